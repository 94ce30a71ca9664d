//! [`Dedup`]: "first time seen?" for high-volume streams (clicks, impressions, telemetry,
//! projections) that need no stored result: a third front door, on the record store's
//! connections ([`DedupStore`]).
//!
//! The capacity math decides the strategy: what is kept is events per second × window. 50,000
//! events a second over one hour is 180 million events:
//!
//! - [`Strategy::Markers`]: one key per event (`SET NX PX`), exact, one round trip; the most
//!   memory (a Redis key each).
//! - [`Strategy::Buckets`]: event ids as 16-byte members of one set per window-long bucket and
//!   shard, exact (but for a 128-bit hash collision); far fewer keys.
//! - [`Strategy::Bloom`]: a Bloom filter per bucket and shard, sized for the events a window
//!   brings and a false-positive rate: a bit or two an event, **approximate** (a new event is
//!   now and then taken for a duplicate and dropped; a duplicate is never taken for new).
//!
//! Both bucketed strategies check an event against its own bucket and the ones before and
//! after it, and keep a bucket for three windows and a quarter from its start, so that the next
//! bucket's events read it up to their own horizon: an event is remembered for at least the
//! window, and forgotten within four. Between instances whose
//! clocks differ by δ (under a window), a duplicate reaching the one behind is still caught
//! (the bucket after is checked), and one reaching the one ahead is caught within the window
//! less δ; an instance's clock more than a quarter window off the store's shortens that. A
//! page of events (a broker's batch) is one script per shard.
//!
//! **Never use a deduplication door for a payment, an order or a security event**: it stores
//! no outcome, and a record lost (an eviction, a restart without persistence) lets the event
//! through again. Those go through [`Idempotent`](crate::Idempotent) and
//! [`IdempotencyLayer`](crate::IdempotencyLayer).
//!
//! ```
//! use std::time::Duration;
//! use axum_idempotency::{MemoryStore, dedup::{Dedup, Strategy}};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), axum_idempotency::store::StoreError> {
//! let clicks = Dedup::new(MemoryStore::new(), Strategy::buckets(Duration::from_secs(3600)));
//! assert!(clicks.first_seen("clicks", "evt_1").await?);
//! assert!(!clicks.first_seen("clicks", "evt_1").await?, "a duplicate within the hour");
//! let page = clicks.first_seen_batch("clicks", &["evt_1", "evt_2", "evt_2"]).await?;
//! assert_eq!(page, [false, true, false]);
//! # Ok(()) }
//! ```
//!
#![doc = include_str!("../docs/dedup.md")]

use std::time::{Duration, SystemTime};

use crate::{
    hashing::{Hashing, Names},
    key::RecordKey,
    store::{BucketBatch, DedupStore, FilterBatch, StoreError},
};

use self::events::{Bucket, Events, answers, member, once_each};

mod bloom;
mod events;

/// Sets, or filters, per bucket unless given: enough that one hot bucket is not one Cluster
/// slot.
const SHARDS: u16 = 16;

/// How [`Dedup`] remembers the events it saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Strategy {
    /// One marker per event, kept for `window` from the first sight: exact, one key each.
    Markers {
        /// How long an event is remembered.
        window: Duration,
    },
    /// Event ids in one set per `window`-long bucket, split into `shards` sets by event hash
    /// (so that one hot bucket is not one Cluster slot): exact within the window, far fewer
    /// keys than markers.
    Buckets {
        /// The bucket's length: an event is remembered for at least this long.
        window: Duration,
        /// Sets per bucket, each its own Cluster slot.
        shards: u16,
    },
    /// One Bloom filter per `window`-long bucket and shard: approximate (see
    /// [`Strategy::bloom`]).
    Bloom {
        /// The bucket's length: an event is remembered for at least this long.
        window: Duration,
        /// Filters per bucket, each its own Cluster slot.
        shards: u16,
        /// Each filter's size in bits (at most 2³², what one Redis string holds).
        bits: u64,
        /// The bits one event sets, in each filter.
        hashes: u32,
    },
}

