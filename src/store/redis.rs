//! [`RedisStore`]: records in Redis, shared by every instance of the service.

use std::{
    fmt,
    future::Future,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use deadpool_redis::{
    Config, CreatePoolError, Pool, PoolConfig, Runtime, Timeouts,
    redis::{
        Cmd, ErrorKind, FromRedisValue, Pipeline, RedisFuture, Script, Value,
        aio::{ConnectionLike, MultiplexedConnection},
    },
};
use std::sync::LazyLock;

use super::{Claim, Fenced, OwnerToken, RECORD_VERSION, Store, StoreError};
use crate::{fingerprint::Fingerprint, key::RecordKey};

macro_rules! script {
    ($name:literal) => {
        LazyLock::new(|| {
            Script::new(include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/lua/", $name)))
        })
    };
}

static CLAIM: LazyLock<Script> = script!("claim.lua");
static COMPLETE: LazyLock<Script> = script!("complete.lua");
static RELEASE: LazyLock<Script> = script!("release.lua");
static TOUCH: LazyLock<Script> = script!("touch.lua");

/// Where the response starts in a completed record: after the version, the state and the
/// fingerprint.
const RESPONSE_OFFSET: usize = 1 + 1 + 32;

/// The default for [`RedisStore::command_timeout`].
const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_secs(1);

/// Records in Redis, through a deadpool-redis pool.
///
/// A record is one Redis string, with the lease or the retention as its expiry:
///
/// ```text
/// version '1' | state 'P' (in progress) or 'C' (completed) | fingerprint (32 bytes)
///             | owner token (16 bytes)  or  the encoded response
/// ```
///
/// A string, rather than a hash, because Redis keeps a hash compact only while every value
/// is at most `hash-max-listpack-value` (64) bytes; a stored response is larger, and a hash
/// holding it cost about 870 bytes per record against about 620 for the string.
///
/// Each transition is one Lua script over one key (`EVALSHA`; after a Redis restart or
/// `SCRIPT FLUSH` the script is loaded again on its own). Every operation, connection
/// checkout included, is bounded by [`command_timeout`](Self::command_timeout).
///
/// The store takes one multiplexed connection from the pool and shares it between requests
/// (Redis pipelines them), going back to the pool only when that connection fails: checking a
/// connection out per request would cost the pool's `UNWATCH` + `PING` round trip every time.
///
/// For the guarantee to hold, Redis must not evict records (`maxmemory-policy noeviction`);
/// the store warns once through `tracing` when it finds another policy.
#[derive(Clone)]
pub struct RedisStore {
    source: Source,
    shared: Arc<Shared>,
    command_timeout: Duration,
}

/// Where the store's connection comes from.
#[derive(Clone)]
pub(super) enum Source {
    Standalone(Pool),
    #[cfg(feature = "cluster")]
    Cluster(super::cluster::ClusterPool),
}

/// The connection every operation shares: Redis pipelines concurrent commands on it.
#[derive(Clone)]
enum SharedConnection {
    Standalone(MultiplexedConnection),
    #[cfg(feature = "cluster")]
    Cluster(deadpool_redis::redis::cluster_async::ClusterConnection),
}

impl ConnectionLike for SharedConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Standalone(connection) => connection.req_packed_command(cmd),
            #[cfg(feature = "cluster")]
            Self::Cluster(connection) => connection.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Standalone(connection) => connection.req_packed_commands(pipeline, offset, count),
            #[cfg(feature = "cluster")]
            Self::Cluster(connection) => connection.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Standalone(connection) => connection.get_db(),
            #[cfg(feature = "cluster")]
            Self::Cluster(connection) => connection.get_db(),
        }
    }
}

struct Shared {
    connection: Mutex<Option<SharedConnection>>,
    eviction_checked: AtomicBool,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut debug = f.debug_struct("RedisStore");
        match &self.source {
            Source::Standalone(pool) => debug.field("pool", &pool.status()),
            #[cfg(feature = "cluster")]
            Source::Cluster(pool) => debug.field("cluster_pool", &pool.status()),
        };
        debug.field("command_timeout", &self.command_timeout).finish_non_exhaustive()
    }
}

