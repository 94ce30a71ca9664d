//! The durable half beside Redis (`DurableOutcomes`) and checkpoints (`Checkpoints`), in
//! process, over a private redis-server and a database of each test's own (dropped at the
//! end): the tables' fences (a slow holder's commit refused and rolled back, a step marked
//! once), their expiry, and another payload under a key only the table still holds (a
//! mismatch, which locks the key's own request out of nothing).
//!
//! Needs PostgreSQL at `DATABASE_URL` and `redis-server` on PATH; fails when either is missing.
#![cfg(all(feature = "postgres", feature = "redis"))]

use crate::common;

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{
    Router,
    extract::State,
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::post,
};
use axum_idempotency::{
    IdempotencyContext, IdempotencyLayer, RedisStore,
    durable::{Checkpoints, DurableOutcomes},
    store::{
        StoreError,
        sqlx::{self, PgPool, postgres::PgPoolOptions},
    },
};
use common::{RedisServer, keyed, postgres::TestDatabase, send};
use tokio::sync::oneshot;

fn pool(d: &TestDatabase) -> PgPool {
    PgPoolOptions::new().connect_lazy_with(d.options())
}

#[derive(Clone)]
struct App {
    pool: PgPool,
    outcomes: DurableOutcomes,
    runs: Arc<AtomicUsize>,
    /// The first run waits here, after its payment row and before its commit.
    hold: Arc<Mutex<Option<oneshot::Receiver<()>>>>,
}

/// A payment row and the response committed with it to the table; a commit refused is a
/// 500 naming why.
async fn pay(State(app): State<App>, context: IdempotencyContext, body: String) -> Response {
    let run = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let held = app.hold.lock().unwrap().take();
    let paid = app.outcomes.transaction(&context, move |tx| {
        Box::pin(async move {
            sqlx::query("INSERT INTO payments (run) VALUES ($1)")
                .bind(i64::try_from(run).unwrap())
                .execute(&mut *tx)
                .await?;
            if let Some(held) = held {
                let _ = held.await;
            }
            let response = (StatusCode::CREATED, format!("run {run}: {body}"));
            Ok::<_, sqlx::Error>(response.into_response())
        })
    });
    match paid.await {
        Ok(response) => response,
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}

async fn setup(
    d: &TestDatabase,
    redis: &RedisServer,
    layer: impl Fn(IdempotencyLayer<RedisStore>) -> IdempotencyLayer<RedisStore>,
) -> (App, Router) {
    let pool = pool(d);
    sqlx::raw_sql("CREATE TABLE payments (run BIGINT NOT NULL)").execute(&pool).await.unwrap();
    let outcomes = DurableOutcomes::new(pool.clone());
    outcomes.migrate().await.unwrap();
    let app = App { pool, outcomes: outcomes.clone(), runs: Arc::default(), hold: Arc::default() };
    let store = RedisStore::from_url(&redis.url()).unwrap();
    let layer = layer(IdempotencyLayer::new(store).recover(outcomes));
    let router = Router::new().route("/pay", post(pay)).with_state(app.clone()).layer(layer);
    (app, router)
}

async fn payments(app: &App) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM payments").fetch_one(&app.pool).await.unwrap()
}

