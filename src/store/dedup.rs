//! [`DedupStore`]: what the [`dedup`](crate::dedup) front door asks of a store: markers set
//! when absent, members added to a bucket set when absent from it and its neighbours, and
//! events' bits set in a bucket's Bloom filter when no neighbouring filter holds them all.

use std::{
    future::Future,
    time::{Duration, SystemTime},
};

use super::StoreError;

/// A page's events of one shard, for their bucket sets: each event absent from the three sets
/// (the bucket before, its own, the one after) is added to its own. The three keys share one
/// hash tag: one Cluster slot, one script.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketBatch {
    /// The sets of the bucket before, the events' own bucket, and the bucket after.
    pub sets: [String; 3],
    /// The events' members, 16 bytes of each one's hash, each once.
    pub members: Vec<[u8; 16]>,
    /// When the events' own set expires (it is kept while a neighbour may check it).
    pub expire_at: SystemTime,
}

/// A page's events of one shard, for their bucket's Bloom filter: an event is seen when one of
/// the three filters (the bucket before, its own, the one after) has all its bits set;
/// otherwise its bits are set in its own. The three keys share one hash tag: one Cluster slot,
/// one script.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilterBatch {
    /// The filters of the bucket before, the events' own bucket, and the bucket after.
    pub filters: [String; 3],
    /// The size of each filter, in bits.
    pub bits: u64,
    /// The bits of one event: `positions` holds this many per event, event after event.
    pub hashes: u32,
    /// Each event's bit positions, each below `bits`.
    pub positions: Vec<u64>,
    /// When the events' own filter expires.
    pub expire_at: SystemTime,
}

impl FilterBatch {
    /// How many bit positions each event has in `positions`: `hashes`, and at least one (the
    /// door never asks for none; a batch built by hand may).
    #[must_use]
    pub fn per_event(&self) -> usize {
        usize::try_from(self.hashes.max(1)).unwrap_or(usize::MAX)
    }

    /// Each event's bit positions, event after event.
    pub fn events(&self) -> std::slice::Chunks<'_, u64> {
        self.positions.chunks(self.per_event())
    }
}

/// Storage for "first time seen?" (see [`Dedup`](crate::dedup::Dedup)), on the connections of
/// the record store. [`MemoryStore`](super::MemoryStore) and [`RedisStore`](super::RedisStore)
/// (standalone and Cluster) implement it. Each batch is atomic on its own; a call's batches go
/// at once (pipelined).
pub trait DedupStore: Clone + Send + Sync + 'static {
    /// Sets each marker in `keys` that is absent, for `ttl`; for each, whether it was absent
    /// (the event is new). A marker present is left as it is (its expiry is not extended).
    fn mark(
        &self,
        keys: &[String],
        ttl: Duration,
    ) -> impl Future<Output = Result<Vec<bool>, StoreError>> + Send;

    /// For each batch, for each of its members in order: when it is in none of the three sets,
    /// adds it to its own set (which then expires at `expire_at`); whether it was in none (the
    /// event is new).
    fn add_unseen(
        &self,
        batches: &[BucketBatch],
    ) -> impl Future<Output = Result<Vec<Vec<bool>>, StoreError>> + Send;

    /// For each batch, for each of its events in order: when no one of the three filters has
    /// all the event's bits set, sets them in its own filter (which then expires at
    /// `expire_at`); whether none had (the event is new).
    fn set_unseen(
        &self,
        batches: &[FilterBatch],
    ) -> impl Future<Output = Result<Vec<Vec<bool>>, StoreError>> + Send;
}
