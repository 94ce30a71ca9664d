//! Recovery from the system of record: a payments service whose side effect and its outcome
//! commit in one PostgreSQL transaction (a transactional outbox), and whose idempotency layer
//! asks that outbox before it runs a request again that another instance may have handled.
//!
//! ```sh
//! cargo run --example outbox                                   # the demo (records in memory)
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example outbox  # the demo, records in Redis
//! cargo run --example outbox -- serve --port 3000              # the service alone
//! cargo run --example outbox -- consume --event evt_1 --amount 100   # one delivery
//! ```
//!
//! The demo starts the service as child processes, kills one with SIGKILL right after its
//! transaction committed (before its response reached the idempotency store), and retries on
//! another: the retry is answered from the outbox, and the payment exists once. Then the same
//! with a kill before the commit: nothing happened, and the retry runs.
//!
//! - `DATABASE_URL`: PostgreSQL (default `postgres://postgres@127.0.0.1:5432/postgres`);
//!   `serve` and `consume` create the tables `payments` and `idempotency_outbox` there when
//!   missing. The demo creates a database of its own on that server instead (its name ends
//!   in the demo's pid), and drops it at the end.
//! - `REDIS_URL`: records in Redis: a retry after the lease takes the dead claim over, and only
//!   a takeover asks the outbox. Without it, records are in memory, which a restart loses: the
//!   outbox is then asked on every claim.
//! - `OUTBOX_LEASE_MS` (default 30000; the demo uses 1000), `OUTBOX_EVERY_CLAIM=1`,
//!   `OUTBOX_RECOVERY_TIMEOUT_MS` (default 5000).
//! - `OUTBOX_PAUSE=before-insert|before-commit|after-commit|after-complete`, `OUTBOX_PAUSE_MS`
//!   (default: forever): the request stops there and says so on stdout, for a crash to be
//!   staged (`after-complete`: its response is stored, and not yet sent).
//!
//! tokio-postgres with deadpool-postgres rather than sqlx: nothing needs a database at build
//! time, the dependency tree is smaller, and it is the pool family the crate uses for Redis.

use std::{io::Write as _, process::Stdio, sync::Arc, time::Duration};

use axum::{
    Router,
    body::Body,
    extract::State,
    http::{HeaderValue, Request, Response, StatusCode, header},
    middleware::Next,
    routing::post,
};
use axum_idempotency::{
    IdempotencyContext, IdempotencyLayer, Idempotent, MemoryStore, RedisStore,
    consumer::Outcome,
    recovery::{BoxError, Lookup, Recovered},
    settings::Recovery,
};
use bytes::Bytes;
use deadpool_postgres::{Manager, Pool};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio_postgres::{NoTls, error::SqlState};

const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg =
        |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    match args.first().map(String::as_str) {
        Some("serve") => {
            let port = arg("--port").unwrap_or_else(|| "3000".into()).parse()?;
            serve(records()?, port).await
        }
        Some("consume") => {
            let event = arg("--event").ok_or("consume needs --event ID")?;
            let amount = arg("--amount").ok_or("consume needs --amount N")?.parse()?;
            consume(records()?, event, amount).await
        }
        Some(other) => Err(format!("unknown command {other:?}: serve, consume, or none").into()),
        None => demo::run().await,
    }
}

/// The store `REDIS_URL` names, or a `MemoryStore`.
fn records() -> Result<Records, BoxError> {
    Ok(match std::env::var("REDIS_URL") {
        Ok(url) => Records::Redis(RedisStore::from_url(&url)?),
        Err(_) => Records::Memory(MemoryStore::new()),
    })
}

/// Where idempotency records live. Memory does not survive the process: with it, every claim
/// asks the outbox.
enum Records {
    Memory(MemoryStore),
    Redis(RedisStore),
}

/// The service's settings, from the environment.
#[derive(Clone)]
struct Settings {
    lease: Duration,
    recovery_timeout: Duration,
    every_claim: bool,
    pause: Option<(String, Option<Duration>)>,
}

