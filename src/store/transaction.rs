//! The transactional path's door-neutral parts: [`Committable`] (what an operation run in a
//! store-owned transaction returns), [`TransactionError`], and the slot through which the
//! store tells the claim's holder and its front door what became of the commit.

// Only a store that shares the caller's database runs a transaction (`PostgresStore`): without
// it, the transaction's states are never entered.
#![cfg_attr(not(feature = "postgres"), allow(dead_code))]

use std::{
    fmt,
    future::Future,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use bytes::Bytes;

use super::{OwnerToken, StoreError};
use crate::{context::IdempotencyContext, fingerprint::Fingerprint, key::RecordKey};

/// What an operation run in a store's transaction returns (`PostgresStore::transaction`,
/// `DurableOutcomes::transaction`): its outcome, which the store encodes as the operation's
/// front door stores it and writes in the same transaction as the side effect.
///
/// Implemented for `axum::response::Response` (the HTTP door: the response as the layer
/// stores it, checked by the layer's store policy and limits) and for `axum::Json<T>` (the
/// consumer door: the value `T` as it stores results; the HTTP door: a 200 JSON response).
/// The context the outcome is committed for names the door; a response committed for the
/// consumer door is refused ([`TransactionError::NotStored`]).
pub trait Committable: Sized + Send + 'static {
    /// The outcome as the context's front door stores it, and the value to hand back to the
    /// operation's caller (the same outcome).
    #[doc(hidden)]
    fn encode(
        self,
        context: &IdempotencyContext,
    ) -> impl Future<Output = Result<(Bytes, Self), EncodeError>> + Send;
}

/// Why a store's transaction ([`PostgresStore::transaction`](crate::store::PostgresStore),
/// [`DurableOutcomes::transaction`](crate::durable::DurableOutcomes)) did not commit, or does not
/// know whether it did. Every variant but [`CommitUnknown`](Self::CommitUnknown) means the
/// transaction was rolled back: neither the side effect nor the outcome was written.
///
/// Answer it as the operation's failure. Do not run the transaction again with the same
/// context after [`CommitUnknown`](Self::CommitUnknown): the store refuses it
/// ([`Misuse`](Self::Misuse)), since the first may have committed. The next claim of the key
/// finds the truth: the committed outcome, replayed, or nothing, and the operation runs.
#[derive(Debug)]
#[non_exhaustive]
pub enum TransactionError<E> {
    /// The operation returned this error: rolled back.
    Operation(E),
    /// The store refused or failed before the commit (it could not begin the transaction, the
    /// database failed, or [`StoreError::FencedOut`]: the context's claim is not this store's
    /// live claim, because its lease was taken over or it was claimed in another store):
    /// rolled back.
    Store(StoreError),
    /// The front door does not store this outcome (a response its store policy does not
    /// keep or marked `layer::ReleaseKey`, a response over the stored limits, a value serde
    /// cannot encode, a response committed for the consumer door): rolled back, its side
    /// effect with it (committed with its key released, it would run again on the retry).
    /// Why, as a sentence ("the outcome is not stored: the store policy does not keep it").
    NotStored(String),
    /// The commit was sent, and its answer was lost (the connection broke, or the command
    /// timeout ran out): the transaction committed, or not. Nothing is retried; the key stays
    /// with the claim until the database settles the transaction, and the next claim
    /// answers from what committed.
    CommitUnknown(StoreError),
    /// The call was refused before anything was written: the context is not one a front door
    /// gave to an operation it runs, or this claim's transaction committed already, is
    /// running (a nested call), or ended with its fate unknown. The reason.
    Misuse(&'static str),
}

impl<E> TransactionError<E> {
    /// Whether the transaction may have committed: only
    /// [`CommitUnknown`](Self::CommitUnknown).
    #[must_use]
    pub fn may_have_committed(&self) -> bool {
        matches!(self, Self::CommitUnknown(_))
    }
}

/// A [`TransactionError`] as every front door answers it: the handler's fault (never retried
/// by the client to any effect) or the store's (the retry learns what committed).
#[derive(Debug)]
pub(crate) enum Failure {
    /// The operation's own error (never shown: `None`), an outcome the door does not store or
    /// a misuse: the reason.
    Handler(Option<String>),
    /// Rolled back by the store, or the commit's answer lost: what to tell the client.
    Store(String),
}

impl<E: fmt::Display> TransactionError<E> {
    /// Logs it, once, and says how a door answers it.
    pub(crate) fn failure(self) -> Failure {
        match self {
            Self::Operation(error) => {
                tracing::error!(%error, "idempotency: the handler's transaction failed");
                Failure::Handler(None)
            }
            Self::Store(error) => {
                tracing::error!(%error, "idempotency: the handler's transaction was rolled back");
                Failure::Store(format!("rolled back: {error}"))
            }
            Self::CommitUnknown(error) => {
                tracing::error!(%error, "idempotency: the commit's answer was lost");
                Failure::Store("the commit's answer was lost: retry to learn its outcome".into())
            }
            Self::NotStored(reason) => {
                tracing::error!(reason, "idempotency: the handler's outcome is not stored");
                Failure::Handler(Some(reason))
            }
            Self::Misuse(reason) => {
                tracing::error!(reason, "idempotency: the handler's transaction was refused");
                Failure::Handler(Some(reason.to_owned()))
            }
        }
    }
}

impl<E: fmt::Display> fmt::Display for TransactionError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Operation(error) => write!(f, "the operation failed: {error}"),
            Self::Store(error) => write!(f, "rolled back: {error}"),
            Self::NotStored(reason) => write!(f, "rolled back: {reason}"),
            Self::CommitUnknown(error) => {
                write!(f, "the commit's answer was lost, it may have committed: {error}")
            }
            Self::Misuse(reason) => write!(f, "refused: {reason}"),
        }
    }
}

