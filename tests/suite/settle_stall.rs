//! A response once produced is never produced again: the store stalls (paused with SIGSTOP,
//! busy with a long script, or cut off behind a proxy, so that every command fails fast) right
//! after the handler returned, before its response is stored,
//! for 2 seconds and for the lease less a second. The settle keeps its lease and keeps trying,
//! so no retry (during the stall, or after it and past the lease) runs the handler again:
//! every retry that is answered gets the first response. Redis and PostgreSQL, each a private
//! server of the test's own.
#![cfg(all(feature = "redis", feature = "postgres"))]

use crate::common;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use axum::{Router, http::StatusCode, routing::post};
use axum_idempotency::{IdempotencyLayer, store::Store};
use common::{Calls, RedisServer, keyed, outage::OutageProxy, postgres::PrivatePostgres, send};

/// The lease of the tests' layers: the stalls are 2 s and this less a second.
const LEASE: Duration = Duration::from_secs(4);

/// How a store is made to stall.
#[derive(Clone)]
enum Stall {
    /// Every process of the server stopped (SIGSTOP), then continued: commands wait.
    PausedRedis(Arc<RedisServer>),
    /// A script that runs for the whole stall: every other command is refused with `BUSY`.
    BusyRedis(Arc<RedisServer>),
    PausedPostgres(Arc<PrivatePostgres>),
    /// The store's connections cut and refused: every command fails fast.
    CutOff(Arc<OutageProxy>),
    /// A long script on every master of a Cluster.
    #[cfg(feature = "cluster")]
    BusyCluster(Arc<common::cluster::RedisCluster>),
}

impl Stall {
    /// Starts a stall of `length` and returns once it is under way.
    async fn begin(&self, length: Duration) {
        match self {
            Self::PausedRedis(server) => {
                server.signal("-STOP");
                let server = server.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(length).await;
                    server.signal("-CONT");
                });
            }
            Self::BusyRedis(server) => {
                busy(server, length).await;
                // Past `busy-reply-threshold`, other commands are refused.
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
            #[cfg(feature = "cluster")]
            Self::BusyCluster(cluster) => {
                for node in &cluster.nodes {
                    busy(node, length).await;
                }
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
            Self::CutOff(proxy) => proxy.cut_for(length),
            Self::PausedPostgres(server) => {
                server.signal("-STOP");
                let server = server.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(length).await;
                    server.signal("-CONT");
                });
            }
        }
    }
}

/// Runs a script on `server` for `length`, refusing every other command past the server's
/// `busy-reply-threshold` (set to 100 ms here).
async fn busy(server: &RedisServer, length: Duration) {
    let mut connection = server.connection().await;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("busy-reply-threshold")
        .arg("100")
        .query_async(&mut connection)
        .await
        .unwrap();
    let micros = length.as_micros().to_string();
    tokio::spawn(async move {
        let busy = "local t = redis.call('TIME')
            local start = t[1] * 1000000 + t[2]
            while true do
                local n = redis.call('TIME')
                if n[1] * 1000000 + n[2] - start > tonumber(ARGV[1]) then break end
            end
            return 1";
        let _: Result<i64, _> =
            redis::cmd("EVAL").arg(busy).arg(0).arg(&micros).query_async(&mut connection).await;
    });
}

