//! The system under test: a payments service (the HTTP door) and a payments worker (the
//! consumer door), each a process of this example, over one idempotency store.
//!
//! The side effect is a row per execution in PostgreSQL, with no unique constraint, so a double
//! run is visible to the checker: nothing but the crate keeps a key from running twice. The row
//! is also the outcome: the recovery hook reads it, and the receipt (the answer) is rebuilt from
//! it byte for byte.

use std::{net::SocketAddr, time::Duration};

use axum::{
    Json, Router,
    body::Body,
    extract::State,
    http::{Request, Response, StatusCode, header},
    routing::post,
};
use axum_idempotency::{
    IdempotencyContext, IdempotencyLayer, Idempotent, RedisStore,
    consumer::{Error, Outcome},
    recovery::{BoxError, Lookup, Recovered},
    settings::Recovery,
    store::{
        Committable, PostgresStore, Store,
        sqlx::{self, postgres::PgPoolOptions},
    },
};
use bytes::Bytes;
use deadpool_postgres::{Manager, Pool};
use serde::{Deserialize, Serialize};
use tokio_postgres::NoTls;

use crate::unfenced::Unfenced;

/// How long a claim holds its key without renewal. Short, so that a dead holder's keys are
/// taken over within the run; the keep-alive renews it every second. Long enough for the
/// nemesis's store outages (`store-down`, up to the lease less 1.2 s) to be shorter than the
/// lease less a renewal period.
pub(crate) const LEASE: Duration = Duration::from_secs(4);

/// The schema of the system of record: one row per execution of the side effect.
pub(crate) const SCHEMA: &str = "CREATE TABLE executions (
    id BIGSERIAL PRIMARY KEY,
    door TEXT NOT NULL,
    key TEXT NOT NULL,
    key_hash TEXT NOT NULL,
    amount BIGINT NOT NULL,
    process TEXT NOT NULL,
    started_ms BIGINT NOT NULL,
    written_ms BIGINT NOT NULL);
CREATE INDEX executions_key_hash ON executions (key_hash);";

/// A request (HTTP body) or an event (the consumer's payload).
#[derive(Serialize, Deserialize, Clone, Debug)]
pub(crate) struct Payment {
    pub(crate) key: String,
    pub(crate) amount: i64,
}

/// The answer: rebuilt from the execution's row, so the original and a recovery are the same
/// bytes.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub(crate) struct Receipt {
    pub(crate) payment: i64,
    pub(crate) key: String,
    pub(crate) amount: i64,
}

/// What a worker answers the broker: `ran` or `replayed`, and the receipt.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub(crate) struct Delivered {
    pub(crate) outcome: String,
    pub(crate) receipt: Receipt,
}

/// Milliseconds since the epoch: the clock the runner's history and the rows share.
pub(crate) fn now_ms() -> i64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    since.map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

#[derive(Clone)]
struct App {
    db: Pool,
    door: &'static str,
    process: String,
    /// Over `PostgresStore`: the store whose transaction the row and the outcome commit in,
    /// the crate's one transactional way (`PostgresStore::transaction`).
    records: Option<PostgresStore>,
}

/// The row of an execution, in `tx` (the store's transaction) or committed on its own.
const INSERT: &str =
    "INSERT INTO executions (door, key, key_hash, amount, process, started_ms, written_ms)
     VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING id";