/// An error whatever the operation's error type (`Box<dyn Error + Send + Sync>` included, which
/// is no `Error` itself), so that `?` carries it on; the store's error is its source.
impl<E: fmt::Debug + fmt::Display> std::error::Error for TransactionError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Store(error) | Self::CommitUnknown(error) => Some(error),
            Self::Operation(_) | Self::NotStored(_) | Self::Misuse(_) => None,
        }
    }
}

/// An operation's outcome, encoded as its front door stores it, with what a store needs to
/// write it for the operation's own claim: the key, the owner token that fences it, the
/// fingerprint and the retention. Made by the store's transaction, never by a caller.
pub(crate) struct EncodedOutcome {
    pub(crate) key: RecordKey,
    pub(crate) owner: OwnerToken,
    pub(crate) fingerprint: Fingerprint,
    /// The outcome in clear, as the door answers it.
    pub(crate) outcome: Bytes,
    /// The outcome as the store keeps it: encrypted when the door encrypts at rest.
    pub(crate) stored: Bytes,
    pub(crate) retention: Duration,
}

impl fmt::Debug for EncodedOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EncodedOutcome")
            .field("key_hash", &self.key.hash())
            .field("outcome_len", &self.outcome.len())
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}

/// What became of the transaction of a claim's operation, shared by the store that runs it,
/// the claim's holder (whose lease renewal then stops quietly: the record it finds settled
/// was settled by its own operation) and the front door.
#[derive(Debug, Default)]
pub(crate) struct CommitSlot {
    state: Mutex<SlotState>,
    /// Told of every change of the state: the settle waits for a transaction to end, or for
    /// the operation's context to be dropped.
    changed: tokio::sync::Notify,
    /// The holder began to complete the record itself.
    completing: std::sync::atomic::AtomicBool,
}

#[derive(Debug, Default)]
struct SlotState {
    stage: Stage,
    /// The operation's context (a clone of it) is alive: a transaction may still begin.
    context_alive: bool,
    /// The door settles: no transaction begins any more.
    closed: bool,
}

/// Where the claim's transaction is.
#[derive(Debug, Default, Clone)]
enum Stage {
    /// No transaction was begun.
    #[default]
    None,
    /// A transaction runs; `in_record_store` when it writes the record itself (the record
    /// store's own transaction, `PostgresStore`).
    Running { in_record_store: bool },
    /// Every transaction begun was rolled back: a new one may begin.
    RolledBack,
    /// Ended: committed, or its fate unknown.
    Ended(Commit),
}

