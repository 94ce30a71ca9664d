//! The lease holds while the work runs, in the store's own PostgreSQL transaction
//! (`PostgresStore::transaction`): a transaction longer than the lease is never taken over,
//! whatever its isolation level, and a process killed inside it lets a retry run once, within
//! the wait; a transaction a handler spawned and did not await is waited for, so that what the
//! client is answered, what is stored and what the database committed agree; `migrate()`
//! takes no lock on a table in use. Each test has a database of its own, dropped at the end.
#![cfg(feature = "postgres")]

mod common;

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{Json, Router, extract::State, http::StatusCode, response::IntoResponse, routing::post};
use axum_idempotency::{
    IdempotencyContext, IdempotencyLayer, Idempotent,
    consumer::Outcome,
    durable::Checkpoints,
    store::{
        PostgresStore, StoreError,
        sqlx::{self, Acquire as _, PgPool, postgres::PgPoolOptions},
    },
};
use common::{Seen, keyed, postgres::TestDatabase, send};
use serde_json::json;

const PAYMENTS: &str = "CREATE TABLE payments (id BIGSERIAL PRIMARY KEY, code TEXT NOT NULL)";

#[derive(Clone)]
struct App {
    pool: PgPool,
    store: PostgresStore,
    /// Handler runs, and calls of the payment provider (made inside the transaction).
    runs: Arc<AtomicUsize>,
    provider_calls: Arc<AtomicUsize>,
}

async fn setup(d: &TestDatabase) -> App {
    let pool = PgPoolOptions::new().connect_lazy_with(d.options());
    let store = PostgresStore::new(pool.clone()).sweep_every(None);
    store.migrate().await.unwrap();
    sqlx::raw_sql(PAYMENTS).execute(&pool).await.unwrap();
    App { pool, store, runs: Arc::default(), provider_calls: Arc::default() }
}

/// A suffix no other event of the test has.
fn rand_suffix() -> u64 {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    NEXT.fetch_add(1, Ordering::SeqCst) as u64
}

async fn payments(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM payments").fetch_one(pool).await.unwrap()
}

/// A handler that pays in the store's transaction, at the isolation level its body names,
/// and calls a provider inside it that takes `work`.
fn paying(app: &App, work: Duration) -> Router {
    Router::new()
        .route(
            "/pay",
            post(move |State(app): State<App>, context: IdempotencyContext, level: String| async move {
                app.runs.fetch_add(1, Ordering::SeqCst);
                let provider_calls = app.provider_calls.clone();
                let key = context.key_hash().to_owned();
                let paid = app.store.transaction(&context, move |tx| {
                    Box::pin(async move {
                        let set = format!("SET TRANSACTION ISOLATION LEVEL {level}");
                        sqlx::query(&set).execute(&mut *tx).await?;
                        sqlx::query("INSERT INTO payments (code) VALUES ($1)")
                            .bind(&level)
                            .execute(&mut *tx)
                            .await?;
                        provider_calls.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(work).await;
                        let body = json!({ "paid": level, "key": key });
                        Ok::<_, sqlx::Error>((StatusCode::CREATED, Json(body)).into_response())
                    })
                });
                paid.await.into_response()
            }),
        )
        .with_state(app.clone())
}

/// A client that sends `request` again while it is answered 202, after its `Retry-After`.
async fn until_final(app: &Router, key: &str, body: &'static str) -> Seen {
    loop {
        let seen = send(app, keyed("POST", "/pay", key, body)).await;
        if seen.status != StatusCode::ACCEPTED {
            return seen;
        }
        let after: u64 = seen.header("retry-after").and_then(|s| s.parse().ok()).unwrap_or(1);
        tokio::time::sleep(Duration::from_secs(after)).await;
    }
}

