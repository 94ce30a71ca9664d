//! The opt-in fallback of a [`RegionalStore`](super::RegionalStore): the claims taken outside
//! their home while it could not be reached, so that their settles follow them there.

use std::{
    collections::HashMap,
    sync::{Mutex, MutexGuard, PoisonError},
    time::Instant,
};

use crate::{
    key::RecordKey,
    store::{Lease, OwnerToken, StoreError, later},
};

/// The region that takes a claim when the key's home cannot be reached, and the claims it took.
#[derive(Debug)]
pub(super) struct Fallback {
    pub(super) region: usize,
    /// Each claim taken here (record key, owner token), until its lease and recovery window end.
    claims: Mutex<HashMap<(String, Vec<u8>), Instant>>,
}

impl Fallback {
    pub(super) fn new(region: usize) -> Self {
        Self { region, claims: Mutex::new(HashMap::new()) }
    }

    /// Whether a home that answered `error` counts as unreachable: it could not be reached, or
    /// did not answer in time. Any other error is the home's answer, and stands.
    pub(super) fn applies(error: &StoreError) -> bool {
        matches!(error, StoreError::Unavailable(_) | StoreError::Timeout(_))
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<(String, Vec<u8>), Instant>> {
        // Every critical section leaves the map consistent.
        self.claims.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Remembers that `owner`'s claim of `key` lives here, for its lease and recovery window.
    pub(super) fn remember(&self, key: &RecordKey, owner: &OwnerToken, lease: Lease) {
        let now = Instant::now();
        let until = later(now, lease.duration.saturating_add(lease.recovery_window));
        let mut claims = self.lock();
        claims.retain(|_, until| *until > now);
        claims.insert((key.as_str().to_owned(), owner.as_bytes().to_vec()), until);
    }

    /// Whether `owner`'s claim of `key` was taken here.
    pub(super) fn holds(&self, key: &RecordKey, owner: &OwnerToken) -> bool {
        let held = self.lock().get(&(key.as_str().to_owned(), owner.as_bytes().to_vec())).copied();
        held.is_some_and(|until| until > Instant::now())
    }

    /// Forgets `owner`'s claim of `key`: it was settled.
    pub(super) fn forget(&self, key: &RecordKey, owner: &OwnerToken) {
        self.lock().remove(&(key.as_str().to_owned(), owner.as_bytes().to_vec()));
    }
}