/// What became of the transaction an operation committed its outcome in, as its front door
/// learns it.
#[derive(Debug, Clone)]
pub(crate) enum Commit {
    /// The transaction committed, and the record holds this outcome (the record store shares
    /// the caller's database: `PostgresStore`). The door writes nothing.
    Committed(Bytes),
    /// The transaction committed this outcome to a durable table beside the record store
    /// (`DurableOutcomes`, beside Redis): the door stores it in the record store too, as the
    /// outcome it answers, and a takeover or a lost record is answered from the table.
    CommittedBeside(Bytes),
    /// Every transaction begun was rolled back: the door releases its claim, whatever the
    /// operation returned.
    RolledBack,
    /// The commit's answer was lost: committed or not. The door releases its claim with a
    /// fenced delete: with `PostgresStore` it waits for the transaction's row lock, and a
    /// committed record refuses it; with `DurableOutcomes` the retry's recovery reads the
    /// table, and a second run's commit is refused by the table's key while the first's stands.
    Unknown,
}

impl CommitSlot {
    /// Whether the record may have been settled by its own holder: the operation began a
    /// transaction, or the holder began to complete it. From then, a renewal that finds the
    /// record settled is not a lost lease.
    pub(crate) fn begun(&self) -> bool {
        self.completing.load(std::sync::atomic::Ordering::SeqCst)
            || !matches!(self.lock().stage, Stage::None)
    }

    /// Whether a transaction that writes the record itself runs now: the lease is not renewed
    /// meanwhile, since a renewal's write of the record would make a REPEATABLE READ or
    /// SERIALIZABLE transaction's own write of it fail (a concurrent update); the store holds
    /// the key by a lock of the transaction's session instead.
    pub(crate) fn holds_record(&self) -> bool {
        matches!(self.lock().stage, Stage::Running { in_record_store: true })
    }

    /// Says that the holder begins to complete the record.
    pub(crate) fn completing(&self) {
        self.completing.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Says that the operation's context is alive (`true`, when it is made) or was dropped,
    /// every clone of it.
    pub(crate) fn context_alive(&self, alive: bool) {
        self.lock().context_alive = alive;
        self.changed.notify_waiters();
    }

    /// What became of the operation's transactions, once the door may settle: when the
    /// operation returned with a transaction of its claim still running (spawned, and not
    /// awaited), once that transaction ended; while a clone of its context is alive (a
    /// transaction may be about to begin in a task the operation spawned), once it was dropped
    /// or after `patience`. From then no transaction of the claim begins
    /// ([`start`](Self::start) refuses it), so that what the door answers, what it stores and
    /// what the database committed agree.
    pub(crate) async fn settled(&self, patience: Duration) -> Option<Commit> {
        let now = tokio::time::Instant::now().into_std();
        let give_up = tokio::time::Instant::from_std(super::later(now, patience));
        loop {
            let changed = self.changed.notified();
            let mut changed = std::pin::pin!(changed);
            changed.as_mut().enable();
            let waiting_for_context = {
                let mut state = self.lock();
                match state.stage {
                    Stage::Running { .. } => false,
                    _ if state.context_alive && tokio::time::Instant::now() < give_up => true,
                    _ => {
                        state.closed = true;
                        return state.stage.outcome();
                    }
                }
            };
            if waiting_for_context {
                let _ = tokio::time::timeout_at(give_up, changed).await;
            } else {
                changed.await;
            }
        }
    }

    /// What became of the operation's transactions, if it began one.
    #[cfg(test)]
    pub(crate) fn outcome(&self) -> Option<Commit> {
        self.lock().stage.outcome()
    }

    /// Begins a transaction, unless one runs or ended in a commit (known or not), or the door
    /// settles already; `in_record_store` when the transaction writes the record itself.
    pub(crate) fn start(&self, in_record_store: bool) -> Result<(), &'static str> {
        let mut state = self.lock();
        if state.closed {
            return Err("the operation returned before this transaction began (a transaction \
                        spawned and not awaited, begun after its door settled): await the \
                        transaction in the operation");
        }
        match &state.stage {
            Stage::None | Stage::RolledBack => {
                state.stage = Stage::Running { in_record_store };
                Ok(())
            }
            Stage::Running { .. } => Err("a transaction of this claim is running (a nested call)"),
            Stage::Ended(Commit::Unknown) => {
                Err("this claim's commit ended with its fate unknown: it may have committed")
            }
            Stage::Ended(_) => Err("this claim's outcome was committed already"),
        }
    }

