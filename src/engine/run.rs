//! A claimed operation's whole life, for every front door: run by its caller, and in a task
//! of its own once the caller goes away; the recovery hook when one is due, the operation with
//! its lease renewed, a failure or a panic that releases the key, and the door's settle; then
//! the answer back to the caller.

use std::{
    future::Future,
    panic::AssertUnwindSafe,
    pin::Pin,
    task::{Context, Poll},
};

use tokio::sync::oneshot;
use tokio_util::task::{TaskTracker, task_tracker::TaskTrackerToken};
use tracing::{Instrument as _, instrument::Instrumented};

use super::{Engine, Holder, Panic, Recovery};
use crate::{
    recovery::{BoxError, Recovered},
    store::Store,
};

/// Where a claimed operation's task sends the caller its answer: once, by value.
#[derive(Debug)]
pub(crate) struct Answer<A, E>(oneshot::Sender<Message<A, E>>);

impl<A, E> Answer<A, E> {
    /// Answers the caller with the door's answer.
    pub(crate) fn send(self, answer: A) {
        self.end(Message::Answered(answer));
    }

    /// Resumes `panic` in the caller, as if the layer were not there (its key is released).
    pub(crate) fn resume(self, panic: Panic) {
        self.end(Message::Panicked(panic));
    }

    fn end(self, message: Message<A, E>) {
        // Err only when the caller is gone with its runtime: nobody is left to answer.
        let _ = self.0.send(message);
    }
}

/// What the task tells the caller.
#[derive(Debug)]
enum Message<A, E> {
    Answered(A),
    Failed(E),
    Panicked(Panic),
    Refused,
    Mismatch,
}

/// How a claimed operation ended, for the door to turn into its own answer. A panic is not
/// among them: it is resumed in the caller.
#[derive(Debug)]
pub(crate) enum Ended<A, E> {
    /// The door answered (the operation's outcome, a recovered one, or the door's own).
    Answered(A),
    /// The operation failed; its key was released, so a retry runs it again.
    Failed(E),
    /// The recovery hook failed and the operation did not run; the key was handed back.
    Refused,
    /// The recovery hook found another request's outcome under the key; nothing ran, and the
    /// claim was released.
    Mismatch,
    /// The work ended without an answer: it panicked outside the operation (whose own panic
    /// is resumed in the caller).
    Cancelled,
}

/// What a door does when its recovery hook says the operation happened: store `R` and answer
/// it, as [`Holder::complete`] lets it.
pub(crate) struct Recovering<L, H> {
    /// The hook's lookup, not yet started; it runs in the operation's task.
    pub(crate) lookup: L,
    /// Stores the recovered outcome and answers it.
    pub(crate) happened: H,
}

