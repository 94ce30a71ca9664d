//! The durable authority: a payments service whose idempotency record commits with its payment
//! in one PostgreSQL transaction (`PostgresStore::transaction`, which begins the transaction,
//! hands it to the handler's closure, writes the response fenced by the claim and commits): no
//! outbox table, no recovery hook. A process killed anywhere leaves either the committed
//! response, which every retry replays, or nothing, which the retry runs once.
//!
//! ```sh
//! cargo run --example ledger --features postgres                  # the service, port 3000
//! cargo run --example ledger --features postgres -- serve --port 3001
//! curl -si localhost:3000/payments -H 'idempotency-key: k1' -d '{"amount":100}'
//! cargo run --example ledger --features postgres -- consume --event evt_1 --amount 100
//! ```
//!
//! `consume` is one delivery of a payment event through the consumer door, written the same
//! way (the same `transaction`, returning `Json(value)`); it prints `ran {…}` or
//! `replayed {…}`.
//!
//! `POST /orders` is an order with checkpoints (`Checkpoints`): the order row, then the
//! provider's charge, each a step marked done in its own transaction, then the charge recorded
//! on the order with the response. The same request run again (a takeover, or a retry after a
//! failure) resumes after the last step that committed; another payload under the key is
//! answered 409 (`layer::KeyReused`), never another request's steps.
//!
//! Each payment calls a payment provider first, with a key derived from the request's
//! (`IdempotencyContext::derived_key`): a run after a crash calls it again with the same key, and
//! the provider charges once.
//!
//! - `DATABASE_URL`: PostgreSQL (default `postgres://postgres@127.0.0.1:5432/postgres`); the
//!   tables `idempotency_records`, `idempotency_steps`, `ledger_payments` and `ledger_orders`
//!   are created there when missing.
//! - `REDIS_URL`: Redis in front, PostgreSQL the authority: the claims and the replays in
//!   Redis, the outcome committed with the payment to the crate's table
//!   `idempotency_outcomes` (`DurableOutcomes`), which answers a takeover, a lapsed lease or a
//!   record Redis lost (`IdempotencyLayer::durable`, `Idempotent::durable`).
//! - `PROVIDER_URL`: the payment provider (`POST {url}/charges` with an `idempotency-key`,
//!   answering `{"charge":"…"}`); without it, a fake one in this process.
//! - `LEDGER_LEASE_MS` (default 30000).
//! - `LEDGER_PAUSE=before-claim|after-claim|after-call|before-commit|after-commit|after-store`
//!   (and, for `/orders`, `after-order|after-charge`, after each step committed):
//!   the request (or delivery) stops there, says `paused <point>` on stdout, and waits, for a
//!   crash to be staged: before the door saw it; in the operation, before anything; after the
//!   provider's charge, before its row; after the row, before the commit; after the commit,
//!   before the operation returned; after the door settled, before the response was sent (the
//!   delivery's outcome printed).

