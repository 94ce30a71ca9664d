//! A claimed operation's whole life, for every front door: run by its caller, and in a task
//! of its own once the caller goes away; the recovery hook when one is due, the operation with
//! its lease renewed, a failure or a panic that releases the key, and the door's settle; then
//! the answer back to the caller.

mod detachable;

use super::observe::Label;
use std::{future::Future, panic::AssertUnwindSafe, pin::Pin, time::Duration};

use tokio::sync::oneshot;
use tokio_util::task::TaskTracker;
use tracing::Instrument as _;

use bytes::Bytes;
use futures_util::FutureExt as _;

use self::detachable::Detachable;
use super::{
    Asked, Claimed, Engine, Holder, Panic,
    door::{Door, Settlement, Streaming},
};
use crate::{
    context::IdempotencyContext,
    hashing::Named,
    recovery::{BoxError, Recovered},
    store::{Commit, Store, StoreError},
};

/// Where a claimed operation's task sends the caller its answer: once, by value.
#[derive(Debug)]
struct Answer<A, E>(oneshot::Sender<Message<A, E>>);

impl<A, E> Answer<A, E> {
    /// Answers the caller with the door's answer.
    fn send(self, answer: A) {
        self.end(Message::Answered(answer));
    }

    /// Resumes `panic` in the caller, as if the layer were not there (its key is released).
    fn resume(self, panic: Panic) {
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

/// Who a claim is for: the record key, the fingerprint, the metrics label and the scope.
pub(crate) struct Claiming {
    /// The names in the store ([`Engine::name`]).
    pub(crate) named: Named,
    /// The metrics label: a route or a scope, never a key.
    pub(crate) route: Label,
    /// The scope the operation's context names.
    pub(crate) scope: Vec<u8>,
    /// When a wait for the original must end, whatever the engine's wait: the caller's own
    /// deadline, less the time its answer takes (a gRPC call's `grpc-timeout`).
    pub(crate) wait_until: Option<tokio::time::Instant>,
}

/// What a door starts once its claim is won: the operation, and the recovery hook's lookup
/// when one is due. Neither has run yet; both run in the operation's task.
pub(crate) struct Start<F, L> {
    pub(crate) operation: F,
    pub(crate) lookup: Option<L>,
}

/// How [`Engine::operate`] ended.
#[derive(Debug)]
pub(crate) enum Operated<R, A, E> {
    /// The claim decided without running the operation: the door's request back, to answer.
    Decided(R, Decided),
    /// The operation was claimed, and ended so.
    Ended(Ended<A, E>),
}

/// What a claim decided without running the operation.
#[derive(Debug)]
pub(crate) enum Decided {
    /// The same request completed: its stored outcome, to replay.
    Replay(Bytes),
    /// The same request runs elsewhere (and did not settle within the wait, when waiting is
    /// on): ask again after `retry_after`.
    InProgress { retry_after: Duration },
    /// The store failed, or holds a record this crate cannot read: nothing ran.
    Failed(StoreError),
}

impl<St: Store> Engine<St> {
    /// Claims the key of `claiming`, and, when won, runs the door's operation from claim to
    /// settle; waits for the door's answer.
    ///
    /// `start` gets the door's `request`, the operation's context and whether the recovery
    /// hook is due, and builds the operation (and the hook's lookup); it is called only when
    /// the claim is won. Otherwise the request comes back with what the claim decided.
    ///
    /// The work runs in the caller's task while the caller waits for its answer, and in a
    /// task of its own once the caller goes away (or got its answer with work left: a stored
    /// response's retries, a streamed body): a caller that goes away never cancels it. The
    /// hook's lookup, when given, is asked first (within its timeout); an outcome it knows is
    /// stored as [`Door::recovered`] says and the operation does not run; a failed hook ends
    /// as [`Ended::Refused`]. Then the operation runs with its lease renewed. An outcome it
    /// committed in a store's transaction is left as committed ([`Door::committed`]); one
    /// whose transaction did not commit releases the key; any other is settled as
    /// [`Door::settle`] says. `Err` releases the key and ends as [`Ended::Failed`]; a panic
    /// releases the key and is resumed here.
    pub(crate) async fn operate<D, R, E, F, L>(
        &self,
        door: D,
        claiming: Claiming,
        request: R,
        start: impl FnOnce(R, IdempotencyContext, bool) -> Start<F, L>,
    ) -> Operated<R, D::Answer, E>
    where
        D: Door,
        E: Send + 'static,
        F: Future<Output = Result<D::Output, E>> + Send + 'static,
        L: Future<Output = Result<Recovered<D::Recovered>, BoxError>> + Send + 'static,
    {
        let Claiming { named, route, scope, wait_until } = claiming;
        let claimed = self.claim(named, route, wait_until).await;
        door.claimed(outcome_name(&claimed));
        let holder = match claimed {
            Ok(Claimed::Run(holder)) => holder,
            Ok(Claimed::Replay(stored)) => {
                return Operated::Decided(request, Decided::Replay(stored));
            }
            Ok(Claimed::InProgress { retry_after }) => {
                return Operated::Decided(request, Decided::InProgress { retry_after });
            }
            Ok(Claimed::Mismatch) => return Operated::Ended(Ended::Mismatch),
            Err(error) => return Operated::Decided(request, Decided::Failed(error)),
        };
        let durable = door.durable();
        let due = holder.needs_recovery(durable.is_some());
        let context = holder.context(scope, door.encoding(), durable);
        let Start { operation, lookup } = start(request, context, due);
        Operated::Ended(self.run_claimed(holder, door, lookup, operation).await)
    }

    /// Runs `operation` for `holder` (after the hook's `lookup`, when given) and settles it as
    /// `door` says, in the caller's task and in one of its own once the caller goes away.
    async fn run_claimed<D, E, L>(
        &self,
        holder: Holder<St>,
        door: D,
        lookup: Option<L>,
        operation: impl Future<Output = Result<D::Output, E>> + Send + 'static,
    ) -> Ended<D::Answer, E>
    where
        D: Door,
        E: Send + 'static,
        L: Future<Output = Result<Recovered<D::Recovered>, BoxError>> + Send + 'static,
    {
        let (sender, mut ended) = oneshot::channel();
        let answer = Answer(sender);
        let spawned_renewals = holder.spawned_renewals();
        let mut work = self.detachable(async move {
            let holder = match lookup {
                None => holder,
                Some(lookup) => match holder.recover(lookup).await {
                    Asked::Run(holder) => holder,
                    Asked::Happened(holder, outcome) => {
                        let held = holder.held();
                        let recovered = door.recovered(outcome, &held);
                        let recovered = AssertUnwindSafe(recovered).catch_unwind().await;
                        let settlement = recovered.unwrap_or_else(Settlement::Panicked);
                        return settle(holder, settlement, answer).await;
                    }
                    Asked::Refused => return answer.end(Message::Refused),
                    Asked::Mismatch => return answer.end(Message::Mismatch),
                },
            };
            match holder.run(operation).await {
                Ok((holder, Ok(output))) => settle_output(holder, &door, output, answer).await,
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

/// Settles an operation's output: as its store transaction left it, when it ran one; as the
/// door says otherwise.
async fn settle_output<St: Store, D: Door, E>(
    holder: Holder<St>,
    door: &D,
    output: D::Output,
    answer: Answer<D::Answer, E>,
) {
    // A transaction the operation spawned and did not await is waited for, as long as it runs;
    // where one may still begin (the store, or the door's table beside it, commits in
    // transactions), so is a context the operation left alive, briefly: a task spawned with it
    // begins its transaction on its first poll, and a context kept for other work (a log, a
    // stream's body) holds the answer back no longer.
    let patience = match holder.commits_in_transactions() || door.durable().is_some() {
        true => holder.lease_duration().min(CONTEXT_PATIENCE),
        false => Duration::ZERO,
    };
    match holder.commit_slot().clone().settled(patience).await {
        // Committed in the record store's transaction: the engine writes nothing.
        Some(Commit::Committed(committed)) => {
            let answered = door.committed(output, committed, &holder.held()).await;
            holder.settled_in_transaction(move || answer.send(answered)).await;
        }
        // Committed beside the record store: stored there too, as the outcome answered.
        Some(Commit::CommittedBeside(committed)) => {
            let answered = door.committed(output, committed.clone(), &holder.held()).await;
            holder.complete(committed, move || answer.send(answered)).await;
        }
        // A fenced delete, which a committed record refuses: a retry learns what committed.
        Some(Commit::RolledBack | Commit::Unknown) => {
            holder.release("the operation's transaction did not commit its outcome").await;
            answer.send(door.uncommitted(output));
        }
        None => {
            // A door's settle runs the user's code too (a store policy): its panic releases the
            // key and is resumed in the caller, as the operation's is.
            let held = holder.held();
            let settled = AssertUnwindSafe(door.settle(output, &held)).catch_unwind().await;
            let settlement = settled.unwrap_or_else(Settlement::Panicked);
            settle(holder, settlement, answer).await;
        }
    }
}

/// How long a settle waits, at most, for a context its operation left alive to begin a
/// transaction (or be dropped): after it, a transaction that begins is refused.
const CONTEXT_PATIENCE: Duration = Duration::from_millis(250);

/// Does what `settlement` says: writes the store through `holder`, and answers.
async fn settle<St: Store, A, E>(
    holder: Holder<St>,
    settlement: Settlement<A>,
    answer: Answer<A, E>,
) {
    match settlement {
        Settlement::Store(outcome, answered) => {
            holder.complete(outcome, move || answer.send(answered)).await;
        }
        Settlement::Release(why, answered) => {
            holder.release(why).await;
            answer.send(answered);
        }
        Settlement::TooLarge { record, why, answer: answered } => {
            holder.complete_too_large(record, why, move || answer.send(answered)).await;
        }
        Settlement::Streamed(answered, rest) => {
            answer.send(answered);
            // The lease is renewed while the stream runs, as while the operation ran.
            let (holder, streamed) = match holder.run(rest).await {
                Ok(streamed) => streamed,
                Err(_panic) => {
                    return tracing::error!(
                        "idempotency: the outcome's stream panicked; key released"
                    );
                }
            };
            match streamed.ended {
                Streaming::Stored(outcome) => holder.complete(outcome, || {}).await,
                Streaming::OverLimit { record, why, forward } => {
                    // The caller gets the whole stream first: the settle does not hold it up.
                    let settled = holder.complete_too_large(record, why, || {});
                    futures_util::future::join(forward, settled).await;
                }
                Streaming::Failed(error) => {
                    tracing::error!(key_hash = holder.key().hash(), %error, "idempotency: the outcome's stream failed");
                    holder.release("the response body failed").await;
                }
            }
            drop(streamed.open);
        }
        Settlement::Panicked(panic) => {
            holder.release("the outcome's encoding panicked").await;
            answer.resume(panic);
        }
    }
}

/// The claim's outcome, for the door's span.
fn outcome_name<St: Store>(claimed: &Result<Claimed<St>, StoreError>) -> &'static str {
    match claimed {
        Ok(Claimed::Run(holder)) if holder.taken_over() => "taken_over",
        Ok(Claimed::Run(_)) => "claimed",
        Ok(Claimed::Replay(_)) => "replayed",
        Ok(Claimed::InProgress { .. }) => "in_progress",
        Ok(Claimed::Mismatch) => "mismatch",
        Err(error) if error.is_unavailable() => "store_unavailable",
        Err(_) => "corrupt_record",
    }
}
