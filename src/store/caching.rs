//! [`CachingStore`]: completed records kept in process, in front of another store.

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::{Duration, Instant},
};

use bytes::Bytes;

use super::{
    AbandonedClaim, Admin, Claim, Fenced, Forgotten, Inspection, Lease, OwnerToken, Store,
    StoreError, Subscription,
};
use crate::{fingerprint::Fingerprint, key::RecordKey};

/// The default for [`CachingStore::max_bytes`]: 32 MiB.
pub const DEFAULT_CACHE_BYTES: usize = 32 * 1024 * 1024;
/// The default for [`CachingStore::max_age`]: one minute.
pub const DEFAULT_CACHE_AGE: Duration = Duration::from_secs(60);

/// A near cache of completed records in front of another store: a retry storm is answered from
/// this process, with no round trip.
///
/// A completed record never changes until it expires: `complete` only writes over an
/// in-progress record of the same owner, and `release` only deletes in-progress records. So a
/// copy of it is exact for as long as the record lives. The cache keeps a copy of each
/// completed record this process replayed (the first retry of a request goes to the inner
/// store; the storm after it does not), and answers a claim that finds one (a replay, or a
/// mismatch against it) itself; every other claim, and every other transition, goes to the
/// inner store. Records that are never retried are never copied: the fresh path costs what
/// the inner store's does.
///
/// - Each copy expires no later than its record (its remaining retention, as the inner store
///   reported it with the replay), and no later than [`max_age`](Self::max_age) (default 1
///   minute).
/// - The copies are bounded in bytes ([`max_bytes`](Self::max_bytes), default 32 MiB); past
///   it the oldest go first. A copy costs its response plus about 150 bytes.
/// - **Opt in, knowing what it changes:** a record deleted by hand in the inner store (a
///   `DEL` in Redis to let a client run its request again) is still replayed by the instances
///   that hold a copy, for up to `max_age`. The same holds for a record the inner store lost.
///
/// ```
/// # #[cfg(feature = "redis")] {
/// use std::time::Duration;
/// use axum_idempotency::{IdempotencyLayer, RedisStore, store::CachingStore};
///
/// # fn layer() -> Result<(), Box<dyn std::error::Error>> {
/// let store = CachingStore::new(RedisStore::from_url("redis://127.0.0.1:6379")?)
///     .max_bytes(64 * 1024 * 1024)
///     .max_age(Duration::from_secs(30));
/// let layer = IdempotencyLayer::new(store);
/// # Ok(()) }
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct CachingStore<St> {
    inner: St,
    cache: Arc<Mutex<Cache>>,
}

#[derive(Debug)]
struct Cache {
    entries: HashMap<String, Entry>,
    /// Keys in the order they were cached, with the generation of the entry then: the oldest
    /// go first when the cache is over its bytes.
    order: VecDeque<(String, u64)>,
    bytes: usize,
    max_bytes: usize,
    max_age: Duration,
    generation: u64,
}

#[derive(Debug)]
struct Entry {
    fingerprint: Fingerprint,
    response: Bytes,
    expires_at: Instant,
    generation: u64,
}

/// What an entry costs besides its response: the key (about 80 bytes), the fingerprint, the
/// map's and the queue's own slots.
const ENTRY_OVERHEAD: usize = 160;

impl<St> CachingStore<St> {
    /// A cache in front of `inner`, with the default bounds.
    pub fn new(inner: St) -> Self {
        let cache = Cache {
            entries: HashMap::new(),
            order: VecDeque::new(),
            bytes: 0,
            max_bytes: DEFAULT_CACHE_BYTES,
            max_age: DEFAULT_CACHE_AGE,
            generation: 0,
        };
        Self { inner, cache: Arc::new(Mutex::new(cache)) }
    }

    /// Sets the most bytes the copies may hold, responses and keys counted. Defaults to
    /// [`DEFAULT_CACHE_BYTES`]; 0 keeps nothing.
    #[must_use]
    pub fn max_bytes(self, bytes: usize) -> Self {
        self.lock().max_bytes = bytes;
        self
    }

    /// Sets the longest a copy is kept, whatever its record's retention: how long a record
    /// deleted by hand may still be replayed here. Defaults to [`DEFAULT_CACHE_AGE`].
    #[must_use]
    pub fn max_age(self, age: Duration) -> Self {
        self.lock().max_age = age;
        self
    }