impl Strategy {
    /// Markers kept for `window`.
    #[must_use]
    pub const fn markers(window: Duration) -> Self {
        Self::Markers { window }
    }

    /// Buckets of `window`, in 16 shards.
    #[must_use]
    pub const fn buckets(window: Duration) -> Self {
        Self::Buckets { window, shards: SHARDS }
    }

    /// Bloom filters for buckets of `window`, in 16 shards, sized so that a bucket holding
    /// `events_per_window` answers a new event "seen" with the probability
    /// `false_positive_rate`: `-ln(rate) / (ln 2)²` bits an event (9.6 at 1 %, 14.4 at 0.1 %),
    /// allocated in full for every bucket kept.
    ///
    /// **Approximate.** A new event is dropped as a duplicate now and then. The rate is one
    /// filter's at its design load; a continuous stream sees more, since an event is checked
    /// against the bucket before its own too (1.18 % for a 1 % target, 0.113 % for 0.1 %), and
    /// it grows with the load (see [`false_positive_rate`](Self::false_positive_rate): twice
    /// the events sized for turn one filter's 1 % into 16 %, a stream's into 17.3 %). A
    /// duplicate is never taken for new within the window. A change of window, rate, size or
    /// strategy starts from empty filters (they are keyed apart): see the [module](self),
    /// *Backfills and rolling deploys*.
    ///
    /// # Panics
    ///
    /// When `false_positive_rate` is not strictly between 0 and 1, or a filter would need
    /// more than 2³² bits (split it with more [`Strategy::Bloom::shards`]).
    #[must_use]
    pub fn bloom(window: Duration, events_per_window: u64, false_positive_rate: f64) -> Self {
        assert!(
            false_positive_rate > 0.0 && false_positive_rate < 1.0,
            "a Bloom filter's false-positive rate is strictly between 0 and 1, not {false_positive_rate}"
        );
        let (bits, hashes) =
            bloom::size(events_per_window.div_ceil(u64::from(SHARDS)), false_positive_rate);
        assert!(
            bits <= bloom::MAX_BITS,
            "a Bloom filter of {bits} bits is over the 2^32 one Redis string holds: use more shards"
        );
        Self::Bloom { window, shards: SHARDS, bits, hashes }
    }

    /// The probability that a new event is taken for one seen, when a bucket holds
    /// `events_per_window`: zero for the exact strategies, `(1 - e^(-kn/m))^k` of one filter
    /// for [`Strategy::Bloom`] (an event is checked against its own bucket's filter and the
    /// one before, so the door's rate lies between that of the fuller one and their sum).
    #[must_use]
    pub fn false_positive_rate(&self, events_per_window: u64) -> f64 {
        match *self {
            Self::Markers { .. } | Self::Buckets { .. } => 0.0,
            Self::Bloom { shards, bits, hashes, .. } => {
                bloom::rate(bits, hashes, events_per_window as f64 / f64::from(shards.max(1)))
            }
        }
    }
}

/// Answers "first time seen?" for event ids in a scope (see the [module](self)). Cloning is
/// cheap.
#[derive(Debug, Clone)]
pub struct Dedup<St> {
    store: St,
    strategy: Strategy,
    /// The strategy instances still run during a configuration change: events are checked
    /// against its buckets too.
    previous: Option<Strategy>,
    prefix: String,
    /// How event ids are named in the store: plain or keyed, or both during a move.
    hashing: Hashing,
}

impl<St: DedupStore> Dedup<St> {
    /// A door over `store`, remembering events by `strategy`, under the key prefix `dedup`.
    pub fn new(store: St, strategy: Strategy) -> Self {
        Self {
            store,
            strategy,
            previous: None,
            prefix: "dedup".to_owned(),
            hashing: Hashing::default(),
        }
    }

