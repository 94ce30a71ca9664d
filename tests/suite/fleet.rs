//! The store knows its fleet (`Store::announce`): an instance whose naming cannot serve beside
//! what its fleet's registry lists is refused (503 `fleet-disagrees`, nothing run), on every
//! store, for each step an operator in a hurry skips during a move between namings; and an
//! instance refused at start leaves the fleet it was refused by serving.

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
    Fingerprint, IdempotencyLayer, Idempotent, MemoryStore,
    consumer::{Error, Outcome},
    hashing::{Deploy, Hashing},
    store::{Admin, Claim, Fenced, Lease, OwnerToken, RecordKey, Store, StoreError, Subscription},
};
use common::*;

every_store!(
    each_hurried_step_is_refused_and_runs_nothing,
    a_door_refused_at_start_leaves_its_fleet_serving
);

fn keyed(byte: u8) -> Hashing {
    Hashing::keyed([byte; 32])
}

fn moving(from: Hashing, to: Hashing, deploy: Deploy) -> Hashing {
    from.moving_to(to, deploy).unwrap()
}

/// An instance in the fleet whose keys have `prefix`.
fn instance<H: Harness>(h: &H, calls: &Calls, prefix: &str, hashing: Hashing) -> Router {
    app(calls).layer(IdempotencyLayer::new(h.store()).key_prefix(prefix).hashing(hashing))
}

async fn each_hurried_step_is_refused_and_runs_nothing<H: Harness>(h: H) {
    let plain = Hashing::plain;
    // (what runs, what starts beside it): each is refused.
    let hurried = [
        // The naming changed in one deploy.
        (plain(), keyed(1)),
        // Deploy 1 skipped; deploy 2 skipped.
        (plain(), moving(plain(), keyed(1), Deploy::Second)),
        (moving(plain(), keyed(1), Deploy::First), keyed(1)),
        // Another secret during deploy 2.
        (moving(plain(), keyed(1), Deploy::Second), moving(plain(), keyed(3), Deploy::Second)),
        // A rotation begun during deploy 1.
        (moving(plain(), keyed(1), Deploy::First), moving(keyed(1), keyed(2), Deploy::First)),
        // A rollback too far: deploy 2 runs, deploy 0 starts.
        (moving(plain(), keyed(1), Deploy::Second), plain()),
    ];
    for (i, (running, starting)) in hurried.into_iter().enumerate() {
        let (calls, prefix) = (Calls::default(), format!("hurry-{i}"));
        let running = instance(&h, &calls, &prefix, running);
        let ran = send(&running, common::keyed("POST", "/payments", "k1", "{}")).await;
        assert_eq!(ran.status, 201, "case {i}");
        let starting = instance(&h, &calls, &prefix, starting);
        for key in ["k1", "k2"] {
            let refused = send(&starting, common::keyed("POST", "/payments", key, "{}")).await;
            refused.assert_problem(503, "fleet-disagrees");
            assert_eq!(refused.header("retry-after"), Some("1"), "case {i}");
        }
        assert_eq!(calls.get(), 1, "case {i}: nothing runs on the instance refused");
        // Failing open does not pass a refused request through.
        let open =
            IdempotencyLayer::new(h.store()).key_prefix(&prefix).hashing(keyed(9)).fail_open(true);
        let open = app(&calls).layer(open);
        let refused = send(&open, common::keyed("POST", "/payments", "k3", "{}")).await;
        refused.assert_problem(503, "fleet-disagrees");
        assert_eq!(calls.get(), 1, "case {i}: failing open ran it");
    }
    // The consumer door: a typed error that says which step is missing.
    let first = Idempotent::new(h.store()).hashing(moving(plain(), keyed(1), Deploy::First));
    let ran = first.run("orders", "evt-1", b"{}", |_| async { Ok::<_, String>(1_u32) }).await;
    assert!(ran.is_ok(), "{ran:?}");
    let new = Idempotent::new(h.store()).hashing(keyed(1));
    let refused = new.run("orders", "evt-2", b"{}", |_| async { Ok::<_, String>(2_u32) }).await;
    let Err(Error::Store(StoreError::Misplaced(why))) = refused else { panic!("{refused:?}") };
    assert!(why.contains("`Deploy::Second`) is missing"), "{why}");
}

