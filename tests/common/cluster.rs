//! A Redis Cluster of private `redis-server` processes on free loopback ports.

use std::{
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::OnceLock,
    time::{Duration, Instant},
};

use axum_idempotency::{
    RedisStore,
    store::{
        RecordKey,
        deadpool_redis::redis::{self, AsyncCommands},
    },
};

use super::{
    Harness, Held, RawHarness, RawValue, RedisServer, describe_with, free_port, held_in, plant_with,
};

/// Masters and replicas made into one cluster by `redis-cli --cluster create`. Stopped by pid
/// when dropped.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
    dir: PathBuf,
    watchdog: Option<Child>,
}

impl RedisCluster {
    /// Starts `masters` masters with `replicas` replicas each; panics, loudly, when
    /// `redis-server` or `redis-cli` is not on PATH.
    pub fn start(masters: usize, replicas: usize) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "axum-idempotency-cluster-{}-{}",
            std::process::id(),
            Instant::now().elapsed().as_nanos() + u128::from(free_port())
        ));
        std::fs::create_dir_all(&dir).expect("cluster directory");
        let nodes: Vec<RedisServer> = (0..masters * (1 + replicas))
            .map(|_| {
                // A port whose cluster bus (the port + 10,000) is out of range or taken makes
                // the node exit: another port is tried.
                let node = |port: u16| {
                    let config = dir.join(format!("nodes-{port}.conf"));
                    RedisServer::try_start_on(
                        port,
                        &[
                            "--cluster-enabled",
                            "yes",
                            "--cluster-config-file",
                            config.to_str().unwrap(),
                            "--cluster-node-timeout",
                            "1000",
                            // Live shards keep serving while one is down.
                            "--cluster-require-full-coverage",
                            "no",
                            // Replicas sync at once rather than after the default 5 s.
                            "--repl-diskless-sync-delay",
                            "0",
                            "--dir",
                            dir.to_str().unwrap(),
                        ],
                    )
                };
                (0..10)
                    .map(|_| free_port())
                    .filter(|port| *port <= u16::MAX - 10_000)
                    .find_map(node)
                    .expect("a cluster node on a free port")
            })
            .collect();
        let addresses: Vec<String> =
            nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        let status = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdout(Stdio::null())
            .status()
            .unwrap_or_else(|error| {
                panic!(
                    "cluster tests need `redis-cli` on PATH (apt-get install redis-tools): {error}"
                )
            });
        assert!(status.success(), "redis-cli --cluster create failed");
        let cluster = Self { nodes, dir, watchdog: None };
        cluster.wait_until_ok();
        cluster
    }

    /// Waits until every node sees every slot served.
    pub fn wait_until_ok(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        for node in &self.nodes {
            loop {
                let info = Command::new("redis-cli")
                    .args(["-p", &node.port.to_string(), "cluster", "info"])
                    .output()
                    .expect("redis-cli");
                let info = String::from_utf8_lossy(&info.stdout);
                if info.contains("cluster_state:ok") && info.contains("cluster_slots_ok:16384") {
                    break;
                }
                assert!(Instant::now() < deadline, "cluster did not become ok: {info}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// Kills the nodes, by pid, should this process end without dropping the cluster (a
    /// static shared by a test binary is never dropped).
    pub fn stop_with_this_process(&mut self) {
        let pids: Vec<String> = self.nodes.iter().map(|n| n.pid().to_string()).collect();
        let script = format!(
            "while kill -0 {} 2>/dev/null; do sleep 0.5; done; kill -9 {} 2>/dev/null; rm -rf '{}'",
            std::process::id(),
            pids.join(" "),
            self.dir.display()
        );
        self.watchdog = Some(Command::new("sh").args(["-c", &script]).spawn().expect("watchdog"));
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    pub fn store(&self) -> RedisStore {
        RedisStore::cluster_from_urls(self.urls()).expect("cluster store")
    }

    /// A node that accepts connections.
    fn live_node(&self) -> &RedisServer {
        self.nodes
            .iter()
            .find(|n| std::net::TcpStream::connect(("127.0.0.1", n.port)).is_ok())
            .expect("a live node")
    }

    /// The nodes that are masters now, with the slot ranges they serve.
    pub async fn masters(&self) -> Vec<(u16, Vec<(u16, u16)>)> {
        let mut connection = self.live_node().connection().await;
        let slots: Vec<redis::Value> =
            redis::cmd("CLUSTER").arg("SLOTS").query_async(&mut connection).await.unwrap();
        let mut masters: Vec<(u16, Vec<(u16, u16)>)> = Vec::new();
        for range in slots {
            let redis::Value::Array(fields) = range else { panic!("CLUSTER SLOTS") };
            let (redis::Value::Int(start), redis::Value::Int(end), redis::Value::Array(master)) =
                (&fields[0], &fields[1], &fields[2])
            else {
                panic!("CLUSTER SLOTS shape")
            };
            let redis::Value::Int(port) = master[1] else { panic!("CLUSTER SLOTS port") };
            let port = u16::try_from(port).unwrap();
            let range = (u16::try_from(*start).unwrap(), u16::try_from(*end).unwrap());
            match masters.iter_mut().find(|(p, _)| *p == port) {
                Some((_, ranges)) => ranges.push(range),
                None => masters.push((port, vec![range])),
            }
        }
        masters.sort();
        masters
    }

    pub fn node(&self, port: u16) -> &RedisServer {
        self.nodes.iter().find(|n| n.port == port).expect("node")
    }

    pub fn node_mut(&mut self, port: u16) -> &mut RedisServer {
        self.nodes.iter_mut().find(|n| n.port == port).expect("node")
    }

    pub async fn cluster_connection(&self) -> redis::cluster_async::ClusterConnection {
        redis::cluster::ClusterClient::new(self.urls())
            .unwrap()
            .get_async_connection()
            .await
            .expect("cluster connection")
    }

    pub async fn held(&self, key: &RecordKey) -> Option<Held> {
        let record: Option<Vec<u8>> =
            self.cluster_connection().await.get(key.as_str()).await.expect("GET");
        held_in(key, record)
    }

    /// Keys per master, by port.
    pub async fn dbsize_per_master(&self) -> Vec<(u16, usize)> {
        let mut sizes = Vec::new();
        for (port, _) in self.masters().await {
            let mut connection = self.node(port).connection().await;
            sizes.push((port, super::redis::records_on(&mut connection).await));
        }
        sizes
    }

    pub async fn flush(&self) {
        for (port, _) in self.masters().await {
            let mut connection = self.node(port).connection().await;
            let () = redis::cmd("FLUSHALL").query_async(&mut connection).await.unwrap();
        }
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            node.kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The behaviour suite's harness on one 3-master cluster shared by the test binary. Tests
/// take turns on it, each starting from an empty cluster.
pub struct ClusterHarness {
    cluster: &'static RedisCluster,
    store: RedisStore,
    _turn: tokio::sync::MutexGuard<'static, ()>,
}

impl ClusterHarness {
    /// The shared cluster, for what a test reads on its nodes.
    pub fn cluster(&self) -> &RedisCluster {
        self.cluster
    }
}

impl Harness for ClusterHarness {
    type Store = RedisStore;

    async fn start() -> Self {
        static CLUSTER: OnceLock<RedisCluster> = OnceLock::new();
        static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
        let turn = TURN.lock().await;
        let cluster = CLUSTER.get_or_init(|| {
            let mut cluster = RedisCluster::start(3, 0);
            cluster.stop_with_this_process();
            cluster
        });
        cluster.flush().await;
        Self { cluster, store: cluster.store(), _turn: turn }
    }

    fn store(&self) -> RedisStore {
        self.store.clone()
    }

    fn second_store(&self) -> RedisStore {
        self.cluster.store()
    }

    async fn held(&self, key: &RecordKey) -> Option<Held> {
        self.cluster.held(key).await
    }

    async fn record_count(&self) -> usize {
        self.cluster.dbsize_per_master().await.iter().map(|(_, n)| n).sum()
    }
}

impl RawHarness for ClusterHarness {
    async fn subscribers(&self, key: &RecordKey) -> usize {
        let channel = super::settle_channel(key);
        let mut total = 0;
        for node in &self.cluster.nodes {
            total += super::subscribers_on(node, &channel).await;
        }
        total
    }

    async fn describe(&self, key: &RecordKey) -> String {
        describe_with(&mut self.cluster.cluster_connection().await, key).await
    }

    async fn raw(&self, key: &RecordKey) -> Option<Vec<u8>> {
        self.cluster.cluster_connection().await.get(key.as_str()).await.expect("GET")
    }

    async fn pttl(&self, key: &RecordKey) -> i64 {
        self.cluster.cluster_connection().await.pttl(key.as_str()).await.expect("PTTL")
    }

    async fn plant(&self, key: &RecordKey, value: RawValue) {
        plant_with(&mut self.cluster.cluster_connection().await, key, value).await;
    }
}

/// The hash slot of a key, as Redis Cluster computes it: CRC16 (XMODEM) of the hash tag, or
/// of the whole key when it has none, modulo 16384.
pub fn key_slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let tagged = bytes.iter().position(|&b| b == b'{').and_then(|open| {
        let close = bytes[open + 1..].iter().position(|&b| b == b'}')?;
        (close > 0).then(|| &bytes[open + 1..open + 1 + close])
    });
    let mut crc: u16 = 0;
    for &byte in tagged.unwrap_or(bytes) {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
        }
    }
    crc % 16384
}
