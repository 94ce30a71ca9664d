//! Waiting on Redis: two instances share the settle through pub/sub, a lost subscriber
//! connection cannot strand a waiter, and the cost of a waiter in round trips.

mod common;

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use axum_idempotency::settings::Waiting;
use axum_idempotency::{IdempotencyLayer, RedisStore, store::deadpool_redis::redis};
use common::*;

fn waiting(store: RedisStore, calls: &Calls, wait: Duration) -> axum::Router {
    app(calls).layer(IdempotencyLayer::new(store).waiting(Waiting::up_to(wait)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_on_one_instance_is_woken_by_the_settle_on_another_without_polling() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let a = waiting(server.store(), &calls, Duration::from_secs(5));
    let b = waiting(server.store(), &calls, Duration::from_secs(5));
    // Warm both instances up: connections, scripts, the subscriber.
    send(&a, keyed("POST", "/payments", "warm-a", "{}")).await;
    send(&b, keyed("POST", "/payments", "warm-b", "{}")).await;
    reset_command_stats(&server).await;

    let original = send_in_background(&a, delayed("/slow", "k1", 700, "{}"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    let waiter = send(&b, delayed("/slow", "k1", 700, "{}")).await;
    let waited = started.elapsed();
    let original = original.await.unwrap();
    assert_eq!(original.status, 201);
    assert!(waiter.replayed(), "{waiter:?}");
    assert_eq!(waiter.body, original.body);
    assert!(waited < Duration::from_secs(2), "woken by its deadline, not the settle: {waited:?}");

    // The waiter's subscription goes once it leaves (in the background).
    eventually("the subscription is gone", async || {
        subscribers_on(&server, &settle_channel(&global("k1"))).await == 0
    })
    .await;
    let commands = command_calls(&server).await;
    // The original: claim + complete. The waiter: its first claim, a claim after subscribing
    // (which marks the record), and one last claim once woken: three, however long it waited.
    // The complete publishes once, because the record was marked.
    let expected = BTreeMap::from([
        ("evalsha".to_owned(), 2 + 3),
        ("publish".to_owned(), 1),
        ("subscribe".to_owned(), 1),
        ("unsubscribe".to_owned(), 1),
    ]);
    assert_eq!(commands, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_subscriber_connection_strands_no_waiter_and_waiting_works_again() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let app = waiting(server.store(), &calls, Duration::from_secs(3));
    let original = send_in_background(&app, delayed("/slow", "k1", 1000, "{}"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let waiters: Vec<_> =
        (0..5).map(|_| send_in_background(&app, delayed("/slow", "k1", 1000, "{}"))).collect();
    eventually("the waiters subscribed", async || {
        subscribers_on(&server, &settle_channel(&global("k1"))).await == 1
    })
    .await;
    let killed: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("pubsub")
        .query_async(&mut server.connection().await)
        .await
        .unwrap();
    assert_eq!(killed, 1);
    let started = Instant::now();
    for waiter in waiters {
        let seen = waiter.await.unwrap();
        // The subscriber reconnected and subscribed again: the waiters heard the original's
        // settle (at about 1 s), well before their 3 s deadline.
        assert!(seen.replayed(), "{seen:?}");
    }
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    assert_eq!(original.await.unwrap().status, 201);

    // Waiting works again: a new original, a new waiter, woken well before its deadline.
    let second = send_in_background(&app, delayed("/slow", "k2", 600, "{}"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    let waiter = send(&app, delayed("/slow", "k2", 600, "{}")).await;
    assert!(waiter.replayed(), "{waiter:?}");
    assert!(started.elapsed() < Duration::from_millis(1500), "{:?}", started.elapsed());
    assert_eq!(second.await.unwrap().status, 201);
    assert_eq!(calls.get(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_without_a_subscriber_answers_waiters_by_polling_with_backoff() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let app = waiting(RedisStore::new(server.pool()), &calls, Duration::from_secs(8));
    let original = send_in_background(&app, delayed("/slow", "k1", 500, "{}"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    reset_command_stats(&server).await;
    let started = Instant::now();
    let waiter = send(&app, delayed("/slow", "k1", 500, "{}")).await;
    // Nobody could tell it of the settle: a claim of its polling, not its deadline, finds the
    // replay (polls at 50, 150, 350, 750 ms: the settle comes at about 400 ms).
    let took = started.elapsed();
    assert!(waiter.replayed(), "{waiter:?}");
    assert!(took >= Duration::from_millis(300) && took < Duration::from_millis(1500), "{took:?}");
    assert_eq!(original.await.unwrap().status, 201);
    assert_eq!(calls.get(), 1);
    // Backing off: the waiter's claims and the original's complete, a handful of scripts.
    let scripts = command_calls(&server).await.get("evalsha").copied().unwrap_or(0);
    assert!((3..=8).contains(&scripts), "{scripts} scripts");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subscriber_reconnects_once_redis_is_back() {
    let mut server = RedisServer::start();
    let calls = Calls::default();
    let app = waiting(server.store(), &calls, Duration::from_secs(3));
    let waited_for = |key: &'static str| {
        let app = app.clone();
        async move {
            let original = send_in_background(&app, delayed("/slow", key, 600, "{}"));
            tokio::time::sleep(Duration::from_millis(100)).await;
            let started = Instant::now();
            let waiter = send(&app, delayed("/slow", key, 600, "{}")).await;
            assert_eq!(original.await.unwrap().status, 201);
            (waiter, started.elapsed())
        }
    };
    // The subscriber is up and serves a waiter.
    let (waiter, took) = waited_for("before").await;
    assert!(waiter.replayed() && took < Duration::from_secs(2), "{waiter:?} after {took:?}");
    // Redis goes away, and comes back empty on the same port, a little later.
    server.kill();
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.restart();
    eventually("requests succeed again", async || {
        send(&app, keyed("POST", "/payments", "probe", "{}")).await.status == 201
    })
    .await;
    // The subscriber kept trying, and serves waiters again: woken by the settle, not the
    // 3 s deadline.
    let (waiter, took) = waited_for("after").await;
    assert!(waiter.replayed() && took < Duration::from_secs(2), "{waiter:?} after {took:?}");
}
