//! A webhook receiver: each provider event is processed once, however often it is delivered.
//!
//! ```sh
//! cargo run --example webhook                                   # in-memory records, port 3001
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example webhook  # records in Redis
//! ```
//!
//! The signature is checked first, over the raw body, before the event id is trusted: a
//! forged delivery must not be able to use up (or replay) a real event's record. Then the
//! event is processed through [`Idempotent`], keyed by the provider's event id and scoped by
//! provider and consumer, so that a second consumer of the same events keeps records of its
//! own. Then, in another terminal (the secret is `whsec_demo` unless `WEBHOOK_SECRET` is set):
//!
//! ```sh
//! body='{"id":"evt_1","type":"charge.succeeded","amount":100}'
//! sig=$(printf '%s' "$body" | openssl dgst -sha256 -hmac whsec_demo | sed 's/^.* //')
//! # Processed: 200 {"event":"evt_1","status":"processed"}.
//! curl -i localhost:3001/webhooks/acme-pay -H "x-signature: sha256=$sig" -d "$body"
//! # The provider delivers it again: 200 {"status":"duplicate"}, not processed again.
//! curl -i localhost:3001/webhooks/acme-pay -H "x-signature: sha256=$sig" -d "$body"
//! # A bad signature: 400 problem+json, and no record is touched.
//! curl -i localhost:3001/webhooks/acme-pay -H 'x-signature: sha256=00' -d "$body"
//! # The same event id with another payload (correctly signed): 422 problem+json.
//! body2='{"id":"evt_1","type":"charge.succeeded","amount":999}'
//! sig2=$(printf '%s' "$body2" | openssl dgst -sha256 -hmac whsec_demo | sed 's/^.* //')
//! curl -i localhost:3001/webhooks/acme-pay -H "x-signature: sha256=$sig2" -d "$body2"
//! ```
//!
//! At start it prints these lines with the signatures already computed. Set `PORT` to listen
//! elsewhere.

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
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
    Idempotent, MemoryStore, RedisStore, Store,
    consumer::{Error, Outcome},
};
use hmac::{Hmac, KeyInit, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

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

struct App<St> {
    secret: Vec<u8>,
    idem: Idempotent<St>,
    ledger: AtomicUsize,
}

async fn receive<St: Store>(
    State(app): State<Arc<App<St>>>,
    Path(provider): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    // 1. The signature, over the raw body, before anything in it is trusted.
    let signature = headers.get("x-signature").and_then(|v| v.to_str().ok());
    if !signed(&app.secret, &body, signature) {
        return problem(
            StatusCode::BAD_REQUEST,
            "bad-signature",
            "The signature does not match the body",
        );
    }
    let Ok(event) = serde_json::from_slice::<Event>(&body) else {
        return problem(StatusCode::BAD_REQUEST, "bad-event", "The body is not an event");
    };
    // 2. Once per event id, for this provider and this consumer.
    let scope = format!("{provider}:ledger");
    let ledger_app = app.clone();
    let (event_id, kind) = (event.id.clone(), event.kind);
    let outcome = app
        .idem
        .run(&scope, &event.id, &body, move |_context| async move {
            // The side effect: here, a ledger entry for the event.
            let entry = ledger_app.ledger.fetch_add(1, Ordering::SeqCst) + 1;
            println!("processing {event_id} ({kind}): ledger entry {entry}");
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
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_str(&seconds).unwrap());
            response
        }
        Ok(Outcome::Mismatch) => problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "event-reused",
            "This event id was delivered before with another payload",
        ),
        // The provider retries a 5xx: nothing was processed.
        Err(Error::Store(_) | Error::Cancelled) => {
            problem(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "Try again later")
        }
        Err(error) => {
            eprintln!("webhook: {error}");
            problem(StatusCode::INTERNAL_SERVER_ERROR, "failed", "The event could not be processed")
        }
    }
}

fn signed(secret: &[u8], body: &[u8], signature: Option<&str>) -> bool {
    let Some(hex) = signature.and_then(|s| s.strip_prefix("sha256=")) else { return false };
    let Some(expected) = decode_hex(hex) else { return false };
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(body);
    // Constant time: the comparison must not tell an attacker how much of a guess was right.
    mac.verify_slice(&expected).is_ok()
}

fn sign(secret: &[u8], body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(body);
    mac.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect()
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
    let app = Arc::new(App {
        secret: secret.clone().into_bytes(),
        idem: Idempotent::new(store),
        ledger: AtomicUsize::new(0),
    });
    let router = Router::new().route("/webhooks/{provider}", post(receive::<St>)).with_state(app);
    let listener = tokio::net::TcpListener::bind(format!("127.0.0.1:{port}")).await.expect("bind");
    let body = r#"{"id":"evt_1","type":"charge.succeeded","amount":100}"#;
    println!("webhook receiver on http://127.0.0.1:{port}, records in {records}. Try:");
    println!(
        "curl -i localhost:{port}/webhooks/acme-pay -H 'x-signature: sha256={}' -d '{body}'",
        sign(secret.as_bytes(), body.as_bytes())
    );
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
