//! Where idempotency records live: the [`Store`] trait and its implementations ([`MemoryStore`],
//! [`RedisStore`], `PostgresStore`, [`CachingStore`], [`RegionalStore`], each passing one
//! behaviour suite); beside
//! it, the operator's calls ([`Admin`]) and the `dedup` door's ([`DedupStore`]).
//!
//! A record moves through three transitions, each one atomic in the store:
//!
//! - [`Store::claim`]: an absent key becomes *in progress* under a fresh owner token and a
//!   lease; a present key reports what holds it ([`Claim`]). A claim whose lease lapsed is
//!   remembered for the lease's recovery window: a claim in that window takes it over
//!   ([`Claim::TakenOver`]), so that the new owner knows to ask its system of record first.
//! - [`Store::complete`]: the owner stores the encoded response for the retention period.
//! - [`Store::release`]: the owner deletes the record so that a retry can run.
//!
//! plus [`Store::touch`], which renews the owner's lease while a long handler runs.
//! `complete`, `release` and `touch` are *fenced* by the owner token: a holder whose lease
//! lapsed, and whose key was then claimed by another request, cannot overwrite or delete the
//! new owner's record.

mod admin;
mod caching;
#[cfg(any(feature = "redis", feature = "postgres"))]
mod clock;
mod dedup;
mod error;
mod memory;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "redis")]
mod redis;
mod regional;
mod subscription;
pub(crate) mod transaction;

use std::{fmt, future::Future, time::Duration};

use bytes::Bytes;

pub use self::admin::{AbandonedClaim, Admin, Forgotten, Inspection, KeyReport, RecordStatus};
pub use self::caching::{CachingStore, DEFAULT_CACHE_AGE, DEFAULT_CACHE_BYTES};
pub use self::dedup::{BucketBatch, DedupStore, FilterBatch};
pub use self::error::StoreError;
pub use self::memory::{DEFAULT_CAPACITY, MemoryStore, RecordState};
#[cfg(feature = "postgres")]
pub use self::postgres::{LapsedClaims, PostgresStore, TableNameError};
#[cfg(feature = "redis")]
pub use self::redis::RedisStore;
#[cfg(feature = "cluster")]
pub use self::redis::{ClusterConfigError, ClusterManager, ClusterPool};
pub use self::regional::{HashedHome, HomeRegion, RegionalStore, RegionsMoveError};
pub use self::subscription::{OnLastLeave, Subscription, Waiters};
#[cfg(feature = "postgres")]
pub(crate) use self::transaction::Running;
pub(crate) use self::transaction::{Commit, CommitSlot, EncodedOutcome};
pub use self::transaction::{Committable, EncodeError, TransactionError};
pub use crate::key::RecordKey;
use crate::{fingerprint::Fingerprint, hashing::Deploy};
/// The deadpool-redis this crate builds on, for [`RedisStore::new`]'s pool.
#[cfg(feature = "redis")]
pub use deadpool_redis;
/// The sqlx this crate builds on, for [`PostgresStore::new`]'s pool.
#[cfg(feature = "postgres")]
pub use sqlx;

