//! [`Direct`]: the connection a [`RedisStore`](super::RedisStore) built from a URL drives
//! itself, to a standalone server over plain TCP, in place of a redis-rs multiplexed one.
//!
//! A multiplexed connection hands each command to its driver task through a channel, writes
//! it through a codec and reads each reply with a parser combinator: about 7k instructions a
//! command, over half of what a fresh request's two scripts cost the client. Here a command
//! is written by its caller, straight from its `Cmd` into the socket, when nothing else is on
//! the wire; while other commands are, it joins the bytes waiting to go, which the connection's
//! task writes as one when the next reply comes in (so commands sent together reach Redis in
//! one read, as the batches of a multiplexed connection do). The task reads replies and gives
//! each to the command that waits for it, in the order they were written.
//!
//! What a caller sees is what a redis-rs connection gives: each reply as its `Value`, a
//! server error as `Value::ServerError`, an I/O error or a lost connection as an error (every
//! command waiting then gets one, and every later command at once: the store takes a new
//! connection). A caller that stops waiting (its deadline, kept by the watchdog) leaves its
//! reply to be read and dropped, so the replies after it still reach their own commands.
//!
//! Only for plain TCP and RESP2 (redis-rs's default) without TCP settings of the app's own;
//! TLS, Unix sockets, RESP3 and keep-alive or user-timeout settings keep the multiplexed
//! connection ([`Direct::serves`]).

use std::{
    collections::VecDeque,
    future::Future,
    io,
    pin::Pin,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    task::{Context, Poll, Waker},
};

use bytes::{Buf, BytesMut};
use deadpool_redis::redis::{
    Cmd, ConnectionAddr, ConnectionInfo, Pipeline, ProtocolVersion, RedisError, RedisFuture, Value,
};
use tokio::{net::TcpStream, sync::oneshot};

use super::reply;

/// A shared handle on one connection; cloned for each operation. The last one dropped ends
/// the connection's task.
#[derive(Clone)]
pub(super) struct Direct {
    handles: Arc<Handles>,
    db: i64,
}

struct Inner {
    stream: TcpStream,
    state: Mutex<State>,
}

struct State {
    /// Commands not yet written: what the socket did not take at once.
    out: Vec<u8>,
    /// Who waits for each reply still to come, in the order the commands were written.
    waiting: VecDeque<Waiting>,
    /// Why the connection is lost, once it is: every command after fails at once.
    lost: Option<(io::ErrorKind, &'static str)>,
    /// The connection's task, to wake when there is something to write or nothing to wait for.
    task: Option<Waker>,
    /// No handle is left: the task ends.
    closed: bool,
}

/// Who waits for a command's reply.
type Waiting = oneshot::Sender<Result<Value, RedisError>>;

struct Handles(Arc<Inner>);

impl Drop for Handles {
    fn drop(&mut self) {
        let mut state = self.0.state();
        state.closed = true;
        state.wake_task();
    }
}

impl Direct {
    /// Whether the store can drive connections to `info` itself.
    pub(super) fn serves(info: &ConnectionInfo) -> bool {
        // TCP settings of the app's own (keep-alive probes, a user timeout) are redis-rs's to
        // apply. `TCP_NODELAY` is always set here.
        let tcp = info.tcp_settings();
        #[cfg(any(target_os = "android", target_os = "fuchsia", target_os = "linux"))]
        let own_settings = tcp.keepalive().is_some() || tcp.user_timeout().is_some();
        #[cfg(not(any(target_os = "android", target_os = "fuchsia", target_os = "linux")))]
        let own_settings = tcp.keepalive().is_some();
        matches!(info.addr(), ConnectionAddr::Tcp(..))
            && info.redis_settings().protocol() == ProtocolVersion::RESP2
            && !own_settings
    }

