//! What a review of the move between namings (`Hashing::moving_to`) found, kept as tests: a
//! lapsed claim keeps its lapse through the second claim's wait and through a late second
//! claim (so that the recovery hook is asked), a panic releases both names, an operator that
//! does not read every naming its fleet reads is refused `forget`, and the wait under the new
//! names takes a waiter's place.

use crate::common;

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::body::Bytes;
use axum_idempotency::{
    Fingerprint, IdempotencyContext, Idempotent, MemoryStore,
    consumer::Outcome,
    hashing::{Deploy, Hashing},
    recovery::{BoxError, Lookup, Recovered},
    settings::Waiting,
    store::{Claim, Fenced, Lease, OwnerToken, RecordKey, Store, StoreError, Subscription},
};
#[allow(unused_imports)]
use common::*;

const SECRET: [u8; 32] = [0x5e; 32];

fn build(deploy: usize) -> Hashing {
    let keyed = || Hashing::keyed(SECRET);
    match deploy {
        0 => Hashing::plain(),
        1 => Hashing::plain().moving_to(keyed(), Deploy::First).unwrap(),
        2 => Hashing::plain().moving_to(keyed(), Deploy::Second).unwrap(),
        _ => keyed(),
    }
}

type Outbox = Arc<Mutex<HashMap<String, u32>>>;

/// A hook over an outbox keyed by key hash, looking under both names as the docs say.
fn outbox_hook(
    outbox: Outbox,
    asked: Arc<AtomicUsize>,
) -> impl Fn(Lookup<Bytes>) -> std::future::Ready<Result<Recovered<u32>, BoxError>> + Clone {
    move |lookup: Lookup<Bytes>| {
        asked.fetch_add(1, Ordering::SeqCst);
        let context = &lookup.context;
        let outbox = outbox.lock().unwrap();
        let found = std::iter::once(context.key_hash())
            .chain(context.key_hash_alongside())
            .find_map(|hash| outbox.get(hash).copied());
        std::future::ready(Ok(found.map_or(Recovered::Unknown, Recovered::Happened)))
    }
}

/// A deploy-3 holder charges (outbox row under its key hash) and dies mid-operation: its
/// claim under the new names lapses (kept for the recovery window).
async fn deploy3_dies(
    store: MemoryStore,
    outbox: &Outbox,
    charges: &Arc<AtomicUsize>,
    lease: Duration,
) {
    let dying = Idempotent::new(store)
        .hashing(build(3))
        .lease(lease)
        .keep_alive(None)
        .recover(outbox_hook(outbox.clone(), Arc::default()));
    let (o, c) = (outbox.clone(), charges.clone());
    let died = tokio::time::timeout(Duration::from_millis(50), async move {
        dying
            .run("pay", "k1", b"100", move |context: IdempotencyContext| async move {
                let run = c.fetch_add(1, Ordering::SeqCst) as u32 + 1;
                o.lock().unwrap().insert(context.key_hash().to_owned(), run);
                std::future::pending::<()>().await;
                Ok::<_, String>(0_u32)
            })
            .await
    })
    .await;
    assert!(died.is_err());
}

fn charge(
    outbox: &Outbox,
    charges: &Arc<AtomicUsize>,
) -> impl FnOnce(IdempotencyContext) -> std::future::Ready<Result<u32, String>> + Send + 'static {
    let (outbox, charges) = (outbox.clone(), charges.clone());
    move |context| {
        let run = charges.fetch_add(1, Ordering::SeqCst) as u32 + 1;
        outbox.lock().unwrap().insert(context.key_hash().to_owned(), run);
        std::future::ready(Ok(run))
    }
}

