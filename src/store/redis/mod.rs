//! [`RedisStore`]: records in Redis, shared by every instance of the service.

mod admin;
mod batch;
mod bounded;
mod builders;
mod checks;
mod clock;
#[cfg(feature = "cluster")]
mod cluster;
mod connection;
mod dedup;
mod scripts;
mod subscriber;

use std::{fmt, sync::Arc, time::Duration};

use bytes::Bytes;
use deadpool_redis::{
    Pool,
    redis::{FromRedisValue, Value},
};

#[cfg(feature = "cluster")]
pub use self::cluster::{ClusterConfigError, ClusterManager, ClusterPool};
use self::{
    connection::{Connections, Source},
    scripts::{
        ABANDON, CLAIM, COMPLETE, RELEASE, ScriptCall, TOUCH, millis, parse_claim, settle_channel,
        whole_millis,
    },
    subscriber::{Listen, Subscriber},
};
use super::{
    Claim, Fenced, Lease, OwnerToken, Store, StoreError, Subscription, clock::claim_resampling,
};
use crate::{fingerprint::Fingerprint, key::RecordKey};

/// Format version written with every record. A record of another version is reported as
/// [`StoreError::CorruptRecord`], never replayed or overwritten.
const RECORD_VERSION: &str = "1";

/// The default for [`RedisStore::command_timeout`].
const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_secs(1);

/// Records in Redis, through a deadpool-redis pool.
///
/// A record is one Redis string, with the lease or the retention as its expiry:
///
/// ```text
/// version '1' | state 'P' (in progress), 'W' (in progress, waited for) or 'C' (completed)
///             | fingerprint (32 bytes)
///             | owner token (16 bytes) and lease deadline  or  the encoded response
/// ```
///
/// A claim whose answer was lost while the key was absent leaves a marker in its place
/// (state 'X', with the claim's owner token, for one lease): that claim, should it land late,
/// is refused; every other claim sees the key as absent (see [`Store::abandon`]).
///
/// A string, rather than a hash, because Redis keeps a hash compact only while every value
/// is at most `hash-max-listpack-value` (64) bytes, and a stored response is larger: a hash
/// would cost each record more memory (measured in the repository's `BENCHMARKS.md`, *Memory
/// per record*).
///
/// Each transition is one Lua script over one key (`EVALSHA`; after a Redis restart or
/// `SCRIPT FLUSH` the script is loaded again on its own). Every operation, connection
/// checkout included, is bounded by [`command_timeout`](Self::command_timeout): each command
/// waits for its reply at most what is left of it (redis-rs's response timeout). Every
/// connection comes from the store's deadpool-redis pool: a store from
/// [`from_url`](Self::from_url) or [`from_client`](Self::from_client) builds one of
/// [`POOL_SIZE`](Self::POOL_SIZE) connections; over [`new`](Self::new), the app's own pool sets
/// the bound, and a [`subscriber`](Self::subscriber) wakes waiting retries.
///
#[doc = include_str!("../../docs/redis.md")]
#[derive(Clone)]
pub struct RedisStore {
    connections: Arc<Connections>,
    /// The connection that hears settles, for waiters; `None` when the store was built over
    /// a pool alone (see [`RedisStore::subscriber`]).
    subscriber: Option<Arc<Subscriber>>,
    command_timeout: Duration,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut debug = f.debug_struct("RedisStore");
        match &self.connections.source {
            Source::Standalone(pool) => debug.field("pool", &pool.status()),
            #[cfg(feature = "cluster")]
            Source::Cluster(pool) => debug.field("cluster_pool", &pool.status()),
            #[cfg(feature = "sentinel")]
            Source::Sentinel(pool) => debug.field("sentinel_pool", &pool.status()),
        };
        debug.field("command_timeout", &self.command_timeout).finish_non_exhaustive()
    }
}

impl RedisStore {
    /// How many connections the pool that [`from_url`](Self::from_url),
    /// [`from_client`](Self::from_client) and the Sentinel and Cluster builders make holds at
    /// most.
    pub const POOL_SIZE: usize = 8;

    /// A store over `pool`: every connection the store uses is one of the pool's (see
    /// [`RedisStore`], "Connections").
    ///
    /// ```no_run
    /// use axum_idempotency::{RedisStore, store::deadpool_redis::{Config, Runtime}};
    ///
    /// let pool = Config::from_url("redis://127.0.0.1:6379").create_pool(Some(Runtime::Tokio1))?;
    /// let store = RedisStore::new(pool);
    /// # Ok::<_, Box<dyn std::error::Error>>(())
    /// ```
    #[must_use]
    pub fn new(pool: Pool) -> Self {
        Self::with_source(Source::Standalone(pool))
    }

