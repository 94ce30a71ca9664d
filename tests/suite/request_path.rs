//! Edges of the request path that each hold a promise of the docs: what the fingerprint
//! covers, where the limits fall, how a failing inner service or a panic leaves the key, and
//! what the layer's answers say. Run against every store.

use crate::common;

use std::time::Duration;

use axum::{
    Router,
    body::Body,
    http::{Request, Response},
};
use axum_idempotency::settings::Waiting;
use axum_idempotency::{
    Fingerprint, IdempotencyLayer,
    layer::Fingerprinting,
    store::{OwnerToken, Store},
};
use common::*;
use tower::{ServiceBuilder, ServiceExt};

every_store!(
    a_store_policy_that_panics_is_resumed_and_releases_the_key,
    one_key_on_two_resources_of_one_route_is_409,
    one_key_on_two_resources_through_a_nested_router_is_409,
    the_query_string_is_part_of_the_request,
    a_declared_length_within_the_limit_is_read,
    a_response_of_exactly_the_stored_limit_is_stored,
    retry_after_is_never_under_one_second,
    an_inner_service_error_releases_the_key,
    a_panic_is_resumed_as_the_handlers_own_and_releases_the_key,
    a_malformed_key_problem_says_what_a_key_must_be,
    a_quoted_key_with_a_space_is_one_key,
    a_request_no_route_matched_uses_up_no_key,
    a_405_is_never_stored,
    compression_outside_the_layer_compresses_each_replay_for_its_client,
    compression_inside_never_replays_an_encoding_the_retry_refuses,
    canonical_json_replays_a_reserialized_body_and_ignores_volatile_members,
    a_selected_header_that_changes_is_409,
    a_custom_fingerprint_decides_what_a_retry_is,
    a_large_corrupt_record_is_500_not_a_panic,
);

fn layered<H: Harness>(h: &H, calls: &Calls) -> Router {
    app(calls).layer(IdempotencyLayer::new(h.store()))
}

async fn one_key_on_two_resources_of_one_route_is_409<H: Harness>(h: H) {
    let calls = Calls::default();
    let app = layered(&h, &calls);
    let first = send(&app, keyed("POST", "/orders/1/capture", "k1", "{}")).await;
    assert_eq!(first.status, 201);
    // Same route template, same key, same body: another order. Replaying order 1's answer for
    // order 2 would be another request's result.
    send(&app, keyed("POST", "/orders/2/capture", "k1", "{}"))
        .await
        .assert_problem(409, "key-reused");
    let retry = send(&app, keyed("POST", "/orders/1/capture", "k1", "{}")).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(calls.get(), 1);
}

async fn one_key_on_two_resources_through_a_nested_router_is_409<H: Harness>(h: H) {
    let calls = Calls::default();
    let app = Router::new().nest("/v1", layered(&h, &calls));
    assert_eq!(send(&app, keyed("POST", "/v1/orders/1/capture", "k1", "{}")).await.status, 201);
    send(&app, keyed("POST", "/v1/orders/2/capture", "k1", "{}"))
        .await
        .assert_problem(409, "key-reused");
    // The record's fingerprint is the full original path, wherever the layer sits: the same
    // request through a router without the prefix is another request.
    let store = h.store();
    let nested = Fingerprint::new("POST", "/v1/orders/1/capture", "", b"{}");
    let claim = store
        .claim(&global("k1"), &nested, &OwnerToken::random(), Duration::from_secs(1).into())
        .await;
    assert!(matches!(claim.unwrap(), axum_idempotency::store::Claim::Replay { .. }));
    assert_eq!(calls.get(), 1);
}

async fn the_query_string_is_part_of_the_request<H: Harness>(h: H) {
    let calls = Calls::default();
    let app = layered(&h, &calls);
    assert_eq!(send(&app, keyed("POST", "/payments?amount=1", "k1", "{}")).await.status, 201);
    send(&app, keyed("POST", "/payments?amount=2", "k1", "{}"))
        .await
        .assert_problem(409, "key-reused");
    assert!(send(&app, keyed("POST", "/payments?amount=1", "k1", "{}")).await.replayed());
    assert_eq!(calls.get(), 1);
}