/// 2&3: the deploy-3 holder dies; a deploy-2 retry arrives while its lease still runs and
/// waits under the new names; the wait's takeover is released (its lapse lost), both names
/// claimed again fresh, and the hook is never asked: the operation runs a second time.
/// Control: the same retry on deploy 3 asks the hook and replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_under_the_new_names_keeps_the_lapse_for_the_hook() {
    for retry_on in [3, 2] {
        let store = MemoryStore::new();
        let (outbox, charges, asked) =
            (Outbox::default(), Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let lease = Duration::from_millis(300);
        deploy3_dies(store.clone(), &outbox, &charges, lease).await;
        let door = Idempotent::new(store.clone())
            .hashing(build(retry_on))
            .lease(lease)
            .waiting(Waiting::up_to(Duration::from_secs(2)))
            .recover(outbox_hook(outbox.clone(), asked.clone()));
        let retried = door.run("pay", "k1", b"100", charge(&outbox, &charges)).await;
        assert!(
            matches!(retried, Ok(Outcome::Replayed(1))),
            "retry on deploy {retry_on}: {retried:?}"
        );
        assert_eq!(charges.load(Ordering::SeqCst), 1, "retry on deploy {retry_on}: charged twice");
    }
}

/// A store whose claims under `slow_key` answer `delay` late (applied at once); others
/// answer `other_delay` late.
#[derive(Clone)]
struct SlowClaims<S> {
    inner: S,
    delays: Arc<Mutex<Vec<(String, Duration)>>>,
}

impl<S: Store> Store for SlowClaims<S> {
    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Claim, StoreError> {
        let claim = self.inner.claim(key, fingerprint, owner, lease).await;
        let delay = self
            .delays
            .lock()
            .unwrap()
            .iter()
            .find(|(k, _)| k == key.hash())
            .map(|(_, d)| *d)
            .unwrap_or_default();
        tokio::time::sleep(delay).await;
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
}

/// The deploy-3 holder dies; past its lease, a deploy-2 retry's two claims are each in time
/// but together late for the first's lease: the second (a takeover of the lapsed claim) is
/// abandoned, its lapse kept, so that the next retry takes it over again and asks the hook,
/// which finds the charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_second_claim_that_took_a_lapse_over_keeps_it_for_the_hook() {
    let store = MemoryStore::new();
    let (outbox, charges, asked) =
        (Outbox::default(), Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let lease = Duration::from_millis(300);
    deploy3_dies(store.clone(), &outbox, &charges, lease).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let plain = RecordKey::new("idempotency-consumer", b"pay", b"k1");
    let keyed = Hashing::keyed(SECRET);
    // The new name, as a context under the keyed names tells it.
    let (sender, receiver) = tokio::sync::oneshot::channel();
    Idempotent::new(MemoryStore::new())
        .hashing(keyed)
        .run("pay", "k1", b"100", |context| async move {
            sender.send(context.key_hash().to_owned()).unwrap();
            Ok::<_, String>(0_u32)
        })
        .await
        .unwrap();
    let new_hash = receiver.await.unwrap();
    // lease 300 ms: in time below 200 ms. 120 + 120 = 240: late together.
    let delays = vec![
        (plain.hash().to_owned(), Duration::from_millis(120)),
        (new_hash.clone(), Duration::from_millis(120)),
    ];
    let slow = SlowClaims { inner: store.clone(), delays: Arc::new(Mutex::new(delays)) };
    let door = Idempotent::new(slow)
        .hashing(build(2))
        .lease(lease)
        .recover(outbox_hook(outbox.clone(), asked.clone()));
    // Both claims made, too late together: a store error (503), nothing run.
    let late = door.run("pay", "k1", b"100", charge(&outbox, &charges)).await;
    assert!(late.is_err(), "{late:?}");
    assert_eq!(charges.load(Ordering::SeqCst), 1);
    let door = Idempotent::new(store.clone())
        .hashing(build(2))
        .lease(lease)
        .recover(outbox_hook(outbox.clone(), asked.clone()));
    let retried = door.run("pay", "k1", b"100", charge(&outbox, &charges)).await;
    assert!(matches!(retried, Ok(Outcome::Replayed(1))), "{retried:?}");
    assert_eq!(charges.load(Ordering::SeqCst), 1, "charged twice");
}

mod sweep {
    use super::*;
    use axum::Router;
    use axum_idempotency::{IdempotencyLayer, layer::Limits};

