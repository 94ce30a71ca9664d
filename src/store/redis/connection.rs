//! The connection every operation of a [`RedisStore`](super::RedisStore) shares, and where it
//! comes from.

use std::{
    future::Future,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use deadpool_redis::{
    Pool,
    redis::{
        Cmd, ConnectionInfo, ErrorKind, Pipeline, RedisError, RedisFuture, ServerErrorKind, Value,
        aio::{ConnectionLike, MultiplexedConnection},
    },
};
use tokio::{runtime, time::Instant};

#[cfg(feature = "cluster")]
use super::cluster::{ClusterPool, pool_error};
use super::{
    batch::{Batcher, Operation},
    checks::{check_version, warn_unless_noeviction},
    direct::Direct,
    watchdog::{self, Elapsed},
};
use crate::store::StoreError;
use crate::store::clock::ServerClock;

impl From<RedisError> for StoreError {
    fn from(e: RedisError) -> Self {
        Self::unavailable(e)
    }
}

impl From<deadpool_redis::PoolError> for StoreError {
    fn from(e: deadpool_redis::PoolError) -> Self {
        Self::unavailable(e)
    }
}

/// Where the store's connection comes from.
#[derive(Clone)]
pub(super) enum Source {
    Standalone(Pool),
    #[cfg(feature = "cluster")]
    Cluster(ClusterPool),
    #[cfg(feature = "sentinel")]
    Sentinel(deadpool_redis::sentinel::Pool),
}

/// A connection Redis pipelines concurrent commands on.
#[derive(Clone)]
pub(super) enum SharedConnection {
    Standalone(MultiplexedConnection),
    /// A standalone server's, driven by the store itself (see `direct.rs`).
    Direct(Direct),
    #[cfg(feature = "cluster")]
    Cluster(deadpool_redis::redis::cluster_async::ClusterConnection),
}

impl ConnectionLike for SharedConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Standalone(connection) => connection.req_packed_command(cmd),
            Self::Direct(connection) => connection.req_packed_command(cmd),
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
            Self::Direct(connection) => connection.req_packed_commands(pipeline, offset, count),
            #[cfg(feature = "cluster")]
            Self::Cluster(connection) => connection.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Standalone(connection) => connection.get_db(),
            Self::Direct(connection) => connection.db(),
            #[cfg(feature = "cluster")]
            Self::Cluster(connection) => connection.get_db(),
        }
    }
}

/// The shared connection, with the deadline of the operation it serves: no command is sent
/// once it passed, so an operation of several commands (a `NOSCRIPT` reload, a scan) is
/// bounded as a whole. With [`Replies::Timed`], each command waits at most what is left
/// (redis-rs's own timer, which holds the wait for room in the pipeline's channel too); with
/// [`Replies::Watched`], the watchdog ends the whole operation, and the commands of an
/// operation that started while another of the store's ran go in [batches](Batcher). A
/// Cluster connection keeps the node timeouts it was built with (see `cluster.rs`): its
/// operations run under the store's own timer instead.
pub(super) struct Bounded {
    connection: SharedConnection,
    /// The operation among the store's others, when its commands may go in batches (a
    /// standalone connection whose replies are watched).
    operation: Option<Operation<MultiplexedConnection>>,
    deadline: Instant,
    replies: Replies,
}

/// How an operation's replies are bounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Replies {
    /// By redis-rs's own timer, set before each command to what is left of the operation's
    /// time: for a pool the store did not build, whose connections wait for a reply as long
    /// as they were made to (redis-rs's default: 500 ms), whatever the command timeout.
    Timed,
    /// By the [`watchdog`], around the whole operation: for the pools the store builds
    /// (`from_url`, `from_client`), whose connections have no reply timer of their own.
    Watched,
}

impl ConnectionLike for Bounded {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match (self.left(), &self.operation, &self.connection) {
            (None, ..) => Box::pin(async { Err(Elapsed.into()) }),
            (Some(_), Some(operation), SharedConnection::Standalone(connection))
                if !operation.alone() =>
            {
                let batcher = operation.batcher().clone();
                Box::pin(batcher.send(connection.clone(), cmd, self.deadline))
            }
            (Some(left), ..) => self.bounded(left).req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self.left() {
            Some(left) => self.bounded(left).req_packed_commands(pipeline, offset, count),
            None => Box::pin(async { Err(Elapsed.into()) }),
        }
    }

    fn get_db(&self) -> i64 {
        self.connection.get_db()
    }
}

impl Bounded {
    /// The time left before the deadline; `None` once it passed.
    fn left(&self) -> Option<Duration> {
        self.deadline.checked_duration_since(Instant::now()).filter(|left| !left.is_zero())
    }

