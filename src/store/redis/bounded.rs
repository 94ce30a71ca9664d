//! A connection as one operation of a [`RedisStore`](super::RedisStore) uses it: the shared
//! connection ([`SharedConnection`]), bounded by the operation's deadline ([`Bounded`]).

use std::time::Duration;

use deadpool_redis::redis::{
    Cmd, Pipeline, RedisError, RedisFuture, Value,
    aio::{ConnectionLike, MultiplexedConnection},
};
use tokio::time::Instant;

use super::batch::Operation;

/// A connection Redis pipelines concurrent commands on: a clone of one of the pool's.
#[derive(Clone)]
pub(super) enum SharedConnection {
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

/// The shared connection, with the deadline of the operation it serves: no command is sent
/// once it passed, and each command waits for its reply at most what is left (redis-rs's
/// response timeout, which holds the wait for room in the connection's channel too; for a
/// command that goes in a [batch](super::batch::Batcher), a tokio timeout), so an operation of several
/// commands (a `NOSCRIPT` reload, a scan) is bounded as a whole. A Cluster connection keeps
/// the node timeouts it was built with (see `cluster.rs`): its operations run under a tokio
/// timeout instead.
pub(super) struct Bounded {
    connection: SharedConnection,
    deadline: Instant,
    /// The operation among the store's others, when its commands may go in batches (a
    /// standalone server's connection).
    operation: Option<Operation<MultiplexedConnection>>,
}

impl ConnectionLike for Bounded {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match (self.left(), &self.operation, &self.connection) {
            (None, ..) => Box::pin(async { Err(elapsed()) }),
            // Other operations of the store run: the command goes in their batch.
            (Some(_), Some(operation), SharedConnection::Standalone(connection))
                if !operation.alone() =>
            {
                let batched =
                    operation.batcher().clone().send(connection.clone(), cmd, self.deadline);
                let deadline = self.deadline;
                Box::pin(async move {
                    tokio::time::timeout_at(deadline, batched)
                        .await
                        .unwrap_or_else(|_| Err(elapsed()))
                })
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
            None => Box::pin(async { Err(elapsed()) }),
        }
    }

    fn get_db(&self) -> i64 {
        self.connection.get_db()
    }
}

impl Bounded {
    /// `connection` for one operation, until `deadline`; `operation` when its commands may go
    /// in batches.
    pub(super) fn new(
        connection: SharedConnection,
        deadline: Instant,
        operation: Option<Operation<MultiplexedConnection>>,
    ) -> Self {
        Self { connection, deadline, operation }
    }

    /// The time left before the deadline; `None` once it passed.
    fn left(&self) -> Option<Duration> {
        self.deadline.checked_duration_since(Instant::now()).filter(|left| !left.is_zero())
    }

    /// The Cluster connection, when it is one (its operations run under a tokio timeout).
    #[cfg(feature = "cluster")]
    pub(super) fn cluster(
        &mut self,
    ) -> Option<&mut deadpool_redis::redis::cluster_async::ClusterConnection> {
        match &mut self.connection {
            SharedConnection::Cluster(cluster) => Some(cluster),
            SharedConnection::Standalone(_) => None,
        }
    }

    /// The connection, its next reply awaited at most `left`.
    fn bounded(&mut self, left: Duration) -> &mut SharedConnection {
        match &mut self.connection {
            SharedConnection::Standalone(connection) => connection.set_response_timeout(left),
            #[cfg(feature = "cluster")]
            SharedConnection::Cluster(_) => {}
        }
        &mut self.connection
    }
}

/// The error of a command whose operation's time was up before it was sent: a timeout, as
/// redis-rs reports its own.
fn elapsed() -> RedisError {
    std::io::Error::from(std::io::ErrorKind::TimedOut).into()
}
