//! `load storm`: retry storms. 64 concurrent duplicates of each key, whose handler takes
//! 50 ms, with waiting off and on, over `MemoryStore` and `RedisStore` (a private Redis): the
//! answers by status, the handler runs per key, and what the duplicates cost in Redis commands.

use std::{
    collections::BTreeMap,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{Router, body::Body, http::Request, routing::post};
use axum_idempotency::settings::Waiting;
use axum_idempotency::{IdempotencyLayer, MemoryStore, RedisStore};

use crate::{ChildGuard, Error, matrix::commandstats, tower_service_shim::oneshot};

const DUPLICATES: usize = 64;
const KEYS: usize = 20;
const HANDLER: Duration = Duration::from_millis(50);

fn app(layer_store: Layered, wait: bool, runs: &Arc<AtomicUsize>) -> Router {
    let runs = runs.clone();
    let router = Router::new().route(
        "/pay",
        post(move || {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(HANDLER).await;
                "paid"
            }
        }),
    );
    match layer_store {
        Layered::Memory(store) => {
            let layer = IdempotencyLayer::new(store);
            router.layer(if wait {
                layer.waiting(Waiting::up_to(Duration::from_secs(5)))
            } else {
                layer
            })
        }
        Layered::Redis(store) => {
            let layer = IdempotencyLayer::new(store);
            router.layer(if wait {
                layer.waiting(Waiting::up_to(Duration::from_secs(5)))
            } else {
                layer
            })
        }
    }
}

enum Layered {
    Memory(MemoryStore),
    Redis(RedisStore),
}

pub(crate) async fn storm() -> Result<(), Error> {
    let redis = ChildGuard::redis_server(false)?;
    let url = format!("redis://127.0.0.1:{}", redis.port);
    let mut control = redis::Client::open(url.as_str())?.get_multiplexed_async_connection().await?;
    println!(
        "{DUPLICATES} concurrent duplicates of each of {KEYS} keys; the handler takes {HANDLER:?}.\n"
    );
    println!(
        "| store | waiting | original 200 | replayed 200 | 202 | handler runs per key | EVALSHA per duplicate | PUBLISH per key | (UN)SUBSCRIBE per key | last answer per key |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for store in ["memory", "redis"] {
        for wait in [false, true] {
            let runs = Arc::new(AtomicUsize::new(0));
            let layered = match store {
                "memory" => Layered::Memory(MemoryStore::new()),
                _ => Layered::Redis(RedisStore::from_url(&url)?),
            };
            let router = app(layered, wait, &runs);
            // Warm up: connections, scripts, the subscriber.
            let warm =
                Request::post("/pay").header("idempotency-key", "warm").body(Body::empty())?;
            oneshot(router.clone(), warm).await?;
            runs.store(0, Ordering::SeqCst);
            let before = commandstats(&mut control).await?;
            let mut statuses: BTreeMap<&str, usize> = BTreeMap::new();
            let mut slowest = Duration::ZERO;
            for key in 0..KEYS {
                let started = Instant::now();
                let requests: Vec<_> = (0..DUPLICATES)
                    .map(|_| {
                        let router = router.clone();
                        let request = Request::post("/pay")
                            .header("idempotency-key", format!("storm-{wait}-{key}"))
                            .body(Body::empty())
                            .expect("request");
                        tokio::spawn(async move { oneshot(router, request).await })
                    })
                    .collect();
                for request in requests {
                    let response = request.await??;
                    let kind = match (
                        response.status().as_u16(),
                        response.headers().contains_key("idempotency-replayed"),
                    ) {
                        (200, false) => "original",
                        (200, true) => "replayed",
                        (202, _) => "in progress",
                        _ => "other",
                    };
                    *statuses.entry(kind).or_default() += 1;
                }
                slowest = slowest.max(started.elapsed());
            }
            let after = commandstats(&mut control).await?;
            let delta = |command: &str| {
                after.get(command).copied().unwrap_or(0) - before.get(command).copied().unwrap_or(0)
            };
            let duplicates = (KEYS * (DUPLICATES - 1)) as f64;
            let (evalsha, publish, subscribe) = if store == "redis" {
                // The original's claim and complete are not the duplicates' cost.
                let evalsha = delta("evalsha") as f64 - 2.0 * KEYS as f64;
                (
                    format!("{:.2}", evalsha / duplicates),
                    format!("{:.2}", delta("publish") as f64 / KEYS as f64),
                    format!(
                        "{:.2}",
                        (delta("subscribe") + delta("unsubscribe")) as f64 / KEYS as f64
                    ),
                )
            } else {
                ("-".to_owned(), "-".to_owned(), "-".to_owned())
            };
            println!(
                "| {store} | {} | {} | {} | {} | {:.2} | {evalsha} | {publish} | {subscribe} | {slowest:.0?} |",
                if wait { "on (5 s)" } else { "off" },
                statuses.get("original").unwrap_or(&0),
                statuses.get("replayed").unwrap_or(&0),
                statuses.get("in progress").unwrap_or(&0),
                runs.load(Ordering::SeqCst) as f64 / KEYS as f64,
            );
        }
    }
    Ok(())
}
