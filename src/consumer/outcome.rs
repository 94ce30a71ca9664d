//! What [`Idempotent::run`](super::Idempotent::run) answers.

use std::{fmt, time::Duration};

use crate::store::StoreError;

/// What became of one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome<T> {
    /// The operation ran now, and this is its result (stored for replay).
    Ran(T),
    /// The operation ran before, for this key and payload: its stored result.
    Replayed(T),
    /// Another delivery of the same payload is running it; ask again after `retry_after`.
    InProgress {
        /// A short hint ([`Waiting::retry_after`](crate::settings::Waiting::retry_after), 1 s by
        /// default), never past the running delivery's lease.
        retry_after: Duration,
    },
    /// The key was used with a different payload.
    Mismatch,
}

impl<T> Outcome<T> {
    /// The result, ran now or replayed; `None` for [`InProgress`](Self::InProgress) and
    /// [`Mismatch`](Self::Mismatch).
    pub fn into_result(self) -> Option<T> {
        match self {
            Self::Ran(value) | Self::Replayed(value) => Some(value),
            Self::InProgress { .. } | Self::Mismatch => None,
        }
    }
}

/// Why [`Idempotent::run`](super::Idempotent::run) has no outcome.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error<E> {
    /// The operation failed. Its key was released, so a redelivery runs it again.
    Operation(E),
    /// The store could not be reached, did not answer, or holds a value this crate did not
    /// write under the key. The operation did not run.
    Store(StoreError),
    /// The stored record cannot be read: its result does not deserialize into the result type
    /// (it changed between deploys), or the record was written by something else, tampered
    /// with, or sealed under a key the keyring no longer lists. The operation did not run;
    /// redelivering the event will not help.
    Corrupt {
        /// The record's key hash, as the logs show it.
        key_hash: String,
        /// What the decoder said.
        reason: String,
    },
    /// The operation ran on an earlier delivery, but its result could not be stored: serde
    /// could not encode it (a map with non-string keys, a `Serialize` that fails), or it held
    /// a float JSON cannot (NaN, ±inf). It cannot be replayed, and the operation does not run
    /// again: ack the delivery, and look at the first run's logs.
    ResultNotStored {
        /// The record's key hash, as the logs show it.
        key_hash: String,
        /// Why the result could not be encoded.
        reason: String,
    },
    /// The event id (the key) is empty: every event without an id would share one record.
    /// Nothing ran and nothing was written.
    EmptyKey,
    /// The operation's work ended without an answer: it panicked outside the operation
    /// (whose own panic is resumed in the caller). Nothing is stored; the claim is left to its
    /// lease.
    Cancelled,
    /// The delivery took over a lapsed claim and the recovery hook failed (an error, a panic,
    /// or no answer within the recovery timeout): the operation did not run. A redelivery
    /// takes over again and asks again.
    Recovery,
}

impl<E: fmt::Display> fmt::Display for Error<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Operation(error) => write!(f, "the operation failed: {error}"),
            Self::Store(error) => write!(f, "idempotency store: {error}"),
            Self::Corrupt { key_hash, reason } => {
                write!(f, "the stored result under key hash {key_hash} is unreadable: {reason}")
            }
            Self::ResultNotStored { key_hash, reason } => write!(
                f,
                "the operation under key hash {key_hash} ran before, but its result could not be stored: {reason}"
            ),
            Self::EmptyKey => f.write_str("the key (event id) is empty"),
            Self::Cancelled => f.write_str("the operation's work ended without an answer"),
            Self::Recovery => f.write_str("the recovery hook failed; the operation did not run"),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for Error<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Operation(error) => Some(error),
            Self::Store(error) => Some(error),
            Self::Corrupt { .. }
            | Self::ResultNotStored { .. }
            | Self::EmptyKey
            | Self::Cancelled
            | Self::Recovery => None,
        }
    }
}
