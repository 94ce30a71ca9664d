//! How many connections a store from a URL opens to Redis: never more than its pool's size,
//! plus the one subscriber connection, whatever the load (a cold start, a `CLIENT KILL` of
//! every connection, a server that takes few clients, runtimes side by side). Each test
//! counts what Redis saw (`INFO clients` sampled, `total_connections_received`) from one admin
//! connection of its own, which every figure below includes.

use crate::common;

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use axum::Router;
use axum_idempotency::{
    IdempotencyLayer,
    store::deadpool_redis::redis::{self, aio::MultiplexedConnection},
};
use common::*;

/// The pool `RedisStore::from_url` builds: at most 8 connections.
const POOL_SIZE: u64 = 8;

/// The connections the store may hold at once: its pool's, and the subscriber's.
const STORE_CONNECTIONS: u64 = POOL_SIZE + 1;

async fn info_field(admin: &mut MultiplexedConnection, section: &str, field: &str) -> u64 {
    let info: String = redis::cmd("INFO").arg(section).query_async(admin).await.unwrap();
    info.lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or_else(|| panic!("{field} in INFO {section}"))
}

/// Connections accepted since the server started.
async fn received(admin: &mut MultiplexedConnection) -> u64 {
    info_field(admin, "stats", "total_connections_received").await
}

/// The most clients connected at once while it ran, sampled every millisecond on the admin
/// connection (its own included).
struct Watch {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<u64>,
}

impl Watch {
    fn start(admin: &MultiplexedConnection) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (mut admin, stopped) = (admin.clone(), stop.clone());
        let task = tokio::spawn(async move {
            let mut most = 0;
            while !stopped.load(Ordering::SeqCst) {
                most = most.max(info_field(&mut admin, "clients", "connected_clients").await);
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            most
        });
        Self { stop, task }
    }

    async fn most(self) -> u64 {
        self.stop.store(true, Ordering::SeqCst);
        self.task.await.unwrap()
    }
}

/// Sends `count` requests at once, each with a key of its own (`{prefix}-{n}`), each from a
/// task of its own.
async fn burst(app: &Router, prefix: &str, count: usize) -> Vec<(String, Seen)> {
    let requests: Vec<_> = (0..count)
        .map(|n| {
            let key = format!("{prefix}-{n}");
            (key.clone(), send_in_background(app, keyed("POST", "/payments", &key, "{}")))
        })
        .collect();
    let mut seen = Vec::new();
    for (key, request) in requests {
        seen.push((key, request.await.unwrap()));
    }
    seen
}

