//! [`DedupStore`]: what the [`dedup`](crate::dedup) front door asks of a store: markers set
//! when absent, and members added to a bucket set when absent from it and its neighbours.

use std::{
    future::Future,
    time::{Duration, SystemTime},
};

use super::StoreError;

/// One event id to add to its bucket: absent from the three sets (the bucket before, its own,
/// the one after), it is added to its own. The three keys share one hash tag: one Cluster slot.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BucketEntry {
    /// The sets of the bucket before, the event's own bucket, and the bucket after.
    pub sets: [String; 3],
    /// The event's member: 16 bytes of its hash.
    pub member: [u8; 16],
    /// When the event's own set expires (it is kept while a neighbour may check it).
    pub expire_at: SystemTime,
}

/// Storage for "first time seen?" (see [`Dedup`](crate::dedup::Dedup)), on the connections of
/// the record store. [`MemoryStore`](super::MemoryStore) and [`RedisStore`](super::RedisStore)
/// (standalone and Cluster) implement it. Each entry of a call is atomic on its own; a call's
/// entries go in one pipelined batch.
pub trait DedupStore: Clone + Send + Sync + 'static {
    /// Sets each marker in `keys` that is absent, for `ttl`; for each, whether it was absent
    /// (the event is new). A marker present is left as it is (its expiry is not extended).
    fn mark(
        &self,
        keys: &[String],
        ttl: Duration,
    ) -> impl Future<Output = Result<Vec<bool>, StoreError>> + Send;

    /// For each entry: when its member is in none of its three sets, adds it to its own set
    /// (which then expires at `expire_at`); whether it was in none (the event is new).
    fn add_unseen(
        &self,
        entries: &[BucketEntry],
    ) -> impl Future<Output = Result<Vec<bool>, StoreError>> + Send;
}
