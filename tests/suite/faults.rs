//! Faults in the request's own life: a client that goes away, a handler that panics.

use crate::common;

use std::time::Duration;

use axum_idempotency::IdempotencyLayer;
use common::*;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;
use tower_http::catch_panic::CatchPanicLayer;

every_store!(
    dropped_request_still_completes_and_the_retry_is_replayed,
    panic_releases_the_key_and_propagates,
    task_tracker_lets_shutdown_wait_for_running_handlers,
);

async fn dropped_request_still_completes_and_the_retry_is_replayed<H: Harness>(h: H) {
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(h.store()));
    let request = || {
        axum::http::Request::post("/slow")
            .header("idempotency-key", "k1")
            .header("x-delay-ms", "300")
            .body(axum::body::Body::from("{}"))
            .unwrap()
    };
    // The client gives up mid-handler (once it started, however long a cold claim took): its
    // response future is dropped.
    let mut call = Box::pin(app.clone().oneshot(request()));
    let started = async {
        while calls.get() == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::select! {
        _ = &mut call => panic!("the handler should still have been running"),
        () = started => {}
    }
    drop(call);
    assert_eq!(h.held(&global("k1")).await, Some(Held::InProgress));
    eventually("the orphaned handler completes and stores its response", async || {
        h.held(&global("k1")).await == Some(Held::Completed)
    })
    .await;
    let retry = send(&app, request()).await;
    assert!(retry.replayed());
    assert_eq!(retry.header("x-payment"), Some("pay_1"));
    assert_eq!(calls.get(), 1);
}

async fn panic_releases_the_key_and_propagates<H: Harness>(h: H) {
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(h.store())).layer(CatchPanicLayer::new());
    for call in 1..=2 {
        let seen = send(&app, keyed("POST", "/panic", "k1", "")).await;
        // CatchPanicLayer's own answer: the panic reached it.
        assert_eq!(seen.status, 500);
        assert!(!seen.replayed());
        assert_eq!(h.held(&global("k1")).await, None, "the key stayed claimed after a panic");
        assert_eq!(calls.get(), call);
    }
}

async fn task_tracker_lets_shutdown_wait_for_running_handlers<H: Harness>(h: H) {
    let calls = Calls::default();
    let tasks = TaskTracker::new();
    let app = app(&calls).layer(IdempotencyLayer::new(h.store()).task_tracker(tasks.clone()));
    let request = axum::http::Request::post("/slow")
        .header("idempotency-key", "k1")
        .header("x-delay-ms", "300")
        .body(axum::body::Body::from("{}"))
        .unwrap();
    // The connection goes away mid-handler, as it does when a server shuts down: once the
    // handler has started (however long the claim took on a cold store).
    let mut call = Box::pin(app.clone().oneshot(request));
    let started = async {
        while calls.get() == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::select! {
        _ = &mut call => panic!("the request ended before its handler started"),
        () = started => {}
    }
    drop(call);
    assert_eq!(tasks.len(), 1);
    tasks.close();
    tokio::time::timeout(Duration::from_secs(2), tasks.wait()).await.expect("tasks finish");
    // Once the tracker is done, the response is stored: nothing left for the shutdown to lose.
    assert_eq!(h.held(&global("k1")).await, Some(Held::Completed));
    assert_eq!(calls.get(), 1);
}
