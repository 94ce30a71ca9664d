//! A webhook receiver: each provider event is processed once, however often it is delivered,
//! and a delivery nobody signed, or signed too long ago, is processed never.
//!
//! ```sh
//! cargo run --example webhook                                   # in-memory records, port 3001
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example webhook  # records in Redis
//! ```
//!
//! What it checks, in order, before an event is processed:
//!
//! 1. **the provider** is one it knows (`/webhooks/{provider}`): each has a secret of its own,
//!    and an unknown name is 404 before anything else, so no path can mint a new record (or a
//!    new metrics label).
//! 2. **the signature**, HMAC-SHA256 with that provider's secret over `"{t}.{body}"`, where `t`
//!    is the signing time (the `webhook-signature: t=…,v1=…` header, as Stripe and Standard
//!    Webhooks do). The scope of the record is the provider whose secret verified it, never the
//!    path as sent: a body signed by one provider cannot be processed again under another name.
//! 3. **the signing time**, within [`TOLERANCE`] (5 minutes) of now: a captured delivery
//!    replayed later is refused. The records are kept for [`RETENTION`] (7 days), longer than
//!    any provider retries (Stripe: 3 days); each retry is signed anew, so it passes the
//!    timestamp check and is then a duplicate. Both are needed: the records alone forget an
//!    event after their retention, and a replay after that would run again; the timestamp
//!    alone does not stop a second delivery within the tolerance.
//! 4. **the fingerprint** is the event without the members a provider changes between retries
//!    of the same event ([`VOLATILE`]: its delivery attempt): a genuine retry is a duplicate,
//!    the same event id with another payload is 422.
//!
//! Then, in another terminal, the lines it prints at start (with the signatures computed, the
//! secret is `whsec_demo` unless `WEBHOOK_SECRET` is set): the first delivery is processed,
//! the second is a duplicate, a bad signature is 400, another payload under the same id is 422.
//! Set `PORT` to listen elsewhere.

use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use axum::{
    Json, Router,
    body::Bytes,
    extract::{Path, State},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
    routing::post,
};
use axum_idempotency::{
    Idempotent, MemoryStore, RedisStore,
    consumer::{Error, Outcome},
    store::Store,
};
use hmac::{Hmac, KeyInit, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

/// How far a signing time may be from now.
pub const TOLERANCE: Duration = Duration::from_secs(5 * 60);
/// How long an event's record is kept: longer than any provider's retries.
pub const RETENTION: Duration = Duration::from_secs(7 * 24 * 60 * 60);
/// The members a provider changes between deliveries of one event: left out of the
/// fingerprint.
pub const VOLATILE: [&str; 1] = ["delivery_attempt"];

/// The part of a provider's event this receiver reads.
#[derive(Deserialize)]
struct Event {
    id: String,
    #[serde(rename = "type")]
    kind: String,
}

/// What processing an event produced: stored, and replayed to a duplicate delivery.
#[derive(Serialize, Deserialize)]
struct Processed {
    event: String,
    ledger_entry: usize,
}

/// The providers this receiver knows, each with its own secret.
pub type Providers = HashMap<&'static str, Vec<u8>>;

/// The receiver's state.
#[derive(Debug)]
pub struct App<St> {
    providers: Providers,
    idem: Idempotent<St>,
    /// The side effects so far: one ledger entry per event processed.
    pub ledger: AtomicUsize,
}

/// The receiver over `store`, for `providers`.
pub fn router<St: Store>(store: St, providers: Providers) -> (Router, Arc<App<St>>) {
    let app = Arc::new(App {
        providers,
        idem: Idempotent::new(store).retention(RETENTION),
        ledger: AtomicUsize::new(0),
    });
    let router =
        Router::new().route("/webhooks/{provider}", post(receive::<St>)).with_state(app.clone());
    (router, app)
}

async fn receive<St: Store>(
    State(app): State<Arc<App<St>>>,
    Path(provider): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    // 1. A provider we know; its name from our table, not from the path.
    let Some((&provider, secret)) = app.providers.get_key_value(provider.as_str()) else {
        return problem(StatusCode::NOT_FOUND, "unknown-provider", "No such webhook");
    };
    // 2 and 3. The signature over the signing time and the raw body, before anything in it
    // is trusted; then the signing time.
    let signature = headers.get("webhook-signature").and_then(|v| v.to_str().ok());
    let Some(signed_at) = verify(secret, &body, signature) else {
        return problem(
            StatusCode::BAD_REQUEST,
            "bad-signature",
            "The signature does not match the body",
        );
    };
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
    if now.abs_diff(signed_at) > TOLERANCE.as_secs() {
        return problem(StatusCode::BAD_REQUEST, "stale-signature", "The delivery is too old");
    }
    let (Ok(event), Ok(mut fingerprinted)) = (
        serde_json::from_slice::<Event>(&body),
        serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(&body),
    ) else {
        return problem(StatusCode::BAD_REQUEST, "bad-event", "The body is not an event");
    };
    // 4. The fingerprint: the event without what changes between its deliveries.
    for member in VOLATILE {
        fingerprinted.remove(member);
    }
    let payload = serde_json::to_vec(&fingerprinted).unwrap_or_default();
    // Once per event id, for this provider and this consumer.
    let scope = format!("{provider}:ledger");
    let ledger_app = app.clone();
    let (event_id, kind) = (event.id.clone(), event.kind);
    let outcome = app
        .idem
        .run(&scope, &event.id, &payload, move |_context| async move {
            // The side effect: here, a ledger entry for the event.
            let entry = ledger_app.ledger.fetch_add(1, Ordering::SeqCst) + 1;
            println!("processing {event_id} ({kind}) from {provider}: ledger entry {entry}");
            Ok::<_, std::convert::Infallible>(Processed { event: event_id, ledger_entry: entry })
        })
        .await;
    match outcome {
        Ok(Outcome::Ran(done)) => answer("processed", &done),
        Ok(Outcome::Replayed(done)) => answer("duplicate", &done),
        Ok(Outcome::InProgress { retry_after }) => {
            let mut response =
                problem(StatusCode::CONFLICT, "in-progress", "This event is being processed");
            let seconds = retry_after.as_secs().max(1).to_string();
            if let Ok(seconds) = HeaderValue::from_str(&seconds) {
                response.headers_mut().insert(header::RETRY_AFTER, seconds);
            }
            response
        }
        Ok(Outcome::Mismatch) => problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "event-reused",
            "This event id was delivered before with another payload",
        ),
        Err(Error::EmptyKey) => {
            problem(StatusCode::BAD_REQUEST, "bad-event", "The event has no id")
        }
        // The provider retries a 5xx: nothing was processed.
        Err(Error::Store(_) | Error::Cancelled | Error::Recovery) => {
            problem(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "Try again later")
        }
        // Processed before, but its answer is not replayable: acknowledge, never run again.
        Err(error @ Error::ResultNotStored { .. }) => {
            eprintln!("webhook: {error}");
            (StatusCode::OK, Json(serde_json::json!({ "status": "duplicate" }))).into_response()
        }
        Err(error) => {
            eprintln!("webhook: {error}");
            problem(StatusCode::INTERNAL_SERVER_ERROR, "failed", "The event could not be processed")
        }
    }
}

