//! [`Admin`]: what an operator sees of one record and does to it, on every store of the crate:
//! [`inspect`](Admin::inspect), [`forget`](Admin::forget), and the bounded listing of
//! [`abandoned`](Admin::abandoned) claims.

use std::{future::Future, time::Duration};

use bytes::Bytes;

use super::{Store, StoreError};
use crate::{fingerprint::Fingerprint, key::RecordKey};

/// An operator's handle on single records: support answering "what happened to this request
/// with key K?", letting a client run it again, and finding the claims nobody came back for.
/// [`MemoryStore`](super::MemoryStore), [`RedisStore`](super::RedisStore) (standalone and
/// Cluster), [`PostgresStore`](super::PostgresStore), [`CachingStore`](super::CachingStore) and
/// [`RegionalStore`](super::RegionalStore) implement it. The front doors' `inspect`, `forget` and `abandoned` take a scope and a client's
/// key instead of a [`RecordKey`], and decrypt what the door encrypted.
///
/// None of it is on a request's path: each call is one round trip, except the Redis listing,
/// which scans the keyspace.
///
#[doc = include_str!("../docs/admin.md")]
pub trait Admin: Store {
    /// What the store holds under `key`, if anything: its state, its time left, its size, and
    /// whether a duplicate waits for it; the stored outcome, as the store holds it, only when
    /// `with_outcome`. An abandoned claim's marker is no record.
    fn inspect(
        &self,
        key: &RecordKey,
        with_outcome: bool,
    ) -> impl Future<Output = Result<Option<Inspection>, StoreError>> + Send;

    /// Deletes the record under `key`, so that the client's next retry runs as new: a
    /// completed record, or an in-progress one whose lease lapsed. One whose lease runs is
    /// refused ([`Forgotten::Running`]) unless `force`: its operation may be running now, and
    /// a retry would run it a second time beside it. Whoever waits for the record is woken. A
    /// forced-out operation that finishes before any retry claims the key stores its outcome
    /// as the one answer, as one whose lease lapsed does.
    fn forget(
        &self,
        key: &RecordKey,
        force: bool,
    ) -> impl Future<Output = Result<Forgotten, StoreError>> + Send;

    /// The in-progress records whose lease lapsed at least `lapsed_for` ago and that no claim
    /// took over since (a holder that died or stalled, a client that never came back), oldest
    /// lapse first, at most `limit`.
    fn abandoned(
        &self,
        lapsed_for: Duration,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<AbandonedClaim>, StoreError>> + Send;
}

/// What [`Admin::inspect`] found under a key.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Inspection {
    /// Running, lapsed, or completed.
    pub state: RecordStatus,
    /// How long the record is kept from now: a completed record's retention left; an
    /// in-progress one's lease and recovery window left.
    pub time_left: Duration,
    /// The stored outcome's size in bytes, as the store holds it (encrypted, when the door
    /// encrypts); 0 in progress.
    pub size: usize,
    /// Whether a duplicate marked the record as waited for, so that its settle wakes it.
    pub waited_for: bool,
    /// The fingerprint of the request that made the record.
    pub fingerprint: Fingerprint,
    /// The stored outcome, as the store holds it: only when asked for.
    pub outcome: Option<Bytes>,
}

/// What a front door's `inspect` found under a client's key (`layer::Operator::inspect`,
/// `consumer::Operator::inspect`): the store's [`Inspection`], and what the door reads in the outcome,
/// decrypted when it encrypts at rest.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct KeyReport<T> {
    /// The record's name in the store, as the logs and the operation's context name it.
    pub key_hash: String,
    /// What the store holds; its `outcome` is never set here (see [`outcome`](Self::outcome)).
    pub record: Inspection,
    /// How long ago the outcome was stored, by the clock of the instance that stored it;
    /// `None` in progress (a record does not keep when it was claimed), and for a record an
    /// earlier version wrote without its time.
    pub completed_ago: Option<Duration>,
    /// The stored outcome as the door replays it: only when asked for.
    pub outcome: Option<T>,
}

/// The state of an inspected record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordStatus {
    /// Claimed, its lease running: the operation may be running now.
    Running {
        /// Time left on the lease, by the store's clock.
        lease_left: Duration,
    },
    /// Claimed, its lease lapsed: the holder died or stalled. The next claim with the same
    /// fingerprint takes it over.
    Lapsed {
        /// How long ago the lease lapsed, by the store's clock.
        lapsed_for: Duration,
    },
    /// Completed: its outcome is replayed.
    Completed,
}

/// What [`Admin::forget`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Forgotten {
    /// The record was deleted: the next request with the key runs as new.
    Deleted,
    /// Nothing was under the key.
    Absent,
    /// Refused: the record is in progress and its lease runs. Nothing was deleted; `force`
    /// deletes it.
    Running,
}

/// An in-progress record whose lease lapsed and that no claim took over since: its holder died
/// or stalled, and its client has not come back (yet). [`Admin::abandoned`] and
/// [`PostgresStore::abandoned_claims`](super::PostgresStore::abandoned_claims) list it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AbandonedClaim {
    /// The record's key (its [`hash`](RecordKey::hash) is what the operation's context
    /// called `key_hash`, and what its outbox row is keyed by).
    pub key: RecordKey,
    /// The fingerprint of the request that claimed it: a takeover must bring the same.
    pub fingerprint: Fingerprint,
    /// How long ago its lease lapsed, by the store's clock.
    pub lapsed_for: Duration,
}

impl AbandonedClaim {
    pub(crate) fn new(key: RecordKey, fingerprint: Fingerprint, lapsed_for: Duration) -> Self {
        Self { key, fingerprint, lapsed_for }
    }
}

/// The state of an in-progress record whose lease ends `lease_left_ms` from now (negative:
/// lapsed that long ago), by the store's clock.
pub(crate) fn in_progress(lease_left_ms: i64) -> RecordStatus {
    let millis = Duration::from_millis(lease_left_ms.unsigned_abs());
    match lease_left_ms > 0 {
        true => RecordStatus::Running { lease_left: millis },
        false => RecordStatus::Lapsed { lapsed_for: millis },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_ending_now_has_lapsed_as_a_claim_sees_it() {
        let ms = Duration::from_millis;
        assert_eq!(in_progress(1), RecordStatus::Running { lease_left: ms(1) });
        assert_eq!(in_progress(0), RecordStatus::Lapsed { lapsed_for: ms(0) });
        assert_eq!(in_progress(-250), RecordStatus::Lapsed { lapsed_for: ms(250) });
        assert_eq!(in_progress(i64::MIN), RecordStatus::Lapsed { lapsed_for: ms(1 << 63) });
    }
}