/// The defaults (lease 10 s, wait 10 s) and 11.5 s of work inside the transaction, at each
/// isolation level, with a duplicate every second: the handler runs once, the provider is
/// called once, one payment, and every client gets the same 201.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_longer_than_the_lease_runs_once_at_every_isolation_level() {
    let d = TestDatabase::create("held").await;
    let app = setup(&d).await;
    let router =
        paying(&app, Duration::from_millis(11_500)).layer(IdempotencyLayer::new(app.store.clone()));
    let levels: [(&str, &'static str); 3] =
        [("k-rc", "READ COMMITTED"), ("k-rr", "REPEATABLE READ"), ("k-s", "SERIALIZABLE")];
    let mut clients = Vec::new();
    for (key, level) in levels {
        for duplicate in 0..13 {
            let router = router.clone();
            clients.push(tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs(duplicate)).await;
                (key, until_final(&router, key, level).await)
            }));
        }
    }
    let mut answers: Vec<(&str, Seen)> = Vec::new();
    for client in clients {
        answers.push(client.await.unwrap());
    }
    for (key, level) in levels {
        let first = answers.iter().find(|(k, _)| *k == key).map(|(_, seen)| seen).unwrap();
        assert_eq!(first.status, StatusCode::CREATED, "{level}: {first:?}");
        for (_, seen) in answers.iter().filter(|(k, _)| *k == key) {
            assert_eq!((seen.status, &seen.body), (first.status, &first.body), "{level}");
        }
        let replays = answers.iter().filter(|(k, seen)| *k == key && seen.replayed()).count();
        assert_eq!(replays, 12, "{level}: every duplicate is a replay of the one run");
    }
    let ran = (app.runs.load(Ordering::SeqCst), app.provider_calls.load(Ordering::SeqCst));
    assert_eq!(ran, (3, 3), "one run and one provider call a key");
    assert_eq!(payments(&app.pool).await, 3);
}

/// The consumer door: a lease of a second and 2.5 s in the transaction, redeliveries every
/// 200 ms: one run, and every redelivery answered "in progress" until the outcome replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumer_doors_transaction_longer_than_its_lease_runs_once() {
    let d = TestDatabase::create("held").await;
    let app = setup(&d).await;
    runs_once_past_its_lease(&app).await;
}

/// An instance of the previous release that starts after this one migrated (a rollback, a
/// replica restarting mid-deploy) replaces its own claim function (eight arguments, no key
/// lock), not this release's: a transaction longer than its lease still runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_previous_release_migrating_after_this_one_leaves_the_key_lock_in_place() {
    let d = TestDatabase::create("held").await;
    let app = setup(&d).await;
    let previous = "CREATE OR REPLACE FUNCTION idempotency_records_claim(p_key TEXT,
        p_fingerprint BYTEA, p_owner BYTEA, p_lease_ms BIGINT, p_window_ms BIGINT,
        p_waiting BOOLEAN, p_not_after_ms BIGINT, p_lock_ms BIGINT, OUT outcome INT,
        OUT response BYTEA, OUT remaining_ms BIGINT)
        LANGUAGE sql AS $$ SELECT 5, NULL::bytea, NULL::bigint $$";
    sqlx::raw_sql(previous).execute(&app.pool).await.unwrap();
    runs_once_past_its_lease(&app).await;
    app.store.migrate().await.unwrap();
    runs_once_past_its_lease(&App { runs: Arc::default(), ..app.clone() }).await;
}

/// One event whose transaction outlives its lease, redelivered meanwhile: it runs once.
async fn runs_once_past_its_lease(app: &App) {
    sqlx::query("TRUNCATE payments").execute(&app.pool).await.unwrap();
    let event = format!("evt_{}", rand_suffix());
    let idem = Idempotent::new(app.store.clone()).lease(Duration::from_secs(1));
    let run = |idem: Idempotent<PostgresStore>, app: App, event: String| async move {
        idem.run("payments", &event, b"{}", move |context| async move {
            app.runs.fetch_add(1, Ordering::SeqCst);
            let Json(paid) = app
                .store
                .transaction(&context, |tx| {
                    Box::pin(async move {
                        let sql = "INSERT INTO payments (code) VALUES ('evt_1') RETURNING id";
                        let id: i64 = sqlx::query_scalar(sql).fetch_one(&mut *tx).await?;
                        tokio::time::sleep(Duration::from_millis(2500)).await;
                        Ok::<_, sqlx::Error>(Json(id))
                    })
                })
                .await?;
            Ok::<_, axum_idempotency::store::TransactionError<sqlx::Error>>(paid)
        })
        .await
    };
    let first = tokio::spawn(run(idem.clone(), app.clone(), event.clone()));
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(3500) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        match run(idem.clone(), app.clone(), event.clone()).await {
            Ok(Outcome::InProgress { .. } | Outcome::Replayed(_)) => {}
            other => panic!("a redelivery at {:?}: {other:?}", started.elapsed()),
        }
    }
    let first = first.await.unwrap();
    let Ok(Outcome::Ran(id)) = first else { panic!("{first:?}") };
    let again = run(idem.clone(), app.clone(), event.clone()).await;
    assert!(matches!(again, Ok(Outcome::Replayed(replayed)) if replayed == id), "{again:?}");
    assert_eq!((app.runs.load(Ordering::SeqCst), payments(&app.pool).await), (1, 1));
}