async fn flushall(redis: &RedisServer) {
    let () = axum_idempotency::store::deadpool_redis::redis::cmd("FLUSHALL")
        .query_async(&mut redis.connection().await)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_holder_is_fenced_out_by_the_outcome_table_and_its_payment_rolled_back() {
    let (d, redis) = (TestDatabase::create("durable").await, RedisServer::start());
    let lease = Duration::from_millis(300);
    let (app, router) = setup(&d, &redis, |layer| layer.lease(lease).keep_alive(None)).await;
    let (go_on, held) = oneshot::channel();
    *app.hold.lock().unwrap() = Some(held);
    let first = common::send_in_background(&router, keyed("POST", "/pay", "k1", "a"));
    // The first run holds its payment row, uncommitted, past its lease; the retry takes the
    // claim over, finds nothing in the table, and runs.
    tokio::time::sleep(lease + Duration::from_millis(200)).await;
    let second = send(&router, keyed("POST", "/pay", "k1", "a")).await;
    assert_eq!((second.status, second.body.as_str()), (StatusCode::CREATED, "run 2: a"));
    go_on.send(()).unwrap();
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(first.body, format!("rolled back: {}", StoreError::FencedOut));
    // One payment: the first's went with its refused commit.
    assert_eq!(payments(&app).await, 1);
    let replay = send(&router, keyed("POST", "/pay", "k1", "a")).await;
    assert_eq!((replay.body.as_str(), replay.replayed()), ("run 2: a", true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_payload_under_a_key_only_the_table_holds_is_a_mismatch_and_never_runs() {
    let (d, redis) = (TestDatabase::create("durable").await, RedisServer::start());
    let (app, router) = setup(&d, &redis, |layer| layer).await;
    assert_eq!(send(&router, keyed("POST", "/pay", "k1", "a")).await.status, StatusCode::CREATED);
    flushall(&redis).await;
    // The table holds the first request's outcome: another payload is a key reused, and its
    // claim is released, so that the first request's retry is still answered.
    for _ in 0..2 {
        let other = send(&router, keyed("POST", "/pay", "k1", "b")).await;
        other.assert_problem(409, "key-reused");
    }
    let same = send(&router, keyed("POST", "/pay", "k1", "a")).await;
    assert_eq!((same.body.as_str(), same.replayed()), ("run 1: a", true));
    assert_eq!((app.runs.load(Ordering::SeqCst), payments(&app).await), (1, 1));
}

/// A `Recovery` set after `durable` (its timeout, say) keeps the table asked on every claim:
/// a record Redis lost is replayed from the table, never run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_settings_after_durable_still_replay_what_redis_lost() {
    let (d, redis) = (TestDatabase::create("durable").await, RedisServer::start());
    let recovery = axum_idempotency::settings::Recovery::default().timeout(Duration::from_secs(2));
    let (app, router) = setup(&d, &redis, |layer| layer.recovery(recovery)).await;
    assert_eq!(send(&router, keyed("POST", "/pay", "k1", "a")).await.body, "run 1: a");
    flushall(&redis).await;
    let retry = send(&router, keyed("POST", "/pay", "k1", "a")).await;
    assert_eq!((retry.body.as_str(), retry.replayed()), ("run 1: a", true));
    assert_eq!((app.runs.load(Ordering::SeqCst), payments(&app).await), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_outcome_answers_nothing_and_is_taken_over_by_a_new_run() {
    let (d, redis) = (TestDatabase::create("durable").await, RedisServer::start());
    let retention = Duration::from_millis(400);
    let (app, router) = setup(&d, &redis, |layer| layer.retention(retention)).await;
    assert_eq!(send(&router, keyed("POST", "/pay", "k1", "a")).await.body, "run 1: a");
    flushall(&redis).await;
    tokio::time::sleep(retention + Duration::from_millis(200)).await;
    // Past its retention the key is new: the table answers nothing, and its expired row is
    // replaced by the new run's outcome.
    let again = send(&router, keyed("POST", "/pay", "k1", "a")).await;
    assert_eq!(
        (again.status, again.body.as_str(), again.replayed()),
        (StatusCode::CREATED, "run 2: a", false)
    );
    assert_eq!(payments(&app).await, 2);
    assert_eq!(app.outcomes.sweep_expired().await.unwrap(), 0, "the live outcome was swept");
}

/// The context a door gives an operation run for `key` with `payload`, whose outcome is kept
/// `retention`.
async fn context_of(key: &str, payload: &[u8], retention: Duration) -> IdempotencyContext {
    let idem = axum_idempotency::Idempotent::new(axum_idempotency::MemoryStore::new())
        .retention(retention);
    let (sender, context) = oneshot::channel();
    let ran = idem.run("steps", key, payload, |context| async move {
        sender.send(context).unwrap();
        Ok::<_, std::convert::Infallible>(())
    });
    ran.await.unwrap();
    context.await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_is_marked_once_and_expires_with_its_retention() {
    let d = TestDatabase::create("durable").await;
    let pool = pool(&d);
    let steps = Checkpoints::new(pool.clone());
    steps.migrate().await.unwrap();
    let retention = Duration::from_millis(300);
    let key = context_of("k1", b"a", retention).await;
    assert_eq!(steps.done::<i64>(&key, "order").await.unwrap(), None);
    let mut tx = pool.begin().await.unwrap();
    steps.mark(&mut tx, &key, "order", &7_i64).await.unwrap();
    // Not done until its transaction commits.
    assert_eq!(steps.done::<i64>(&key, "order").await.unwrap(), None);
    tx.commit().await.unwrap();
    assert_eq!(steps.done::<i64>(&key, "order").await.unwrap(), Some(7));
    let another_key = context_of("k2", b"a", retention).await;
    assert_eq!(steps.done::<i64>(&another_key, "order").await.unwrap(), None);
    assert_eq!(steps.done::<i64>(&key, "charge").await.unwrap(), None);
    // Another request under the same key: its steps are not this one's.
    let another_request = context_of("k1", b"b", retention).await;
    let reused = steps.done::<i64>(&another_request, "order").await;
    assert!(matches!(reused, Err(StoreError::KeyReused)), "{reused:?}");
    // A second holder's mark of the same step is refused.
    let mut tx = pool.begin().await.unwrap();
    let twice = steps.mark(&mut tx, &key, "order", &8_i64).await;
    assert!(matches!(twice, Err(StoreError::FencedOut)), "{twice:?}");
    drop(tx);
    assert_eq!(steps.done::<i64>(&key, "order").await.unwrap(), Some(7));
    // A result that does not read back as the type asked is an error, never another value.
    assert!(matches!(steps.done::<String>(&key, "order").await, Err(StoreError::CorruptRecord(_))));
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(steps.done::<i64>(&key, "order").await.unwrap(), None);
    let mut tx = pool.begin().await.unwrap();
    steps.mark(&mut tx, &key, "order", &9_i64).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(steps.done::<i64>(&key, "order").await.unwrap(), Some(9));
    assert_eq!(steps.sweep_expired().await.unwrap(), 0);
}

/// `DurableOutcomes::transaction` under a door that does not answer from the table (no
/// `.recover(outcomes)`) is refused before anything runs: a committed outcome Redis then lost,
/// or a takeover, would never be answered from the table, and every retry would run the
/// handler's work before its transaction again.
/// A commit into a table the door does not answer from (another database's
/// `DurableOutcomes`) is refused before anything runs: once the record store lost its record,
/// the door would ask its own table, find nothing, and run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_into_another_table_than_the_doors_is_refused() {
    let (d, other, redis) = (
        TestDatabase::create("durable").await,
        TestDatabase::create("durable_other").await,
        RedisServer::start(),
    );
    let pool = pool(&d);
    sqlx::raw_sql("CREATE TABLE payments (run BIGINT NOT NULL)").execute(&pool).await.unwrap();
    let outcomes = DurableOutcomes::new(pool.clone());
    outcomes.migrate().await.unwrap();
    let answers_from = DurableOutcomes::new(self::pool(&other));
    answers_from.migrate().await.unwrap();
    let app = App { pool, outcomes, runs: Arc::default(), hold: Arc::default() };
    let store = RedisStore::from_url(&redis.url()).unwrap();
    let layer = IdempotencyLayer::new(store).recover(answers_from);
    let router = Router::new().route("/pay", post(pay)).with_state(app.clone()).layer(layer);
    for _ in 0..2 {
        let refused = send(&router, keyed("POST", "/pay", "k1", "a")).await;
        assert_eq!(refused.status, StatusCode::INTERNAL_SERVER_ERROR, "{refused:?}");
        assert!(refused.body.contains("does not answer from"), "{}", refused.body);
    }
    assert_eq!(payments(&app).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_outcomes_under_a_door_that_does_not_read_them_is_refused() {
    let (d, redis) = (TestDatabase::create("durable").await, RedisServer::start());
    let pool = pool(&d);
    sqlx::raw_sql("CREATE TABLE payments (run BIGINT NOT NULL)").execute(&pool).await.unwrap();
    let outcomes = DurableOutcomes::new(pool.clone());
    outcomes.migrate().await.unwrap();
    let app = App { pool, outcomes: outcomes.clone(), runs: Arc::default(), hold: Arc::default() };
    let store = RedisStore::from_url(&redis.url()).unwrap();
    let router = Router::new()
        .route("/pay", post(pay))
        .with_state(app.clone())
        .layer(IdempotencyLayer::new(store.clone()));
    let refused = send(&router, keyed("POST", "/pay", "k1", "a")).await;
    assert_eq!(refused.status, StatusCode::INTERNAL_SERVER_ERROR, "{refused:?}");
    assert!(refused.body.contains(".recover(outcomes)"), "{}", refused.body);
    assert_eq!(payments(&app).await, 0);
    // The consumer door the same, and with `.durable` both doors commit.
    let operation = |outcomes: DurableOutcomes| {
        move |context: IdempotencyContext| async move {
            let paid = outcomes.transaction(&context, |_| {
                Box::pin(async move { Ok::<_, sqlx::Error>(axum::Json(1_i64)) })
            });
            paid.await.map(|axum::Json(id)| id)
        }
    };
    let idem = axum_idempotency::Idempotent::new(store.clone());
    let refused = idem.run("payments", "evt_1", b"{}", operation(outcomes.clone())).await;
    let message = format!("{refused:?}");
    assert!(message.contains("Misuse"), "{message}");
    let durable = idem.recover(outcomes.clone());
    let ran = durable.run("payments", "evt_1", b"{}", operation(outcomes)).await;
    assert!(matches!(ran, Ok(axum_idempotency::consumer::Outcome::Ran(1))), "{ran:?}");
    let layer = IdempotencyLayer::new(store).recover(app.outcomes.clone());
    let router = Router::new().route("/pay", post(pay)).with_state(app.clone()).layer(layer);
    assert_eq!(send(&router, keyed("POST", "/pay", "k1", "a")).await.status, StatusCode::CREATED);
    assert_eq!(payments(&app).await, 1);
}

/// A steps table of the previous version (no fingerprint column): `migrate` adds the column;
/// its old steps, bound to no request, are never resumed for one (`KeyReused`), and new steps
/// are marked and read as ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_steps_table_is_upgraded_and_its_unbound_steps_never_resumed() {
    let d = TestDatabase::create("durable").await;
    let pool = pool(&d);
    let old = "CREATE TABLE idempotency_steps (key_hash TEXT NOT NULL, step TEXT NOT NULL,
        result BYTEA NOT NULL, expires_at TIMESTAMPTZ NOT NULL, PRIMARY KEY (key_hash, step))";
    sqlx::raw_sql(old).execute(&pool).await.unwrap();
    let context = context_of("k1", b"a", Duration::from_secs(60)).await;
    let row = "INSERT INTO idempotency_steps VALUES ($1, 'order', '7', now() + interval '1 hour')";
    sqlx::query(row).bind(context.key_hash()).execute(&pool).await.unwrap();
    let steps = Checkpoints::new(pool.clone());
    steps.migrate().await.unwrap();
    let old_step = steps.done::<i64>(&context, "order").await;
    assert!(matches!(old_step, Err(StoreError::KeyReused)), "{old_step:?}");
    let mut tx = pool.begin().await.unwrap();
    steps.mark(&mut tx, &context, "charge", &"ch_1").await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(steps.done::<String>(&context, "charge").await.unwrap().as_deref(), Some("ch_1"));
}