/// Every request answered by the handler (201) or, when `replays`, by its replay.
fn all_answered(seen: &[(String, Seen)], replays: bool) {
    for (key, answer) in seen {
        assert_eq!(answer.status, 201, "{key}: {answer:?}");
        assert_eq!(answer.replayed(), replays, "{key}: {answer:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_start_of_200_concurrent_requests_opens_at_most_the_pools_connections() {
    let server = RedisServer::start();
    let mut admin = server.connection().await;
    let before = received(&mut admin).await;
    let watch = Watch::start(&admin);
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(server.store()));

    all_answered(&burst(&app, "cold", 200).await, false);
    all_answered(&burst(&app, "cold", 200).await, true);
    assert_eq!(calls.get(), 200);

    let most = watch.most().await;
    let made = received(&mut admin).await - before;
    assert!(made <= STORE_CONNECTIONS, "{made} connections made, the pool holds {POOL_SIZE}");
    assert!(most <= STORE_CONNECTIONS + 1, "{most} clients at once (the admin's included)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_at_maxclients_60_answers_200_concurrent_requests_without_an_error() {
    let server = RedisServer::start_with(&["--maxclients", "60"]);
    let mut admin = server.connection().await;
    let before = received(&mut admin).await;
    let watch = Watch::start(&admin);
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(server.store()));

    for round in 0..3 {
        // Cold first, then with the store's connections made: fresh keys, then their replays.
        let prefix = format!("round{round}");
        all_answered(&burst(&app, &prefix, 200).await, false);
        all_answered(&burst(&app, &prefix, 200).await, true);
    }
    assert_eq!(calls.get(), 600);

    let most = watch.most().await;
    let made = received(&mut admin).await - before;
    assert!(made <= STORE_CONNECTIONS, "{made} connections made, the pool holds {POOL_SIZE}");
    assert!(most <= STORE_CONNECTIONS + 1, "{most} clients at once (the admin's included)");
    let rejected = info_field(&mut admin, "stats", "rejected_connections").await;
    assert_eq!(rejected, 0, "connections refused at maxclients");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_kill_under_load_is_followed_by_at_most_the_pools_connections() {
    let server = RedisServer::start();
    let mut admin = server.connection().await;
    let watch = Watch::start(&admin);
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(server.store()));
    all_answered(&burst(&app, "warm", 50).await, false);

    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let (app, stop) = (app.clone(), stop.clone());
        tokio::spawn(async move {
            let mut seen = Vec::new();
            let mut round = 0;
            while !stop.load(Ordering::SeqCst) && round < 400 {
                seen.extend(burst(&app, &format!("load{round}"), 50).await);
                round += 1;
            }
            seen
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = received(&mut admin).await;
    // Every normal client but the admin connection itself (SKIPME yes, the default).
    let killed: u64 = redis::cmd("CLIENT")
        .arg(&["KILL", "TYPE", "normal"][..])
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(killed >= 1, "the store's connections were killed");
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::SeqCst);
    let seen = load.await.unwrap();

    // A request that met the kill may be 503 (its claim's outcome unknown, nothing run); every
    // other is answered, and every request after is.
    for (key, answer) in &seen {
        assert!(matches!(answer.status.as_u16(), 201 | 503), "{key}: {answer:?}");
    }
    let unanswered: Vec<_> = seen.iter().filter(|(_, a)| a.status == 503).collect();
    assert!(unanswered.len() < seen.len() / 2, "{} of {} unanswered", unanswered.len(), seen.len());
    all_answered(&burst(&app, "after", 200).await, false);
    for (key, _) in unanswered {
        // A claim whose reply the kill lost holds its key until the store's guard gives it
        // back (in the background, once Redis answers again): 202 until then.
        let mut retry = send(&app, keyed("POST", "/payments", key, "{}")).await;
        for _ in 0..50 {
            if retry.status != 202 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            retry = send(&app, keyed("POST", "/payments", key, "{}")).await;
        }
        assert_eq!(retry.status, 201, "{key}: {retry:?}");
        assert!(!retry.replayed(), "{key}: the request answered 503 ran its handler");
    }
    // The handler ran once per key answered.
    let answered = seen.iter().filter(|(_, a)| a.status == 201).count();
    let retried = seen.len() - answered;
    assert_eq!(calls.get(), 50 + seen.len() + 200, "{answered} answered, {retried} retried");

    let most = watch.most().await;
    let made = received(&mut admin).await - before;
    assert!(made <= STORE_CONNECTIONS, "{made} connections made after the kill");
    assert!(most <= STORE_CONNECTIONS + 1, "{most} clients at once (the admin's included)");
}

#[test]
fn six_runtimes_side_by_side_share_the_pools_connections() {
    let server = RedisServer::start();
    let admin_runtime = tokio::runtime::Runtime::new().unwrap();
    let mut admin = admin_runtime.block_on(server.connection());
    let before = admin_runtime.block_on(received(&mut admin));
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(server.store()));
    // A runtime's connection may be one another runtime made, which ends with that runtime:
    // none ends before every one is done.
    let done = std::sync::Barrier::new(6);
    std::thread::scope(|threads| {
        for name in 0..6 {
            let (app, done) = (app.clone(), &done);
            threads.spawn(move || {
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .enable_all()
                    .build()
                    .unwrap();
                let seen: Vec<_> = (0..3)
                    .flat_map(|round| {
                        runtime.block_on(burst(&app, &format!("rt{name}-{round}"), 50))
                    })
                    .collect();
                done.wait();
                all_answered(&seen, false);
            });
        }
    });
    assert_eq!(calls.get(), 6 * 3 * 50);
    let made = admin_runtime.block_on(received(&mut admin)) - before;
    assert!(made <= STORE_CONNECTIONS, "{made} connections made, the pool holds {POOL_SIZE}");
}