impl<St: Store> Engine<St> {
    /// Runs `operation` for `holder`, and waits for the door's answer.
    ///
    /// The work runs in the caller's task while the caller waits for its answer, and in a
    /// task of its own once the caller goes away (or got its answer with work left: a
    /// stored response's retries, a streamed body): a caller that goes away never cancels
    /// it. When `recovery` is given, the hook is asked first (within its timeout); an outcome
    /// it knows is given to `recovery.happened` and the operation does not run; a failed hook
    /// ends as [`Ended::Refused`]. Then the operation runs with its lease renewed; `Ok` goes
    /// to `settle`, which stores (or releases) and [`send`](Answer::send)s the answer; `Err`
    /// releases the key and ends as [`Ended::Failed`]; a panic releases the key and is
    /// resumed here.
    pub(crate) async fn run_claimed<T, E, A, R, L, H, HFut, S, SFut>(
        &self,
        holder: Holder<St>,
        recovery: Option<Recovering<L, H>>,
        operation: impl Future<Output = Result<T, E>> + Send + 'static,
        settle: S,
    ) -> Ended<A, E>
    where
        T: Send + 'static,
        E: Send + 'static,
        A: Send + 'static,
        R: Send + 'static,
        L: Future<Output = Result<Recovered<R>, BoxError>> + Send + 'static,
        H: FnOnce(Holder<St>, R, Answer<A, E>) -> HFut + Send + 'static,
        HFut: Future<Output = ()> + Send + 'static,
        S: FnOnce(Holder<St>, T, Answer<A, E>) -> SFut + Send + 'static,
        SFut: Future<Output = ()> + Send + 'static,
    {
        let (sender, mut ended) = oneshot::channel();
        let answer = Answer(sender);
        let spawned_renewals = holder.spawned_renewals();
        let mut work = self.detachable(async move {
            let holder = match recovery {
                None => holder,
                Some(Recovering { lookup, happened }) => match holder.recover(lookup).await {
                    Recovery::Run(holder) => holder,
                    Recovery::Happened(holder, outcome) => {
                        return happened(holder, outcome, answer).await;
                    }
                    Recovery::Refused => return answer.end(Message::Refused),
                    Recovery::Mismatch => return answer.end(Message::Mismatch),
                },
            };
            match holder.run(operation).await {
                Ok((holder, Ok(output))) => settle(holder, output, answer).await,
                Ok((holder, Err(error))) => {
                    holder.release("the operation failed").await;
                    answer.end(Message::Failed(error));
                }
                Err(panic) => answer.resume(panic),
            }
        });
        if spawned_renewals {
            // The renewals' task this claim just spawned waits in this worker's LIFO slot,
            // which no other worker steals: it runs first, so that the work, which may block
            // the thread past the lease, does not hold it back. Once per engine's renewals.
            tokio::task::yield_now().await;
        }
        let message = std::future::poll_fn(|cx| {
            work.poll_attached(cx);
            Pin::new(&mut ended).poll(cx)
        })
        .await;
        // What is left of the work, if anything, goes on in a task of its own.
        drop(work);
        match message {
            Ok(Message::Answered(answer)) => Ended::Answered(answer),
            Ok(Message::Failed(error)) => Ended::Failed(error),
            Ok(Message::Refused) => Ended::Refused,
            Ok(Message::Mismatch) => Ended::Mismatch,
            Ok(Message::Panicked(panic)) => std::panic::resume_unwind(panic),
            Err(_) => Ended::Cancelled,
        }
    }

    /// A claimed operation's work, run in its caller's task until it is detached: counted on
    /// the configured `TaskTracker`, and in the caller's span.
    fn detachable(&self, work: impl Future<Output = ()> + Send + 'static) -> Detachable {
        // Boxed, so that the caller's future does not carry the work's kilobytes inline and a
        // detached work moves without a copy; boxed before it is wrapped, so that they are
        // copied once. In the caller's span, so that its events nest where the request's do,
        // detached or not.
        let work: Pin<Box<dyn Future<Output = ()> + Send>> = Box::pin(work);
        Detachable {
            work: Some(work.in_current_span()),
            tracked: self.settings.tasks.as_ref().map(TaskTracker::token),
        }
    }
}

/// A claimed operation's work, polled by its caller while it waits for the answer, and spawned
/// when dropped unfinished: a caller that goes away does not cancel it. Run inline, the common
/// request (its answer sent when its work ends) costs no task, no wake-up of another task
/// and no hop between them.
struct Detachable {
    work: Option<Instrumented<Pin<Box<dyn Future<Output = ()> + Send>>>>,
    /// Counts the work on the configured `TaskTracker` until it ends.
    tracked: Option<TaskTrackerToken>,
}

impl Detachable {
    /// Polls the work, while it is not done. A panic of its own (the operation's is caught
    /// and resumed through the answer) ends it, as a spawned task's would: its answer's sender
    /// is dropped, and the caller ends as [`Ended::Cancelled`].
    fn poll_attached(&mut self, cx: &mut Context<'_>) {
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
