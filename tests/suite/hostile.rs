//! Hostile and odd input: every answer is a clear status, nothing panics, nothing is stored
//! that should not be.

use crate::common;

use std::{convert::Infallible, sync::LazyLock, time::Duration};

use axum::{
    body::{Body, Bytes},
    http::{HeaderValue, Method, Request},
};
use axum_idempotency::{IdempotencyLayer, MemoryStore, store::RecordKey};
use common::*;
use futures_util::StreamExt as _;
use proptest::prelude::*;
use tower::ServiceExt;

fn global(key: &[u8]) -> RecordKey {
    RecordKey::new("idempotency", b"", key)
}

#[tokio::test]
async fn control_characters_unicode_and_oversized_keys_are_400() {
    let store = MemoryStore::new();
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(store.clone()));
    let ten_kb = vec![b'k'; 10 * 1024];
    let hostile: [&[u8]; 6] =
        [b"a\tb", b"\t", "\u{1F4A5}".as_bytes(), b"\xff\xfe", &ten_kb, b"\"a\"b\""];
    for key in hostile {
        let mut request = Request::post("/payments").body(Body::from("{}")).unwrap();
        request.headers_mut().insert("idempotency-key", HeaderValue::from_bytes(key).unwrap());
        send(&app, request).await.assert_problem(400, "key-malformed");
    }
    let mut request = Request::post("/payments").body(Body::from("{}")).unwrap();
    for i in 0..100 {
        request.headers_mut().append("idempotency-key", HeaderValue::from(i));
    }
    send(&app, request).await.assert_problem(400, "key-malformed");
    assert_eq!(calls.get(), 0);
    assert!(store.is_empty());
}

#[tokio::test]
async fn a_10_kb_unrelated_header_does_not_matter() {
    let store = MemoryStore::new();
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(store.clone()));
    let big = "v".repeat(10 * 1024);
    for _ in 0..2 {
        let request = Request::post("/payments")
            .header("idempotency-key", "k1")
            .header("x-big", &big)
            .body(Body::from("{}"))
            .unwrap();
        assert_eq!(send(&app, request).await.status, 201);
    }
    assert_eq!(calls.get(), 1);
}

#[tokio::test]
async fn a_body_that_stalls_midway_claims_nothing() {
    let store = MemoryStore::new();
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(store.clone()));
    // Slowloris: a few bytes, then nothing, ever.
    let stalled = futures_util::stream::iter([Ok::<_, Infallible>(Bytes::from_static(b"{\"amo"))])
        .chain(futures_util::stream::pending());
    let request = Request::post("/payments")
        .header("idempotency-key", "k1")
        .body(Body::from_stream(stalled))
        .unwrap();
    let outcome =
        tokio::time::timeout(Duration::from_millis(100), app.clone().oneshot(request)).await;
    assert!(outcome.is_err(), "a stalled body cannot complete");
    // The server gave up on the connection: no claim was made, so the key is free.
    assert!(store.is_empty());
    assert_eq!(send(&app, keyed("POST", "/payments", "k1", "{}")).await.status, 201);
    assert_eq!(calls.get(), 1);
}

#[tokio::test]
async fn a_body_that_fails_midway_is_400_and_claims_nothing() {
    let store = MemoryStore::new();
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(store.clone()));
    let failing = futures_util::stream::iter([
        Ok(Bytes::from_static(b"{\"amo")),
        Err(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "peer went away")),
    ]);
    let request = Request::post("/payments")
        .header("idempotency-key", "k1")
        .body(Body::from_stream(failing))
        .unwrap();
    send(&app, request).await.assert_problem(400, "body-unreadable");
    assert!(store.is_empty());
    assert_eq!(calls.get(), 0);
}

