//! Redis Cluster: a deadpool [`Manager`](deadpool::managed::Manager) over redis-rs's cluster
//! client, built with bounded timeouts and retries.
//!
//! deadpool-redis's own cluster configuration exposes no retry or timeout settings, and with
//! redis-rs's defaults a script against a slot whose master is down went unanswered for over
//! 90 s. [`RedisStore::cluster_from_urls`](super::RedisStore::cluster_from_urls) sets them; [`ClusterManager`] takes any
//! [`ClusterClient`] you build yourself.

use std::{fmt, time::Duration};

use deadpool::managed::{self, Metrics, RecycleResult};
use deadpool_redis::redis::{
    RedisError,
    cluster::{ClusterClient, ClusterClientBuilder},
    cluster_async::ClusterConnection,
};

use crate::store::StoreError;

/// A pool of Redis Cluster connections for [`RedisStore::cluster`](super::RedisStore::cluster).
pub type ClusterPool = managed::Pool<ClusterManager>;

/// Makes Redis Cluster connections from a redis-rs
/// [`ClusterClient`](https://docs.rs/redis/1/redis/cluster/struct.ClusterClient.html).
///
/// A cluster connection reaches every node, follows `MOVED` and `ASK` redirections and
/// reconnects on its own; the store shares one and takes another from the pool only when it
/// fails.
pub struct ClusterManager {
    client: ClusterClient,
}

impl ClusterManager {
    /// A manager for `client`. Reads go to masters unless the client was built with
    /// `read_from_replicas`, which a replay must not use: a replica may lag its master.
    #[must_use]
    pub fn new(client: ClusterClient) -> Self {
        Self { client }
    }
}

impl fmt::Debug for ClusterManager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterManager").finish_non_exhaustive()
    }
}

impl managed::Manager for ClusterManager {
    type Type = ClusterConnection;
    type Error = RedisError;

    async fn create(&self) -> Result<ClusterConnection, RedisError> {
        self.client.get_async_connection().await
    }

    async fn recycle(
        &self,
        connection: &mut ClusterConnection,
        _: &Metrics,
    ) -> RecycleResult<RedisError> {
        // The store comes back to the pool only after its connection failed. A cluster
        // connection reconnects to nodes by itself, but after a master died it was seen stuck
        // refreshing its slot map, holding every request: one that does not answer a PING is
        // replaced.
        let _: String = deadpool_redis::redis::cmd("PING").query_async(connection).await?;
        Ok(())
    }
}

/// Why [`RedisStore::cluster_from_urls`](super::RedisStore::cluster_from_urls) could not build a store.
#[derive(Debug)]
#[non_exhaustive]
pub enum ClusterConfigError {
    /// A node URL is not a Redis URL.
    Redis(RedisError),
    /// The pool could not be built.
    Pool(managed::BuildError),
}

impl fmt::Display for ClusterConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Redis(e) => write!(f, "invalid cluster configuration: {e}"),
            Self::Pool(e) => write!(f, "cluster pool: {e}"),
        }
    }
}

impl std::error::Error for ClusterConfigError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Redis(e) => Some(e),
            Self::Pool(e) => Some(e),
        }
    }
}

pub(super) fn pool_error(error: managed::PoolError<RedisError>) -> StoreError {
    StoreError::unavailable(error)
}

/// How long one attempt at a node, and one whole command with its retries, may take.
const NODE_TIMEOUT: Duration = Duration::from_millis(500);

/// A pool for the seed nodes `urls`, with bounded timeouts: each attempt at a node 500 ms, two
/// retries, and at most one second per command.
pub(super) fn pool_from_urls(urls: &[String]) -> Result<ClusterPool, ClusterConfigError> {
    let client = ClusterClientBuilder::new(urls.to_vec())
        .retries(2)
        .min_retry_wait(10)
        .max_retry_wait(100)
        .connection_timeout(NODE_TIMEOUT)
        .response_timeout(NODE_TIMEOUT)
        .overall_response_timeout(Some(Duration::from_secs(1)))
        .build()
        .map_err(ClusterConfigError::Redis)?;
    ClusterPool::builder(ClusterManager::new(client))
        .max_size(super::RedisStore::POOL_SIZE)
        .wait_timeout(Some(Duration::from_secs(1)))
        .create_timeout(Some(Duration::from_secs(1)))
        .recycle_timeout(Some(Duration::from_secs(1)))
        .runtime(deadpool::Runtime::Tokio1)
        .build()
        .map_err(ClusterConfigError::Pool)
}
