//! The request of neighbouring deploys that keeps its claim through a collision
//! (`tests/suite/hashing_collisions.rs`), then takes a lapsed claim over under the other names,
//! and renews its own before it runs: that renewal slow, or its caller gone while it is on the
//! wire. Nothing runs twice, and nothing stays held for a lease.

use crate::common;

use std::{
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
    recovery::{BoxError, Lookup, Recovered},
    settings::Waiting,
    store::{Claim, Fenced, Lease, OwnerToken, RecordKey, Store, StoreError, Subscription},
};
use common::*;
use http::Request;

const SECRET: [u8; 32] = [0x5e; 32];

/// A memory store that starts the other names (`b`) with a claim that lapses after `seed_b`
/// (an instance died mid-request), answers the first touch of our names (`a`) after
/// `touch_a` (sent: it lands then whether or not its caller still waits), and can answer
/// every claim late.
#[derive(Clone)]
struct Script {
    inner: MemoryStore,
    log: Arc<Mutex<Vec<String>>>,
    a: Arc<Mutex<Option<String>>>,
    b: Arc<Mutex<Option<String>>>,
    seed_b: Option<Duration>,
    seeded: Arc<AtomicBool>,
    touch_a: Option<Duration>,
    touched: Arc<AtomicBool>,
    /// Told when that touch has landed, before its answer goes back.
    touch_landed: Arc<tokio::sync::Notify>,
    /// every claim answered this late (its effect at once)
    late_claims: Option<Duration>,
}

impl Script {
    fn new(inner: MemoryStore) -> Self {
        Self {
            inner,
            log: Arc::default(),
            a: Arc::default(),
            b: Arc::default(),
            seed_b: None,
            seeded: Arc::default(),
            touch_a: None,
            touched: Arc::default(),
            touch_landed: Arc::default(),
            late_claims: None,
        }
    }
    fn is(&self, which: &Mutex<Option<String>>, key: &RecordKey) -> bool {
        which.lock().unwrap().as_deref() == Some(key.as_str())
    }
    async fn seed(&self, key: &RecordKey, fingerprint: &Fingerprint) {
        if let Some(seed) = self.seed_b
            && self.is(&self.b, key)
            && !self.seeded.swap(true, Ordering::SeqCst)
        {
            let died = Lease::new(seed).recovery_window(Duration::from_secs(60));
            let c = self.inner.claim(key, fingerprint, &OwnerToken::random(), died).await.unwrap();
            assert_eq!(c, Claim::Claimed);
        }
    }
}

impl Store for Script {
    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Claim, StoreError> {
        self.log.lock().unwrap().push(key.as_str().to_owned());
        self.seed(key, fingerprint).await;
        let c = self.inner.claim(key, fingerprint, owner, lease).await;
        if let Some(late) = self.late_claims {
            tokio::time::sleep(late).await;
        }
        c
    }

    async fn claim_waiting(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Claim, StoreError> {
        self.seed(key, fingerprint).await;
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
        if let Some(delay) = self.touch_a
            && self.is(&self.a, key)
            && !self.touched.swap(true, Ordering::SeqCst)
        {
            // Sent: it lands after `delay` whether or not its caller still waits.
            let (inner, key, owner) = (self.inner.clone(), key.clone(), owner.clone());
            let told = self.touch_landed.clone();
            let landed = tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                let touched = inner.touch(&key, &owner, lease).await;
                told.notify_one();
                touched
            });
            return landed.await.unwrap();
        }
        self.inner.touch(key, owner, lease).await
    }
}

fn hashings() -> [Hashing; 2] {
    [
        Hashing::plain().alongside(Hashing::keyed(SECRET)).unwrap(),
        Hashing::keyed(SECRET).alongside(Hashing::plain()).unwrap(),
    ]
}

/// Which deploy keeps (its own name sorts first): (kept deploy's hashing, other's, a, b).
async fn sides() -> (Hashing, Hashing, String, String) {
    let store = Script::new(MemoryStore::new());
    let calls = Calls::default();
    let [one, two] = hashings();
    let app1 = app(&calls).layer(IdempotencyLayer::new(store.clone()).hashing(one.clone()));
    send(&app1, delayed("/slow", "k1", 0, "{}")).await;
    let log = store.log.lock().unwrap().clone();
    let (own1, other1) = (log[0].clone(), log[1].clone());
    if own1 < other1 { (one, two, own1, other1) } else { (two, one, other1, own1) }
}

