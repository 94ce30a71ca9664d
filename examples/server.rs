//! A small payments service to try with curl.
//!
//! ```sh
//! cargo run --example server                                   # in-memory store, port 3000
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example server  # Redis
//! ```
//!
//! Then, in another terminal:
//!
//! ```sh
//! # The first request runs the handler: 201 and a new payment id.
//! curl -i -X POST localhost:3000/payments -H 'Idempotency-Key: order-1' \
//!      -H 'X-Tenant-Id: acme' -H 'content-type: application/json' -d '{"amount":100}'
//! # The same again: the stored 201, with `idempotency-replayed: true`.
//! curl -i -X POST localhost:3000/payments -H 'Idempotency-Key: order-1' \
//!      -H 'X-Tenant-Id: acme' -H 'content-type: application/json' -d '{"amount":100}'
//! # The same key with another amount: 409 problem+json.
//! curl -i -X POST localhost:3000/payments -H 'Idempotency-Key: order-1' \
//!      -H 'X-Tenant-Id: acme' -H 'content-type: application/json' -d '{"amount":5}'
//! # The same key for another tenant is another record: 201, a new payment.
//! curl -i -X POST localhost:3000/payments -H 'Idempotency-Key: order-1' \
//!      -H 'X-Tenant-Id: globex' -H 'content-type: application/json' -d '{"amount":100}'
//! # Payments require a key: 400 problem+json without one.
//! curl -i -X POST localhost:3000/payments -H 'X-Tenant-Id: acme' -d '{"amount":100}'
//! # A slow payment (2 s): send it twice at once, and the second waits for the first and gets
//! # its response, with Idempotency-Replayed: true (past the 10 s wait: 202 + Retry-After).
//! curl -i -X POST 'localhost:3000/payments?delay_ms=2000' -H 'Idempotency-Key: order-2' \
//!      -H 'X-Tenant-Id: acme' -H 'content-type: application/json' -d '{"amount":7}' &
//! sleep 0.2; curl -i -X POST 'localhost:3000/payments?delay_ms=2000' -H 'Idempotency-Key: order-2' \
//!      -H 'X-Tenant-Id: acme' -H 'content-type: application/json' -d '{"amount":7}'
//! ```
//!
//! With `--features metrics`, `GET /metrics` serves the layer's counters and histograms in
//! Prometheus format (`curl localhost:3000/metrics`). Set `PORT` to listen elsewhere.
//!
//! The tenant header is trusted as is here; behind a real
//! gateway, scope by the authenticated identity instead (see `ExtractorScope`).

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use axum::{
    Json, Router,
    extract::{Query, State},
    http::{HeaderName, StatusCode},
    routing::{get, post},
};
use axum_idempotency::{HeaderScope, IdempotencyLayer, MemoryStore, RedisStore, store::Store};
use serde::Deserialize;
use serde_json::{Value, json};

#[derive(Deserialize)]
struct Delay {
    delay_ms: Option<u64>,
}

async fn create_payment(
    State(next_id): State<Arc<AtomicU64>>,
    Query(delay): Query<Delay>,
    Json(payment): Json<Value>,
) -> (StatusCode, Json<Value>) {
    if let Some(ms) = delay.delay_ms {
        tokio::time::sleep(Duration::from_millis(ms.min(30_000))).await;
    }
    let id = next_id.fetch_add(1, Ordering::SeqCst);
    tracing::info!(id, "payment created");
    (StatusCode::CREATED, Json(json!({ "id": format!("pay_{id}"), "amount": payment["amount"] })))
}

fn app<St: Store>(store: St) -> Router {
    let idempotency = IdempotencyLayer::new(store)
        .scope(HeaderScope::new(HeaderName::from_static("x-tenant-id")))
        .require_key(true);
    Router::new()
        .route("/payments", post(create_payment))
        .route_layer(idempotency)
        .route("/health", get(|| async { "ok" }))
        .with_state(Arc::new(AtomicU64::new(1)))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,axum_idempotency=debug".into()),
        )
        .init();
    let app = match std::env::var("REDIS_URL") {
        Ok(url) => app(RedisStore::from_url(&url)?),
        Err(_) => app(MemoryStore::new()),
    };
    #[cfg(feature = "metrics")]
    let app = {
        let prometheus =
            metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder()?;
        app.route("/metrics", get(move || std::future::ready(prometheus.render())))
    };
    let port = std::env::var("PORT").unwrap_or_else(|_| "3000".to_owned());
    let listener = tokio::net::TcpListener::bind(format!("127.0.0.1:{port}")).await?;
    tracing::info!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