/// This binary again, as the instance that dies: it runs the request's handler, which pays and
/// calls its provider inside the transaction for 11.5 s, and says so on stdout.
#[test]
fn instance_process() {
    let Ok(url) = std::env::var("HELD_TRANSACTIONS_URL") else { return };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let pool = PgPoolOptions::new().connect_lazy_with(url.parse().unwrap());
        let store = PostgresStore::new(pool.clone()).sweep_every(None);
        let app = App { pool, store, runs: Arc::default(), provider_calls: Arc::default() };
        let router = Router::new()
            .route(
                "/pay",
                post(|State(app): State<App>, context: IdempotencyContext| async move {
                    let paid = app.store.transaction(&context, |tx| {
                        Box::pin(async move {
                            let sql = "INSERT INTO payments (code) VALUES ('killed')";
                            sqlx::query(sql).execute(&mut *tx).await?;
                            println!("in the transaction");
                            tokio::time::sleep(Duration::from_millis(11_500)).await;
                            Ok::<_, sqlx::Error>(StatusCode::CREATED.into_response())
                        })
                    });
                    paid.await.into_response()
                }),
            )
            .with_state(app.clone())
            .layer(IdempotencyLayer::new(app.store.clone()));
        let answered = send(&router, keyed("POST", "/pay", "k1", "{}")).await;
        panic!("the instance was to be killed before its answer: {answered:?}");
    });
}

/// An instance killed inside its transaction: its session ends, and with it the key's lock
/// and the payment; the retry on another instance runs once, within the default wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_killed_inside_its_transaction_lets_the_retry_run_once_within_the_wait() {
    let d = TestDatabase::create("held").await;
    let app = setup(&d).await;
    let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args(["instance_process", "--exact", "--nocapture", "--test-threads=1"])
        .env("HELD_TRANSACTIONS_URL", d.uri())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
    let inside = async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if line.contains("in the transaction") {
                return;
            }
        }
        panic!("the instance exited before its transaction began");
    };
    tokio::time::timeout(Duration::from_secs(60), inside)
        .await
        .expect("the instance's transaction");
    tokio::time::sleep(Duration::from_millis(500)).await;
    child.kill().await.unwrap();
    let router = Router::new()
        .route(
            "/pay",
            post(|State(app): State<App>, context: IdempotencyContext| async move {
                app.runs.fetch_add(1, Ordering::SeqCst);
                let paid = app.store.transaction(&context, |tx| {
                    Box::pin(async move {
                        let sql = "INSERT INTO payments (code) VALUES ('retry')";
                        sqlx::query(sql).execute(&mut *tx).await?;
                        Ok::<_, sqlx::Error>(StatusCode::CREATED.into_response())
                    })
                });
                paid.await.into_response()
            }),
        )
        .with_state(app.clone())
        .layer(IdempotencyLayer::new(app.store.clone()));
    let sent = Instant::now();
    let retry = send(&router, keyed("POST", "/pay", "k1", "{}")).await;
    assert_eq!((retry.status, retry.replayed()), (StatusCode::CREATED, false), "{retry:?}");
    assert!(sent.elapsed() < Duration::from_secs(10), "answered after {:?}", sent.elapsed());
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
    let codes: Vec<String> =
        sqlx::query_scalar("SELECT code FROM payments").fetch_all(&app.pool).await.unwrap();
    assert_eq!(codes, ["retry"], "the killed instance's payment was rolled back");
}