    /// Connects to `info` (see [`serves`](Self::serves)), authenticates and selects its
    /// database. Its task is spawned on the caller's runtime.
    pub(super) async fn connect(info: &ConnectionInfo) -> Result<Self, RedisError> {
        let ConnectionAddr::Tcp(host, port) = info.addr() else {
            return Err(lost(io::ErrorKind::Unsupported, "not a plain TCP address"));
        };
        let stream = TcpStream::connect((host.as_str(), *port)).await?;
        stream.set_nodelay(true)?;
        let state = State {
            out: Vec::new(),
            waiting: VecDeque::new(),
            lost: None,
            task: None,
            closed: false,
        };
        let inner = Arc::new(Inner { stream, state: Mutex::new(state) });
        tokio::spawn(Task { inner: inner.clone(), read: BytesMut::with_capacity(READ_CHUNK) });
        let settings = info.redis_settings();
        let direct = Self { handles: Arc::new(Handles(inner)), db: settings.db() };
        if let Some(password) = settings.password() {
            let mut auth = deadpool_redis::redis::cmd("AUTH");
            auth.arg(settings.username()).arg(password);
            direct.request(&auth).await?.extract_error()?;
        }
        if settings.db() != 0 {
            let select = deadpool_redis::redis::cmd("SELECT").arg(settings.db()).clone();
            direct.request(&select).await?.extract_error()?;
        }
        Ok(direct)
    }

    /// Whether the connection was found lost (Redis closed it, a write or a read failed):
    /// nothing sent on it could be answered, so the store connects again before it sends.
    pub(super) fn is_lost(&self) -> bool {
        self.handles.0.state().lost.is_some()
    }

    pub(super) fn db(&self) -> i64 {
        self.db
    }

    /// Sends `command`; its reply.
    pub(super) async fn request(&self, command: &Cmd) -> Result<Value, RedisError> {
        let replied = self.send(|state| state.queue(command))?;
        replied.await.map_err(|_| task_ended())?
    }

    /// Sends the commands of `pipeline` (not a transaction) at once; the replies after the
    /// first `offset`, `count` of them. (The store sends no pipeline on this connection: its
    /// commands are written together by themselves.)
    pub(super) async fn request_all(
        &self,
        pipeline: &Pipeline,
        offset: usize,
        count: usize,
    ) -> Result<Vec<Value>, RedisError> {
        if pipeline.is_transaction() {
            return Err(lost(io::ErrorKind::Unsupported, "a transaction on a shared connection"));
        }
        let replies = self.send(|state| {
            pipeline.cmd_iter().map(|command| state.queue(command)).collect::<Vec<_>>()
        })?;
        let mut values = Vec::with_capacity(count);
        for (n, reply) in replies.into_iter().enumerate() {
            let value = reply.await.map_err(|_| task_ended())??;
            if n >= offset && values.len() < count {
                values.push(value);
            }
        }
        Ok(values)
    }

    /// Queues commands with `queue`, under one lock (so that the order of the replies is the
    /// order of the waiters), and writes them.
    fn send<R>(&self, queue: impl FnOnce(&mut State) -> R) -> Result<R, RedisError> {
        let inner = &self.handles.0;
        let mut state = inner.state();
        if let Some((kind, why)) = state.lost {
            return Err(lost(kind, why));
        }
        // Nothing on the wire: the caller writes at once. Else the task writes it with the
        // others when the next reply comes in.
        let alone = state.waiting.is_empty();
        let replied = queue(&mut state);
        if alone {
            // What the socket does not take (or an error, which the task meets again and
            // reports) is left to the task.
            if let Ok(written) = inner.stream.try_write(&state.out) {
                state.written(written);
            }
            if !state.out.is_empty() {
                state.wake_task();
            }
        }
        Ok(replied)
    }
}

impl Inner {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl State {
    /// Packs `command` into what is to be written, and queues a waiter for its reply.
    fn queue(&mut self, command: &Cmd) -> oneshot::Receiver<Result<Value, RedisError>> {
        command.write_packed_command(&mut self.out);
        let (reply, replied) = oneshot::channel();
        self.waiting.push_back(reply);
        replied
    }

    /// The connection is lost: every waiter hears it, and every later command.
    fn lose(&mut self, kind: io::ErrorKind, why: &'static str) {
        self.lost.get_or_insert((kind, why));
        self.out.clear();
        self.wake_task();
        for reply in self.waiting.drain(..) {
            let _ = reply.send(Err(lost(kind, why)));
        }
    }

    /// The first `count` bytes waiting to go are written. A buffer a large record grew is
    /// given back once empty.
    fn written(&mut self, count: usize) {
        self.out.drain(..count);
        if self.out.is_empty() && self.out.capacity() > KEPT {
            self.out = Vec::new();
        }
    }

    /// Wakes the connection's task, to write or to end.
    fn wake_task(&mut self) {
        if let Some(task) = self.task.take() {
            task.wake();
        }
    }

