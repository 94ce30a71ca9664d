//! An instance of a move's deploy (`Hashing::moving_to`) dies between its two claims, or
//! between its two completes, on every store: the retries on its neighbours, and on its own
//! deploy, run the request once, and every one after a response was stored replays it.
//!
//! The crash is a process's, in process: from the step it dies at, nothing more of the
//! instance reaches the store (the store applied that step; its answer, every renewal, every
//! guard's abandon and release are never sent), as when the process is killed.
//!
use crate::common;

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{Router, body::Bytes};
use axum_idempotency::{
    Fingerprint, IdempotencyLayer,
    hashing::{Deploy, Hashing},
    store::{Claim, Fenced, Lease, OwnerToken, RecordKey, Store, StoreError, Subscription},
};
use common::*;

every_store!(a_crash_between_a_moves_claims_or_completes_runs_the_request_once);

const SECRET: [u8; 32] = [0x5e; 32];
const LEASE: Duration = Duration::from_millis(400);

/// Where the instance dies: after the store applied this many claims, or completes.
#[derive(Clone, Copy, Debug)]
enum Step {
    Claims(usize),
    Completes(usize),
}

/// A store that, once `step` is applied, never answers again, nor sends anything more.
#[derive(Clone)]
struct Dies<S> {
    inner: S,
    step: Step,
    claims: Arc<AtomicUsize>,
    completes: Arc<AtomicUsize>,
    dead: Arc<AtomicBool>,
}

impl<S> Dies<S> {
    fn new(inner: S, step: Step) -> Self {
        let (claims, completes) = (Arc::default(), Arc::default());
        Self { inner, step, claims, completes, dead: Arc::default() }
    }

    async fn alive(&self) {
        if self.dead.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
    }

    /// After an applied step: dies there when it is the one, its answer never heard.
    async fn applied(&self, counter: &AtomicUsize, is_it: impl Fn(usize) -> bool) {
        if is_it(counter.fetch_add(1, Ordering::SeqCst) + 1) {
            self.dead.store(true, Ordering::SeqCst);
        }
        self.alive().await;
    }
}

impl<S: Store> Store for Dies<S> {
    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Claim, StoreError> {
        self.alive().await;
        let claim = self.inner.claim(key, fingerprint, owner, lease).await;
        let step = self.step;
        self.applied(&self.claims, |n| matches!(step, Step::Claims(at) if at == n)).await;
        claim
    }

    async fn claim_waiting(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Claim, StoreError> {
        self.claim(key, fingerprint, owner, lease).await
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
        self.alive().await;
        let completed = self.inner.complete(key, owner, fingerprint, response, retention).await;
        let step = self.step;
        self.applied(&self.completes, |n| matches!(step, Step::Completes(at) if at == n)).await;
        completed
    }

    async fn release(&self, key: &RecordKey, owner: &OwnerToken) -> Result<Fenced, StoreError> {
        self.alive().await;
        self.inner.release(key, owner).await
    }

    async fn abandon(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        fingerprint: &Fingerprint,
        lease: Lease,
    ) -> Result<Fenced, StoreError> {
        self.alive().await;
        self.inner.abandon(key, owner, fingerprint, lease).await
    }

    async fn touch(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Fenced, StoreError> {
        self.alive().await;
        self.inner.touch(key, owner, lease).await
    }

    fn commits_in_transactions(&self) -> bool {
        self.inner.commits_in_transactions()
    }

    async fn announce(
        &self,
        registry: &RecordKey,
        entries: &[(String, Duration)],
    ) -> Result<Option<Vec<String>>, StoreError> {
        self.alive().await;
        self.inner.announce(registry, entries).await
    }
}

fn build(deploy: usize) -> Hashing {
    let keyed = || Hashing::keyed(SECRET);
    match deploy {
        0 => Hashing::plain(),
        1 => Hashing::plain().moving_to(keyed(), Deploy::First).unwrap(),
        2 => Hashing::plain().moving_to(keyed(), Deploy::Second).unwrap(),
        _ => keyed(),
    }
}

/// An instance of `deploy`, in `fleet` (a key prefix each: the fleet's registry remembers
/// what ran, and refuses deploy 3 while deploy 1's records may live, rightly).
fn instance<S: Store>(store: S, calls: &Calls, deploy: usize, fleet: usize) -> Router {
    let layer = IdempotencyLayer::new(store).key_prefix(format!("moving-{fleet}"));
    app(calls).layer(layer.hashing(build(deploy)).lease(LEASE))
}

async fn a_crash_between_a_moves_claims_or_completes_runs_the_request_once<H: Harness>(h: H) {
    // Deploy 1 runs beside deploys 0 and 2; deploy 2 beside 1 and 3. Each dies after its
    // first claim, after its second, and after its first complete.
    let steps = [Step::Claims(1), Step::Claims(2), Step::Completes(1)];
    let mut case = 0;
    for dying in [1, 2] {
        let outer = if dying == 1 { 0 } else { 3 };
        // The retries, in every order of two neighbouring deploys (the deploys either side of
        // the dying one never run side by side: the fleet's registry refuses them).
        let orders = [[outer, dying], [dying, outer], [dying, 3 - dying], [3 - dying, dying]];
        for step in steps {
            for order in orders {
                case += 1;
                let key: &'static str = Box::leak(format!("k{case}").into_boxed_str());
                let calls = Calls::default();
                let fleet = case;
                let dies = instance(Dies::new(h.store(), step), &calls, dying, fleet);
                let died = send_in_background(&dies, keyed("POST", "/payments", key, "{}"));
                let ran_before = match step {
                    Step::Completes(_) => 1,
                    Step::Claims(_) => 0,
                };
                // Dead at its step: the handler ran only when it died completing.
                tokio::time::sleep(Duration::from_millis(200)).await;
                assert!(!died.is_finished(), "{dying} {step:?}: the instance answered");
                died.abort();
                assert_eq!(calls.get(), ran_before, "deploy {dying} {step:?}");
                // Its claims lapse; then a retry on each deploy of the order.
                tokio::time::sleep(LEASE * 2).await;
                let mut answers = Vec::new();
                for deploy in order {
                    let retry = instance(h.store(), &calls, deploy, fleet);
                    let seen = send(&retry, keyed("POST", "/payments", key, "{}")).await;
                    let case = format!("deploy {dying} died at {step:?}, retries on {order:?}");
                    assert_eq!(seen.status, 201, "{case}: {seen:?}");
                    answers.push(seen);
                }
                assert_eq!(calls.get(), 1, "deploy {dying} died at {step:?}, {order:?}: run again");
                let first = &answers[0].body;
                assert!(answers.iter().all(|seen| &seen.body == first), "{answers:?}");
                // What ran before the crash was stored: the first retry replays it too.
                let replays = if ran_before == 1 { &answers[..] } else { &answers[1..] };
                assert!(replays.iter().all(Seen::replayed), "{dying} {step:?}: {answers:?}");
            }
        }
    }
}
