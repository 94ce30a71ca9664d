//! The HTTP door's response committed with the handler's side effect in the store's own
//! PostgreSQL transaction (`PostgresStore::transaction`), in process: the client is answered
//! what the database holds, whatever the handler returns after its commit; a commit that fails
//! leaves nothing stored, whatever the handler returns; a response the layer would not store is
//! refused and rolled back; and each misuse of the transaction (retried after a lost answer,
//! nested, sent to another store) is refused, never paid twice. Each test has a database of
//! its own, dropped at the end. (The crash windows, with real SIGKILL, are `tests/suite/ledger.rs`.)
#![cfg(feature = "postgres")]

mod common;

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use axum::{
    Json, Router,
    extract::State,
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::post,
};
use axum_idempotency::settings::Waiting;
use axum_idempotency::{
    IdempotencyContext, IdempotencyLayer,
    store::{
        PostgresStore, StoreError, TransactionError,
        sqlx::{self, PgPool, postgres::PgPoolOptions},
    },
};
use common::{keyed, postgres::TestDatabase, send};
use serde_json::json;

/// `deferred` fails at commit, never before: a second row with the same `code` passes its
/// insert, and the commit refuses it.
const TABLES: &str = "CREATE TABLE payments (id BIGSERIAL PRIMARY KEY, code TEXT NOT NULL,
        CONSTRAINT one_code UNIQUE (code) DEFERRABLE INITIALLY DEFERRED);
    -- A commit that takes 1.5 s (a trigger run at commit time), for a commit whose answer
    -- comes after the store's command timeout: a reply lost on the wire.
    CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS
        $$ BEGIN IF NEW.code = 'slow' THEN PERFORM pg_sleep(1.5); END IF; RETURN NULL; END $$;
    CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON payments
        DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit()";

#[derive(Clone)]
struct App {
    pool: PgPool,
    store: PostgresStore,
    /// A store of the same database on another table: not the layer's.
    other: PostgresStore,
    runs: Arc<AtomicUsize>,
}

async fn setup(d: &TestDatabase) -> (App, Router) {
    let pool = PgPoolOptions::new().connect_lazy_with(d.options());
    // A short command timeout, which the slow commit outlives.
    let store = PostgresStore::new(pool.clone())
        .sweep_every(None)
        .command_timeout(std::time::Duration::from_millis(300));
    store.migrate().await.unwrap();
    sqlx::raw_sql(TABLES).execute(&pool).await.unwrap();
    let other = PostgresStore::with_table(pool.clone(), "other_records").unwrap();
    let other = other.sweep_every(None);
    other.migrate().await.unwrap();
    let app = App { pool, store: store.clone(), other, runs: Arc::default() };
    let router = Router::new()
        .route("/pay", post(pay))
        .route("/pay-then-answer-otherwise", post(pay_then_answer_otherwise))
        .route("/pay-twice-ignoring-the-commit", post(pay_twice_ignoring_the_commit))
        .route("/commit-a-500", post(commit_a_500))
        .route("/commit-a-500-answered-by-the-layer", post(commit_a_500_answered_by_the_layer))
        .route("/pay-slowly", post(pay_slowly))
        .route("/pay-slowly-and-retry", post(pay_slowly_and_retry))
        .route("/pay-nested", post(pay_nested))
        .route("/pay-through-another-store", post(pay_through_another_store))
        .route(
            "/pay-through-another-store-answered-by-the-layer",
            post(pay_through_another_store_answered_by_the_layer),
        )
        .with_state(app.clone())
        .layer(IdempotencyLayer::new(store));
    (app, router)
}

/// One payment row with `code`, and `response` committed with it in the store's transaction.
async fn commit_payment(
    app: &App,
    context: &IdempotencyContext,
    code: &'static str,
    response: impl IntoResponse,
) -> Result<Response, TransactionError<sqlx::Error>> {
    commit_payment_in(&app.store, app, context, code, response.into_response()).await
}

