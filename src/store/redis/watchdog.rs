//! The watchdog: one thread that ends every [`Watched`] operation at its deadline, in place of
//! a timer per command.
//!
//! redis-rs bounds a reply with a tokio timer of its own for each command: registered in the
//! timer wheel, allocated, polled, and taken out again. That was 2.7k instructions of a fresh
//! request's 78k (two commands). Here an operation costs two uncontended locks and a slab
//! slot: it is watched from its first pending poll to its end, and the thread, asleep until
//! the earliest deadline it knows, wakes the operations whose deadline has passed. Under load
//! it wakes about once per command timeout; idle, it sleeps until the next operation.
//!
//! A thread, not a task: it serves every runtime at once, and ends nothing late because a
//! runtime that spawned it stopped running its tasks.

use std::{
    future::Future,
    pin::Pin,
    sync::{Condvar, Mutex, MutexGuard, OnceLock, PoisonError},
    task::{Context, Poll, Waker},
    time::{Duration, Instant},
};

use slab::Slab;

/// How long the thread looks again while nothing is watched, before it sleeps until told: an
/// operation that starts within it, due no sooner, needs no notification.
const IDLE: Duration = Duration::from_millis(100);

/// How many idle looks before the thread sleeps until told.
const IDLE_LOOKS: u32 = 10;

/// Ends `future` at `deadline`, with [`Elapsed`].
pub(super) fn within<F: Future>(deadline: Instant, future: F) -> Watched<F> {
    Watched { future, deadline, slot: None }
}

/// The deadline passed first.
#[derive(Debug)]
pub(super) struct Elapsed;

impl From<Elapsed> for deadpool_redis::redis::RedisError {
    /// A timeout, as redis-rs reports its own: an operation's time was up.
    fn from(_: Elapsed) -> Self {
        std::io::Error::from(std::io::ErrorKind::TimedOut).into()
    }
}

pin_project_lite::pin_project! {
    /// An operation under the watchdog; see [`within`].
    pub(super) struct Watched<F> {
        #[pin]
        future: F,
        deadline: Instant,
        // Its slot in the watchdog's slab, from its first pending poll.
        slot: Option<usize>,
    }

    impl<F> PinnedDrop for Watched<F> {
        fn drop(this: Pin<&mut Self>) {
            if let Some(slot) = this.project().slot.take() {
                watchdog().lock().watches.remove(slot);
            }
        }
    }
}

impl<F: Future> Future for Watched<F> {
    type Output = Result<F::Output, Elapsed>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(output) = this.future.poll(cx) {
            return Poll::Ready(Ok(output));
        }
        let watchdog = watchdog();
        let mut state = watchdog.lock();
        match *this.slot {
            Some(slot) => {
                let watch = &mut state.watches[slot];
                if watch.expired {
                    return Poll::Ready(Err(Elapsed));
                }
                if !watch.waker.will_wake(cx.waker()) {
                    watch.waker = cx.waker().clone();
                }
            }
            None => {
                let deadline = *this.deadline;
                if deadline <= Instant::now() {
                    return Poll::Ready(Err(Elapsed));
                }
                let watch = Watch { deadline, waker: cx.waker().clone(), expired: false };
                *this.slot = Some(state.watches.insert(watch));
                // The thread sleeps past this deadline: it must look sooner.
                if state.wakes_at.is_none_or(|at| deadline < at) {
                    state.wakes_at = Some(deadline);
                    watchdog.look.notify_one();
                }
            }
        }
        Poll::Pending
    }
}

struct Watchdog {
    state: Mutex<State>,
    /// Tells the thread to look again: an operation is due before it would.
    look: Condvar,
}

struct State {
    watches: Slab<Watch>,
    /// When the thread looks next; `None`: not until told.
    wakes_at: Option<Instant>,
}

struct Watch {
    deadline: Instant,
    waker: Waker,
    /// The deadline passed: the next poll ends the operation.
    expired: bool,
}

impl Watchdog {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing panics while it is held; a poisoned state is still whole.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The thread: wakes the operations whose deadline passed, then sleeps until the next.
    fn run(&self) {
        let mut state = self.lock();
        let mut idle_looks = 0;
        // The wakers of the operations past their deadline, woken with the lock released: a
        // waker is the runtime's code, and one that touched the watchdog would deadlock.
        let mut due: Vec<Waker> = Vec::new();
        loop {
            let now = Instant::now();
            let mut next: Option<Instant> = None;
            for (_, watch) in state.watches.iter_mut().filter(|(_, watch)| !watch.expired) {
                if watch.deadline <= now {
                    watch.expired = true;
                    due.push(watch.waker.clone());
                } else {
                    next = Some(next.map_or(watch.deadline, |next| next.min(watch.deadline)));
                }
            }
            idle_looks = if state.watches.is_empty() { idle_looks + 1 } else { 0 };
            state.wakes_at = match next {
                Some(next) => Some(next),
                None if idle_looks < IDLE_LOOKS => Some(now + IDLE),
                None => None,
            };
            if !due.is_empty() {
                drop(state);
                due.drain(..).for_each(Waker::wake);
                state = self.lock();
            }
            // Read under the lock again: an operation registered meanwhile may have moved it
            // sooner (and its notification found nobody waiting).
            state = match state.wakes_at {
                Some(at) => {
                    let sleep = at.saturating_duration_since(Instant::now());
                    self.look.wait_timeout(state, sleep).unwrap_or_else(PoisonError::into_inner).0
                }
                None => self.look.wait(state).unwrap_or_else(PoisonError::into_inner),
            };
        }
    }
}

