//! Redis failing for real: private `redis-server` processes killed, paused (SIGSTOP) and
//! restarted while requests run. No mocks.

mod common;

use std::{
    collections::HashMap,
    io::Write,
    sync::{
        Arc, LazyLock, Mutex, Once,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{
    Router,
    body::Bytes,
    http::{HeaderMap, StatusCode},
    routing::post,
};
use axum_idempotency::{
    IdempotencyLayer, RedisStore,
    store::{
        RecordKey,
        deadpool_redis::redis::{self, AsyncCommands},
    },
};
use common::*;

static LOGS: LazyLock<Mutex<Vec<u8>>> = LazyLock::new(Mutex::default);
static PANICS: AtomicUsize = AtomicUsize::new(0);

struct LogWriter;

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        LOGS.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Sends the crate's logs to a buffer the tests read, and counts panics anywhere in the
/// process (a panic inside a spawned task would otherwise surface only as an answer).
fn observe() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        tracing_subscriber::fmt()
            .with_writer(|| LogWriter)
            .with_ansi(false)
            .with_env_filter("axum_idempotency=debug")
            .init();
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            default(info);
        }));
    });
}

fn logs_mentioning(needle: &str) -> Vec<String> {
    let logs = String::from_utf8_lossy(&LOGS.lock().unwrap()).into_owned();
    logs.lines().filter(|line| line.contains(needle)).map(str::to_owned).collect()
}

/// The two ways a store is built, each with `timeout`: over a pool of the app's own, and over
/// the pool it builds itself (`from_url`). Both bound each reply with redis-rs's reply timer,
/// set before each command to what is left.
fn both_stores(server: &RedisServer, timeout: Duration) -> [(&'static str, RedisStore); 2] {
    let built = RedisStore::from_url(&server.url()).unwrap();
    [
        ("app-pool", RedisStore::new(server.pool()).command_timeout(timeout)),
        ("from-url", built.command_timeout(timeout)),
    ]
}

async fn a_claim_with_unknown_outcome_never_runs_the_handler_and_is_released(built: Built) {
    observe();
    let server = RedisServer::start();
    let calls = Calls::default();
    let app =
        app(&calls).layer(IdempotencyLayer::new(built.store(&server, Duration::from_millis(200))));
    assert_eq!(send(&app, keyed("POST", "/payments", "warm", "{}")).await.status, 201);

    server.signal("-STOP");
    let during = tokio::time::timeout(
        Duration::from_secs(3),
        send(&app, keyed("POST", "/payments", "k1", "{}")),
    )
    .await
    .expect("a request against a paused Redis must not hang");
    server.signal("-CONT");
    during.assert_problem(503, "store-unavailable");
    assert_eq!(during.header("retry-after"), Some("1"));
    assert_eq!(calls.get(), 1, "the handler ran although the claim's outcome was unknown");

    // Redis ran the late claim once continued, and then the release the layer sent after it:
    // the key is free again, and the retry runs the handler, once.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(server.held(&global("k1")).await, None, "the unknown claim was left behind");
    let retry = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    assert_eq!(retry.status, 201);
    assert!(send(&app, keyed("POST", "/payments", "k1", "{}")).await.replayed());
    assert_eq!(calls.get(), 2);
    assert_eq!(PANICS.load(Ordering::SeqCst), 0);
}

async fn complete_that_fails_after_the_handler_ran_is_retried_in_the_background(built: Built) {
    observe();
    let mut server = RedisServer::start();
    let calls = Calls::default();
    let app =
        app(&calls).layer(IdempotencyLayer::new(built.store(&server, Duration::from_millis(300))));
    let first = send_in_background(&app, delayed("/slow", "k1", 300, "{}"));
    let key = global("k1");
    eventually("the claim is written", async || {
        server.connection().await.exists::<_, bool>(key.as_str()).await.unwrap()
    })
    .await;
    server.kill();
    // The client gets its response although it could not be stored.
    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    assert_eq!(first.header("x-payment"), Some("pay_1"));
    server.restart();
    eventually("the background retry stores the response", async || {
        server.held(&key).await == Some(Held::Completed)
    })
    .await;
    let retry = send(&app, keyed("POST", "/slow", "k1", "{}")).await;
    assert!(retry.replayed());
    assert_eq!(retry.header("x-payment"), Some("pay_1"));
    assert_eq!(calls.get(), 1);
    assert!(logs_mentioning(key.hash()).iter().any(|l| l.contains("storing the response failed")));
    assert!(
        logs_mentioning(key.hash())
            .iter()
            .any(|l| l.contains("store answered on retry") && l.contains("outcome=Applied"))
    );
}

async fn complete_that_keeps_failing_logs_an_error_naming_the_key_hash(built: Built) {
    observe();
    let mut server = RedisServer::start();
    let calls = Calls::default();
    // The settle keeps trying while its lease holds: a short one, so that it gives up soon.
    let store = built.store(&server, Duration::from_millis(200));
    let app = app(&calls).layer(IdempotencyLayer::new(store).lease(Duration::from_secs(1)));
    let first = send_in_background(&app, delayed("/slow", &built.key("k2"), 200, "{}"));
    let key = global(&built.key("k2"));
    eventually("the claim is written", async || {
        server.connection().await.exists::<_, bool>(key.as_str()).await.unwrap()
    })
    .await;
    server.kill();
    assert_eq!(first.await.unwrap().status, 201);
    eventually("the final error is logged", async || {
        logs_mentioning(key.hash())
            .iter()
            .any(|l| l.contains("ERROR") && l.contains("could not be stored"))
    })
    .await;
    // Hashes are hex, so "k2" in a line can only be the raw key.
    assert!(logs_mentioning(key.hash()).iter().all(|l| !l.contains("k2")), "raw key logged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_policy_other_than_noeviction_is_warned_about_once() {
    observe();
    let lru = RedisServer::start_with(&["--maxmemory-policy", "allkeys-lru"]);
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(RedisStore::new(lru.pool())));
    for i in 0..3 {
        send(&app, keyed("POST", "/payments", &format!("k{i}"), "{}")).await;
    }
    let warnings = logs_mentioning("policy=\"allkeys-lru\"");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("WARN") && warnings[0].contains("noeviction"));
}

