//! Responses stream through the layer: the client reads each frame as the handler produces
//! it, the layer keeps its copy on the side and stores it when the stream ends. Run against
//! every store.

use crate::common;

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{
    Router,
    body::{Body, Bytes},
    http::{HeaderValue, Response},
    routing::post,
};
use axum_idempotency::IdempotencyLayer;
use common::*;
use http_body_util::BodyExt;
use tower::ServiceExt;

every_store!(
    an_event_stream_reaches_the_client_before_the_handler_finishes_and_is_replayed_whole,
    a_client_that_leaves_mid_stream_still_has_the_stream_stored,
    an_endless_stream_is_never_buffered_and_never_run_again,
    a_two_mib_header_is_sent_and_never_run_again,
    headers_of_exactly_the_stored_limit_are_stored,
    a_stream_that_panics_ends_in_an_error_and_its_key_is_released_first,
);

/// When the handler produced each event, by its own clock.
#[derive(Clone, Default)]
struct Produced(Arc<Mutex<Vec<Instant>>>);

/// `POST /events`: five `data:` events, 150 ms apart. `POST /endless`: 1 KiB every 20 ms,
/// forever. `POST /big-header`: a 2 MiB header.
fn streaming_app(calls: &Calls, produced: &Produced, chunks: &Arc<AtomicUsize>) -> Router {
    let events = {
        let (calls, produced) = (calls.clone(), produced.clone());
        move || async move {
            calls.next_call();
            let stream = futures_util::stream::unfold(0, move |i| {
                let produced = produced.clone();
                async move {
                    if i == 5 {
                        return None;
                    }
                    if i > 0 {
                        tokio::time::sleep(Duration::from_millis(150)).await;
                    }
                    produced.0.lock().unwrap().push(Instant::now());
                    Some((Ok::<_, std::io::Error>(Bytes::from(format!("data: {i}\n\n"))), i + 1))
                }
            });
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(Body::from_stream(stream))
                .unwrap()
        }
    };
    let endless = {
        let (calls, chunks, produced) = (calls.clone(), chunks.clone(), produced.clone());
        move || async move {
            calls.next_call();
            let stream = futures_util::stream::unfold((), move |()| {
                let (chunks, produced) = (chunks.clone(), produced.clone());
                async move {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    chunks.fetch_add(1, Ordering::SeqCst);
                    produced.0.lock().unwrap().push(Instant::now());
                    Some((Ok::<_, std::io::Error>(Bytes::from(vec![b'x'; 1024])), ()))
                }
            });
            Body::from_stream(stream)
        }
    };
    let big_header = {
        let calls = calls.clone();
        move || async move {
            let call = calls.next_call();
            let value = HeaderValue::from_str(&"h".repeat(2 * 1024 * 1024)).unwrap();
            Response::builder()
                .header("x-huge", value)
                .body(Body::from(format!("call {call}")))
                .unwrap()
        }
    };
    Router::new()
        .route("/events", post(events))
        .route("/endless", post(endless))
        .route("/big-header", post(big_header))
}

async fn an_event_stream_reaches_the_client_before_the_handler_finishes_and_is_replayed_whole<
    H: Harness,
>(
    h: H,
) {
    let (calls, produced, chunks) = (Calls::default(), Produced::default(), Arc::default());
    let app = streaming_app(&calls, &produced, &chunks).layer(IdempotencyLayer::new(h.store()));
    let response = app.clone().oneshot(keyed("POST", "/events", "k1", "")).await.unwrap();
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let mut body = response.into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    let first_arrived = Instant::now();
    assert_eq!(first, "data: 0\n\n");
    let mut whole = first.to_vec();
    while let Some(frame) = body.frame().await {
        whole.extend_from_slice(&frame.unwrap().into_data().unwrap());
    }
    let produced = produced.0.lock().unwrap().clone();
    assert_eq!(produced.len(), 5);
    // The first event arrived as the handler produced it, well before its last event (600 ms
    // later by the handler's own clock): the layer held nothing back.
    assert!(first_arrived < produced[4], "the first event arrived after the stream ended");
    assert!(first_arrived.duration_since(produced[0]) < Duration::from_millis(300));
    // The finished stream is stored, and replayed whole.
    eventually("the stream is stored", async || {
        h.held(&global("k1")).await == Some(Held::Completed)
    })
    .await;
    let retry = send(&app, keyed("POST", "/events", "k1", "")).await;
    assert!(retry.replayed());
    assert_eq!(retry.header("content-type"), Some("text/event-stream"));
    assert_eq!(retry.body.as_bytes(), whole.as_slice());
    assert_eq!(calls.get(), 1);
}

async fn a_client_that_leaves_mid_stream_still_has_the_stream_stored<H: Harness>(h: H) {
    let (calls, produced, chunks) = (Calls::default(), Produced::default(), Arc::default());
    let app = streaming_app(&calls, &produced, &chunks).layer(IdempotencyLayer::new(h.store()));
    let response = app.clone().oneshot(keyed("POST", "/events", "k1", "")).await.unwrap();
    let mut body = response.into_body();
    body.frame().await.unwrap().unwrap();
    // The client goes away after the first event.
    drop(body);
    eventually("the stream is read to its end and stored", async || {
        h.held(&global("k1")).await == Some(Held::Completed)
    })
    .await;
    let retry = send(&app, keyed("POST", "/events", "k1", "")).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, (0..5).map(|i| format!("data: {i}\n\n")).collect::<String>());
    assert_eq!(calls.get(), 1);
}