/// The process's one watchdog, its thread started on first use.
fn watchdog() -> &'static Watchdog {
    static WATCHDOG: OnceLock<&'static Watchdog> = OnceLock::new();
    WATCHDOG.get_or_init(|| {
        let state = State { watches: Slab::new(), wakes_at: None };
        let watchdog: &'static Watchdog =
            Box::leak(Box::new(Watchdog { state: Mutex::new(state), look: Condvar::new() }));
        // Without its thread, no watched operation would ever end at its deadline: a process
        // that cannot start one more thread has worse troubles than this panic.
        std::thread::Builder::new()
            .name("idempotency-watchdog".to_owned())
            .spawn(|| watchdog.run())
            .expect("the store's watchdog thread starts");
        watchdog
    })
}

#[cfg(test)]
mod tests {
    use std::{
        future::Future,
        sync::{
            Arc,
            atomic::{AtomicUsize, Ordering},
        },
        task::{Context, Poll, Wake, Waker},
        time::{Duration, Instant},
    };

    use super::{Elapsed, watchdog, within};

    #[tokio::test]
    async fn an_operation_past_its_deadline_ends_then_and_a_finished_one_leaves_no_watch() {
        let started = Instant::now();
        let never = within(started + Duration::from_millis(50), std::future::pending::<()>());
        assert!(matches!(never.await, Err(Elapsed)));
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(50) && took < Duration::from_millis(500), "{took:?}");

        let soon = async {
            tokio::time::sleep(Duration::from_millis(10)).await;
            7
        };
        assert_eq!(within(Instant::now() + Duration::from_secs(5), soon).await.unwrap(), 7);
        // Operations due in an hour, dropped unfinished, leave nothing watched either (other
        // tests of this process may be watched meanwhile, a few at a time).
        let hour = Instant::now() + Duration::from_secs(3600);
        for _ in 0..1000 {
            let dropped = within(hour, std::future::pending::<()>());
            assert!(tokio::time::timeout(Duration::ZERO, dropped).await.is_err());
        }
        assert!(watchdog().lock().watches.len() < 100);
    }

    #[tokio::test]
    async fn an_operation_due_before_the_thread_would_look_wakes_it() {
        // The thread sleeps until a deadline a second off (past its idle looks); one due in
        // 100 ms must tell it to look sooner.
        let long = tokio::spawn(within(
            Instant::now() + Duration::from_secs(1),
            std::future::pending::<()>(),
        ));
        tokio::time::sleep(Duration::from_millis(250)).await;
        let started = Instant::now();
        let short = within(started + Duration::from_millis(100), std::future::pending::<()>());
        assert!(short.await.is_err());
        let took = started.elapsed();
        // Without the notify it would end with the long one's look, 750 ms from `started`.
        assert!(took < Duration::from_millis(600), "{took:?}");
        long.abort();
    }

    /// A waker that counts its wakes.
    struct Counting(AtomicUsize);

    impl Wake for Counting {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn the_waker_of_the_last_poll_is_the_one_woken() {
        // A detached operation moves from its caller's task to a task of its own: polled by
        // another waker, it must wake that one at its deadline.
        let (first, second) =
            (Arc::new(Counting(AtomicUsize::new(0))), Arc::new(Counting(AtomicUsize::new(0))));
        let mut watched = Box::pin(within(
            Instant::now() + Duration::from_millis(50),
            std::future::pending::<()>(),
        ));
        let first_waker = Waker::from(first.clone());
        assert!(watched.as_mut().poll(&mut Context::from_waker(&first_waker)).is_pending());
        let second_waker = Waker::from(second.clone());
        assert!(watched.as_mut().poll(&mut Context::from_waker(&second_waker)).is_pending());
        let deadline = Instant::now() + Duration::from_secs(2);
        while second.0.load(Ordering::SeqCst) == 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(second.0.load(Ordering::SeqCst), 1);
        assert_eq!(first.0.load(Ordering::SeqCst), 0);
        let polled = watched.as_mut().poll(&mut Context::from_waker(&second_waker));
        assert!(matches!(polled, Poll::Ready(Err(Elapsed))));
    }

    /// A waker that looks at the watchdog when woken, as a runtime's may do anything.
    struct Meddling(AtomicUsize);

    impl Wake for Meddling {
        fn wake(self: Arc<Self>) {
            drop(watchdog().lock());
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_waker_is_woken_without_the_watchdog_locked() {
        let meddling = Arc::new(Meddling(AtomicUsize::new(0)));
        let waker = Waker::from(meddling.clone());
        let mut watched = Box::pin(within(
            Instant::now() + Duration::from_millis(20),
            std::future::pending::<()>(),
        ));
        assert!(watched.as_mut().poll(&mut Context::from_waker(&waker)).is_pending());
        let deadline = Instant::now() + Duration::from_secs(2);
        while meddling.0.load(Ordering::SeqCst) == 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let woken = meddling.0.load(Ordering::SeqCst);
        if woken == 0 {
            // Its drop would wait for the deadlocked watchdog's lock: fail instead of hanging.
            std::mem::forget(watched);
        }
        assert_eq!(woken, 1, "the watchdog deadlocked in a wake");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn operations_due_in_any_order_each_end_at_their_own_deadline() {
        let started = Instant::now();
        // Registered latest first: each earlier deadline must wake the sleeping thread.
        let waits = [400, 200, 100, 300].map(|millis| {
            tokio::spawn(async move {
                let deadline = started + Duration::from_millis(millis);
                let ended = within(deadline, std::future::pending::<()>()).await;
                (millis, ended.is_err(), started.elapsed())
            })
        });
        for wait in waits {
            let (millis, elapsed, took) = wait.await.unwrap();
            assert!(elapsed);
            let due = Duration::from_millis(millis);
            // Slack for a loaded machine; each deadline is 100 ms from the next.
            assert!(took >= due && took < due + Duration::from_millis(300), "{millis}: {took:?}");
        }
    }
}
