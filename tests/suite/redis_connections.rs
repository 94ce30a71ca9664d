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

/// This process's TCP sockets whose remote port is `port`, but for those from `except` (local
/// ports). Every state counts but `TIME_WAIT` (both ends closed, the server forgot it) and
/// `LISTEN`: a socket closed on our side while the server is stopped (`FIN_WAIT2`) still sits
/// in the server's accept queue, and Redis accepts it on resume, against its `maxclients`,
/// as it does one still connecting or connected.
fn sockets_to(port: u16, except: &[u16]) -> usize {
    const TIME_WAIT: &str = "06";
    const LISTEN: &str = "0A";
    let port_of = |address: &str| {
        let hex = address.rsplit(':').next()?;
        u16::from_str_radix(hex, 16).ok()
    };
    ["/proc/self/net/tcp", "/proc/self/net/tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(table).ok())
        .map(|table| {
            table
                .lines()
                .skip(1)
                .filter(|line| {
                    let fields: Vec<&str> = line.split_whitespace().collect();
                    let (Some(local), Some(remote), Some(state)) =
                        (fields.get(1), fields.get(2), fields.get(3))
                    else {
                        return false;
                    };
                    port_of(remote) == Some(port)
                        && ![TIME_WAIT, LISTEN].contains(state)
                        && !port_of(local).is_some_and(|local| except.contains(&local))
                })
                .count()
        })
        .sum()
}

/// The local port of `admin`, as the server names its peer (`CLIENT INFO`, `addr=ip:port`).
async fn local_port(admin: &mut MultiplexedConnection) -> u16 {
    let info: String = redis::cmd("CLIENT").arg("INFO").query_async(admin).await.unwrap();
    info.split_whitespace()
        .find_map(|field| field.strip_prefix("addr="))
        .and_then(|address| address.rsplit(':').next()?.parse().ok())
        .expect("addr= in CLIENT INFO")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_stopped_for_5_s_under_200_clients_gets_at_most_the_pools_connections() {
    let server = RedisServer::start_with(&["--maxclients", "60"]);
    let mut admin = server.connection().await;
    let admin_port = local_port(&mut admin).await;
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(server.store()));

    // Sampled from a thread of its own: the runtime's two workers are busy with the clients.
    let stop_sampling = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (stop, port) = (stop_sampling.clone(), server.port);
        std::thread::spawn(move || {
            let started = std::time::Instant::now();
            let mut samples = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                samples.push((started.elapsed(), sockets_to(port, &[admin_port])));
                std::thread::sleep(Duration::from_millis(100));
            }
            samples
        })
    };
    let stop_clients = Arc::new(AtomicBool::new(false));
    let resumed = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..200)
        .map(|client| {
            let (app, stop, resumed) = (app.clone(), stop_clients.clone(), resumed.clone());
            tokio::spawn(async move {
                let (mut answered, mut answered_after_resume, mut n) = (0, 0, 0);
                while !stop.load(Ordering::SeqCst) {
                    n += 1;
                    let key = format!("stall-{client}-{n}");
                    let seen = send(&app, keyed("POST", "/payments", &key, "{}")).await;
                    assert!(matches!(seen.status.as_u16(), 201 | 503), "{key}: {seen:?}");
                    if seen.status == 201 {
                        answered += 1;
                        answered_after_resume += usize::from(resumed.load(Ordering::SeqCst));
                    }
                    // A client's pause between requests, so that 200 of them leave the
                    // machine some room.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                (answered, answered_after_resume)
            })
        })
        .collect();

    tokio::time::sleep(Duration::from_secs(1)).await;
    server.signal("-STOP");
    tokio::time::sleep(Duration::from_secs(5)).await;
    server.signal("-CONT");
    tokio::time::sleep(Duration::from_secs(1)).await;
    resumed.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop_clients.store(true, Ordering::SeqCst);
    let (mut answered, mut answered_after_resume) = (0, 0);
    for client in clients {
        let (all, after) = client.await.unwrap();
        answered += all;
        answered_after_resume += after;
    }
    stop_sampling.store(true, Ordering::SeqCst);
    let samples = sampler.join().unwrap();

    let most = samples.iter().map(|(_, count)| *count).max().unwrap_or(0) as u64;
    let rejected = info_field(&mut admin, "stats", "rejected_connections").await;
    let made = received(&mut admin).await;
    let series: Vec<_> = samples.iter().step_by(5).map(|(_, count)| count).collect();
    eprintln!(
        "stall: at most {most} sockets to Redis (every 500 ms: {series:?}); {made} connections \
         received, {rejected} rejected; {answered} requests answered, {answered_after_resume} \
         in the last 2 s"
    );
    assert!(answered_after_resume > 0, "no request answered after Redis resumed");
    assert_eq!(rejected, 0, "connections refused at maxclients on resume");
    assert!(most <= STORE_CONNECTIONS, "{most} sockets at once, the pool holds {POOL_SIZE}");
}

/// Redis killed for good under 200 clients: every claim fails fast with 503 (the store
/// reconnecting, or the connect failing), and a claim that was never sent leaves no task
/// behind to abandon it: the runtime's tasks stay bounded however long the outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_gone_for_good_fails_fast_and_leaves_no_abandons_behind() {
    let mut server = RedisServer::start();
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(server.store()));
    let warm = send(&app, keyed("POST", "/payments", "warm", "{}")).await;
    assert_eq!(warm.status.as_u16(), 201, "{warm:?}");
    server.kill();
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..200)
        .map(|client| {
            let (app, stop) = (app.clone(), stop.clone());
            tokio::spawn(async move {
                let mut n = 0;
                while !stop.load(Ordering::SeqCst) {
                    n += 1;
                    let request = keyed("POST", "/payments", &format!("gone-{client}-{n}"), "{}");
                    let seen = send(&app, request).await;
                    assert_eq!(seen.status.as_u16(), 503, "{seen:?}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                n
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let alive = tokio::runtime::Handle::current().metrics().num_alive_tasks();
    stop.store(true, Ordering::SeqCst);
    let mut sent = 0;
    for client in clients {
        sent += client.await.unwrap();
    }
    assert!(sent > 2_000, "{sent} requests in 3 s: the 503s were not fast");
    // The 200 clients and the store's own few: not one abandon a failed claim.
    assert!(alive < 400, "{alive} tasks alive after {sent} failed requests");
    assert_eq!(calls.get(), 1);
}