    fn with_source(source: Source) -> Self {
        Self {
            connections: Arc::new(Connections::new(source)),
            subscriber: None,
            command_timeout: DEFAULT_COMMAND_TIMEOUT,
        }
    }

    /// Sets the client whose connection listens for settles, so that a request waiting for
    /// an in-progress original (`waiting`) is woken when it settles. Set by
    /// [`from_url`](Self::from_url); a store made with [`new`](Self::new) has none, and its
    /// waiters wait out their deadline before they claim again.
    ///
    /// One connection serves every waiter of the store (and of its clones): it subscribes to a
    /// record's channel while the record has waiters in this process.
    #[must_use]
    pub fn subscriber(mut self, client: deadpool_redis::redis::Client) -> Self {
        self.subscriber = Some(Arc::new(Subscriber::new(Listen::Standalone(Box::new(client)))));
        self
    }

    /// Sets the longest time one store operation may take, connection checkout included.
    /// An operation that takes longer fails with [`StoreError::Timeout`], and the layer answers
    /// 503 without running the handler. Defaults to one second.
    #[must_use]
    pub fn command_timeout(mut self, timeout: Duration) -> Self {
        self.command_timeout = timeout;
        self
    }

    /// Runs one script call: every transition is one.
    async fn invoke<T: FromRedisValue + Send>(&self, call: ScriptCall) -> Result<T, StoreError> {
        let call = &call;
        self.connections
            .run(
                self.command_timeout,
                |mut connection| async move { call.query(&mut connection).await },
            )
            .await
    }

    /// Runs a fenced script: 1 (or 2, see `lua/complete.lua` and `lua/abandon.lua`) when
    /// applied, 0 when another owner holds the key.
    async fn fenced(&self, call: ScriptCall) -> Result<Fenced, StoreError> {
        let reply: i64 = self.invoke(call).await?;
        Ok(if reply == 0 { Fenced::Rejected } else { Fenced::Applied })
    }

    async fn claim_marking(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
        waiting: bool,
    ) -> Result<Claim, StoreError> {
        let claim = || async {
            parse_claim(self.claim_once(key, fingerprint, owner, lease, waiting).await?)
        };
        let resample = || async {
            let clock = &self.connections.clock;
            self.connections
                .run(self.command_timeout, |mut connection| async move {
                    clock.sample(&mut connection).await
                })
                .await
        };
        claim_resampling(claim, resample).await
    }

    /// One run of the claim script. The claim names the latest server time at which it may
    /// be applied (see [`clock`]): a claim held up on the wire past it writes nothing.
    async fn claim_once(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
        waiting: bool,
    ) -> Result<Value, StoreError> {
        let (mut lives, mut lease_ms) = (itoa::Buffer::new(), itoa::Buffer::new());
        // The record lives for the lease and the recovery window (Lua adding them would cost
        // Redis a number written back as text).
        let lives = lives.format(millis(lease.duration) + whole_millis(lease.recovery_window));
        // Half a lease of slack: a claim applied within it is still met by its guard, which
        // tries to abandon it for a whole lease after the claim's timeout.
        let slack = lease.duration / 2;
        let timeout = self.command_timeout;
        let lease = lease_ms.format(millis(lease.duration));
        let waiting: &[u8] = if waiting { b"1" } else { b"0" };
        let clock = &self.connections.clock;
        self.connections
            .run(timeout, |mut connection| async move {
                // After the connection is had: a new one has just sampled the clock.
                let mut deadline = itoa::Buffer::new();
                let deadline = deadline.format(clock.claim_deadline(timeout, slack));
                let args = [
                    fingerprint.as_bytes().as_slice(),
                    owner.as_bytes(),
                    lease.as_bytes(),
                    RECORD_VERSION.as_bytes(),
                    waiting,
                    lives.as_bytes(),
                    deadline.as_bytes(),
                ];
                ScriptCall::new(&CLAIM, &[key.as_str()], &args, 0).query(&mut connection).await
            })
            .await
    }

