//! A claim answered after its lease could no longer be held: the model's counterexample
//! (`tests/model.rs`, `a_claim_answered_too_late_runs_after_a_response_was_stored`) as a test.
//! The claim is applied at once and its answer comes a lease later (its process paused with
//! the answer on the wire); meanwhile a retry takes the lapsed key over, runs and stores its
//! response. The late answer is abandoned, never run, and the key claimed again: the first
//! client gets the response stored, as every later retry does; one run.

use crate::common;

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use axum_idempotency::{
    Fingerprint, IdempotencyLayer, MemoryStore,
    settings::Waiting,
    store::{Claim, Fenced, Lease, OwnerToken, RecordKey, Store, StoreError},
};
use bytes::Bytes;
use common::*;

const LEASE: Duration = Duration::from_millis(300);

/// A `MemoryStore` whose first claim is applied at once and answered `delay` later (every
/// claim, when `every`); it counts the claims.
#[derive(Clone)]
struct LateFirstAnswer {
    inner: MemoryStore,
    delay: Duration,
    delayed: Arc<AtomicBool>,
    every: bool,
    claims: Arc<std::sync::atomic::AtomicUsize>,
}

impl LateFirstAnswer {
    fn new(delay: Duration, every: bool) -> Self {
        let (delayed, claims) = (Arc::default(), Arc::default());
        Self { inner: MemoryStore::new(), delay, delayed, every, claims }
    }
}

impl Store for LateFirstAnswer {
    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Claim, StoreError> {
        let claim = self.inner.claim(key, fingerprint, owner, lease).await;
        self.claims.fetch_add(1, Ordering::SeqCst);
        if !self.delayed.swap(true, Ordering::SeqCst) || self.every {
            tokio::time::sleep(self.delay).await;
        }
        claim
    }

    async fn complete(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        fingerprint: &Fingerprint,
        response: Bytes,
        retention: Duration,
    ) -> Result<Fenced, StoreError> {
        self.inner.complete(key, owner, fingerprint, response, retention).await
    }

    async fn release(&self, key: &RecordKey, owner: &OwnerToken) -> Result<Fenced, StoreError> {
        self.inner.release(key, owner).await
    }

    async fn touch(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Fenced, StoreError> {
        self.inner.touch(key, owner, lease).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_answered_after_its_lease_is_abandoned_not_run() {
    let store = LateFirstAnswer::new(LEASE * 2, false);
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(store).lease(LEASE));
    let late = send_in_background(&app, keyed("POST", "/payments", "k1", "{}"));
    // Past the lease, which nobody renewed: the retry takes the key over, runs and stores.
    tokio::time::sleep(LEASE + LEASE / 6).await;
    let retry = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    assert_eq!((retry.status.as_u16(), retry.replayed()), (201, false), "{retry:?}");
    let late = late.await.unwrap();
    assert_eq!(calls.get(), 1, "the late claim ran the handler after a response was stored");
    assert_eq!((late.status.as_u16(), &late.body, late.replayed()), (201, &retry.body, true));
    let again = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    assert_eq!((again.status.as_u16(), &again.body, again.replayed()), (201, &retry.body, true));
}

/// Nobody else asks: the one request's claim is answered a little late (past the lease less its
/// renewal period), on a current-thread runtime, waiting off. Its claim is abandoned before the
/// key is claimed again, so the claim again takes it and runs: 201, one run (a reviewer saw 202
/// for a request nothing ran, the second claim finding the first still held).
#[tokio::test]
async fn a_lone_request_whose_claim_came_a_little_late_runs_once() {
    let store = LateFirstAnswer::new(LEASE * 11 / 15, false);
    let calls = Calls::default();
    let layer = IdempotencyLayer::new(store.clone()).lease(LEASE).waiting(Waiting::off());
    let app = app(&calls).layer(layer);
    let seen = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    assert_eq!((seen.status.as_u16(), seen.replayed()), (201, false), "{seen:?}");
    assert_eq!((calls.get(), store.claims.load(Ordering::SeqCst)), (1, 2));
}

/// A store that answers every claim past what the lease allows: each request is 503 after two
/// claims (never 202 for work nothing runs, never a loop of claims until the wait ends).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_too_slow_for_the_lease_is_503_after_two_claims() {
    let store = LateFirstAnswer::new(LEASE * 11 / 15, true);
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(store.clone()).lease(LEASE));
    let started = std::time::Instant::now();
    for key in ["a", "b", "c"] {
        let seen = send(&app, keyed("POST", "/payments", key, "{}")).await;
        seen.assert_problem(503, "store-unavailable");
    }
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
    assert_eq!((calls.get(), store.claims.load(Ordering::SeqCst)), (0, 6));
}

/// Leases of a few milliseconds (no longer than their renewal period) still run.
#[tokio::test]
async fn leases_of_a_few_milliseconds_still_run() {
    for ms in [1, 2, 3] {
        let calls = Calls::default();
        let layer = IdempotencyLayer::new(MemoryStore::new()).lease(Duration::from_millis(ms));
        let seen = send(&app(&calls).layer(layer), keyed("POST", "/payments", "k", "{}")).await;
        assert_eq!((seen.status.as_u16(), calls.get()), (201, 1), "lease {ms} ms: {seen:?}");
    }
}