async fn a_declared_length_within_the_limit_is_read<H: Harness>(h: H) {
    let calls = Calls::default();
    let app = app(&calls).layer(
        IdempotencyLayer::new(h.store()).limits(axum_idempotency::layer::Limits::default().body(8)),
    );
    for (key, body) in [("k1", "1234567"), ("k2", "12345678")] {
        let request = Request::post("/payments")
            .header("idempotency-key", key)
            .header("content-length", body.len().to_string())
            .body(Body::from(body))
            .unwrap();
        let seen = send(&app, request).await;
        assert_eq!(seen.status, 201, "{key}: {seen:?}");
        assert!(seen.body.contains(body));
    }
    assert_eq!(calls.get(), 2);
}

async fn a_response_of_exactly_the_stored_limit_is_stored<H: Harness>(h: H) {
    let calls = Calls::default();
    // `/big` answers 4096 bytes; a limit of 4096 stores it, 4095 does not.
    let at_limit = app(&calls).layer(
        IdempotencyLayer::new(h.store())
            .limits(axum_idempotency::layer::Limits::default().stored_body(4096)),
    );
    let first = send(&at_limit, keyed("POST", "/big", "k1", "")).await;
    assert_eq!(first.body.len(), 4096);
    let retry = send(&at_limit, keyed("POST", "/big", "k1", "")).await;
    assert!(retry.replayed());
    assert_eq!(retry.body.len(), 4096);
    let under = app(&calls).layer(
        IdempotencyLayer::new(h.store())
            .limits(axum_idempotency::layer::Limits::default().stored_body(4095)),
    );
    assert_eq!(send(&under, keyed("POST", "/big", "k2", "")).await.body.len(), 4096);
    // Too large to keep: the key is held as completed, not replayable.
    assert_eq!(h.held(&global("k2")).await, Some(Held::Completed));
    send(&under, keyed("POST", "/big", "k2", ""))
        .await
        .assert_problem(500, "response-not-replayable");
    assert_eq!(calls.get(), 2);
}

async fn retry_after_is_never_under_one_second<H: Harness>(h: H) {
    let calls = Calls::default();
    let layer = IdempotencyLayer::new(h.store()).lease(Duration::from_millis(600)).keep_alive(None);
    let app = app(&calls).layer(layer.waiting(Waiting::off()));
    let first = send_until_claimed(&h, &app, delayed("/slow", "k1", 500, "{}"), "k1").await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Under a second of lease is left: the answer rounds up, never to 0 ("retry now").
    let retry = send(&app, delayed("/slow", "k1", 500, "{}")).await;
    retry.assert_problem(202, "in-progress");
    assert_eq!(retry.header("retry-after"), Some("1"));
    first.await.unwrap();
}

async fn an_inner_service_error_releases_the_key<H: Harness>(h: H) {
    let calls = Calls::default();
    let counted = calls.clone();
    let service = ServiceBuilder::new().layer(IdempotencyLayer::new(h.store())).service_fn(
        move |_request: Request<Body>| {
            let call = counted.next_call();
            async move {
                if call == 1 {
                    return Err("the inner service failed");
                }
                Ok::<_, &str>(Response::new(Body::from(format!("call {call}"))))
            }
        },
    );
    let request = || keyed("POST", "/payments", "k1", "{}");
    let error =
        service.clone().oneshot(request()).await.expect_err("the inner error goes out as is");
    assert_eq!(error, "the inner service failed");
    eventually("the key is released", async || h.held(&global("k1")).await.is_none()).await;
    let retry = service.clone().oneshot(request()).await.expect("second call succeeds");
    assert_eq!(retry.status(), 200);
    assert_eq!(calls.get(), 2);
    assert_eq!(h.held(&global("k1")).await, Some(Held::Completed));
}