impl RedisStore {
    /// A store over `pool`.
    ///
    /// ```no_run
    /// use axum_idempotency::{RedisStore, deadpool_redis::{Config, Runtime}};
    ///
    /// let pool = Config::from_url("redis://127.0.0.1:6379").create_pool(Some(Runtime::Tokio1))?;
    /// let store = RedisStore::new(pool);
    /// # Ok::<_, Box<dyn std::error::Error>>(())
    /// ```
    #[must_use]
    pub fn new(pool: Pool) -> Self {
        Self::with_source(Source::Standalone(pool))
    }

    pub(super) fn with_source(source: Source) -> Self {
        Self {
            source,
            shared: Arc::new(Shared {
                connection: Mutex::new(None),
                eviction_checked: AtomicBool::new(false),
            }),
            command_timeout: DEFAULT_COMMAND_TIMEOUT,
        }
    }

    /// A store over a new pool for `url`, with its wait, create and recycle timeouts set to
    /// one second and at most 8 connections.
    ///
    /// # Errors
    ///
    /// When `url` is not a Redis URL. No connection is made until the first request.
    pub fn from_url(url: &str) -> Result<Self, CreatePoolError> {
        let mut config = Config::from_url(url);
        let timeout = Some(DEFAULT_COMMAND_TIMEOUT);
        config.pool = Some(PoolConfig {
            max_size: 8,
            timeouts: Timeouts { wait: timeout, create: timeout, recycle: timeout },
            ..PoolConfig::default()
        });
        Ok(Self::new(config.create_pool(Some(Runtime::Tokio1))?))
    }

    /// Sets the longest time one store operation may take, connection checkout included.
    /// An operation that takes longer fails with [`StoreError::Timeout`], and the layer answers
    /// 503 without running the handler. Defaults to one second.
    #[must_use]
    pub fn command_timeout(mut self, timeout: Duration) -> Self {
        self.command_timeout = timeout;
        self
    }

    /// The shared connection, or a new one from the pool.
    async fn connection(&self) -> Result<SharedConnection, StoreError> {
        let cached = self.shared.connection.lock().unwrap_or_else(PoisonError::into_inner).clone();
        if let Some(connection) = cached {
            return Ok(connection);
        }
        let mut connection = match &self.source {
            Source::Standalone(pool) => SharedConnection::Standalone((*pool.get().await?).clone()),
            #[cfg(feature = "cluster")]
            Source::Cluster(pool) => SharedConnection::Cluster(
                (*pool.get().await.map_err(super::cluster::pool_error)?).clone(),
            ),
        };
        if !self.shared.eviction_checked.swap(true, Ordering::Relaxed) {
            warn_unless_noeviction(&mut connection).await;
        }
        *self.shared.connection.lock().unwrap_or_else(PoisonError::into_inner) =
            Some(connection.clone());
        Ok(connection)
    }

    /// Runs `op` on the shared connection within the command timeout. A connection that
    /// failed is dropped, so the next operation takes a fresh one from the pool.
    async fn run<T, F, Fut>(&self, op: F) -> Result<T, StoreError>
    where
        F: FnOnce(SharedConnection) -> Fut + Send,
        Fut: Future<Output = Result<T, deadpool_redis::redis::RedisError>> + Send,
    {
        let attempt = async {
            let connection = self.connection().await?;
            op(connection).await.map_err(StoreError::from)
        };
        // Boxed: the pool checkout and redis-rs futures are large, and unboxed they made every
        // future of the layer that awaits the store several kilobytes, copied on each move.
        let result = match Box::pin(tokio::time::timeout(self.command_timeout, attempt)).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::Timeout(self.command_timeout)),
        };
        if let Err(error) = &result {
            // A server's error reply leaves the connection sound; anything else may not.
            let server_replied = match error {
                StoreError::Redis(e) => matches!(e.kind(), ErrorKind::Server(_)),
                StoreError::CorruptRecord(_) => true,
                _ => false,
            };
            if !server_replied {
                *self.shared.connection.lock().unwrap_or_else(PoisonError::into_inner) = None;
            }
        }
        result
    }

    /// Runs `script` over `key` with `args`: every transition is one such call.
    async fn invoke<T: FromRedisValue + Send>(
        &self,
        script: &'static Script,
        key: &RecordKey,
        args: &[&[u8]],
    ) -> Result<T, StoreError> {
        self.run(|mut connection| async move {
            let mut invocation = script.prepare_invoke();
            invocation.key(key.as_str());
            for arg in args {
                invocation.arg(*arg);
            }
            invocation.invoke_async(&mut connection).await
        })
        .await
    }

    /// Runs a fenced script: 1 when applied, 0 when another owner holds the key.
    async fn fenced(
        &self,
        script: &'static Script,
        key: &RecordKey,
        args: &[&[u8]],
    ) -> Result<Fenced, StoreError> {
        let reply: i64 = self.invoke(script, key, args).await?;
        Ok(if reply == 1 { Fenced::Applied } else { Fenced::Rejected })
    }
}

