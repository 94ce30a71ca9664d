//! The batches over a fake connection that records what it was sent.
//!
//! Every runtime here has its timers on, as every runtime a store runs on needs them (a
//! batch is bounded by a tokio timeout, each command by redis-rs's).

use std::{
    future::Future,
    sync::atomic::AtomicBool,
    time::{Duration, Instant as StdInstant},
};

use deadpool_redis::redis::{ErrorKind, RedisFuture, ServerErrorKind, parse_redis_value};
use tokio::sync::Semaphore;

use super::*;

/// How a fake connection answers a pipeline.
#[derive(Clone, Copy)]
enum Pipelines {
    /// Each command's first argument, back; `NOSCRIPT` for the argument `noscript`.
    Echo,
    /// An I/O error for the whole pipeline.
    Fail,
    /// One reply fewer than commands (no server does that; a client's bug might).
    Short,
    /// Never.
    Hang,
}

/// A connection that records what it was sent: `1` for a command alone, `n` for a
/// pipeline of `n`. A command alone is answered once `answer_alone` has a permit.
#[derive(Clone)]
struct Fake {
    sent: Arc<Mutex<Vec<(&'static str, usize)>>>,
    answer_alone: Arc<Semaphore>,
    pipelines: Pipelines,
    hung_dropped: Arc<AtomicBool>,
}

impl Fake {
    fn new(pipelines: Pipelines) -> Self {
        Self {
            sent: Arc::default(),
            answer_alone: Arc::new(Semaphore::new(0)),
            pipelines,
            hung_dropped: Arc::default(),
        }
    }

    fn sent(&self) -> Vec<(&'static str, usize)> {
        self.sent.lock().unwrap().clone()
    }
}

fn echo(command: &Cmd) -> Value {
    let first = command.args_iter().next().map(|arg| match arg {
        deadpool_redis::redis::Arg::Simple(bytes) => bytes.to_vec(),
        _ => Vec::new(),
    });
    match first.as_deref() {
        Some(b"noscript") => parse_redis_value(b"-NOSCRIPT No matching script\r\n").unwrap(),
        Some(first) => Value::BulkString(first.to_vec()),
        None => Value::Nil,
    }
}

struct Dropped(Arc<AtomicBool>);

impl Drop for Dropped {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

impl ConnectionLike for Fake {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        self.sent.lock().unwrap().push(("alone", 1));
        Box::pin(async move {
            self.answer_alone.acquire().await.unwrap().forget();
            Ok(echo(cmd))
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        assert_eq!((offset, count), (0, pipeline.len()));
        self.sent.lock().unwrap().push(("batch", count));
        let dropped = Dropped(self.hung_dropped.clone());
        Box::pin(async move {
            match self.pipelines {
                Pipelines::Echo => Ok(pipeline.cmd_iter().map(echo).collect()),
                Pipelines::Short => Ok(pipeline.cmd_iter().skip(1).map(echo).collect()),
                Pipelines::Fail => {
                    Err(RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset)))
                }
                Pipelines::Hang => {
                    let _dropped = dropped;
                    std::future::pending().await
                }
            }
        })
    }

