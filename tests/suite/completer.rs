//! The completer over `PostgresStore`: claims whose holder died and whose client never came
//! back are listed, settled from the system of record when the hook knows the outcome (and
//! every retry then replays it, without running the handler), or reported when it does not (a
//! warning, the metric, the claim left for its client). Each test has a database of its own,
//! dropped at the end.
#![cfg(feature = "postgres")]

use crate::common;

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{Router, body::Bytes, http::StatusCode, routing::post};
use axum_idempotency::{
    IdempotencyLayer, Idempotent,
    completer::Pass,
    consumer::Outcome,
    recovery::{BoxError, Lookup, Recovered},
    store::{Admin, Claim, Lease, OwnerToken, PostgresStore, RecordKey, Store, sqlx},
};
use common::{keyed, postgres::TestDatabase, send};
use http::{Request, Response};

const LEASE: Duration = Duration::from_millis(200);
/// The completer's patience: claims lapsed this long ago (the tests wait past it).
const LAPSED: Duration = Duration::from_millis(20);

async fn store(d: &TestDatabase) -> PostgresStore {
    let options = d.options();
    let pool = sqlx::postgres::PgPoolOptions::new().connect_lazy_with(options);
    let store = PostgresStore::new(pool).sweep_every(None);
    store.migrate().await.unwrap();
    store
}

/// A service whose handler hangs on its first call (its holder is as good as dead: no
/// keep-alive, and a lease of 200 ms), with a recovery hook that knows nothing, so that a
/// lapsed claim is kept for its recovery window.
fn service(store: &PostgresStore, runs: &Arc<AtomicUsize>) -> Router {
    let runs = runs.clone();
    let hook = |_: Lookup<Request<Bytes>>| async { Ok::<_, BoxError>(Recovered::Unknown) };
    let layer = IdempotencyLayer::new(store.clone()).lease(LEASE).keep_alive(None).recover(hook);
    Router::new()
        .route(
            "/pay",
            post(move || async move {
                if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                    std::future::pending::<()>().await;
                }
                (StatusCode::CREATED, "ran again")
            }),
        )
        .layer(layer)
}

/// What the system of record answers about one request.
type Found = std::future::Ready<Result<Recovered<Response<Bytes>>, BoxError>>;

