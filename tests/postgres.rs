//! `PostgresStore` beyond the shared suites: the sweep of expired rows, the schema and its
//! names, waiting through `LISTEN`/`NOTIFY` (and a listener connection killed), and a database
//! that cannot be reached or drops the store's connections. Each test has a database of its
//! own on the server `DATABASE_URL` names, dropped at the end.

mod common;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use axum::{
    Router,
    body::Bytes,
    http::{HeaderMap, StatusCode},
    routing::post,
};

use axum_idempotency::settings::Waiting;
use axum_idempotency::{
    Fingerprint, IdempotencyLayer,
    store::{
        Claim, Fenced, Lease, OwnerToken, PostgresStore, RecordKey, Store, StoreError,
        sqlx::{PgPool, postgres::PgPoolOptions},
    },
};
use common::*;

async fn harness() -> PostgresHarness {
    <PostgresHarness as Harness>::start().await
}

fn key(name: &str) -> RecordKey {
    RecordKey::new("idempotency", b"", name.as_bytes())
}

/// The backends of the test's database other than `ours`, whose query starts with `like`.
async fn backends(h: &PostgresHarness, like: &str) -> Vec<i32> {
    let sql = "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid() \
               AND query LIKE $2";
    let client = h.database.client().await;
    let rows = client.query(sql, &[&h.database.name, &format!("{like}%")]).await.unwrap();
    rows.iter().map(|row| row.get(0)).collect()
}

