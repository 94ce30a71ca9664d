//! The HTTP door's response committed in the handler's own PostgreSQL transaction
//! (`http::seal`, `PostgresStore::commit`), in process: the client is answered what the
//! database holds, whatever the handler returns after its commit; a commit that fails leaves
//! nothing stored, whatever the handler returns; a response the layer would not store cannot
//! be sealed. Each test has a database of its own, dropped at the end. (The crash windows, with
//! real SIGKILL, are `tests/ledger.rs`.)
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
use axum_idempotency::{
    IdempotencyContext, IdempotencyLayer, http,
    store::{
        PostgresStore, SealError,
        sqlx::{self, PgPool, postgres::PgConnectOptions, postgres::PgPoolOptions},
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
    runs: Arc<AtomicUsize>,
}

async fn setup(d: &TestDatabase) -> (App, Router) {
    let options =
        PgConnectOptions::new().host(&d.host()).port(d.port()).username(d.user()).database(&d.name);
    let pool = PgPoolOptions::new().connect_lazy_with(options);
    // A short command timeout, which the slow commit outlives.
    let store = PostgresStore::new(pool.clone())
        .sweep_every(None)
        .command_timeout(std::time::Duration::from_millis(300));
    store.migrate().await.unwrap();
    sqlx::raw_sql(TABLES).execute(&pool).await.unwrap();
    let app = App { pool, store: store.clone(), runs: Arc::default() };
    let router = Router::new()
        .route("/pay", post(pay))
        .route("/pay-then-answer-otherwise", post(pay_then_answer_otherwise))
        .route("/pay-twice-ignoring-the-commit", post(pay_twice_ignoring_the_commit))
        .route("/seal-a-500", post(seal_a_500))
        .route("/pay-slowly", post(pay_slowly))
        .with_state(app.clone())
        .layer(IdempotencyLayer::new(store));
    (app, router)
}

/// One payment row with `code`, and `response` sealed and committed with it.
async fn commit_payment(
    app: &App,
    context: &IdempotencyContext,
    code: &str,
    response: impl IntoResponse,
) -> Result<http::SealedResponse, String> {
    app.runs.fetch_add(1, Ordering::SeqCst);
    let mut tx = app.pool.begin().await.map_err(|e| e.to_string())?;
    let sql = "INSERT INTO payments (code) VALUES ($1)";
    sqlx::query(sql).bind(code).execute(&mut *tx).await.map_err(|e| e.to_string())?;
    let sealed = http::seal(context, response).await.map_err(|e| e.to_string())?;
    app.store.commit(tx, &sealed).await.map_err(|e| e.to_string())?;
    Ok(sealed)
}

fn created(body: serde_json::Value) -> impl IntoResponse {
    (StatusCode::CREATED, [("x-payment", "p1"), ("set-cookie", "session=1")], Json(body))
}

async fn pay(State(app): State<App>, context: IdempotencyContext) -> Response {
    match commit_payment(&app, &context, "a", created(json!({ "paid": "a" }))).await {
        Ok(sealed) => sealed.into_response(),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error).into_response(),
    }
}

/// A payment whose commit lands after the store stopped waiting for its answer.
async fn pay_slowly(State(app): State<App>, context: IdempotencyContext) -> Response {
    match commit_payment(&app, &context, "slow", created(json!({ "paid": "slowly" }))).await {
        Ok(sealed) => sealed.into_response(),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error).into_response(),
    }
}

/// Commits one response, then returns another.
async fn pay_then_answer_otherwise(
    State(app): State<App>,
    context: IdempotencyContext,
) -> Response {
    match commit_payment(&app, &context, "a", created(json!({ "paid": "a" }))).await {
        Ok(_) => (StatusCode::OK, Json(json!({ "something": "else" }))).into_response(),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error).into_response(),
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
        Ok(sealed) => sealed.into_response(),
        // The misuse the layer must survive: a success answered after a failed commit.
        Err(_) => created(json!({ "paid": "not really" })).into_response(),
    }
}

async fn seal_a_500(context: IdempotencyContext) -> Response {
    let failed = (StatusCode::INTERNAL_SERVER_ERROR, "no");
    match http::seal(&context, failed).await {
        Err(SealError::NotStored(why)) => (StatusCode::BAD_GATEWAY, why).into_response(),
        other => panic!("a 500 was sealed: {other:?}"),
    }
}

async fn payments(app: &App) -> i64 {
    let sql = "SELECT count(*) FROM payments";
    sqlx::query_scalar(sql).fetch_one(&app.pool).await.unwrap()
}

async fn record_state(app: &App) -> Option<String> {
    let sql = "SELECT state::text FROM idempotency_records";
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
async fn a_response_the_layer_would_not_store_cannot_be_sealed() {
    let d = TestDatabase::create("txnhttp").await;
    let (app, router) = setup(&d).await;
    let first = send(&router, keyed("POST", "/seal-a-500", "k1", "{}")).await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY);
    assert_eq!(first.body, "the status is not stored");
    // A 502 is not stored either: the key is released.
    assert_eq!(record_state(&app).await, None);
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
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR, "{}", first.body);
    assert!(first.body.contains("did not answer within 300ms"), "{}", first.body);
    // The commit lands after its answer was given up on.
    tokio::time::sleep(std::time::Duration::from_millis(1600)).await;
    assert_eq!(record_state(&app).await.as_deref(), Some("C"));
    assert_eq!(payments(&app).await, 1);
    let retry = send(&router, keyed("POST", "/pay-slowly", "k1", "{}")).await;
    assert_eq!((retry.status, retry.body.as_str()), (StatusCode::CREATED, r#"{"paid":"slowly"}"#));
    assert_eq!(retry.headers["idempotency-replayed"], "true");
    assert_eq!((app.runs.load(Ordering::SeqCst), payments(&app).await), (1, 1));
}
