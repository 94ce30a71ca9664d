//! The ways to build a [`RedisStore`] beyond [`RedisStore::new`]: from a URL, from a client,
//! over Sentinel, over a Cluster, each with bounded timeouts.

#[cfg(feature = "cluster")]
use std::sync::Arc;

use deadpool_redis::{CreatePoolError, Pool, Runtime, redis::AsyncConnectionConfig};
#[cfg(feature = "sentinel")]
use deadpool_redis::{PoolConfig, Timeouts};

#[cfg(any(feature = "sentinel", feature = "cluster"))]
use super::connection::Source;
use super::{DEFAULT_COMMAND_TIMEOUT, RedisStore};
#[cfg(feature = "cluster")]
use super::{
    cluster::{self, ClusterConfigError, ClusterPool},
    subscriber::{Listen, Subscriber},
};

impl RedisStore {
    /// A store over a new pool for `url`: at most [`POOL_SIZE`](Self::POOL_SIZE) (8)
    /// connections, with its wait, create and recycle timeouts set to one second, and a
    /// [`subscriber`](Self::subscriber) connection for waiters. See [`RedisStore`] for what the
    /// store's requests use of the pool, and [`new`](Self::new) for a pool sized by the app.
    ///
    /// # Errors
    ///
    /// When `url` is not a Redis URL. No connection is made until the first request.
    pub fn from_url(url: &str) -> Result<Self, CreatePoolError> {
        let client = deadpool_redis::redis::Client::open(url)
            .map_err(|error| CreatePoolError::Config(deadpool_redis::ConfigError::Redis(error)))?;
        Self::from_client(client)
    }

    /// A store over a new pool of connections made by `client`, with the same bounds as
    /// [`from_url`](Self::from_url), and `client` as the [`subscriber`](Self::subscriber). For
    /// a client built in code: TLS with the app's own root certificate
    /// (`Client::build_with_tls`, features `tls-rustls` or `tls-native-tls`), a username,
    /// another protocol.
    ///
    /// # Errors
    ///
    /// When the pool cannot be built. No connection is made until the first request.
    pub fn from_client(client: deadpool_redis::redis::Client) -> Result<Self, CreatePoolError> {
        // Each command's reply is awaited at most what is left of its operation's time (see
        // `connection.rs`); the pool's own `PING` at a checkout, at most its recycle timeout.
        let timeout = Some(DEFAULT_COMMAND_TIMEOUT);
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(timeout)
            .set_response_timeout(timeout);
        let manager =
            deadpool_redis::Manager::new_with_config(client.get_connection_info().clone(), config)
                .map_err(|error| {
                    CreatePoolError::Config(deadpool_redis::ConfigError::Redis(error))
                })?;
        let pool = Pool::builder(manager)
            .max_size(Self::POOL_SIZE)
            .wait_timeout(timeout)
            .create_timeout(timeout)
            .recycle_timeout(timeout)
            .runtime(Runtime::Tokio1)
            .build()
            .map_err(CreatePoolError::Build)?;
        Ok(Self::new(pool).subscriber(client))
    }

    /// A store over a Redis Sentinel pool: every connection is made to the master the
    /// sentinels name at that moment, and one that finds its server demoted (`READONLY`) is
    /// replaced. Such a store has no [`subscriber`](Self::subscriber): its waiters wait out
    /// their deadline before their last claim.
    #[cfg(feature = "sentinel")]
    #[must_use]
    pub fn sentinel(pool: deadpool_redis::sentinel::Pool) -> Self {
        Self::with_source(Source::Sentinel(pool))
    }

    /// A store over a new Sentinel pool: the sentinels at `urls` name the master of
    /// `master_name`. At most [`POOL_SIZE`](Self::POOL_SIZE) connections, with one-second wait, create and recycle timeouts.
    ///
    /// ```no_run
    /// use axum_idempotency::RedisStore;
    ///
    /// let sentinels = ["redis://10.0.0.1:26379", "redis://10.0.0.2:26379"];
    /// let store = RedisStore::sentinel_from_urls(sentinels, "mymaster")?;
    /// # Ok::<_, Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// When a URL is not a Redis URL. No connection is made until the first request.
    #[cfg(feature = "sentinel")]
    pub fn sentinel_from_urls<I, U>(
        urls: I,
        master_name: &str,
    ) -> Result<Self, deadpool_redis::sentinel::CreatePoolError>
    where
        I: IntoIterator<Item = U>,
        U: AsRef<str>,
    {
        use deadpool_redis::sentinel::{Config, SentinelServerType};
        let urls: Vec<String> = urls.into_iter().map(|url| url.as_ref().to_owned()).collect();
        let mut config =
            Config::from_urls(urls, master_name.to_owned(), SentinelServerType::Master);
        let timeout = Some(DEFAULT_COMMAND_TIMEOUT);
        config.pool = Some(PoolConfig {
            max_size: Self::POOL_SIZE,
            timeouts: Timeouts { wait: timeout, create: timeout, recycle: timeout },
            ..PoolConfig::default()
        });
        Ok(Self::sentinel(config.create_pool(Some(Runtime::Tokio1))?))
    }

    /// A store over a Redis Cluster pool.
    ///
    /// Every script touches one key, whose `{hash tag}` puts the whole record in one slot, so
    /// each transition is atomic on the master that owns the slot.
    #[cfg(feature = "cluster")]
    #[must_use]
    pub fn cluster(pool: ClusterPool) -> Self {
        Self::with_source(Source::Cluster(pool))
    }

    /// A store over a new cluster pool for the seed nodes `urls`, with bounded timeouts: each
    /// attempt at a node 500 ms, two retries, and at most one second per command, so a dead
    /// shard is answered with 503 within the store's command timeout.
    ///
    /// ```no_run
    /// use axum_idempotency::RedisStore;
    ///
    /// let store = RedisStore::cluster_from_urls(["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"])?;
    /// # Ok::<_, Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// When a URL is not a Redis URL. No connection is made until the first request.
    #[cfg(feature = "cluster")]
    pub fn cluster_from_urls<I, U>(urls: I) -> Result<Self, ClusterConfigError>
    where
        I: IntoIterator<Item = U>,
        U: AsRef<str>,
    {
        let urls: Vec<String> = urls.into_iter().map(|url| url.as_ref().to_owned()).collect();
        let mut store = Self::cluster(cluster::pool_from_urls(&urls)?);
        store.subscriber = Some(Arc::new(Subscriber::new(Listen::Cluster(urls))));
        Ok(store)
    }
}
