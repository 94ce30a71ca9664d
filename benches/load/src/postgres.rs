//! `load postgres`: `PostgresStore` against the PostgreSQL floor, side by side in one run, on
//! a database of the run's own (dropped at the end) on the server `DATABASE_URL` names; then
//! the bytes a completed row takes, and claim latency with and without a sweep of a million
//! expired rows running beside it.
//!
//! The floor is the fewest statements any PostgreSQL-backed layer needs, over the same kind
//! of pool: one upsert to claim and one update to complete a fresh key, one select to replay.
//!
//! `load postgres transactional`: the cost of the record committed with the side effect. A
//! handler that writes its payment row in a transaction (`pg-row`, no idempotency) against the
//! same handler under the layer over `PostgresStore`, its response committed (`transaction`) in
//! that transaction (`pg-txn`), fresh keys, side by side in one run.

use std::{
    io::{BufRead, BufReader},
    process::Stdio,
    time::{Duration, Instant},
};

use axum::{
    Router,
    body::Body,
    extract::State,
    http::{HeaderMap, Request},
    response::Response,
    routing::post,
};
use axum_idempotency::{
    IdempotencyContext, IdempotencyLayer,
    store::{
        PostgresStore,
        sqlx::{self, PgPool, postgres::PgPoolOptions},
    },
};
use bytes::Bytes;

use crate::{
    ChildGuard, Error, REQUEST_BODY, bare, free_port, handler, tower_service_shim::oneshot,
};

/// A pool as `PostgresStore`'s docs advise: no ping before each checkout.
fn pool(url: &str) -> Result<PgPool, Error> {
    Ok(PgPoolOptions::new().max_connections(16).test_before_acquire(false).connect_lazy(url)?)
}

/// The targets' routers: `postgres` (the layer over `PostgresStore`) and `pg-floor`; `pg-row`
/// (a payment row per request, no idempotency) and `pg-txn` (the same, its response committed
/// with the row).
pub(crate) async fn app(target: &str, url: &str) -> Result<Router, Error> {
    Ok(match target {
        "pg-row" | "pg-txn" | "pg-split" => {
            let pool = pool(url)?;
            let payments = "CREATE TABLE IF NOT EXISTS payments (id BIGSERIAL PRIMARY KEY, body BYTEA NOT NULL)";
            sqlx::raw_sql(payments).execute(&pool).await?;
            let store = PostgresStore::new(pool.clone());
            store.migrate().await?;
            let sealed = target == "pg-txn";
            let router = Router::new().route("/pay", post(payment)).with_state((
                pool,
                store.clone(),
                sealed,
            ));
            match target {
                "pg-row" => router,
                _ => router.layer(IdempotencyLayer::new(store)),
            }
        }
        "postgres" => {
            let store = PostgresStore::new(pool(url)?);
            store.migrate().await?;
            bare().layer(IdempotencyLayer::new(store))
        }
        "pg-floor" => {
            let pool = pool(url)?;
            sqlx::raw_sql(
                "CREATE TABLE IF NOT EXISTS floor (key TEXT PRIMARY KEY, state \"char\" NOT NULL, \
                 response BYTEA)",
            )
            .execute(&pool)
            .await?;
            Router::new().route("/pay", post(floor_handler)).with_state(pool)
        }
        other => return Err(format!("unknown target {other}").into()),
    })
}

async fn floor_handler(State(pool): State<PgPool>, headers: HeaderMap, body: Bytes) -> Response {
    let Some(key) = headers.get("idempotency-key").and_then(|k| k.to_str().ok()) else {
        return handler(body).await;
    };
    if key.starts_with("replay-key") {
        let stored: Option<(Option<Vec<u8>>,)> =
            sqlx::query_as("SELECT response FROM floor WHERE key = $1")
                .bind(key)
                .fetch_optional(&pool)
                .await
                .expect("select");
        if stored.is_some_and(|(response,)| response.is_some()) {
            return handler(body).await;
        }
    }
    sqlx::query(
        "INSERT INTO floor (key, state) VALUES ($1, 'P') ON CONFLICT (key) DO UPDATE SET state = 'P'",
    )
    .bind(key)
    .execute(&pool)
    .await
    .expect("upsert");
    let response = handler(body).await;
    sqlx::query("UPDATE floor SET state = 'C', response = $2 WHERE key = $1")
        .bind(key)
        .bind(&b"the response, as a layer would encode it"[..])
        .execute(&pool)
        .await
        .expect("update");
    response
}