    /// Names event ids in the store with keyed hashes (HMAC-SHA256 under a secret), so that
    /// what is stored cannot confirm a guessed event id (see [`crate::hashing`]). Plain SHA-256
    /// by default. During a move ([`Hashing::moving_to`], either deploy), an event is new only
    /// if it is new under both namings, and is remembered under both, as against a previous
    /// configuration ([`during_change_from`](Self::during_change_from)). Turning keyed names
    /// on in a running dedup door is one rolling deploy of `Hashing::plain()
    /// .moving_to(Hashing::keyed(secret), Deploy::First)`, then, a window after the last plain
    /// instance stopped, one of `Hashing::keyed(secret)`: with no lease, a dedup door needs no
    /// second deploy.
    #[must_use]
    pub fn hashing(mut self, hashing: Hashing) -> Self {
        self.hashing = hashing;
        self
    }

    /// Keeps deduplicating against `previous`, the strategy this door's instances ran before a
    /// configuration change (another window, rate, size, or kind): an event is new only if it
    /// is new to both, and is remembered by both. A change keys its sets and filters apart,
    /// so without this every event the old configuration saw is answered new once more; set it
    /// on the new configuration for a rolling deploy, and drop it a window after the last
    /// instance of the old configuration stopped. It costs a second check an event meanwhile.
    /// Unset by default.
    #[must_use]
    pub fn during_change_from(mut self, previous: Strategy) -> Self {
        self.previous = (previous != self.strategy).then_some(previous);
        self
    }