    /// The store behind the cache.
    pub fn inner(&self) -> &St {
        &self.inner
    }

    /// The number of copies held, live or not yet swept.
    #[must_use]
    pub fn cached(&self) -> usize {
        self.lock().entries.len()
    }

    fn lock(&self) -> MutexGuard<'_, Cache> {
        // Every critical section leaves the cache consistent.
        self.cache.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What the cache answers for `key`, if it holds a live copy.
    fn answer(&self, key: &RecordKey, fingerprint: &Fingerprint) -> Option<Claim> {
        let now = Instant::now();
        let mut cache = self.lock();
        let entry = cache.entries.get(key.as_str())?;
        if entry.expires_at <= now {
            cache.remove(key.as_str());
            return None;
        }
        Some(if entry.fingerprint == *fingerprint {
            Claim::Replay { response: entry.response.clone(), remaining: entry.expires_at - now }
        } else {
            Claim::Mismatch
        })
    }

    /// Keeps a copy of a completed record for `remaining` (bounded by the max age), counted
    /// from `since`.
    fn keep(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        response: &Bytes,
        since: Instant,
        remaining: Duration,
    ) {
        let mut cache = self.lock();
        let expires_at = since + remaining.min(cache.max_age);
        let size = response.len() + key.as_str().len() + ENTRY_OVERHEAD;
        if expires_at <= Instant::now() || size > cache.max_bytes {
            return;
        }
        cache.remove(key.as_str());
        cache.generation += 1;
        let generation = cache.generation;
        let entry = Entry {
            fingerprint: fingerprint.clone(),
            response: response.clone(),
            expires_at,
            generation,
        };
        cache.entries.insert(key.as_str().to_owned(), entry);
        cache.order.push_back((key.as_str().to_owned(), generation));
        cache.bytes += size;
        while cache.bytes > cache.max_bytes {
            let Some((oldest, generation)) = cache.order.pop_front() else { break };
            if cache.entries.get(&oldest).is_some_and(|entry| entry.generation == generation) {
                cache.remove(&oldest);
            }
        }
    }
}

impl Cache {
    fn remove(&mut self, key: &str) {
        if let Some(entry) = self.entries.remove(key) {
            self.bytes -= entry.response.len() + key.len() + ENTRY_OVERHEAD;
        }
        // A queue that only grows under churn of the same keys is compacted when it holds
        // twice the entries: O(1) per insert, amortised.
        if self.order.len() > 2 * self.entries.len() + 64 {
            let entries = &self.entries;
            self.order.retain(|(key, generation)| {
                entries.get(key).is_some_and(|entry| entry.generation == *generation)
            });
        }
    }
}

impl<St: Store> CachingStore<St> {
    async fn claim_through(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        claim: impl Future<Output = Result<Claim, StoreError>>,
    ) -> Result<Claim, StoreError> {
        let since = Instant::now();
        let claim = claim.await?;
        if let Claim::Replay { response, remaining } = &claim {
            self.keep(key, fingerprint, response, since, *remaining);
        }
        Ok(claim)
    }
}

impl<St: Store> Store for CachingStore<St> {
    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Claim, StoreError> {
        if let Some(answer) = self.answer(key, fingerprint) {
            return Ok(answer);
        }
        self.claim_through(key, fingerprint, self.inner.claim(key, fingerprint, owner, lease)).await
    }