/// The signing time of a `t=…,v1=…` signature over `"{t}.{body}"` with `secret`, if it
/// verifies.
fn verify(secret: &[u8], body: &[u8], signature: Option<&str>) -> Option<u64> {
    let (mut at, mut expected) = (None, None);
    for part in signature?.split(',') {
        match part.split_once('=')? {
            ("t", t) => at = Some(t),
            ("v1", hex) => expected = decode_hex(hex),
            _ => {}
        }
    }
    let (at, expected) = (at?, expected?);
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).ok()?;
    mac.update(at.as_bytes());
    mac.update(b".");
    mac.update(body);
    // Constant time: the comparison must not tell an attacker how much of a guess was right.
    mac.verify_slice(&expected).ok()?;
    at.parse().ok()
}

/// The `webhook-signature` header a provider sends for `body`, signed at `at` (Unix seconds).
pub fn sign(secret: &[u8], at: u64, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(at.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    let hex: String = mac.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect();
    format!("t={at},v1={hex}")
}

fn decode_hex(hex: &str) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok()).collect()
}

fn answer(status: &str, done: &Processed) -> Response {
    let body = serde_json::json!({ "event": done.event, "status": status, "ledger_entry": done.ledger_entry });
    (StatusCode::OK, Json(body)).into_response()
}

fn problem(status: StatusCode, kind: &str, title: &str) -> Response {
    let body = serde_json::json!({
        "type": format!("urn:webhook-example:problem:{kind}"),
        "title": title,
        "status": status.as_u16(),
    });
    let mut response = (status, body.to_string()).into_response();
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
    response
}

async fn serve<St: Store>(store: St, records: &str) {
    let secret = std::env::var("WEBHOOK_SECRET").unwrap_or_else(|_| "whsec_demo".to_owned());
    let port = std::env::var("PORT").unwrap_or_else(|_| "3001".to_owned());
    let providers = Providers::from([("acme-pay", secret.clone().into_bytes())]);
    let (router, _app) = router(store, providers);
    let listener = tokio::net::TcpListener::bind(format!("127.0.0.1:{port}")).await.expect("bind");
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
    let url = format!("localhost:{port}/webhooks/acme-pay");
    let body = r#"{"id":"evt_1","type":"charge.succeeded","amount":100,"delivery_attempt":1}"#;
    let retry = r#"{"id":"evt_1","type":"charge.succeeded","amount":100,"delivery_attempt":2}"#;
    let reused = r#"{"id":"evt_1","type":"charge.succeeded","amount":999,"delivery_attempt":3}"#;
    let signed = |body: &str| sign(secret.as_bytes(), now, body.as_bytes());
    println!(
        "webhook receiver on http://127.0.0.1:{port}, records in {records}. Try (within 5 minutes):"
    );
    println!("# processed:");
    println!("curl -i {url} -H 'webhook-signature: {}' -d '{body}'", signed(body));
    println!(
        "# the provider's retry (another delivery attempt): a duplicate, not processed again:"
    );
    println!("curl -i {url} -H 'webhook-signature: {}' -d '{retry}'", signed(retry));
    println!("# a bad signature: 400 problem+json, no record touched:");
    println!("curl -i {url} -H 'webhook-signature: t={now},v1=00' -d '{body}'");
    println!("# the same event id with another payload: 422 problem+json:");
    println!("curl -i {url} -H 'webhook-signature: {}' -d '{reused}'", signed(reused));
    axum::serve(listener, router).await.expect("serve");
}

#[tokio::main]
async fn main() {
    match std::env::var("REDIS_URL") {
        Ok(url) => {
            let store = RedisStore::from_url(&url).expect("REDIS_URL is a Redis URL");
            serve(store, &format!("Redis at {url}")).await;
        }
        Err(_) => serve(MemoryStore::new(), "memory").await,
    }
}
