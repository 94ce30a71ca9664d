//! [`MemoryStore`]: records in this process.

mod admin;
mod dedup;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::{Duration, Instant},
};

use bytes::Bytes;

use super::{Claim, Fenced, Lease, OwnerToken, Store, StoreError, Subscription, Waiters, later};
use crate::{fingerprint::Fingerprint, key::RecordKey};

/// The smallest map that is swept for expired records.
const SWEEP_FROM: usize = 1024;

/// The default for [`MemoryStore::with_capacity`].
pub const DEFAULT_CAPACITY: usize = 100_000;

/// Records kept in this process, with the same semantics as [`RedisStore`](super::RedisStore),
/// expiry included.
///
/// For examples, tests, and single-instance services: records are not shared between
/// processes and do not survive a restart. Clones share one map.
///
/// The store holds at most [`DEFAULT_CAPACITY`] live records (see
/// [`with_capacity`](Self::with_capacity)). When it is full, a claim fails with
/// [`StoreError::CapacityReached`] (the layer answers 503 + `Retry-After`, as Redis at
/// `maxmemory` under `noeviction`): no record, in progress or completed, is ever evicted to
/// make room. Expired records are swept out first.
#[derive(Debug, Clone, Default)]
pub struct MemoryStore {
    inner: Arc<Mutex<Records>>,
    waiters: Waiters,
    /// The `dedup` door's markers and bucket sets.
    seen: Arc<Mutex<dedup::Seen>>,
    /// The fleets' registries ([`Store::announce`]): each entry until its time.
    fleet: Arc<Mutex<HashMap<String, HashMap<String, Instant>>>>,
}

#[derive(Debug)]
struct Records {
    map: HashMap<String, Record>,
    capacity: usize,
    /// The map is swept for expired records when it reaches this size, and the mark is then
    /// set to twice what is left: a sweep costs O(records), and doubling keeps that at O(1)
    /// per claim while holding at most twice the live records.
    sweep_at: usize,
}

impl Default for Records {
    fn default() -> Self {
        Self { map: HashMap::new(), capacity: DEFAULT_CAPACITY, sweep_at: SWEEP_FROM }
    }
}

#[derive(Debug)]
struct Record {
    fingerprint: Fingerprint,
    state: State,
    /// When the record goes: an in-progress record's lease deadline plus its recovery window,
    /// a completed one's retention.
    expires_at: Instant,
}

#[derive(Debug)]
enum State {
    InProgress { owner: OwnerToken, deadline: Instant },
    Completed(Bytes),
}

/// What a [`MemoryStore`] holds under one key, for inspection.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordState {
    /// Claimed, its handler running.
    InProgress,
    /// Completed; the encoded response is kept for replay.
    Completed,
}

impl MemoryStore {
    /// An empty store.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store that holds at most `records` live records.
    #[must_use]
    pub fn with_capacity(records: usize) -> Self {
        let store = Self::default();
        store.lock().capacity = records;
        store
    }

    /// What the store holds under `key`, if anything live.
    #[must_use]
    pub fn state(&self, key: &RecordKey) -> Option<RecordState> {
        let records = self.lock();
        let record = records.live(key.as_str(), Instant::now())?;
        Some(match record.state {
            State::InProgress { .. } => RecordState::InProgress,
            State::Completed(_) => RecordState::Completed,
        })
    }

    /// The number of live records.
    #[must_use]
    pub fn len(&self) -> usize {
        let now = Instant::now();
        self.lock().map.values().filter(|record| record.expires_at > now).count()
    }

    /// Whether the store holds no live record.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> MutexGuard<'_, Records> {
        // Every critical section leaves the map consistent, so a panic elsewhere while the
        // lock was held does not make it unusable.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `write` on the record under `key` if `owner` holds it.
    fn fenced(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        write: impl FnOnce(&mut Records, &str),
    ) -> Fenced {
        let mut records = self.lock();
        let owned = matches!(
            records.live(key.as_str(), Instant::now()),
            Some(Record { state: State::InProgress { owner: holder, .. }, .. }) if holder == owner
        );
        if !owned {
            return Fenced::Rejected;
        }
        write(&mut records, key.as_str());
        Fenced::Applied
    }
}

impl Records {
    fn live(&self, key: &str, now: Instant) -> Option<&Record> {
        self.map.get(key).filter(|record| record.expires_at > now)
    }

    fn live_mut(&mut self, key: &str, now: Instant) -> Option<&mut Record> {
        self.map.get_mut(key).filter(|record| record.expires_at > now)
    }