/// Storage for idempotency records.
///
/// Implementations must make each method atomic for its key. Records are opaque to the store:
/// the fingerprint is compared byte for byte and the response is kept as the bytes it was given.
pub trait Store: Clone + Send + Sync + 'static {
    /// Claims `key` for a request with `fingerprint`, or reports what holds it.
    ///
    /// An absent key (never written, expired, or released) is claimed for `owner`: its lease
    /// ends after `lease.duration` unless completed, released or touched, and the record is
    /// kept for `lease.recovery_window` after that. A claim with the same fingerprint in that
    /// window takes the lapsed claim over for `owner` ([`Claim::TakenOver`]); the lapsed
    /// holder is fenced out from then on. The caller draws `owner` before the call, so that it
    /// can release a claim whose answer it never saw.
    fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send;

    /// Stores `response` under `key` for `retention`, if `owner` still holds the key or the key
    /// is absent. Returns [`Fenced::Rejected`] when another owner or another stored response
    /// holds it; [`Fenced::Applied`] also when the key already holds this very response for
    /// `fingerprint` (an earlier attempt of this complete landed, though its answer was lost).
    fn complete(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        fingerprint: &Fingerprint,
        response: Bytes,
        retention: Duration,
    ) -> impl Future<Output = Result<Fenced, StoreError>> + Send;

    /// Deletes the record under `key` if `owner` still holds it.
    fn release(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
    ) -> impl Future<Output = Result<Fenced, StoreError>> + Send;

    /// Like [`claim`](Self::claim), and when a request with the same fingerprint is in
    /// progress, also marks its record as waited for, so that its settle notifies the
    /// [`subscribe`](Self::subscribe)rs. A store that cannot notify keeps the default: `claim`.
    fn claim_waiting(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send {
        self.claim(key, fingerprint, owner, lease)
    }

    /// Subscribes to the next settle (complete or release) of the record under `key`.
    ///
    /// A waiter subscribes first, then claims with [`claim_waiting`](Self::claim_waiting),
    /// then waits: a settle between its claims cannot be missed. The default never notifies
    /// ([`Subscription::unsupported`]): waiters then wait out their deadline.
    fn subscribe(&self, key: &RecordKey) -> impl Future<Output = Subscription> + Send {
        let _ = key;
        std::future::ready(Subscription::unsupported())
    }

    /// Settles a claim whose answer its caller never saw (the call timed out, or the caller
    /// went away while it was on the wire): the claim may have landed, may still land, or
    /// never will. Whatever the caller's claim was, a plain claim or a takeover, nothing
    /// known about the key may be lost: an operation taken over may have happened.
    ///
    /// - If `owner` holds the key, its lease ends now: with a `lease.recovery_window` the
    ///   record is kept for that window, so that the next claim takes it over and asks the
    ///   system of record; without one, the record is deleted.
    /// - If the key is absent, a store whose claims can land late (a command in a socket
    ///   buffer of a paused server) leaves a marker, for `lease.duration`, under which that
    ///   claim of `owner` is refused ([`StoreError::ClaimAbandoned`]); every other claim
    ///   sees the key as absent.
    ///
    /// [`Fenced::Applied`] when the key was the caller's or was marked; [`Fenced::Rejected`]
    /// when another owner or a stored response holds it.
    ///
    /// The default, for a store whose claims cannot land late, ends the lease with
    /// [`touch`](Self::touch) (a zero `lease.duration`), or [`release`](Self::release)s
    /// without a window.
    fn abandon(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        fingerprint: &Fingerprint,
        lease: Lease,
    ) -> impl Future<Output = Result<Fenced, StoreError>> + Send {
        let _ = fingerprint;
        async move {
            if lease.recovery_window.is_zero() {
                self.release(key, owner).await
            } else {
                let ended = Lease::new(Duration::ZERO).recovery_window(lease.recovery_window);
                self.touch(key, owner, ended).await
            }
        }
    }

    /// Whether an operation may commit its outcome in a transaction of this store
    /// (`PostgresStore::transaction`): its door then waits, before it settles, for a
    /// transaction the operation spawned and for the clones of its context (see
    /// [`IdempotencyContext`](crate::IdempotencyContext)). `false` by default; a store that
    /// wraps another answers as the other does.
    #[doc(hidden)]
    fn commits_in_transactions(&self) -> bool {
        false
    }

    /// Where the store keeps its records, for the fleet's registry ([`crate::hashing`]): an
    /// id of its placement (a `RegionalStore`'s region list and rule) and, during a move
    /// between two, the id moved to and this build's deploy. `None` (the default) for a store
    /// with one place; a store that wraps another answers as the other does.
    #[doc(hidden)]
    fn placement(&self) -> Option<(String, Option<(String, Deploy)>)> {
        None
    }

    /// During a move between two placements of its own, this build's deploy when `key`'s
    /// placement changes (its home region does): the engine then claims it in both, as during
    /// a move between namings. `None` by default; a store that wraps another answers as the
    /// other does.
    #[doc(hidden)]
    fn moves(&self, key: &RecordKey) -> Option<Deploy> {
        let _ = key;
        None
    }

    /// Records under `registry` that an instance holds each of `entries`, each until its own
    /// duration from now by the store's clock (never shortening an entry another instance
    /// announced for longer), forgets the entries past their time, and answers every entry
    /// left, its own among them: how a door learns which namings its fleet serves, and
    /// refuses to run beside an instance whose records it could not see (see
    /// [`crate::hashing`]). Called when a door first claims, then every third of its lease (one to ten seconds).
    ///
    /// The default answers `None`: a store that keeps no registry. Its doors then check
    /// nothing, and say so once in a warning; a store of your own keeps one as the crate's do
    /// (the conformance kit checks it).
    fn announce(
        &self,
        registry: &RecordKey,
        entries: &[(String, Duration)],
    ) -> impl Future<Output = Result<Option<Vec<String>>, StoreError>> + Send {
        let _ = (registry, entries);
        async { Ok(None) }
    }

    /// Renews the lease of the record under `key` to `lease` if `owner` still holds it. A
    /// zero `lease.duration` ends the lease now and keeps the record for its recovery window:
    /// the next claim takes it over.
    fn touch(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        lease: Lease,
    ) -> impl Future<Output = Result<Fenced, StoreError>> + Send;
}