/// A handler that spawns its transaction and answers before it ends, over 200 keys each
/// retried 1.5 s later: the door waits for the transaction, so every client's answer is its
/// retry's, and the payments are exactly the answers that say "paid".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spawned_transaction_is_waited_for_and_the_answers_are_what_committed() {
    let d = TestDatabase::create("held").await;
    let app = setup(&d).await;
    let router = Router::new()
        .route(
            "/pay",
            post(|State(app): State<App>, context: IdempotencyContext| async move {
                app.runs.fetch_add(1, Ordering::SeqCst);
                let key = context.key_hash().to_owned();
                let store = app.store.clone();
                drop(tokio::spawn(async move {
                    let paid = store.transaction(&context, |tx| {
                        Box::pin(async move {
                            let sql = "INSERT INTO payments (code) VALUES ($1)";
                            sqlx::query(sql).bind(&key).execute(&mut *tx).await?;
                            let body = json!({ "paid": key });
                            Ok::<_, sqlx::Error>((StatusCode::CREATED, Json(body)).into_response())
                        })
                    });
                    let _ = paid.await;
                }));
                (StatusCode::CREATED, Json(json!({ "accepted": true }))).into_response()
            }),
        )
        .with_state(app.clone())
        .layer(IdempotencyLayer::new(app.store.clone()));
    let keys: Vec<String> = (0..200).map(|i| format!("k{i}")).collect();
    let mut clients = Vec::new();
    for key in keys {
        let router = router.clone();
        clients.push(tokio::spawn(async move {
            let request = || keyed("POST", "/pay", &key, "{}");
            let first = send(&router, request()).await;
            tokio::time::sleep(Duration::from_millis(1500)).await;
            (first, send(&router, request()).await)
        }));
    }
    let mut said_paid = 0;
    for client in clients {
        let (first, retry) = client.await.unwrap();
        assert_eq!((first.status, &first.body), (retry.status, &retry.body), "{first:?}");
        assert!(retry.replayed(), "{retry:?}");
        said_paid += usize::from(first.body.contains("\"paid\""));
    }
    assert_eq!(app.runs.load(Ordering::SeqCst), 200);
    assert_eq!(payments(&app.pool).await, i64::try_from(said_paid).unwrap());
    assert_eq!(said_paid, 200, "every spawned transaction was waited for and committed");
}

/// A handler that spawns its transaction with a clone of its context, which begins only after
/// the door stopped waiting for that clone (250 ms on): the transaction is refused before it
/// writes anything, and the client's answer (the handler's own, paying nothing) is what every
/// retry gets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_begun_after_its_door_settled_is_refused_before_it_writes() {
    let d = TestDatabase::create("held").await;
    let app = setup(&d).await;
    let (refused, mut told) = tokio::sync::mpsc::unbounded_channel();
    let router = Router::new()
        .route(
            "/pay",
            post(move |State(app): State<App>, context: IdempotencyContext| async move {
                let (store, refused) = (app.store.clone(), refused.clone());
                drop(tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(900)).await;
                    let paid = store.transaction(&context, |tx| {
                        Box::pin(async move {
                            let sql = "INSERT INTO payments (code) VALUES ('late')";
                            sqlx::query(sql).execute(&mut *tx).await?;
                            Ok::<_, sqlx::Error>(Json(1))
                        })
                    });
                    let _ = refused.send(paid.await.map(|_| ()));
                }));
                (StatusCode::ACCEPTED, Json(json!({ "queued": true }))).into_response()
            }),
        )
        .with_state(app.clone())
        .layer(IdempotencyLayer::new(app.store.clone()));
    let started = Instant::now();
    let first = send(&router, keyed("POST", "/pay", "k1", "{}")).await;
    let waited = started.elapsed();
    assert_eq!(first.status, StatusCode::ACCEPTED, "{first:?}");
    let patience = Duration::from_millis(250)..Duration::from_millis(900);
    assert!(patience.contains(&waited), "the door waited {waited:?} for the context");
    let refusal = tokio::time::timeout(Duration::from_secs(5), told.recv()).await.unwrap();
    let error = refusal.unwrap().expect_err("the late transaction was refused");
    assert!(error.to_string().contains("await the transaction"), "{error}");
    let retry = send(&router, keyed("POST", "/pay", "k1", "{}")).await;
    assert_eq!((retry.status, &retry.body, retry.replayed()), (first.status, &first.body, true));
    assert_eq!(payments(&app.pool).await, 0);
}

