//! Duplicates of one request that reach neighbouring deploys of a move (`Hashing::alongside`)
//! at the same moment: each claims its own names, then looks at the other's, and finds the
//! other's claim there. One of the two must still run the request, and never both.

use crate::common;

use std::{
    collections::HashSet,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use axum::{Router, body::Bytes};
use axum_idempotency::{
    Fingerprint, IdempotencyLayer, MemoryStore,
    hashing::Hashing,
    settings::Waiting,
    store::{Claim, Fenced, Lease, OwnerToken, RecordKey, Store, StoreError, Subscription},
};
use common::*;

const SECRET: [u8; 32] = [0x5e; 32];

/// A memory store whose first claim won under each name is answered only once a claim has
/// been won under two names, and whose first claim found in progress under each name only once
/// two have been: the two requests of neighbouring deploys both look at the other's names after
/// both claimed their own, and both find the other's claim there, the collision that is
/// otherwise a matter of timing. It
/// can also hold its first waiting claim for `pause` before it lands (a pause of the process,
/// or of the network, past the claim's lease), and start every name with a lapsed claim.
#[derive(Clone)]
struct Crossing {
    inner: MemoryStore,
    met: Arc<Mutex<HashSet<(String, &'static str)>>>,
    both_claimed: Arc<tokio::sync::Barrier>,
    both_looked: Arc<tokio::sync::Barrier>,
    pause: Option<Duration>,
    paused: Arc<AtomicBool>,
    /// Every name first holds a lapsed claim, kept for its window: an instance of each deploy
    /// died mid-request, so that each request takes a claim over.
    lapsed: Option<Arc<Mutex<HashSet<String>>>>,
}

impl Crossing {
    fn new(inner: MemoryStore, pause: Option<Duration>, lapsed: bool) -> Self {
        Self {
            inner,
            met: Arc::default(),
            both_claimed: Arc::new(tokio::sync::Barrier::new(2)),
            both_looked: Arc::new(tokio::sync::Barrier::new(2)),
            pause,
            paused: Arc::default(),
            lapsed: lapsed.then(Arc::default),
        }
    }
}

impl Store for Crossing {
    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Claim, StoreError> {
        if let Some(lapsed) = &self.lapsed
            && lapsed.lock().unwrap().insert(key.as_str().to_owned())
        {
            let died =
                Lease::new(Duration::from_millis(1)).recovery_window(Duration::from_secs(60));
            self.inner.claim(key, fingerprint, &OwnerToken::random(), died).await.unwrap();
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let claimed = self.inner.claim(key, fingerprint, owner, lease).await;
        let (meeting, barrier) = match claimed {
            Ok(Claim::Claimed | Claim::TakenOver) => ("claimed", &self.both_claimed),
            Ok(Claim::InProgress { .. }) => ("looked", &self.both_looked),
            _ => return claimed,
        };
        if self.met.lock().unwrap().insert((key.as_str().to_owned(), meeting)) {
            // Bounded: a request that never comes fails the test's assertions, not its time.
            let crossed = tokio::time::timeout(Duration::from_secs(5), barrier.wait()).await;
            assert!(crossed.is_ok(), "the neighbouring deploy's request never {meeting}");
        }
        claimed
    }

    async fn claim_waiting(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Claim, StoreError> {
        if let Some(pause) = self.pause
            && !self.paused.swap(true, Ordering::SeqCst)
        {
            tokio::time::sleep(pause).await;
        }
        self.inner.claim_waiting(key, fingerprint, owner, lease).await
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

/// An instance of deploy 1 (`plain().alongside(keyed)`) and one of deploy 2
/// (`keyed.alongside(plain())`) over `store`.
fn neighbours(store: &Crossing, calls: &Calls, lease: Duration) -> [Router; 2] {
    let deploy = |hashing: Hashing| {
        let layer = IdempotencyLayer::new(store.clone())
            .hashing(hashing)
            .lease(lease)
            .waiting(Waiting::up_to(Duration::from_secs(2)));
        app(calls).layer(layer)
    };
    [
        deploy(Hashing::plain().alongside(Hashing::keyed(SECRET)).unwrap()),
        deploy(Hashing::keyed(SECRET).alongside(Hashing::plain()).unwrap()),
    ]
}

/// Both requests claim their own names before either looks at the other's. Were both to let
/// go, both would be answered 202, the handler never run, and so would every duplicate after
/// them that met the same way (neighbouring deploys' waiters, woken together by the two
/// releases). One of the two keeps its claim and waits for the other's to be let go: it runs
/// the request, the other is told it is in progress, and both replay it after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_whose_claims_cross_on_neighbouring_deploys_run_once() {
    let store = Crossing::new(MemoryStore::new(), None, false);
    let calls = Calls::default();
    let deploys = neighbours(&store, &calls, Duration::from_secs(5));
    let sent =
        deploys.each_ref().map(|d| send_in_background(d, keyed("POST", "/payments", "k1", "{}")));
    let [first, second] = sent;
    let seen = [first.await.unwrap(), second.await.unwrap()];
    let originals: Vec<_> = seen.iter().filter(|s| s.status == 201 && !s.replayed()).collect();
    assert_eq!(originals.len(), 1, "{seen:?}");
    let other = seen.iter().find(|s| s.status != 201).expect("one was not run");
    other.assert_problem(202, "in-progress");
    assert_eq!(calls.get(), 1);
    for deploy in &deploys {
        let retry = send(deploy, keyed("POST", "/payments", "k1", "{}")).await;
        assert!(retry.replayed(), "{retry:?}");
        assert_eq!(retry.body, originals[0].body);
    }
    assert_eq!(calls.get(), 1);
}

/// The one that keeps its claim is paused while it waits (its waiting claim lands past its
/// lease): meanwhile its claim lapses, and a third duplicate takes the request over and runs
/// it. When the pause ends, the claim it kept is no longer its own: it must not run too,
/// whether the other names are then free, or hold a lapsed claim it takes over (each deploy
/// had an instance die mid-request before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_kept_through_a_pause_past_its_lease_does_not_run_after_a_takeover() {
    for lapsed in [false, true] {
        kept_through_a_pause(lapsed).await;
    }
}

async fn kept_through_a_pause(lapsed: bool) {
    let store = Crossing::new(MemoryStore::new(), Some(Duration::from_millis(1500)), lapsed);
    let calls = Calls::default();
    let lease = Duration::from_millis(300);
    let deploys = neighbours(&store, &calls, lease);
    let sent =
        deploys.each_ref().map(|d| send_in_background(d, keyed("POST", "/payments", "k1", "{}")));
    // Past both claims' leases (and the one the kept claim's look made), within the pause.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let third = send(&deploys[1], keyed("POST", "/payments", "k1", "{}")).await;
    assert_eq!((third.status.as_u16(), third.replayed()), (201, false), "{lapsed}: {third:?}");
    let [first, second] = sent;
    let seen = [first.await.unwrap(), second.await.unwrap()];
    for crossed in &seen {
        assert!(crossed.status == 202 || crossed.replayed(), "{lapsed}: run twice: {seen:?}");
    }
    assert_eq!(calls.get(), 1, "{lapsed}: {seen:?}");
    for deploy in &deploys {
        let retry = send(deploy, keyed("POST", "/payments", "k1", "{}")).await;
        assert!(retry.replayed(), "{retry:?}");
        assert_eq!(retry.body, third.body);
    }
    assert_eq!(calls.get(), 1);
}
