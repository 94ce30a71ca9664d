//! Redis Sentinel: a master, a replica and three sentinels, all private processes on free
//! loopback ports. Records go to the master the sentinels name; after a failover the store
//! follows the new master and completed records are still replayed. (Built with the
//! `sentinel` feature: `cargo test --all-features`.)

use crate::common;

use std::{
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use axum_idempotency::{
    IdempotencyLayer, RedisStore,
    store::deadpool_redis::redis::{self, AsyncCommands},
};
use common::*;

const MASTER: &str = "mymaster";

/// A `redis-server --sentinel` process, stopped by pid when dropped.
struct Sentinel {
    child: Child,
    port: u16,
}

impl Sentinel {
    fn start(dir: &Path, master_port: u16) -> Self {
        let port = free_port();
        let config = dir.join(format!("sentinel-{port}.conf"));
        std::fs::write(
            &config,
            format!(
                "port {port}\nbind 127.0.0.1\nsentinel monitor {MASTER} 127.0.0.1 {master_port} 2\n\
                 sentinel down-after-milliseconds {MASTER} 1000\nsentinel failover-timeout {MASTER} 5000\n"
            ),
        )
        .unwrap();
        let child = Command::new("redis-server")
            .arg(&config)
            .arg("--sentinel")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|error| panic!("this test needs `redis-server` on PATH: {error}"));
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "a sentinel did not come up");
            std::thread::sleep(Duration::from_millis(20));
        }
        Self { child, port }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    async fn connection(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url()).unwrap().get_multiplexed_async_connection().await.unwrap()
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The port of the master the sentinel names now.
async fn master_port(sentinel: &Sentinel) -> u16 {
    let (_, port): (String, String) = redis::cmd("SENTINEL")
        .arg("GET-MASTER-ADDR-BY-NAME")
        .arg(MASTER)
        .query_async(&mut sentinel.connection().await)
        .await
        .unwrap();
    port.parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_follows_the_master_through_a_failover_and_keeps_its_records() {
    let master = RedisServer::start();
    let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &master.port.to_string()]);
    let dir =
        std::env::temp_dir().join(format!("axum-idempotency-sentinel-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sentinels: Vec<Sentinel> = (0..3).map(|_| Sentinel::start(&dir, master.port)).collect();
    // The sentinels learn of the replica from the master.
    eventually_within(Duration::from_secs(20), "the sentinels know the replica", async || {
        let replicas: Vec<redis::Value> = redis::cmd("SENTINEL")
            .arg("REPLICAS")
            .arg(MASTER)
            .query_async(&mut sentinels[0].connection().await)
            .await
            .unwrap_or_default();
        !replicas.is_empty()
    })
    .await;

    let store =
        RedisStore::sentinel_from_urls(sentinels.iter().map(Sentinel::url), MASTER).unwrap();
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(store));
    let first = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    assert_eq!(first.status, 201);
    assert!(!first.replayed());
    assert!(send(&app, keyed("POST", "/payments", "k1", "{}")).await.replayed());
    // The record is on the master, and reaches the replica.
    let key = global("k1");
    let on_master: Option<Vec<u8>> = master.connection().await.get(key.as_str()).await.unwrap();
    assert_eq!(&on_master.expect("the record is on the master")[..2], b"1C");
    eventually_within(Duration::from_secs(20), "the replica has the record", async || {
        replica.connection().await.exists::<_, bool>(key.as_str()).await.unwrap()
    })
    .await;

    // A failover: the replica is promoted, the old master demoted.
    // Retried while the sentinels do not yet count the replica as good to promote.
    eventually_within(Duration::from_secs(20), "the sentinels start a failover", async || {
        redis::cmd("SENTINEL")
            .arg("FAILOVER")
            .arg(MASTER)
            .query_async::<()>(&mut sentinels[0].connection().await)
            .await
            .is_ok()
    })
    .await;
    eventually_within(Duration::from_secs(20), "the sentinels name the replica", async || {
        master_port(&sentinels[0]).await == replica.port
    })
    .await;
    // Until the sentinels demote the old master it still takes writes, which its demotion then
    // discards: the failover window `RedisStore`'s docs name. Once it is a replica, its answer is
    // READONLY, and the store must move to the new master.
    eventually_within(Duration::from_secs(20), "the old master is demoted", async || {
        // While it resyncs from the new master it may refuse a connection (LOADING): ask again.
        let Ok(mut connection) =
            redis::Client::open(master.url()).unwrap().get_multiplexed_async_connection().await
        else {
            return false;
        };
        let info: Result<String, _> =
            redis::cmd("INFO").arg("replication").query_async(&mut connection).await;
        info.is_ok_and(|info| info.contains("role:slave"))
    })
    .await;
    // The store finds the new master: requests succeed again, and the completed record is
    // still replayed, not run again.
    let answers = std::sync::Mutex::new(Vec::new());
    eventually_within(Duration::from_secs(20), "a fresh request succeeds again", async || {
        let seen = send(&app, keyed("POST", "/payments", "k2", "{}")).await;
        let done = seen.status == 201;
        answers.lock().unwrap().push(seen);
        done
    })
    .await;
    let answers = answers.into_inner().unwrap();
    assert!(!answers.last().unwrap().replayed(), "{answers:?}");
    let replay = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    assert!(replay.replayed(), "{replay:?}");
    let on_new_master: Option<Vec<u8>> =
        replica.connection().await.get(global("k2").as_str()).await.unwrap();
    assert!(on_new_master.is_some(), "the new record is on the new master");
    assert_eq!(calls.get(), 2, "{answers:?}");
    drop(sentinels);
    let _ = std::fs::remove_dir_all(&dir);
}