/// A store that wraps `PostgresStore` (a near cache in front) commits in its transactions too:
/// a transaction spawned a moment after the handler returned is waited for, and answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spawned_transaction_behind_a_near_cache_is_waited_for() {
    let d = TestDatabase::create("held").await;
    let app = setup(&d).await;
    let router = Router::new()
        .route(
            "/pay",
            post(|State(app): State<App>, context: IdempotencyContext| async move {
                let store = app.store.clone();
                drop(tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let paid = store.transaction(&context, |tx| {
                        Box::pin(async move {
                            let sql = "INSERT INTO payments (code) VALUES ('cached')";
                            sqlx::query(sql).execute(&mut *tx).await?;
                            Ok::<_, sqlx::Error>(Json(json!({ "paid": true })))
                        })
                    });
                    let _ = paid.await;
                }));
                (StatusCode::ACCEPTED, Json(json!({ "queued": true }))).into_response()
            }),
        )
        .with_state(app.clone())
        .layer(IdempotencyLayer::new(axum_idempotency::store::CachingStore::new(
            app.store.clone(),
        )));
    let first = send(&router, keyed("POST", "/pay", "k1", "{}")).await;
    assert!(first.body.contains("\"paid\""), "{first:?}");
    assert_eq!(payments(&app.pool).await, 1);
}

/// A handler that keeps a clone of its context for other work (an audit task of 30 s): the
/// door waits for it 250 ms at most over `PostgresStore`, and not at all over a store that
/// commits in no transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_context_kept_for_other_work_holds_the_answer_back_briefly() {
    let d = TestDatabase::create("held").await;
    let app = setup(&d).await;
    let auditing = || {
        Router::new().route(
            "/pay",
            post(|context: IdempotencyContext| async move {
                drop(tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                    drop(context);
                }));
                StatusCode::CREATED
            }),
        )
    };
    let postgres = auditing().layer(IdempotencyLayer::new(app.store.clone()));
    let memory = auditing().layer(IdempotencyLayer::new(axum_idempotency::MemoryStore::new()));
    for (router, longest) in [(postgres, 800), (memory, 200)] {
        let started = Instant::now();
        let answered = send(&router, keyed("POST", "/pay", "k1", "{}")).await;
        assert_eq!(answered.status, StatusCode::CREATED, "{answered:?}");
        let took = started.elapsed();
        assert!(took < Duration::from_millis(longest), "answered after {took:?}");
    }
}

/// A transaction that marked a step and stays open (a slow call after its mark): a start's
/// `migrate()` of the steps' table returns at once, taking no lock, and the other keys' steps
/// are marked meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_behind_an_open_step_transaction_takes_no_lock_and_other_keys_go_on() {
    let d = TestDatabase::create("held").await;
    let app = setup(&d).await;
    let steps = Checkpoints::new(app.pool.clone());
    steps.migrate().await.unwrap();
    let idem = Idempotent::new(app.store.clone());
    let (marked, release) =
        (Arc::new(tokio::sync::Notify::new()), Arc::new(tokio::sync::Notify::new()));
    let holding = {
        let (idem, steps, pool) = (idem.clone(), steps.clone(), app.pool.clone());
        let (marked, release) = (marked.clone(), release.clone());
        tokio::spawn(async move {
            idem.run("orders", "slow", b"{}", move |context| async move {
                let mut tx = pool.begin().await.unwrap();
                steps.mark(&mut tx, &context, "order", &1).await.unwrap();
                marked.notify_one();
                release.notified().await;
                tx.commit().await.unwrap();
                Ok::<_, StoreError>(1)
            })
            .await
        })
    };
    marked.notified().await;
    let started = Instant::now();
    let migrated = tokio::time::timeout(Duration::from_secs(5), steps.migrate()).await;
    assert!(matches!(migrated, Ok(Ok(()))), "{migrated:?}");
    assert!(started.elapsed() < Duration::from_secs(1), "migrate took {:?}", started.elapsed());
    for key in ["a", "b", "c", "d"] {
        let (steps, pool) = (steps.clone(), app.pool.clone());
        let ran = idem
            .run("orders", key, b"{}", move |context| async move {
                let mut tx = pool.begin().await.unwrap();
                steps.mark(&mut tx, &context, "order", &2).await?;
                tx.commit().await.map_err(StoreError::unavailable)?;
                Ok::<_, StoreError>(2)
            })
            .await;
        assert!(matches!(ran, Ok(Outcome::Ran(2))), "{key}: {ran:?}");
    }
    release.notify_one();
    assert!(matches!(holding.await.unwrap(), Ok(Outcome::Ran(1))));
}