    fn get_db(&self) -> i64 {
        0
    }
}

fn command(first: &str) -> Cmd {
    let mut command = Cmd::new();
    command.arg(first).arg("and more");
    command
}

/// Sends `first` through `batcher` on `fake`, due in `within`.
fn send(
    batcher: &Arc<Batcher<Fake>>,
    fake: &Fake,
    first: &str,
    within: Duration,
) -> impl Future<Output = RedisResult<Value>> + use<> {
    let (batcher, fake, command) = (batcher.clone(), fake.clone(), command(first));
    async move { batcher.send(fake, &command, Instant::now() + within).await }
}

const LONG: Duration = Duration::from_secs(5);

#[tokio::test]
async fn commands_queued_together_go_out_as_one_batch_each_with_its_own_reply() {
    let (batcher, fake) = (Arc::new(Batcher::default()), Fake::new(Pipelines::Echo));
    let (a, noscript, c) = tokio::join!(
        send(&batcher, &fake, "a", LONG),
        send(&batcher, &fake, "noscript", LONG),
        send(&batcher, &fake, "c", LONG),
    );
    assert_eq!(fake.sent(), [("batch", 3)]);
    assert_eq!(a.unwrap(), Value::BulkString(b"a".to_vec()));
    // A server error is its command's alone.
    assert_eq!(noscript.unwrap_err().kind(), ErrorKind::Server(ServerErrorKind::NoScript));
    assert_eq!(c.unwrap(), Value::BulkString(b"c".to_vec()));
    // The next command, queued after the batch was taken, goes in a batch of its own.
    send(&batcher, &fake, "next", LONG).await.unwrap();
    assert_eq!(fake.sent(), [("batch", 3), ("batch", 1)]);
}

/// `commands` commands, each queued one turn of the runtime after the one before (a task that
/// yields between them), as commands come whose requests or replies are read meanwhile. With
/// `pause`, the second comes two turns after the first: a turn brings the batch nothing.
///
/// On tokio's current-thread runtime (this test's), where a task that yielded resumes after
/// the tasks that yielded before it: this one before the batch's task, each turn.
async fn one_a_turn(batcher: &Arc<Batcher<Fake>>, fake: &Fake, commands: usize, pause: bool) {
    let mut replies = Vec::new();
    for k in 0..commands {
        if k == 1 && pause {
            tokio::task::yield_now().await;
        }
        if k > 0 {
            tokio::task::yield_now().await;
        }
        let mut reply = Box::pin(send(batcher, fake, "x", LONG));
        // Polled once: queued.
        assert!(futures_util::poll!(reply.as_mut()).is_pending());
        replies.push(reply);
    }
    for reply in replies {
        assert_eq!(reply.await.unwrap(), Value::BulkString(b"x".to_vec()));
    }
}

#[tokio::test]
async fn a_batch_waits_for_the_commands_each_turn_brings_for_three_turns() {
    // The first command is queued before the batch's task runs; each of its three turns
    // brings one more.
    let (batcher, fake) = (Arc::new(Batcher::default()), Fake::new(Pipelines::Echo));
    one_a_turn(&batcher, &fake, 4, false).await;
    assert_eq!(fake.sent(), [("batch", 4)]);
    // A fifth comes after the third turn: the next batch's.
    let (batcher, fake) = (Arc::new(Batcher::default()), Fake::new(Pipelines::Echo));
    one_a_turn(&batcher, &fake, 5, false).await;
    assert_eq!(fake.sent(), [("batch", 4), ("batch", 1)]);
}

#[tokio::test]
async fn a_turn_that_brings_no_command_ends_the_batchs_wait() {
    let (batcher, fake) = (Arc::new(Batcher::default()), Fake::new(Pipelines::Echo));
    one_a_turn(&batcher, &fake, 2, true).await;
    assert_eq!(fake.sent(), [("batch", 1), ("batch", 1)]);
}

/// A batch's error reaches every command in it; so do replies that do not number the
/// commands, since which reply is whose cannot be told.
#[tokio::test]
async fn a_batch_that_fails_or_answers_short_answers_none_of_its_commands() {
    for pipelines in [Pipelines::Fail, Pipelines::Short] {
        let (batcher, fake) = (Arc::new(Batcher::default()), Fake::new(pipelines));
        let (a, b) =
            tokio::join!(send(&batcher, &fake, "a", LONG), send(&batcher, &fake, "b", LONG));
        assert_eq!(fake.sent(), [("batch", 2)]);
        for reply in [a, b] {
            let error = reply.unwrap_err();
            assert!(error.is_io_error(), "{error:?}");
        }
    }
}

#[tokio::test]
async fn a_command_whose_operation_ended_or_whose_time_is_up_is_not_sent() {
    let (batcher, fake) = (Arc::new(Batcher::default()), Fake::new(Pipelines::Echo));
    let mut gone = Box::pin(send(&batcher, &fake, "gone", LONG));
    // Queued by its first poll, then dropped before the batch's task runs.
    assert!(futures_util::poll!(gone.as_mut()).is_pending());
    drop(gone);
    let (late, kept) = tokio::join!(
        send(&batcher, &fake, "late", Duration::ZERO),
        send(&batcher, &fake, "kept", LONG)
    );
    assert_eq!(kept.unwrap(), Value::BulkString(b"kept".to_vec()));
    assert!(late.unwrap_err().is_timeout());
    assert_eq!(fake.sent(), [("batch", 1)]);
}

#[tokio::test]
async fn a_batch_unanswered_ends_at_its_latest_deadline() {
    let (batcher, fake) = (Arc::new(Batcher::default()), Fake::new(Pipelines::Hang));
    let start = StdInstant::now();
    let (early, late) = tokio::join!(
        send(&batcher, &fake, "early", Duration::from_millis(100)),
        send(&batcher, &fake, "late", Duration::from_millis(400)),
    );
    let ended = start.elapsed();
    assert_eq!(fake.sent(), [("batch", 2)]);
    for reply in [early, late] {
        let error = reply.unwrap_err();
        assert!(error.is_timeout(), "{error:?}");
    }
    // Ended by the later deadline, not the earlier, and not never.
    assert!(ended >= Duration::from_millis(390), "{ended:?}");
    assert!(ended < Duration::from_millis(2_000), "{ended:?}");
    assert!(fake.hung_dropped.load(Ordering::SeqCst), "the batch's pipeline was not dropped");
}

#[test]
fn a_batch_task_dropped_before_it_ran_does_not_stop_the_next_batch() {
    let (batcher, fake) = (Arc::new(Batcher::default()), Fake::new(Pipelines::Echo));
    // Queued and its batch's task spawned, then the runtime gone before the task ran.
    let gone = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    gone.block_on(async {
        let mut queued = Box::pin(send(&batcher, &fake, "gone", LONG));
        assert!(futures_util::poll!(queued.as_mut()).is_pending());
    });
    drop(gone);
    let next = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    let reply = next
        .block_on(async { tokio::time::timeout(LONG, send(&batcher, &fake, "next", LONG)).await });
    let reply = reply.expect("the next command waited for a batch task that never came");
    assert_eq!(reply.unwrap(), Value::BulkString(b"next".to_vec()));
    // The command of the runtime that went away was never sent, nor kept.
    assert_eq!(fake.sent(), [("batch", 1)]);
    assert_eq!(batcher.queue.lock().unwrap().waiting.len(), 0, "a dead runtime's command kept");
}

#[test]
fn a_batch_task_waiting_on_an_idle_runtime_stops_no_batch_of_another() {
    let (batcher, fake) = (Arc::new(Batcher::default()), Fake::new(Pipelines::Echo));
    // Queued from a runtime that runs tasks only inside `block_on`, which returned before
    // the batch's task ran: the runtime lives on, idle.
    let idle = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    idle.block_on(async {
        let mut queued = Box::pin(send(&batcher, &fake, "idle", LONG));
        assert!(futures_util::poll!(queued.as_mut()).is_pending());
    });
    let other = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    let reply = other
        .block_on(async { tokio::time::timeout(LONG, send(&batcher, &fake, "other", LONG)).await });
    let reply = reply.expect("the command waited for a task of an idle runtime");
    assert_eq!(reply.unwrap(), Value::BulkString(b"other".to_vec()));
    // The idle runtime's task, run at last, finds nothing to send and unmarks nothing.
    idle.block_on(tokio::task::yield_now());
    assert_eq!(fake.sent(), [("batch", 1)]);
    drop(idle);
}

#[test]
fn a_runtime_sends_its_own_commands_on_its_own_connection() {
    let batcher = Arc::new(Batcher::default());
    let (on_idle, on_other) = (Fake::new(Pipelines::Echo), Fake::new(Pipelines::Echo));
    // Queued first, from a runtime that then idles with the command still waiting.
    let idle = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    let mut queued = Box::pin(send(&batcher, &on_idle, "idle", LONG));
    idle.block_on(async { assert!(futures_util::poll!(queued.as_mut()).is_pending()) });
    let other = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    let reply = other.block_on(async {
        tokio::time::timeout(LONG, send(&batcher, &on_other, "other", LONG)).await
    });
    assert_eq!(reply.unwrap().unwrap(), Value::BulkString(b"other".to_vec()));
    // The other runtime's batch went out on its own connection, without the idle one's
    // command, which its own runtime sends once it runs.
    assert_eq!((on_idle.sent(), on_other.sent()), (vec![], vec![("batch", 1)]));
    assert_eq!(idle.block_on(queued).unwrap(), Value::BulkString(b"idle".to_vec()));
    assert_eq!(on_idle.sent(), [("batch", 1)]);
}

#[test]
fn an_operation_is_alone_when_no_other_of_the_store_runs() {
    let batcher = Arc::new(Batcher::<Fake>::default());
    let first = batcher.start();
    let second = batcher.start();
    assert!(first.alone() && !second.alone());
    drop(first);
    // The second still runs.
    let third = batcher.start();
    assert!(!third.alone());
    drop((second, third));
    assert!(batcher.start().alone());
}

#[test]
fn outside_a_tokio_runtime_a_command_goes_straight_out() {
    let (batcher, fake) = (Arc::new(Batcher::default()), Fake::new(Pipelines::Echo));
    fake.answer_alone.add_permits(1);
    // Polled once, by no executor: the answer is at hand, no task was needed.
    let sending = std::pin::pin!(send(&batcher, &fake, "a", LONG));
    let mut context = std::task::Context::from_waker(std::task::Waker::noop());
    let std::task::Poll::Ready(reply) = sending.poll(&mut context) else {
        panic!("the command waits for a batch no task writes")
    };
    assert_eq!(reply.unwrap(), Value::BulkString(b"a".to_vec()));
    assert_eq!(fake.sent(), [("alone", 1)]);
}
