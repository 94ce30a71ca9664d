//! What keeping a lease costs: the renewals (`EVALSHA` of `touch.lua`, one round trip each)
//! sent while handlers of 1, 5 and 30 seconds run, under the HTTP layer's default lease (10 s)
//! and under a 30 s lease, counted from a private Redis's `INFO commandstats` (every call but
//! the claim and the complete is a renewal). Commandstats are server-wide, so the six run one
//! after another (about 72 s).

use std::time::Duration;

use axum::{Router, body::Body, http::Request, routing::post};
use axum_idempotency::{IdempotencyLayer, RedisStore};
use crate::tower_service_shim::oneshot;

use crate::Error;

async fn evalsha_calls(connection: &mut redis::aio::MultiplexedConnection) -> Result<u64, Error> {
    let info: String = redis::cmd("INFO").arg("commandstats").query_async(connection).await?;
    let calls = info
        .lines()
        .find_map(|line| line.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next())
        .map_or(Ok(0), str::parse)?;
    Ok(calls)
}

pub(crate) async fn run(redis_url: &str) -> Result<(), Error> {
    let client = redis::Client::open(redis_url)?;
    let mut connection = client.get_multiplexed_async_connection().await?;
    // A first request loads every script the others use (claim, touch, complete), so that no
    // `NOSCRIPT` answer is counted as a call.
    let warm: Router = Router::new()
        .route("/pay", post(|| async {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            "paid"
        }))
        .layer(IdempotencyLayer::new(RedisStore::from_url(redis_url)?));
    let request = Request::post("/pay").header("idempotency-key", "warm").body(Body::empty())?;
    oneshot(warm, request).await.expect("infallible");
    println!("| lease | handler | renewals (touch round trips) |");
    println!("|---|---|---|");
    for lease in [Duration::from_secs(10), Duration::from_secs(30)] {
        for handler in [1, 5, 30].map(Duration::from_secs) {
            let store = RedisStore::from_url(redis_url)?;
            let app: Router = Router::new()
                .route("/pay", post(move || async move {
                    tokio::time::sleep(handler).await;
                    "paid"
                }))
                .layer(IdempotencyLayer::new(store).lease(lease));
            let key = format!("renewals-{}-{}", lease.as_secs(), handler.as_secs());
            let request = Request::post("/pay").header("idempotency-key", key).body(Body::empty())?;
            let before = evalsha_calls(&mut connection).await?;
            let response = oneshot(app, request).await.expect("infallible");
            assert!(response.status().is_success(), "{}", response.status());
            // The claim and the complete: two scripts; the rest renewed the lease.
            let renewals = evalsha_calls(&mut connection).await? - before - 2;
            println!("| {} s | {} s | {renewals} |", lease.as_secs(), handler.as_secs());
        }
    }
    Ok(())
}
