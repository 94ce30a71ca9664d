//! The lease is held from the claim to the settle, whatever runs in between (a recovery hook
//! slower than the lease, a response body of known length slower than the lease), on both
//! doors and every store; durations as long as `Duration::MAX` never panic a request; the
//! keep-alive ceiling counts from the claim.

use crate::common;

use std::{
    collections::VecDeque,
    convert::Infallible,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use axum::{Router, body::Body, routing::post};
use axum_idempotency::settings::{Recovery, Waiting};
use axum_idempotency::{
    Fingerprint, IdempotencyContext, IdempotencyLayer, Idempotent,
    consumer::Outcome,
    recovery::{Lookup, Recovered},
    store::{Claim, Lease, OwnerToken, RecordKey, Store},
};
use bytes::Bytes;
use common::*;
use http::{Request, Response};
use http_body::{Frame, SizeHint};

every_store!(
    a_hook_slower_than_the_lease_keeps_the_key_until_it_answers,
    a_hook_slower_than_the_lease_keeps_the_key_on_the_consumer_door,
    a_known_length_body_slower_than_the_lease_keeps_the_key_until_it_is_stored,
    durations_as_long_as_duration_max_never_panic_a_request,
    durations_as_long_as_duration_max_never_panic_an_operation,
    the_keep_alive_ceiling_counts_from_the_claim,
);

const LEASE: Duration = Duration::from_millis(300);

/// A claim on `POST /payments` with body `{}` and `key` whose holder died: nobody settles it,
/// and its lease has lapsed when this returns.
async fn dead_holder<S: Store>(store: &S, key: &RecordKey, fingerprint: &Fingerprint) {
    let lease = Lease::new(Duration::from_millis(50)).recovery_window(Duration::from_secs(3600));
    let claim = store.claim(key, fingerprint, &OwnerToken::random(), lease).await;
    assert_eq!(claim.unwrap(), Claim::Claimed);
    tokio::time::sleep(Duration::from_millis(150)).await;
}

async fn a_hook_slower_than_the_lease_keeps_the_key_until_it_answers<H: Harness>(h: H) {
    let (calls, asked) = (Calls::default(), Arc::new(AtomicUsize::new(0)));
    let hook = {
        let asked = asked.clone();
        move |_lookup: Lookup<Request<Bytes>>| {
            asked.fetch_add(1, Ordering::SeqCst);
            async {
                tokio::time::sleep(3 * LEASE).await;
                Ok::<_, std::io::Error>(Recovered::<Response<Bytes>>::Unknown)
            }
        }
    };
    // Waiting off: a probe's 202 says the key is held.
    let layer = IdempotencyLayer::new(h.store()).waiting(Waiting::off());
    let app = app(&calls).layer(layer.lease(LEASE).recover(hook));
    let fingerprint = Fingerprint::new("POST", "/payments", "", b"{}");
    dead_holder(&h.store(), &global("k1"), &fingerprint).await;
    let taking_over = send_in_background(&app, keyed("POST", "/payments", "k1", "{}"));
    // Past the takeover's own lease, while its hook still looks: the key is still held.
    tokio::time::sleep(LEASE + LEASE / 2).await;
    let during = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    during.assert_problem(202, "in-progress");
    assert_eq!(asked.load(Ordering::SeqCst), 1, "a second retry took the key over");
    let ran = taking_over.await.unwrap();
    assert_eq!(ran.status, 201);
    assert!(!ran.replayed());
    let after = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    assert!(after.replayed());
    assert_eq!(after.body, ran.body);
    assert_eq!((asked.load(Ordering::SeqCst), calls.get()), (1, 1));
}

async fn a_hook_slower_than_the_lease_keeps_the_key_on_the_consumer_door<H: Harness>(h: H) {
    let asked = Arc::new(AtomicUsize::new(0));
    let hook = {
        let asked = asked.clone();
        move |_lookup: Lookup<Bytes>| {
            asked.fetch_add(1, Ordering::SeqCst);
            async {
                tokio::time::sleep(3 * LEASE).await;
                Ok::<_, std::io::Error>(Recovered::<u32>::Unknown)
            }
        }
    };
    let idem = Idempotent::new(h.store()).lease(LEASE).recover(hook);
    let ran = Arc::new(AtomicUsize::new(0));
    let operation = || {
        let ran = ran.clone();
        move |_context: IdempotencyContext| async move {
            Ok::<_, std::io::Error>(u32::try_from(ran.fetch_add(1, Ordering::SeqCst)).unwrap() + 1)
        }
    };
    let key = RecordKey::new("idempotency-consumer", b"payments", b"evt_1");
    dead_holder(&h.store(), &key, &Fingerprint::of_payload(b"amount=100")).await;
    let taking_over = {
        let (idem, operation) = (idem.clone(), operation());
        tokio::spawn(async move { idem.run("payments", "evt_1", b"amount=100", operation).await })
    };
    tokio::time::sleep(LEASE + LEASE / 2).await;
    let during = idem.run("payments", "evt_1", b"amount=100", operation()).await.unwrap();
    assert!(matches!(during, Outcome::InProgress { .. }), "{during:?}");
    assert_eq!(asked.load(Ordering::SeqCst), 1, "a second delivery took the key over");
    assert_eq!(taking_over.await.unwrap().unwrap(), Outcome::Ran(1));
    let after = idem.run("payments", "evt_1", b"amount=100", operation()).await.unwrap();
    assert_eq!(after, Outcome::Replayed(1));
    assert_eq!((asked.load(Ordering::SeqCst), ran.load(Ordering::SeqCst)), (1, 1));
}

/// A body whose length is known up front, produced one chunk every `every`: a proxied upstream
/// with `Content-Length`.
struct Trickle {
    chunks: VecDeque<Bytes>,
    every: Duration,
    next: Pin<Box<tokio::time::Sleep>>,
}

impl Trickle {
    fn new(chunks: &[&'static str], every: Duration) -> Self {
        let chunks = chunks.iter().map(|c| Bytes::from_static(c.as_bytes())).collect();
        Self { chunks, every, next: Box::pin(tokio::time::sleep(every)) }
    }
}

impl http_body::Body for Trickle {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.chunks.is_empty() {
            return Poll::Ready(None);
        }
        if self.next.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        let every = self.every;
        self.next.as_mut().reset(tokio::time::Instant::now() + every);
        Poll::Ready(self.chunks.pop_front().map(|chunk| Ok(Frame::data(chunk))))
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.chunks.iter().map(|c| c.len() as u64).sum())
    }
}