async fn a_door_refused_at_start_leaves_its_fleet_serving<H: Harness>(h: H)
where
    H::Store: Admin,
{
    let calls = Calls::default();
    let prefix = "refused-at-start";
    let first = instance(&h, &calls, prefix, moving(Hashing::plain(), keyed(1), Deploy::First));
    assert_eq!(send(&first, common::keyed("POST", "/payments", "k1", "{}")).await.status, 201);
    // A readiness check at start says so before any request: the skipped deploy's door is
    // refused, the fleet's is not.
    let skipped_layer = IdempotencyLayer::new(h.store()).key_prefix(prefix).hashing(keyed(1));
    let refused = skipped_layer.operator().check_fleet().await.unwrap_err();
    assert!(matches!(&refused, StoreError::Misplaced(why) if why.contains("`Deploy::Second`")));
    let serving = IdempotencyLayer::new(h.store()).key_prefix(prefix);
    let serving = serving.hashing(moving(Hashing::plain(), keyed(1), Deploy::First));
    serving.operator().check_fleet().await.unwrap();
    let skipped = app(&calls).layer(skipped_layer);
    send(&skipped, common::keyed("POST", "/payments", "k2", "{}"))
        .await
        .assert_problem(503, "fleet-disagrees");
    // The fleet serves on past its next announcements (a third of a ten-second lease each),
    // and the instance refused stays refused.
    tokio::time::sleep(Duration::from_millis(3600)).await;
    for key in ["k2", "k3"] {
        let ran = send(&first, common::keyed("POST", "/payments", key, "{}")).await;
        assert_eq!((ran.status.as_u16(), ran.replayed()), (201, false), "{ran:?}");
    }
    send(&skipped, common::keyed("POST", "/payments", "k4", "{}"))
        .await
        .assert_problem(503, "fleet-disagrees");
    // Deploy 2 beside deploy 1: serves, and replays what deploy 1 ran.
    let second = instance(&h, &calls, prefix, moving(Hashing::plain(), keyed(1), Deploy::Second));
    assert!(send(&second, common::keyed("POST", "/payments", "k2", "{}")).await.replayed());
    assert_eq!(calls.get(), 3);
}

/// A store whose `announce` is `delay` late (a round trip), and fails while `fail` is set.
#[derive(Clone)]
struct Wrap<S> {
    inner: S,
    delay: Duration,
    fail: Arc<AtomicBool>,
    announces: Arc<AtomicUsize>,
}
impl<S> Wrap<S> {
    fn new(inner: S, delay: Duration) -> Self {
        Self { inner, delay, fail: Arc::default(), announces: Arc::default() }
    }
}