impl App {
    /// The side effect: a call to the payment provider (20 to 150 ms), then the row, in one
    /// transaction: the store's, with the outcome `committed` makes of the receipt, over
    /// `PostgresStore`; the system of record's own otherwise.
    async fn pay<O: Committable>(
        &self,
        context: &IdempotencyContext,
        payment: &Payment,
        committed: fn(&Receipt) -> O,
    ) -> Result<Receipt, BoxError> {
        let started = now_ms();
        let provider = Duration::from_millis(20 + rand::random::<u64>() % 130);
        let (key, amount) = (payment.key.clone(), payment.amount);
        if let Some(records) = &self.records {
            let (door, process) = (self.door, self.process.clone());
            let key_hash = context.key_hash().to_owned();
            let written = std::sync::Arc::new(std::sync::Mutex::new(None));
            let receipt = written.clone();
            let paid = records.transaction(context, move |tx| {
                Box::pin(async move {
                    tokio::time::sleep(provider).await;
                    let id: i64 = sqlx::query_scalar(INSERT)
                        .bind(door)
                        .bind(&key)
                        .bind(&key_hash)
                        .bind(amount)
                        .bind(&process)
                        .bind(started)
                        .bind(now_ms())
                        .fetch_one(&mut *tx)
                        .await?;
                    let receipt = Receipt { payment: id, key, amount };
                    let outcome = committed(&receipt);
                    *written.lock().unwrap() = Some(receipt);
                    Ok::<_, sqlx::Error>(outcome)
                })
            });
            paid.await?;
            return Ok(receipt.lock().unwrap().take().ok_or("no receipt")?);
        }
        let mut client = self.db.get().await?;
        let tx = client.transaction().await?;
        tokio::time::sleep(provider).await;
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 7] =
            [&self.door, &key, &context.key_hash(), &amount, &self.process, &started, &now_ms()];
        let row = tx.query_one(INSERT, &params).await?;
        tx.commit().await?;
        Ok(Receipt { payment: row.get(0), key, amount })
    }

    /// The recovery hook's question: the first execution committed for `key_hash`, if any.
    async fn executed(&self, key_hash: &str) -> Result<Option<Receipt>, BoxError> {
        let client = self.db.get().await?;
        let sql = "SELECT id, key, amount FROM executions WHERE key_hash = $1 ORDER BY id LIMIT 1";
        let row = client.query_opt(sql, &[&key_hash]).await?;
        Ok(row.map(|row| Receipt { payment: row.get(0), key: row.get(1), amount: row.get(2) }))
    }
}

fn receipt_response(receipt: &Receipt) -> Response<Bytes> {
    let body = serde_json::to_vec(receipt).unwrap_or_default();
    let mut response = Response::new(Bytes::from(body));
    *response.status_mut() = StatusCode::CREATED;
    response.headers_mut().insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
    response
}

/// Serves `door` (`http` or `consumer`) on `port` until killed, over the store the runner
/// names in `CHAOS_STORE`: `redis://…`, `cluster:url,url,…`, or `postgres://…`.
pub(crate) async fn serve(door: &str, port: u16) -> Result<(), BoxError> {
    let spec = std::env::var("CHAOS_STORE").map_err(|_| "CHAOS_STORE is not set")?;
    if spec.starts_with("postgres://") {
        let pool = PgPoolOptions::new().test_before_acquire(false).connect_lazy(&spec)?;
        let store = PostgresStore::new(pool);
        // Every instance migrates as it starts, side by side, and waits out a store that is
        // down as it starts (a restart during the nemesis's `store-down`), as a supervisor's
        // restarts would.
        let started = std::time::Instant::now();
        while let Err(error) = store.migrate().await {
            if started.elapsed() > Duration::from_secs(30) {
                return Err(error.into());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        serve_over(store.clone(), door, port, Some(store)).await
    } else {
        let store = match spec.strip_prefix("cluster:") {
            Some(urls) => RedisStore::cluster_from_urls(urls.split(','))?,
            None => RedisStore::from_url(&spec)?,
        };
        match std::env::var("CHAOS_UNFENCED").is_ok_and(|v| v == "1") {
            true => serve_over(Unfenced(store), door, port, None).await,
            false => serve_over(store, door, port, None).await,
        }
    }
}

async fn serve_over<St: Store>(
    store: St,
    door: &str,
    port: u16,
    records: Option<PostgresStore>,
) -> Result<(), BoxError> {
    let var = |name: &str| std::env::var(name).map_err(|_| format!("{name} is not set"));
    let config: tokio_postgres::Config = var("CHAOS_DATABASE_URL")?.parse()?;
    let db = Pool::builder(Manager::new(config, NoTls))
        .max_size(16)
        .wait_timeout(Some(Duration::from_secs(5)))
        .runtime(deadpool_postgres::Runtime::Tokio1)
        .build()?;
    let process = var("CHAOS_PROCESS")?;
    let every_claim = std::env::var("CHAOS_EVERY_CLAIM").is_ok_and(|v| v == "1");
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port))).await?;
    let router = match door {
        "http" => {
            let app = App { db, door: "http", process, records };
            let hook_app = app.clone();
            let layer = IdempotencyLayer::new(store)
                .lease(LEASE)
                .recover(move |lookup: Lookup<Request<Bytes>>| {
                    let app = hook_app.clone();
                    async move {
                        Ok::<_, BoxError>(match app.executed(lookup.context.key_hash()).await? {
                            Some(receipt) => Recovered::Happened(receipt_response(&receipt)),
                            None => Recovered::Unknown,
                        })
                    }
                })
                .recovery(Recovery::default().every_claim(every_claim));
            Router::new().route("/payments", post(create_payment)).with_state(app).layer(layer)
        }
        "consumer" => {
            let app = App { db, door: "consumer", process, records };
            let hook_app = app.clone();
            let idempotent = Idempotent::new(store)
                .lease(LEASE)
                .recover(move |lookup: Lookup<Bytes>| {
                    let app = hook_app.clone();
                    async move {
                        Ok::<_, BoxError>(match app.executed(lookup.context.key_hash()).await? {
                            Some(receipt) => Recovered::Happened(receipt),
                            None => Recovered::Unknown,
                        })
                    }
                })
                .recovery(Recovery::default().every_claim(every_claim));
            Router::new().route("/deliver", post(deliver)).with_state((app, idempotent))
        }
        other => return Err(format!("unknown door {other:?}: http or consumer").into()),
    };
    // The runner holds the other end of stdin: when it is gone, so is this process.
    tokio::spawn(async {
        let mut stdin = tokio::io::stdin();
        let mut byte = [0u8; 1];
        while matches!(tokio::io::AsyncReadExt::read(&mut stdin, &mut byte).await, Ok(1..)) {}
        std::process::exit(0);
    });
    println!("listening on {}", listener.local_addr()?);
    axum::serve(listener, router).await?;
    Ok(())
}