async fn terminate(h: &PostgresHarness, pids: &[i32]) {
    let client = h.database.client().await;
    for pid in pids {
        client.execute("SELECT pg_terminate_backend($1)", &[pid]).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_rows_are_swept_in_batches_and_live_ones_kept() {
    let h = harness().await;
    let store = h.store().sweep_every(None);
    let fingerprint = Fingerprint::of_payload(b"f");
    let short = Lease::new(Duration::from_millis(1));
    for i in 0..7 {
        let claim = store
            .claim(&key(&format!("gone-{i}")), &fingerprint, &OwnerToken::random(), short)
            .await;
        assert_eq!(claim.unwrap(), Claim::Claimed);
    }
    let long = Lease::new(Duration::from_secs(60));
    for i in 0..3 {
        store
            .claim(&key(&format!("live-{i}")), &fingerprint, &OwnerToken::random(), long)
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    let rows = "SELECT count(*) FROM idempotency_records WHERE state <> 'F'";
    let client = h.database.client().await;
    assert_eq!(client.query_one(rows, &[]).await.unwrap().get::<_, i64>(0), 10);
    // Batches of 3: 3 + 3 + 1.
    assert_eq!(store.sweep_expired(3).await.unwrap(), 7);
    assert_eq!(client.query_one(rows, &[]).await.unwrap().get::<_, i64>(0), 3);
    assert_eq!(h.record_count().await, 3);
    assert_eq!(store.sweep_expired(3).await.unwrap(), 0);
    // A batch of 0 is a batch of 1, never a loop that does not end.
    store.claim(&key("gone-again"), &fingerprint, &OwnerToken::random(), short).await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let zero = tokio::time::timeout(Duration::from_secs(5), store.sweep_expired(0)).await;
    assert_eq!(zero.expect("a batch of 0 returns").unwrap(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_sweeps_by_itself() {
    let h = harness().await;
    let store = h.store().sweep_every(Some(Duration::from_millis(100)));
    let fingerprint = Fingerprint::of_payload(b"f");
    let short = Lease::new(Duration::from_millis(1));
    store.claim(&key("gone"), &fingerprint, &OwnerToken::random(), short).await.unwrap();
    let client = h.database.client().await;
    eventually("the expired row is swept by the store's own task", async || {
        let rows = client
            .query_one("SELECT count(*) FROM idempotency_records WHERE state <> 'F'", &[])
            .await
            .unwrap();
        rows.get::<_, i64>(0) == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_keeps_its_period_while_claims_keep_coming() {
    // Claims every 20 ms against a sweep every 100 ms: a claim finds the sweep running and
    // leaves it be (restarting it on each would put the next sweep off for good).
    let h = harness().await;
    let store = h.store().sweep_every(Some(Duration::from_millis(100)));
    let fingerprint = Fingerprint::of_payload(b"f");
    let gone = key("gone");
    let short = Lease::new(Duration::from_millis(1));
    store.claim(&gone, &fingerprint, &OwnerToken::random(), short).await.unwrap();
    let client = h.database.client().await;
    let sql = "SELECT count(*) FROM idempotency_records WHERE key = $1";
    let started = Instant::now();
    let mut claims = 0;
    while client.query_one(sql, &[&gone.as_str()]).await.unwrap().get::<_, i64>(0) == 1 {
        assert!(started.elapsed() < Duration::from_secs(3), "not swept after {claims} claims");
        let key = key(&format!("k{claims}"));
        let lease = Lease::new(Duration::from_secs(60));
        store.claim(&key, &fingerprint, &OwnerToken::random(), lease).await.unwrap();
        claims += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_sweeps_again_on_a_new_runtime_after_its_first_ended() {
    // The sweep is a task of the runtime of the store's first claim, and ends with it; a claim
    // on another runtime starts it again there.
    let h = harness().await;
    let store = h.store_shared_by_runtimes().sweep_every(Some(Duration::from_millis(100)));
    let fingerprint = Fingerprint::of_payload(b"f");
    let short = Lease::new(Duration::from_millis(1));
    let ended = {
        let (store, fingerprint) = (store.clone(), fingerprint.clone());
        tokio::task::spawn_blocking(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
            let (first, owner) = (key("first"), OwnerToken::random());
            runtime.block_on(store.claim(&first, &fingerprint, &owner, short)).unwrap();
        })
    };
    ended.await.unwrap();
    // The pool may lend a connection the ended runtime made, which fails its statement once
    // (see the harness): a caller's retry gets through once they are spent.
    let mut claimed = Err(StoreError::Timeout(Duration::ZERO));
    for _ in 0..5 {
        claimed = store.claim(&key("second"), &fingerprint, &OwnerToken::random(), short).await;
        if !matches!(&claimed, Err(error) if error.is_unavailable()) {
            break;
        }
    }
    claimed.unwrap();
    let client = h.database.client().await;
    eventually("both expired rows are swept by the store's own task", async || {
        let rows = client
            .query_one("SELECT count(*) FROM idempotency_records WHERE state <> 'F'", &[])
            .await
            .unwrap();
        rows.get::<_, i64>(0) == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lapsed_claims_are_counted_with_the_age_of_the_oldest() {
    let h = harness().await;
    let store = h.store().sweep_every(None);
    let none = store.lapsed_claims().await.unwrap();
    assert_eq!((none.count, none.oldest), (0, None));
    let fingerprint = Fingerprint::of_payload(b"f");
    let lapsing = Lease::new(Duration::from_millis(50)).recovery_window(Duration::from_secs(60));
    for name in ["dead-1", "dead-2"] {
        store.claim(&key(name), &fingerprint, &OwnerToken::random(), lapsing).await.unwrap();
    }
    // Still held, completed, and expired past its window: none of them counts.
    let held = Lease::new(Duration::from_secs(60));
    store.claim(&key("held"), &fingerprint, &OwnerToken::random(), held).await.unwrap();
    let owner = OwnerToken::random();
    store.claim(&key("done"), &fingerprint, &owner, lapsing).await.unwrap();
    store
        .complete(&key("done"), &owner, &fingerprint, "ok".into(), Duration::from_secs(60))
        .await
        .unwrap();
    let gone = Lease::new(Duration::from_millis(1));
    store.claim(&key("gone"), &fingerprint, &OwnerToken::random(), gone).await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let lapsed = store.lapsed_claims().await.unwrap();
    assert_eq!(lapsed.count, 2);
    let oldest = lapsed.oldest.unwrap();
    assert!((Duration::from_millis(300)..Duration::from_secs(3)).contains(&oldest), "{oldest:?}");
    // A takeover holds its key again: it no longer counts.
    store.claim(&key("dead-1"), &fingerprint, &OwnerToken::random(), held).await.unwrap();
    assert_eq!(store.lapsed_claims().await.unwrap().count, 1);
}

/// With `metrics`, each round of the store's sweep sets two gauges, labelled by table: the
/// claims whose lease lapsed, and how long ago the oldest lapsed.
#[cfg(feature = "metrics")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_sets_the_lapsed_claims_gauges() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install().expect("the only recorder of this test binary");
    // One snapshot (reading a gauge resets it to 0): each gauge's labels and value.
    let gauges = || {
        let snapshot = snapshotter.snapshot().into_vec().into_iter();
        let gauges = snapshot.filter_map(|(key, .., value)| {
            let DebugValue::Gauge(value) = value else { return None };
            let key = key.key();
            let labels: Vec<String> =
                key.labels().map(|l| format!("{}={}", l.key(), l.value())).collect();
            Some((key.name().to_owned(), (labels, value.into_inner())))
        });
        gauges.collect::<std::collections::BTreeMap<_, _>>()
    };
    let h = harness().await;
    let store = h.store().sweep_every(Some(Duration::from_millis(100)));
    let fingerprint = Fingerprint::of_payload(b"f");
    let lapsing = Lease::new(Duration::from_millis(50)).recovery_window(Duration::from_secs(60));
    let owners = [OwnerToken::random(), OwnerToken::random()];
    let first_claimed = Instant::now();
    store.claim(&key("dead-1"), &fingerprint, &owners[0], lapsing).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let second_claimed = Instant::now();
    store.claim(&key("dead-2"), &fingerprint, &owners[1], lapsing).await.unwrap();
    let held = Lease::new(Duration::from_secs(60));
    store.claim(&key("held"), &fingerprint, &OwnerToken::random(), held).await.unwrap();
    let table = vec!["table=idempotency_records".to_owned()];
    // The oldest lapse of the claims made at `since`, as a sweep round within the last 0.4 s
    // measured it.
    let counted = async |count: f64, since: Instant| {
        eventually_within(Duration::from_secs(3), &format!("{count} lapsed claims"), async || {
            let lapsed_for = since.elapsed().as_secs_f64() - 0.05;
            let gauges = gauges();
            let (labels, counted) = &gauges["idempotency_lapsed_claims"];
            let (_, age) = &gauges["idempotency_oldest_lapsed_claim_seconds"];
            assert_eq!(labels, &table);
            *counted == count && (lapsed_for - 0.4..lapsed_for + 0.05).contains(age)
        })
        .await;
    };
    counted(2.0, first_claimed).await;
    // The first holder finishes after all (nobody took over): the second is the oldest.
    let first = key("dead-1");
    let done = store.complete(&first, &owners[0], &fingerprint, "ok".into(), held.duration);
    assert_eq!(done.await.unwrap(), Fenced::Applied);
    counted(1.0, second_claimed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_is_safe_on_every_start_and_side_by_side() {
    let h = harness().await;
    let stores: Vec<PostgresStore> = (0..4).map(|_| PostgresStore::new(h.pool())).collect();
    let migrations =
        futures_util::future::join_all(stores.iter().map(PostgresStore::migrate)).await;
    assert!(migrations.iter().all(Result::is_ok), "{migrations:?}");
    h.store().migrate().await.unwrap();
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(stores[0].clone()));
    assert_eq!(send(&app, keyed("POST", "/payments", "k1", "{}")).await.status, 201);
    assert!(send(&app, keyed("POST", "/payments", "k1", "{}")).await.replayed());
    assert_eq!(calls.get(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_name_that_is_not_a_plain_identifier_is_refused() {
    let h = harness().await;
    for bad in ["keys; DROP TABLE x", "Keys", "", "a-b", "1keys"] {
        let refused = PostgresStore::with_table(h.pool(), bad).unwrap_err();
        assert!(refused.to_string().contains("lowercase letters"), "{refused}");
    }
    let store = PostgresStore::with_table(h.pool(), "payment_keys").unwrap();
    assert!(store.schema().contains("CREATE TABLE IF NOT EXISTS payment_keys ("));
    store.migrate().await.unwrap();
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(store));
    assert_eq!(send(&app, keyed("POST", "/payments", "k1", "{}")).await.status, 201);
    let client = h.database.client().await;
    let rows = "SELECT count(*) FROM payment_keys WHERE state <> 'F'";
    assert_eq!(client.query_one(rows, &[]).await.unwrap().get::<_, i64>(0), 1);
    let rows = "SELECT count(*) FROM idempotency_records";
    assert_eq!(client.query_one(rows, &[]).await.unwrap().get::<_, i64>(0), 0);
}

/// Counts the notifications on the store's channel, heard by a connection of the test's own.
async fn notifications(h: &PostgresHarness) -> tokio::sync::mpsc::UnboundedReceiver<String> {
    let mut listener =
        axum_idempotency::store::sqlx::postgres::PgListener::connect_with(&h.pool()).await.unwrap();
    listener.listen("idempotency_records_settled").await.unwrap();
    let (heard, received) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok(notification) = listener.recv().await {
            let _ = heard.send(notification.payload().to_owned());
        }
    });
    received
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_is_woken_by_the_settle_and_only_waited_records_notify() {
    let h = harness().await;
    let mut heard = notifications(&h).await;
    let calls = Calls::default();
    let a = app(&calls)
        .layer(IdempotencyLayer::new(h.store()).waiting(Waiting::up_to(Duration::from_secs(8))));
    let b = app(&calls).layer(
        IdempotencyLayer::new(h.second_store()).waiting(Waiting::up_to(Duration::from_secs(8))),
    );
    // Nobody waits: no notification.
    assert_eq!(send(&a, keyed("POST", "/payments", "alone", "{}")).await.status, 201);
    let original = send_in_background(&a, delayed("/slow", "k1", 700, "{}"));
    tokio::time::sleep(Duration::from_millis(150)).await;
    let started = Instant::now();
    let waiter = send(&b, delayed("/slow", "k1", 700, "{}")).await;
    let waited = started.elapsed();
    let original = original.await.unwrap();
    assert_eq!(original.status, 201);
    assert!(waiter.replayed(), "{waiter:?}");
    assert_eq!(waiter.body, original.body);
    assert_eq!(calls.get(), 2);
    assert!(waited < Duration::from_secs(2), "woken by its deadline, not the settle: {waited:?}");
    let payload = tokio::time::timeout(Duration::from_secs(2), heard.recv()).await.unwrap();
    assert_eq!(payload.as_deref(), Some(global("k1").as_str()));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(heard.try_recv().is_err(), "a record nobody waited for notified");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_listener_connection_strands_no_waiter_and_waiting_works_again() {
    let h = harness().await;
    let calls = Calls::default();
    let wait = Duration::from_secs(3);
    let app = app(&calls).layer(IdempotencyLayer::new(h.store()).waiting(Waiting::up_to(wait)));
    // A first waiter starts the listener.
    let original = send_in_background(&app, delayed("/slow", "k0", 300, "{}"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(send(&app, delayed("/slow", "k0", 300, "{}")).await.replayed());
    original.await.unwrap();

    let original = send_in_background(&app, delayed("/slow", "k1", 1500, "{}"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let waiter = send_in_background(&app, delayed("/slow", "k1", 1500, "{}"));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let listeners = backends(&h, "LISTEN").await;
    assert_eq!(listeners.len(), 1, "one listener connection per store");
    terminate(&h, &listeners).await;
    // Woken by the loss or its deadline, it answers with the original's response.
    let started = Instant::now();
    let waiter = waiter.await.unwrap();
    assert!(started.elapsed() < wait + Duration::from_secs(1));
    let original = original.await.unwrap();
    assert!(waiter.replayed(), "{waiter:?}");
    assert_eq!(waiter.body, original.body);

    // After the reconnect, a settle wakes a waiter again.
    eventually("the listener is back", async || backends(&h, "LISTEN").await.len() == 1).await;
    let original = send_in_background(&app, delayed("/slow", "k2", 700, "{}"));
    tokio::time::sleep(Duration::from_millis(150)).await;
    let started = Instant::now();
    assert!(send(&app, delayed("/slow", "k2", 700, "{}")).await.replayed());
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    original.await.unwrap();
    assert_eq!(calls.get(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_postgres_is_503_and_the_handler_does_not_run() {
    let port = free_port();
    let pool: PgPool = PgPoolOptions::new()
        .test_before_acquire(false)
        .connect_lazy(&format!("postgres://postgres@127.0.0.1:{port}/nothing"))
        .unwrap();
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(PostgresStore::new(pool)));
    let started = Instant::now();
    let seen = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    seen.assert_problem(503, "store-unavailable");
    assert!(seen.header("retry-after").is_some());
    assert_eq!(calls.get(), 0);
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_store_connections_run_no_key_twice_and_requests_succeed_again() {
    let h = harness().await;
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(h.store()));
    for i in 0..20 {
        assert_eq!(
            send(&app, keyed("POST", "/payments", &format!("warm-{i}"), "{}")).await.status,
            201
        );
    }
    let load = {
        let app = app.clone();
        tokio::spawn(async move {
            let mut statuses = Vec::new();
            for i in 0..200 {
                let key: &'static str = Box::leak(format!("k{}", i % 50).into_boxed_str());
                statuses.push(send(&app, keyed("POST", "/payments", key, "{}")).await.status);
            }
            statuses
        })
    };
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(40)).await;
        let pids = backends(&h, "").await;
        terminate(&h, &pids).await;
    }
    let statuses = load.await.unwrap();
    assert!(statuses.iter().all(|s| matches!(s.as_u16(), 201 | 503)), "{statuses:?}");
    // 20 warm-up keys and 50 keys under load: each ran at most once.
    assert!(calls.get() <= 70, "{} runs for 70 keys", calls.get());
    eventually("requests succeed again", async || {
        send(&app, keyed("POST", "/payments", "after", "{}")).await.status == 201
    })
    .await;
}

/// How many times each of the store's functions ran, from the server's own counters
/// (`track_functions`): one call is one statement, one round trip; and, under `"inserted"` and
/// `"updated"`, the rows the table's statements inserted and updated. A backend publishes its
/// counters within its idle interval (10 s), so this waits that long first.
async fn calls_of_functions(h: &PostgresHarness) -> std::collections::BTreeMap<String, i64> {
    tokio::time::sleep(Duration::from_millis(11_000)).await;
    let client = h.database.client().await;
    let sql = "SELECT funcname::text, calls FROM pg_stat_user_functions";
    let rows = client.query(sql, &[]).await.unwrap();
    let mut calls: std::collections::BTreeMap<String, i64> = rows
        .iter()
        .map(|row| (row.get::<_, String>(0).replace("idempotency_records_", ""), row.get(1)))
        .collect();
    let sql = "SELECT n_tup_ins, n_tup_upd FROM pg_stat_user_tables \
               WHERE relname = 'idempotency_records'";
    let row = client.query_one(sql, &[]).await.unwrap();
    calls.insert("inserted".into(), row.get(0));
    calls.insert("updated".into(), row.get(1));
    calls
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trips_fresh_2_replay_1_in_progress_1_pass_through_0() {
    let h = harness().await;
    let admin = postgres::connect(&h.database.admin).await.unwrap();
    let track = format!("ALTER DATABASE {} SET track_functions = 'pl'", h.database.name);
    admin.batch_execute(&track).await.unwrap();
    // A pool of its own, whose sessions start after the setting.
    let calls = Calls::default();
    let store = PostgresStore::new(h.pool()).sweep_every(None);
    let app = app(&calls).layer(IdempotencyLayer::new(store).waiting(Waiting::off()));
    let before = calls_of_functions(&h).await;
    assert!(before.values().all(|calls| *calls == 0), "{before:?}");

    // Fresh: a claim and a complete.
    assert_eq!(send(&app, keyed("POST", "/payments", "k1", "{}")).await.status, 201);
    // Replay: a claim.
    assert!(send(&app, keyed("POST", "/payments", "k1", "{}")).await.replayed());
    // In progress: the retry's claim (the original is a fresh request).
    let original = send_in_background(&app, delayed("/slow", "k2", 500, "{}"));
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(send(&app, delayed("/slow", "k2", 500, "{}")).await.status, 202);
    assert_eq!(original.await.unwrap().status, 201);
    // Pass-through: nothing.
    assert_eq!(send(&app, keyed("GET", "/payments", "k3", "")).await.status, 201);
    let mut unkeyed = keyed("POST", "/payments", "k4", "{}");
    unkeyed.headers_mut().remove("idempotency-key");
    assert_eq!(send(&app, unkeyed).await.status, 201);
    assert_eq!(calls.get(), 4);

    let after = calls_of_functions(&h).await;
    // 1 + 1 + (1 + 1): fresh, replay, and the in-progress retry beside its fresh original.
    assert_eq!(after.get("claim"), Some(&4), "{after:?}");
    // Each complete of a live claim is one plain UPDATE, with no call of the function: the
    // two fresh requests' claims inserted two rows, their completes updated them, and
    // nothing else wrote the table (the in-progress retry does not wait, so marks nothing)
    // but the door's first claim, which announced it to its fleet: the registry's row,
    // inserted as the door said it was starting, and updated as it said it runs (announced
    // again only a third of a lease later).
    assert_eq!(after.get("inserted"), Some(&3), "{after:?}");
    assert_eq!(after.get("updated"), Some(&3), "{after:?}");
    for other in ["complete", "release", "touch", "abandon"] {
        assert_eq!(after.get(other).copied().unwrap_or(0), 0, "{other}: {after:?}");
    }
}

/// A store over a private server, migrated, with a short command timeout.
async fn private_store(server: &postgres::PrivatePostgres) -> PostgresStore {
    let pool = PgPoolOptions::new()
        .test_before_acquire(false)
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy(&server.url())
        .unwrap();
    let store = PostgresStore::new(pool).command_timeout(Duration::from_millis(500));
    store.migrate().await.unwrap();
    store
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_paused_past_the_command_timeout_answers_503_and_locks_no_key() {
    let server = postgres::PrivatePostgres::start();
    let calls = Calls::default();
    let app = app(&calls)
        .layer(IdempotencyLayer::new(private_store(&server).await).lease(Duration::from_secs(2)));
    assert_eq!(send(&app, keyed("POST", "/payments", "before", "{}")).await.status, 201);

    server.signal("-STOP");
    let started = Instant::now();
    let paused = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    paused.assert_problem(503, "store-unavailable");
    assert!(paused.header("retry-after").is_some());
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    // Past every timeout: the claim sits in the server's socket, and lands when it resumes.
    tokio::time::sleep(Duration::from_secs(3)).await;
    server.signal("-CONT");

    // It landed after its deadline and wrote nothing, or its guard abandoned it: either way
    // the retry runs at once, not after a lease, and the handler runs once.
    eventually_within(Duration::from_secs(5), "the key is free after the resume", async || {
        send(&app, keyed("POST", "/payments", "k1", "{}")).await.status == 201
    })
    .await;
    assert!(send(&app, keyed("POST", "/payments", "k1", "{}")).await.replayed());
    assert_eq!(calls.get(), 2, "the handler ran once for k1, once for the warm-up");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_and_restarted_database_keeps_completed_records() {
    let mut server = postgres::PrivatePostgres::start();
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(private_store(&server).await));
    let first = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    assert_eq!(first.status, 201);

    server.crash();
    let down = send(&app, keyed("POST", "/payments", "k2", "{}")).await;
    down.assert_problem(503, "store-unavailable");
    server.run();

    // Committed is durable: the record is replayed after the crash, and new keys run.
    eventually("requests succeed again after the restart", async || {
        send(&app, keyed("POST", "/payments", "k2", "{}")).await.status == 201
    })
    .await;
    let replay = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, first.body);
    assert_eq!(calls.get(), 2);
}

/// PostgreSQL crashed (SIGKILL to every process) and restarted while eight clients send
/// requests: every answer is 201, 202 or 503 with `Retry-After`, none hangs, nothing
/// panics, no key runs twice, requests succeed again within seconds of the restart, and the
/// records completed before the crash are replayed after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_crashed_and_restarted_under_load_runs_no_key_twice() {
    static PANICS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        default(info);
    }));
    let mut server = postgres::PrivatePostgres::start();
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
    // The lease (2 s) outlasts the requests of any one key (a 1 s window): a key whose
    // completion the crash lost is never taken over within the test, so none may run twice.
    let layer = IdempotencyLayer::new(private_store(&server).await).lease(Duration::from_secs(2));
    let app = Router::new().route("/pay", post(handler)).layer(layer);

    let (load_for, window) = (Duration::from_millis(4000), Duration::from_secs(1));
    let load = load::Load::start(&app, load_for, window, Duration::from_secs(3));
    let start = load.start;

    tokio::time::sleep_until((start + Duration::from_millis(1300)).into()).await;
    let crashed_at = Instant::now();
    tokio::task::block_in_place(|| server.crash());
    tokio::time::sleep(Duration::from_millis(200)).await;
    tokio::task::block_in_place(|| server.run());
    let restarted_at = Instant::now();
    let probes = std::sync::atomic::AtomicUsize::new(0);
    eventually_within(Duration::from_secs(5), "a success after the restart", async || {
        let probe = format!("probe-{}", probes.fetch_add(1, std::sync::atomic::Ordering::SeqCst));
        send(&app, keyed("POST", "/pay", &probe, "{}")).await.status == StatusCode::CREATED
    })
    .await;
    let recovered_in = restarted_at.elapsed();
    let answers = load.finish().await;
    let mut tally: HashMap<u16, usize> = HashMap::new();
    for answer in &answers {
        *tally.entry(answer.status).or_default() += 1;
        match answer.status {
            201 | 202 => {}
            503 => assert!(answer.retry_after, "503 without Retry-After for {}", answer.key),
            other => panic!("status {other} for {}", answer.key),
        }
    }
    // Completed before the crash: the records outlived it. Those the load asked again after
    // the restart were replayed (counted); each is asked again now too, and must be replayed
    // without its handler running (the load alone may ask none of them again after a slow
    // restart: a key's requests span one window).
    let mut completed_before: Vec<&str> = answers
        .iter()
        .filter(|a| a.status == 201 && !a.replayed && a.done < crashed_at)
        .map(|a| a.key.as_str())
        .collect();
    completed_before.sort_unstable();
    completed_before.dedup();
    let replayed_after = answers
        .iter()
        .filter(|a| a.replayed && a.sent > restarted_at && completed_before.contains(&&*a.key))
        .count();
    assert!(!completed_before.is_empty(), "nothing completed before the crash: {tally:?}");
    for key in completed_before.iter().step_by(completed_before.len().div_ceil(40)) {
        let again = send(&app, keyed("POST", "/pay", key, "{}")).await;
        assert_eq!(again.status, StatusCode::CREATED, "{key}, completed before the crash");
        assert!(again.replayed(), "{key}, completed before the crash, was not replayed after it");
    }
    let executions = executions.lock().unwrap();
    for (key, ran) in executions.iter() {
        assert!(*ran <= 1, "{key} ran {ran} times");
    }
    assert_eq!(PANICS.load(std::sync::atomic::Ordering::SeqCst), 0, "something panicked");
    assert!(tally.get(&201).copied().unwrap_or(0) > 100, "too little load got through: {tally:?}");
    assert!(tally.contains_key(&503), "the crash never reached a request: {tally:?}");
    eprintln!(
        "crash under load: {} answers {tally:?}; {} keys ran; {replayed_after} replays across the crash; a success {recovered_in:?} after the restart",
        answers.len(),
        executions.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_pool_answers_503_within_the_command_timeout() {
    let h = harness().await;
    // A pool of one connection, which the app itself holds.
    let small = PgPoolOptions::new()
        .max_connections(1)
        .test_before_acquire(false)
        .connect_lazy_with(h.pool().connect_options().as_ref().clone());
    let store = PostgresStore::new(small.clone()).command_timeout(Duration::from_millis(300));
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(store));
    let held = small.acquire().await.unwrap();
    let started = Instant::now();
    let seen = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    seen.assert_problem(503, "store-unavailable");
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    assert_eq!(calls.get(), 0);
    drop(held);
    assert_eq!(send(&app, keyed("POST", "/payments", "k1", "{}")).await.status, 201);
    assert_eq!(calls.get(), 1);
}

/// What the table holds under `key`, live or not: state, and the time it has left in ms.
async fn row(h: &PostgresHarness, key: &RecordKey) -> Option<(String, i64)> {
    let sql = "SELECT state::text, (extract(epoch FROM expires_at - clock_timestamp()) * 1000)::int8 \
               FROM idempotency_records WHERE key = $1";
    let row = h.database.client().await.query_opt(sql, &[&key.as_str()]).await.unwrap()?;
    Some((row.get(0), row.get(1)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_landing_after_its_abandon_is_refused_and_blocks_nobody_else() {
    // The claim sat in a paused server's socket; its caller timed out, and its guard's abandon
    // reached the server first.
    let h = harness().await;
    let store = h.store();
    let fingerprint = Fingerprint::of_payload(b"1");
    let long = Lease::new(Duration::from_secs(30));
    let (k, late) = (key("a"), OwnerToken::random());
    assert_eq!(store.abandon(&k, &late, &fingerprint, long).await.unwrap(), Fenced::Applied);
    let (state, left) = row(&h, &k).await.expect("a marker");
    assert_eq!(state, "X");
    assert!((28_000..=30_000).contains(&left), "the marker lives one lease: {left} ms");
    assert_eq!(h.held(&k).await, Some(Held::Abandoned));
    // The late claim lands: refused, and nothing written.
    assert!(matches!(
        store.claim(&k, &fingerprint, &late, long).await,
        Err(StoreError::ClaimAbandoned)
    ));
    assert_eq!(row(&h, &k).await.map(|(state, _)| state).as_deref(), Some("X"));
    assert_eq!(store.touch(&k, &late, long).await.unwrap(), Fenced::Rejected);
    assert_eq!(store.release(&k, &late).await.unwrap(), Fenced::Rejected);
    // Anyone else sees an absent key: a holder whose lease lapsed with nobody taking over may
    // still store its response, and a claim (any fingerprint) takes it.
    let lapsed = OwnerToken::random();
    let written =
        store.complete(&k, &lapsed, &fingerprint, "r".into(), Duration::from_secs(30)).await;
    assert_eq!(written.unwrap(), Fenced::Applied);
    assert_eq!(h.held(&k).await, Some(Held::Completed));
    let k = key("b");
    assert_eq!(store.abandon(&k, &late, &fingerprint, long).await.unwrap(), Fenced::Applied);
    let next = OwnerToken::random();
    let other = Fingerprint::of_payload(b"2");
    assert_eq!(store.claim(&k, &other, &next, long).await.unwrap(), Claim::Claimed);
    assert_eq!(h.held(&k).await, Some(Held::InProgress));
    // And the late claim, landing now, finds another's claim: it takes nothing.
    assert_eq!(store.claim(&k, &fingerprint, &late, long).await.unwrap(), Claim::Mismatch);
    assert_eq!(store.release(&k, &next).await.unwrap(), Fenced::Applied);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_arriving_after_its_deadline_writes_nothing() {
    // The claim function called as the store calls it, with a deadline already past: a claim
    // held up on the wire while its caller gave up on it.
    let h = harness().await;
    let client = h.database.client().await;
    let claim = "SELECT outcome FROM idempotency_records_claim($1, $2, $3, 30000, 60000, false, $4, 500, 0)";
    let past: i64 = client
        .query_one("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::int8 - 1000", &[])
        .await
        .unwrap()
        .get(0);
    let fingerprint = Fingerprint::of_payload(b"1");
    let (k, owner) = (key("late"), OwnerToken::random());
    let args = |deadline: i64| {
        (
            k.as_str().to_owned(),
            fingerprint.as_bytes().to_vec(),
            owner.as_bytes().to_vec(),
            deadline,
        )
    };
    let (a, b, c, d) = args(past);
    let outcome: i32 = client.query_one(claim, &[&a, &b, &c, &d]).await.unwrap().get(0);
    assert_eq!(outcome, 6, "refused");
    assert_eq!(row(&h, &k).await, None, "nothing written");
    // A lapsed claim is not taken over by a late one either.
    let store = h.store();
    let short = Lease::new(Duration::from_millis(50)).recovery_window(Duration::from_secs(60));
    store.claim(&k, &fingerprint, &OwnerToken::random(), short).await.unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await;
    let outcome: i32 = client.query_one(claim, &[&a, &b, &c, &d]).await.unwrap().get(0);
    assert_eq!(outcome, 6, "refused");
    assert_eq!(store.lapsed_claims().await.unwrap().count, 1, "the lapsed claim is still lapsed");
    // In time, the same call claims (no deadline: 0).
    let (a, b, c, d) = args(0);
    let outcome: i32 = client.query_one(claim, &[&a, &b, &c, &d]).await.unwrap().get(0);
    assert_eq!(outcome, 5, "taken over");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_after_the_record_expired_is_fenced_out() {
    let h = harness().await;
    let store = h.store();
    let (k, owner) = (key("expired"), OwnerToken::random());
    let fingerprint = Fingerprint::of_payload(b"1");
    store.claim(&k, &fingerprint, &owner, Lease::new(Duration::from_millis(50))).await.unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(h.held(&k).await, None);
    // Gone, though its row is not swept yet: the holder released nothing.
    assert_eq!(store.release(&k, &owner).await.unwrap(), Fenced::Rejected);
    assert_eq!(
        store.touch(&k, &owner, Lease::new(Duration::from_secs(30))).await.unwrap(),
        Fenced::Rejected
    );
}

/// A holder whose lease was taken over, completing with the very bytes the new holder stored
/// (an outcome with no time in it, or a transaction's sealed outcome sent twice), is fenced
/// out: "already stored" is an answer for the owner that stored it, never for another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_taken_over_cannot_complete_with_the_new_holders_bytes() {
    let h = harness().await;
    let store = h.store();
    let (k, fingerprint) = (key("taken"), Fingerprint::of_payload(b"1"));
    let short = Lease::new(Duration::from_millis(50)).recovery_window(Duration::from_secs(60));
    let (first, second) = (OwnerToken::random(), OwnerToken::random());
    assert_eq!(store.claim(&k, &fingerprint, &first, short).await.unwrap(), Claim::Claimed);
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(store.claim(&k, &fingerprint, &second, short).await.unwrap(), Claim::TakenOver);
    let (bytes, day) = (Bytes::from_static(b"same answer"), Duration::from_secs(86_400));
    let stored = store.complete(&k, &second, &fingerprint, bytes.clone(), day).await.unwrap();
    assert_eq!(stored, Fenced::Applied);
    let late = store.complete(&k, &first, &fingerprint, bytes.clone(), day).await.unwrap();
    assert_eq!(late, Fenced::Rejected, "the fenced-out holder's complete was counted as stored");
    // The owner that stored it, asking again (its first answer lost), is told it is stored.
    let again = store.complete(&k, &second, &fingerprint, bytes, day).await.unwrap();
    assert_eq!(again, Fenced::Applied);
}

/// Six instances migrating one fresh database at once, ten times over: every table of the
/// crate (the records, the durable outcomes, the checkpoints), no failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_migrating_at_once_never_collide() {
    use axum_idempotency::durable::{Checkpoints, DurableOutcomes};
    let h = harness().await;
    let pool = h.pool();
    let drop_all = "DROP TABLE IF EXISTS idempotency_records, idempotency_outcomes, \
                    idempotency_steps";
    let mut failures = Vec::new();
    for _ in 0..10 {
        h.database.client().await.batch_execute(drop_all).await.unwrap();
        let instances = (0..6).map(|_| {
            let pool = pool.clone();
            tokio::spawn(async move {
                PostgresStore::new(pool.clone()).migrate().await?;
                DurableOutcomes::new(pool.clone()).migrate().await?;
                Checkpoints::new(pool).migrate().await
            })
        });
        for instance in instances.collect::<Vec<_>>() {
            if let Err(error) = instance.await.unwrap() {
                failures.push(error.to_string());
            }
        }
    }
    assert!(failures.is_empty(), "{} of 60 failed: {:?}", failures.len(), failures.first());
}

/// A store whose `migrate()` was never run: the request is answered 503 as for a store that
/// cannot serve, and the error names the fix, for the log and for the consumer door's caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_schema_is_named_as_such() {
    let d = common::postgres::TestDatabase::create("noschema").await;
    let store = PostgresStore::new(common::postgres::pool_for(&d)).sweep_every(None);
    let (k, fingerprint) = (key("k"), Fingerprint::of_payload(b"1"));
    let lease = Lease::new(Duration::from_secs(30));
    let error = store.claim(&k, &fingerprint, &OwnerToken::random(), lease).await.unwrap_err();
    assert!(matches!(error, StoreError::SchemaMissing(_)), "{error:?}");
    assert!(error.is_unavailable());
    assert!(error.to_string().contains("run migrate()"), "{error}");
    let idem = axum_idempotency::Idempotent::new(store.clone());
    let ran = idem.run("s", "k", b"{}", |_| async { Ok::<_, std::io::Error>(1) }).await;
    let Err(axum_idempotency::consumer::Error::Store(StoreError::SchemaMissing(_))) = ran else {
        panic!("not a missing schema: {ran:?}")
    };
    let calls = Calls::default();
    let app = common::app(&calls).layer(IdempotencyLayer::new(store));
    send(&app, keyed("POST", "/payments", "k1", "{}"))
        .await
        .assert_problem(503, "store-unavailable");
    assert_eq!(calls.get(), 0);
}

/// `migrate()` leaves the claim function of the previous version (seven arguments) where it
/// is: instances of that version keep claiming through it during a rolling deploy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_keeps_the_previous_versions_claim_for_a_rolling_deploy() {
    let d = common::postgres::TestDatabase::create("upgrade").await;
    let pool = common::postgres::pool_for(&d);
    let previous = "CREATE FUNCTION idempotency_records_claim(p_key TEXT, p_fingerprint BYTEA,
        p_owner BYTEA, p_lease_ms BIGINT, p_window_ms BIGINT, p_waiting BOOLEAN,
        p_not_after_ms BIGINT, OUT outcome INT, OUT response BYTEA, OUT remaining_ms BIGINT)
        LANGUAGE sql AS $$ SELECT 0, NULL::bytea, NULL::bigint $$";
    axum_idempotency::store::sqlx::raw_sql(previous).execute(&pool).await.unwrap();
    PostgresStore::new(pool.clone()).migrate().await.unwrap();
    let claims: i64 = axum_idempotency::store::sqlx::query_scalar(
        "SELECT count(*) FROM pg_proc WHERE proname = 'idempotency_records_claim'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(claims, 2, "the previous version's claim was dropped");
}

/// A table made by an earlier version keeps its rows and loses the CHECK on `state` that
/// every write paid for: `migrate()` drops it, once, and the store claims and completes on
/// the table as before. Run again, it finds nothing to drop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_drops_the_previous_versions_state_check_and_keeps_the_rows() {
    use axum_idempotency::store::sqlx;
    let d = common::postgres::TestDatabase::create("upgrade_check").await;
    let pool = common::postgres::pool_for(&d);
    let previous = "CREATE TABLE pay_keys (key TEXT PRIMARY KEY,
        state \"char\" NOT NULL CHECK (state IN ('P', 'C', 'X')), fingerprint BYTEA NOT NULL,
        owner BYTEA, response BYTEA, lease_until TIMESTAMPTZ, expires_at TIMESTAMPTZ NOT NULL,
        waited BOOLEAN NOT NULL DEFAULT false);
        INSERT INTO pay_keys (key, state, fingerprint, response, expires_at)
        VALUES ('kept', 'C', '\\x00', '\\x01', now() + interval '1 hour')";
    sqlx::raw_sql(previous).execute(&pool).await.unwrap();
    let checks = "SELECT count(*) FROM pg_constraint WHERE conrelid = 'pay_keys'::regclass \
                  AND contype = 'c'";
    let count = |pool: PgPool| async move {
        sqlx::query_scalar::<_, i64>(checks).fetch_one(&pool).await.unwrap()
    };
    assert_eq!(count(pool.clone()).await, 1);
    let store = PostgresStore::with_table(pool.clone(), "pay_keys").unwrap().sweep_every(None);
    store.migrate().await.unwrap();
    assert_eq!(count(pool.clone()).await, 0, "the previous version's CHECK is still there");
    store.migrate().await.unwrap();
    assert_eq!(count(pool.clone()).await, 0);
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM pay_keys WHERE key = 'kept'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 1);

    let (k, fingerprint, owner) = (key("k"), Fingerprint::of_payload(b"1"), OwnerToken::random());
    let lease = Lease::new(Duration::from_secs(30));
    assert!(matches!(store.claim(&k, &fingerprint, &owner, lease).await, Ok(Claim::Claimed)));
    let stored = store
        .complete(&k, &owner, &fingerprint, Bytes::from_static(b"done"), Duration::from_secs(60))
        .await;
    assert!(matches!(stored, Ok(Fenced::Applied)), "{stored:?}");
    let replay = store.claim(&k, &fingerprint, &OwnerToken::random(), lease).await;
    let Ok(Claim::Replay { response, .. }) = replay else { panic!("no replay: {replay:?}") };
    assert_eq!(&response[..], b"done");
}

/// What the table holds under `key`, live or not: state, owner, response, and the time to its
/// expiry in ms.
async fn record(h: &PostgresHarness, key: &RecordKey) -> (String, Vec<u8>, Option<Vec<u8>>, i64) {
    let sql = "SELECT state::text, owner, response, \
               (extract(epoch FROM expires_at - clock_timestamp()) * 1000)::int8 \
               FROM idempotency_records WHERE key = $1";
    let row = h.database.client().await.query_one(sql, &[&key.as_str()]).await.unwrap();
    (row.get(0), row.get(1), row.get(2), row.get(3))
}

/// The complete of the owner's live claim is one plain `UPDATE`, fenced as the complete
/// function fences it; every other complete updates nothing there and goes on to the function,
/// which decides it as before: a complete landing after a takeover is refused and leaves the
/// new holder's claim; one resent after its answer was lost is applied again and rewrites
/// nothing; another response of the same owner is refused; an expired claim nobody took, and
/// an abandoned claim's marker, are completed. The server's counters show which path each took.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_claims_complete_is_one_update_and_every_other_complete_the_functions() {
    let h = harness().await;
    let admin = postgres::connect(&h.database.admin).await.unwrap();
    let track = format!("ALTER DATABASE {} SET track_functions = 'pl'", h.database.name);
    admin.batch_execute(&track).await.unwrap();
    let store = PostgresStore::new(h.pool()).sweep_every(None);
    let fingerprint = Fingerprint::of_payload(b"1");
    let (long, day) = (Lease::new(Duration::from_secs(30)), Duration::from_secs(86_400));
    let short = Lease::new(Duration::from_millis(50)).recovery_window(Duration::from_secs(60));
    let complete = |k: RecordKey, owner: OwnerToken, response: &'static str| {
        let (store, fingerprint) = (store.clone(), fingerprint.clone());
        async move {
            store.complete(&k, &owner, &fingerprint, Bytes::from(response), day).await.unwrap()
        }
    };

    // The owner's live claim: the plain update.
    let (k, owner) = (key("live"), OwnerToken::random());
    assert_eq!(store.claim(&k, &fingerprint, &owner, long).await.unwrap(), Claim::Claimed);
    assert_eq!(complete(k.clone(), owner.clone(), "first").await, Fenced::Applied);
    let stored = record(&h, &k).await;
    assert_eq!((stored.0.as_str(), stored.2.as_deref()), ("C", Some(&b"first"[..])));
    assert!((86_300_000..=86_400_000).contains(&stored.3), "the retention: {} ms", stored.3);
    // Resent, its answer lost: applied, and nothing rewritten (the retention runs as before).
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(complete(k.clone(), owner.clone(), "first").await, Fenced::Applied);
    let again = record(&h, &k).await;
    assert!(again.3 < stored.3, "the resent complete wrote the record again");
    // Another response of the same owner: refused, and the first kept.
    assert_eq!(complete(k.clone(), owner.clone(), "second").await, Fenced::Rejected);
    assert_eq!(record(&h, &k).await.2.as_deref(), Some(&b"first"[..]));

    // A holder whose lease lapsed and was taken over: refused, the new claim left as it was.
    let (k, first, second) = (key("taken"), OwnerToken::random(), OwnerToken::random());
    assert_eq!(store.claim(&k, &fingerprint, &first, short).await.unwrap(), Claim::Claimed);
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(store.claim(&k, &fingerprint, &second, long).await.unwrap(), Claim::TakenOver);
    assert_eq!(complete(k.clone(), first, "stale").await, Fenced::Rejected);
    let held = record(&h, &k).await;
    assert_eq!((held.0.as_str(), held.1.as_slice(), held.2), ("P", second.as_bytes(), None));
    // The new holder's complete: the plain update.
    assert_eq!(complete(k.clone(), second, "new").await, Fenced::Applied);
    assert_eq!(record(&h, &k).await.2.as_deref(), Some(&b"new"[..]));

    // An abandoned claim with a recovery window is still its owner's: the plain update.
    let (k, owner) = (key("abandoned"), OwnerToken::random());
    assert_eq!(store.claim(&k, &fingerprint, &owner, short).await.unwrap(), Claim::Claimed);
    assert_eq!(store.abandon(&k, &owner, &fingerprint, short).await.unwrap(), Fenced::Applied);
    assert_eq!(complete(k.clone(), owner, "kept").await, Fenced::Applied);
    assert_eq!(record(&h, &k).await.2.as_deref(), Some(&b"kept"[..]));

    // A claim that expired with nobody taking it over, and an abandoned claim's marker (the
    // key absent for any other owner): the function writes the record.
    let (k, owner) = (key("expired"), OwnerToken::random());
    let lease = Lease::new(Duration::from_millis(50));
    assert_eq!(store.claim(&k, &fingerprint, &owner, lease).await.unwrap(), Claim::Claimed);
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(complete(k.clone(), owner, "late").await, Fenced::Applied);
    assert_eq!(record(&h, &k).await.2.as_deref(), Some(&b"late"[..]));
    let (k, owner) = (key("marker"), OwnerToken::random());
    assert_eq!(store.abandon(&k, &owner, &fingerprint, long).await.unwrap(), Fenced::Applied);
    assert_eq!(complete(k.clone(), OwnerToken::random(), "lapsed").await, Fenced::Applied);
    assert_eq!(record(&h, &k).await.0, "C");

    let calls = calls_of_functions(&h).await;
    // The resent complete, the other response, the stale holder, the expired claim, the marker.
    assert_eq!(calls.get("complete"), Some(&5), "{calls:?}");
}

/// Instances of the previous version complete every claim through the complete function:
/// its own update of the owner's live claim (the statement the store now sends as a plain
/// one) still completes it, refuses any other owner, and wakes the claim's waiters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_previous_versions_complete_through_the_function_is_fenced_and_notifies() {
    let h = harness().await;
    let store = h.store();
    let mut heard = notifications(&h).await;
    let fingerprint = Fingerprint::of_payload(b"1");
    let lease = Lease::new(Duration::from_secs(30));
    let (k, owner, waiter) = (key("previous"), OwnerToken::random(), OwnerToken::random());
    assert_eq!(store.claim(&k, &fingerprint, &owner, lease).await.unwrap(), Claim::Claimed);
    let waiting = store.claim_waiting(&k, &fingerprint, &waiter, lease).await.unwrap();
    assert!(matches!(waiting, Claim::InProgress { .. }), "{waiting:?}");
    let client = h.database.client().await;
    let call = "SELECT idempotency_records_complete($1, $2, $3, $4, 86400000)";
    let complete = |owner: &OwnerToken, response: &'static [u8]| {
        let args = (
            k.as_str().to_owned(),
            owner.as_bytes().to_vec(),
            fingerprint.as_bytes().to_vec(),
            response.to_vec(),
        );
        let client = &client;
        async move {
            let (a, b, c, d) = args;
            client.query_one(call, &[&a, &b, &c, &d]).await.unwrap().get::<_, i32>(0)
        }
    };
    assert_eq!(complete(&waiter, b"stranger").await, 0, "another owner's complete was applied");
    assert_eq!(record(&h, &k).await.0, "P");
    assert_eq!(complete(&owner, b"done").await, 1);
    assert_eq!(record(&h, &k).await.2.as_deref(), Some(&b"done"[..]));
    let payload = tokio::time::timeout(Duration::from_secs(2), heard.recv()).await;
    assert_eq!(payload.expect("no notification").as_deref(), Some(k.as_str()));
}

/// A claim's lease and recovery window, on the way of a new key (computed in its insert) and
/// on the long way (a reclaim of an expired record, then a takeover): each keeps the record
/// its window past the lease, so that a lapsed holder is taken over rather than claimed anew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_claim_keeps_the_record_its_recovery_window_past_the_lease() {
    let h = harness().await;
    let store = h.store();
    let fingerprint = Fingerprint::of_payload(b"1");
    let window = Duration::from_secs(60);
    let short = Lease::new(Duration::from_millis(50)).recovery_window(window);
    let within = |left: i64| (59_000..=60_050).contains(&left);
    // A claim of `k` by a new owner, after `pause`.
    let claim = async |k: &RecordKey, lease: Lease, pause: u64| {
        tokio::time::sleep(Duration::from_millis(pause)).await;
        store.claim(k, &fingerprint, &OwnerToken::random(), lease).await.unwrap()
    };
    // A new key.
    let k = key("new");
    assert_eq!(claim(&k, short, 0).await, Claim::Claimed);
    let left = record(&h, &k).await.3;
    assert!(within(left), "a new key's claim: {left} ms");
    assert_eq!(claim(&k, short, 150).await, Claim::TakenOver);
    let left = record(&h, &k).await.3;
    assert!(within(left), "a takeover: {left} ms");
    assert_eq!(claim(&k, short, 150).await, Claim::TakenOver);
    // An expired record, claimed anew the long way.
    let k = key("reclaimed");
    assert_eq!(claim(&k, Lease::new(Duration::from_millis(50)), 0).await, Claim::Claimed);
    assert_eq!(claim(&k, short, 150).await, Claim::Claimed);
    let left = record(&h, &k).await.3;
    assert!(within(left), "a reclaim: {left} ms");
    assert_eq!(claim(&k, short, 150).await, Claim::TakenOver);
}
