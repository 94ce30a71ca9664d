//! [`DedupStore`] for [`MemoryStore`]: markers, bucket sets and Bloom filters in this process,
//! expiring by the system clock (the buckets' expiries are wall-clock times).

use std::{
    collections::{HashMap, HashSet},
    sync::{MutexGuard, PoisonError},
    time::{Duration, SystemTime},
};

use super::MemoryStore;
use crate::store::{BucketBatch, DedupStore, FilterBatch, StoreError};

/// The markers, bucket sets and filters of one store, each with when it expires.
#[derive(Debug, Default)]
pub(super) struct Seen {
    markers: HashMap<String, SystemTime>,
    sets: HashMap<String, (HashSet<[u8; 16]>, SystemTime)>,
    /// Each filter's bits, 64 to a word.
    filters: HashMap<String, (Vec<u64>, SystemTime)>,
    /// Swept of expired entries when they reach this many, then set to twice what is left.
    sweep_at: usize,
}

impl Seen {
    fn sweep(&mut self, now: SystemTime) {
        if self.markers.len() + self.sets.len() + self.filters.len() < self.sweep_at.max(1024) {
            return;
        }
        self.markers.retain(|_, expires| *expires > now);
        self.sets.retain(|_, (_, expires)| *expires > now);
        self.filters.retain(|_, (_, expires)| *expires > now);
        self.sweep_at = 2 * (self.markers.len() + self.sets.len() + self.filters.len());
    }

    fn holds(&self, set: &str, member: &[u8; 16], now: SystemTime) -> bool {
        self.sets
            .get(set)
            .is_some_and(|(members, expires)| *expires > now && members.contains(member))
    }

    /// Whether `filter` has every bit of `positions` set.
    fn has_all(&self, filter: &str, positions: &[u64], now: SystemTime) -> bool {
        self.filters.get(filter).is_some_and(|(words, expires)| {
            *expires > now
                && positions.iter().all(|&bit| {
                    let word = usize::try_from(bit / 64).unwrap_or(usize::MAX);
                    words.get(word).is_some_and(|word| word >> (bit % 64) & 1 == 1)
                })
        })
    }
}

impl MemoryStore {
    fn seen(&self) -> MutexGuard<'_, Seen> {
        // Every critical section leaves the maps consistent.
        self.seen.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl DedupStore for MemoryStore {
    async fn mark(&self, keys: &[String], ttl: Duration) -> Result<Vec<bool>, StoreError> {
        let now = SystemTime::now();
        let mut seen = self.seen();
        seen.sweep(now);
        let expires = now.checked_add(ttl).unwrap_or(now + Duration::from_secs(30 * 365 * 86_400));
        Ok(keys
            .iter()
            .map(|key| match seen.markers.get(key) {
                Some(at) if *at > now => false,
                _ => {
                    seen.markers.insert(key.clone(), expires);
                    true
                }
            })
            .collect())
    }

    async fn add_unseen(&self, batches: &[BucketBatch]) -> Result<Vec<Vec<bool>>, StoreError> {
        let now = SystemTime::now();
        let mut seen = self.seen();
        seen.sweep(now);
        let added = batches.iter().map(|batch| {
            let fresh: Vec<bool> = batch
                .members
                .iter()
                .map(|member| !batch.sets.iter().any(|set| seen.holds(set, member, now)))
                .collect();
            if fresh.contains(&true) {
                let (members, expires) = seen
                    .sets
                    .entry(batch.sets[1].clone())
                    .or_insert_with(|| (HashSet::new(), batch.expire_at));
                if *expires <= now {
                    members.clear();
                }
                let new = batch.members.iter().zip(&fresh).filter(|(_, new)| **new);
                members.extend(new.map(|(member, _)| *member));
                *expires = batch.expire_at;
            }
            fresh
        });
        Ok(added.collect())
    }

    async fn set_unseen(&self, batches: &[FilterBatch]) -> Result<Vec<Vec<bool>>, StoreError> {
        let now = SystemTime::now();
        let mut seen = self.seen();
        seen.sweep(now);
        let set = batches.iter().map(|batch| {
            let words = usize::try_from(batch.bits.div_ceil(64)).unwrap_or(usize::MAX);
            batch
                .events()
                .map(|positions| {
                    if batch.filters.iter().any(|filter| seen.has_all(filter, positions, now)) {
                        return false;
                    }
                    let (bits, expires) = seen
                        .filters
                        .entry(batch.filters[1].clone())
                        .or_insert_with(|| (vec![0; words], batch.expire_at));
                    if *expires <= now {
                        bits.fill(0);
                    }
                    for &bit in positions {
                        let word = usize::try_from(bit / 64).unwrap_or(usize::MAX);
                        if let Some(word) = bits.get_mut(word) {
                            *word |= 1 << (bit % 64);
                        }
                    }
                    *expires = batch.expire_at;
                    true
                })
                .collect()
        });
        Ok(set.collect())
    }
}
