//! Answers lost between the service and a real, paused Redis (SIGSTOP): a claim that lands
//! after its caller gave up must never erase what the key knows (a takeover of an operation
//! that may have happened), and must never lock the key for a lease however long the pause.

mod common;

use std::time::Duration;

use axum_idempotency::{
    Claim, Fingerprint, IdempotencyLayer, OwnerToken, RedisStore, Store,
    recovery::{Lookup, Recovered},
    store::Lease,
};
use bytes::Bytes;
use common::*;
use http::{Request, Response};

fn store(server: &RedisServer, timeout_ms: u64) -> RedisStore {
    RedisStore::new(server.pool()).command_timeout(Duration::from_millis(timeout_ms))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_whose_answer_was_lost_is_taken_over_again_never_claimed_blind() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let asked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    // The system of record holds the dead holder's charge.
    let hook = {
        let asked = asked.clone();
        move |_lookup: Lookup<Request<Bytes>>| {
            asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let response = Response::builder()
                .status(201)
                .body(Bytes::from_static(br#"{"from":"ledger"}"#))
                .unwrap();
            std::future::ready(Ok::<_, std::io::Error>(Recovered::Happened(response)))
        }
    };
    let layer = IdempotencyLayer::new(store(&server, 200)).lease(Duration::from_millis(300));
    let app = app(&calls).layer(layer.recover(hook));
    assert_eq!(send(&app, keyed("POST", "/payments", "warm", "{}")).await.status, 201);

    // A holder charged and died before it stored anything; its lease has lapsed.
    let fingerprint = Fingerprint::new("POST", "/payments", "", b"{}");
    let lease = Lease::new(Duration::from_millis(100)).recovery_window(Duration::from_secs(3600));
    let dead =
        server.store().claim(&global("k1"), &fingerprint, &OwnerToken::random(), lease).await;
    assert_eq!(dead.unwrap(), Claim::Claimed);
    tokio::time::sleep(Duration::from_millis(250)).await;

    // A retry's takeover sits in the paused server's socket buffer; the retry gives up.
    server.signal("-STOP");
    let lost = tokio::time::timeout(
        Duration::from_secs(3),
        send(&app, keyed("POST", "/payments", "k1", "{}")),
    )
    .await
    .expect("a request against a paused Redis must not hang");
    server.signal("-CONT");
    lost.assert_problem(503, "store-unavailable");

    // The takeover landed; its guard ended its lease but kept the record, so the next retry
    // takes over again and asks the system of record, rather than running blind.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(server.held(&global("k1")).await, Some(Held::InProgress));
    let retry = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    assert_eq!((retry.status.as_u16(), retry.body.as_str()), (201, r#"{"from":"ledger"}"#));
    assert!(retry.replayed());
    assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(calls.get(), 1, "the handler ran for k1 (only `warm` may have run)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_pause_longer_than_every_retry_leaves_the_key_free_once_redis_resumes() {
    let server = RedisServer::start();
    let calls = Calls::default();
    // The default 30 s lease: a claim that lands late and stays would lock the key for it.
    let app = app(&calls).layer(IdempotencyLayer::new(store(&server, 300)));
    assert_eq!(send(&app, keyed("POST", "/payments", "warm", "{}")).await.status, 201);

    server.signal("-STOP");
    let lost = tokio::time::timeout(
        Duration::from_secs(3),
        send(&app, keyed("POST", "/payments", "k1", "{}")),
    )
    .await
    .expect("a request against a paused Redis must not hang");
    lost.assert_problem(503, "store-unavailable");
    // Longer than the guard once kept trying (three tries 50, 200 and 800 ms apart).
    tokio::time::sleep(Duration::from_secs(6)).await;
    server.signal("-CONT");

    // Within the guard's longest pause between tries (1 s) and a round trip, the key is free.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let held = server.held(&global("k1")).await;
    assert!(matches!(held, None | Some(Held::Abandoned)), "the late claim holds the key: {held:?}");
    let retry = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(calls.get(), 2);
    assert!(send(&app, keyed("POST", "/payments", "k1", "{}")).await.replayed());
    assert_eq!(calls.get(), 2);
}
