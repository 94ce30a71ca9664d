//! The connection every operation of a [`RedisStore`](super::RedisStore) shares, and where it
//! comes from: always the store's deadpool-redis pool (or a Cluster's), never a connection the
//! store makes by itself.

mod reconnect;

use std::{
    future::Future,
    pin::Pin,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use deadpool_redis::{
    Pool,
    redis::{ErrorKind, RedisError, ServerErrorKind, aio::MultiplexedConnection},
};
use tokio::{runtime, time::Instant};

use super::batch::Batcher;
use super::bounded::{Bounded, SharedConnection};
use super::checks::{check_version, warn_unless_noeviction};
#[cfg(feature = "cluster")]
use super::cluster::{ClusterPool, pool_error};
use crate::store::StoreError;
use crate::store::clock::ServerClock;
use reconnect::Reconnect;

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

/// How far off the deadline of an operation without one is (as far as tokio's own timers
/// reach).
const NO_DEADLINE: Duration = Duration::from_secs(86_400 * 365 * 30);

/// How many runtimes' connections a store keeps at most.
const RUNTIMES: usize = 16;

/// One runtime's shared connection.
struct Shared {
    /// The runtime that took it from the pool.
    runtime: Option<runtime::Id>,
    /// Which connection it is, so that an operation that failed on it drops this one and not
    /// the one that replaced it meanwhile.
    id: u64,
    connection: SharedConnection,
}

/// The shared connections, and the connect that makes the next one: under one lock, so that
/// a caller that finds neither starts the one connect.
struct Slots {
    /// The shared connections, each with the runtime that took it from the pool: a
    /// connection's driver is a task of the runtime that made it, and ends with that runtime.
    /// An operation uses the one its own runtime took, so a store shared by runtimes one after
    /// another (as tests share one) loses no request to an earlier runtime's end: the pool's
    /// check (a `PING`) finds the dead connection, and makes one on the runtime asking. (Two
    /// runtimes side by side may take the same pooled connection; when its runtime ends, the
    /// other's next operation fails once and takes a new one.) At most [`RUNTIMES`] (an
    /// application has one runtime or a handful), the oldest dropped first.
    shared: Vec<Shared>,
    reconnect: Reconnect,
}

impl Slots {
    /// The connection shared on `runtime`, when there is one.
    fn find(&self, runtime: Option<runtime::Id>) -> Option<(u64, SharedConnection)> {
        let found = self.shared.iter().find(|shared| shared.runtime == runtime)?;
        Some((found.id, found.connection.clone()))
    }
}

/// One shared connection per runtime, a clone of one of the pool's connections, taken from
/// the pool when there is none or the last one failed.
///
/// Every connection the store uses is one its pool made, and one connect at a time takes it
/// (`reconnect.rs`), so the store never holds more than the pool's `max_size` connections
/// (plus the subscriber's, see `subscriber.rs`), however many requests come at once, a stalled
/// server's included. The clone is kept, not the checkout: checking a connection out per
/// operation would cost the pool's `PING` round trip each time.
pub(super) struct Connections {
    pub(super) source: Source,
    slots: Mutex<Slots>,
    /// The id of the next connection taken.
    next_id: AtomicU64,
    /// The batches of the operations that run together on a standalone server's connection;
    /// `None` for a Cluster, whose connection sends each command to its slot's node.
    batcher: Option<Arc<Batcher<MultiplexedConnection>>>,
    eviction_checked: AtomicBool,
    /// The server's clock, sampled on each new connection.
    pub(super) clock: ServerClock,
}

impl Connections {
    pub(super) fn new(source: Source) -> Self {
        let batcher = match source {
            #[cfg(feature = "cluster")]
            Source::Cluster(_) => None,
            _ => Some(Arc::default()),
        };
        Self {
            batcher,
            source,
            slots: Mutex::new(Slots { shared: Vec::new(), reconnect: Reconnect::default() }),
            next_id: AtomicU64::new(0),
            eviction_checked: AtomicBool::new(false),
            clock: ServerClock::default(),
        }
    }

    /// The connection shared on `runtime`, when there is one.
    fn cached(&self, runtime: Option<runtime::Id>) -> Option<(u64, SharedConnection)> {
        self.slots().find(runtime)
    }

    /// A new connection from the pool, checked.
    async fn connect(&self) -> Result<SharedConnection, StoreError> {
        let mut connection = match &self.source {
            Source::Standalone(pool) => SharedConnection::Standalone((*pool.get().await?).clone()),
            #[cfg(feature = "cluster")]
            Source::Cluster(pool) => {
                SharedConnection::Cluster((*pool.get().await.map_err(pool_error)?).clone())
            }
            // Taken out of the pool for good: the pool's recycle check is a PING, which a master
            // demoted by a failover still answers. A new connection asks the sentinels where
            // the master is now.
            #[cfg(feature = "sentinel")]
            Source::Sentinel(pool) => SharedConnection::Standalone(
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
        Ok(connection)
    }

    /// Drops connection `id`, so that the next operation takes another from the pool.
    fn drop_connection(&self, id: u64) {
        let mut slots = self.slots();
        if let Some(at) = slots.shared.iter().position(|shared| shared.id == id) {
            // Kept (in place of the one kept before) for the probe, should the next connect
            // fail: its socket is one the server holds already.
            slots.reconnect.suspect = Some(slots.shared.remove(at).connection);
        }
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
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
    ///
    /// A connection found closed before anything was sent on it (Redis closed it while it
    /// idled: its `timeout`, a restart, a `CLIENT KILL`) is replaced and `op` run again on the
    /// new one, so no request fails for it. redis-rs refuses a command at once when the
    /// connection's driver has ended; one that it took answers no sooner than its reply, or
    /// the loss, comes back: an operation that ends with a lost connection on its first poll
    /// sent nothing.
    pub(super) async fn run<T, F, Fut>(
        self: &Arc<Self>,
        timeout: Duration,
        op: F,
    ) -> Result<T, StoreError>
    where
        F: Fn(Bounded) -> Fut + Send + Sync,
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
        let mut used = None;
        let result = match self.cached(runtime) {
            // The common path, without a tokio timer of its own: redis-rs bounds each command,
            // its wait for room in the pipeline's channel included, by what is left.
            Some((id, connection @ SharedConnection::Standalone(_))) => {
                used = Some(id);
                let operation = self.batcher.as_ref().map(Batcher::start);
                let bounded = Bounded::new(connection, deadline, operation);
                match (FirstPoll { future: op(bounded), polled: false }).await {
                    (Err(Attempt::Redis(error)), true) if error.is_connection_dropped() => {
                        self.drop_connection(id);
                        used = None;
                        // Not "never sent" should no connection be had now: a batch another
                        // worker flushed may have carried the first attempt before the loss.
                        let again =
                            self.run_checked_out(runtime, timeout, deadline, &op, &mut used);
                        again.await.map_err(|error| match error {
                            Attempt::Store(error) => Attempt::Store(error.maybe_sent()),
                            other => other,
                        })
                    }
                    (result, _) => result,
                }
            }
            // A checkout and a Cluster's commands (which keep the node timeouts they were
            // built with) go under a tokio timeout.
            _ => self.run_checked_out(runtime, timeout, deadline, &op, &mut used).await,
        };
        let result = result.map_err(|error| match error {
            Attempt::Redis(error) => to_store_error(error),
            Attempt::Store(error) => error,
            Attempt::Elapsed => StoreError::Timeout(timeout),
        });
        if let (Err(error), Some(id)) = (&result, used) {
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
                self.drop_connection(id);
            }
        }
        result
    }

    /// Runs `op` on the runtime's shared connection, taken from the pool when there is none,
    /// under a tokio timeout at `deadline`. `used` is set to the connection's id.
    ///
    /// Boxed, the checkout's future included: unboxed, this path's futures (kilobytes) made
    /// every store operation's future as large, copied on each move, for a step taken once
    /// per connection (and on a Cluster, whose commands cost more anyway).
    async fn run_checked_out<T, F, Fut>(
        self: &Arc<Self>,
        runtime: Option<runtime::Id>,
        timeout: Duration,
        deadline: Instant,
        op: &F,
        used: &mut Option<u64>,
    ) -> Result<T, Attempt>
    where
        F: Fn(Bounded) -> Fut + Send + Sync,
        Fut: Future<Output = Result<T, RedisError>> + Send,
    {
        let attempt: Pin<Box<dyn Future<Output = Result<T, Attempt>> + Send + '_>> =
            Box::pin(async {
                let (id, connection) = match self.cached(runtime) {
                    Some(cached) => cached,
                    // Failed so (the store reconnecting, a connect that failed), the operation
                    // was never sent: a claim holds nothing, and no guard need abandon it.
                    None => self
                        .connection(runtime, timeout)
                        .await
                        .map_err(|error| Attempt::Store(error.never_sent()))?,
                };
                *used = Some(id);
                let operation = self.batcher.as_ref().map(Batcher::start);
                op(Bounded::new(connection, deadline, operation)).await.map_err(Attempt::Redis)
            });
        tokio::time::timeout_at(deadline, attempt).await.unwrap_or(Err(Attempt::Elapsed))
    }
}

/// Why an operation failed, before it is told as a [`StoreError`].
enum Attempt {
    Redis(RedisError),
    Store(StoreError),
    Elapsed,
}

impl From<RedisError> for Attempt {
    fn from(error: RedisError) -> Self {
        Self::Redis(error)
    }
}

pin_project_lite::pin_project! {
    /// A future's output, and whether it came on the first poll.
    struct FirstPoll<F> {
        #[pin]
        future: F,
        polled: bool,
    }
}

impl<T, F: Future<Output = Result<T, RedisError>>> Future for FirstPoll<F> {
    type Output = (Result<T, Attempt>, bool);

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let first = !std::mem::replace(this.polled, true);
        match this.future.poll(cx) {
            Poll::Ready(output) => Poll::Ready((output.map_err(Attempt::Redis), first)),
            Poll::Pending => Poll::Pending,
        }
    }
}
