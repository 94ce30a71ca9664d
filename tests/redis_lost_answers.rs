//! Answers lost between the service and a real, paused Redis (SIGSTOP): a claim that lands
//! after its caller gave up must never erase what the key knows (a takeover of an operation
//! that may have happened), and must never lock the key for a lease however long the pause.

mod common;

use std::time::Duration;

use axum_idempotency::{
    Fingerprint, IdempotencyLayer,
    recovery::{Lookup, Recovered},
    store::{Claim, Lease, OwnerToken, RecordKey, Store},
};
use bytes::Bytes;
use common::*;
use http::{Request, Response};

async fn a_takeover_whose_answer_was_lost_is_taken_over_again_never_claimed_blind(built: Built) {
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
    let layer = IdempotencyLayer::new(built.store(&server, Duration::from_millis(200)))
        .lease(Duration::from_millis(300));
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

/// Sends a keyed request for `k1` while Redis is paused (SIGSTOP) for `pause`: its claim sits
/// in the server's socket buffer, the client gets 503, and Redis resumes. Then, within
/// `settle`, the key must be free: the retry runs the handler, once.
async fn a_claim_lost_in_a_pause_leaves_the_key_free(
    built: Built,
    lease: Duration,
    pause: Duration,
    settle: Duration,
) {
    let server = RedisServer::start();
    let calls = Calls::default();
    let app = app(&calls).layer(
        IdempotencyLayer::new(built.store(&server, Duration::from_millis(300))).lease(lease),
    );
    assert_eq!(send(&app, keyed("POST", "/payments", "warm", "{}")).await.status, 201);

    server.signal("-STOP");
    let lost = tokio::time::timeout(
        Duration::from_secs(3),
        send(&app, keyed("POST", "/payments", "k1", "{}")),
    )
    .await
    .expect("a request against a paused Redis must not hang");
    lost.assert_problem(503, "store-unavailable");
    tokio::time::sleep(pause).await;
    server.signal("-CONT");

    tokio::time::sleep(settle).await;
    let held = server.held(&global("k1")).await;
    assert!(matches!(held, None | Some(Held::Abandoned)), "the late claim holds the key: {held:?}");
    let retry = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(calls.get(), 2);
    assert!(send(&app, keyed("POST", "/payments", "k1", "{}")).await.replayed());
    assert_eq!(calls.get(), 2);
}

async fn a_redis_pause_longer_than_every_retry_leaves_the_key_free_once_redis_resumes(
    built: Built,
) {
    // The default 30 s lease, a pause longer than the guard once kept trying (three tries 50,
    // 200 and 800 ms apart); within the guard's longest pause between tries (1 s) and a round
    // trip of the resume, the key is free.
    let (lease, pause) = (Duration::from_secs(30), Duration::from_secs(6));
    a_claim_lost_in_a_pause_leaves_the_key_free(built, lease, pause, Duration::from_millis(1500))
        .await;
}

async fn a_redis_pause_longer_than_the_lease_leaves_the_key_free_once_redis_resumes(built: Built) {
    // Past the guard's whole budget (a lease of tries): the claim that lands on the resume
    // carries its deadline in the server's time, long gone, and writes nothing.
    let (lease, pause) = (Duration::from_secs(2), Duration::from_secs(5));
    a_claim_lost_in_a_pause_leaves_the_key_free(built, lease, pause, Duration::from_millis(300))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_arriving_after_its_deadline_writes_nothing() {
    // `lua/claim.lua` run by hand, as a claim held up on the wire arrives: its deadline (in
    // the server's time) has passed. On an absent key, a marker, and a lapsed claim alike, it
    // is refused ({6}) and the key is left as it was.
    use axum_idempotency::store::deadpool_redis::redis::{self, AsyncCommands, Script, Value};
    let server = RedisServer::start();
    let mut redis = server.connection().await;
    let script = Script::new(include_str!("../lua/claim.lua"));
    let fingerprint = Fingerprint::new("POST", "/payments", "", b"{}");
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut redis).await.unwrap();
    let now_ms = secs * 1000 + micros / 1000;
    let claim = |key: &RecordKey, deadline: u64| {
        let mut invocation = script.prepare_invoke();
        invocation
            .key(key.as_str())
            .arg(fingerprint.as_bytes())
            .arg(OwnerToken::random().as_bytes())
            .arg("30000")
            .arg("1")
            .arg("0")
            .arg("60000")
            .arg(deadline.to_string());
        invocation
    };
    let refused = Value::Array(vec![Value::Int(6)]);
    // Absent.
    let absent = global("absent");
    let reply: Value = claim(&absent, now_ms - 1000).invoke_async(&mut redis).await.unwrap();
    assert_eq!(reply, refused);
    assert_eq!(server.held(&absent).await, None);
    // An abandoned claim's marker, another token's.
    let marked = global("marked");
    let store = server.store();
    let (token, lease) = (OwnerToken::random(), Lease::new(Duration::from_secs(30)));
    store.abandon(&marked, &token, &fingerprint, lease).await.unwrap();
    let reply: Value = claim(&marked, now_ms - 1000).invoke_async(&mut redis).await.unwrap();
    assert_eq!(reply, refused);
    assert_eq!(server.held(&marked).await, Some(Held::Abandoned));
    // A lapsed claim within its recovery window: not taken over.
    let lapsed = global("lapsed");
    let lease = Lease::new(Duration::from_millis(50)).recovery_window(Duration::from_secs(60));
    let first = store.claim(&lapsed, &fingerprint, &OwnerToken::random(), lease).await;
    assert_eq!(first.unwrap(), Claim::Claimed);
    tokio::time::sleep(Duration::from_millis(150)).await;
    let before: Vec<u8> = redis.get(lapsed.as_str()).await.unwrap();
    let reply: Value = claim(&lapsed, now_ms - 1000).invoke_async(&mut redis).await.unwrap();
    assert_eq!(reply, refused);
    let after: Vec<u8> = redis.get(lapsed.as_str()).await.unwrap();
    assert_eq!(before, after, "a late takeover rewrote the record");
    // In time, the same claims land.
    let reply: Value = claim(&absent, now_ms + 60_000).invoke_async(&mut redis).await.unwrap();
    assert_eq!(reply, Value::Int(0));
    let reply: Value = claim(&lapsed, now_ms + 60_000).invoke_async(&mut redis).await.unwrap();
    assert_eq!(reply, Value::Int(5));
}

both_redis_stores!(
    a_takeover_whose_answer_was_lost_is_taken_over_again_never_claimed_blind,
    a_redis_pause_longer_than_every_retry_leaves_the_key_free_once_redis_resumes,
    a_redis_pause_longer_than_the_lease_leaves_the_key_free_once_redis_resumes,
);
