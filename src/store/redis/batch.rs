//! [`Batcher`]: the commands of operations that run together, written to Redis together as one
//! redis-rs pipeline.
//!
//! A multiplexed connection writes each command as it comes: under load, one `writev` a
//! command on the client, one read on the server (redis-rs's driver task, woken into the
//! worker's LIFO slot, writes each before the next is queued). Here an operation that starts
//! while no other of the store's runs sends its commands straight out, as before (an idle store
//! pays two atomic additions an operation); one that starts while others run queues its
//! commands, and one task, spawned by the first of them, yields (every task already runnable
//! sends first, and the tasks the runtime's driver wakes meanwhile, for up to three turns while
//! each brings more) and writes the queue as one pipeline (`req_packed_commands` on the same
//! redis-rs connection), giving each command's reply, or the pipeline's error, to its own
//! sender.
//!
//! What an operation sees does not change: its command's own reply (a server error, such as
//! `NOSCRIPT`, is its alone), in order with its other commands (an operation awaits each reply
//! before it sends again); its deadline (its wait for a reply is bounded by it, see
//! `connection.rs`). The task that writes a batch is bounded by the latest deadline in it (a
//! tokio timeout); a command whose operation ended (or whose deadline passed) before its batch
//! was written is not sent.

use std::sync::{
    Arc, Mutex, PoisonError,
    atomic::{AtomicUsize, Ordering},
};

use deadpool_redis::redis::{Cmd, Pipeline, RedisError, RedisResult, Value, aio::ConnectionLike};
use tokio::{runtime, sync::oneshot, time::Instant};

/// One store's queue of commands waiting for a batch; see the module.
pub(super) struct Batcher<C> {
    queue: Mutex<Queue<C>>,
    /// The store's operations running now.
    operations: AtomicUsize,
}

impl<C> Default for Batcher<C> {
    fn default() -> Self {
        let queue = Mutex::new(Queue { waiting: Vec::new(), flushing: None });
        Self { queue, operations: AtomicUsize::new(0) }
    }
}

struct Queue<C> {
    waiting: Vec<Waiting<C>>,
    /// The runtime a task to write the queue was spawned on, which has not taken it yet. A
    /// command queued from another runtime spawns a task of its own there: the runtime of the
    /// first may have stopped running its tasks (one that runs only inside `block_on`).
    flushing: Option<runtime::Id>,
}

/// A command waiting for its batch.
struct Waiting<C> {
    command: Cmd,
    /// The runtime of the command's operation: only its own runtime's task sends it.
    runtime: runtime::Id,
    /// The connection of the command's operation: a batch goes out on its first command's.
    connection: C,
    deadline: Instant,
    reply: oneshot::Sender<RedisResult<Value>>,
}

/// One running operation of the store, counted until it is dropped.
pub(super) struct Operation<C> {
    batcher: Arc<Batcher<C>>,
    /// No other operation of the store ran when it started: its commands go straight out.
    alone: bool,
}

impl<C> Drop for Operation<C> {
    fn drop(&mut self) {
        self.batcher.operations.fetch_sub(1, Ordering::AcqRel);
    }
}

impl<C> Batcher<C> {
    /// Counts an operation from now until the returned value is dropped.
    pub(super) fn start(self: &Arc<Self>) -> Operation<C> {
        let alone = self.operations.fetch_add(1, Ordering::AcqRel) == 0;
        Operation { batcher: self.clone(), alone }
    }
}

impl<C> Operation<C> {
    /// Whether the operation's commands go straight out, not in batches.
    pub(super) fn alone(&self) -> bool {
        self.alone
    }

    /// The store's batches.
    pub(super) fn batcher(&self) -> &Arc<Batcher<C>> {
        &self.batcher
    }
}

impl<C> Batcher<C>
where
    C: ConnectionLike + Clone + Send + 'static,
{
    /// Sends `command` in the next batch, on `connection` if it is the batch's first.
    /// `deadline` is its operation's. Outside a tokio runtime (no task can write a batch), at
    /// once.
    pub(super) async fn send(
        self: Arc<Self>,
        mut connection: C,
        command: &Cmd,
        deadline: Instant,
    ) -> RedisResult<Value> {
        let Ok(runtime) = runtime::Handle::try_current() else {
            return connection.req_packed_command(command).await;
        };
        let (reply, replied) = oneshot::channel();
        let here = runtime.id();
        let spawn = {
            let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
            let command = command.clone();
            queue.waiting.push(Waiting { command, runtime: here, connection, deadline, reply });
            queue.flushing.replace(here) != Some(here)
        };
        if spawn {
            runtime.spawn(flush(Flushing { batcher: Some(self.clone()), runtime: here }));
        }
        // A sender dropped unanswered: the batch's task ended without a reply (its deadline,
        // or its runtime shutting down), the command perhaps applied.
        replied.await.unwrap_or_else(|_| Err(batch_lost()))
    }
}

/// The most turns of the scheduler a batch waits for while each adds commands to it.
const MOST_TURNS: usize = 3;