async fn a_known_length_body_slower_than_the_lease_keeps_the_key_until_it_is_stored<H: Harness>(
    h: H,
) {
    let calls = Arc::new(AtomicUsize::new(0));
    let handler = {
        let calls = calls.clone();
        move || async move {
            calls.fetch_add(1, Ordering::SeqCst);
            // Four chunks over 4 × 250 ms: past three leases of 300 ms.
            let body = Trickle::new(&["ch", "_1", "23", "45"], Duration::from_millis(250));
            Response::builder().status(201).body(Body::new(body)).unwrap()
        }
    };
    let app = Router::new()
        .route("/proxied", post(handler))
        // Waiting off: a probe's 202 says the key is held.
        .layer(IdempotencyLayer::new(h.store()).lease(LEASE).waiting(Waiting::off()));
    let first = send_in_background(&app, keyed("POST", "/proxied", "k1", "{}"));
    tokio::time::sleep(Duration::from_millis(700)).await;
    let during = send(&app, keyed("POST", "/proxied", "k1", "{}")).await;
    during.assert_problem(202, "in-progress");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "a retry ran the handler while the body was read");
    let first = first.await.unwrap();
    assert_eq!((first.status.as_u16(), first.body.as_str()), (201, "ch_12345"));
    let after = send(&app, keyed("POST", "/proxied", "k1", "{}")).await;
    assert!(after.replayed());
    assert_eq!(after.body, "ch_12345");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