#[tokio::test]
async fn bodies_at_and_one_byte_over_the_limit() {
    let store = MemoryStore::new();
    let calls = Calls::default();
    let app = app(&calls).layer(
        IdempotencyLayer::new(store.clone())
            .limits(axum_idempotency::layer::Limits::default().body(1024)),
    );
    let at: &'static str = "a".repeat(1024).leak();
    let over: &'static str = "a".repeat(1025).leak();
    assert_eq!(send(&app, keyed("POST", "/payments", "at", at)).await.status, 201);
    send(&app, keyed("POST", "/payments", "over", over))
        .await
        .assert_problem(413, "body-too-large");
    // Chunked, no Content-Length, one byte over.
    let chunks = futures_util::stream::iter([
        Ok::<_, Infallible>(Bytes::from(at)),
        Ok(Bytes::from_static(b"a")),
    ]);
    let request = Request::post("/payments")
        .header("idempotency-key", "chunked")
        .body(Body::from_stream(chunks))
        .unwrap();
    send(&app, request).await.assert_problem(413, "body-too-large");
    assert_eq!(calls.get(), 1);
    assert_eq!(store.len(), 1);
}

#[tokio::test]
async fn a_body_sent_in_chunks_is_the_same_request_as_sent_whole() {
    // The handler sees the chunks joined, in order; a retry that sends the same bytes in one
    // piece has the same fingerprint, so it is replayed, not refused.
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(MemoryStore::new()));
    let chunks = futures_util::stream::iter(
        [&b"{\"amount\""[..], b":", b"100}"].map(|chunk| Ok::<_, Infallible>(Bytes::from(chunk))),
    );
    let request = Request::post("/payments")
        .header("idempotency-key", "chunks")
        .body(Body::from_stream(chunks))
        .unwrap();
    let first = send(&app, request).await;
    assert_eq!(first.status, 201);
    assert_eq!(first.body, r#"{"call":1,"request":{"amount":100}}"#);
    let whole = send(&app, keyed("POST", "/payments", "chunks", r#"{"amount":100}"#)).await;
    assert!(whole.replayed(), "{:?}", whole.body);
    assert_eq!(whole.body, first.body);
    assert_eq!(calls.get(), 1);
}

static RUNTIME: LazyLock<tokio::runtime::Runtime> = LazyLock::new(|| {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
});

fn arbitrary_request() -> impl Strategy<Value = (Method, Vec<Vec<u8>>, Vec<u8>, bool)> {
    let method = prop_oneof![Just(Method::POST), Just(Method::PATCH), Just(Method::GET)];
    let key_value = prop_oneof![
        "[!-~]{1,8}".prop_map(String::into_bytes),
        proptest::collection::vec(any::<u8>(), 0..300),
        Just(b"\"quoted\"".to_vec()),
    ];
    let keys = proptest::collection::vec(key_value, 0..3);
    let body = proptest::collection::vec(any::<u8>(), 0..80);
    (method, keys, body, any::<bool>())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, failure_persistence: None, ..ProptestConfig::default() })]

    /// The whole layer on arbitrary requests: a clear status, never a panic, and a record
    /// only for a request that ran with one valid key.
    #[test]
    fn the_layer_answers_arbitrary_requests((method, keys, body, twice) in arbitrary_request()) {
        RUNTIME.block_on(async {
            let store = MemoryStore::new();
            let calls = Calls::default();
            let app = app(&calls).layer(IdempotencyLayer::new(store.clone()).limits(axum_idempotency::layer::Limits::default().body(64)));
            let build = || {
                let mut request = Request::builder().method(method.clone()).uri("/payments")
                    .body(Body::from(body.clone())).unwrap();
                for key in &keys {
                    if let Ok(value) = HeaderValue::from_bytes(key) {
                        request.headers_mut().append("idempotency-key", value);
                    }
                }
                request
            };
            let first = send(&app, build()).await;
            let key = axum_idempotency::layer::parse_key(build().headers(), &"idempotency-key".parse().unwrap());
            let handled = method == Method::POST || method == Method::PATCH;
            match (&key, handled) {
                (_, false) | (Ok(None), true) => {
                    prop_assert_eq!(first.status, 201);
                    prop_assert!(store.is_empty());
                }
                (Err(_), true) => first.assert_problem(400, "key-malformed"),
                (Ok(Some(_)), true) if body.len() > 64 => first.assert_problem(413, "body-too-large"),
                (Ok(Some(key)), true) => {
                    prop_assert_eq!(first.status, 201);
                    prop_assert!(store.state(&global(key)).is_some());
                    if twice {
                        let again = send(&app, build()).await;
                        prop_assert!(again.replayed());
                        prop_assert_eq!(again.body, first.body);
                        prop_assert_eq!(calls.get(), 1);
                    }
                }
            }
            Ok(())
        })?;
    }
}