/// When the schema is not current (a new version's start) behind the same open transaction,
/// `migrate()` gives up within half its command timeout and says why, and the other keys'
/// steps are marked meanwhile; once the transaction ends, it migrates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_that_must_change_a_table_in_use_gives_up_in_time_and_says_why() {
    let d = TestDatabase::create("held").await;
    let app = setup(&d).await;
    let steps = Checkpoints::new(app.pool.clone());
    steps.migrate().await.unwrap();
    // As a table of the previous version: its comment names another schema.
    sqlx::query("COMMENT ON TABLE idempotency_steps IS NULL").execute(&app.pool).await.unwrap();
    let mut holder = app.pool.acquire().await.unwrap();
    let mut tx = holder.begin().await.unwrap();
    sqlx::query("INSERT INTO idempotency_steps VALUES ('h', 's', '', '', now() + interval '1 h')")
        .execute(&mut *tx)
        .await
        .unwrap();
    let started = Instant::now();
    let migrating = tokio::time::timeout(Duration::from_secs(5), steps.migrate());
    let (migrated, marked) = tokio::join!(migrating, async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let idem = Idempotent::new(app.store.clone());
        let (steps, pool) = (steps.clone(), app.pool.clone());
        idem.run("orders", "other", b"{}", move |context| async move {
            let mut tx = pool.begin().await.unwrap();
            steps.mark(&mut tx, &context, "order", &3).await?;
            tx.commit().await.map_err(StoreError::unavailable)?;
            Ok::<_, StoreError>(3)
        })
        .await
    });
    let error = migrated.expect("migrate() gave up in time").expect_err("the lock is held");
    assert!(error.to_string().contains("was not granted within 500 ms"), "{error}");
    assert!(started.elapsed() < Duration::from_secs(2), "gave up after {:?}", started.elapsed());
    assert!(matches!(marked, Ok(Outcome::Ran(3))), "{marked:?}");
    tx.rollback().await.unwrap();
    steps.migrate().await.unwrap();
    let comment: Option<String> =
        sqlx::query_scalar("SELECT obj_description('idempotency_steps'::regclass, 'pg_class')")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert!(comment.is_some_and(|c| c.starts_with("axum-idempotency schema ")));
}

/// A step's transaction left idle after its mark (its app cut off) is ended by the database
/// after the claim's lease: its lock on the step does not outlive it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_transaction_left_idle_is_ended_after_the_lease() {
    let d = TestDatabase::create("held").await;
    let app = setup(&d).await;
    let steps = Checkpoints::new(app.pool.clone());
    steps.migrate().await.unwrap();
    let idem = Idempotent::new(app.store.clone()).lease(Duration::from_secs(1));
    let (steps_, pool) = (steps.clone(), app.pool.clone());
    let ran = idem
        .run("orders", "idle", b"{}", move |context| async move {
            let mut tx = pool.begin().await.unwrap();
            steps_.mark(&mut tx, &context, "order", &1).await?;
            tokio::time::sleep(Duration::from_millis(1600)).await;
            tx.commit().await.map_err(StoreError::unavailable)?;
            Ok::<_, StoreError>(1)
        })
        .await;
    assert!(ran.is_err(), "the idle transaction committed: {ran:?}");
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_steps")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(rows, 0, "the step of the ended transaction was rolled back");
}
