//! A claimed operation's work, run by its caller and spawned when the caller goes away.

use std::{
    future::Future,
    panic::AssertUnwindSafe,
    pin::Pin,
    task::{Context, Poll},
};

use tokio_util::task::task_tracker::TaskTrackerToken;
use tracing::instrument::Instrumented;

/// A claimed operation's work, polled by its caller while it waits for the answer, and spawned
/// when dropped unfinished: a caller that goes away does not cancel it. Run inline, the common
/// request (its answer sent when its work ends) costs no task, no wake-up of another task
/// and no hop between them.
pub(super) struct Detachable {
    pub(super) work: Option<Instrumented<Pin<Box<dyn Future<Output = ()> + Send>>>>,
    /// Counts the work on the configured `TaskTracker` until it ends.
    pub(super) tracked: Option<TaskTrackerToken>,
}

impl Detachable {
    /// Polls the work, while it is not done. A panic of its own (the operation's is caught
    /// and resumed through the answer) ends it, as a spawned task's would: its answer's sender
    /// is dropped, and the caller ends as [`Ended::Cancelled`].
    pub(super) fn poll_attached(&mut self, cx: &mut Context<'_>) {
        if let Some(work) = &mut self.work {
            let polled =
                std::panic::catch_unwind(AssertUnwindSafe(|| Pin::new(&mut *work).poll(cx)));
            if !matches!(polled, Ok(Poll::Pending)) {
                self.work = None;
            }
        }
    }
}

impl Drop for Detachable {
    fn drop(&mut self) {
        let Some(work) = self.work.take() else { return };
        let tracked = self.tracked.take();
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(async move {
                work.await;
                drop(tracked);
            })),
            // Dropped outside any runtime (its own shut down): nothing can run the work, and
            // dropping it releases what it holds, as a task cancelled at shutdown would.
            Err(_) => drop(work),
        }
    }
}