    async fn claim_waiting(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Claim, StoreError> {
        if let Some(answer) = self.answer(key, fingerprint) {
            return Ok(answer);
        }
        let claim = self.inner.claim_waiting(key, fingerprint, owner, lease);
        self.claim_through(key, fingerprint, claim).await
    }

    async fn subscribe(&self, key: &RecordKey) -> Subscription {
        self.inner.subscribe(key).await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        fingerprint: &Fingerprint,
        response: Bytes,
        retention: Duration,
    ) -> Result<Fenced, StoreError> {
        // Not copied here: most records are never asked for again, and a copy of each would
        // cost the fresh path its allocations. The first retry copies it.
        self.inner.complete(key, owner, fingerprint, response, retention).await
    }

    async fn release(&self, key: &RecordKey, owner: &OwnerToken) -> Result<Fenced, StoreError> {
        self.inner.release(key, owner).await
    }

    async fn abandon(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        fingerprint: &Fingerprint,
        lease: Lease,
    ) -> Result<Fenced, StoreError> {
        self.inner.abandon(key, owner, fingerprint, lease).await
    }

    async fn touch(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Fenced, StoreError> {
        self.inner.touch(key, owner, lease).await
    }

    fn commits_in_transactions(&self) -> bool {
        self.inner.commits_in_transactions()
    }

    fn placement(&self) -> Option<(String, Option<(String, crate::hashing::Deploy)>)> {
        self.inner.placement()
    }

    fn moves(&self, key: &RecordKey) -> Option<crate::hashing::Deploy> {
        self.inner.moves(key)
    }

    async fn announce(
        &self,
        registry: &RecordKey,
        entries: &[(String, Duration)],
    ) -> Result<Option<Vec<String>>, StoreError> {
        self.inner.announce(registry, entries).await
    }
}

impl<St: Admin> Admin for CachingStore<St> {
    async fn inspect(
        &self,
        key: &RecordKey,
        with_outcome: bool,
    ) -> Result<Option<Inspection>, StoreError> {
        self.inner.inspect(key, with_outcome).await
    }

    /// Forgets the record in the inner store, and this process's copy of it. Other processes'
    /// copies are replayed until their [`max_age`](CachingStore::max_age).
    async fn forget(&self, key: &RecordKey, force: bool) -> Result<Forgotten, StoreError> {
        self.lock().remove(key.as_str());
        self.inner.forget(key, force).await
    }

    async fn abandoned(
        &self,
        lapsed_for: Duration,
        limit: u32,
    ) -> Result<Vec<AbandonedClaim>, StoreError> {
        self.inner.abandoned(lapsed_for, limit).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    fn fp(body: &str) -> Fingerprint {
        Fingerprint::new("POST", "/", "", body.as_bytes())
    }

    async fn completed(store: &CachingStore<MemoryStore>, name: &str, body: usize) -> RecordKey {
        let key = RecordKey::new("t", b"", name.as_bytes());
        let owner = OwnerToken::random();
        let long = Duration::from_secs(60);
        assert_eq!(store.claim(&key, &fp("1"), &owner, long.into()).await.unwrap(), Claim::Claimed);
        let response = Bytes::from(vec![b'r'; body]);
        store.complete(&key, &owner, &fp("1"), response, long).await.unwrap();
        // The first replay copies it.
        let replay = store.claim(&key, &fp("1"), &OwnerToken::random(), long.into()).await;
        assert!(matches!(replay.unwrap(), Claim::Replay { .. }));
        key
    }

    #[tokio::test]
    async fn the_oldest_copies_go_first_past_the_byte_bound() {
        let entry = 1000 + ENTRY_OVERHEAD + RecordKey::new("t", b"", b"k0").as_str().len();
        let store = CachingStore::new(MemoryStore::new()).max_bytes(3 * entry);
        let mut keys = Vec::new();
        for i in 0..5 {
            keys.push(completed(&store, &format!("k{i}"), 1000).await);
        }
        assert_eq!(store.cached(), 3);
        assert_eq!(store.lock().bytes, 3 * entry);
        let held: Vec<bool> =
            keys.iter().map(|k| store.lock().entries.contains_key(k.as_str())).collect();
        assert_eq!(held, [false, false, true, true, true]);
        // A response larger than the whole cache is never kept, and evicts nothing.
        let big = CachingStore::new(MemoryStore::new()).max_bytes(600);
        let small = completed(&big, "small", 10).await;
        completed(&big, "big", 1000).await;
        assert_eq!(big.cached(), 1);
        assert!(big.lock().entries.contains_key(small.as_str()));
    }

    #[tokio::test]
    async fn churn_on_one_key_keeps_the_queue_bounded() {
        let store = CachingStore::new(MemoryStore::new());
        let key = RecordKey::new("t", b"", b"same");
        let response = Bytes::from_static(b"r");
        for _ in 0..1000 {
            store.keep(&key, &fp("1"), &response, Instant::now(), Duration::from_secs(60));
        }
        let queued = store.lock().order.len();
        let cached = store.cached();
        assert!(queued <= 2 * cached + 65, "{queued} queued for {cached} entries");
        assert_eq!(store.cached(), 1);
    }
}