async fn a_panic_is_resumed_as_the_handlers_own_and_releases_the_key<H: Harness>(h: H) {
    let calls = Calls::default();
    let app = layered(&h, &calls);
    // No CatchPanicLayer: the panic must reach the caller as the handler's own, not as a
    // response the layer made up.
    let joined = tokio::spawn(app.clone().oneshot(keyed("POST", "/panic", "k1", ""))).await;
    let panic = joined.expect_err("the panic propagates").into_panic();
    let message = panic.downcast_ref::<&str>().copied().unwrap_or_default();
    assert_eq!(message, "handler panicked on purpose");
    assert_eq!(h.held(&global("k1")).await, None);
    assert_eq!(calls.get(), 1);
}

async fn a_malformed_key_problem_says_what_a_key_must_be<H: Harness>(h: H) {
    let calls = Calls::default();
    let app = layered(&h, &calls);
    let seen = send(&app, keyed("POST", "/payments", "caf\u{e9}", "{}")).await;
    seen.assert_problem(400, "key-malformed");
    let problem: serde_json::Value = serde_json::from_str(&seen.body).unwrap();
    assert_eq!(
        problem["detail"],
        "the Idempotency-Key must be 1 to 255 visible ASCII characters, or printable ASCII characters (spaces included) as a quoted string"
    );
    let seen = send(&app, keyed("POST", "/payments", "a, b", "{}")).await;
    let problem: serde_json::Value = serde_json::from_str(&seen.body).unwrap();
    assert_eq!(
        problem["detail"],
        "the Idempotency-Key header must appear exactly once, with one value"
    );
    assert_eq!(calls.get(), 0);
}

async fn a_large_corrupt_record_is_500_not_a_panic<H: Harness>(h: H) {
    let calls = Calls::default();
    let app = layered(&h, &calls);
    // A stored response of 400,000 bytes whose header count reads 0xffff: more headers than
    // `HeaderMap` can hold, in a blob large enough to seem to have room for them.
    let mut blob = vec![0u8; 400_000];
    // Format 2 (an HTTP response), its completion time, status 200, 0xffff headers.
    blob[0] = 2;
    blob[9..13].copy_from_slice(&[0, 200, 0xff, 0xff]);
    let store = h.store();
    let fingerprint = Fingerprint::new("POST", "/payments", "", b"{}");
    let owner = OwnerToken::random();
    let long = Duration::from_secs(60);
    store.claim(&global("k1"), &fingerprint, &owner, long.into()).await.unwrap();
    store.complete(&global("k1"), &owner, &fingerprint, blob.into(), long).await.unwrap();
    let seen = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    seen.assert_problem(500, "corrupt-record");
    // Left alone, and the handler did not run.
    assert_eq!(h.held(&global("k1")).await, Some(Held::Completed));
    assert_eq!(calls.get(), 0);
}

async fn a_quoted_key_with_a_space_is_one_key<H: Harness>(h: H) {
    let calls = Calls::default();
    let app = layered(&h, &calls);
    // RFC 8941 sf-strings, which the IETF draft makes the key, may hold spaces.
    let first = send(&app, keyed("POST", "/payments", "\"order 1\"", "{}")).await;
    assert_eq!(first.status, 201);
    let retry = send(&app, keyed("POST", "/payments", "\"order 1\"", "{}")).await;
    assert!(retry.replayed());
    assert_eq!(h.held(&global("order 1")).await, Some(Held::Completed));
    // Bare, a space is still malformed: it is no token.
    send(&app, keyed("POST", "/payments", "order 1", "{}"))
        .await
        .assert_problem(400, "key-malformed");
    assert_eq!(calls.get(), 1);
}