    /// Makes sure a record for `key` fits: sweeps the expired ones when the map is full, and
    /// refuses when it is still full. Nothing live is ever evicted.
    fn make_room(&mut self, key: &str, now: Instant) -> Result<(), StoreError> {
        if self.map.len() < self.capacity || self.map.contains_key(key) {
            return Ok(());
        }
        self.map.retain(|_, record| record.expires_at > now);
        if self.map.len() < self.capacity {
            return Ok(());
        }
        Err(StoreError::CapacityReached(self.capacity))
    }
}

impl Store for MemoryStore {
    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Claim, StoreError> {
        let now = Instant::now();
        let mut records = self.lock();
        if records.map.len() >= records.sweep_at {
            records.map.retain(|_, record| record.expires_at > now);
            records.sweep_at = (2 * records.map.len()).max(SWEEP_FROM);
        }
        if let Some(record) = records.live_mut(key.as_str(), now) {
            if record.fingerprint != *fingerprint {
                return Ok(Claim::Mismatch);
            }
            return Ok(match &mut record.state {
                State::Completed(response) => {
                    Claim::Replay { response: response.clone(), remaining: record.expires_at - now }
                }
                State::InProgress { deadline, .. } if *deadline > now => {
                    Claim::InProgress { remaining: *deadline - now }
                }
                // The lease lapsed within the recovery window: the key is the caller's now,
                // and the lapsed holder is fenced out by its token.
                State::InProgress { owner: holder, deadline } => {
                    *holder = owner.clone();
                    *deadline = later(now, lease.duration);
                    record.expires_at = later(*deadline, lease.recovery_window);
                    Claim::TakenOver
                }
            });
        }
        records.make_room(key.as_str(), now)?;
        let deadline = later(now, lease.duration);
        records.map.insert(
            key.as_str().to_owned(),
            Record {
                fingerprint: fingerprint.clone(),
                state: State::InProgress { owner: owner.clone(), deadline },
                expires_at: later(deadline, lease.recovery_window),
            },
        );
        Ok(Claim::Claimed)
    }

    async fn complete(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        fingerprint: &Fingerprint,
        response: Bytes,
        retention: Duration,
    ) -> Result<Fenced, StoreError> {
        let now = Instant::now();
        let mut records = self.lock();
        match records.live(key.as_str(), now) {
            Some(Record { state: State::InProgress { owner: holder, .. }, .. })
                if holder == owner => {}
            // An earlier attempt of this very complete landed.
            Some(Record { state: State::Completed(stored), fingerprint: held, .. })
                if *stored == response && held == fingerprint =>
            {
                return Ok(Fenced::Applied);
            }
            Some(_) => return Ok(Fenced::Rejected),
            // The lease lapsed and nobody took over: the response is still the one answer.
            None => records.make_room(key.as_str(), now)?,
        }
        records.map.insert(
            key.as_str().to_owned(),
            Record {
                fingerprint: fingerprint.clone(),
                state: State::Completed(response),
                expires_at: later(now, retention),
            },
        );
        drop(records);
        self.waiters.notify(key.as_str());
        Ok(Fenced::Applied)
    }

    async fn release(&self, key: &RecordKey, owner: &OwnerToken) -> Result<Fenced, StoreError> {
        let released = self.fenced(key, owner, |records, key| {
            records.map.remove(key);
        });
        if released == Fenced::Applied {
            self.waiters.notify(key.as_str());
        }
        Ok(released)
    }

    async fn subscribe(&self, key: &RecordKey) -> Subscription {
        self.waiters.register(key.as_str(), None).0
    }

    async fn announce(
        &self,
        registry: &RecordKey,
        entries: &[(String, Duration)],
    ) -> Result<Option<Vec<String>>, StoreError> {
        let now = Instant::now();
        let mut fleet = self.fleet.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let listed = fleet.entry(registry.as_str().to_owned()).or_default();
        listed.retain(|_, until| *until > now);
        for (entry, lasts) in entries {
            let until = later(now, *lasts);
            let kept = listed.entry(entry.clone()).or_insert(until);
            *kept = (*kept).max(until);
        }
        let mut answered: Vec<String> = listed.keys().cloned().collect();
        answered.sort();
        Ok(Some(answered))
    }

    async fn touch(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Fenced, StoreError> {
        Ok(self.fenced(key, owner, |records, key| {
            if let Some(record) = records.map.get_mut(key)
                && let State::InProgress { deadline, .. } = &mut record.state
            {
                *deadline = later(Instant::now(), lease.duration);
                record.expires_at = later(*deadline, lease.recovery_window);
            }
        }))
    }
}

#[cfg(test)]
mod tests;