/// The handler runs, its store stalls for `length` as it returns; retries come during the
/// stall and after it, past the lease: the handler ran once, and every retry answered 201 is
/// the first response, replayed.
async fn a_stall_after_the_handler_never_runs_it_twice<St: Store>(
    store: St,
    stall: Stall,
    length: Duration,
) {
    let calls = Calls::default();
    let handler = {
        let (calls, stall) = (calls.clone(), stall.clone());
        move || async move {
            let call = calls.next_call();
            stall.begin(length).await;
            (StatusCode::CREATED, format!("payment {call}"))
        }
    };
    let app: Router =
        Router::new().route("/pay", post(handler)).layer(IdempotencyLayer::new(store).lease(LEASE));
    let started = Instant::now();
    let first = send(&app, keyed("POST", "/pay", "k1", "{}")).await;
    assert_eq!((first.status, first.body.as_str()), (StatusCode::CREATED, "payment 1"));
    // Retries during the stall: an error (the store cannot answer), a wait, or the replay.
    let mut during = Vec::new();
    while started.elapsed() < length {
        during.push(common::send_in_background(&app, keyed("POST", "/pay", "k1", "{}")));
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    for retry in during {
        let retry = retry.await.unwrap();
        if retry.status == StatusCode::CREATED {
            assert_eq!(retry.body, "payment 1", "{retry:?}");
        }
    }
    // Past the stall and past the lease of a holder that would have given up.
    let after = (length + LEASE + Duration::from_millis(500)).saturating_sub(started.elapsed());
    tokio::time::sleep(after).await;
    let retry = send(&app, keyed("POST", "/pay", "k1", "{}")).await;
    assert_eq!((retry.status, retry.body.as_str()), (StatusCode::CREATED, "payment 1"));
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(calls.get(), 1, "the handler ran again");
}

fn redis() -> Arc<RedisServer> {
    Arc::new(RedisServer::start())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_paused_for_two_seconds() {
    let server = redis();
    let stall = Stall::PausedRedis(server.clone());
    a_stall_after_the_handler_never_runs_it_twice(server.store(), stall, Duration::from_secs(2))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_paused_for_the_lease_less_a_second() {
    let server = redis();
    let stall = Stall::PausedRedis(server.clone());
    let length = LEASE - Duration::from_secs(1);
    a_stall_after_the_handler_never_runs_it_twice(server.store(), stall, length).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_busy_for_two_seconds() {
    let server = redis();
    let stall = Stall::BusyRedis(server.clone());
    a_stall_after_the_handler_never_runs_it_twice(server.store(), stall, Duration::from_secs(2))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_busy_for_the_lease_less_a_second() {
    let server = redis();
    let stall = Stall::BusyRedis(server.clone());
    let length = LEASE - Duration::from_secs(1);
    a_stall_after_the_handler_never_runs_it_twice(server.store(), stall, length).await;
}

/// A store over the PostgreSQL at `url`.
fn postgres_store(url: &str) -> axum_idempotency::store::PostgresStore {
    let pool = axum_idempotency::store::sqlx::postgres::PgPoolOptions::new()
        .test_before_acquire(false)
        .connect_lazy(url)
        .unwrap();
    axum_idempotency::store::PostgresStore::new(pool).sweep_every(None)
}

async fn postgres() -> (Arc<PrivatePostgres>, axum_idempotency::store::PostgresStore) {
    let server = Arc::new(PrivatePostgres::start());
    let store = postgres_store(&server.url());
    store.migrate().await.unwrap();
    (server, store)
}

/// A private PostgreSQL (migrated), and a store that reaches it through a proxy to cut off.
async fn postgres_behind_a_proxy()
-> (Arc<PrivatePostgres>, Arc<OutageProxy>, axum_idempotency::store::PostgresStore) {
    let (server, _) = postgres().await;
    let proxy = cut_off(server.port).await;
    let store = postgres_store(&format!("postgres://postgres@127.0.0.1:{}/postgres", proxy.port));
    (server, proxy, store)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_paused_for_two_seconds() {
    let (server, store) = postgres().await;
    let stall = Stall::PausedPostgres(server);
    a_stall_after_the_handler_never_runs_it_twice(store, stall, Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_paused_for_the_lease_less_a_second() {
    let (server, store) = postgres().await;
    let stall = Stall::PausedPostgres(server);
    let length = LEASE - Duration::from_secs(1);
    a_stall_after_the_handler_never_runs_it_twice(store, stall, length).await;
}

async fn cut_off(target: u16) -> Arc<OutageProxy> {
    Arc::new(OutageProxy::start(target).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cut_off_for_the_lease_less_a_second() {
    let server = redis();
    let proxy = cut_off(server.port).await;
    let store =
        axum_idempotency::RedisStore::from_url(&format!("redis://127.0.0.1:{}", proxy.port))
            .unwrap();
    let length = LEASE - Duration::from_secs(1);
    a_stall_after_the_handler_never_runs_it_twice(store, Stall::CutOff(proxy), length).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_cut_off_for_two_seconds() {
    let (_server, proxy, store) = postgres_behind_a_proxy().await;
    let length = Duration::from_secs(2);
    a_stall_after_the_handler_never_runs_it_twice(store, Stall::CutOff(proxy), length).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_cut_off_for_the_lease_less_a_second() {
    let (_server, proxy, store) = postgres_behind_a_proxy().await;
    let length = LEASE - Duration::from_secs(1);
    a_stall_after_the_handler_never_runs_it_twice(store, Stall::CutOff(proxy), length).await;
}

#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_busy_for_the_lease_less_a_second() {
    let cluster = Arc::new(common::cluster::RedisCluster::start(3, 0));
    let store = cluster.store();
    let length = LEASE - Duration::from_secs(1);
    a_stall_after_the_handler_never_runs_it_twice(store, Stall::BusyCluster(cluster), length).await;
}