fn millis(duration: Duration) -> u64 {
    // PEXPIRE needs at least 1 ms; a zero lease would be an error, not an instant expiry.
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl Store for RedisStore {
    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Duration,
    ) -> Result<Claim, StoreError> {
        let lease = millis(lease).to_string();
        let args: [&[u8]; 4] =
            [fingerprint.as_bytes(), owner.as_bytes(), lease.as_bytes(), RECORD_VERSION.as_bytes()];
        parse_claim(self.invoke(&CLAIM, key, &args).await?)
    }

    async fn complete(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        fingerprint: &Fingerprint,
        response: Bytes,
        retention: Duration,
    ) -> Result<Fenced, StoreError> {
        let retention = millis(retention).to_string();
        let args: [&[u8]; 5] = [
            owner.as_bytes(),
            fingerprint.as_bytes(),
            &response,
            retention.as_bytes(),
            RECORD_VERSION.as_bytes(),
        ];
        self.fenced(&COMPLETE, key, &args).await
    }

    async fn release(&self, key: &RecordKey, owner: &OwnerToken) -> Result<Fenced, StoreError> {
        self.fenced(&RELEASE, key, &[owner.as_bytes(), RECORD_VERSION.as_bytes()]).await
    }

    async fn touch(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        lease: Duration,
    ) -> Result<Fenced, StoreError> {
        let lease = millis(lease).to_string();
        self.fenced(&TOUCH, key, &[owner.as_bytes(), lease.as_bytes(), RECORD_VERSION.as_bytes()])
            .await
    }
}

/// Reads the reply of `lua/claim.lua`.
fn parse_claim(reply: Value) -> Result<Claim, StoreError> {
    let unexpected =
        || StoreError::CorruptRecord("unexpected reply from the claim script".to_owned());
    let Value::Array(items) = reply else { return Err(unexpected()) };
    let mut items = items.into_iter();
    let Some(Value::Int(code)) = items.next() else { return Err(unexpected()) };
    match (code, items.next()) {
        (0, None) => Ok(Claim::Claimed),
        (1, Some(Value::BulkString(record))) if record.len() >= RESPONSE_OFFSET => {
            Ok(Claim::Replay(Bytes::from(record).slice(RESPONSE_OFFSET..)))
        }
        (2, None) => Ok(Claim::Mismatch),
        (3, Some(Value::Int(remaining_ms))) => Ok(Claim::InProgress {
            remaining: Duration::from_millis(u64::try_from(remaining_ms).unwrap_or(0)),
        }),
        (4, Some(Value::BulkString(reason))) => {
            Err(StoreError::CorruptRecord(String::from_utf8_lossy(&reason).into_owned()))
        }
        _ => Err(unexpected()),
    }
}

/// Records must not be evicted: an evicted record lets a retry run the handler again.
async fn warn_unless_noeviction(connection: &mut SharedConnection) {
    let reply: Result<Vec<String>, _> = deadpool_redis::redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .query_async(connection)
        .await;
    match reply.as_deref() {
        Ok([_, policy]) if policy == "noeviction" => {}
        Ok([_, policy]) => tracing::warn!(
            policy = policy.as_str(),
            "idempotency: Redis maxmemory-policy is not noeviction; an evicted record lets a retry run its handler again"
        ),
        // CONFIG is often disabled on managed Redis: nothing to learn, nothing to warn.
        _ => tracing::debug!("idempotency: could not read Redis maxmemory-policy"),
    }
}