    /// Gives `value` to the oldest waiter. `false` when nobody waits for it.
    fn deliver(&mut self, value: Value) -> bool {
        let Some(reply) = self.waiting.pop_front() else { return false };
        // A waiter that stopped waiting (its operation ended) drops its reply.
        let _ = reply.send(Ok(value));
        true
    }
}

/// How large a buffer stays once empty; a larger one (a large record's) is given back.
const KEPT: usize = 1 << 20;

/// How much the task reads at a time, at least.
const READ_CHUNK: usize = 16 * 1024;

/// How many reads the task makes before it lets the runtime's other tasks run.
const READS_PER_TURN: usize = 32;

/// The connection's task: writes what callers could not, reads every reply.
struct Task {
    inner: Arc<Inner>,
    read: BytesMut,
}

impl Future for Task {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let Task { inner, read } = self.get_mut();
        let stream = &inner.stream;
        for _ in 0..READS_PER_TURN {
            {
                let mut state = inner.state();
                if state.closed || state.lost.is_some() {
                    return Poll::Ready(());
                }
                if !state.task.as_ref().is_some_and(|task| task.will_wake(cx.waker())) {
                    state.task = Some(cx.waker().clone());
                }
                while !state.out.is_empty() {
                    match stream.poll_write_ready(cx) {
                        Poll::Pending => break,
                        Poll::Ready(Err(error)) => {
                            state.lose(error.kind(), "writing a command failed");
                            return Poll::Ready(());
                        }
                        Poll::Ready(Ok(())) => match stream.try_write(&state.out) {
                            Ok(written) => state.written(written),
                            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
                            Err(error) => {
                                state.lose(error.kind(), "writing a command failed");
                                return Poll::Ready(());
                            }
                        },
                    }
                }
            }
            match stream.poll_read_ready(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(error)) => {
                    inner.state().lose(error.kind(), "reading a reply failed");
                    return Poll::Ready(());
                }
                Poll::Ready(Ok(())) => {}
            }
            if read.capacity() - read.len() < READ_CHUNK / 4 {
                read.reserve(READ_CHUNK);
            }
            match stream.try_read_buf(read) {
                Ok(0) => {
                    inner.state().lose(io::ErrorKind::UnexpectedEof, "Redis closed the connection");
                    return Poll::Ready(());
                }
                Ok(_) => {
                    if let Err(why) = deliver(inner, read) {
                        inner.state().lose(io::ErrorKind::InvalidData, why);
                        return Poll::Ready(());
                    }
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
                Err(error) => {
                    inner.state().lose(error.kind(), "reading a reply failed");
                    return Poll::Ready(());
                }
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

/// Gives every whole reply in `read` to its waiter, and takes it out.
fn deliver(inner: &Inner, read: &mut BytesMut) -> Result<(), &'static str> {
    let mut used = 0;
    let mut state = None;
    let result = loop {
        match reply::read(&read[used..]) {
            Ok(Some((value, length))) => {
                used += length;
                let state = state.get_or_insert_with(|| inner.state());
                if !state.deliver(value) {
                    break Err("Redis sent a reply nobody asked for");
                }
            }
            Ok(None) => break Ok(()),
            Err(_) => break Err("Redis sent bytes that are not a reply"),
        }
    };
    drop(state);
    read.advance(used);
    if read.is_empty() && read.capacity() > KEPT {
        *read = BytesMut::with_capacity(READ_CHUNK);
    }
    result
}

impl Drop for Task {
    /// The task ended (a lost connection, no handle left, or its runtime shutting down):
    /// nobody waits forever.
    fn drop(&mut self) {
        self.inner.state().lose(io::ErrorKind::ConnectionAborted, "the connection's task ended");
    }
}

fn lost(kind: io::ErrorKind, why: &'static str) -> RedisError {
    RedisError::from(io::Error::new(kind, why))
}

fn task_ended() -> RedisError {
    lost(io::ErrorKind::ConnectionAborted, "the connection's task ended before the reply")
}

impl Direct {
    pub(super) fn req_packed_command<'a>(&'a self, command: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(self.request(command))
    }

    pub(super) fn req_packed_commands<'a>(
        &'a self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(self.request_all(pipeline, offset, count))
    }
}

#[cfg(test)]
mod tests;
