//! The store conformance kit, run as a third-party store would run it: `ledger::*` is a store
//! written here against the crate's public API alone (`LedgerStore`); `memory::*` is the
//! crate's `MemoryStore` through the same macro; the Redis stores run `check_all` against a
//! private server each. A broken ledger (no fencing, no recovery window) shows that the kit
//! fails a store that breaks the contract.

#[macro_use]
mod common;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use axum_idempotency::{
    Fingerprint, MemoryStore, conformance,
    store::{
        Claim, Fenced, Lease, OwnerToken, RecordKey, Store, StoreError, Subscription, Waiters,
    },
};
use bytes::Bytes;

/// A store of records in a map, as a third-party crate would write one: only the public API.
#[derive(Clone, Default)]
struct LedgerStore {
    records: Arc<Mutex<HashMap<String, Record>>>,
    waiters: Waiters,
    /// The fleets' registries: each entry until its time.
    fleet: Arc<Mutex<HashMap<String, HashMap<String, Instant>>>>,
    /// What a broken store would get wrong, for the kit to catch.
    broken: Broken,
}

#[derive(Clone, Copy, Default)]
struct Broken {
    /// complete, release and touch ignore the owner token.
    unfenced: bool,
    /// A lapsed claim is forgotten at once, whatever its recovery window.
    no_window: bool,
    /// No registry of the fleet (`announce` answers `None`, as by default).
    no_registry: bool,
}

struct Record {
    fingerprint: Fingerprint,
    state: State,
    /// When the record is gone: the end of the retention, or of the lease and its window.
    expires: Instant,
}

enum State {
    InProgress { owner: OwnerToken, deadline: Instant },
    Completed(Bytes),
}

impl LedgerStore {
    fn broken(broken: Broken) -> Self {
        Self { broken, ..Self::default() }
    }

    /// The live records, expired ones swept out first.
    fn live(&self) -> std::sync::MutexGuard<'_, HashMap<String, Record>> {
        let mut records = self.records.lock().unwrap();
        let now = Instant::now();
        records.retain(|_, record| record.expires > now);
        records
    }

    fn in_progress(&self, owner: &OwnerToken, lease: Lease, fingerprint: Fingerprint) -> Record {
        let deadline = Instant::now() + lease.duration;
        let window = if self.broken.no_window { Duration::ZERO } else { lease.recovery_window };
        let state = State::InProgress { owner: owner.clone(), deadline };
        Record { fingerprint, state, expires: deadline + window }
    }

    fn holds(&self, record: &Record, owner: &OwnerToken) -> bool {
        matches!(&record.state, State::InProgress { owner: held, .. }
            if held == owner || self.broken.unfenced)
    }
}

impl Store for LedgerStore {
    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Claim, StoreError> {
        let mut records = self.live();
        let now = Instant::now();
        let claim = match records.get(key.as_str()) {
            None => Claim::Claimed,
            Some(record) if record.fingerprint != *fingerprint => return Ok(Claim::Mismatch),
            Some(Record { state: State::Completed(response), expires, .. }) => {
                return Ok(Claim::Replay { response: response.clone(), remaining: *expires - now });
            }
            Some(Record { state: State::InProgress { deadline, .. }, .. }) if *deadline > now => {
                return Ok(Claim::InProgress { remaining: *deadline - now });
            }
            Some(_) => Claim::TakenOver,
        };
        records
            .insert(key.as_str().to_owned(), self.in_progress(owner, lease, fingerprint.clone()));
        Ok(claim)
    }

    async fn complete(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        fingerprint: &Fingerprint,
        response: Bytes,
        retention: Duration,
    ) -> Result<Fenced, StoreError> {
        let mut records = self.live();
        let applies = match records.get(key.as_str()) {
            None => true,
            Some(Record { state: State::Completed(stored), fingerprint: fp, .. }) => {
                // The same outcome already stored: an earlier attempt landed.
                if *stored == response && fp == fingerprint {
                    return Ok(Fenced::Applied);
                }
                false
            }
            Some(record) => self.holds(record, owner),
        };
        if !applies {
            return Ok(Fenced::Rejected);
        }
        let expires = Instant::now() + retention;
        let record =
            Record { fingerprint: fingerprint.clone(), state: State::Completed(response), expires };
        records.insert(key.as_str().to_owned(), record);
        drop(records);
        self.waiters.notify(key.as_str());
        Ok(Fenced::Applied)
    }

    async fn release(&self, key: &RecordKey, owner: &OwnerToken) -> Result<Fenced, StoreError> {
        let mut records = self.live();
        match records.get(key.as_str()) {
            Some(record) if self.holds(record, owner) => {
                records.remove(key.as_str());
                drop(records);
                self.waiters.notify(key.as_str());
                Ok(Fenced::Applied)
            }
            _ => Ok(Fenced::Rejected),
        }
    }