/// A payment row and the trivial handler's response in one transaction; when `sealed` (and
/// under the layer), the store's transaction, with the response committed with the row.
async fn payment(
    State((pool, store, sealed)): State<(PgPool, PostgresStore, bool)>,
    context: Option<IdempotencyContext>,
    body: Bytes,
) -> Response {
    if let Some(context) = context.filter(|_| sealed) {
        let paid = store.transaction(&context, |tx| {
            Box::pin(async move {
                sqlx::query("INSERT INTO payments (body) VALUES ($1)")
                    .bind(&body[..])
                    .execute(&mut *tx)
                    .await?;
                Ok::<_, sqlx::Error>(handler(body).await)
            })
        });
        return paid.await.expect("transaction");
    }
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query("INSERT INTO payments (body) VALUES ($1)")
        .bind(&body[..])
        .execute(&mut *tx)
        .await
        .expect("insert");
    let response = handler(body).await;
    tx.commit().await.expect("commit");
    response
}

/// A database of the run's own; dropped with this.
struct Database {
    admin: String,
    name: String,
    url: String,
}

impl Database {
    async fn create() -> Result<Self, Error> {
        let admin = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
        let name = format!("axum_idempotency_bench_{}", std::process::id());
        let pool = PgPool::connect(&admin).await.map_err(|e| {
            format!("the benchmark needs PostgreSQL at DATABASE_URL ({admin}): {e}")
        })?;
        sqlx::raw_sql(&format!("CREATE DATABASE {name}")).execute(&pool).await?;
        let (base, _) = admin.rsplit_once('/').ok_or("DATABASE_URL has no database")?;
        Ok(Self { url: format!("{base}/{name}"), admin, name })
    }

    async fn drop_now(&self) -> Result<(), Error> {
        let pool = PgPool::connect(&self.admin).await?;
        sqlx::raw_sql(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name))
            .execute(&pool)
            .await?;
        Ok(())
    }
}

/// One measured load: 2xx/s, p99 in µs.
async fn drive(
    exe: &std::path::Path,
    port: u16,
    scenario: &str,
    connections: usize,
    seconds: u64,
) -> Result<(f64, u64), Error> {
    let output = std::process::Command::new(exe)
        .args([
            "drive",
            &port.to_string(),
            scenario,
            &connections.to_string(),
            &(seconds * 1000).to_string(),
            "500",
            "256",
        ])
        .output()?;
    if !output.status.success() {
        return Err(format!("drive {scenario}: {}", String::from_utf8_lossy(&output.stderr)).into());
    }
    let line = String::from_utf8(output.stdout)?;
    let fields: Vec<f64> = line.split_whitespace().map(str::parse).collect::<Result<_, _>>()?;
    let [requests, errors, _p50, p99, secs, _sent] = fields[..] else {
        return Err(format!("unexpected drive output {line:?}").into());
    };
    Ok(((requests - errors) / secs, p99 as u64))
}