async fn a_request_no_route_matched_uses_up_no_key<H: Harness>(h: H) {
    let calls = Calls::default();
    let app = layered(&h, &calls);
    for _ in 0..2 {
        let seen = send(&app, keyed("POST", "/no-such-path", "k1", "{}")).await;
        assert_eq!(seen.status, 404);
        assert!(!seen.replayed());
    }
    assert_eq!(h.record_count().await, 0);
    // The key is still free for the real request.
    assert_eq!(send(&app, keyed("POST", "/payments", "k1", "{}")).await.status, 201);
    assert_eq!(calls.get(), 1);
}

async fn a_405_is_never_stored<H: Harness>(h: H) {
    let calls = Calls::default();
    let routes = layered(&h, &calls);
    // `/slow` takes POST only.
    for _ in 0..2 {
        let seen = send(&routes, keyed("PATCH", "/slow", "k1", "{}")).await;
        assert_eq!(seen.status, 405);
        assert!(!seen.replayed());
        assert_eq!(h.held(&global("k1")).await, None);
    }
    // Even with a store policy that stores everything.
    let everything = app(&calls)
        .layer(IdempotencyLayer::new(h.store()).store_policy(|_: &http::response::Parts| true));
    assert_eq!(send(&everything, keyed("PATCH", "/slow", "k2", "{}")).await.status, 405);
    assert_eq!(h.held(&global("k2")).await, None);
    assert_eq!(calls.get(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_memory_store_answers_503_and_evicts_no_record() {
    let store = axum_idempotency::MemoryStore::with_capacity(2);
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(store.clone()));
    for key in ["k1", "k2"] {
        assert_eq!(send(&app, keyed("POST", "/payments", key, "{}")).await.status, 201);
    }
    let full = send(&app, keyed("POST", "/payments", "k3", "{}")).await;
    full.assert_problem(503, "store-unavailable");
    assert_eq!(full.header("retry-after"), Some("1"));
    // Nothing was evicted to make room: both stored responses are still replayed.
    for key in ["k1", "k2"] {
        assert!(send(&app, keyed("POST", "/payments", key, "{}")).await.replayed());
    }
    assert_eq!(store.len(), 2);
    assert_eq!(calls.get(), 2);
}

fn gzip_request(key: &str, accept: &'static str) -> Request<Body> {
    Request::post("/big")
        .header("idempotency-key", key)
        .header("accept-encoding", accept)
        .body(Body::empty())
        .unwrap()
}

async fn compression_outside_the_layer_compresses_each_replay_for_its_client<H: Harness>(h: H) {
    use tower_http::compression::CompressionLayer;
    let calls = Calls::default();
    // The recommended order: compression outside, so the record is the handler's own body.
    let app = app(&calls).layer(IdempotencyLayer::new(h.store())).layer(CompressionLayer::new());
    let first = send(&app, gzip_request("k1", "gzip")).await;
    assert_eq!(first.header("content-encoding"), Some("gzip"));
    let plain = send(&app, gzip_request("k1", "identity")).await;
    assert!(plain.replayed());
    assert_eq!(plain.header("content-encoding"), None);
    assert_eq!(plain.body, "x".repeat(4096));
    let gzip = send(&app, gzip_request("k1", "gzip")).await;
    assert!(gzip.replayed());
    assert_eq!(gzip.header("content-encoding"), Some("gzip"));
    assert_eq!(calls.get(), 1);
}

async fn compression_inside_never_replays_an_encoding_the_retry_refuses<H: Harness>(h: H) {
    use tower_http::compression::CompressionLayer;
    let calls = Calls::default();
    let app = app(&calls).layer(CompressionLayer::new()).layer(IdempotencyLayer::new(h.store()));
    let first = send(&app, gzip_request("k1", "gzip")).await;
    assert_eq!(first.header("content-encoding"), Some("gzip"));
    // A retry that takes gzip gets the stored gzip body.
    let gzip = send(&app, gzip_request("k1", "gzip")).await;
    assert!(gzip.replayed());
    assert_eq!(gzip.header("content-encoding"), Some("gzip"));
    // One that does not is refused, never handed gzip, and the handler does not run again.
    send(&app, gzip_request("k1", "identity")).await.assert_problem(406, "encoding-not-acceptable");
    assert_eq!(calls.get(), 1);
}

async fn canonical_json_replays_a_reserialized_body_and_ignores_volatile_members<H: Harness>(h: H) {
    let calls = Calls::default();
    let layer = IdempotencyLayer::new(h.store())
        .fingerprinting(Fingerprinting::default().ignore_json_member("/client_sent_at"));
    let app = app(&calls).layer(layer);
    let first = send(
        &app,
        keyed("POST", "/payments", "k1", r#"{"amount":100,"currency":"EUR","client_sent_at":1}"#),
    )
    .await;
    assert_eq!(first.status, 201);
    // Another member order, other whitespace, another number form, another timestamp.
    let retry = send(
        &app,
        keyed(
            "POST",
            "/payments",
            "k1",
            "{ \"currency\": \"EUR\",\n \"amount\": 1e2, \"client_sent_at\": 2 }",
        ),
    )
    .await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, first.body);
    // What the client means did change: 409.
    send(&app, keyed("POST", "/payments", "k1", r#"{"amount":101,"currency":"EUR"}"#))
        .await
        .assert_problem(409, "key-reused");
    // A body that is not JSON is its bytes.
    assert_eq!(send(&app, keyed("POST", "/payments", "k2", "amount=100")).await.status, 201);
    assert!(send(&app, keyed("POST", "/payments", "k2", "amount=100")).await.replayed());
    send(&app, keyed("POST", "/payments", "k2", "amount=100 "))
        .await
        .assert_problem(409, "key-reused");
    assert_eq!(calls.get(), 2);
}

async fn a_selected_header_that_changes_is_409<H: Harness>(h: H) {
    let calls = Calls::default();
    let version = axum::http::HeaderName::from_static("x-api-version");
    let app = app(&calls).layer(
        IdempotencyLayer::new(h.store()).fingerprinting(Fingerprinting::default().header(version)),
    );
    let request = |v: &str| {
        Request::post("/payments")
            .header("idempotency-key", "k1")
            .header("x-api-version", v)
            .body(Body::from("{}"))
            .unwrap()
    };
    assert_eq!(send(&app, request("2024-01-01")).await.status, 201);
    assert!(send(&app, request("2024-01-01")).await.replayed());
    send(&app, request("2025-06-01")).await.assert_problem(409, "key-reused");
    assert_eq!(calls.get(), 1);
}

async fn a_custom_fingerprint_decides_what_a_retry_is<H: Harness>(h: H) {
    let calls = Calls::default();
    // The app's own rule: the path alone.
    let layer = IdempotencyLayer::new(h.store()).fingerprinting(Fingerprinting::custom(
        |parts: &axum::http::request::Parts, _body: &[u8]| {
            axum_idempotency::Fingerprint::new("", parts.uri.path(), "", b"")
        },
    ));
    let app = app(&calls).layer(layer);
    assert_eq!(send(&app, keyed("POST", "/payments", "k1", "one body")).await.status, 201);
    assert!(send(&app, keyed("POST", "/payments", "k1", "another body")).await.replayed());
    assert_eq!(calls.get(), 1);
}

/// A store policy is the user's code, run in the settle: its panic releases the key and reaches
/// the caller, as a handler's does (the key is not left claimed until its lease lapses).
async fn a_store_policy_that_panics_is_resumed_and_releases_the_key<H: Harness>(h: H) {
    let calls = Calls::default();
    let policy = |_: &axum::http::response::Parts| -> bool { panic!("the policy panicked") };
    let app = app(&calls).layer(IdempotencyLayer::new(h.store()).store_policy(policy));
    let joined = tokio::spawn(app.clone().oneshot(keyed("POST", "/payments", "k1", "{}"))).await;
    let panic = joined.expect_err("the panic propagates").into_panic();
    assert_eq!(panic.downcast_ref::<&str>().copied(), Some("the policy panicked"));
    assert_eq!(h.held(&global("k1")).await, None);
    assert_eq!(calls.get(), 1);
}