    /// Ends the running transaction.
    pub(crate) fn end(&self, commit: Commit) {
        self.lock().stage = match commit {
            Commit::RolledBack => Stage::RolledBack,
            commit => Stage::Ended(commit),
        };
        self.changed.notify_waiters();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Stage {
    fn outcome(&self) -> Option<Commit> {
        match self {
            Self::None => None,
            Self::RolledBack => Some(Commit::RolledBack),
            // A transaction still running (spawned and left, past the settle's patience): its
            // fate is not known here.
            Self::Running { .. } => Some(Commit::Unknown),
            Self::Ended(commit) => Some(commit.clone()),
        }
    }
}

/// Ends a claim's running transaction when dropped: rolled back unless told otherwise (an
/// operation cancelled mid-way drops its transaction, which sqlx rolls back), unknown once
/// the commit was sent.
pub(crate) struct Running {
    slot: Arc<CommitSlot>,
    ending: Option<Commit>,
}

impl Running {
    pub(crate) fn new(slot: Arc<CommitSlot>) -> Self {
        Self { slot, ending: Some(Commit::RolledBack) }
    }

    /// From now, a drop leaves the commit's fate unknown.
    pub(crate) fn committing(&mut self) {
        self.ending = Some(Commit::Unknown);
    }

    /// Ends the transaction with `commit`.
    pub(crate) fn end_with(&mut self, commit: Commit) {
        self.ending = None;
        self.slot.end(commit);
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(commit) = self.ending.take() {
            self.slot.end(commit);
        }
    }
}

impl fmt::Debug for Running {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Running").finish_non_exhaustive()
    }
}

/// Why a front door made no stored outcome of a value.
#[derive(Debug)]
#[non_exhaustive]
pub enum EncodeError {
    /// serde could not encode the value, or it holds NaN or an infinity (which JSON would
    /// store as `null`): the reason.
    Unencodable(String),
    /// The front door does not store this outcome (the HTTP door: a status its store policy
    /// does not keep, a 405, or headers or a body over the stored limits; the body failed;
    /// the consumer door: a response): the reason.
    NotStored(&'static str),
    /// The context is not one a front door gave to an operation it runs.
    NotClaimed,
}

impl fmt::Display for EncodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unencodable(reason) => write!(f, "the result cannot be stored: {reason}"),
            Self::NotStored(reason) => write!(f, "the outcome is not stored: {reason}"),
            Self::NotClaimed => f.write_str("the context is not one a front door gave"),
        }
    }
}

impl std::error::Error for EncodeError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_commits_once_and_begins_again_only_after_a_roll_back() {
        let slot = Arc::new(CommitSlot::default());
        assert!(slot.outcome().is_none() && !slot.begun());
        slot.start(true).unwrap();
        assert!(slot.holds_record());
        assert!(slot.start(true).is_err(), "a nested transaction began");
        drop(Running::new(slot.clone()));
        assert!(matches!(slot.outcome(), Some(Commit::RolledBack)));
        assert!(!slot.holds_record());
        slot.start(false).unwrap();
        assert!(!slot.holds_record());
        let mut running = Running::new(slot.clone());
        running.committing();
        drop(running);
        assert!(matches!(slot.outcome(), Some(Commit::Unknown)));
        assert!(slot.start(true).is_err(), "a transaction began after an unknown commit");
        let slot = Arc::new(CommitSlot::default());
        slot.start(true).unwrap();
        Running::new(slot.clone()).end_with(Commit::Committed(Bytes::from_static(b"r")));
        assert!(slot.start(true).is_err(), "a transaction began after a commit");
        assert!(matches!(slot.outcome(), Some(Commit::Committed(_))));
    }

    /// An outcome not stored says so once, in its `Display` and in what a door answers (the
    /// encoder's sentence is carried whole).
    #[test]
    fn an_outcome_not_stored_says_so_once() {
        let reason = EncodeError::NotStored("the store policy does not keep it").to_string();
        let error = TransactionError::<String>::NotStored(reason);
        let said = "the outcome is not stored: the store policy does not keep it";
        assert_eq!(error.to_string(), format!("rolled back: {said}"));
        match error.failure() {
            Failure::Handler(Some(detail)) => assert_eq!(detail, said),
            other => panic!("{other:?}"),
        }
        let store = TransactionError::<String>::Store(StoreError::FencedOut);
        assert_eq!(store.to_string(), format!("rolled back: {}", StoreError::FencedOut));
        assert!(
            matches!(store.failure(), Failure::Store(detail) if detail.starts_with("rolled back: "))
        );
    }
}