    /// The Cluster connection, when it is one (its operations run under the store's timer).
    #[cfg(feature = "cluster")]
    pub(super) fn cluster(
        &mut self,
    ) -> Option<&mut deadpool_redis::redis::cluster_async::ClusterConnection> {
        match &mut self.connection {
            SharedConnection::Cluster(cluster) => Some(cluster),
            SharedConnection::Standalone(_) | SharedConnection::Direct(_) => None,
        }
    }

    /// The connection, its next reply awaited at most `left` when its replies are timed.
    fn bounded(&mut self, left: Duration) -> &mut SharedConnection {
        match &mut self.connection {
            SharedConnection::Standalone(connection) if self.replies == Replies::Timed => {
                connection.set_response_timeout(left);
            }
            SharedConnection::Standalone(_) | SharedConnection::Direct(_) => {}
            #[cfg(feature = "cluster")]
            SharedConnection::Cluster(_) => {}
        }
        &mut self.connection
    }
}

/// How far off the deadline of an operation without one is (as far as tokio's own timers
/// reach).
const NO_DEADLINE: Duration = Duration::from_secs(86_400 * 365 * 30);

/// How many runtimes' connections a store keeps at most.
const RUNTIMES: usize = 4;

/// One shared connection per runtime, taken from the pool when there is none or the last one
/// failed.
pub(super) struct Connections {
    pub(super) source: Source,
    /// The shared connections, each with the runtime that took it from the pool: a
    /// connection's driver is a task of the runtime that made it, and ends with that runtime.
    /// An operation uses the one its own runtime took, so a store shared by runtimes one after
    /// another (as tests share one) loses no request to an earlier runtime's end: the pool's
    /// check (a `PING`) finds the dead connection, and makes one on the runtime asking. (Two
    /// runtimes side by side may take the same pooled connection; when its runtime ends, the
    /// other's next operation fails once and takes a new one, as before.) At most
    /// [`RUNTIMES`] (an application has one runtime or a handful), the oldest dropped first.
    shared: Mutex<Vec<(Option<runtime::Id>, SharedConnection)>>,
    /// Where the store connects by itself, in place of taking the pool's connection: a
    /// standalone server over plain TCP, for the pools it builds (see `direct.rs`).
    direct: Option<ConnectionInfo>,
    /// The batches of the operations that run together, when replies are watched on the
    /// pool's connections.
    batcher: Option<Arc<Batcher<MultiplexedConnection>>>,
    /// How the replies on the pool's connections are bounded.
    replies: Replies,
    eviction_checked: AtomicBool,
    /// The server's clock, sampled on each new connection.
    pub(super) clock: ServerClock,
}

impl Connections {
    pub(super) fn new(source: Source, replies: Replies, direct: Option<ConnectionInfo>) -> Self {
        Self {
            source,
            shared: Mutex::new(Vec::new()),
            // A direct connection writes what is sent together as one by itself.
            batcher: (replies == Replies::Watched && direct.is_none()).then(Arc::default),
            direct,
            replies,
            eviction_checked: AtomicBool::new(false),
            clock: ServerClock::default(),
        }
    }

    /// A new connection from the pool, checked and shared on `runtime`, the caller's.
    async fn connect(&self, runtime: Option<runtime::Id>) -> Result<SharedConnection, StoreError> {
        let mut connection = match (&self.source, &self.direct) {
            (Source::Standalone(_), Some(info)) => {
                SharedConnection::Direct(Direct::connect(info).await?)
            }
            (Source::Standalone(pool), _) => {
                SharedConnection::Standalone((*pool.get().await?).clone())
            }
            #[cfg(feature = "cluster")]
            (Source::Cluster(pool), _) => {
                SharedConnection::Cluster((*pool.get().await.map_err(pool_error)?).clone())
            }
            // Taken out of the pool for good: the pool's recycle check is a PING, which a master
            // demoted by a failover still answers. A new connection asks the sentinels where
            // the master is now.
            #[cfg(feature = "sentinel")]
            (Source::Sentinel(pool), _) => SharedConnection::Standalone(
                deadpool_redis::sentinel::Connection::take(pool.get().await?),
            ),
        };
        // A new connection may reach another server (a failover, a restart into another
        // version): each is checked once, before any script runs on it.
        check_version(&mut connection, self.minimum_version()).await?;
        // Without a sample, claims carry no deadline (the guard alone cleans up after them).
        if let Err(error) = self.clock.sample(&mut connection).await {
            tracing::debug!(%error, "idempotency: could not read the Redis server's clock");
        }
        if !self.eviction_checked.swap(true, Ordering::Relaxed) {
            warn_unless_noeviction(&mut connection).await;
        }
        let mut shared = self.shared();
        shared.retain(|(made_on, _)| *made_on != runtime);
        if shared.len() >= RUNTIMES {
            shared.remove(0);
        }
        shared.push((runtime, connection.clone()));
        Ok(connection)
    }

