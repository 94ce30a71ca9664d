//! One behaviour suite, run against every store: `memory::*` and `redis::*` are the same tests.

use crate::common;

use std::time::Duration;

use axum::{
    Router,
    body::Body,
    http::{HeaderName, Request},
};
use axum::{
    extract::FromRequestParts,
    http::{StatusCode, request::Parts},
    routing::post,
};
use axum_idempotency::settings::Waiting;
use axum_idempotency::{
    HeaderScope, IdempotencyLayer, layer::scope::ExtractorScope, store::RecordKey,
};
use common::*;

every_store!(
    methods_other_than_post_and_patch_pass_through,
    requests_without_a_key_pass_through,
    missing_key_is_400_where_a_key_is_required,
    malformed_keys_are_400,
    quoted_and_bare_keys_name_the_same_record,
    patch_is_idempotent_too,
    retry_is_replayed_with_status_headers_and_body,
    body_over_the_limit_is_413,
    retry_while_in_progress_gets_202_with_retry_after,
    different_payload_is_409_in_progress_and_completed,
    server_error_releases_the_key_so_the_retry_runs,
    the_default_policy_stores_what_the_handler_acted_on,
    response_over_the_stored_limit_is_sent_and_never_run_again,
    response_over_the_stored_limit_is_released_when_so_configured,
    a_two_mebibyte_response_is_sent_and_never_run_again,
    streamed_response_over_the_stored_limit_is_sent_whole_and_never_run_again,
    streamed_response_over_the_stored_limit_is_released_when_so_configured,
    response_body_that_fails_reaches_the_client_and_is_released,
    configuration_setters_take_effect,
    scopes_keep_tenants_apart,
    extractor_scope_per_route_answers_its_rejection,
    ietf_preset_answers_409_and_422,
    completed_record_expires_after_retention,
    concurrent_duplicates_run_the_handler_once,
    lapsed_lease_is_taken_over_and_the_old_holder_fenced,
    keep_alive_holds_the_key_for_a_handler_four_times_its_lease,
    keep_alive_stops_at_its_ceiling,
    a_handler_says_not_stored_through_its_response,
);

fn layered<H: Harness>(harness: &H, calls: &Calls) -> Router {
    app(calls).layer(IdempotencyLayer::new(harness.store()))
}

async fn methods_other_than_post_and_patch_pass_through<H: Harness>(h: H) {
    let calls = Calls::default();
    let app = layered(&h, &calls);
    for _ in 0..2 {
        let seen = send(&app, keyed("GET", "/payments", "k1", "")).await;
        assert_eq!(seen.status, 201);
        assert!(!seen.replayed());
    }
    assert_eq!(calls.get(), 2);
    assert_eq!(h.record_count().await, 0);
}

async fn requests_without_a_key_pass_through<H: Harness>(h: H) {
    let calls = Calls::default();
    let app = layered(&h, &calls);
    for _ in 0..2 {
        let request = Request::post("/payments").body(Body::from("{}")).unwrap();
        let seen = send(&app, request).await;
        assert_eq!(seen.status, 201);
        assert_eq!(seen.header("set-cookie"), Some("session=secret"));
    }
    assert_eq!(calls.get(), 2);
    assert_eq!(h.record_count().await, 0);
}

async fn missing_key_is_400_where_a_key_is_required<H: Harness>(h: H) {
    let calls = Calls::default();
    let app = app(&calls).route_layer(IdempotencyLayer::new(h.store()).require_key(true));
    let seen = send(&app, Request::post("/payments").body(Body::from("{}")).unwrap()).await;
    seen.assert_problem(400, "key-missing");
    // GET is not an idempotent-handled method, so it needs no key.
    let seen = send(&app, Request::get("/payments").body(Body::empty()).unwrap()).await;
    assert_eq!(seen.status, 201);
    assert_eq!(calls.get(), 1);
    assert_eq!(h.record_count().await, 0);
}

