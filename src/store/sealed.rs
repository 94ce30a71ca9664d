//! [`SealedOutcome`]: an outcome a front door encoded for the operation to write in its own
//! transaction, beside its side effect.

use std::{
    sync::{Arc, atomic::AtomicBool},
    time::Duration,
};

use bytes::Bytes;

use super::OwnerToken;
use crate::{fingerprint::Fingerprint, key::RecordKey};

/// An operation's outcome, encoded as its front door stores it, with what a store needs to
/// write it for the operation's own claim: the key, the owner token that fences it, the
/// fingerprint and the retention. Made by
/// [`consumer::seal`](crate::consumer::seal); written in the caller's transaction by a store
/// that shares the caller's database (`PostgresStore::complete_in`), so that the outcome
/// commits with the side effect, or neither does.
#[derive(Debug)]
pub struct SealedOutcome {
    pub(crate) key: RecordKey,
    pub(crate) owner: OwnerToken,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) outcome: Bytes,
    pub(crate) retention: Duration,
    /// Shared with the operation's context: set once a store wrote the outcome in a
    /// transaction, so that the front door does not write it again. (Only a store that
    /// shares the caller's database writes one: without such a store, nothing sets it.)
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) written: Arc<AtomicBool>,
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

    /// How long the outcome is kept.
    #[must_use]
    pub fn retention(&self) -> Duration {
        self.retention
    }

    /// Tells the front door that the outcome was written in the operation's transaction.
    #[cfg(feature = "postgres")]
    pub(crate) fn mark_written(&self) {
        self.written.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}