    /// The command that tells waiters of a settle: sharded pub/sub on a Cluster, where a plain
    /// `PUBLISH` would be broadcast to every node.
    fn publish_command(&self) -> &'static [u8] {
        match self.connections.source {
            Source::Standalone(_) => b"PUBLISH",
            #[cfg(feature = "sentinel")]
            Source::Sentinel(_) => b"PUBLISH",
            #[cfg(feature = "cluster")]
            Source::Cluster(_) => b"SPUBLISH",
        }
    }
}

impl Store for RedisStore {
    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Claim, StoreError> {
        self.claim_marking(key, fingerprint, owner, lease, false).await
    }

    async fn claim_waiting(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Claim, StoreError> {
        // Without a subscriber nobody would hear the publish: do not ask for one.
        self.claim_marking(key, fingerprint, owner, lease, self.subscriber.is_some()).await
    }

    async fn subscribe(&self, key: &RecordKey) -> Subscription {
        match &self.subscriber {
            Some(subscriber) => {
                subscriber.subscribe(settle_channel(key), self.command_timeout).await
            }
            None => Subscription::unsupported(),
        }
    }

    async fn complete(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        fingerprint: &Fingerprint,
        response: Bytes,
        retention: Duration,
    ) -> Result<Fenced, StoreError> {
        let mut retention_ms = itoa::Buffer::new();
        let retention = retention_ms.format(millis(retention));
        let args: [&[u8]; 3] = [owner.as_bytes(), retention.as_bytes(), self.publish_command()];
        // The record as it is stored (see `lua/complete.lua`), joined in the command's buffer.
        let record = [RECORD_VERSION.as_bytes(), b"C", fingerprint.as_bytes(), &response];
        let length = record.iter().map(|piece| piece.len()).sum();
        self.fenced(ScriptCall::publishing(&COMPLETE, key, &args, length).joined(&record)).await
    }

    async fn release(&self, key: &RecordKey, owner: &OwnerToken) -> Result<Fenced, StoreError> {
        let args: [&[u8]; 3] =
            [owner.as_bytes(), RECORD_VERSION.as_bytes(), self.publish_command()];
        self.fenced(ScriptCall::publishing(&RELEASE, key, &args, 0)).await
    }

    async fn abandon(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        fingerprint: &Fingerprint,
        lease: Lease,
    ) -> Result<Fenced, StoreError> {
        let (mut window, mut marker) = (itoa::Buffer::new(), itoa::Buffer::new());
        let window = window.format(whole_millis(lease.recovery_window));
        let marker = marker.format(millis(lease.duration));
        let args: [&[u8]; 6] = [
            owner.as_bytes(),
            fingerprint.as_bytes(),
            RECORD_VERSION.as_bytes(),
            window.as_bytes(),
            marker.as_bytes(),
            self.publish_command(),
        ];
        self.fenced(ScriptCall::publishing(&ABANDON, key, &args, 0)).await
    }

    async fn touch(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Fenced, StoreError> {
        // A zero lease is meant: it ends the lease now.
        let (mut window, mut lease_ms) = (itoa::Buffer::new(), itoa::Buffer::new());
        let window = window.format(whole_millis(lease.recovery_window));
        let lease = lease_ms.format(whole_millis(lease.duration));
        let args: [&[u8]; 4] =
            [owner.as_bytes(), lease.as_bytes(), RECORD_VERSION.as_bytes(), window.as_bytes()];
        self.fenced(ScriptCall::new(&TOUCH, &[key.as_str()], &args, 0)).await
    }

    async fn announce(
        &self,
        registry: &RecordKey,
        entries: &[(String, Duration)],
    ) -> Result<Option<Vec<String>>, StoreError> {
        let lasts: Vec<String> =
            entries.iter().map(|(_, lasts)| whole_millis(*lasts).to_string()).collect();
        let args: Vec<&[u8]> = entries
            .iter()
            .zip(&lasts)
            .flat_map(|((entry, _), lasts)| [entry.as_bytes(), lasts.as_bytes()])
            .collect();
        let call = ScriptCall::new(&scripts::ANNOUNCE, &[registry.as_str()], &args, 0);
        self.invoke::<Vec<String>>(call).await.map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn debug_shows_the_pool_and_the_timeout_never_a_connection_secret() {
        let store = RedisStore::from_url("redis://:hunter2@127.0.0.1:1").unwrap();
        let debug = format!("{store:?}");
        assert!(debug.starts_with("RedisStore { pool: Status {"), "{debug}");
        assert!(debug.contains("command_timeout: 1s"), "{debug}");
        assert!(!debug.contains("hunter2"), "{debug}");
    }
}