/// The kept request takes a lapsed claim over under `b` after its wait, and its fenced touch
/// of `a` is answered later than a lease. Keep-alive off, `b`'s takeover is not renewed: were
/// it run then, a retry of `b`'s deploy would take `b` over and run too. It gives up within a
/// third of its lease, and hands `b` back; keep-alive on, too (a store that slow is down).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_renewal_of_ours_after_a_takeover_under_the_other_names_runs_once() {
    for keep_alive in [None, Some(Duration::from_secs(60))] {
        slow_touch(keep_alive).await;
    }
}

async fn slow_touch(keep: Option<Duration>) {
    let (kept, other, a, b) = sides().await;
    let mut store = Script::new(MemoryStore::new());
    *store.a.lock().unwrap() = Some(a);
    *store.b.lock().unwrap() = Some(b);
    store.seed_b = Some(Duration::from_millis(40));
    store.touch_a = Some(Duration::from_millis(450));
    let calls = Calls::default();
    let deploy = |h: Hashing| {
        app(&calls).layer(
            IdempotencyLayer::new(store.clone())
                .hashing(h)
                .lease(Duration::from_millis(300))
                .keep_alive(keep)
                .waiting(Waiting::up_to(Duration::from_secs(2))),
        )
    };
    let (ka, kb) = (deploy(kept), deploy(other));
    let first = send_in_background(&ka, delayed("/slow", "k1", 600, "{}"));
    tokio::time::sleep(Duration::from_millis(700)).await;
    let second = send(&kb, delayed("/slow", "k1", 600, "{}")).await;
    let first = first.await.unwrap();
    assert_eq!(calls.get(), 1, "run twice ({keep:?}): {first:?} {second:?}");
    first.assert_problem(503, "store-unavailable");
    assert_eq!((second.status.as_u16(), second.replayed()), (201, false), "{second:?}");
}

/// A caller that goes away while the kept request's fenced touch of its own claim is on the
/// wire: were ours abandoned at once (its lapse kept: a hook is there), the touch would land
/// after it and lease ours again for a whole lease that nobody holds (the retry 202). It is
/// let go once the touch has landed: whether the caller went away before the touch's answer,
/// or just after it, the answer sent and never read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_gone_while_ours_is_renewed_after_the_look_leaves_nothing_held() {
    for answered in [false, true] {
        caller_gone_during_the_renewal(answered).await;
    }
}

async fn caller_gone_during_the_renewal(answered: bool) {
    let (kept, _other, a, b) = sides().await;
    let mut store = Script::new(MemoryStore::new());
    *store.a.lock().unwrap() = Some(a);
    *store.b.lock().unwrap() = Some(b);
    store.seed_b = Some(Duration::from_millis(40));
    store.touch_a = Some(Duration::from_millis(300));
    let calls = Calls::default();
    let hook = |_: Lookup<Request<Bytes>>| async { Ok::<_, BoxError>(Recovered::Unknown) };
    let layer = |w: Waiting| {
        IdempotencyLayer::new(store.clone())
            .hashing(kept.clone())
            .lease(Duration::from_secs(3))
            .recover(hook)
            .waiting(w)
    };
    let ka: Router = app(&calls).layer(layer(Waiting::up_to(Duration::from_secs(5))));
    let mut request = Box::pin(send(&ka, delayed("/slow", "k1", 0, "{}")));
    if answered {
        // Not polled again once the touch has landed: its answer reaches nobody.
        tokio::select! {
            biased;
            () = store.touch_landed.notified() => {}
            seen = &mut request => panic!("answered: {seen:?}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    } else {
        let gone = tokio::time::timeout(Duration::from_millis(150), &mut request).await;
        assert!(gone.is_err(), "{gone:?}");
    }
    drop(request);
    tokio::time::sleep(Duration::from_millis(600)).await;
    let kn: Router = app(&calls).layer(layer(Waiting::off()));
    let retry = send(&kn, delayed("/slow", "k1", 0, "{}")).await;
    assert_eq!(retry.status.as_u16(), 201, "{answered}: {retry:?}");
}
