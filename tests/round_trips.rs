//! Redis round trips per request, counted by Redis itself (`INFO commandstats` deltas).

mod common;

use std::collections::BTreeMap;

use axum::{body::Body, http::Request};
use axum_idempotency::settings::Waiting;
use axum_idempotency::{IdempotencyLayer, RedisStore};
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fresh_is_two_replay_one_in_progress_one_pass_through_zero() {
    let server = RedisServer::start();
    let calls = Calls::default();
    // Waiting off: an in-progress answer at once is one round trip (a waiter's costs are
    // counted in tests/redis_waiting.rs).
    let layer = IdempotencyLayer::new(RedisStore::new(server.pool()));
    let app = app(&calls).layer(layer.waiting(Waiting::off()));
    // Warm up: the first request opens the connection, reads the eviction policy and loads
    // the scripts. None of that happens again.
    send(&app, keyed("POST", "/payments", "warm", "{}")).await;
    send(&app, keyed("POST", "/payments", "warm", "{}")).await;
    let n = 20;

    reset_command_stats(&server).await;
    for i in 0..n {
        assert_eq!(
            send(&app, keyed("POST", "/payments", &format!("fresh-{i}"), "{}")).await.status,
            201
        );
    }
    let fresh = command_calls(&server).await;
    assert_eq!(fresh, BTreeMap::from([("evalsha".to_owned(), 2 * n)]), "fresh: claim + complete");

    reset_command_stats(&server).await;
    for _ in 0..n {
        assert!(send(&app, keyed("POST", "/payments", "fresh-0", "{}")).await.replayed());
    }
    let replay = command_calls(&server).await;
    assert_eq!(replay, BTreeMap::from([("evalsha".to_owned(), n)]), "replay: claim only");

    let slow = send_in_background(&app, delayed("/slow", "busy", 300, "{}"));
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    reset_command_stats(&server).await;
    for _ in 0..n {
        send(&app, keyed("POST", "/slow", "busy", "{}")).await.assert_problem(202, "in-progress");
    }
    let in_progress = command_calls(&server).await;
    assert_eq!(in_progress, BTreeMap::from([("evalsha".to_owned(), n)]), "in progress: claim only");
    slow.await.unwrap();

    reset_command_stats(&server).await;
    for _ in 0..n {
        send(&app, Request::post("/payments").body(Body::from("{}")).unwrap()).await;
        send(&app, keyed("GET", "/payments", "k", "")).await;
    }
    let pass_through = command_calls(&server).await;
    assert_eq!(pass_through, BTreeMap::new(), "pass-through: no command");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_door_fresh_is_two_replay_one_in_progress_one() {
    use axum_idempotency::{Idempotent, consumer::Outcome};

    let server = RedisServer::start();
    let idem = Idempotent::new(RedisStore::new(server.pool()));
    let run = |id: String, delay_ms: u64| {
        let idem = idem.clone();
        async move {
            idem.run("consumer", id, b"payload", move |_context| async move {
                tokio::time::sleep(std::time::Duration::from_millis(delay_ms)).await;
                Ok::<_, std::io::Error>(42u32)
            })
            .await
            .unwrap()
        }
    };
    run("warm".into(), 0).await;
    let n = 20;

    reset_command_stats(&server).await;
    for i in 0..n {
        assert_eq!(run(format!("fresh-{i}"), 0).await, Outcome::Ran(42));
    }
    let fresh = command_calls(&server).await;
    assert_eq!(fresh, BTreeMap::from([("evalsha".to_owned(), 2 * n)]), "fresh: claim + complete");

    reset_command_stats(&server).await;
    for _ in 0..n {
        assert_eq!(run("fresh-0".into(), 0).await, Outcome::Replayed(42));
    }
    let replay = command_calls(&server).await;
    assert_eq!(replay, BTreeMap::from([("evalsha".to_owned(), n)]), "replay: claim only");

    let slow = tokio::spawn(run("busy".into(), 300));
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    reset_command_stats(&server).await;
    for _ in 0..n {
        assert!(matches!(run("busy".into(), 0).await, Outcome::InProgress { .. }));
    }
    let in_progress = command_calls(&server).await;
    assert_eq!(in_progress, BTreeMap::from([("evalsha".to_owned(), n)]), "in progress: claim only");
    slow.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovery_hook_costs_nothing_fresh_and_one_lookup_on_a_takeover() {
    use std::sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    };

    use axum_idempotency::{
        Fingerprint,
        recovery::{Lookup, Recovered},
        store::{Claim, Lease, OwnerToken, Store},
    };
    use bytes::Bytes;
    use http::Response;

    let server = RedisServer::start();
    let calls = Calls::default();
    let lookups = Arc::new(AtomicUsize::new(0));
    let hook = {
        let lookups = lookups.clone();
        move |_lookup: Lookup<Request<Bytes>>| {
            lookups.fetch_add(1, Ordering::SeqCst);
            let response = Response::builder().status(201).body(Bytes::from_static(b"outbox"));
            std::future::ready(Ok::<_, http::Error>(Recovered::Happened(response.unwrap())))
        }
    };
    let store = RedisStore::new(server.pool());
    let app = app(&calls).layer(IdempotencyLayer::new(store.clone()).recover(hook));
    send(&app, keyed("POST", "/payments", "warm", "{}")).await;
    let n = 20;

    reset_command_stats(&server).await;
    for i in 0..n {
        let fresh = send(&app, keyed("POST", "/payments", &format!("fresh-{i}"), "{}")).await;
        assert!(!fresh.replayed());
    }
    let fresh = command_calls(&server).await;
    assert_eq!(fresh, BTreeMap::from([("evalsha".to_owned(), 2 * n)]), "fresh: claim + complete");
    assert_eq!(lookups.load(Ordering::SeqCst), 0, "a fresh claim asked the hook");

    // Dead holders, planted: their leases lapse unsettled.
    let fingerprint = Fingerprint::new("POST", "/payments", "", b"{}");
    let lease = Lease::new(std::time::Duration::from_millis(50))
        .recovery_window(std::time::Duration::from_secs(60));
    for i in 0..n {
        let key = global(&format!("dead-{i}"));
        let claim = store.claim(&key, &fingerprint, &OwnerToken::random(), lease).await.unwrap();
        assert_eq!(claim, Claim::Claimed);
    }
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    reset_command_stats(&server).await;
    for i in 0..n {
        let taken = send(&app, keyed("POST", "/payments", &format!("dead-{i}"), "{}")).await;
        assert_eq!(
            (taken.status.as_u16(), taken.replayed(), taken.body.as_str()),
            (201, true, "outbox")
        );
    }
    let takeover = command_calls(&server).await;
    assert_eq!(
        takeover,
        BTreeMap::from([("evalsha".to_owned(), 2 * n)]),
        "takeover: claim + complete"
    );
    assert_eq!(lookups.load(Ordering::SeqCst), n as usize, "one lookup per takeover");
    assert_eq!(calls.get(), 1 + n as usize, "the handler ran on a takeover");
}