/// How long a claim holds its key, and how long a lapsed claim is remembered after.
///
/// ```
/// use std::time::Duration;
/// use axum_idempotency::store::Lease;
///
/// let lease = Lease::new(Duration::from_secs(30)).recovery_window(Duration::from_secs(3600));
/// assert_eq!(lease.duration, Duration::from_secs(30));
/// assert_eq!(Lease::from(Duration::from_secs(30)).recovery_window, Duration::ZERO);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// How long the claim holds its key without renewal.
    pub duration: Duration,
    /// How long an in-progress record outlives its lapsed lease, so that the next claim
    /// knows it takes over from a holder that may have died mid-operation. Zero: the record
    /// expires with its lease, and the next claim is a plain [`Claim::Claimed`].
    pub recovery_window: Duration,
}

impl Lease {
    /// A lease of `duration`, without a recovery window.
    #[must_use]
    pub const fn new(duration: Duration) -> Self {
        Self { duration, recovery_window: Duration::ZERO }
    }

    /// Sets the recovery window.
    #[must_use]
    pub const fn recovery_window(mut self, window: Duration) -> Self {
        self.recovery_window = window;
        self
    }
}

impl From<Duration> for Lease {
    fn from(duration: Duration) -> Self {
        Self::new(duration)
    }
}

/// `at + by`, saturating about 30 years on: a configured duration as long as `Duration::MAX`
/// means "keep it" (or "no bound"), never a panic.
pub(crate) fn later(at: std::time::Instant, by: Duration) -> std::time::Instant {
    const FAR: Duration = Duration::from_secs(30 * 365 * 24 * 60 * 60);
    // 30 years past any instant of a running process fits every platform's `Instant`.
    at.checked_add(by.min(FAR)).unwrap_or(at)
}

/// What [`Store::claim`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Claim {
    /// The key was absent and now belongs to the caller's owner token.
    Claimed,
    /// The key held a claim with the same fingerprint whose lease lapsed (its holder died, or
    /// is too slow), within its recovery window: it now belongs to the caller's owner token.
    /// The operation may have happened: ask the system of record before running it again.
    TakenOver,
    /// A request with the same fingerprint completed; here is its encoded response.
    Replay {
        /// The response, as [`Store::complete`] was given it.
        response: Bytes,
        /// Time left of the record's retention, by the store's clock: how long a copy of it
        /// may be kept (see [`CachingStore`]).
        remaining: Duration,
    },
    /// A request with the same fingerprint is still running; its lease ends in `remaining`.
    InProgress {
        /// Time left on the holder's lease, by the store's clock.
        remaining: Duration,
    },
    /// The key is held by a request with a different fingerprint.
    Mismatch,
}

/// The answer of a fenced write: [`Store::complete`], [`Store::release`], [`Store::touch`],
/// [`Store::abandon`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fenced {
    /// The caller held the key and the write was applied.
    Applied,
    /// Another owner or a stored response holds the key; nothing was written.
    Rejected,
}

/// The random token that proves ownership of a claimed key.
#[derive(Clone, PartialEq, Eq)]
pub struct OwnerToken([u8; 16]);

impl OwnerToken {
    /// A fresh random token.
    #[must_use]
    pub fn random() -> Self {
        Self(rand::random())
    }

    /// The token's bytes, as written to the store.
    #[must_use]
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for OwnerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // A token is a capability over the record; keep it out of logs.
        f.write_str("OwnerToken(..)")
    }
}

#[cfg(test)]
mod tests;
