//! The slot through which a store's transaction tells the claim's holder and its front door
//! what became of the commit: [`CommitSlot`], [`Running`], [`Commit`].

use std::{
    fmt,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use bytes::Bytes;

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
        let give_up = tokio::time::Instant::from_std(crate::store::later(now, patience));
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
            // A transaction still running: its fate is not known here (the settle waits for it
            // to end, and never reads this).
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