/// One answer seen by the load.
async fn redis_faults_under_load_never_panic_hang_or_run_a_key_twice(built: Built) {
    observe();
    let mut server = RedisServer::start();
    let executions: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let handler = {
        let executions = executions.clone();
        move |headers: HeaderMap, body: Bytes| async move {
            let key = headers["idempotency-key"].to_str().unwrap().to_owned();
            *executions.lock().unwrap().entry(key).or_default() += 1;
            tokio::time::sleep(Duration::from_millis(5)).await;
            (StatusCode::CREATED, body)
        }
    };
    let layer = IdempotencyLayer::new(built.store(&server, Duration::from_millis(300)))
        .lease(Duration::from_secs(2));
    let app = Router::new().route("/pay", post(handler)).layer(layer);

    // Half the requests share five hot keys per 400 ms window; half are fresh.
    let (load_for, window) = (Duration::from_millis(4000), Duration::from_millis(400));
    let load = load::Load::start(&app, load_for, window, Duration::from_secs(2));
    let start = load.start;

    let at = |ms: u64| tokio::time::sleep_until((start + Duration::from_millis(ms)).into());
    at(400).await;
    let mut redis = server.connection().await;
    let () = redis::cmd("SCRIPT").arg("FLUSH").query_async(&mut redis).await.unwrap();
    at(800).await;
    server.signal("-STOP"); // longer than the 300 ms command timeout
    at(1600).await;
    server.signal("-CONT");
    at(2200).await;
    let killed_at = Instant::now();
    server.kill();
    at(2400).await;
    server.restart();
    let restarted_at = Instant::now();
    let mut probe = 0;
    loop {
        probe += 1;
        let seen = send(&app, keyed("POST", "/pay", &format!("probe-{probe}"), "{}")).await;
        if seen.status == StatusCode::CREATED {
            break;
        }
        assert!(
            restarted_at.elapsed() < Duration::from_secs(1),
            "no success within 1 s of the restart"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let recovered_in = restarted_at.elapsed();
    let answers = load.finish().await;
    let executions = executions.lock().unwrap();
    let mut tally: HashMap<u16, usize> = HashMap::new();
    for answer in &answers {
        *tally.entry(answer.status).or_default() += 1;
        match answer.status {
            201 | 202 => {}
            503 => assert!(answer.retry_after, "503 without Retry-After"),
            other => panic!("status {other} for {}", answer.key),
        }
    }
    // Keys whose every request ran while Redis kept its data (before the kill, or after the
    // restart) ran at most once.
    let mut span: HashMap<&str, (Instant, Instant)> = HashMap::new();
    for answer in &answers {
        let entry = span.entry(&answer.key).or_insert((answer.sent, answer.done));
        entry.0 = entry.0.min(answer.sent);
        entry.1 = entry.1.max(answer.done);
    }
    let mut checked = 0;
    for (key, (first, last)) in &span {
        if last < &killed_at || first > &restarted_at {
            checked += 1;
            let ran = executions.get(*key).copied().unwrap_or(0);
            assert!(ran <= 1, "{key} ran {ran} times with Redis up");
        }
    }
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "something panicked");
    assert!(tally.get(&201).copied().unwrap_or(0) > 100, "too little load got through: {tally:?}");
    assert!(tally.contains_key(&503), "the faults never reached a request: {tally:?}");
    eprintln!(
        "load: {} answers {tally:?}; {checked} keys checked for single execution; recovered {recovered_in:?} after restart",
        answers.len()
    );
}

async fn a_request_dropped_while_claiming_releases_what_it_claimed(built: Built) {
    observe();
    let server = RedisServer::start();
    let calls = Calls::default();
    let app = app(&calls)
        .layer(IdempotencyLayer::new(built.store(&server, Duration::from_millis(3_000))));
    assert_eq!(send(&app, keyed("POST", "/payments", "warm", "{}")).await.status, 201);

    // The claim is on the wire when the client goes away.
    server.signal("-STOP");
    let request = keyed("POST", "/payments", "k1", "{}");
    let gave_up = tokio::time::timeout(
        Duration::from_millis(100),
        tower::ServiceExt::oneshot(app.clone(), request),
    )
    .await;
    assert!(gave_up.is_err());
    server.signal("-CONT");
    // Redis runs the claim, then the release the dropped request sent after it.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        server.held(&global("k1")).await,
        None,
        "the dropped request's claim was left behind"
    );
    let retry = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(calls.get(), 2);
}