    async fn touch(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Fenced, StoreError> {
        let mut records = self.live();
        match records.get_mut(key.as_str()) {
            Some(record) if self.holds(record, owner) => {
                *record = self.in_progress(owner, lease, record.fingerprint.clone());
                Ok(Fenced::Applied)
            }
            _ => Ok(Fenced::Rejected),
        }
    }

    async fn subscribe(&self, key: &RecordKey) -> Subscription {
        self.waiters.register(key.as_str(), None).0
    }

    async fn announce(
        &self,
        registry: &RecordKey,
        entries: &[(String, Duration)],
    ) -> Result<Option<Vec<String>>, StoreError> {
        if self.broken.no_registry {
            return Ok(None);
        }
        let now = Instant::now();
        let mut fleet = self.fleet.lock().unwrap();
        let listed = fleet.entry(registry.as_str().to_owned()).or_default();
        listed.retain(|_, until| *until > now);
        for (entry, lasts) in entries {
            let until = now + *lasts;
            let kept = listed.entry(entry.clone()).or_insert(until);
            *kept = (*kept).max(until);
        }
        Ok(Some(listed.keys().cloned().collect()))
    }
}

/// The way the `conformance` module's docs (and CONTRIBUTING.md) tell a third-party store to run
/// the kit.
mod ledger {
    async fn store() -> super::LedgerStore {
        super::LedgerStore::default()
    }

    axum_idempotency::store_conformance_tests!(store);
}

mod memory {
    async fn store() -> axum_idempotency::MemoryStore {
        axum_idempotency::MemoryStore::new()
    }

    axum_idempotency::store_conformance_tests!(store);
}

#[tokio::test]
async fn the_caching_store_over_memory_passes_the_kit() {
    conformance::check_all(&axum_idempotency::store::CachingStore::new(MemoryStore::new())).await;
}

#[tokio::test]
async fn the_memory_stores_pass_the_operators_check() {
    conformance::check_admin(&MemoryStore::new()).await;
    conformance::check_admin(&axum_idempotency::store::CachingStore::new(MemoryStore::new())).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stores_pass_the_kit() {
    let server = common::RedisServer::start();
    conformance::check_all(&server.store()).await;
    // Without a subscriber: waiters are polled, the answers are the same.
    conformance::check_all(&axum_idempotency::RedisStore::new(server.pool())).await;
    conformance::check_all(&axum_idempotency::store::CachingStore::new(server.store())).await;
    conformance::check_admin(&server.store()).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_stores_pass_the_kit() {
    use axum_idempotency::store::{CachingStore, PostgresStore};
    let harness = <common::PostgresHarness as common::Harness>::start().await;
    conformance::check_all(&common::Harness::store(&harness)).await;
    conformance::check_all(&CachingStore::new(common::Harness::store(&harness))).await;
    // A table of the app's choosing: its functions and channel follow its name.
    let named = PostgresStore::with_table(harness.pool(), "payment_keys").unwrap();
    named.migrate().await.unwrap();
    conformance::check_all(&named).await;
    conformance::check_admin(&named).await;
    conformance::check_admin(&common::Harness::store(&harness)).await;
}

#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_passes_the_kit() {
    let cluster = <common::ClusterHarness as common::Harness>::start().await;
    conformance::check_all(&common::Harness::store(&cluster)).await;
    conformance::check_admin(&common::Harness::store(&cluster)).await;
}

/// Runs one check against `store` and says whether it failed (panicked).
async fn fails<F: Future<Output = ()> + Send + 'static>(check: F) -> bool {
    tokio::spawn(check).await.is_err_and(|error| error.is_panic())
}

#[tokio::test]
async fn the_kit_fails_a_store_that_breaks_the_contract() {
    let unfenced = LedgerStore::broken(Broken { unfenced: true, ..Broken::default() });
    let no_window = LedgerStore::broken(Broken { no_window: true, ..Broken::default() });
    let sound = LedgerStore::default();
    let (a, b, c) = (unfenced.clone(), no_window.clone(), sound.clone());
    assert!(
        fails(async move {
            conformance::a_stale_holder_is_fenced_out_of_the_new_owners_claim(&a).await;
        })
        .await,
        "a store without fencing passed the fencing check"
    );
    assert!(
        fails(async move {
            conformance::a_lapsed_claim_within_its_recovery_window_is_taken_over(&b).await;
        })
        .await,
        "a store without recovery windows passed the takeover check"
    );
    let no_registry = LedgerStore::broken(Broken { no_registry: true, ..Broken::default() });
    assert!(
        fails(async move {
            conformance::the_fleet_registry_keeps_each_entry_for_its_time(&no_registry).await;
        })
        .await,
        "a store without a registry passed the registry check"
    );
    // The same checks pass the sound store: the failures above are the breakage's.
    assert!(!fails(async move { conformance::check_all(&c).await }).await);
}