impl<S: Store> Store for Wrap<S> {
    async fn claim(
        &self,
        key: &RecordKey,
        fp: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Claim, StoreError> {
        self.inner.claim(key, fp, owner, lease).await
    }
    async fn claim_waiting(
        &self,
        key: &RecordKey,
        fp: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Claim, StoreError> {
        self.inner.claim_waiting(key, fp, owner, lease).await
    }
    async fn subscribe(&self, key: &RecordKey) -> Subscription {
        self.inner.subscribe(key).await
    }
    async fn complete(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        fp: &Fingerprint,
        response: Bytes,
        retention: Duration,
    ) -> Result<Fenced, StoreError> {
        self.inner.complete(key, owner, fp, response, retention).await
    }
    async fn release(&self, key: &RecordKey, owner: &OwnerToken) -> Result<Fenced, StoreError> {
        self.inner.release(key, owner).await
    }
    async fn abandon(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        fp: &Fingerprint,
        lease: Lease,
    ) -> Result<Fenced, StoreError> {
        self.inner.abandon(key, owner, fp, lease).await
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
    async fn announce(
        &self,
        registry: &RecordKey,
        entries: &[(String, Duration)],
    ) -> Result<Option<Vec<String>>, StoreError> {
        self.announces.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(self.delay).await;
        if self.fail.load(Ordering::SeqCst) {
            return Err(StoreError::Timeout(Duration::from_secs(1)));
        }
        self.inner.announce(registry, entries).await
    }
}

/// A consumer door with a short lease (announced every second) and records that live about
/// `records` (a retention and its window, a lease, no keep-alive).
fn door<S: Store>(store: S, hashing: Hashing, records: Duration) -> Idempotent<S> {
    Idempotent::new(store)
        .hashing(hashing)
        .lease(Duration::from_secs(1))
        .retention(records / 2)
        .keep_alive(None)
}

/// One event on `door`: "ran", "replayed", or what else it was answered.
async fn run<S: Store>(door: &Idempotent<S>, event: &str, runs: &Arc<AtomicUsize>) -> String {
    let runs = runs.clone();
    let ran = door
        .run("pay", event, b"{}", move |_| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, String>(1_u32)
        })
        .await;
    match ran {
        Ok(Outcome::Ran(_)) => "ran".into(),
        Ok(Outcome::Replayed(_)) => "replayed".into(),
        Err(Error::Store(StoreError::Misplaced(_))) => "refused".into(),
        other => format!("{other:?}"),
    }
}

/// An idle door: its running entry lapses (three announcements, a second each) and its
/// records expire; a door of another naming starts meanwhile and runs an event. The idle door
/// asks its fleet again before it serves the retry: refused, never run a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_door_asks_its_fleet_again_before_it_serves() {
    let store = MemoryStore::new();
    let runs = Arc::new(AtomicUsize::new(0));
    let late = |store: &MemoryStore| Wrap::new(store.clone(), Duration::from_millis(20));
    let plain = door(late(&store), Hashing::plain(), Duration::from_secs(1));
    assert_eq!(run(&plain, "k0", &runs).await, "ran");
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let keyed = door(late(&store), keyed(1), Duration::from_secs(60));
    assert_eq!(run(&keyed, "k1", &runs).await, "ran");
    assert_eq!(run(&plain, "k1", &runs).await, "refused");
    assert_eq!(runs.load(Ordering::SeqCst), 2, "run twice");
}

/// Two doors that cannot serve side by side start at the same moment (each announcement a
/// tenth of a second late): one serves, the other is refused, and so they stay; the one
/// refused recorded nothing that refuses the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doors_starting_at_once_leave_one_serving() {
    let store = MemoryStore::new();
    let runs = Arc::new(AtomicUsize::new(0));
    let late = || Wrap::new(store.clone(), Duration::from_millis(100));
    let plain = door(late(), Hashing::plain(), Duration::from_secs(60));
    let keyed = door(late(), keyed(1), Duration::from_secs(60));
    let (a, b) = tokio::join!(run(&plain, "a0", &runs), run(&keyed, "b0", &runs));
    let first = (a.clone(), b.clone());
    assert!(matches!(first.0.as_str(), "ran" | "refused"), "{first:?}");
    assert_ne!(a, b, "both {a}: one serves, the other is refused");
    for second in 1..=5 {
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let (event_a, event_b) = (format!("a{second}"), format!("b{second}"));
        let (a, b) = tokio::join!(run(&plain, &event_a, &runs), run(&keyed, &event_b, &runs));
        assert_eq!((a, b), first, "after {second} s");
    }
}

/// A door whose first announcement fails (the registry cannot be read) serves nothing
/// unchecked, the requests that waited for that announcement included; once the registry
/// answers, it is refused beside the fleet it cannot serve beside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_door_whose_registry_cannot_be_read_serves_nothing_unchecked() {
    let store = MemoryStore::new();
    let runs = Arc::new(AtomicUsize::new(0));
    let plain = door(store.clone(), Hashing::plain(), Duration::from_secs(60));
    assert_eq!(run(&plain, "k0", &runs).await, "ran");
    let failing = Wrap::new(store.clone(), Duration::from_millis(200));
    failing.fail.store(true, Ordering::SeqCst);
    let keyed = door(failing.clone(), keyed(1), Duration::from_secs(60));
    let second = async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        run(&keyed, "k2", &runs).await
    };
    let (first, second) = tokio::join!(run(&keyed, "k1", &runs), second);
    assert!(first.contains("Store") && second.contains("Store"), "{first} | {second}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    failing.fail.store(false, Ordering::SeqCst);
    assert_eq!(run(&keyed, "k3", &runs).await, "refused");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