/// `everything`: the ratios, then the bytes per row and the sweep (`load postgres ratios`: the
/// ratios alone).
pub(crate) async fn run(everything: bool) -> Result<(), Error> {
    let seconds: u64 =
        std::env::var("BENCH_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(2);
    let rounds: usize =
        std::env::var("BENCH_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(3);
    let database = Database::create().await?;
    let outcome = run_in(&database, seconds, rounds, everything).await;
    database.drop_now().await?;
    outcome
}

/// `load postgres transactional`: `pg-row` against `pg-txn`, fresh keys.
pub(crate) async fn transactional() -> Result<(), Error> {
    let seconds: u64 =
        std::env::var("BENCH_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(2);
    let rounds: usize =
        std::env::var("BENCH_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(3);
    let database = Database::create().await?;
    let outcome = side_by_side(&database, ["pg-row", "pg-txn", "pg-split"], seconds, rounds).await;
    database.drop_now().await?;
    outcome
}

/// The servers of `targets`, each a process of its own, ready.
fn start(
    exe: &std::path::Path,
    database: &Database,
    targets: &[&'static str],
) -> Result<Vec<(&'static str, ChildGuard)>, Error> {
    let mut servers = Vec::new();
    for &target in targets {
        let port = free_port();
        let mut child = std::process::Command::new(exe)
            .args(["serve", target, &port.to_string(), &database.url])
            .stdout(Stdio::piped())
            .spawn()?;
        let mut ready = String::new();
        BufReader::new(child.stdout.take().expect("piped")).read_line(&mut ready)?;
        if ready.trim() != "ready" {
            return Err(format!("server {target} did not start").into());
        }
        servers.push((target, ChildGuard { child, port }));
    }
    Ok(servers)
}

async fn side_by_side(
    database: &Database,
    targets: [&'static str; 3],
    seconds: u64,
    rounds: usize,
) -> Result<(), Error> {
    let exe = std::env::current_exe()?;
    let servers = start(&exe, database, &targets)?;
    println!(
        "load postgres transactional: {rounds} rounds of {seconds} s per cell after 0.5 s warm-up, the median shown; 256-byte bodies, fresh keys; PostgreSQL at DATABASE_URL, a database of the run's own\n"
    );
    println!(
        "| connections | row alone 2xx/s | row + record, one transaction 2xx/s | ratio | row, then the layer's own complete 2xx/s | ratio | p99 µs: alone / one transaction / separate |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---|");
    for connections in [16, 64] {
        let mut figures = Vec::new();
        for (_, server) in &servers {
            let mut runs = Vec::new();
            for _ in 0..rounds {
                runs.push(drive(&exe, server.port, "fresh", connections, seconds).await?);
            }
            runs.sort_by(|a, b| a.0.total_cmp(&b.0));
            figures.push(runs[runs.len() / 2]);
        }
        let [(alone, alone_p99), (ours, our_p99), (split, split_p99)] = figures[..] else {
            unreachable!()
        };
        println!(
            "| {connections} | {alone:.0} | {ours:.0} | {:.2} | {split:.0} | {:.2} | {alone_p99} / {our_p99} / {split_p99} |",
            ours / alone,
            split / alone
        );
    }
    Ok(())
}

async fn run_in(
    database: &Database,
    seconds: u64,
    rounds: usize,
    everything: bool,
) -> Result<(), Error> {
    let exe = std::env::current_exe()?;
    let servers = start(&exe, database, &["pg-floor", "postgres"])?;
    println!(
        "load postgres: {rounds} rounds of {seconds} s per cell after 0.5 s warm-up, the median shown; 256-byte bodies; PostgreSQL at DATABASE_URL, a database of the run's own\n"
    );
    println!(
        "| scenario | connections | floor 2xx/s | PostgresStore 2xx/s | ratio | floor p99 µs | PostgresStore p99 µs |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for scenario in ["fresh", "replay"] {
        for connections in [16, 64] {
            let mut figures = Vec::new();
            for (_, server) in &servers {
                let mut runs = Vec::new();
                for _ in 0..rounds {
                    runs.push(drive(&exe, server.port, scenario, connections, seconds).await?);
                }
                runs.sort_by(|a, b| a.0.total_cmp(&b.0));
                figures.push(runs[runs.len() / 2]);
            }
            let [(floor, floor_p99), (ours, our_p99)] = figures[..] else { unreachable!() };
            println!(
                "| {scenario} | {connections} | {floor:.0} | {ours:.0} | {:.2} | {floor_p99} | {our_p99} |",
                ours / floor
            );
        }
    }
    drop(servers);
    if !everything {
        return Ok(());
    }
    bytes_per_row(&database.url).await?;
    sweep_beside_claims(&database.url, &exe, seconds.max(5)).await
}

/// 100,000 completed records of a 256-byte response, through the layer; the table's size,
/// indexes and TOAST included, per row.
async fn bytes_per_row(url: &str) -> Result<(), Error> {
    let pool = pool(url)?;
    sqlx::raw_sql("DROP TABLE IF EXISTS idempotency_records CASCADE").execute(&pool).await?;
    let store = PostgresStore::new(pool.clone()).sweep_every(None);
    store.migrate().await?;
    let app = bare().layer(IdempotencyLayer::new(store));
    let rows = 100_000;
    let mut sending = Vec::new();
    for chunk in 0..16 {
        let app = app.clone();
        sending.push(tokio::spawn(async move {
            for n in (chunk..rows).step_by(16) {
                let request = Request::post("/pay")
                    .header("content-type", "application/json")
                    .header("idempotency-key", format!("row-{n}"))
                    .body(Body::from(REQUEST_BODY))
                    .expect("request");
                let response = oneshot(app.clone(), request).await.expect("response");
                assert!(response.status().is_success());
            }
        }));
    }
    for task in sending {
        task.await?;
    }
    sqlx::raw_sql("VACUUM ANALYZE idempotency_records").execute(&pool).await?;
    let (size, count): (i64, i64) = sqlx::query_as(
        "SELECT pg_total_relation_size('idempotency_records'), (SELECT count(*) FROM idempotency_records)",
    )
    .fetch_one(&pool)
    .await?;
    println!(
        "\nbytes per completed row (256-byte response, {count} rows, pg_total_relation_size: heap, indexes, TOAST): {}",
        size / count
    );
    Ok(())
}

/// Claim latency (fresh requests, 16 connections) with and without `sweep_expired` deleting a
/// million expired rows beside them.
async fn sweep_beside_claims(url: &str, exe: &std::path::Path, seconds: u64) -> Result<(), Error> {
    let pool = pool(url)?;
    let port = free_port();
    let mut child = std::process::Command::new(exe)
        .args(["serve", "postgres", &port.to_string(), url])
        .stdout(Stdio::piped())
        .spawn()?;
    let mut ready = String::new();
    BufReader::new(child.stdout.take().expect("piped")).read_line(&mut ready)?;
    let _server = ChildGuard { child, port };
    let (quiet, quiet_p99) = drive(exe, port, "fresh", 16, seconds).await?;
    let expire = "INSERT INTO idempotency_records (key, state, fingerprint, response, expires_at) \
                  SELECT 'expired-' || n, 'C', '\\x00', '\\x00', now() - interval '1 hour' \
                  FROM generate_series(1, 1000000) AS n";
    sqlx::raw_sql(expire).execute(&pool).await?;
    let store = PostgresStore::new(pool.clone()).sweep_every(None);
    let started = Instant::now();
    let sweeping = tokio::spawn(async move { store.sweep_expired(1000).await });
    let (busy, busy_p99) = drive(exe, port, "fresh", 16, seconds).await?;
    let swept = sweeping.await??;
    let took = started.elapsed();
    println!("\n| claims (fresh, 16 connections) | 2xx/s | p99 µs |\n|---|---:|---:|");
    println!("| no sweep | {quiet:.0} | {quiet_p99} |");
    println!(
        "| beside a sweep of 1,000,000 expired rows (1,000 a statement) | {busy:.0} | {busy_p99} |"
    );
    println!("\nthe sweep deleted {swept} rows in {:.1} s", took.as_secs_f64());
    let _ = Duration::ZERO;
    Ok(())
}