async fn malformed_keys_are_400<H: Harness>(h: H) {
    let calls = Calls::default();
    let app = layered(&h, &calls);
    let long = "k".repeat(256);
    let bad: Vec<Vec<&[u8]>> = vec![
        vec![b""],
        vec![long.as_bytes()],
        vec![b"a b"],
        vec![b"\"unterminated"],
        vec!["caf\u{e9}".as_bytes()],
        vec![b"a\tb"],
        vec![b"one", b"two"],
        vec![b"one, two"],
        vec![b"\"k\";a=1"],
    ];
    for values in bad {
        let mut request = Request::post("/payments").body(Body::from("{}")).unwrap();
        for value in &values {
            request
                .headers_mut()
                .append("idempotency-key", axum::http::HeaderValue::from_bytes(value).unwrap());
        }
        let seen = send(&app, request).await;
        seen.assert_problem(400, "key-malformed");
        // The detail names what is wrong: a key with parameters is not told it is two.
        if values == [b"\"k\";a=1"] {
            assert!(seen.body.contains("without parameters"), "{}", seen.body);
        }
    }
    assert_eq!(calls.get(), 0);
    assert_eq!(h.record_count().await, 0);
    // 255 characters is the longest key accepted.
    let longest = "k".repeat(255);
    let seen = send(&app, keyed("POST", "/payments", &longest, "{}")).await;
    assert_eq!(seen.status, 201);
    assert_eq!(h.held(&global(&longest)).await, Some(Held::Completed));
}

async fn quoted_and_bare_keys_name_the_same_record<H: Harness>(h: H) {
    let calls = Calls::default();
    let app = layered(&h, &calls);
    let first = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    let retry = send(&app, keyed("POST", "/payments", "\"k1\"", "{}")).await;
    assert_eq!(first.status, 201);
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(calls.get(), 1);
}

async fn patch_is_idempotent_too<H: Harness>(h: H) {
    let calls = Calls::default();
    let app = layered(&h, &calls);
    send(&app, keyed("PATCH", "/payments", "k1", "{}")).await;
    let retry = send(&app, keyed("PATCH", "/payments", "k1", "{}")).await;
    assert!(retry.replayed());
    assert_eq!(calls.get(), 1);
    // The method is part of the fingerprint.
    let post = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    post.assert_problem(409, "key-reused");
    assert_eq!(calls.get(), 1);
}