async fn commit_payment_in(
    store: &PostgresStore,
    app: &App,
    context: &IdempotencyContext,
    code: &'static str,
    response: Response,
) -> Result<Response, TransactionError<sqlx::Error>> {
    app.runs.fetch_add(1, Ordering::SeqCst);
    store
        .transaction(context, |tx| {
            Box::pin(async move {
                let sql = "INSERT INTO payments (code) VALUES ($1)";
                sqlx::query(sql).bind(code).execute(&mut *tx).await?;
                Ok(response)
            })
        })
        .await
}

fn created(body: serde_json::Value) -> impl IntoResponse {
    (StatusCode::CREATED, [("x-payment", "p1"), ("set-cookie", "session=1")], Json(body))
}

async fn pay(State(app): State<App>, context: IdempotencyContext) -> Response {
    commit_payment(&app, &context, "a", created(json!({ "paid": "a" }))).await.into_response()
}

/// A payment whose commit lands after the store stopped waiting for its answer.
async fn pay_slowly(State(app): State<App>, context: IdempotencyContext) -> Response {
    commit_payment(&app, &context, "slow", created(json!({ "paid": "slowly" })))
        .await
        .into_response()
}

/// The misuse of a handler that retries its transaction when the commit's answer is lost:
/// the second call must be refused, whatever the first did.
async fn pay_slowly_and_retry(State(app): State<App>, context: IdempotencyContext) -> Response {
    let response = || created(json!({ "paid": "slowly" }));
    let first = commit_payment(&app, &context, "slow", response()).await;
    assert!(matches!(&first, Err(e) if e.may_have_committed()), "{first:?}");
    let again = commit_payment(&app, &context, "again", response()).await;
    let Err(TransactionError::Misuse(reason)) = again else { panic!("retried: {again:?}") };
    (StatusCode::SERVICE_UNAVAILABLE, reason).into_response()
}

/// The misuse of a transaction begun inside another of the same claim.
async fn pay_nested(State(app): State<App>, context: IdempotencyContext) -> Response {
    let (inner_app, inner_context) = (app.clone(), context.clone());
    let outer = app
        .store
        .transaction(&context, move |tx| {
            Box::pin(async move {
                sqlx::query("INSERT INTO payments (code) VALUES ('outer')")
                    .execute(&mut *tx)
                    .await?;
                let response = created(json!({ "paid": "inner" })).into_response();
                let inner = commit_payment(&inner_app, &inner_context, "inner", response).await;
                let Err(TransactionError::Misuse(reason)) = inner else {
                    panic!("a nested transaction ran: {inner:?}")
                };
                Ok::<_, sqlx::Error>((StatusCode::CREATED, reason).into_response())
            })
        })
        .await;
    outer.into_response()
}

/// The misuse of a commit sent to a store that is not the layer's.
async fn pay_through_another_store(
    State(app): State<App>,
    context: IdempotencyContext,
) -> Response {
    let response = created(json!({ "paid": "elsewhere" })).into_response();
    let paid = commit_payment_in(&app.other, &app, &context, "a", response).await;
    match paid {
        Err(TransactionError::Store(StoreError::FencedOut)) => {
            (StatusCode::CONFLICT, "fenced out").into_response()
        }
        other => panic!("committed through another store: {other:?}"),
    }
}

/// The same misuse, its error answered as the layer answers it (`IntoResponse`).
async fn pay_through_another_store_answered_by_the_layer(
    State(app): State<App>,
    context: IdempotencyContext,
) -> Response {
    let response = created(json!({ "paid": "elsewhere" })).into_response();
    commit_payment_in(&app.other, &app, &context, "a", response).await.into_response()
}

/// Commits one response, then returns another.
async fn pay_then_answer_otherwise(
    State(app): State<App>,
    context: IdempotencyContext,
) -> Response {
    match commit_payment(&app, &context, "a", created(json!({ "paid": "a" }))).await {
        Ok(_) => (StatusCode::OK, Json(json!({ "something": "else" }))).into_response(),
        Err(error) => error.into_response(),
    }
}

/// A row whose commit the deferred constraint refuses when code `a` exists (the first call
/// commits it, outside any idempotency), and a 201 returned whatever the commit said.
async fn pay_twice_ignoring_the_commit(
    State(app): State<App>,
    context: IdempotencyContext,
) -> Response {
    let response = created(json!({ "paid": "a" }));
    match commit_payment(&app, &context, "a", response).await {
        Ok(response) => response,
        // The misuse the layer must survive: a success answered after a failed commit.
        Err(_) => created(json!({ "paid": "not really" })).into_response(),
    }
}