    /// Sets the prefix of every key it writes. Defaults to `dedup`.
    #[must_use]
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Whether `id` is seen in `scope` for the first time (within the strategy's window); it
    /// is remembered from now on.
    ///
    /// # Errors
    ///
    /// The store's. The event's fate is then unknown: a call whose answer was lost (a timeout)
    /// may have remembered it, and asked again it is a duplicate. Where losing an event is
    /// worse than counting one twice, take an error as "new" rather than asking again.
    pub async fn first_seen(&self, scope: &str, id: impl AsRef<[u8]>) -> Result<bool, StoreError> {
        let seen = self.first_seen_at(scope, &[id], SystemTime::now()).await?;
        Ok(seen.first().copied().unwrap_or(false))
    }

    /// [`first_seen`](Self::first_seen) for a page of ids (a broker's batch): markers in one
    /// pipelined batch, buckets and filters one script per shard. For each id, in order,
    /// whether it is new. An id twice in the page is new the first time only.
    ///
    /// # Errors
    ///
    /// The store's, for the whole page: as for [`first_seen`](Self::first_seen), part or all
    /// of it may have been remembered.
    pub async fn first_seen_batch(
        &self,
        scope: &str,
        ids: &[impl AsRef<[u8]>],
    ) -> Result<Vec<bool>, StoreError> {
        self.first_seen_at(scope, ids, SystemTime::now()).await
    }

    /// [`first_seen_batch`](Self::first_seen_batch) with the time taken as `at` (the buckets'
    /// time; markers expire by the store's clock): for a replay of a log with its timestamps,
    /// and for tests of the bucket boundaries. A bucket is kept until three windows and a quarter
    /// after its start, so that the next bucket's events read it up to their own horizon: a
    /// time whose window reads a bucket that has expired already (the one before its own, about
    /// two windows after its own start) is refused, never answered new.
    ///
    /// # Errors
    ///
    /// [`StoreError::BeyondHorizon`] for a bucketed strategy and a time whose bucket has
    /// expired (a backfill older than about two windows, counted from its bucket's start):
    /// nothing is written. The store's.
    pub async fn first_seen_at(
        &self,
        scope: &str,
        ids: &[impl AsRef<[u8]>],
        at: SystemTime,
    ) -> Result<Vec<bool>, StoreError> {
        // Every configuration instances may run: the strategy and the one before it, under
        // every naming. An event is new only if it is new to all of them.
        let mut fresh = vec![true; ids.len()];
        for strategy in std::iter::once(self.strategy).chain(self.previous) {
            for names in self.hashing.namings() {
                let checked = self.check(strategy, names, scope, ids, at).await?;
                fresh.iter_mut().zip(checked).for_each(|(fresh, new)| *fresh &= new);
            }
        }
        Ok(fresh)
    }

    /// Whether each of `ids` is new to `strategy`'s sets or filters, remembered there.
    async fn check(
        &self,
        strategy: Strategy,
        names: &Names,
        scope: &str,
        ids: &[impl AsRef<[u8]>],
        at: SystemTime,
    ) -> Result<Vec<bool>, StoreError> {
        let fresh = match strategy {
            Strategy::Markers { window } => {
                let prefix = format!("{}:m", self.prefix);
                let keys = ids.iter().map(|id| {
                    let plain = RecordKey::new(&prefix, scope.as_bytes(), id.as_ref());
                    names.record_key(&plain).as_str().to_owned()
                });
                let (keys, firsts) = once_each(keys);
                let marked = self.store.mark(&keys, window).await?;
                return answers(&firsts, &marked);
            }
            Strategy::Buckets { window, shards } => {
                let events = Events::of(names, scope, ids, shards);
                let bucket = Bucket::within_horizon(at, window)?;
                let batches: Vec<BucketBatch> = events
                    .shards
                    .iter()
                    .map(|(shard, members)| BucketBatch {
                        sets: self.keys(names, "b", scope, &shard.to_be_bytes(), bucket.number),
                        members: members.iter().map(|&i| member(&events.hashes[i])).collect(),
                        expire_at: bucket.expire_at,
                    })
                    .collect();
                (events, self.store.add_unseen(&batches).await?)
            }
            Strategy::Bloom { window, shards, bits, hashes } => {
                // A variant built by hand is held to what `Strategy::bloom` makes.
                let (bits, hashes) =
                    (bits.clamp(64, bloom::MAX_BITS), hashes.clamp(1, bloom::MAX_HASHES));
                let events = Events::of(names, scope, ids, shards);
                let bucket = Bucket::within_horizon(at, window)?;
                // A filter resized is another filter: its positions would not match.
                let mut sizing = [0; 14];
                sizing[2..10].copy_from_slice(&bits.to_be_bytes());
                sizing[10..].copy_from_slice(&hashes.to_be_bytes());
                let batches: Vec<FilterBatch> = events
                    .shards
                    .iter()
                    .map(|(shard, members)| {
                        sizing[..2].copy_from_slice(&shard.to_be_bytes());
                        let mut positions = Vec::with_capacity(members.len() * hashes as usize);
                        for &i in members {
                            bloom::positions(&events.hashes[i], bits, hashes, &mut positions);
                        }
                        FilterBatch {
                            filters: self.keys(names, "f", scope, &sizing, bucket.number),
                            bits,
                            hashes,
                            positions,
                            expire_at: bucket.expire_at,
                        }
                    })
                    .collect();
                (events, self.store.set_unseen(&batches).await?)
            }
        };
        let (events, by_shard) = fresh;
        answers(&events.firsts, &events.scatter(&by_shard)?)
    }

    /// The keys of the sets (`kind` `b`) or filters (`f`) of the buckets before, at and after
    /// `bucket`, for a shard: they share the hash tag `shard` makes, one Cluster slot.
    fn keys(
        &self,
        names: &Names,
        kind: &str,
        scope: &str,
        shard: &[u8],
        bucket: u128,
    ) -> [String; 3] {
        let plain = RecordKey::new(&format!("{}:{kind}", self.prefix), scope.as_bytes(), shard);
        let tag = names.record_key(&plain);
        let key = |bucket: u128| format!("{}:{bucket}", tag.as_str());
        [key(bucket.saturating_sub(1)), key(bucket), key(bucket + 1)]
    }
}