/// Writes the queue as one pipeline, once every task already runnable has had its turn, and
/// the tasks those turns woke while they queue more (up to [`MOST_TURNS`]).
async fn flush<C>(mut flushing: Flushing<C>)
where
    C: ConnectionLike + Clone + Send + 'static,
{
    // Under load, each turn of the scheduler runs tasks (replies read, requests accepted)
    // that queue commands of their own: one batch carries them all, and Redis reads and
    // answers one pipeline rather than several (about a fifth less Redis CPU a request at
    // 16 connections: `BENCHMARKS.md`, "More turns before a batch"). A turn that queued
    // nothing ends the wait at once. What a turn holds depends on the runtime: on a
    // current-thread one, the tasks its driver woke run before this one resumes; on a
    // multi-thread one, a yielded task resumes first (in the worker's LIFO slot), and those
    // tasks queue their commands during the next turn, which follows only if this one brought
    // some (the queue it found, run before the driver's poll).
    let mut queued = flushing.queued();
    for _ in 0..MOST_TURNS {
        tokio::task::yield_now().await;
        let now_queued = flushing.queued();
        if now_queued == queued {
            break;
        }
        queued = now_queued;
    }
    let waiting = flushing.take();
    let now = Instant::now();
    // A command whose operation ended (a dropped request) or whose time is up is not sent.
    let (mut pipeline, mut replies) = (Pipeline::with_capacity(waiting.len()), Vec::new());
    let mut batch = None;
    for Waiting { command, connection, deadline, reply, .. } in waiting {
        if reply.is_closed() {
            continue;
        }
        if deadline <= now {
            let _ = reply.send(Err(elapsed()));
            continue;
        }
        let (_, latest) = batch.get_or_insert((connection, deadline));
        *latest = deadline.max(*latest);
        pipeline.add_command(command);
        replies.push(reply);
    }
    let Some((mut connection, latest)) = batch else { return };
    let count = replies.len();
    match tokio::time::timeout_at(latest, connection.req_packed_commands(&pipeline, 0, count)).await
    {
        Ok(Ok(values)) if values.len() == count => {
            for (reply, value) in replies.into_iter().zip(values) {
                let _ = reply.send(value.extract_error());
            }
        }
        Ok(Ok(_)) => {
            for reply in replies {
                let _ = reply.send(Err(batch_lost()));
            }
        }
        Ok(Err(error)) => {
            for reply in replies {
                let _ = reply.send(Err(error.clone()));
            }
        }
        // Every operation's time is up.
        Err(_) => {
            for reply in replies {
                let _ = reply.send(Err(elapsed()));
            }
        }
    }
}

/// A batch's task until it takes the queue, made before the task is spawned. Dropped before
/// it takes it (its runtime shut down before the task ran), it says so, so that the next
/// command queued spawns another: else every command after would wait for a task that never
/// comes.
struct Flushing<C> {
    batcher: Option<Arc<Batcher<C>>>,
    /// The runtime the task was spawned on.
    runtime: runtime::Id,
}

impl<C> Flushing<C> {
    /// How many commands wait in the queue, every runtime's.
    fn queued(&self) -> usize {
        self.batcher.as_ref().map_or(0, |batcher| {
            batcher.queue.lock().unwrap_or_else(PoisonError::into_inner).waiting.len()
        })
    }

    /// The queue's commands of this runtime, and the next command from this runtime spawns
    /// the next batch's task. Another runtime's commands wait for its own task (one is
    /// pending: each runtime's first command queued since its last task took spawns one), as
    /// their connection is its: a connection's driver is a task of the runtime that made it,
    /// and a runtime that idles (a current-thread runtime between two `block_on`) would hold
    /// up the batch of every runtime sending on it.
    fn take(&mut self) -> Vec<Waiting<C>> {
        let Some(batcher) = self.batcher.take() else { return Vec::new() };
        let mut queue = batcher.queue.lock().unwrap_or_else(PoisonError::into_inner);
        queue.flushing.take_if(|runtime| *runtime == self.runtime);
        // A command whose operation ended is never sent, whichever runtime's it is: one of a
        // runtime that shut down before its task took it would otherwise stay queued.
        queue.waiting.retain(|waiting| !waiting.reply.is_closed());
        let here = |waiting: &mut Waiting<C>| waiting.runtime == self.runtime;
        queue.waiting.extract_if(.., here).collect()
    }
}

impl<C> Drop for Flushing<C> {
    fn drop(&mut self) {
        if let Some(batcher) = self.batcher.take() {
            let mut queue = batcher.queue.lock().unwrap_or_else(PoisonError::into_inner);
            queue.flushing.take_if(|runtime| *runtime == self.runtime);
        }
    }
}

/// The error of a command whose time was up: a timeout, as redis-rs reports its own.
fn elapsed() -> RedisError {
    std::io::Error::from(std::io::ErrorKind::TimedOut).into()
}

/// The error of a command whose batch ended without its reply: it may have been applied.
fn batch_lost() -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::ConnectionAborted,
        "the batch carrying the command ended without its reply",
    ))
}

#[cfg(test)]
mod tests;