impl Settings {
    fn from_env(records: &Records) -> Self {
        let var = |name: &str| std::env::var(name).ok();
        let ms = |value: String| value.parse().map(Duration::from_millis).ok();
        Self {
            lease: var("OUTBOX_LEASE_MS").and_then(ms).unwrap_or(Duration::from_secs(30)),
            recovery_timeout: var("OUTBOX_RECOVERY_TIMEOUT_MS")
                .and_then(ms)
                .unwrap_or(Duration::from_secs(5)),
            every_claim: matches!(records, Records::Memory(_))
                || var("OUTBOX_EVERY_CLAIM").as_deref() == Some("1"),
            pause: var("OUTBOX_PAUSE").map(|point| (point, var("OUTBOX_PAUSE_MS").and_then(ms))),
        }
    }

    /// Stops at `point` when told to: says so on stdout, then waits.
    async fn pause_at(&self, point: &str, key_hash: &str) {
        let Some((at, how_long)) = &self.pause else { return };
        if at != point {
            return;
        }
        println!("paused {point} {key_hash}");
        let _ = std::io::stdout().flush();
        match how_long {
            Some(how_long) => tokio::time::sleep(*how_long).await,
            None => std::future::pending().await,
        }
    }
}

/// A pool over `DATABASE_URL`, with the tables created.
async fn database() -> Result<Pool, BoxError> {
    database_at(&std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.into()))
        .await
}

/// A pool over `url`, with the tables created.
async fn database_at(url: &str) -> Result<Pool, BoxError> {
    let config: tokio_postgres::Config = url.parse()?;
    let pool = Pool::builder(Manager::new(config, NoTls)).max_size(8).build()?;
    let mut client =
        pool.get().await.map_err(|e| format!("cannot use PostgreSQL at {url}: {e}"))?;
    let tx = client.transaction().await?;
    // Instances start side by side: one creates the tables at a time.
    tx.execute("SELECT pg_advisory_xact_lock(7247)", &[]).await?;
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS payments (
             id BIGSERIAL PRIMARY KEY,
             key_hash TEXT NOT NULL UNIQUE,
             amount BIGINT NOT NULL,
             created_at TIMESTAMPTZ NOT NULL DEFAULT now());
         CREATE TABLE IF NOT EXISTS idempotency_outbox (
             key_hash TEXT PRIMARY KEY,
             status SMALLINT NOT NULL,
             body BYTEA NOT NULL,
             created_at TIMESTAMPTZ NOT NULL DEFAULT now());",
    )
    .await?;
    tx.commit().await?;
    Ok(pool)
}

#[derive(Clone)]
struct App {
    db: Pool,
    settings: Arc<Settings>,
}

