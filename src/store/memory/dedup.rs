//! [`DedupStore`] for [`MemoryStore`]: markers and bucket sets in this process, expiring by
//! the system clock (the bucket sets' expiries are wall-clock times).

use std::{
    collections::{HashMap, HashSet},
    sync::{MutexGuard, PoisonError},
    time::{Duration, SystemTime},
};

use super::MemoryStore;
use crate::store::{BucketEntry, DedupStore, StoreError};

/// The markers and bucket sets of one store, each with when it expires.
#[derive(Debug, Default)]
pub(super) struct Seen {
    markers: HashMap<String, SystemTime>,
    sets: HashMap<String, (HashSet<[u8; 16]>, SystemTime)>,
    /// Swept of expired entries when they reach this many, then set to twice what is left.
    sweep_at: usize,
}

impl Seen {
    fn sweep(&mut self, now: SystemTime) {
        if self.markers.len() + self.sets.len() < self.sweep_at.max(1024) {
            return;
        }
        self.markers.retain(|_, expires| *expires > now);
        self.sets.retain(|_, (_, expires)| *expires > now);
        self.sweep_at = 2 * (self.markers.len() + self.sets.len());
    }

    fn holds(&self, set: &str, member: &[u8; 16], now: SystemTime) -> bool {
        self.sets
            .get(set)
            .is_some_and(|(members, expires)| *expires > now && members.contains(member))
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

    async fn add_unseen(&self, entries: &[BucketEntry]) -> Result<Vec<bool>, StoreError> {
        let now = SystemTime::now();
        let mut seen = self.seen();
        seen.sweep(now);
        Ok(entries
            .iter()
            .map(|entry| {
                if entry.sets.iter().any(|set| seen.holds(set, &entry.member, now)) {
                    return false;
                }
                let (members, expires) = seen
                    .sets
                    .entry(entry.sets[1].clone())
                    .or_insert_with(|| (HashSet::new(), entry.expire_at));
                if *expires <= now {
                    members.clear();
                }
                members.insert(entry.member);
                *expires = entry.expire_at;
                true
            })
            .collect())
    }
}