async fn an_endless_stream_is_never_buffered_and_never_run_again<H: Harness>(h: H) {
    let (calls, produced, chunks) = (Calls::default(), Produced::default(), Arc::default());
    let layer = IdempotencyLayer::new(h.store())
        .limits(axum_idempotency::layer::Limits::default().stored_body(16 * 1024));
    let app = streaming_app(&calls, &produced, &chunks).layer(layer);
    let response = app.clone().oneshot(keyed("POST", "/endless", "k1", "")).await.unwrap();
    let mut body = response.into_body();
    body.frame().await.unwrap().unwrap();
    let first_arrived = Instant::now();
    // By the handler's own clock, the first chunk arrived before its eighth was produced
    // (140 ms later): nothing waits for the stored limit (16 chunks) to fill.
    let eighth = produced.0.lock().unwrap().get(7).copied();
    assert!(eighth.is_none_or(|eighth| first_arrived < eighth), "the first chunk was held back");
    // Past the stored limit the copy is dropped, while the stream goes on, and the key is kept
    // as completed, not replayable.
    for _ in 0..20 {
        body.frame().await.unwrap().unwrap();
    }
    eventually("the key is kept as not replayable", async || {
        h.held(&global("k1")).await == Some(Held::Completed)
    })
    .await;
    // The client leaves: the layer stops reading the endless body.
    drop(body);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let after_leaving = chunks.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        chunks.load(Ordering::SeqCst) <= after_leaving + 1,
        "the endless body was still read after its client left"
    );
    assert_eq!(calls.get(), 1);
}

async fn a_two_mib_header_is_sent_and_never_run_again<H: Harness>(h: H) {
    let (calls, produced, chunks) = (Calls::default(), Produced::default(), Arc::default());
    let app = streaming_app(&calls, &produced, &chunks).layer(IdempotencyLayer::new(h.store()));
    let seen = send(&app, keyed("POST", "/big-header", "k1", "")).await;
    assert_eq!(seen.status, 200);
    assert_eq!(seen.header("x-huge").map(str::len), Some(2 * 1024 * 1024));
    assert!(!seen.replayed());
    assert_eq!(seen.body, "call 1");
    assert_eq!(h.held(&global("k1")).await, Some(Held::Completed));
    let retry = send(&app, keyed("POST", "/big-header", "k1", "")).await;
    retry.assert_problem(500, "response-not-replayable");
    assert_eq!(calls.get(), 1);
}

/// The stored headers limit is inclusive: headers that take exactly the limit are stored, one
/// byte less and they are not.
async fn headers_of_exactly_the_stored_limit_are_stored<H: Harness>(h: H) {
    let (calls, produced, chunks) = (Calls::default(), Produced::default(), Arc::default());
    let app = streaming_app(&calls, &produced, &chunks);
    // What the stored headers take: each kept header's name and value, and 6 bytes.
    let seen = send(
        &app.clone().layer(IdempotencyLayer::new(h.store())),
        keyed("POST", "/big-header", "probe", ""),
    )
    .await;
    let stored: usize = seen
        .headers
        .iter()
        .filter(|(name, _)| !["content-length", "date", "set-cookie"].contains(&name.as_str()))
        .map(|(name, value)| 6 + name.as_str().len() + value.len())
        .sum();
    for (limit, key, replayed) in [(stored - 1, "under", false), (stored, "exact", true)] {
        let layer = IdempotencyLayer::new(h.store())
            .limits(axum_idempotency::layer::Limits::default().stored_headers(limit));
        let app = app.clone().layer(layer);
        send(&app, keyed("POST", "/big-header", key, "")).await;
        let again = send(&app, keyed("POST", "/big-header", key, "")).await;
        assert_eq!(again.replayed(), replayed, "limit {limit}, stored headers {stored}");
        if !replayed {
            again.assert_problem(500, "response-not-replayable");
        }
    }
}

/// A body that panics mid-stream: the client reads the first chunk, then an error where the
/// body broke off (not a body that looks whole), and by then its key is released: the retry at
/// once runs the handler again.
async fn a_stream_that_panics_ends_in_an_error_and_its_key_is_released_first<H: Harness>(h: H) {
    let calls = Calls::default();
    let panicking = {
        let calls = calls.clone();
        move || async move {
            calls.next_call();
            let stream = futures_util::stream::unfold(0, |i| async move {
                if i == 1 {
                    panic!("the body panicked on purpose");
                }
                Some((Ok::<_, std::io::Error>(Bytes::from_static(b"partial")), i + 1))
            });
            Body::from_stream(stream)
        }
    };
    let app =
        Router::new().route("/panics", post(panicking)).layer(IdempotencyLayer::new(h.store()));
    for call in 1..=2 {
        let response = app.clone().oneshot(keyed("POST", "/panics", "k1", "")).await.unwrap();
        assert_eq!(response.status(), 200);
        let mut body = response.into_body();
        let first = body.frame().await.expect("a first frame").expect("the first chunk");
        assert_eq!(first.into_data().unwrap(), "partial");
        assert!(body.frame().await.expect("an error frame").is_err(), "the panic ends in an error");
        assert!(body.frame().await.is_none());
        // The stream ended only once the key was released.
        assert_eq!(h.held(&global("k1")).await, None);
        assert_eq!(calls.get(), call);
    }
}