    every_store!(a_move_pair_answers_as_one_naming_does, fifty_at_once_across_neighbours);

    const ROUTES: [&str; 7] =
        ["/payments", "/big", "/streamed", "/broken-body", "/flaky", "/status/500", "/unavailable"];

    /// An instance of `deploy` in the fleet whose keys have `prefix` (a fleet each: the
    /// registry refuses deploys that are not neighbours).
    fn instance<S: Store>(store: S, calls: &Calls, deploy: usize, prefix: &str) -> Router {
        app(calls).layer(
            IdempotencyLayer::new(store)
                .key_prefix(prefix)
                .hashing(build(deploy))
                .limits(Limits::default().stored_body(1024)),
        )
    }

    /// The answers of six requests of one key over instances of `pair`, and the handler's
    /// runs.
    async fn sequence<H: Harness>(
        h: &H,
        pair: (usize, usize),
        route: &str,
        key: &'static str,
    ) -> Vec<(u16, bool, String)> {
        let calls = Calls::default();
        let a = instance(h.store(), &calls, pair.0, key);
        let b = instance(h.second_store(), &calls, pair.1, key);
        let mut seen = Vec::new();
        for instance in [&a, &b, &a, &b, &b, &a] {
            let request = keyed("POST", route, key, "{}");
            use http_body_util::BodyExt as _;
            use tower::ServiceExt as _;
            let response = instance.clone().oneshot(request).await.unwrap();
            let (parts, body) = response.into_parts();
            let replayed = parts.headers.get("idempotency-replayed").is_some_and(|v| v == "true");
            let body = match body.collect().await {
                Ok(body) => String::from_utf8_lossy(&body.to_bytes()).into_owned(),
                Err(error) => format!("body error: {error}"),
            };
            seen.push((parts.status.as_u16(), replayed, body));
        }
        seen.push((calls.get() as u16, false, "calls".into()));
        seen
    }

    async fn a_move_pair_answers_as_one_naming_does<H: Harness>(h: H) {
        let mut n = 0;
        for pair in [(0, 1), (1, 0), (1, 2), (2, 1), (2, 3), (3, 2)] {
            for route in ROUTES {
                n += 1;
                let k1: &'static str = Box::leak(format!("m{n}").into_boxed_str());
                let k2: &'static str = Box::leak(format!("c{n}").into_boxed_str());
                // Under two prefixes: the same answers, but for the key in a replayed body.
                let moving = sequence(&h, pair, route, k1).await;
                let control = sequence(&h, (3, 3), route, k2).await;
                assert_eq!(moving, control, "pair {pair:?} route {route}");
            }
        }
    }

    async fn fifty_at_once_across_neighbours<H: Harness>(h: H) {
        for pair in [(0, 1), (1, 2), (2, 3)] {
            let calls = Calls::default();
            // A prefix (a fleet) each: `fifty_duplicates_at_once` sends `k1`.
            let prefix = format!("p{}{}", pair.0, pair.1);
            let mk = |store, deploy| {
                app(&calls)
                    .layer(IdempotencyLayer::new(store).hashing(build(deploy)).key_prefix(&prefix))
            };
            let instances = [
                mk(h.store(), pair.0),
                mk(h.second_store(), pair.1),
                mk(h.store(), pair.1),
                mk(h.second_store(), pair.0),
            ];
            let answers = fifty_duplicates_at_once(&instances).await;
            assert_eq!(calls.get(), 1, "pair {pair:?}: {answers:?}");
        }
    }
}

/// A panic in the operation on each deploy of the move: both names released; the retry on
/// each neighbour runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_releases_both_names() {
    for (dying, next) in [(1, 0), (1, 2), (2, 1), (2, 3)] {
        let store = MemoryStore::new();
        let door = Idempotent::new(store.clone()).hashing(build(dying));
        let panicked = tokio::spawn(async move {
            door.run("pay", "k1", b"100", |_| async { panic!("boom") as Result<u32, String> }).await
        })
        .await;
        assert!(panicked.unwrap_err().is_panic());
        for deploy in [next, dying] {
            let door =
                Idempotent::new(store.clone()).hashing(build(deploy)).waiting(Waiting::off());
            let ran = door.run("pay", "k1", b"100", |_| async { Ok::<_, String>(5_u32) }).await;
            assert!(
                matches!(ran, Ok(Outcome::Ran(5) | Outcome::Replayed(5))),
                "{dying}->{deploy}: {ran:?}"
            );
        }
    }
}