async fn a_guard_that_cannot_reach_redis_gives_up_after_a_lease_and_says_so(built: Built) {
    // Redis stays paused: the guard of the unanswered claim tries to abandon it for one lease
    // (1 s here), then stops and logs an error naming the key hash; it does not try forever.
    observe();
    let server = RedisServer::start();
    let calls = Calls::default();
    let layer = IdempotencyLayer::new(built.store(&server, Duration::from_millis(200)))
        .lease(Duration::from_secs(1));
    let app = app(&calls).layer(layer);
    assert_eq!(send(&app, keyed("POST", "/payments", "warm", "{}")).await.status, 201);
    server.signal("-STOP");
    let guarded = built.key("guarded");
    let key = RecordKey::new("idempotency", b"", guarded.as_bytes());
    send(&app, keyed("POST", "/payments", &guarded, "{}"))
        .await
        .assert_problem(503, "store-unavailable");
    let gave_up = "could not abandon a claim whose outcome is unknown";
    eventually_within(Duration::from_secs(4), "the guard gives up and says so", async || {
        logs_mentioning(key.hash()).iter().any(|line| line.contains(gave_up))
    })
    .await;
    server.signal("-CONT");
    assert_eq!(calls.get(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_timeout_longer_than_redis_rs_default_is_waited_out() {
    // redis-rs gives up on a reply after 500 ms unless told otherwise: a store whose command
    // timeout is two seconds waits out a Redis paused for 900 ms, and runs the handler once.
    // Both stores on one server, each with keys of its own.
    let server = RedisServer::start();
    let apps = both_stores(&server, Duration::from_secs(2)).map(|(name, store)| {
        let calls = Calls::default();
        (name, app(&calls).layer(IdempotencyLayer::new(store)), calls)
    });
    for (name, app, _) in &apps {
        let warm = keyed("POST", "/payments", &format!("warm-{name}"), "{}");
        assert_eq!(send(app, warm).await.status, 201, "{name}");
    }
    server.signal("-STOP");
    let during = apps.each_ref().map(|(name, app, _)| {
        send_in_background(app, keyed("POST", "/payments", &format!("k1-{name}"), "{}"))
    });
    tokio::time::sleep(Duration::from_millis(900)).await;
    server.signal("-CONT");
    for ((name, app, calls), during) in apps.iter().zip(during) {
        let during = during.await.unwrap();
        assert_eq!(during.status, 201, "{name}: {:?}", during.body);
        let retry = keyed("POST", "/payments", &format!("k1-{name}"), "{}");
        assert!(send(app, retry).await.replayed(), "{name}");
        assert_eq!(calls.get(), 2, "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_against_a_paused_redis_ends_within_the_command_timeout() {
    // More operations than the connection's pipeline channel holds (50): those that wait for
    // room in it are bounded too, as are those on the wire. redis-rs's own 500 ms reply timer
    // would answer too late; no bound at all, never.
    use axum_idempotency::{
        Fingerprint,
        store::{Lease, OwnerToken, Store, StoreError},
    };
    let server = RedisServer::start();
    let fingerprint = Fingerprint::of_payload(b"{}");
    let lease = Lease::new(Duration::from_secs(30));
    let stores = both_stores(&server, Duration::from_millis(150));
    for (name, store) in &stores {
        let owner = OwnerToken::random();
        let warm = store.claim(&global(&format!("warm-{name}")), &fingerprint, &owner, lease).await;
        assert!(warm.is_ok(), "{name}: {warm:?}");
    }
    server.signal("-STOP");
    let operations: Vec<_> = (0..200)
        .flat_map(|i| stores.iter().map(move |(name, store)| (i, *name, store.clone())))
        .map(|(i, name, store)| {
            let fingerprint = fingerprint.clone();
            tokio::spawn(async move {
                let started = Instant::now();
                let key = global(&format!("k{i}-{name}"));
                let owner = OwnerToken::random();
                let claim = store.claim(&key, &fingerprint, &owner, lease);
                // Bounded here too, so that an unbounded store fails the test, not hangs it.
                let claim = tokio::time::timeout(Duration::from_secs(2), claim).await;
                (name, claim, started.elapsed())
            })
        })
        .collect();
    let mut slowest = [Duration::ZERO; 2];
    for operation in operations {
        let (name, claim, took) = operation.await.unwrap();
        let claim = claim.unwrap_or_else(|_| panic!("{name}: an operation never ended"));
        assert!(matches!(claim, Err(StoreError::Timeout(_))), "{name}: {claim:?}");
        let slot = usize::from(name == "from-url");
        slowest[slot] = slowest[slot].max(took);
    }
    server.signal("-CONT");
    // 250 ms of slack for a loaded machine, and still short of redis-rs's 500.
    assert!(slowest[0] < Duration::from_millis(400), "app-pool: {:?}", slowest[0]);
    assert!(slowest[1] < Duration::from_millis(400), "from-url: {:?}", slowest[1]);
    // Each took the command timeout at least: neither ended before its time.
    assert!(slowest.iter().all(|took| *took >= Duration::from_millis(150)), "{slowest:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_timeout_of_duration_max_means_none_and_never_panics() {
    let server = RedisServer::start();
    for (name, store) in both_stores(&server, Duration::MAX) {
        let calls = Calls::default();
        let app = app(&calls).layer(IdempotencyLayer::new(store));
        let key = format!("k1-{name}");
        let first = send(&app, keyed("POST", "/payments", &key, "{}")).await;
        assert_eq!(first.status, 201, "{name}");
        assert!(send(&app, keyed("POST", "/payments", &key, "{}")).await.replayed(), "{name}");
        assert_eq!(calls.get(), 1, "{name}");
    }
}

both_redis_stores!(
    a_claim_with_unknown_outcome_never_runs_the_handler_and_is_released,
    complete_that_fails_after_the_handler_ran_is_retried_in_the_background,
    complete_that_keeps_failing_logs_an_error_naming_the_key_hash,
    redis_faults_under_load_never_panic_hang_or_run_a_key_twice,
    a_request_dropped_while_claiming_releases_what_it_claimed,
    a_guard_that_cannot_reach_redis_gives_up_after_a_lease_and_says_so,
);

/// With a subscriber that records it, each handled request has its `idempotency` span, and the
/// layer's events sit in it with the request's key hash and outcome (a span nobody records is
/// not entered; see `src/layer/service.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorded_requests_events_sit_in_its_span_with_the_outcome() {
    observe();
    let server = RedisServer::start();
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(server.store()));
    let key = "span-k1";
    assert_eq!(send(&app, keyed("POST", "/payments", key, "{}")).await.status, 201);
    assert!(send(&app, keyed("POST", "/payments", key, "{}")).await.replayed());
    let hash = global(key).hash().to_owned();
    let replayed: Vec<_> = logs_mentioning("idempotency: replayed")
        .into_iter()
        .filter(|line| line.contains(&hash))
        .collect();
    assert_eq!(replayed.len(), 1, "{replayed:?}");
    let line = &replayed[0];
    assert!(line.contains(&format!("idempotency{{key_hash=\"{hash}\"")), "{line}");
    assert!(line.contains("outcome=\"replayed\"") && line.contains("replayed=true"), "{line}");
}
