//! The Redis half of the harness: private `redis-server` processes, the Redis-backed store
//! harnesses, and raw access to what they hold.

use std::{
    collections::BTreeMap,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use axum_idempotency::{
    RedisStore,
    store::{
        CachingStore, RecordKey,
        deadpool_redis::{
            Config, Pool, Runtime,
            redis::{self, AsyncCommands},
        },
    },
};

use super::{Harness, Held, RawHarness, RawValue, free_port, settle_channel};

/// The commands our Lua scripts run inside Redis. `INFO commandstats` counts those too; they
/// cost no round trip, so they are left out of the count.
pub fn script_internal_commands() -> Vec<String> {
    let mut commands = Vec::new();
    for script in ["claim", "complete", "release", "touch"] {
        let path = format!("{}/lua/{script}.lua", env!("CARGO_MANIFEST_DIR"));
        let source = std::fs::read_to_string(path).unwrap();
        // Both `redis.call('X'` and `redis.pcall('X'`.
        for call in source.split("call('").skip(1) {
            commands.push(call.split('\'').next().unwrap().to_lowercase());
        }
    }
    commands
}

/// Round trips per command since the last `CONFIG RESETSTAT`.
pub async fn command_calls(server: &RedisServer) -> BTreeMap<String, u64> {
    let internal = script_internal_commands();
    let mut redis = server.connection().await;
    let info: String =
        redis::cmd("INFO").arg("commandstats").query_async(&mut redis).await.unwrap();
    // Lines look like `cmdstat_evalsha:calls=20,usec=...`.
    info.lines()
        .filter_map(|line| line.strip_prefix("cmdstat_"))
        .filter_map(|line| {
            let (command, stats) = line.split_once(':')?;
            let calls = stats.split(',').find_map(|stat| stat.strip_prefix("calls="))?;
            Some((command.to_owned(), calls.parse().ok()?))
        })
        .filter(|(command, _)| !internal.contains(command))
        // The test's own looks: INFO, CONFIG RESETSTAT, PUBSUB NUMSUB / SHARDNUMSUB.
        .filter(|(command, _)| {
            !["info", "config|resetstat", "pubsub|numsub", "pubsub|shardnumsub"]
                .contains(&command.as_str())
        })
        .collect()
}

/// How many connections the server has accepted since it started, this look's own included.
pub async fn connections_received(server: &RedisServer) -> u64 {
    let mut redis = server.connection().await;
    let info: String = redis::cmd("INFO").arg("stats").query_async(&mut redis).await.unwrap();
    info.lines()
        .find_map(|line| line.strip_prefix("total_connections_received:"))
        .and_then(|count| count.trim().parse().ok())
        .expect("total_connections_received in INFO stats")
}

pub async fn reset_command_stats(server: &RedisServer) {
    let mut redis = server.connection().await;
    let () = redis::cmd("CONFIG").arg("RESETSTAT").query_async(&mut redis).await.unwrap();
}

/// How a test's store is built: over a pool of the app's own (`RedisStore::new`, no
/// subscriber), or from a URL, as the docs build it (`RedisStore::from_url`: a pool the
/// store builds, with the subscriber). Both share the pool's connections, each command bounded
/// by redis-rs's response timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Built {
    AppPool,
    FromUrl,
}

impl Built {
    /// The store built this way for `server`, with `timeout` as its command timeout.
    pub fn store(self, server: &RedisServer, timeout: Duration) -> RedisStore {
        let store = match self {
            Self::AppPool => RedisStore::new(server.pool()),
            Self::FromUrl => server.store(),
        };
        store.command_timeout(timeout)
    }

    /// `key`, made this way's own: the two ways run side by side in one process, whose logs
    /// their tests share.
    pub fn key(self, key: &str) -> String {
        format!("{key}-{self:?}")
    }
}

/// Runs each named test, an `async fn(Built)`, once per way a Redis store is built:
/// `app_pool::*` and `from_url::*`.
#[macro_export]
macro_rules! both_redis_stores {
    ($($test:ident),* $(,)?) => {
        mod app_pool {
            $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() {
                super::$test($crate::common::Built::AppPool).await;
            }
            )*
        }
        mod from_url {
            $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() {
                super::$test($crate::common::Built::FromUrl).await;
            }
            )*
        }
    };
}

/// A private `redis-server` on a free loopback port, stopped by pid when dropped.
pub struct RedisServer {
    child: Child,
    pub port: u16,
}