/// An operator built like a deploy that does not read every naming its fleet reads (deploy 0
/// beside deploy 1, deploy 3 beside deploy 2) would forget a key under one naming only, and
/// the other would still answer it: refused, saying to forget through a build of the move,
/// which forgets it under both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_that_does_not_read_every_naming_of_its_fleet_is_refused_forget() {
    use axum_idempotency::IdempotencyLayer;
    for (ran_on, operator_of) in [(1, 0), (2, 3)] {
        let store = MemoryStore::new();
        let calls = Calls::default();
        let inst = |d| app(&calls).layer(IdempotencyLayer::new(store.clone()).hashing(build(d)));
        let first = send(&inst(ran_on), keyed("POST", "/payments", "k1", "{}")).await;
        assert_eq!(first.status, 201);
        let operator = IdempotencyLayer::new(store.clone()).hashing(build(operator_of)).operator();
        let refused = operator.forget(b"", "k1", false).await.unwrap_err();
        assert!(matches!(refused, StoreError::Misplaced(_)), "{refused:?}");
        assert!(refused.to_string().contains("through an operator of a build of the move"));
        // Through the move's build: forgotten under both names; it runs again, once.
        let operator = IdempotencyLayer::new(store.clone()).hashing(build(ran_on)).operator();
        operator.forget(b"", "k1", false).await.unwrap();
        for d in [operator_of, ran_on] {
            let again = send(&inst(d), keyed("POST", "/payments", "k1", "{}")).await;
            assert_eq!(again.header("x-payment"), Some("pay_2"), "{again:?}");
        }
        assert_eq!(calls.get(), 2);
    }
}

/// `max_waiters(1)`: one duplicate may wait, on deploy 2 (under the new names, held by a
/// deploy-3 original) as on deploy 3; the others are answered 202 at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wait_under_the_new_names_takes_a_waiters_place() {
    use axum_idempotency::IdempotencyLayer;
    for deploy in [3, 2] {
        let store = MemoryStore::new();
        let calls = Calls::default();
        let waiting = Waiting::up_to(Duration::from_secs(3)).max_waiters(1);
        let holder = app(&calls).layer(IdempotencyLayer::new(store.clone()).hashing(build(3)));
        let original = send_in_background(&holder, delayed("/slow", "k1", 800, "{}"));
        tokio::time::sleep(Duration::from_millis(100)).await;
        let dups = app(&calls)
            .layer(IdempotencyLayer::new(store.clone()).hashing(build(deploy)).waiting(waiting));
        let handles: Vec<_> =
            (0..5).map(|_| send_in_background(&dups, delayed("/slow", "k1", 800, "{}"))).collect();
        let mut statuses = Vec::new();
        for handle in handles {
            statuses.push(handle.await.unwrap().status.as_u16());
        }
        original.await.unwrap();
        let waited = statuses.iter().filter(|s| **s == 201).count();
        assert!(waited <= 1, "deploy {deploy}: {waited} waited with max_waiters(1): {statuses:?}");
    }
}
