//! Faults in the request's own life: a client that goes away, a handler that panics.

use crate::common;

use std::time::Duration;

use axum_idempotency::{
    IdempotencyLayer,
    settings::Waiting,
    store::{Claim, Fenced, Lease, OwnerToken, RecordKey, StoreError},
};
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

/// A memory store whose first release fails (the store unreachable for a moment).
#[derive(Clone)]
struct FirstReleaseFails {
    inner: axum_idempotency::MemoryStore,
    failed: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl axum_idempotency::store::Store for FirstReleaseFails {
    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &axum_idempotency::Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Claim, StoreError> {
        self.inner.claim(key, fingerprint, owner, lease).await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        fingerprint: &axum_idempotency::Fingerprint,
        response: axum::body::Bytes,
        retention: Duration,
    ) -> Result<Fenced, StoreError> {
        self.inner.complete(key, owner, fingerprint, response, retention).await
    }

    async fn release(&self, key: &RecordKey, owner: &OwnerToken) -> Result<Fenced, StoreError> {
        if !self.failed.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return Err(StoreError::unavailable("the store is unreachable for a moment"));
        }
        self.inner.release(key, owner).await
    }

    async fn touch(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Fenced, StoreError> {
        self.inner.touch(key, owner, lease).await
    }
}

/// A handler fails (its key is released) and the store fails that release, which is tried
/// again in the background: a service shutting down right then waits for the retry, on the
/// task tracker, and the next instance's retry runs at once rather than finding the key held
/// for a lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_tried_again_is_waited_for_at_shutdown() {
    let inner = axum_idempotency::MemoryStore::new();
    let store = FirstReleaseFails { inner: inner.clone(), failed: Default::default() };
    let calls = Calls::default();
    let tasks = TaskTracker::new();
    let layer = IdempotencyLayer::new(store).task_tracker(tasks.clone());
    let failed = send(&app(&calls).layer(layer), keyed("POST", "/flaky", "k1", "{}")).await;
    assert_eq!(failed.status, 500);
    tasks.close();
    tokio::time::timeout(Duration::from_secs(5), tasks.wait()).await.expect("tasks finish");
    assert!(inner.state(&global("k1")).is_none(), "released before the shutdown ended");
    let next = app(&calls).layer(IdempotencyLayer::new(inner.clone()).waiting(Waiting::off()));
    let retry = send(&next, keyed("POST", "/flaky", "k1", "{}")).await;
    assert_eq!((retry.status.as_u16(), retry.replayed()), (201, false), "{retry:?}");
    assert_eq!(calls.get(), 2);
}
