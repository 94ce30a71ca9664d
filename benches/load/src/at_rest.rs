//! `load at-rest`: what protecting the stored outcome costs, side by side in one run. In
//! process (one thread, no HTTP connection): µs per request with and without encryption at
//! rest, fresh and replay, 256 B and 16 KiB bodies, over the memory store and a private Redis;
//! and the bytes a record costs in Redis (`MEMORY USAGE`) stored whole, encrypted, and
//! minimally (`layer::Minimal`).

use std::time::{Duration, Instant};

use super::tower_service_shim::oneshot;
use axum::{
    Json, Router,
    body::Body,
    http::{Request, StatusCode},
    response::IntoResponse,
    routing::post,
};
use axum_idempotency::{
    IdempotencyLayer, MemoryStore, RedisStore,
    encryption::Keyring,
    layer::Minimal,
    store::{RecordKey, Store},
};
use bytes::Bytes;
use http_body_util::BodyExt;

use super::{ChildGuard, Error, bare, request_body};

const ROUNDS: usize = 5;

fn layered<St: Store>(store: St, encrypted: bool) -> Router {
    let layer = IdempotencyLayer::new(store);
    match encrypted {
        true => bare().layer(layer.encrypt_at_rest(Keyring::new("k1", [7; 32]).unwrap())),
        false => bare().layer(layer),
    }
}

/// µs per request over `requests` requests of `size` bytes.
async fn per_request(
    app: &Router,
    scenario: &str,
    size: usize,
    requests: usize,
    round: usize,
) -> Result<f64, Error> {
    let body = request_body(size);
    let replay_key = format!("replay-{size}-{round}");
    let send = |key: String| {
        let request = Request::post("/pay")
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(Body::from(body.clone()));
        async move {
            let response = oneshot(app.clone(), request?).await?;
            assert!(response.status().is_success(), "{}", response.status());
            response.into_body().collect().await?;
            Ok::<_, Error>(())
        }
    };
    if scenario == "replay" {
        send(replay_key.clone()).await?;
    }
    let started = Instant::now();
    for n in 0..requests {
        let key = match scenario {
            "fresh" => format!("fresh-{size}-{round}-{n}"),
            _ => replay_key.clone(),
        };
        send(key).await?;
    }
    Ok(started.elapsed().as_secs_f64() * 1e6 / requests as f64)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

pub(crate) async fn run() -> Result<(), Error> {
    let redis = ChildGuard::redis_server(false)?;
    let redis_url = format!("redis://127.0.0.1:{}", redis.port);
    println!(
        "load at-rest: in process, one thread; the median of {ROUNDS} rounds, clear and encrypted interleaved\n"
    );
    println!("| store | scenario | body | clear µs/req | encrypted µs/req | encrypted / clear |");
    println!("|---|---|---:|---:|---:|---:|");
    for store in ["memory", "redis"] {
        for scenario in ["fresh", "replay"] {
            for size in [256, 16 * 1024] {
                let requests = match store {
                    "memory" => 20_000,
                    _ => 5_000,
                };
                let (mut clear, mut encrypted) = (Vec::new(), Vec::new());
                for round in 0..ROUNDS {
                    for (on, into) in [(false, &mut clear), (true, &mut encrypted)] {
                        let app = match store {
                            "memory" => layered(MemoryStore::with_capacity(5_000_000), on),
                            _ => layered(RedisStore::from_url(&redis_url)?, on),
                        };
                        let round = round * 2 + usize::from(on);
                        into.push(per_request(&app, scenario, size, requests, round).await?);
                    }
                }
                let (clear, encrypted) = (median(clear), median(encrypted));
                println!(
                    "| {store} | {scenario} | {size} | {clear:.2} | {encrypted:.2} | {:.3} |",
                    encrypted / clear
                );
            }
        }
    }
    record_bytes(&redis_url).await?;
    drop(redis);
    Ok(())
}

/// An order of `size` bytes, stored minimally: its id and its Location.
async fn minimal_order(body: Bytes) -> impl IntoResponse {
    let order = serde_json::json!({"id": "ord_1", "notes": "n".repeat(body.len())});
    (StatusCode::CREATED, [("location", "/orders/ord_1")], Minimal::new("ord_1"), Json(order))
}

/// `MEMORY USAGE` of one record, stored whole, encrypted and minimally.
async fn record_bytes(redis_url: &str) -> Result<(), Error> {
    let client = redis::Client::open(redis_url)?;
    let mut control = client.get_multiplexed_async_connection().await?;
    println!("\n| body | whole | encrypted | minimal |");
    println!("|---:|---:|---:|---:|");
    for size in [256, 16 * 1024] {
        let mut row = Vec::new();
        for (name, app) in [
            ("whole", layered(RedisStore::from_url(redis_url)?, false)),
            ("encrypted", layered(RedisStore::from_url(redis_url)?, true)),
            (
                "minimal",
                Router::new()
                    .route("/pay", post(minimal_order))
                    .layer(IdempotencyLayer::new(RedisStore::from_url(redis_url)?)),
            ),
        ] {
            let key = format!("bytes-{name}-{size}");
            let request = Request::post("/pay")
                .header("content-type", "application/json")
                .header("idempotency-key", &key)
                .body(Body::from(request_body(size)))?;
            let response = oneshot(app, request).await?;
            assert!(response.status().is_success());
            response.into_body().collect().await?;
            let record = RecordKey::new("idempotency", b"", key.as_bytes());
            let bytes: i64 = redis::cmd("MEMORY")
                .arg("USAGE")
                .arg(record.as_str())
                .arg("SAMPLES")
                .arg(0)
                .query_async(&mut control)
                .await?;
            row.push(bytes);
        }
        println!("| {size} | {} B | {} B | {} B |", row[0], row[1], row[2]);
    }
    tokio::time::sleep(Duration::ZERO).await;
    Ok(())
}
