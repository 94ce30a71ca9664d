//! The transactional path's door-neutral parts: [`Committable`] (what an operation run in a
//! store-owned transaction returns), [`TransactionError`], and the slot through which the
//! store tells the claim's holder and its front door what became of the commit.

// Only a store that shares the caller's database runs a transaction (`PostgresStore`): without
// it, the transaction's states are never entered.
#![cfg_attr(not(feature = "postgres"), allow(dead_code))]

use std::{fmt, future::Future, time::Duration};

use bytes::Bytes;

use super::{OwnerToken, StoreError};
use crate::{context::IdempotencyContext, fingerprint::Fingerprint, key::RecordKey};

/// What an operation run in a store's transaction returns (`PostgresStore::transaction`,
/// `DurableOutcomes::transaction`): its outcome, which the store encodes as the operation's
/// front door stores it and writes in the same transaction as the side effect.
///
/// Implemented for `axum::response::Response` (the HTTP door: the response as the layer
/// stores it, checked by the layer's store policy and limits) and for `axum::Json<T>` (the
/// consumer door: the value `T` as it stores results; the HTTP door: a 200 JSON response).
/// The context the outcome is committed for names the door; a response committed for the
/// consumer door is refused ([`TransactionError::NotStored`]).
pub trait Committable: Sized + Send + 'static {
    /// The outcome as the context's front door stores it, and the value to hand back to the
    /// operation's caller (the same outcome).
    #[doc(hidden)]
    fn encode(
        self,
        context: &IdempotencyContext,
    ) -> impl Future<Output = Result<(Bytes, Self), EncodeError>> + Send;
}

/// Why a store's transaction ([`PostgresStore::transaction`](crate::store::PostgresStore),
/// [`DurableOutcomes::transaction`](crate::durable::DurableOutcomes)) did not commit, or does not
/// know whether it did. Every variant but [`CommitUnknown`](Self::CommitUnknown) means the
/// transaction was rolled back: neither the side effect nor the outcome was written.
///
/// Answer it as the operation's failure. Do not run the transaction again with the same
/// context after [`CommitUnknown`](Self::CommitUnknown): the store refuses it
/// ([`Misuse`](Self::Misuse)), since the first may have committed. The next claim of the key
/// finds the truth: the committed outcome, replayed, or nothing, and the operation runs.
#[derive(Debug)]
#[non_exhaustive]
pub enum TransactionError<E> {
    /// The operation returned this error: rolled back.
    Operation(E),
    /// The store refused or failed before the commit (it could not begin the transaction, the
    /// database failed, or [`StoreError::FencedOut`]: the context's claim is not this store's
    /// live claim, because its lease was taken over or it was claimed in another store):
    /// rolled back.
    Store(StoreError),
    /// The front door does not store this outcome (a response its store policy does not
    /// keep or marked `layer::ReleaseKey`, a response over the stored limits, a value serde
    /// cannot encode, a response committed for the consumer door): rolled back, its side
    /// effect with it (committed with its key released, it would run again on the retry).
    /// Why, as a sentence ("the outcome is not stored: the store policy does not keep it").
    NotStored(String),
    /// The commit was sent, and its answer was lost (the connection broke, or the command
    /// timeout ran out): the transaction committed, or not. Nothing is retried; the key stays
    /// with the claim until the database settles the transaction, and the next claim
    /// answers from what committed.
    CommitUnknown(StoreError),
    /// The call was refused before anything was written: the context is not one a front door
    /// gave to an operation it runs, or this claim's transaction committed already, is
    /// running (a nested call), or ended with its fate unknown. The reason.
    Misuse(&'static str),
}

impl<E> TransactionError<E> {
    /// Whether the transaction may have committed: only
    /// [`CommitUnknown`](Self::CommitUnknown).
    #[must_use]
    pub fn may_have_committed(&self) -> bool {
        matches!(self, Self::CommitUnknown(_))
    }
}

/// A [`TransactionError`] as every front door answers it: the handler's fault (never retried
/// by the client to any effect) or the store's (the retry learns what committed).
#[derive(Debug)]
pub(crate) enum Failure {
    /// The operation's own error (never shown: `None`), an outcome the door does not store or
    /// a misuse: the reason.
    Handler(Option<String>),
    /// Rolled back by the store, or the commit's answer lost: what to tell the client.
    Store(String),
}

impl<E: fmt::Display> TransactionError<E> {
    /// Logs it, once, and says how a door answers it.
    pub(crate) fn failure(self) -> Failure {
        match self {
            Self::Operation(error) => {
                tracing::error!(%error, "idempotency: the handler's transaction failed");
                Failure::Handler(None)
            }
            Self::Store(error) => {
                tracing::error!(%error, "idempotency: the handler's transaction was rolled back");
                Failure::Store(format!("rolled back: {error}"))
            }
            Self::CommitUnknown(error) => {
                tracing::error!(%error, "idempotency: the commit's answer was lost");
                Failure::Store("the commit's answer was lost: retry to learn its outcome".into())
            }
            Self::NotStored(reason) => {
                tracing::error!(reason, "idempotency: the handler's outcome is not stored");
                Failure::Handler(Some(reason))
            }
            Self::Misuse(reason) => {
                tracing::error!(reason, "idempotency: the handler's transaction was refused");
                Failure::Handler(Some(reason.to_owned()))
            }
        }
    }
}

impl<E: fmt::Display> fmt::Display for TransactionError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Operation(error) => write!(f, "the operation failed: {error}"),
            Self::Store(error) => write!(f, "rolled back: {error}"),
            Self::NotStored(reason) => write!(f, "rolled back: {reason}"),
            Self::CommitUnknown(error) => {
                write!(f, "the commit's answer was lost, it may have committed: {error}")
            }
            Self::Misuse(reason) => write!(f, "refused: {reason}"),
        }
    }
}