impl RedisServer {
    /// Starts a server; panics, loudly, when `redis-server` is not on PATH.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    pub fn start_with(extra: &[&str]) -> Self {
        // A free port can be taken by a server another test starts at the same moment: then
        // ours exits, and we try another port.
        for _ in 0..5 {
            if let Some(server) = Self::try_start_on(free_port(), extra) {
                return server;
            }
        }
        panic!("no redis-server could be started on a free port");
    }

    /// Starts a server on `port`; `None` when it cannot listen there.
    pub fn try_start_on(port: u16, extra: &[&str]) -> Option<Self> {
        let child = Self::spawn(port, extra);
        let mut server = Self { child, port };
        server.wait_until_up().then_some(server)
    }

    fn spawn(port: u16, extra: &[&str]) -> Child {
        // A directory of its own, emptied first: a replica's full sync makes its master write
        // an RDB file, which a later server started in the same directory would load.
        let dir = std::env::temp_dir().join(format!("axum-idempotency-redis-{port}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a directory for redis-server");
        Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&dir)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|error| {
                panic!("these tests need `redis-server` on PATH (apt-get install redis-server): {error}")
            })
    }

    /// Waits until the server on the port answers and is ours (its `process_id` is our
    /// child's pid). False when our child exited: the port was taken.
    fn wait_until_up(&mut self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if self.child.try_wait().ok().flatten().is_some() {
                return false;
            }
            if let Ok(client) = redis::Client::open(self.url())
                && let Ok(mut connection) = client.get_connection()
                && let Ok(info) = redis::cmd("INFO").arg("server").query::<String>(&mut connection)
                && info.contains(&format!("process_id:{}\r", self.child.id()))
            {
                return true;
            }
            assert!(
                Instant::now() < deadline,
                "redis-server on port {} did not come up",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn pool(&self) -> Pool {
        Config::from_url(self.url()).create_pool(Some(Runtime::Tokio1)).expect("pool")
    }

    /// The store a user of the docs makes: `RedisStore::from_url` (a pool of its own, a
    /// subscriber for waiters). A pool of the app's own,
    /// `RedisStore::new(pool)`, is tested in `tests/suite/redis.rs`, and beside this one in
    /// `tests/redis_faults.rs` and `tests/redis_lost_answers.rs` ([`Built`]).
    pub fn store(&self) -> RedisStore {
        RedisStore::from_url(&self.url()).expect("store")
    }

    /// A plain connection for looking at what the layer wrote.
    pub async fn connection(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .expect("client")
            .get_multiplexed_async_connection()
            .await
            .expect("connection to the test redis")
    }

    /// What the record under `key` is, read straight from Redis: `1P…` in progress, `1C…`
    /// completed, `1X…` an abandoned claim's marker (see `src/store/redis/mod.rs`).
    pub async fn held(&self, key: &RecordKey) -> Option<Held> {
        let record: Option<Vec<u8>> = self.connection().await.get(key.as_str()).await.expect("GET");
        held_in(key, record)
    }

    /// Kills the server (SIGKILL) and starts it again on the same port, empty.
    pub fn restart(&mut self) {
        self.kill();
        self.child = Self::spawn(self.port, &[]);
        assert!(self.wait_until_up(), "redis-server could not listen on port {} again", self.port);
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn signal(&self, signal: &str) {
        let status =
            Command::new("kill").args([signal, &self.pid().to_string()]).status().expect("kill");
        assert!(status.success(), "kill {signal} failed");
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // A stopped server ignores SIGTERM until continued; SIGKILL works either way.
        self.kill();
        // And its directory goes with it: nothing left behind in the temporary folder.
        let dir = std::env::temp_dir().join(format!("axum-idempotency-redis-{}", self.port));
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// What a Redis value under `key` is: `1P…` in progress, `1C…` completed, `1X…` an abandoned
/// claim's marker (see `src/store/redis/mod.rs`).
pub fn held_in(key: &RecordKey, record: Option<Vec<u8>>) -> Option<Held> {
    match record?.get(..2) {
        Some(b"1P") => Some(Held::InProgress),
        Some(b"1C") => Some(Held::Completed),
        Some(b"1X") => Some(Held::Abandoned),
        other => panic!("record {} is not one the layer writes: {other:?}", key.as_str()),
    }
}

pub struct RedisHarness {
    pub server: RedisServer,
    pub store: RedisStore,
}

impl Harness for RedisHarness {
    type Store = RedisStore;

    async fn start() -> Self {
        let server = RedisServer::start();
        let store = server.store();
        Self { server, store }
    }

    fn store(&self) -> RedisStore {
        self.store.clone()
    }

    fn second_store(&self) -> RedisStore {
        self.server.store()
    }

    async fn held(&self, key: &RecordKey) -> Option<Held> {
        self.server.held(key).await
    }

    async fn record_count(&self) -> usize {
        records_on(&mut self.server.connection().await).await
    }
}

/// `CachingStore` in front of Redis: completed records copied in process. `store()` is one
/// instance's cache; `second_store()` another instance's, over the same Redis.
pub struct CachedHarness {
    pub server: RedisServer,
    pub store: CachingStore<RedisStore>,
}

impl Harness for CachedHarness {
    type Store = CachingStore<RedisStore>;

    async fn start() -> Self {
        let server = RedisServer::start();
        let store = CachingStore::new(server.store());
        Self { server, store }
    }

    fn store(&self) -> CachingStore<RedisStore> {
        self.store.clone()
    }

    fn second_store(&self) -> CachingStore<RedisStore> {
        CachingStore::new(self.server.store())
    }

    async fn held(&self, key: &RecordKey) -> Option<Held> {
        self.server.held(key).await
    }

    async fn record_count(&self) -> usize {
        records_on(&mut self.server.connection().await).await
    }
}

/// Subscribers of `channel` on one server: plain and sharded.
pub async fn subscribers_on(server: &RedisServer, channel: &str) -> usize {
    let mut connection = server.connection().await;
    let mut total = 0;
    for command in ["NUMSUB", "SHARDNUMSUB"] {
        let (_, count): (String, usize) = redis::cmd("PUBSUB")
            .arg(command)
            .arg(channel)
            .query_async::<Vec<(String, usize)>>(&mut connection)
            .await
            .expect("PUBSUB")
            .pop()
            .expect("one channel");
        total += count;
    }
    total
}

pub async fn plant_with<C: redis::aio::ConnectionLike + Send>(
    connection: &mut C,
    key: &RecordKey,
    value: RawValue,
) {
    match value {
        RawValue::String(bytes) => {
            let () = redis::cmd("SET")
                .arg(key.as_str())
                .arg(bytes)
                .query_async(connection)
                .await
                .unwrap();
        }
        RawValue::Hash => {
            let _: i64 = redis::cmd("HSET")
                .arg(key.as_str())
                .arg("state")
                .arg("completed")
                .query_async(connection)
                .await
                .unwrap();
        }
    }
}

pub async fn describe_with<C: redis::aio::ConnectionLike + Send>(
    connection: &mut C,
    key: &RecordKey,
) -> String {
    let kind: String = redis::cmd("TYPE").arg(key.as_str()).query_async(connection).await.unwrap();
    let contents: redis::Value = match kind.as_str() {
        "string" => redis::cmd("GET").arg(key.as_str()).query_async(connection).await.unwrap(),
        "hash" => redis::cmd("HGETALL").arg(key.as_str()).query_async(connection).await.unwrap(),
        _ => redis::Value::Nil,
    };
    format!("{kind} {contents:?}")
}

impl RawHarness for RedisHarness {
    async fn subscribers(&self, key: &RecordKey) -> usize {
        subscribers_on(&self.server, &settle_channel(key)).await
    }

    async fn describe(&self, key: &RecordKey) -> String {
        describe_with(&mut self.server.connection().await, key).await
    }

    async fn raw(&self, key: &RecordKey) -> Option<Vec<u8>> {
        self.server.connection().await.get(key.as_str()).await.expect("GET")
    }

    async fn pttl(&self, key: &RecordKey) -> i64 {
        self.server.connection().await.pttl(key.as_str()).await.expect("PTTL")
    }

    async fn plant(&self, key: &RecordKey, value: RawValue) {
        plant_with(&mut self.server.connection().await, key, value).await;
    }
}

/// The records a Redis server holds: its keys but the doors' fleet registries
/// (`Store::announce`, a key of their own beside the records).
pub async fn records_on(connection: &mut impl redis::aio::ConnectionLike) -> usize {
    let keys: Vec<String> =
        redis::cmd("KEYS").arg("*").query_async(connection).await.expect("KEYS");
    keys.iter().filter(|key| !key.contains("-fleet:{")).count()
}
