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
//!   shard, exact (but for a 128-bit hash collision); far fewer keys. An event is remembered for
//!   at least the window and at most three windows (its bucket is checked by the buckets
//!   before and after it, so that instances whose clocks differ by less than a window agree).
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

use std::{
    collections::HashSet,
    hash::Hash,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use crate::{
    fingerprint::Fingerprint,
    key::RecordKey,
    store::{BucketEntry, DedupStore, StoreError},
};

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
        Self::Buckets { window, shards: 16 }
    }
}

/// Answers "first time seen?" for event ids in a scope (see the [module](self)). Cloning is
/// cheap.
#[derive(Debug, Clone)]
pub struct Dedup<St> {
    store: St,
    strategy: Strategy,
    prefix: String,
}

impl<St: DedupStore> Dedup<St> {
    /// A door over `store`, remembering events by `strategy`, under the key prefix `dedup`.
    pub fn new(store: St, strategy: Strategy) -> Self {
        Self { store, strategy, prefix: "dedup".to_owned() }
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
    /// The store's: the event's fate is then unknown, as for any failed call.
    pub async fn first_seen(&self, scope: &str, id: impl AsRef<[u8]>) -> Result<bool, StoreError> {
        let seen = self.first_seen_at(scope, &[id], SystemTime::now()).await?;
        Ok(seen.first().copied().unwrap_or(false))
    }

    /// [`first_seen`](Self::first_seen) for a page of ids (a broker's batch), in one pipelined
    /// batch: for each, in order, whether it is new. An id twice in the page is new the first
    /// time only.
    ///
    /// # Errors
    ///
    /// The store's.
    pub async fn first_seen_batch(
        &self,
        scope: &str,
        ids: &[impl AsRef<[u8]>],
    ) -> Result<Vec<bool>, StoreError> {
        self.first_seen_at(scope, ids, SystemTime::now()).await
    }

    /// [`first_seen_batch`](Self::first_seen_batch) with the time taken as `at` (the buckets'
    /// time; markers expire by the store's clock): for a replay of a log with its timestamps,
    /// and for tests of the bucket boundaries. Only times at or after now keep the buckets'
    /// expiries meaningful.
    ///
    /// # Errors
    ///
    /// The store's.
    pub async fn first_seen_at(
        &self,
        scope: &str,
        ids: &[impl AsRef<[u8]>],
        at: SystemTime,
    ) -> Result<Vec<bool>, StoreError> {
        let answers = match self.strategy {
            Strategy::Markers { window } => {
                let prefix = format!("{}:m", self.prefix);
                let keys = ids.iter().map(|id| {
                    RecordKey::new(&prefix, scope.as_bytes(), id.as_ref()).as_str().to_owned()
                });
                let (keys, firsts) = once_each(keys);
                let marked = self.store.mark(&keys, window).await?;
                firsts.into_iter().map(|first| first.is_some_and(|i| marked[i])).collect()
            }
            Strategy::Buckets { window, shards } => {
                let entries =
                    ids.iter().map(|id| self.bucket_entry(scope, id.as_ref(), window, shards, at));
                let (entries, firsts) = once_each(entries);
                let added = self.store.add_unseen(&entries).await?;
                firsts.into_iter().map(|first| first.is_some_and(|i| added[i])).collect()
            }
        };
        Ok(answers)
    }

    /// The bucket entry of `id` seen `at`: its shard's sets of the buckets around `at`.
    fn bucket_entry(
        &self,
        scope: &str,
        id: &[u8],
        window: Duration,
        shards: u16,
        at: SystemTime,
    ) -> BucketEntry {
        let hash = Fingerprint::of_fields(&[scope.as_bytes(), id]);
        let hash = hash.as_bytes();
        let window_ms = window.as_millis().max(1);
        let bucket = at.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() / window_ms;
        // The shard's record key is the sets' hash tag: one Cluster slot per scope and shard.
        let shard = u16::from_be_bytes([hash[0], hash[1]]) % shards.max(1);
        let tag =
            RecordKey::new(&format!("{}:b", self.prefix), scope.as_bytes(), &shard.to_be_bytes());
        let set = |bucket: u128| format!("{}:{bucket}", tag.as_str());
        // Kept while the bucket after it may check it, and a window more for clocks that
        // differ between instances.
        let expire_ms = u64::try_from((bucket + 3) * window_ms).unwrap_or(u64::MAX);
        let mut member = [0; 16];
        member.copy_from_slice(&hash[16..]);
        BucketEntry {
            sets: [set(bucket.saturating_sub(1)), set(bucket), set(bucket + 1)],
            member,
            expire_at: UNIX_EPOCH + Duration::from_millis(expire_ms),
        }
    }
}

/// `items` once each, in order, and for each item where its first occurrence is among them
/// (`None` for a repeat): the same event twice in one page is new the first time only.
fn once_each<T: Hash + Eq + Clone>(items: impl Iterator<Item = T>) -> (Vec<T>, Vec<Option<usize>>) {
    let (mut unique, mut firsts, mut seen) = (Vec::new(), Vec::new(), HashSet::new());
    for item in items {
        match seen.insert(item.clone()) {
            true => {
                firsts.push(Some(unique.len()));
                unique.push(item);
            }
            false => firsts.push(None),
        }
    }
    (unique, firsts)
}