#[derive(Deserialize)]
struct PaymentRequest {
    amount: i64,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
struct Receipt {
    payment_id: i64,
    amount: i64,
}

/// The side effect and its outcome, in one transaction: the payment row, and the outbox row
/// keyed by the idempotency key's hash. A second run for one key fails on the unique key hash
/// and answers with the first run's outcome.
async fn pay(app: &App, context: &IdempotencyContext, amount: i64) -> Result<Receipt, BoxError> {
    let hash = context.key_hash();
    let mut client = app.db.get().await?;
    let tx = client.transaction().await?;
    app.settings.pause_at("before-insert", hash).await;
    let row = tx
        .query_one(
            "INSERT INTO payments (key_hash, amount) VALUES ($1, $2) RETURNING id",
            &[&hash, &amount],
        )
        .await?;
    let receipt = Receipt { payment_id: row.get(0), amount };
    let body = serde_json::to_vec(&receipt)?;
    tx.execute(
        "INSERT INTO idempotency_outbox (key_hash, status, body) VALUES ($1, 201, $2)",
        &[&hash, &body],
    )
    .await?;
    app.settings.pause_at("before-commit", hash).await;
    tx.commit().await?;
    app.settings.pause_at("after-commit", hash).await;
    Ok(receipt)
}

/// What the outbox holds for `key_hash`: the status and body answered then.
async fn outbox(db: &Pool, key_hash: &str) -> Result<Option<(u16, Vec<u8>)>, BoxError> {
    let client = db.get().await?;
    let sql = "SELECT status, body FROM idempotency_outbox WHERE key_hash = $1";
    let row = client.query_opt(sql, &[&key_hash]).await?;
    Ok(row.map(|row| (u16::try_from(row.get::<_, i16>(0)).unwrap_or(500), row.get(1))))
}

fn json_response(status: u16, body: Vec<u8>) -> Response<Body> {
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

async fn create_payment(
    State(app): State<App>,
    context: IdempotencyContext,
    body: Bytes,
) -> Response<Body> {
    let Ok(request) = serde_json::from_slice::<PaymentRequest>(&body) else {
        return json_response(422, br#"{"error":"the body needs an integer amount"}"#.to_vec());
    };
    match pay(&app, &context, request.amount).await {
        Ok(receipt) => json_response(201, serde_json::to_vec(&receipt).unwrap_or_default()),
        // Another run committed this key first (a holder that was slow, not dead): answer
        // with its outcome, so the client sees one payment whichever run it reached.
        Err(error) if is_unique_violation(&error) => {
            match outbox(&app.db, context.key_hash()).await {
                Ok(Some((status, body))) => json_response(status, body),
                _ => json_response(
                    409,
                    br#"{"error":"this payment was made by another request"}"#.to_vec(),
                ),
            }
        }
        Err(error) => {
            eprintln!("payment failed: {error}");
            json_response(503, br#"{"error":"the payment could not be made; retry"}"#.to_vec())
        }
    }
}

fn is_unique_violation(error: &BoxError) -> bool {
    error
        .downcast_ref::<tokio_postgres::Error>()
        .and_then(tokio_postgres::Error::code)
        .is_some_and(|code| *code == SqlState::UNIQUE_VIOLATION)
}

/// The recovery hook: the outbox row of the request, if its transaction committed.
async fn recover_from_outbox(
    db: Pool,
    lookup: Lookup<Request<Bytes>>,
) -> Result<Recovered<Response<Bytes>>, BoxError> {
    Ok(match outbox(&db, lookup.context.key_hash()).await? {
        Some((status, body)) => Recovered::Happened(
            Response::builder()
                .status(status)
                .header(header::CONTENT_TYPE, "application/json")
                .body(Bytes::from(body))?,
        ),
        None => Recovered::Unknown,
    })
}

async fn serve(records: Records, port: u16) -> Result<(), BoxError> {
    let settings = Arc::new(Settings::from_env(&records));
    let db = database().await?;
    let app = App { db: db.clone(), settings: settings.clone() };
    let routes = Router::new().route("/payments", post(create_payment)).with_state(app);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    println!("listening on {}", listener.local_addr()?);
    let _ = std::io::stdout().flush();
    macro_rules! layered {
        ($store:expr) => {{
            let layer = IdempotencyLayer::new($store)
                .lease(settings.lease)
                .recover(move |lookup| recover_from_outbox(db.clone(), lookup))
                .recovery(
                    Recovery::default()
                        .every_claim(settings.every_claim)
                        .timeout(settings.recovery_timeout),
                );
            // Outside the idempotency layer: the response has been stored when it gets here.
            let after_complete = axum::middleware::from_fn(move |request, next: Next| {
                let settings = settings.clone();
                async move {
                    let response = next.run(request).await;
                    settings.pause_at("after-complete", "-").await;
                    response
                }
            });
            axum::serve(listener, routes.layer(layer).layer(after_complete)).await?
        }};
    }
    match records {
        Records::Memory(store) => layered!(store),
        Records::Redis(store) => layered!(store),
    }
    Ok(())
}

/// One delivery of a payment event through the consumer door; prints its outcome as JSON.
async fn consume(records: Records, event: String, amount: i64) -> Result<(), BoxError> {
    let settings = Arc::new(Settings::from_env(&records));
    let db = database().await?;
    let app = App { db: db.clone(), settings: settings.clone() };
    let payload = format!(r#"{{"amount":{amount}}}"#);
    let hook = move |lookup: Lookup<Bytes>| {
        let db = db.clone();
        async move {
            Ok::<_, BoxError>(match outbox(&db, lookup.context.key_hash()).await? {
                Some((_, body)) => Recovered::Happened(serde_json::from_slice::<Receipt>(&body)?),
                None => Recovered::Unknown,
            })
        }
    };
    let operation = move |context: IdempotencyContext| async move {
        match pay(&app, &context, amount).await {
            // Another run committed this event first (a worker that was slow, not dead): its
            // outcome is this delivery's too, so the event is stored as done. An `Err` here
            // would release the key, and every later delivery would fail the same way.
            Err(error) if is_unique_violation(&error) => {
                match outbox(&app.db, context.key_hash()).await? {
                    Some((_, body)) => Ok(serde_json::from_slice::<Receipt>(&body)?),
                    None => Err(error),
                }
            }
            paid => paid,
        }
    };
    macro_rules! delivered {
        ($store:expr) => {
            Idempotent::new($store)
                .lease(settings.lease)
                .recover(hook)
                .recovery(Recovery::default().every_claim(settings.every_claim))
                .run("payments-consumer", &event, &payload, operation)
                .await
        };
    }
    let outcome = match records {
        Records::Memory(store) => delivered!(store),
        Records::Redis(store) => delivered!(store),
    };
    let line = match outcome {
        Ok(Outcome::Ran(receipt)) => serde_json::json!({ "outcome": "ran", "receipt": receipt }),
        Ok(Outcome::Replayed(receipt)) => {
            serde_json::json!({ "outcome": "replayed", "receipt": receipt })
        }
        Ok(Outcome::InProgress { .. }) => serde_json::json!({ "outcome": "in_progress" }),
        Ok(Outcome::Mismatch) => serde_json::json!({ "outcome": "mismatch" }),
        Err(error) => serde_json::json!({ "outcome": "error", "error": error.to_string() }),
    };
    println!("{line}");
    Ok(())
}

/// The demo: instances of this example as child processes, one of them killed mid-request.
mod demo {
    use super::*;

    /// Runs the demo in a database of its own on the server `DATABASE_URL` names, dropped at
    /// the end: it leaves nothing behind.
    pub(super) async fn run() -> Result<(), BoxError> {
        let admin = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.into());
        let name = format!("axum_idempotency_outbox_demo_{}", std::process::id());
        let (client, connection) = tokio_postgres::connect(&admin, NoTls)
            .await
            .map_err(|e| format!("cannot use PostgreSQL at {admin}: {e}"))?;
        tokio::spawn(connection);
        client.batch_execute(&format!("CREATE DATABASE {name}")).await?;
        let (server, _) = admin.rsplit_once('/').ok_or("DATABASE_URL names no database")?;
        let outcome = show(&format!("{server}/{name}")).await;
        let dropped = client.batch_execute(&format!("DROP DATABASE {name} WITH (FORCE)")).await;
        outcome?;
        Ok(dropped?)
    }

    async fn show(url: &str) -> Result<(), BoxError> {
        let db = database_at(url).await?;
        let records = match std::env::var("REDIS_URL") {
            Ok(url) => {
                format!("Redis at {url} (a retry takes the dead claim over and asks the outbox)")
            }
            Err(_) => "in memory, lost with the process (every claim asks the outbox)".to_owned(),
        };
        println!(
            "records: {records}\ndatabase: PostgreSQL, tables payments and idempotency_outbox in a database of the demo's own, dropped at the end\n"
        );
        let run = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_millis();
        let (committed, uncommitted) = (format!("demo-{run}-a"), format!("demo-{run}-b"));
        let mut rows = Vec::new();

        let survivor = Instance::start(None, url).await?;
        for (key, point) in [(&committed, "after-commit"), (&uncommitted, "before-commit")] {
            let mut doomed = Instance::start(Some(point), url).await?;
            let port = doomed.port;
            let request = tokio::spawn({
                let key = key.clone();
                async move { post(port, &key, r#"{"amount":100}"#).await }
            });
            doomed.wait_for("paused").await?;
            doomed.child.kill().await?; // SIGKILL
            let _ = request.await;
            let payments = payments_for(&db, key).await?;
            rows.push((
                key.clone(),
                format!("instance A, killed {point}"),
                "no answer".to_owned(),
                payments,
            ));
            // Past the lease, so that a claim in Redis has lapsed and is taken over.
            tokio::time::sleep(Duration::from_millis(1200)).await;
            for attempt in ["retry", "retry again"] {
                let (status, replayed, body) =
                    post(survivor.port, key, r#"{"amount":100}"#).await?;
                let how = if replayed { "replayed" } else { "ran" };
                let answer = format!("{status} {how} {body}");
                let payments = payments_for(&db, key).await?;
                rows.push((key.clone(), format!("instance B, {attempt}"), answer, payments));
            }
        }
        println!(
            "| key            | request                          | answer                                          | payments |"
        );
        println!(
            "|----------------|----------------------------------|-------------------------------------------------|---------:|"
        );
        for (key, request, answer, payments) in rows {
            let key = key.rsplit('-').next().unwrap_or_default();
            println!("| {key:<14} | {request:<32} | {answer:<47} | {payments:>8} |");
        }
        println!(
            "\na: the payment committed, the process died before the idempotency store heard of it;"
        );
        println!("   the retry is answered from the outbox and the handler does not run again.");
        println!(
            "b: the process died before the commit: nothing happened, and the retry runs once."
        );
        Ok(())
    }

    async fn payments_for(db: &Pool, key: &str) -> Result<i64, BoxError> {
        let hash = axum_idempotency::store::RecordKey::new("idempotency", b"", key.as_bytes());
        let client = db.get().await?;
        let row = client
            .query_one("SELECT count(*) FROM payments WHERE key_hash = $1", &[&hash.hash()])
            .await?;
        Ok(row.get(0))
    }

    struct Instance {
        child: tokio::process::Child,
        lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
        port: u16,
    }

    impl Instance {
        async fn start(pause: Option<&str>, database_url: &str) -> Result<Self, BoxError> {
            let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
            let mut command = tokio::process::Command::new(std::env::current_exe()?);
            command
                .args(["serve", "--port", &port.to_string()])
                .env("OUTBOX_LEASE_MS", "1000")
                .env("DATABASE_URL", database_url)
                .env_remove("OUTBOX_PAUSE")
                .stdout(Stdio::piped())
                .kill_on_drop(true);
            if let Some(point) = pause {
                command.env("OUTBOX_PAUSE", point);
            }
            let mut child = command.spawn()?;
            let stdout = child.stdout.take().ok_or("no stdout")?;
            let mut instance = Self { child, lines: BufReader::new(stdout).lines(), port };
            instance.wait_for("listening").await?;
            Ok(instance)
        }

        async fn wait_for(&mut self, prefix: &str) -> Result<(), BoxError> {
            let wait = tokio::time::timeout(Duration::from_secs(30), async {
                while let Some(line) = self.lines.next_line().await? {
                    if line.starts_with(prefix) {
                        return Ok(());
                    }
                }
                Err::<(), BoxError>(format!("the instance exited before saying {prefix:?}").into())
            });
            wait.await.map_err(|_| format!("no {prefix:?} from the instance within 30 s"))?
        }
    }

    /// POSTs `body` with `key` to the instance on `port`: status, replayed, body.
    async fn post(
        port: u16,
        key: &str,
        body: &'static str,
    ) -> Result<(u16, bool, String), BoxError> {
        use http_body_util::BodyExt as _;
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<Body>();
        let request = Request::post(format!("http://127.0.0.1:{port}/payments"))
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(Body::from(body))?;
        let response = client.request(request).await?;
        let status = response.status().as_u16();
        let replayed = response.headers().get("idempotency-replayed").is_some();
        let body = response.into_body().collect().await?.to_bytes();
        Ok((status, replayed, String::from_utf8_lossy(&body).into_owned()))
    }
}
