//! A claimed operation's whole life, for every front door: a task of its own, the recovery
//! hook when one is due, the operation with its lease renewed, a failure or a panic that
//! releases the key, and the door's settle; then the answer back to the caller.

use std::future::Future;

use tokio::sync::oneshot;

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
    /// The task was dropped unfinished: the runtime is shutting down.
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
    /// Runs `operation` for `holder` in a task of its own, and waits for the door's answer.
    ///
    /// In the task: when `recovery` is given, the hook is asked first (within its timeout);
    /// an outcome it knows is given to `recovery.happened` and the operation does not run; a
    /// failed hook ends as [`Ended::Refused`]. Then the operation runs with its lease renewed;
    /// `Ok` goes to `settle`, which stores (or releases) and [`send`](Answer::send)s the
    /// answer; `Err` releases the key and ends as [`Ended::Failed`]; a panic releases the key
    /// and is resumed here. A caller that goes away does not cancel the task.
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
        let (sender, ended) = oneshot::channel();
        let answer = Answer(sender);
        self.spawn(async move {
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
        match ended.await {
            Ok(Message::Answered(answer)) => Ended::Answered(answer),
            Ok(Message::Failed(error)) => Ended::Failed(error),
            Ok(Message::Refused) => Ended::Refused,
            Ok(Message::Mismatch) => Ended::Mismatch,
            Ok(Message::Panicked(panic)) => std::panic::resume_unwind(panic),
            Err(_) => Ended::Cancelled,
        }
    }

    /// Spawns a claimed operation's task: on the configured `TaskTracker`, or with
    /// `tokio::spawn`. The task is detached: a caller that goes away does not cancel it.
    pub(crate) fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        // Boxed here, so that the caller's future does not carry the task's state inline, and
        // before it is wrapped, so that its kilobytes are copied once; in the caller's span, so
        // that its events nest where the request's do.
        let task = tracing::Instrument::in_current_span(Box::pin(task));
        match &self.settings.tasks {
            Some(tracker) => drop(tracker.spawn(task)),
            None => drop(tokio::spawn(task)),
        }
    }
}