    fn shared(&self) -> std::sync::MutexGuard<'_, Vec<(Option<runtime::Id>, SharedConnection)>> {
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The oldest server the scripts run on: Redis 5 replicates a script's writes after
    /// `TIME` (older servers refuse them); a Cluster's settle publishes with `SPUBLISH`, new
    /// in Redis 7.
    fn minimum_version(&self) -> (u32, u32) {
        match self.source {
            #[cfg(feature = "cluster")]
            Source::Cluster(_) => (7, 0),
            _ => (5, 0),
        }
    }

    /// Runs `op` on the shared connection within `timeout`. A connection that failed is
    /// dropped, so the next operation takes a fresh one from the pool.
    pub(super) async fn run<T, F, Fut>(&self, timeout: Duration, op: F) -> Result<T, StoreError>
    where
        F: FnOnce(Bounded) -> Fut + Send,
        Fut: Future<Output = Result<T, RedisError>> + Send,
    {
        // A timeout too long to add (`Duration::MAX`, meaning none) is thirty years.
        let now = Instant::now();
        let deadline = now.checked_add(timeout).unwrap_or(now + NO_DEADLINE);
        let to_store_error = |error: RedisError| match error.is_timeout() {
            true => StoreError::Timeout(timeout),
            false => StoreError::from(error),
        };
        let runtime = runtime::Handle::try_current().ok().map(|here| here.id());
        // A direct connection found lost before anything was sent on it (Redis closed it while
        // idle: its `timeout`, a restart, a `CLIENT KILL`) is replaced at once, not failed on.
        let cached = self
            .shared()
            .iter()
            .find(|(made_on, _)| *made_on == runtime)
            .map(|(_, c)| c.clone())
            .filter(|connection| !matches!(connection, SharedConnection::Direct(d) if d.is_lost()));
        let result = match cached {
            // The common path, without a tokio timer of its own: the watchdog ends the
            // operation at its deadline, or redis-rs bounds each command, its wait for room in
            // the pipeline's channel included, by what is left (`Bounded`).
            Some(connection @ (SharedConnection::Standalone(_) | SharedConnection::Direct(_))) => {
                let replies = self.replies;
                let operation = self.batcher.as_ref().map(Batcher::start);
                let operation = op(Bounded { connection, operation, deadline, replies });
                match replies {
                    Replies::Timed => operation.await.map_err(to_store_error),
                    Replies::Watched => {
                        match watchdog::within(deadline.into_std(), operation).await {
                            Ok(result) => result.map_err(to_store_error),
                            Err(Elapsed) => Err(StoreError::Timeout(timeout)),
                        }
                    }
                }
            }
            // A checkout and a Cluster's commands (which keep the node timeouts they were
            // built with) go under the store's own timer.
            // Boxed, the checkout's future included: unboxed, this path's futures (kilobytes)
            // made every store operation's future as large, copied on each move, for a step
            // taken once per connection (and on a Cluster, whose commands cost more anyway).
            cached => {
                let attempt = Box::pin(async {
                    let connection = match cached {
                        Some(connection) => connection,
                        None => self.connect(runtime).await?,
                    };
                    let replies = self.replies;
                    let operation = self.batcher.as_ref().map(Batcher::start);
                    op(Bounded { connection, operation, deadline, replies })
                        .await
                        .map_err(to_store_error)
                });
                match tokio::time::timeout_at(deadline, attempt).await {
                    Ok(result) => result,
                    Err(_) => Err(StoreError::Timeout(timeout)),
                }
            }
        };
        if let Err(error) = &result {
            // A server's error reply leaves the connection sound; anything else may not. READONLY
            // is the exception: the server was a master and is a replica now (a failover).
            let server_replied = match error {
                StoreError::Unavailable(e) => e.downcast_ref::<RedisError>().is_some_and(|e| {
                    matches!(e.kind(), ErrorKind::Server(kind) if kind != ServerErrorKind::ReadOnly)
                }),
                StoreError::CorruptRecord(_) => true,
                _ => false,
            };
            if !server_replied {
                self.shared().retain(|(made_on, _)| *made_on != runtime);
            }
        }
        result
    }
}