async fn retry_is_replayed_with_status_headers_and_body<H: Harness>(h: H) {
    let calls = Calls::default();
    let app = layered(&h, &calls);
    let first = send(&app, keyed("POST", "/payments", "k1", r#"{"amount":100}"#)).await;
    assert_eq!(first.status, 201);
    assert_eq!(first.body, r#"{"call":1,"request":{"amount":100}}"#);
    assert_eq!(first.header("set-cookie"), Some("session=secret"));
    assert!(!first.replayed());
    assert_eq!(h.held(&global("k1")).await, Some(Held::Completed));

    for _ in 0..2 {
        let retry = send(&app, keyed("POST", "/payments", "k1", r#"{"amount":100}"#)).await;
        assert_eq!(retry.status, 201);
        assert_eq!(retry.body, first.body);
        assert_eq!(retry.header("content-type"), Some("application/json"));
        assert_eq!(retry.header("x-payment"), Some("pay_1"));
        assert_eq!(retry.header("content-length"), Some(first.body.len().to_string().as_str()));
        assert_eq!(retry.header("set-cookie"), None, "Set-Cookie must not be replayed");
        assert!(retry.replayed());
    }
    assert_eq!(calls.get(), 1);
    assert_eq!(h.record_count().await, 1);
}

async fn body_over_the_limit_is_413<H: Harness>(h: H) {
    let calls = Calls::default();
    let app = app(&calls).layer(
        IdempotencyLayer::new(h.store()).limits(axum_idempotency::layer::Limits::default().body(8)),
    );
    // Declared too large: refused before the body is read.
    let request = Request::post("/payments")
        .header("idempotency-key", "k1")
        .header("content-length", "9")
        .body(Body::from("123456789"))
        .unwrap();
    send(&app, request).await.assert_problem(413, "body-too-large");
    // No Content-Length: a streamed (chunked) body that runs over.
    let chunks = futures_util::stream::iter(["1234", "5678", "9"].map(Ok::<_, std::io::Error>));
    let request = Request::post("/payments")
        .header("idempotency-key", "k2")
        .body(Body::from_stream(chunks))
        .unwrap();
    send(&app, request).await.assert_problem(413, "body-too-large");
    assert_eq!(calls.get(), 0);
    assert_eq!(h.record_count().await, 0);
    // Exactly at the limit is fine.
    let seen = send(&app, keyed("POST", "/payments", "k3", "12345678")).await;
    assert_eq!(seen.status, 201);
    assert_eq!(calls.get(), 1);
}

async fn retry_while_in_progress_gets_202_with_retry_after<H: Harness>(h: H) {
    let calls = Calls::default();
    // Waiting off: the answer a retry gets at once (and, waiting on, past the wait).
    let layer = IdempotencyLayer::new(h.store()).waiting(Waiting::off());
    let app = app(&calls).layer(layer.lease(Duration::from_secs(5)));
    let slow = || delayed("/slow", "k1", 400, "{}");
    let first = send_until_claimed(&h, &app, slow(), "k1").await;
    let retry = send(&app, slow()).await;
    retry.assert_problem(202, "in-progress");
    let retry_after: u64 = retry.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=5).contains(&retry_after), "Retry-After {retry_after}");

    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    let after = send(&app, slow()).await;
    assert!(after.replayed());
    assert_eq!(after.body, first.body);
    assert_eq!(calls.get(), 1);
}

async fn different_payload_is_409_in_progress_and_completed<H: Harness>(h: H) {
    let calls = Calls::default();
    let app = layered(&h, &calls);
    let first = send_until_claimed(&h, &app, delayed("/slow", "k1", 300, "a"), "k1").await;
    send(&app, keyed("POST", "/slow", "k1", "b")).await.assert_problem(409, "key-reused");
    assert_eq!(first.await.unwrap().status, 201);
    send(&app, keyed("POST", "/slow", "k1", "b")).await.assert_problem(409, "key-reused");
    // Another route with the same key and body is a different request too.
    send(&app, keyed("POST", "/payments", "k1", "a")).await.assert_problem(409, "key-reused");
    assert_eq!(calls.get(), 1);
    assert_eq!(h.held(&global("k1")).await, Some(Held::Completed));
}

async fn server_error_releases_the_key_so_the_retry_runs<H: Harness>(h: H) {
    let calls = Calls::default();
    let app = layered(&h, &calls);
    let first = send(&app, keyed("POST", "/flaky", "k1", "{}")).await;
    assert_eq!(first.status, 500);
    assert_eq!(first.body, "boom");
    assert_eq!(h.held(&global("k1")).await, None);
    let retry = send(&app, keyed("POST", "/flaky", "k1", "{}")).await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed());
    let again = send(&app, keyed("POST", "/flaky", "k1", "{}")).await;
    assert!(again.replayed());
    assert_eq!(again.body, retry.body);
    assert_eq!(calls.get(), 2);
}

async fn the_default_policy_stores_what_the_handler_acted_on<H: Harness>(h: H) {
    let calls = Calls::default();
    let app = layered(&h, &calls);
    // Released: what asks for the retry (408, 429), the credentials (401, 403) and how the
    // request was sent (406, 415), which a client fixes and retries with the same key; 5xx.
    for (code, stored) in [
        (408, false),
        (429, false),
        (401, false),
        (403, false),
        (406, false),
        (415, false),
        (422, true),
        (404, true),
        (409, true),
        (400, true),
        (200, true),
        (503, false),
    ] {
        let uri = format!("/status/{code}");
        let key = format!("k{code}");
        let first = send(
            &app,
            Request::post(&uri).header("idempotency-key", &key).body(Body::empty()).unwrap(),
        )
        .await;
        assert_eq!(first.status, code);
        let retry = send(
            &app,
            Request::post(&uri).header("idempotency-key", &key).body(Body::empty()).unwrap(),
        )
        .await;
        assert_eq!(retry.status, code);
        assert_eq!(retry.replayed(), stored, "status {code}");
        let held = h.held(&global(&key)).await;
        assert_eq!(held, stored.then_some(Held::Completed), "status {code}");
    }
    // Each released status ran twice, each stored one once.
    assert_eq!(calls.get(), 7 * 2 + 5);
}

/// A response too large to keep goes whole to the client; its key keeps "completed, not
/// replayable", so that a retry (its answer lost on the way) is told so and never runs the
/// handler again.
async fn response_over_the_stored_limit_is_sent_and_never_run_again<H: Harness>(h: H) {
    let calls = Calls::default();
    let app = app(&calls).layer(
        IdempotencyLayer::new(h.store())
            .limits(axum_idempotency::layer::Limits::default().stored_body(1024)),
    );
    let seen = send(&app, keyed("POST", "/big", "k1", "")).await;
    assert_eq!((seen.status.as_u16(), seen.body.len(), seen.replayed()), (200, 4096, false));
    assert_eq!(h.held(&global("k1")).await, Some(Held::Completed));
    for _ in 0..2 {
        let retry = send(&app, keyed("POST", "/big", "k1", "")).await;
        retry.assert_problem(500, "response-not-replayable");
        assert!(retry.body.contains("status 200"), "{retry:?}");
    }
    assert_eq!(calls.get(), 1);
}

async fn response_over_the_stored_limit_is_released_when_so_configured<H: Harness>(h: H) {
    let calls = Calls::default();
    let layer = IdempotencyLayer::new(h.store()).limits(
        axum_idempotency::layer::Limits::default().stored_body(1024).release_when_too_large(true),
    );
    let app = app(&calls).layer(layer);
    for _ in 0..2 {
        let seen = send(&app, keyed("POST", "/big", "k1", "")).await;
        assert_eq!((seen.status.as_u16(), seen.body.len(), seen.replayed()), (200, 4096, false));
        assert_eq!(h.held(&global("k1")).await, None);
    }
    assert_eq!(calls.get(), 2);
}

/// Under the default limits (1 MiB): a 2 MiB response, and its retry.
async fn a_two_mebibyte_response_is_sent_and_never_run_again<H: Harness>(h: H) {
    let calls = Calls::default();
    let counted = calls.clone();
    let handler = move || async move {
        counted.next_call();
        (StatusCode::CREATED, vec![b'x'; 2 * 1024 * 1024])
    };
    let app = Router::new().route("/huge", post(handler)).layer(IdempotencyLayer::new(h.store()));
    let seen = send(&app, keyed("POST", "/huge", "k1", "")).await;
    assert_eq!((seen.status, seen.body.len()), (StatusCode::CREATED, 2 * 1024 * 1024));
    let retry = send(&app, keyed("POST", "/huge", "k1", "")).await;
    retry.assert_problem(500, "response-not-replayable");
    assert!(retry.body.contains("status 201"), "{retry:?}");
    assert_eq!(calls.get(), 1);
}

async fn scopes_keep_tenants_apart<H: Harness>(h: H) {
    let calls = Calls::default();
    let layer = IdempotencyLayer::new(h.store()).scope(HeaderScope::new("X-Tenant").unwrap());
    let app = app(&calls).layer(layer);
    let as_tenant = |tenant: &str| {
        Request::post("/payments")
            .header("idempotency-key", "shared-key")
            .header("x-tenant", tenant)
            .body(Body::from("{}"))
            .unwrap()
    };
    let a = send(&app, as_tenant("a")).await;
    let b = send(&app, as_tenant("b")).await;
    assert!(!b.replayed(), "tenant b was replayed tenant a's response");
    assert_eq!(b.header("x-payment"), Some("pay_2"));
    let a_again = send(&app, as_tenant("a")).await;
    assert!(a_again.replayed());
    assert_eq!(a_again.body, a.body);
    assert_eq!(calls.get(), 2);
    assert_eq!(
        h.held(&RecordKey::new("idempotency", b"a", b"shared-key")).await,
        Some(Held::Completed)
    );
    assert_eq!(
        h.held(&RecordKey::new("idempotency", b"b", b"shared-key")).await,
        Some(Held::Completed)
    );
    // Without the scope header the request is refused, not put in a shared scope, and the
    // problem's detail names the header it expected.
    let missing = send(&app, keyed("POST", "/payments", "shared-key", "{}")).await;
    missing.assert_problem(400, "scope-missing");
    let detail: serde_json::Value = serde_json::from_str(&missing.body).expect("problem JSON");
    assert_eq!(
        detail["detail"], "the request has no `x-tenant` header, which names its idempotency scope",
        "{missing:?}"
    );
    // Two values are no scope either: the detail says the header repeats.
    let repeated = Request::post("/payments")
        .header("idempotency-key", "shared-key")
        .header("x-tenant", "a")
        .header("x-tenant", "b")
        .body(Body::from("{}"))
        .unwrap();
    let repeated = send(&app, repeated).await;
    repeated.assert_problem(400, "scope-missing");
    let detail: serde_json::Value = serde_json::from_str(&repeated.body).expect("problem JSON");
    assert_eq!(
        detail["detail"],
        "the `x-tenant` header, which names the request's idempotency scope, is repeated",
        "{repeated:?}"
    );
    assert_eq!(calls.get(), 2);
    assert_eq!(h.record_count().await, 2);
}

async fn ietf_preset_answers_409_and_422<H: Harness>(h: H) {
    let calls = Calls::default();
    let layer = IdempotencyLayer::new(h.store()).waiting(Waiting::off());
    let app = app(&calls).layer(layer.answers(axum_idempotency::layer::Answers::ietf_draft()));
    let first = send_until_claimed(&h, &app, delayed("/slow", "k1", 300, "a"), "k1").await;
    let busy = send(&app, keyed("POST", "/slow", "k1", "a")).await;
    busy.assert_problem(409, "in-progress");
    assert!(busy.header("retry-after").is_some());
    send(&app, keyed("POST", "/slow", "k1", "b")).await.assert_problem(422, "key-reused");
    assert_eq!(first.await.unwrap().status, 201);
    assert!(send(&app, keyed("POST", "/slow", "k1", "a")).await.replayed());
    assert_eq!(calls.get(), 1);
}

async fn completed_record_expires_after_retention<H: Harness>(h: H) {
    let calls = Calls::default();
    let app =
        app(&calls).layer(IdempotencyLayer::new(h.store()).retention(Duration::from_millis(300)));
    send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    assert!(send(&app, keyed("POST", "/payments", "k1", "{}")).await.replayed());
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(h.held(&global("k1")).await, None);
    let after = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    assert!(!after.replayed());
    assert_eq!(after.header("x-payment"), Some("pay_2"));
    assert_eq!(calls.get(), 2);
}

async fn concurrent_duplicates_run_the_handler_once<H: Harness>(h: H) {
    let calls = Calls::default();
    fifty_duplicates_at_once(&[layered(&h, &calls)]).await;
    assert_eq!(calls.get(), 1);
    assert_eq!(h.held(&global("k1")).await, Some(Held::Completed));
}

async fn lapsed_lease_is_taken_over_and_the_old_holder_fenced<H: Harness>(h: H) {
    let calls = Calls::default();
    let layer = IdempotencyLayer::new(h.store()).lease(Duration::from_millis(150)).keep_alive(None);
    let app = app(&calls).layer(layer);
    let request = || delayed("/first-slow", "k1", 600, "{}");
    let first = send_until_claimed(&h, &app, request(), "k1").await;
    tokio::time::sleep(Duration::from_millis(250)).await;
    // The first holder's lease has lapsed: this request takes the key over and completes.
    let second = send(&app, request()).await;
    assert_eq!(second.status, 201);
    assert!(!second.replayed());
    assert_eq!(second.header("x-payment"), Some("pay_2"));
    // The first holder finishes later; its client gets its own answer, but it cannot
    // overwrite the record that the second owner wrote.
    let first = first.await.unwrap();
    assert_eq!(first.header("x-payment"), Some("pay_1"));
    let retry = send(&app, request()).await;
    assert!(retry.replayed());
    assert_eq!(retry.header("x-payment"), Some("pay_2"));
    assert_eq!(calls.get(), 2);
}

/// An app's own authenticated-user extractor.
struct User(String);

impl<S: Send + Sync> FromRequestParts<S> for User {
    type Rejection = (StatusCode, &'static str);

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        match parts.headers.get("authorization").and_then(|v| v.to_str().ok()) {
            Some(token) if token.starts_with("user ") => Ok(User(token[5..].to_owned())),
            _ => Err((StatusCode::UNAUTHORIZED, "who are you?")),
        }
    }
}

async fn extractor_scope_per_route_answers_its_rejection<H: Harness>(h: H) {
    let calls = Calls::default();
    let by_user = IdempotencyLayer::new(h.store()).scope(ExtractorScope::new(|user: User| user.0));
    // Only /orders is scoped by user; /payments keeps the global scope.
    let orders = Router::new().route("/orders", post(|| async { "ordered" })).route_layer(by_user);
    let app = app(&calls).layer(IdempotencyLayer::new(h.store())).merge(orders);
    let as_user = |user: &str| {
        Request::post("/orders")
            .header("idempotency-key", "k1")
            .header("authorization", format!("user {user}"))
            .body(Body::empty())
            .unwrap()
    };
    assert!(!send(&app, as_user("ann")).await.replayed());
    assert!(!send(&app, as_user("bob")).await.replayed());
    assert!(send(&app, as_user("ann")).await.replayed());
    assert_eq!(h.held(&RecordKey::new("idempotency", b"ann", b"k1")).await, Some(Held::Completed));
    assert_eq!(h.held(&RecordKey::new("idempotency", b"bob", b"k1")).await, Some(Held::Completed));

    let anonymous = send(&app, keyed("POST", "/orders", "k1", "")).await;
    assert_eq!(anonymous.status, 401);
    assert_eq!(anonymous.body, "who are you?");
    assert_eq!(h.record_count().await, 2);

    // The global-scope route is unaffected by the per-route scope.
    send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    assert!(send(&app, keyed("POST", "/payments", "k1", "{}")).await.replayed());
    assert_eq!(calls.get(), 1);
}

/// Sends `/first-slow` with a first call of `first_ms`, retries after each of `pauses` (from
/// when the claim is seen), and returns (the first answer, the retries).
async fn outlive_the_lease<H: Harness>(
    h: &H,
    app: &Router,
    first_ms: u64,
    pauses: [u64; 2],
) -> (Seen, Vec<Seen>) {
    let request = || delayed("/first-slow", "k1", first_ms, "{}");
    let first = send_until_claimed(h, app, request(), "k1").await;
    let mut retries = Vec::new();
    for pause in pauses {
        tokio::time::sleep(Duration::from_millis(pause)).await;
        retries.push(send(app, request()).await);
    }
    (first.await.unwrap(), retries)
}

async fn keep_alive_holds_the_key_for_a_handler_four_times_its_lease<H: Harness>(h: H) {
    let calls = Calls::default();
    let layer = IdempotencyLayer::new(h.store())
        .waiting(Waiting::off())
        .lease(Duration::from_millis(300))
        .keep_alive(Some(Duration::from_secs(10)));
    let app = app(&calls).layer(layer);
    // Retries at about 450 ms and 1000 ms, while a 1200 ms first call runs.
    let (first, retries) = outlive_the_lease(&h, &app, 1200, [450, 550]).await;
    for retry in &retries {
        retry.assert_problem(202, "in-progress");
    }
    assert_eq!(first.header("x-payment"), Some("pay_1"));
    let after = send(&app, keyed("POST", "/first-slow", "k1", "{}")).await;
    assert!(after.replayed());
    assert_eq!(after.header("x-payment"), Some("pay_1"));
    assert_eq!(calls.get(), 1);
}

async fn keep_alive_stops_at_its_ceiling<H: Harness>(h: H) {
    let calls = Calls::default();
    let layer = IdempotencyLayer::new(h.store())
        .waiting(Waiting::off())
        .lease(Duration::from_millis(600))
        .keep_alive(Some(Duration::from_millis(800)));
    let app = app(&calls).layer(layer);
    // A 2500 ms first call, renewed every 200 ms until the 800 ms ceiling (the lease then runs
    // to about 1400 ms), not after: the retry at about 450 ms still waits, the one at about
    // 1750 ms takes the key over while the first still runs. Wide margins: a loaded machine
    // runs each step late.
    let (first, retries) = outlive_the_lease(&h, &app, 2500, [450, 1300]).await;
    retries[0].assert_problem(202, "in-progress");
    assert_eq!(retries[1].status, 201);
    assert_eq!(retries[1].header("x-payment"), Some("pay_2"));
    assert_eq!(first.header("x-payment"), Some("pay_1"));
    assert_eq!(calls.get(), 2);
}

async fn streamed_response_over_the_stored_limit_is_sent_whole_and_never_run_again<H: Harness>(
    h: H,
) {
    let calls = Calls::default();
    let app = app(&calls).layer(
        IdempotencyLayer::new(h.store())
            .limits(axum_idempotency::layer::Limits::default().stored_body(1500)),
    );
    let seen = send(&app, keyed("POST", "/streamed", "k1", "")).await;
    assert_eq!(seen.status, 200);
    // What the layer read before it saw the limit, then the rest: nothing lost, in order.
    let expected: String = ["a", "b", "c", "d"].iter().map(|c| c.repeat(1024)).collect();
    assert_eq!(seen.body, expected);
    assert!(!seen.replayed());
    assert_eq!(h.held(&global("k1")).await, Some(Held::Completed));
    let retry = send(&app, keyed("POST", "/streamed", "k1", "")).await;
    retry.assert_problem(500, "response-not-replayable");
    assert_eq!(calls.get(), 1);
}

async fn streamed_response_over_the_stored_limit_is_released_when_so_configured<H: Harness>(h: H) {
    let calls = Calls::default();
    let layer = IdempotencyLayer::new(h.store()).limits(
        axum_idempotency::layer::Limits::default().stored_body(1500).release_when_too_large(true),
    );
    let app = app(&calls).layer(layer);
    for _ in 0..2 {
        let seen = send(&app, keyed("POST", "/streamed", "k1", "")).await;
        assert_eq!((seen.status.as_u16(), seen.body.len(), seen.replayed()), (200, 4096, false));
        assert_eq!(h.held(&global("k1")).await, None);
    }
    assert_eq!(calls.get(), 2);
}

async fn response_body_that_fails_reaches_the_client_and_is_released<H: Harness>(h: H) {
    use http_body_util::BodyExt as _;
    use tower::ServiceExt as _;
    let calls = Calls::default();
    let app = layered(&h, &calls);
    for call in 1..=2 {
        // The body streams through: the client has the head and the first chunk before the
        // body fails, and then the failure itself, where it happened.
        let response = app.clone().oneshot(keyed("POST", "/broken-body", "k1", "")).await.unwrap();
        assert_eq!(response.status(), 200);
        let mut body = response.into_body();
        let first = body.frame().await.expect("a first frame").expect("the first chunk");
        assert_eq!(first.into_data().unwrap(), "partial");
        assert!(body.frame().await.expect("the failure").is_err());
        eventually("the key is released", async || h.held(&global("k1")).await.is_none()).await;
        assert_eq!(calls.get(), call);
    }
}

async fn configuration_setters_take_effect<H: Harness>(h: H) {
    let calls = Calls::default();
    let layer = IdempotencyLayer::new(h.store())
        .methods([axum::http::Method::PUT])
        .header_name(HeaderName::from_static("x-idem"))
        .key_prefix("pay")
        .answers(
            axum_idempotency::layer::Answers::default()
                .include_replayed_header(axum::http::header::SET_COOKIE)
                .exclude_replayed_header(HeaderName::from_static("x-payment")),
        )
        .store_policy(|response: &http::response::Parts| response.status.is_server_error());
    let app = app(&calls).layer(layer);
    let request = |method: &str, uri: &str, header: &str, key: &str| {
        Request::builder()
            .method(method)
            .uri(uri)
            .header(header, key)
            .body(Body::from("{}"))
            .unwrap()
    };
    // The store policy keeps only 5xx: a 201 is released and the retry runs again.
    for _ in 0..2 {
        let seen = send(&app, request("PUT", "/payments", "x-idem", "k1")).await;
        assert_eq!(seen.status, 201);
        assert!(!seen.replayed());
    }
    assert_eq!(calls.get(), 2);
    // A 503 is stored, under the prefix, with Set-Cookie and without X-Payment.
    let first = send(&app, request("PUT", "/unavailable", "x-idem", "k2")).await;
    let replay = send(&app, request("PUT", "/unavailable", "x-idem", "k2")).await;
    assert_eq!((first.status.as_u16(), replay.status.as_u16()), (503, 503));
    assert!(replay.replayed());
    assert_eq!(replay.header("set-cookie"), Some("session=secret"));
    assert_eq!(first.header("x-payment"), Some("pay_3"));
    assert_eq!(replay.header("x-payment"), None);
    assert_eq!(h.held(&RecordKey::new("pay", b"", b"k2")).await, Some(Held::Completed));
    assert_eq!(h.held(&global("k2")).await, None);
    assert_eq!(calls.get(), 3);
    // POST is not handled any more, and the default header name means nothing.
    for _ in 0..2 {
        assert!(!send(&app, request("POST", "/unavailable", "x-idem", "k3")).await.replayed());
        assert!(
            !send(&app, request("PUT", "/unavailable", "idempotency-key", "k4")).await.replayed()
        );
    }
    assert_eq!(calls.get(), 7);
    assert_eq!(h.record_count().await, 1);
}

/// A handler says "not stored" with `ReleaseKey` in its response, whatever its status: the key
/// is released and the retry runs; a store policy sees the response's headers.
async fn a_handler_says_not_stored_through_its_response<H: Harness>(h: H) {
    use axum::response::IntoResponse as _;
    use axum_idempotency::layer::ReleaseKey;
    let calls = Calls::default();
    let busy = {
        let calls = calls.clone();
        move || async move {
            match calls.next_call() {
                1 => (StatusCode::CONFLICT, ReleaseKey, "the ledger is busy").into_response(),
                call => (StatusCode::CREATED, format!("pay_{call}")).into_response(),
            }
        }
    };
    let app = Router::new().route("/busy", post(busy)).layer(IdempotencyLayer::new(h.store()));
    let first = send(&app, keyed("POST", "/busy", "k1", "{}")).await;
    assert_eq!((first.status.as_u16(), first.replayed()), (409, false));
    // A 409 the default policy stores: released, for the marker.
    assert_eq!(h.held(&global("k1")).await, None);
    let second = send(&app, keyed("POST", "/busy", "k1", "{}")).await;
    assert_eq!((second.status.as_u16(), second.body.as_str()), (201, "pay_2"));
    let third = send(&app, keyed("POST", "/busy", "k1", "{}")).await;
    assert_eq!(
        (third.status.as_u16(), third.body.as_str(), third.replayed()),
        (201, "pay_2", true)
    );
    assert_eq!(calls.get(), 2);

    // A policy over the head: only responses the handler marks final are stored.
    let marked = {
        let calls = calls.clone();
        move |body: String| async move {
            let call = calls.next_call();
            let status = StatusCode::ACCEPTED;
            match body.as_str() {
                "final" => (status, [("x-final", "1")], format!("job_{call}")).into_response(),
                _ => (status, format!("job_{call}")).into_response(),
            }
        }
    };
    let policy = |response: &axum::http::response::Parts| response.headers.contains_key("x-final");
    let layer = IdempotencyLayer::new(h.store()).store_policy(policy);
    let app = Router::new().route("/jobs", post(marked)).layer(layer);
    for body in ["pending", "pending", "final", "final"] {
        send(&app, keyed("POST", "/jobs", body, body)).await;
    }
    assert_eq!(h.held(&global("pending")).await, None);
    assert_eq!(h.held(&global("final")).await, Some(Held::Completed));
    // Two runs of "pending", one of "final" (its retry replayed).
    assert_eq!(calls.get(), 2 + 3);
}