async fn create_payment(
    State(app): State<App>,
    context: IdempotencyContext,
    Json(payment): Json<Payment>,
) -> Response<Body> {
    let committed = |receipt: &Receipt| receipt_response(receipt).map(Body::from);
    match app.pay(&context, &payment, committed).await {
        Ok(receipt) => receipt_response(&receipt).map(Body::from),
        Err(error) => {
            eprintln!("payment failed: {error}");
            Response::builder().status(503).body(Body::from("payment failed")).unwrap()
        }
    }
}

type Worker<St, H> = (App, Idempotent<St, H>);

async fn deliver<St: Store, H>(
    State((app, idempotent)): State<Worker<St, H>>,
    body: Bytes,
) -> Response<Body>
where
    H: axum_idempotency::recovery::Recover<Bytes, Receipt> + Clone,
{
    let Ok(payment) = serde_json::from_slice::<Payment>(&body) else {
        return Response::builder().status(400).body(Body::from("not a payment")).unwrap();
    };
    let key = payment.key.clone();
    let operation = move |context: IdempotencyContext| async move {
        app.pay(&context, &payment, |receipt| Json(receipt.clone())).await
    };
    let (status, outcome) = match idempotent.run("payments", &key, &body, operation).await {
        Ok(Outcome::Ran(receipt)) => (200, Some(("ran", receipt))),
        Ok(Outcome::Replayed(receipt)) => (200, Some(("replayed", receipt))),
        Ok(Outcome::InProgress { .. }) => (202, None),
        Ok(Outcome::Mismatch) => (409, None),
        Err(Error::Store(_) | Error::Recovery | Error::Operation(_)) => (503, None),
        Err(error) => {
            eprintln!("delivery of {key} failed: {error}");
            (500, None)
        }
    };
    let body = match outcome {
        Some((outcome, receipt)) => {
            serde_json::to_vec(&Delivered { outcome: outcome.to_owned(), receipt })
                .unwrap_or_default()
        }
        None => Vec::new(),
    };
    Response::builder().status(status).body(Body::from(body)).unwrap()
}
