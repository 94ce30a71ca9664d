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
//! With `ADMIN_TOKEN` set, the operator's routes answer requests that carry it as a bearer
//! token (without it they are not served):
//!
//! ```sh
//! ADMIN_TOKEN=s3cret cargo run --example server
//! # What happened to acme's request with key order-1 (add ?body=true for the response):
//! curl -s localhost:3000/admin/keys/acme/order-1 -H 'Authorization: Bearer s3cret'
//! # Let acme run it again: the record goes (one in progress only with ?force=true).
//! curl -s -X DELETE localhost:3000/admin/keys/acme/order-1 -H 'Authorization: Bearer s3cret'
//! # The claims nobody came back for, lapsed a minute ago or more, oldest first.
//! curl -s 'localhost:3000/admin/abandoned?lapsed_secs=60&limit=20' -H 'Authorization: Bearer s3cret'
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
    extract::{Path, Query, State},
    http::{HeaderMap, StatusCode, header},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use axum_idempotency::{
    HeaderScope, IdempotencyLayer, MemoryStore, RedisStore,
    store::{Admin, Forgotten, RecordStatus},
};
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

fn app<St: Admin>(store: St, admin_token: Option<String>) -> Router {
    let idempotency = IdempotencyLayer::new(store)
        .scope(HeaderScope::new("x-tenant-id").expect("a valid header name"))
        .require_key(true);
    let app = Router::new()
        .route("/payments", post(create_payment))
        .route_layer(idempotency.clone())
        .route("/health", get(|| async { "ok" }))
        .with_state(Arc::new(AtomicU64::new(1)));
    match admin_token {
        Some(token) => {
            app.merge(admin(Operator { records: idempotency.operator(), token: token.into() }))
        }
        None => app,
    }
}

/// The operator's routes: the layer's operator calls (`inspect`, `forget`, `abandoned`),
/// behind a bearer token.
struct Operator<St> {
    records: axum_idempotency::layer::Operator<St>,
    token: Arc<str>,
}

impl<St: Clone> Clone for Operator<St> {
    fn clone(&self) -> Self {
        Self { records: self.records.clone(), token: self.token.clone() }
    }
}

fn admin<St: Admin>(operator: Operator<St>) -> Router {
    Router::new()
        .route("/admin/keys/{tenant}/{key}", get(inspect::<St>).delete(forget::<St>))
        .route("/admin/abandoned", get(abandoned::<St>))
        .with_state(operator)
}

/// Whether the request carries the token, compared in constant time: their SHA-256 digests,
/// of one length whatever the tokens' lengths, compared byte for byte with no early return, so
/// that the time taken says nothing of the token (its length included).
fn authorized<St>(operator: &Operator<St>, headers: &HeaderMap) -> bool {
    use sha2::{Digest, Sha256};
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .unwrap_or("");
    let (given, expected) = (Sha256::digest(given), Sha256::digest(&*operator.token));
    given.iter().zip(expected.iter()).fold(0, |diff, (a, b)| diff | (a ^ b)) == 0
}

fn unauthorized() -> Response {
    (StatusCode::UNAUTHORIZED, [(header::WWW_AUTHENTICATE, "Bearer")]).into_response()
}

#[derive(Deserialize)]
struct AdminQuery {
    #[serde(default)]
    body: bool,
    #[serde(default)]
    force: bool,
    lapsed_secs: Option<u64>,
    limit: Option<u32>,
}

fn store_error(error: impl std::fmt::Display) -> Response {
    (StatusCode::SERVICE_UNAVAILABLE, Json(json!({ "error": error.to_string() }))).into_response()
}

async fn inspect<St: Admin>(
    State(operator): State<Operator<St>>,
    Path((tenant, key)): Path<(String, String)>,
    Query(query): Query<AdminQuery>,
    headers: HeaderMap,
) -> Response {
    if !authorized(&operator, &headers) {
        return unauthorized();
    }
    let report = match operator.records.inspect(tenant.as_bytes(), &key, query.body).await {
        Ok(Some(report)) => report,
        Ok(None) => {
            return (StatusCode::NOT_FOUND, Json(json!({ "state": "absent" }))).into_response();
        }
        Err(error) => return store_error(error),
    };
    let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    let (state, lease_ms) = match report.record.state {
        RecordStatus::Running { lease_left } => ("running", Some(ms(lease_left))),
        RecordStatus::Lapsed { lapsed_for } => ("lapsed", Some(ms(lapsed_for))),
        _ => ("completed", None),
    };
    let response = report.outcome.map(|response| {
        json!({
            "status": response.status().as_u16(),
            "headers": response.headers().iter()
                .map(|(name, value)| (name.to_string(), String::from_utf8_lossy(value.as_bytes()).into_owned()))
                .collect::<Vec<_>>(),
            "body": String::from_utf8_lossy(response.body()),
        })
    });
    Json(json!({
        "key_hash": report.key_hash,
        "state": state,
        "lease_left_or_lapsed_for_ms": lease_ms,
        "time_left_ms": ms(report.record.time_left),
        "size": report.record.size,
        "waited_for": report.record.waited_for,
        "completed_ago_ms": report.completed_ago.map(ms),
        "response": response,
    }))
    .into_response()
}

async fn forget<St: Admin>(
    State(operator): State<Operator<St>>,
    Path((tenant, key)): Path<(String, String)>,
    Query(query): Query<AdminQuery>,
    headers: HeaderMap,
) -> Response {
    if !authorized(&operator, &headers) {
        return unauthorized();
    }
    match operator.records.forget(tenant.as_bytes(), &key, query.force).await {
        Ok(Forgotten::Deleted) => Json(json!({ "forgotten": "deleted" })).into_response(),
        Ok(Forgotten::Absent) => (StatusCode::NOT_FOUND, Json(json!({ "forgotten": "absent" }))).into_response(),
        Ok(_) => (
            StatusCode::CONFLICT,
            Json(json!({ "forgotten": "refused", "why": "in progress, its lease running; ?force=true deletes it" })),
        )
            .into_response(),
        Err(error) => store_error(error),
    }
}

async fn abandoned<St: Admin>(
    State(operator): State<Operator<St>>,
    Query(query): Query<AdminQuery>,
    headers: HeaderMap,
) -> Response {
    if !authorized(&operator, &headers) {
        return unauthorized();
    }
    let lapsed = Duration::from_secs(query.lapsed_secs.unwrap_or(60));
    match operator.records.abandoned(lapsed, query.limit.unwrap_or(100)).await {
        Ok(claims) => Json(
            claims
                .iter()
                .map(|claim| json!({ "key": claim.key.as_str(), "lapsed_for_ms": claim.lapsed_for.as_millis() as u64 }))
                .collect::<Vec<_>>(),
        )
        .into_response(),
        Err(error) => store_error(error),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,axum_idempotency=debug".into()),
        )
        .init();
    let admin_token = std::env::var("ADMIN_TOKEN").ok().filter(|token| !token.is_empty());
    let app = match std::env::var("REDIS_URL") {
        Ok(url) => app(RedisStore::from_url(&url)?, admin_token),
        Err(_) => app(MemoryStore::new(), admin_token),
    };
    #[cfg(feature = "metrics")]
    let app = {
        let prometheus =
            metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder()?;
        app.route("/metrics", get(move || std::future::ready(prometheus.render())))
    };
    let port = std::env::var("PORT").unwrap_or_else(|_| "3000".to_owned());
    let listener = tokio::net::TcpListener::bind(format!("127.0.0.1:{port}")).await?;
    // On stdout as a plain line, for scripts (and tests) that wait for it.
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