/// The system of record: the outbox row of `known` says the payment happened.
fn resolver(known: RecordKey) -> impl Fn(Lookup<Request<Bytes>>) -> Found + Send + Sync + 'static {
    move |lookup| {
        std::future::ready(Ok(if lookup.context.key_hash() == known.hash() {
            let response = Response::builder()
                .status(201)
                .header("content-type", "application/json")
                .body(Bytes::from_static(br#"{"payment":7}"#))
                .unwrap();
            Recovered::Happened(response)
        } else {
            Recovered::Unknown
        }))
    }
}

/// The layer `service` runs under, whose operator's completer asks `hook`.
fn operator(store: &PostgresStore) -> axum_idempotency::layer::Operator<PostgresStore> {
    let hook = |_: Lookup<Request<Bytes>>| async { Ok::<_, BoxError>(Recovered::Unknown) };
    IdempotencyLayer::new(store.clone()).lease(LEASE).keep_alive(None).recover(hook).operator()
}

fn global(key: &str) -> RecordKey {
    RecordKey::new("idempotency", b"", key.as_bytes())
}

/// Sends `key` and leaves its handler hanging: a claim whose holder never settles. `runs` is
/// the service's: the client gives up once its handler started (however long a cold claim
/// took), and at least 50 ms later.
async fn abandon(app: &Router, key: &'static str, runs: &AtomicUsize) {
    let before = runs.load(Ordering::SeqCst);
    let request = common::send_in_background(app, keyed("POST", "/pay", key, "{}"));
    tokio::time::sleep(Duration::from_millis(50)).await;
    while runs.load(Ordering::SeqCst) == before {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The client gives up; the handler hangs on, and its lease lapses.
    request.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_completer_settles_a_claim_it_can_resolve_and_reports_one_it_cannot() {
    #[cfg(feature = "metrics")]
    let snapshotter = {
        let recorder = metrics_util::debugging::DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder.install().expect("the only recorder of this test binary");
        snapshotter
    };
    let d = TestDatabase::create("completer").await;
    let store = store(&d).await;
    let (runs_a, runs_b) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (app_a, app_b) = (service(&store, &runs_a), service(&store, &runs_b));
    abandon(&app_a, "known", &runs_a).await;
    abandon(&app_b, "unknown", &runs_b).await;
    tokio::time::sleep(LEASE + Duration::from_millis(100)).await;
    let listed = store.abandoned_claims(Duration::ZERO, 10).await.unwrap();
    let mut hashes: Vec<&str> = listed.iter().map(|claim| claim.key.hash()).collect();
    hashes.sort_unstable();
    let mut expected = [global("known"), global("unknown")];
    expected.sort_by(|a, b| a.hash().cmp(b.hash()));
    assert_eq!(hashes, [expected[0].hash(), expected[1].hash()]);
    // Lapsed more recently than an hour: none.
    assert!(store.abandoned_claims(Duration::from_secs(3600), 10).await.unwrap().is_empty());
    // The oldest lapse first: `known` was claimed 50 ms before `unknown`.
    let oldest = store.abandoned_claims(Duration::ZERO, 1).await.unwrap();
    assert_eq!(oldest.iter().map(|c| c.key.clone()).collect::<Vec<_>>(), [global("known")]);
    assert!(oldest[0].lapsed_for > Duration::ZERO && oldest[0].lapsed_for < Duration::from_secs(5));

    let completer = operator(&store).completer(resolver(global("known"))).lapsed_for(LAPSED);
    assert_eq!(counts(completer.complete_abandoned().await.unwrap()), (1, 1, 0, 0));

    // The settled key is replayed; its handler does not run again.
    let retry = send(&app_a, keyed("POST", "/pay", "known", "{}")).await;
    assert_eq!((retry.status, retry.body.as_str()), (StatusCode::CREATED, r#"{"payment":7}"#));
    assert_eq!(retry.headers["idempotency-replayed"], "true");
    assert_eq!(retry.headers["content-type"], "application/json");
    assert_eq!(runs_a.load(Ordering::SeqCst), 1);
    // The unresolved one is left as it was, for its client's retry (and listed again).
    let left = store.abandoned_claims(Duration::ZERO, 10).await.unwrap();
    assert_eq!(left.iter().map(|c| c.key.clone()).collect::<Vec<_>>(), [global("unknown")]);
    assert_eq!(counts(completer.complete_abandoned().await.unwrap()), (0, 1, 0, 0));
    // Reported, each pass: `idempotency_abandoned_claims_total{result="unresolved"}`. (The
    // other tests of this binary leave none unresolved.)
    #[cfg(feature = "metrics")]
    {
        let unresolved: u64 = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .filter_map(|(key, .., value)| {
                let key = key.key();
                let unresolved = key.name() == "idempotency_abandoned_claims_total"
                    && key.labels().any(|l| l.key() == "result" && l.value() == "unresolved");
                match value {
                    metrics_util::debugging::DebugValue::Counter(n) if unresolved => Some(n),
                    _ => None,
                }
            })
            .sum();
        assert_eq!(unresolved, 2);
    }
    let retry = send(&app_b, keyed("POST", "/pay", "unknown", "{}")).await;
    assert_eq!((retry.status, retry.body.as_str()), (StatusCode::CREATED, "ran again"));
    assert_eq!(runs_b.load(Ordering::SeqCst), 2);
    assert!(store.abandoned_claims(Duration::ZERO, 10).await.unwrap().is_empty());
}

/// (settled, unresolved, failed, skipped).
fn counts(pass: Pass) -> (usize, usize, usize, usize) {
    (pass.settled, pass.unresolved, pass.failed, pass.skipped)
}

/// A claim without a recovery window (no hook) expires with its lease: nothing is left to
/// complete, and the listing shows nothing; nor does it show a claim whose lease runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_that_expired_or_still_run_are_not_abandoned() {
    let d = TestDatabase::create("completer").await;
    let store = store(&d).await;
    let fingerprint = axum_idempotency::Fingerprint::of_payload(b"{}");
    let (owner, lease) = (OwnerToken::random(), Lease::new(Duration::from_millis(100)));
    let claimed = store.claim(&global("expired"), &fingerprint, &owner, lease).await.unwrap();
    assert!(matches!(claimed, Claim::Claimed), "{claimed:?}");
    let running = Lease::new(Duration::from_secs(60)).recovery_window(Duration::from_secs(60));
    store.claim(&global("running"), &fingerprint, &owner, running).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(store.abandoned_claims(Duration::ZERO, 10).await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_completer_settles_a_consumer_claim_with_its_value() {
    let d = TestDatabase::create("completer").await;
    settles_a_consumer_claim(store(&d).await).await;
}

/// The completer works over every store that lists its abandoned claims (`Admin`), not only
/// PostgreSQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_completer_settles_a_claim_of_a_memory_store() {
    settles_a_consumer_claim(axum_idempotency::MemoryStore::new()).await;
}

/// A consumer's operation hangs with its claim held (its worker died); the completer stores
/// the value the hook knows, and the redelivery replays it.
async fn settles_a_consumer_claim<St: Admin>(store: St) {
    let hook = |_: Lookup<Bytes>| async { Ok::<_, BoxError>(Recovered::<i64>::Unknown) };
    let idem = Idempotent::new(store.clone()).lease(LEASE).keep_alive(None).recover(hook);
    // The worker dies mid-operation: its operation hangs with its claim held, and its
    // caller gives up.
    let started = Arc::new(AtomicUsize::new(0));
    let hang = {
        let started = started.clone();
        move |_| async move {
            started.fetch_add(1, Ordering::SeqCst);
            std::future::pending::<()>().await;
            Ok::<i64, std::io::Error>(0)
        }
    };
    // The caller gives up once the operation started (however long a cold claim took).
    let mut run = Box::pin(idem.run("payments", "evt_1", b"{}", hang));
    let running = async {
        while started.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::select! {
        ended = &mut run => panic!("the operation ended: {ended:?}"),
        () = running => {}
    }
    drop(run);
    tokio::time::sleep(LEASE + Duration::from_millis(100)).await;
    let resolve = |_: Lookup<Bytes>| async { Ok::<_, BoxError>(Recovered::Happened(42_i64)) };
    let completer = idem.operator().completer(resolve).lapsed_for(LAPSED);
    let pass = completer.complete_abandoned().await;
    assert_eq!(pass.unwrap().settled, 1);
    let redelivery =
        idem.run("payments", "evt_1", b"{}", |_| async { Ok::<i64, BoxError>(-1) }).await;
    assert!(matches!(redelivery, Ok(Outcome::Replayed(42))), "{redelivery:?}");
}

/// A key settled by a retry between the listing and the completer's takeover is not touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_a_retry_settled_first_is_skipped() {
    let d = TestDatabase::create("completer").await;
    let store = store(&d).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let app = service(&store, &runs);
    abandon(&app, "known", &runs).await;
    tokio::time::sleep(LEASE + Duration::from_millis(100)).await;
    let retried_app = app.clone();
    // The hook is slow: the client's retry takes the claim over and settles it meanwhile.
    let resolve = move |lookup: Lookup<Request<Bytes>>| {
        let app = retried_app.clone();
        async move {
            let retry = send(&app, keyed("POST", "/pay", "known", "{}")).await;
            assert_eq!(retry.body, "ran again");
            resolver(global("known"))(lookup).await
        }
    };
    let pass = operator(&store).completer(resolve).lapsed_for(LAPSED).complete_abandoned().await;
    assert_eq!(counts(pass.unwrap()), (0, 0, 0, 1));
    let replay = send(&app, keyed("POST", "/pay", "known", "{}")).await;
    assert_eq!(replay.body, "ran again", "the completer overwrote the retry's outcome");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// A hook that fails leaves the claim as it was, counted as failed, for the next pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_hook_leaves_the_claim_for_the_next_pass() {
    let d = TestDatabase::create("completer").await;
    let store = store(&d).await;
    let runs = Arc::new(AtomicUsize::new(0));
    abandon(&service(&store, &runs), "known", &runs).await;
    tokio::time::sleep(LEASE + Duration::from_millis(100)).await;
    let failing = |_: Lookup<Request<Bytes>>| async {
        Err::<Recovered<Response<Bytes>>, BoxError>("the outbox is down".into())
    };
    let completer = operator(&store).completer(failing).lapsed_for(LAPSED);
    assert_eq!(counts(completer.complete_abandoned().await.unwrap()), (0, 0, 1, 0));
    assert_eq!(counts(completer.complete_abandoned().await.unwrap()), (0, 0, 1, 0));
    assert_eq!(store.abandoned_claims(Duration::ZERO, 10).await.unwrap().len(), 1);
}