use std::{
    collections::HashMap,
    io::Write as _,
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{
    Json, Router,
    body::Body,
    extract::{Request, State},
    http::{HeaderMap, StatusCode},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::post,
};
use axum_idempotency::{
    IdempotencyContext, IdempotencyLayer, Idempotent, RedisStore,
    consumer::Outcome,
    durable::{Checkpoints, DurableOutcomes},
    layer::KeyReused,
    recovery::{BoxError, Recover},
    store::{
        Committable, PostgresStore, Store, StoreError, TransactionError,
        sqlx::{self, PgConnection, PgPool},
    },
};
use bytes::Bytes;
use futures_util::future::BoxFuture;
use http_body_util::BodyExt as _;
use serde::Deserialize;
use serde_json::{Value, json};

const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

const PAYMENTS: &str = "CREATE TABLE IF NOT EXISTS ledger_payments (
    id BIGSERIAL PRIMARY KEY, amount BIGINT NOT NULL, charge TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS ledger_orders (
    id BIGSERIAL PRIMARY KEY, amount BIGINT NOT NULL, charge TEXT)";

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg =
        |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let command = args.first().map_or("serve", String::as_str);
    if !["serve", "consume"].contains(&command) {
        return Err(format!("unknown command {command:?}: serve, consume, or none").into());
    }
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.into());
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(8).connect(&url).await?;
    sqlx::raw_sql(PAYMENTS).execute(&pool).await?;
    let steps = Checkpoints::new(pool.clone());
    steps.migrate().await?;
    let records = match std::env::var("REDIS_URL") {
        Ok(url) => {
            let outcomes = DurableOutcomes::new(pool.clone());
            outcomes.migrate().await?;
            Records::Redis(RedisStore::from_url(&url)?, outcomes)
        }
        Err(_) => {
            let store = PostgresStore::new(pool.clone());
            store.migrate().await?;
            Records::Postgres(store)
        }
    };
    let provider = match std::env::var("PROVIDER_URL") {
        Ok(url) => url,
        Err(_) => fake_provider().await?,
    };
    let var = |name: &str| std::env::var(name).ok();
    let lease = var("LEDGER_LEASE_MS").and_then(|ms| ms.parse().ok()).unwrap_or(30_000);
    let pause = Pause(var("LEDGER_PAUSE"));
    let lease = Duration::from_millis(lease);
    let ledger = Ledger { pool, records: records.clone(), steps, provider, pause };
    if command == "consume" {
        let event = arg("--event").ok_or("consume needs --event ID")?;
        let amount = arg("--amount").ok_or("consume needs --amount N")?.parse()?;
        return match records {
            Records::Postgres(store) => {
                consume(Idempotent::new(store).lease(lease), ledger, event, amount).await
            }
            Records::Redis(redis, outcomes) => {
                let idem = Idempotent::new(redis).lease(lease).recover(outcomes);
                consume(idem, ledger, event, amount).await
            }
        };
    }
    let port = arg("--port").map_or(Ok(3000), |port| port.parse())?;
    let app = app(ledger, lease);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    println!("listening on {}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}

#[derive(Clone)]
struct Ledger {
    pool: PgPool,
    records: Records,
    /// The steps `/orders` marked done.
    steps: Checkpoints,
    provider: String,
    pause: Pause,
}

/// Where the idempotency records live, and where an outcome commits with its payment.
#[derive(Clone)]
enum Records {
    /// PostgreSQL alone: the record is the store's own row, committed in the transaction.
    Postgres(PostgresStore),
    /// Redis for the claims and the replays, the outcome committed in the transaction to the
    /// crate's table beside it.
    Redis(RedisStore, DurableOutcomes),
}

impl Records {
    /// Runs `operation` in the authority's transaction, with its outcome committed in it: the
    /// payment and its outcome, or neither.
    async fn transaction<O, F>(
        &self,
        context: &IdempotencyContext,
        operation: F,
    ) -> Result<O, TransactionError<BoxError>>
    where
        O: Committable,
        F: for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, Result<O, BoxError>> + Send,
    {
        match self {
            Self::Postgres(store) => store.transaction(context, operation).await,
            Self::Redis(_, outcomes) => outcomes.transaction(context, operation).await,
        }
    }
}

fn app(ledger: Ledger, lease: Duration) -> Router {
    let pause = ledger.pause.clone();
    let router = Router::new()
        .route("/payments", post(pay))
        .route("/orders", post(order))
        .with_state(ledger.clone());
    let router = match ledger.records {
        Records::Postgres(store) => router.layer(IdempotencyLayer::new(store).lease(lease)),
        Records::Redis(redis, outcomes) => {
            router.layer(IdempotencyLayer::new(redis).lease(lease).recover(outcomes))
        }
    };
    router
        // Outside the layer: before it sees the request, and after it settled the response.
        .layer(middleware::from_fn(move |request: Request, next: Next| {
            let pause = pause.clone();
            async move {
                pause.at("before-claim").await;
                let response = next.run(request).await;
                pause.at("after-store").await;
                response
            }
        }))
}

#[derive(Deserialize)]
struct Payment {
    amount: i64,
}

/// The handler written the crate's way: the provider's charge, then the payment row and its
/// response, committed together in the store's transaction.
async fn pay(
    context: IdempotencyContext,
    State(ledger): State<Ledger>,
    Json(payment): Json<Payment>,
) -> Result<Response, Failure> {
    let charge = ledger.charge(&context, payment.amount).await?;
    let pause = ledger.pause.clone();
    let response = ledger
        .records
        .transaction(&context, move |tx| {
            Box::pin(async move {
                let body = record_payment(tx, &pause, payment.amount, charge).await?;
                Ok((StatusCode::CREATED, Json(body)).into_response())
            })
        })
        .await?;
    ledger.pause.at("after-commit").await;
    Ok(response)
}

/// An order with checkpoints: the order row (a step), the provider's charge (a step),
/// then the charge recorded on the order with the response. The same request run again after
/// a crash or a failure skips the steps that committed, with their results, and runs the
/// rest; another payload under the key is refused (`KeyReused`).
async fn order(
    context: IdempotencyContext,
    State(ledger): State<Ledger>,
    Json(payment): Json<Payment>,
) -> Result<Response, Failure> {
    let steps = &ledger.steps;
    let order: i64 = match steps.done(&context, "order").await? {
        Some(order) => order,
        None => {
            let mut tx = ledger.pool.begin().await?;
            let sql = "INSERT INTO ledger_orders (amount) VALUES ($1) RETURNING id";
            let order: i64 =
                sqlx::query_scalar(sql).bind(payment.amount).fetch_one(&mut *tx).await?;
            steps.mark(&mut tx, &context, "order", &order).await?;
            tx.commit().await?;
            order
        }
    };
    ledger.pause.at("after-order").await;
    let charge: String = match steps.done(&context, "charge").await? {
        Some(charge) => charge,
        None => {
            let key =
                context.derived_key("order-charge").ok_or("a context without derived keys")?;
            let charge = charge(&ledger.provider, &key, payment.amount).await?;
            let mut tx = ledger.pool.begin().await?;
            steps.mark(&mut tx, &context, "charge", &charge).await?;
            tx.commit().await?;
            charge
        }
    };
    ledger.pause.at("after-charge").await;
    let response = ledger
        .records
        .transaction(&context, move |tx| {
            Box::pin(async move {
                let sql = "UPDATE ledger_orders SET charge = $2 WHERE id = $1";
                sqlx::query(sql).bind(order).bind(&charge).execute(&mut *tx).await?;
                let body = json!({ "order": order, "charge": charge, "amount": payment.amount });
                Ok((StatusCode::CREATED, Json(body)).into_response())
            })
        })
        .await?;
    Ok(response)
}

/// One delivery of a payment event through the consumer door, written the same way.
async fn consume<St: Store, H: Recover<Bytes, Value>>(
    idem: Idempotent<St, H>,
    ledger: Ledger,
    event: String,
    amount: i64,
) -> Result<(), BoxError> {
    ledger.pause.at("before-claim").await;
    let payload = json!({ "amount": amount }).to_string();
    let pause = ledger.pause.clone();
    let outcome = idem
        .run("payments", event, payload, move |context| async move {
            let charge = ledger.charge(&context, amount).await?;
            let pause = ledger.pause.clone();
            let paid = ledger.records.transaction(&context, move |tx| {
                Box::pin(async move { Ok(Json(record_payment(tx, &pause, amount, charge).await?)) })
            });
            let Json(body) = paid.await?;
            ledger.pause.at("after-commit").await;
            Ok::<_, BoxError>(body)
        })
        .await
        .map_err(|error| error.to_string())?;
    pause.at("after-store").await;
    match outcome {
        Outcome::Ran(body) => println!("ran {body}"),
        Outcome::Replayed(body) => println!("replayed {body}"),
        other => println!("{other:?}"),
    }
    Ok(())
}

impl Ledger {
    /// The provider's charge under a key derived from the request's.
    async fn charge(&self, context: &IdempotencyContext, amount: i64) -> Result<String, BoxError> {
        self.pause.at("after-claim").await;
        let key = context.derived_key("charge").ok_or("a context without derived keys")?;
        let charge = charge(&self.provider, &key, amount).await?;
        self.pause.at("after-call").await;
        Ok(charge)
    }
}

/// The payment row, in the store's transaction: the body to answer.
async fn record_payment(
    tx: &mut PgConnection,
    pause: &Pause,
    amount: i64,
    charge: String,
) -> Result<Value, BoxError> {
    let sql = "INSERT INTO ledger_payments (amount, charge) VALUES ($1, $2) RETURNING id";
    let id: i64 = sqlx::query_scalar(sql).bind(amount).bind(&charge).fetch_one(&mut *tx).await?;
    pause.at("before-commit").await;
    Ok(json!({ "payment": id, "charge": charge, "amount": amount }))
}

/// Charges `amount` at the provider under `key`, its own idempotency key.
async fn charge(provider: &str, key: &str, amount: i64) -> Result<String, BoxError> {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Body>();
    let request = axum::http::Request::post(format!("{provider}/charges"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(json!({ "amount": amount }).to_string()))?;
    let response = client.request(request).await?;
    let body: Value = serde_json::from_slice(&response.into_body().collect().await?.to_bytes())?;
    Ok(body["charge"].as_str().ok_or("the provider answered no charge")?.to_owned())
}

/// A provider that charges once per idempotency key, in this process.
async fn fake_provider() -> Result<String, BoxError> {
    let charges: Arc<Mutex<HashMap<String, String>>> = Arc::default();
    let app = Router::new().route(
        "/charges",
        post(move |headers: HeaderMap| async move {
            let key = headers.get("idempotency-key").and_then(|v| v.to_str().ok());
            let key = key.unwrap_or_default().to_owned();
            let mut charges = charges.lock().unwrap();
            let next = format!("ch_{}", charges.len() + 1);
            Json(json!({ "charge": charges.entry(key).or_insert(next) }))
        }),
    );
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(url)
}

/// Where a request stops, when `LEDGER_PAUSE` names a point.
#[derive(Clone)]
struct Pause(Option<String>);

impl Pause {
    async fn at(&self, point: &str) {
        if self.0.as_deref() == Some(point) {
            println!("paused {point}");
            let _ = std::io::stdout().flush();
            std::future::pending::<()>().await;
        }
    }
}

/// Any failure of the handler: a 500, which the layer does not store (the key is released).
struct Failure(BoxError);

impl<E: Into<BoxError>> From<E> for Failure {
    fn from(error: E) -> Self {
        Self(error.into())
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        eprintln!("payment failed: {}", self.0);
        if matches!(self.0.downcast_ref(), Some(StoreError::KeyReused)) {
            // The key's steps are another request's: the layer's mismatch answer.
            return KeyReused.into_response();
        }
        match self.0.downcast::<TransactionError<BoxError>>() {
            // A commit whose answer was lost: 503 + Retry-After, the retry learns the outcome.
            Ok(failed) if failed.may_have_committed() => failed.into_response(),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "payment failed\n").into_response(),
        }
    }
}
