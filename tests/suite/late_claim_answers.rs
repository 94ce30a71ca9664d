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
    store::{Claim, Fenced, Lease, OwnerToken, RecordKey, Store, StoreError},
};
use bytes::Bytes;
use common::*;

const LEASE: Duration = Duration::from_millis(300);

/// A `MemoryStore` whose first claim is applied at once and answered `delay` later.
#[derive(Clone)]
struct LateFirstAnswer {
    inner: MemoryStore,
    delay: Duration,
    delayed: Arc<AtomicBool>,
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
        if !self.delayed.swap(true, Ordering::SeqCst) {
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
    let store =
        LateFirstAnswer { inner: MemoryStore::new(), delay: LEASE * 2, delayed: Arc::default() };
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