async fn commit_a_500(State(app): State<App>, context: IdempotencyContext) -> Response {
    let failed = (StatusCode::INTERNAL_SERVER_ERROR, "no").into_response();
    match commit_payment_in(&app.store, &app, &context, "a", failed).await {
        Err(TransactionError::NotStored(why)) => (StatusCode::BAD_GATEWAY, why).into_response(),
        other => panic!("a 500 was committed: {other:?}"),
    }
}

async fn payments(app: &App) -> i64 {
    let sql = "SELECT count(*) FROM payments";
    sqlx::query_scalar(sql).fetch_one(&app.pool).await.unwrap()
}

async fn record_state(app: &App) -> Option<String> {
    let sql = "SELECT state::text FROM idempotency_records WHERE state <> 'F'";
    sqlx::query_scalar(sql).fetch_optional(&app.pool).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_committed_response_is_answered_and_replayed_and_the_handler_runs_once() {
    let d = TestDatabase::create("txnhttp").await;
    let (app, router) = setup(&d).await;
    let first = send(&router, keyed("POST", "/pay", "k1", "{}")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.body, r#"{"paid":"a"}"#);
    // The first answer is the handler's own response: headers the layer never stores go too.
    assert_eq!(first.headers["set-cookie"], "session=1");
    assert_eq!(record_state(&app).await.as_deref(), Some("C"));
    for _ in 0..2 {
        let replay = send(&router, keyed("POST", "/pay", "k1", "{}")).await;
        assert_eq!((replay.status, &replay.body), (StatusCode::CREATED, &first.body));
        assert_eq!(replay.headers["idempotency-replayed"], "true");
        assert_eq!(replay.headers["x-payment"], "p1");
        assert_eq!(replay.headers["content-type"], "application/json");
        assert!(replay.headers.get("set-cookie").is_none());
    }
    assert_eq!((app.runs.load(Ordering::SeqCst), payments(&app).await), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_returns_another_response_than_it_committed_answers_the_committed_one() {
    let d = TestDatabase::create("txnhttp").await;
    let (app, router) = setup(&d).await;
    let uri = "/pay-then-answer-otherwise";
    let first = send(&router, keyed("POST", uri, "k1", "{}")).await;
    assert_eq!((first.status, first.body.as_str()), (StatusCode::CREATED, r#"{"paid":"a"}"#));
    assert_eq!(first.headers["x-payment"], "p1");
    assert!(first.headers.get("idempotency-replayed").is_none());
    let replay = send(&router, keyed("POST", uri, "k1", "{}")).await;
    assert_eq!((replay.status, &replay.body), (StatusCode::CREATED, &first.body));
    assert_eq!((app.runs.load(Ordering::SeqCst), payments(&app).await), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_fails_stores_nothing_whatever_the_handler_returns() {
    let d = TestDatabase::create("txnhttp").await;
    let (app, router) = setup(&d).await;
    // Code `a` is taken outside any idempotency: every commit of another `a` row fails.
    sqlx::query("INSERT INTO payments (code) VALUES ('a')").execute(&app.pool).await.unwrap();
    let uri = "/pay-twice-ignoring-the-commit";
    let first = send(&router, keyed("POST", uri, "k1", "{}")).await;
    assert_eq!(first.body, r#"{"paid":"not really"}"#);
    // Nothing committed, so nothing is stored: the key is released, and the retry runs.
    assert_eq!(record_state(&app).await, None);
    let retry = send(&router, keyed("POST", uri, "k1", "{}")).await;
    assert!(retry.headers.get("idempotency-replayed").is_none());
    assert_eq!((app.runs.load(Ordering::SeqCst), payments(&app).await), (2, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_the_layer_would_not_store_is_refused_and_its_side_effect_rolled_back() {
    let d = TestDatabase::create("txnhttp").await;
    let (app, router) = setup(&d).await;
    let first = send(&router, keyed("POST", "/commit-a-500", "k1", "{}")).await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY);
    assert_eq!(first.body, "the outcome is not stored: the store policy does not keep it");
    // A 502 is not stored either: the key is released, and the payment was rolled back.
    assert_eq!(record_state(&app).await, None);
    assert_eq!(payments(&app).await, 0);
    // The error answered by the layer: the handler's fault, a 500 that says why, not stored.
    let answered =
        send(&router, keyed("POST", "/commit-a-500-answered-by-the-layer", "k2", "{}")).await;
    answered.assert_problem(500, "handler-failed");
    assert_eq!(
        answered.problem_detail(),
        "the outcome is not stored: the store policy does not keep it"
    );
    assert_eq!(payments(&app).await, 0);
}

/// The commit's answer is lost (it lands after the command timeout): the door cannot know
/// whether it committed, stores nothing and releases the key with a fenced delete, which waits
/// for the transaction's row lock and is then refused by the committed record. The client got
/// an error; its retry is the committed response, replayed, and the handler ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_whose_answer_is_lost_is_replayed_not_run_again() {
    let d = TestDatabase::create("txnhttp").await;
    let (app, router) = setup(&d).await;
    let first = send(&router, keyed("POST", "/pay-slowly", "k1", "{}")).await;
    first.assert_problem(503, "store-unavailable");
    assert!(first.body.contains("the commit's answer was lost"), "{}", first.body);
    // The commit lands after its answer was given up on.
    tokio::time::sleep(std::time::Duration::from_millis(1600)).await;
    assert_eq!(record_state(&app).await.as_deref(), Some("C"));
    assert_eq!(payments(&app).await, 1);
    let retry = send(&router, keyed("POST", "/pay-slowly", "k1", "{}")).await;
    assert_eq!((retry.status, retry.body.as_str()), (StatusCode::CREATED, r#"{"paid":"slowly"}"#));
    assert_eq!(retry.headers["idempotency-replayed"], "true");
    assert_eq!((app.runs.load(Ordering::SeqCst), payments(&app).await), (1, 1));
}

/// A 500 committed, its refusal answered as the layer answers it (`IntoResponse`).
async fn commit_a_500_answered_by_the_layer(
    State(app): State<App>,
    context: IdempotencyContext,
) -> Response {
    let failed = (StatusCode::INTERNAL_SERVER_ERROR, "no").into_response();
    commit_payment_in(&app.store, &app, &context, "a", failed).await.into_response()
}

/// A handler that retries its transaction after the commit's answer was lost (the commit
/// landed after the command timeout) is refused: one payment, not two; the client's retry is
/// the committed response, replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_retried_after_its_commit_answer_was_lost_is_refused() {
    let d = TestDatabase::create("txnhttp").await;
    let (app, router) = setup(&d).await;
    let first = send(&router, keyed("POST", "/pay-slowly-and-retry", "k1", "{}")).await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "{}", first.body);
    assert!(first.body.contains("fate unknown"), "{}", first.body);
    tokio::time::sleep(std::time::Duration::from_millis(1600)).await;
    assert_eq!(payments(&app).await, 1, "the retried transaction paid again");
    let retry = send(&router, keyed("POST", "/pay-slowly-and-retry", "k1", "{}")).await;
    assert_eq!((retry.status, retry.body.as_str()), (StatusCode::CREATED, r#"{"paid":"slowly"}"#));
    assert_eq!(retry.headers["idempotency-replayed"], "true");
    assert_eq!(payments(&app).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_nested_in_another_of_the_same_claim_is_refused() {
    let d = TestDatabase::create("txnhttp").await;
    let (app, router) = setup(&d).await;
    let first = send(&router, keyed("POST", "/pay-nested", "k1", "{}")).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
    assert!(first.body.contains("nested"), "{}", first.body);
    let rows: Vec<String> =
        sqlx::query_scalar("SELECT code FROM payments").fetch_all(&app.pool).await.unwrap();
    assert_eq!(rows, ["outer"], "only the outer transaction's row committed");
    let retry = send(&router, keyed("POST", "/pay-nested", "k1", "{}")).await;
    assert_eq!((retry.status, &retry.body), (StatusCode::CREATED, &first.body));
    assert_eq!(retry.headers["idempotency-replayed"], "true");
}

/// A commit through a store that is not the layer's (another table of the same database) is
/// fenced out and rolled back: no payment, nothing written in the other table, and the layer's
/// key released, so that the retry runs (and is refused again), never a payment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_through_another_store_is_refused_and_rolled_back() {
    let d = TestDatabase::create("txnhttp").await;
    let (app, router) = setup(&d).await;
    for _ in 0..2 {
        let answer = send(&router, keyed("POST", "/pay-through-another-store", "k1", "{}")).await;
        assert_eq!((answer.status, answer.body.as_str()), (StatusCode::CONFLICT, "fenced out"));
        assert!(answer.headers.get("idempotency-replayed").is_none());
    }
    assert_eq!(payments(&app).await, 0);
    let other: i64 = sqlx::query_scalar("SELECT count(*) FROM other_records")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(other, 0, "the other store wrote a record");
    assert_eq!(record_state(&app).await, None, "the layer's key is released");
    // The error answered by the layer: the store's word, a 503 to retry, saying it rolled back.
    let uri = "/pay-through-another-store-answered-by-the-layer";
    let answered = send(&router, keyed("POST", uri, "k2", "{}")).await;
    answered.assert_problem(503, "store-unavailable");
    assert_eq!(answered.header("retry-after"), Some("1"));
    assert_eq!(answered.problem_detail(), format!("rolled back: {}", StoreError::FencedOut));
    assert_eq!(payments(&app).await, 0);
}

/// A TCP proxy to the database that, once armed, swallows the first message carrying
/// `COMMIT` and holds that connection open, as a partition does: the server keeps the
/// transaction, and its row locks, idle.
struct SwallowingProxy {
    port: u16,
    armed: Arc<std::sync::atomic::AtomicBool>,
    swallowed: Arc<tokio::sync::Notify>,
}

impl SwallowingProxy {
    async fn start(target: (String, u16)) -> Self {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let armed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let swallowed = Arc::new(tokio::sync::Notify::new());
        let (arm, notify) = (armed.clone(), swallowed.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let server = tokio::net::TcpStream::connect(target.clone()).await.unwrap();
                let (mut client_read, mut client_write) = client.into_split();
                let (mut server_read, mut server_write) = server.into_split();
                let (arm, notify) = (arm.clone(), notify.clone());
                tokio::spawn(async move {
                    let mut buffer = vec![0u8; 64 * 1024];
                    loop {
                        let Ok(n @ 1..) = client_read.read(&mut buffer).await else { return };
                        let chunk = &buffer[..n];
                        let commit = chunk.windows(7).any(|w| w == b"COMMIT\0");
                        if commit && arm.swap(false, Ordering::SeqCst) {
                            notify.notify_one();
                            // Held open (this task keeps both ends), never forwarded.
                            std::future::pending::<()>().await;
                        }
                        if server_write.write_all(chunk).await.is_err() {
                            return;
                        }
                    }
                });
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
                });
            }
        });
        Self { port, armed, swallowed }
    }
}

/// The handler's COMMIT is lost in a partition, its connection held open: the transaction
/// stays idle with the record's row locked. A claim on another instance is answered "in
/// progress" within its command timeout, never 503 `store-unavailable`; the database ends the
/// abandoned transaction after the command timeout (the store set its
/// `idle_in_transaction_session_timeout`), and a retry that waits (the layer's default) then
/// runs, within its wait: one payment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_lost_in_a_partition_is_in_progress_then_runs_once() {
    use std::time::{Duration, Instant};
    let d = TestDatabase::create("txnhttp").await;
    let (app, router_b) = setup(&d).await;
    let proxy = SwallowingProxy::start((d.host(), d.port())).await;
    let options = d.options().host("127.0.0.1").port(proxy.port);
    let pool_a = PgPoolOptions::new().test_before_acquire(false).connect_lazy_with(options);
    let store_a =
        PostgresStore::new(pool_a).sweep_every(None).command_timeout(Duration::from_secs(2));
    let app_a = App { store: store_a.clone(), ..app.clone() };
    let router_a = Router::new()
        .route("/pay", post(pay))
        .with_state(app_a)
        .layer(IdempotencyLayer::new(store_a).lease(Duration::from_secs(1)));
    // Instance B answers at once, or waits (the default), over the same table.
    let at_once = Router::new()
        .route("/pay", post(pay))
        .with_state(app.clone())
        .layer(IdempotencyLayer::new(app.store.clone()).waiting(Waiting::off()));
    proxy.armed.store(true, Ordering::SeqCst);
    let first = common::send_in_background(&router_a, keyed("POST", "/pay", "k1", "{}"));
    proxy.swallowed.notified().await;
    // B's command timeout is 300 ms: the row is locked by the idle transaction.
    let started = Instant::now();
    let retry = send(&at_once, keyed("POST", "/pay", "k1", "{}")).await;
    retry.assert_problem(202, "in-progress");
    assert!(retry.headers.contains_key("retry-after"));
    assert!(started.elapsed() < Duration::from_millis(300), "{:?}", started.elapsed());
    let started = Instant::now();
    let waited = send(&router_b, keyed("POST", "/pay", "k1", "{}")).await;
    assert_eq!(waited.status, StatusCode::CREATED, "{waited:?}");
    assert!(waited.headers.get("idempotency-replayed").is_none());
    assert!(started.elapsed() < Duration::from_secs(10), "not within the wait");
    // The commit's answer lost (its timeout came first), or the database's word that it ended
    // the transaction (its idle timeout came first): either way no commit, and a 503.
    let first = first.await.unwrap();
    first.assert_problem(503, "store-unavailable");
    let ended = ["the commit's answer was lost", "idle-in-transaction timeout"];
    assert!(ended.iter().any(|why| first.body.contains(why)), "{}", first.body);
    assert_eq!(payments(&app).await, 1);
    let replay = send(&router_b, keyed("POST", "/pay", "k1", "{}")).await;
    assert_eq!((replay.status, replay.replayed()), (StatusCode::CREATED, true));
}

/// A duplicate that waits for a handler whose transaction is still running is woken by the
/// transaction's commit (its NOTIFY goes out at the commit) and answered with the replay at
/// once, not at the end of its wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_duplicate_is_woken_by_the_transactions_commit() {
    use std::time::{Duration, Instant};
    let d = TestDatabase::create("txnhttp").await;
    let (app, _) = setup(&d).await;
    let holding = Router::new()
        .route(
            "/pay-holding",
            post(|State(app): State<App>, context: IdempotencyContext| async move {
                let paid = app.store.transaction(&context, |tx| {
                    Box::pin(async move {
                        sqlx::query("INSERT INTO payments (code) VALUES ('held')")
                            .execute(&mut *tx)
                            .await?;
                        tokio::time::sleep(Duration::from_millis(800)).await;
                        Ok::<_, sqlx::Error>(created(json!({ "paid": "held" })).into_response())
                    })
                });
                paid.await.into_response()
            }),
        )
        .with_state(app.clone())
        .layer(IdempotencyLayer::new(app.store.clone()));
    let first = common::send_in_background(&holding, keyed("POST", "/pay-holding", "k1", "{}"));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = Instant::now();
    let duplicate = send(&holding, keyed("POST", "/pay-holding", "k1", "{}")).await;
    assert_eq!((duplicate.status, duplicate.replayed()), (StatusCode::CREATED, true));
    assert!(started.elapsed() < Duration::from_secs(3), "woken late: {:?}", started.elapsed());
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(payments(&app).await, 1);
}

/// The lease is renewed while the handler runs, and goes on being renewed after its commit
/// until the layer settles: a renewal that finds the committed record leaves it as it is (its
/// retention), so that the retry a second later is a replay, not a second run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_after_the_commit_keeps_the_records_retention() {
    use std::time::Duration;
    let d = TestDatabase::create("txnhttp").await;
    let (app, _) = setup(&d).await;
    let lingering = Router::new()
        .route(
            "/pay-then-linger",
            post(|State(app): State<App>, context: IdempotencyContext| async move {
                let response = created(json!({ "paid": "lingering" })).into_response();
                let paid = commit_payment_in(&app.store, &app, &context, "l", response).await;
                // Renewals (every 100 ms) run on while the handler lingers.
                tokio::time::sleep(Duration::from_millis(600)).await;
                paid.into_response()
            }),
        )
        .with_state(app.clone())
        .layer(IdempotencyLayer::new(app.store.clone()).lease(Duration::from_millis(300)));
    let first = send(&lingering, keyed("POST", "/pay-then-linger", "k1", "{}")).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    tokio::time::sleep(Duration::from_millis(800)).await;
    let retry = send(&lingering, keyed("POST", "/pay-then-linger", "k1", "{}")).await;
    assert_eq!((retry.status, retry.replayed()), (StatusCode::CREATED, true), "{retry:?}");
    assert_eq!((app.runs.load(Ordering::SeqCst), payments(&app).await), (1, 1));
}

/// A REPEATABLE READ (or SERIALIZABLE) transaction that outlasts a renewal period commits:
/// the lease is not renewed while the store's transaction writes the record (a renewal's
/// write would make the transaction's own write of the record a concurrent update).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeatable_read_transaction_longer_than_a_renewal_period_commits() {
    use std::time::Duration;
    let d = TestDatabase::create("txnhttp").await;
    let (app, _) = setup(&d).await;
    let isolated = Router::new()
        .route(
            "/pay-isolated",
            post(|State(app): State<App>, context: IdempotencyContext, level: String| async move {
                let paid = app.store.transaction(&context, move |tx| {
                    Box::pin(async move {
                        let set = match level.as_str() {
                            "SERIALIZABLE" => "SET TRANSACTION ISOLATION LEVEL SERIALIZABLE",
                            _ => "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ",
                        };
                        sqlx::query(set).execute(&mut *tx).await?;
                        sqlx::query("INSERT INTO payments (code) VALUES ($1)")
                            .bind(set)
                            .execute(&mut *tx)
                            .await?;
                        tokio::time::sleep(Duration::from_millis(1800)).await;
                        Ok::<_, sqlx::Error>(created(json!({ "paid": level })).into_response())
                    })
                });
                paid.await.into_response()
            }),
        )
        .with_state(app.clone())
        .layer(IdempotencyLayer::new(app.store.clone()));
    for (key, level) in [("k1", "REPEATABLE READ"), ("k2", "SERIALIZABLE")] {
        let first = send(&isolated, keyed("POST", "/pay-isolated", key, level)).await;
        assert_eq!(first.status, StatusCode::CREATED, "{level}: {first:?}");
        let retry = send(&isolated, keyed("POST", "/pay-isolated", key, level)).await;
        assert_eq!((retry.status, retry.replayed()), (StatusCode::CREATED, true), "{level}");
    }
    assert_eq!(payments(&app).await, 2);
}

/// A handler that commits, then returns a stream that never ends (as an event stream does):
/// the committed response is answered, at once, without reading the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_returned_after_the_commit_holds_nothing_up() {
    use std::time::Duration;
    let d = TestDatabase::create("txnhttp").await;
    let (app, _) = setup(&d).await;
    let streaming = Router::new()
        .route(
            "/pay-then-stream",
            post(|State(app): State<App>, context: IdempotencyContext| async move {
                let response = created(json!({ "paid": "a" })).into_response();
                let committed = commit_payment_in(&app.store, &app, &context, "s", response).await;
                assert!(committed.is_ok(), "{committed:?}");
                let chunk = futures_util::stream::once(async {
                    Ok::<_, std::io::Error>(axum::body::Bytes::from_static(b"progress"))
                });
                let endless =
                    futures_util::StreamExt::chain(chunk, futures_util::stream::pending());
                axum::body::Body::from_stream(endless).into_response()
            }),
        )
        .with_state(app.clone())
        .layer(IdempotencyLayer::new(app.store.clone()));
    let first = tokio::time::timeout(
        Duration::from_secs(5),
        send(&streaming, keyed("POST", "/pay-then-stream", "k1", "{}")),
    )
    .await
    .expect("the committed response was held up by the stream");
    assert_eq!((first.status, first.body.as_str()), (StatusCode::CREATED, r#"{"paid":"a"}"#));
    let retry = send(&streaming, keyed("POST", "/pay-then-stream", "k1", "{}")).await;
    assert_eq!((retry.status, retry.replayed()), (StatusCode::CREATED, true));
    assert_eq!(payments(&app).await, 1);
}