/// An error whatever the operation's error type (`Box<dyn Error + Send + Sync>` included, which
/// is no `Error` itself), so that `?` carries it on; the store's error is its source.
impl<E: fmt::Debug + fmt::Display> std::error::Error for TransactionError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Store(error) | Self::CommitUnknown(error) => Some(error),
            Self::Operation(_) | Self::NotStored(_) | Self::Misuse(_) => None,
        }
    }
}

/// An operation's outcome, encoded as its front door stores it, with what a store needs to
/// write it for the operation's own claim: the key, the owner token that fences it, the
/// fingerprint and the retention. Made by the store's transaction, never by a caller.
pub(crate) struct EncodedOutcome {
    pub(crate) key: RecordKey,
    pub(crate) owner: OwnerToken,
    pub(crate) fingerprint: Fingerprint,
    /// The outcome in clear, as the door answers it.
    pub(crate) outcome: Bytes,
    /// The outcome as the store keeps it: encrypted when the door encrypts at rest.
    pub(crate) stored: Bytes,
    pub(crate) retention: Duration,
}

impl fmt::Debug for EncodedOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EncodedOutcome")
            .field("key_hash", &self.key.hash())
            .field("outcome_len", &self.outcome.len())
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}

/// Why a front door made no stored outcome of a value.
#[derive(Debug)]
#[non_exhaustive]
pub enum EncodeError {
    /// serde could not encode the value, or it holds NaN or an infinity (which JSON would
    /// store as `null`): the reason.
    Unencodable(String),
    /// The front door does not store this outcome (the HTTP door: a status its store policy
    /// does not keep, a 405, or headers or a body over the stored limits; the body failed;
    /// the consumer door: a response): the reason.
    NotStored(&'static str),
    /// The context is not one a front door gave to an operation it runs.
    NotClaimed,
}

impl fmt::Display for EncodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unencodable(reason) => write!(f, "the result cannot be stored: {reason}"),
            Self::NotStored(reason) => write!(f, "the outcome is not stored: {reason}"),
            Self::NotClaimed => f.write_str("the context is not one a front door gave"),
        }
    }
}

impl std::error::Error for EncodeError {}

mod slot;
#[cfg(test)]
mod tests;

#[cfg(feature = "postgres")]
pub(crate) use self::slot::Running;
pub(crate) use self::slot::{Commit, CommitSlot};
