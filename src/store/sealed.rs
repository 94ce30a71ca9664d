//! [`SealedOutcome`]: an outcome a front door encoded for the operation to commit in its own
//! transaction, beside its side effect; what became of that commit; and [`SealError`].

use std::{
    fmt,
    sync::{
        Arc, OnceLock,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;

use super::OwnerToken;
use crate::{fingerprint::Fingerprint, key::RecordKey};

/// An operation's outcome, encoded as its front door stores it, with what a store needs to
/// write it for the operation's own claim: the key, the owner token that fences it, the
/// fingerprint and the retention. Made by [`consumer::seal`](crate::consumer::seal) and
/// [`http::seal`](crate::http::seal); committed in the caller's transaction by a store that
/// shares the caller's database (`PostgresStore::commit`), so that the outcome commits with
/// the side effect, or neither does.
///
/// Its `Debug` output names the key's hash and the outcome's length, never the outcome.
pub struct SealedOutcome {
    pub(crate) key: RecordKey,
    pub(crate) owner: OwnerToken,
    pub(crate) fingerprint: Fingerprint,
    /// The outcome in clear, as the door answers it.
    pub(crate) outcome: Bytes,
    /// The outcome as the store keeps it: encrypted when the door encrypts at rest.
    pub(crate) stored: Bytes,
    pub(crate) retention: Duration,
    /// Shared with the claim's holder and the operation's context: what became of the commit.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) commit: Arc<CommitSlot>,
}

/// What became of an outcome committed in the operation's own transaction, shared by the
/// store that commits it, the claim's holder (whose lease renewal then stops quietly: the
/// record it finds settled was settled by its own operation) and the front door.
#[derive(Debug, Default)]
pub(crate) struct CommitSlot {
    /// A commit began: from here, a renewal that finds the record settled is not a lost lease.
    begun: AtomicBool,
    outcome: OnceLock<Commit>,
}

impl CommitSlot {
    /// Whether the operation began to commit its outcome.
    pub(crate) fn begun(&self) -> bool {
        self.begun.load(Ordering::SeqCst)
    }

    /// What became of the commit, once it ended.
    pub(crate) fn outcome(&self) -> Option<&Commit> {
        self.outcome.get()
    }

    /// Says that a commit begins: before the store writes the outcome.
    #[cfg_attr(not(any(feature = "postgres", test)), allow(dead_code))]
    pub(crate) fn begin(&self) {
        self.begun.store(true, Ordering::SeqCst);
    }
}

/// What became of the transaction an operation committed its sealed outcome in, as its front
/// door learns it. Set once, by the store's commit. (Only a store that shares the caller's
/// database commits one: without such a store, nothing makes it.)
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
pub(crate) enum Commit {
    /// The transaction committed, and the record holds this outcome (the record store shares
    /// the caller's database: `PostgresStore`). The door writes nothing.
    Committed(Bytes),
    /// The transaction committed this outcome to a durable table beside the record store
    /// (`DurableOutcomes`, beside Redis): the door stores it in the record store too, as the
    /// outcome it answers, and a takeover or a lost record is answered from the table.
    CommittedBeside(Bytes),
    /// The commit failed, was fenced out, or its answer was lost: the outcome is committed or
    /// not. The door writes nothing either: it releases its claim with a fenced delete. With
    /// `PostgresStore` that delete waits for the transaction's row lock, and a committed
    /// record refuses it; with `DurableOutcomes` the retry's recovery reads the table, and a
    /// second run's commit is refused by the table's key while the first's stands.
    NotCommitted,
}

impl SealedOutcome {
    /// The record's key.
    #[must_use]
    pub fn key(&self) -> &RecordKey {
        &self.key
    }

    /// The token of the claim this outcome settles: the write is fenced by it.
    #[must_use]
    pub fn owner(&self) -> &OwnerToken {
        &self.owner
    }

    /// The fingerprint the record keeps.
    #[must_use]
    pub fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }

    /// The stored outcome, as the front door replays it.
    #[must_use]
    pub fn outcome(&self) -> &Bytes {
        &self.outcome
    }

    /// The outcome as the store keeps it: [`outcome`](Self::outcome), encrypted when the front
    /// door encrypts at rest.
    #[must_use]
    pub fn stored(&self) -> &Bytes {
        &self.stored
    }

    /// How long the outcome is kept.
    #[must_use]
    pub fn retention(&self) -> Duration {
        self.retention
    }

    /// Says that a commit of this outcome begins: before the store writes it.
    #[cfg(feature = "postgres")]
    pub(crate) fn begin(&self) {
        self.commit.begin();
    }

    /// Tells the front door what became of the commit. The first word stands: an operation
    /// that commits twice learns from the second commit's error.
    #[cfg(feature = "postgres")]
    pub(crate) fn settle(&self, commit: Commit) {
        let _ = self.commit.outcome.set(commit);
    }
}

impl AsRef<SealedOutcome> for SealedOutcome {
    fn as_ref(&self) -> &SealedOutcome {
        self
    }
}

impl fmt::Debug for SealedOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SealedOutcome")
            .field("key_hash", &self.key.hash())
            .field("outcome_len", &self.outcome.len())
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}

/// Why a front door's `seal` made no outcome.
#[derive(Debug)]
#[non_exhaustive]
pub enum SealError {
    /// serde could not encode the value, or it holds NaN or an infinity (which JSON would
    /// store as `null`): the reason.
    Unencodable(String),
    /// The front door does not store this outcome (the HTTP door: a status its store policy
    /// does not keep, a 405, or headers or a body over the stored limits; the body failed):
    /// the reason. Answer it without sealing it; the key is released as for any such answer.
    NotStored(&'static str),
    /// The context is not one a front door gave to an operation it runs.
    NotClaimed,
}

impl fmt::Display for SealError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unencodable(reason) => write!(f, "the result cannot be stored: {reason}"),
            Self::NotStored(reason) => write!(f, "the outcome is not stored: {reason}"),
            Self::NotClaimed => f.write_str("the context is not one a front door gave"),
        }
    }
}

impl std::error::Error for SealError {}