async fn durations_as_long_as_duration_max_never_panic_a_request<H: Harness>(h: H) {
    let calls = Calls::default();
    let layer = IdempotencyLayer::new(h.store())
        .lease(Duration::MAX)
        .retention(Duration::MAX)
        .keep_alive(Some(Duration::MAX))
        .waiting(Waiting::up_to(Duration::MAX).retry_after(Duration::MAX))
        .recover(|_lookup: Lookup<Request<Bytes>>| async {
            Ok::<_, std::io::Error>(Recovered::<Response<Bytes>>::Unknown)
        })
        .recovery(Recovery::default().window(Duration::MAX).timeout(Duration::MAX));
    let app = app(&calls).layer(layer);
    let first = send_in_background(&app, delayed("/slow", "k1", 300, "{}"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Waits (for ever, if need be) for the original, and answers with its replay.
    let waited = send(&app, delayed("/slow", "k1", 300, "{}")).await;
    let first = first.await.unwrap();
    assert_eq!(first.status, 201, "{first:?}");
    assert!(waited.replayed(), "{waited:?}");
    assert_eq!(waited.body, first.body);
    assert_eq!(calls.get(), 1);
    assert_eq!(h.held(&global("k1")).await, Some(Held::Completed));
}

async fn durations_as_long_as_duration_max_never_panic_an_operation<H: Harness>(h: H) {
    let idem = Idempotent::new(h.store())
        .lease(Duration::MAX)
        .retention(Duration::MAX)
        .keep_alive(Some(Duration::MAX))
        .waiting(Waiting::up_to(Duration::MAX).retry_after(Duration::MAX));
    let ran = Arc::new(AtomicUsize::new(0));
    let operation = || {
        let ran = ran.clone();
        move |_context: IdempotencyContext| async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            Ok::<_, std::io::Error>(ran.fetch_add(1, Ordering::SeqCst) + 1)
        }
    };
    let first = {
        let (idem, operation) = (idem.clone(), operation());
        tokio::spawn(async move { idem.run("payments", "evt_1", b"{}", operation).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let waited = idem.run("payments", "evt_1", b"{}", operation()).await.unwrap();
    assert_eq!(first.await.unwrap().unwrap(), Outcome::Ran(1));
    assert_eq!(waited, Outcome::Replayed(1));
    assert_eq!(ran.load(Ordering::SeqCst), 1);
}

async fn the_keep_alive_ceiling_counts_from_the_claim<H: Harness>(h: H) {
    // The handler takes 900 ms, then streams (no length known) for 2 s. With a ceiling of
    // 900 ms counted from the claim, renewals stop by 900 ms and the lease lapses by 1.2 s;
    // counted again from the start of the stream, they would run to 1.8 s.
    let calls = Arc::new(AtomicUsize::new(0));
    let handler = {
        let calls = calls.clone();
        move || async move {
            calls.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(900)).await;
            let chunks = futures_util::stream::unfold(0, |i| async move {
                (i < 4).then_some(())?;
                tokio::time::sleep(Duration::from_millis(500)).await;
                Some((Ok::<_, Infallible>(Bytes::from_static(b"x")), i + 1))
            });
            Body::from_stream(chunks)
        }
    };
    let layer =
        IdempotencyLayer::new(h.store()).lease(LEASE).keep_alive(Some(Duration::from_millis(900)));
    let app = Router::new().route("/stream", post(handler)).layer(layer);
    let first = send_in_background(&app, keyed("POST", "/stream", "k1", "{}"));
    tokio::time::sleep(Duration::from_millis(1600)).await;
    // The lease lapsed (the handler outlived its ceiling): the retry runs it again, as
    // documented for a handler that outlives the keep-alive ceiling.
    let retry = send_in_background(&app, keyed("POST", "/stream", "k1", "{}"));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(calls.load(Ordering::SeqCst), 2, "the lease was still renewed at 1.6 s");
    first.abort();
    retry.abort();
}

/// A `MemoryStore` whose lease renewals take `delay` on the wire (a slow network): a renewal
/// may still be on its way when the holder settles.
#[derive(Clone)]
struct SlowRenewals {
    inner: axum_idempotency::MemoryStore,
    delay: Duration,
    /// The renewals sent (touches with a lease).
    renewals: Arc<AtomicUsize>,
}

impl Store for SlowRenewals {
    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Claim, axum_idempotency::store::StoreError> {
        self.inner.claim(key, fingerprint, owner, lease).await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        fingerprint: &Fingerprint,
        response: Bytes,
        retention: Duration,
    ) -> Result<axum_idempotency::store::Fenced, axum_idempotency::store::StoreError> {
        self.inner.complete(key, owner, fingerprint, response, retention).await
    }

    async fn release(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
    ) -> Result<axum_idempotency::store::Fenced, axum_idempotency::store::StoreError> {
        self.inner.release(key, owner).await
    }

    async fn touch(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<axum_idempotency::store::Fenced, axum_idempotency::store::StoreError> {
        // A renewal is slow; the hand-back (a zero lease) is not.
        if !lease.duration.is_zero() {
            self.renewals.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(self.delay).await;
        }
        self.inner.touch(key, owner, lease).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_on_the_wire_never_lands_after_the_settle() {
    // Lease 300 ms: a renewal leaves at 100 ms and lands at 300 ms. The recovery hook fails at
    // 150 ms, and the key is handed back (its lease ended, for the next claim to take over).
    // The hand-back waits for the renewal on the wire; were it sent at once, the renewal would
    // land after it and hold the key for another lease.
    let store = SlowRenewals {
        inner: axum_idempotency::MemoryStore::new(),
        delay: LEASE * 2 / 3,
        renewals: Arc::default(),
    };
    let hook = |_lookup: Lookup<Request<Bytes>>| async {
        tokio::time::sleep(LEASE / 2).await;
        Err::<Recovered<Response<Bytes>>, _>(std::io::Error::other("database unreachable"))
    };
    let calls = Calls::default();
    let layer = IdempotencyLayer::new(store.clone()).lease(LEASE).recover(hook);
    let app = app(&calls).layer(layer);
    let fingerprint = Fingerprint::new("POST", "/payments", "", b"{}");
    dead_holder(&store.inner, &global("k1"), &fingerprint).await;
    let refused = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    refused.assert_problem(503, "recovery-failed");
    // After the renewal on the wire would have landed: the key is the next claim's to take.
    tokio::time::sleep(LEASE).await;
    let lease = Lease::new(LEASE).recovery_window(Duration::from_secs(60));
    let (key, owner) = (global("k1"), OwnerToken::random());
    let next = store.inner.claim(&key, &fingerprint, &owner, lease).await.unwrap();
    assert_eq!(next, Claim::TakenOver, "a renewal landed after the hand-back");
    assert_eq!(calls.get(), 0);
}

/// A router whose handler counts its calls, then holds its request for `hold` (asleep, or
/// blocking its thread when `blocking`) before it answers 201.
/// A layer over a `MemoryStore` with the tests' short lease, answering at once (202) a request
/// whose original runs.
fn memory_layer() -> IdempotencyLayer<axum_idempotency::MemoryStore> {
    IdempotencyLayer::new(axum_idempotency::MemoryStore::new()).lease(LEASE).waiting(Waiting::off())
}

fn slow_app(calls: &Arc<AtomicUsize>, hold: Duration, blocking: bool) -> Router {
    let calls = calls.clone();
    let handler = move || async move {
        calls.fetch_add(1, Ordering::SeqCst);
        match blocking {
            true => std::thread::sleep(hold),
            false => tokio::time::sleep(hold).await,
        }
        (http::StatusCode::CREATED, "charged")
    };
    Router::new().route("/pay", post(handler))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_blocks_its_thread_past_the_lease_keeps_the_key() {
    // The renewals run beside the request's task, not in it: a handler that blocks its thread
    // (where it should await) for three leases stops none of them on a multi-threaded runtime.
    let calls = Arc::new(AtomicUsize::new(0));
    let layer = memory_layer();
    let app = slow_app(&calls, 3 * LEASE, true).layer(layer);
    let first = send_in_background(&app, keyed("POST", "/pay", "k1", "{}"));
    tokio::time::sleep(LEASE * 2).await;
    let during = send(&app, keyed("POST", "/pay", "k1", "{}")).await;
    during.assert_problem(202, "in-progress");
    let ran = first.await.unwrap();
    assert_eq!(ran.status, 201);
    assert!(!ran.replayed());
    let after = send(&app, keyed("POST", "/pay", "k1", "{}")).await;
    assert!(after.replayed());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_task_renews_every_running_claim_of_a_layer() {
    // Twenty requests run past their lease at once, through a router used as tests use one
    // (not made a service first: axum wraps the handler in the layer again on every request).
    let calls = Arc::new(AtomicUsize::new(0));
    let layer = memory_layer();
    let app = slow_app(&calls, 4 * LEASE, false).layer(layer);
    let metrics = tokio::runtime::Handle::current().metrics();
    let before = metrics.num_alive_tasks();
    let keys: Vec<String> = (0..20).map(|n| format!("k{n}")).collect();
    let requests: Vec<_> =
        keys.iter().map(|key| send_in_background(&app, keyed("POST", "/pay", key, "{}"))).collect();
    tokio::time::sleep(LEASE * 2).await;
    // Each request (its handler runs in it), and one task renewing all twenty (a renewal on
    // the wire now and then): a task per claim's renewals would be twenty more.
    let alive = metrics.num_alive_tasks() - before;
    assert!((21..30).contains(&alive), "{alive} tasks for 20 running requests");
    for key in &keys {
        send(&app, keyed("POST", "/pay", key, "{}")).await.assert_problem(202, "in-progress");
    }
    for request in requests {
        assert_eq!(request.await.unwrap().status, 201);
    }
    assert_eq!(calls.load(Ordering::SeqCst), 20);
}

#[test]
fn a_layer_whose_first_runtime_ended_renews_on_the_next() {
    // The renewals' task of a runtime ends with it; the next runtime's claim starts its own.
    let first = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    a_claim_on_the_next_runtime_keeps_its_key(first, After::Ends);
}

#[test]
fn a_layer_whose_first_runtime_idles_renews_on_the_next() {
    // A current-thread runtime runs only inside its `block_on`: between two, every task it
    // holds waits. The layer's first claim ran on one that now idles (alive, not driven); a
    // claim on another runtime must still be renewed, there.
    let first = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    a_claim_on_the_next_runtime_keeps_its_key(first, After::Idles);
}

#[test]
fn each_runtime_renews_with_one_task_however_often_claims_alternate() {
    // Two runtimes, both alive, take turns: each keeps the one renewals task its first claim
    // started, and no turn starts another.
    let calls = Arc::new(AtomicUsize::new(0));
    let app = slow_app(&calls, Duration::ZERO, false).layer(memory_layer());
    let runtime = || tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (a, b) = (runtime(), runtime());
    for turn in 0..3 {
        for (name, runtime) in [("a", &a), ("b", &b)] {
            let key = format!("{name}{turn}");
            let seen = runtime.block_on(send(&app, keyed("POST", "/pay", &key, "{}")));
            assert_eq!(seen.status, 201);
        }
    }
    for runtime in [&a, &b] {
        assert_eq!(runtime.metrics().num_alive_tasks(), 1, "renewals tasks on one runtime");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 6);
}

/// What the runtime of a layer's first claim does once that claim is answered.
#[derive(PartialEq)]
enum After {
    Ends,
    Idles,
}

/// The layer's first claim runs on `first`, which then ends or idles; a handler of three
/// leases on another runtime keeps its key: a retry at two leases is answered in progress.
fn a_claim_on_the_next_runtime_keeps_its_key(first: tokio::runtime::Runtime, after: After) {
    let calls = Arc::new(AtomicUsize::new(0));
    let app = slow_app(&calls, 3 * LEASE, false).layer(memory_layer());
    assert_eq!(first.block_on(send(&app, keyed("POST", "/pay", "k0", "{}"))).status, 201);
    let idle = (after == After::Idles).then_some(first);
    let next = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    next.block_on(async {
        let slow = send_in_background(&app, keyed("POST", "/pay", "k1", "{}"));
        tokio::time::sleep(LEASE * 2).await;
        let during = send(&app, keyed("POST", "/pay", "k1", "{}")).await;
        during.assert_problem(202, "in-progress");
        assert_eq!(slow.await.unwrap().status, 201);
    });
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    drop(idle);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_past_its_ceiling_settling_late_leaves_the_next_claims_renewals_alone() {
    // The first request outlives its keep-alive ceiling, so its renewals end while it runs;
    // the second request's claim then takes its place among the renewals. The first settling
    // afterwards must stop nothing of the second's: the second keeps its key past its lease.
    let calls = Arc::new(AtomicUsize::new(0));
    let layer = memory_layer().keep_alive(Some(4 * LEASE));
    let first = slow_app(&calls, 6 * LEASE, false).layer(layer.clone());
    let second = slow_app(&calls, 7 * LEASE / 2, false).layer(layer);
    let outlives = send_in_background(&first, keyed("POST", "/pay", "k1", "{}"));
    tokio::time::sleep(9 * LEASE / 2).await;
    let held = send_in_background(&second, keyed("POST", "/pay", "k2", "{}"));
    // The first settles at 6 leases; the second's lease, renewed until then, would lapse by 7.
    tokio::time::sleep(3 * LEASE).await;
    let during = send(&second, keyed("POST", "/pay", "k2", "{}")).await;
    during.assert_problem(202, "in-progress");
    assert_eq!(outlives.await.unwrap().status, 201);
    assert_eq!(held.await.unwrap().status, 201);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_is_renewed_every_third_of_a_lease_not_more() {
    // A handler of two leases: renewed every third of a lease (sent within a quarter of that
    // of its due time), about six times; not at every look the renewals' task takes (24).
    let store = SlowRenewals {
        inner: axum_idempotency::MemoryStore::new(),
        delay: Duration::ZERO,
        renewals: Arc::default(),
    };
    let calls = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(store.clone()).lease(LEASE);
    let app = slow_app(&calls, 2 * LEASE, false).layer(layer);
    assert_eq!(send(&app, keyed("POST", "/pay", "k1", "{}")).await.status, 201);
    let renewals = store.renewals.load(Ordering::SeqCst);
    assert!((3..=8).contains(&renewals), "{renewals} renewals in two leases");
}
