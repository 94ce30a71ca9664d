//! `examples/webhook.rs`, as users copy it, attacked on every store: a signed event posted
//! under other provider names, replayed after the signature's tolerance, retried by the
//! provider with a new delivery attempt.

use crate::common;

#[path = "../../examples/webhook.rs"]
#[allow(dead_code, unreachable_pub)]
mod webhook;

use std::{
    sync::atomic::Ordering,
    time::{SystemTime, UNIX_EPOCH},
};

use axum::{Router, body::Body};
use common::*;
use http::Request;
use webhook::{Providers, RETENTION, TOLERANCE, router, sign};

every_store!(
    one_signed_event_runs_once_whatever_path_it_is_posted_to,
    a_delivery_signed_longer_ago_than_the_tolerance_is_refused,
    a_provider_retry_with_a_new_delivery_attempt_is_a_duplicate,
);

const ACME: &[u8] = b"whsec_acme";
const OTHER: &[u8] = b"whsec_other";
const EVENT: &str = r#"{"id":"evt_1","type":"charge.succeeded","amount":100,"delivery_attempt":1}"#;

fn providers() -> Providers {
    Providers::from([("acme-pay", ACME.to_vec()), ("other-pay", OTHER.to_vec())])
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs()
}

async fn deliver(app: &Router, path: &str, signature: String, body: &str) -> Seen {
    let request = Request::post(path)
        .header("webhook-signature", signature)
        .body(Body::from(body.to_owned()))
        .unwrap();
    send(app, request).await
}

async fn one_signed_event_runs_once_whatever_path_it_is_posted_to<H: Harness>(h: H) {
    let (app, state) = router(h.store(), providers());
    let signature = sign(ACME, now(), EVENT.as_bytes());
    let first = deliver(&app, "/webhooks/acme-pay", signature.clone(), EVENT).await;
    assert_eq!(first.status, 200, "{first:?}");
    assert!(first.body.contains(r#""status":"processed""#), "{}", first.body);
    let again = deliver(&app, "/webhooks/acme-pay", signature.clone(), EVENT).await;
    assert!(again.body.contains(r#""status":"duplicate""#), "{}", again.body);
    // Another provider's name: its own secret does not verify acme's signature.
    let elsewhere = deliver(&app, "/webhooks/other-pay", signature.clone(), EVENT).await;
    elsewhere.assert_problem(400, "bad-signature");
    // Names nobody configured: refused before any record or label is made.
    for path in ["/webhooks/acme-pay%20", "/webhooks/x", "/webhooks/ACME-PAY"] {
        deliver(&app, path, signature.clone(), EVENT).await.assert_problem(404, "unknown-provider");
    }
    assert_eq!(state.ledger.load(Ordering::SeqCst), 1, "one event, processed more than once");
    assert_eq!(h.record_count().await, 1);
}

async fn a_delivery_signed_longer_ago_than_the_tolerance_is_refused<H: Harness>(h: H) {
    let (app, state) = router(h.store(), providers());
    // A delivery captured and replayed after the tolerance, and one from the future.
    for at in [now() - TOLERANCE.as_secs() - 60, now() + TOLERANCE.as_secs() + 60] {
        let stale = deliver(&app, "/webhooks/acme-pay", sign(ACME, at, EVENT.as_bytes()), EVENT);
        stale.await.assert_problem(400, "stale-signature");
    }
    // A signature over another time than the one it names does not verify (the clock read
    // once: a second ticking between two reads left the signature unforged, and stale).
    let (then, now) = (now() - 3600, now());
    let forged = sign(ACME, then, EVENT.as_bytes());
    let forged = forged.replacen(&format!("t={then}"), &format!("t={now}"), 1);
    assert!(forged.starts_with(&format!("t={now},")), "{forged}");
    deliver(&app, "/webhooks/acme-pay", forged, EVENT).await.assert_problem(400, "bad-signature");
    assert_eq!(state.ledger.load(Ordering::SeqCst), 0);
    assert_eq!(h.record_count().await, 0);
    // The records outlive any provider's retries; the tolerance is far shorter.
    assert!(RETENTION.as_secs() >= 3 * 24 * 3600 && TOLERANCE < RETENTION / 100);
}

async fn a_provider_retry_with_a_new_delivery_attempt_is_a_duplicate<H: Harness>(h: H) {
    let (app, state) = router(h.store(), providers());
    let retry = EVENT.replace(r#""delivery_attempt":1"#, r#""delivery_attempt":2"#);
    for (body, expected) in [(EVENT.to_owned(), "processed"), (retry, "duplicate")] {
        let seen = deliver(&app, "/webhooks/acme-pay", sign(ACME, now(), body.as_bytes()), &body);
        let seen = seen.await;
        assert!(seen.body.contains(&format!(r#""status":"{expected}""#)), "{}", seen.body);
    }
    // The same id with another amount is another payload.
    let reused = EVENT.replace(r#""amount":100"#, r#""amount":999"#);
    let seen = deliver(&app, "/webhooks/acme-pay", sign(ACME, now(), reused.as_bytes()), &reused);
    seen.await.assert_problem(422, "event-reused");
    assert_eq!(state.ledger.load(Ordering::SeqCst), 1);
}
