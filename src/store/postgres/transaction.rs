//! The one transactional path: [`PostgresStore::transaction`] (and
//! [`DurableOutcomes::transaction`](crate::durable::DurableOutcomes::transaction)) begins a transaction
//! on the store's own pool, hands it to the operation, writes the operation's outcome in it,
//! fenced by the claim's owner token, and commits: the side effect and the outcome, or
//! neither.

use std::time::Duration;

use futures_util::future::BoxFuture;
use sqlx::{PgConnection, PgPool, Row as _};

mod key_lock;

use self::key_lock::Held;
pub(crate) use self::key_lock::{KeyLock, key_lock};
use super::{Beginning, PostgresStore, bounded, corrupt, millis};
use crate::{
    context::IdempotencyContext,
    store::{Commit, Committable, EncodedOutcome, Running, StoreError, TransactionError},
};

/// Where a transaction's outcome is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kept<'a> {
    /// In the record itself (`PostgresStore`): the transaction completes the claim, and the
    /// key is held by its lock while the transaction runs (see [`KeyLock`]).
    InRecord(KeyLock<'a>),
    /// In this table beside the record store (`DurableOutcomes`): the door stores it in the
    /// record store too, and must answer from this table.
    Beside(&'a crate::recovery::DurableTable),
}

/// Writes an encoded outcome in the transaction: `Ok(true)` when written, `Ok(false)` when the
/// fence refused it.
pub(crate) type Write = for<'t> fn(
    &'t mut PgConnection,
    &'t EncodedOutcome,
    Duration,
    &'t str,
) -> BoxFuture<'t, Result<bool, StoreError>>;

/// Runs `operation` in a transaction of `pool` for `context`'s claim, and commits it with the
/// outcome `write` writes: see [`PostgresStore::transaction`].
pub(crate) async fn run<O, E, F>(
    (pool, timeout): (&PgPool, Duration),
    (write, statement): (Write, &str),
    where_kept: Kept<'_>,
    context: &IdempotencyContext,
    operation: F,
) -> Result<O, TransactionError<E>>
where
    O: Committable,
    F: for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, Result<O, E>> + Send,
{
    let completion = context.completion().ok_or(TransactionError::Misuse(
        "the context is not one a front door gave to an operation it runs",
    ))?;
    // Beside the record store, the door must answer takeovers and lost records from the
    // table, or a committed outcome that the record store lost is never answered again.
    let beside = matches!(where_kept, Kept::Beside(_));
    if let Kept::Beside(table) = where_kept
        && completion.durable.as_ref() != Some(table)
    {
        return Err(TransactionError::Misuse(match completion.durable {
            None => {
                "DurableOutcomes::transaction needs its door to answer from the table: set \
                 `.recover(outcomes)` on the layer or the consumer door (last)"
            }
            Some(_) => {
                "DurableOutcomes::transaction into a table its door does not answer from (another \
                 database): commit into the DurableOutcomes the door's `.recover(..)` was given"
            }
        }));
    }
    // Written in the one commit only when the record is (not in a table beside the store).
    let placed_next = context.names().any(|(key, _)| key.is_placed_next());
    if placed_next && matches!(where_kept, Kept::InRecord(_)) {
        return Err(TransactionError::Misuse(
            "a transaction while a RegionalStore moves between region lists: the key's two homes \
             are two databases, which one commit cannot write; commit with the `complete` the \
             door makes, or finish the move first",
        ));
    }
    completion.commit.start(!beside).map_err(TransactionError::Misuse)?;
    // Dropped anywhere before the commit is sent (an error, a panic, the caller cancelled):
    // rolled back, and sqlx rolls the transaction back.
    let mut running = Running::new(completion.commit.clone());
    // The checkout, the key's lock and `BEGIN` within one command timeout, as every store
    // operation is.
    let started = tokio::time::Instant::now();
    let connection = bounded(timeout, pool.acquire()).await.map_err(TransactionError::Store)?;
    let mut connection = Beginning::new(connection);
    // Every name the claim holds (two during a move between namings), each by its lock,
    // taken in the order of the names, as every transaction takes them.
    let mut names = vec![(context.key(), &completion.owner)];
    if let (Some(other), Some(owner)) = (context.other_key(), &completion.other_owner) {
        names.push((other, owner));
        names.sort_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
    }
    let mut held = Vec::new();
    if let Kept::InRecord(lock) = where_kept {
        for (key, owner) in names {
            let left = timeout.saturating_sub(started.elapsed());
            let hold = Held { lock, key, owner };
            let taken = bounded(left, hold.take(&mut connection, completion)).await;
            held.push(hold);
            match taken {
                Ok(true) => {}
                Ok(false) => {
                    for hold in held.into_iter().rev() {
                        hold.let_go(&mut connection, None, timeout).await;
                    }
                    return Err(TransactionError::Store(StoreError::FencedOut));
                }
                Err(error) => return Err(TransactionError::Store(error)),
            }
        }
    }
    let left = timeout.saturating_sub(started.elapsed());
    let result = in_transaction(
        &mut connection,
        (left, timeout),
        (write, statement),
        where_kept,
        context,
        operation,
        &mut running,
    )
    .await;
    // Renewed before it is let go, unless it committed (a completed record is never
    // renewed): the holder's renewals resume a period on, and the lease lapsed meanwhile
    // when the transaction outlived it. A commit whose fate is unknown leaves the
    // connection as it is: closed, which ends the lock.
    let renew = match &result {
        Ok(_) | Err(TransactionError::CommitUnknown(_)) => None,
        Err(_) => Some(completion),
    };
    if !matches!(result, Err(TransactionError::CommitUnknown(_))) {
        for hold in held.into_iter().rev() {
            hold.let_go(&mut connection, renew, timeout).await;
        }
    }
    result
}

/// The transaction itself, on `connection`: begun within `begin` (what is left of the
/// command timeout), the operation, its outcome written by `write`, the commit.
async fn in_transaction<O, E, F>(
    connection: &mut Beginning,
    (begin, timeout): (Duration, Duration),
    (write, statement): (Write, &str),
    where_kept: Kept<'_>,
    context: &IdempotencyContext,
    operation: F,
    running: &mut Running,
) -> Result<O, TransactionError<E>>
where
    O: Committable,
    F: for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, Result<O, E>> + Send,
{
    let mut tx = match bounded(begin, connection.begin()).await {
        Ok(tx) => tx,
        Err(StoreError::Timeout(_)) => {
            return Err(TransactionError::Store(StoreError::Timeout(timeout)));
        }
        Err(error) => return Err(TransactionError::Store(error)),
    };
    let value = operation(&mut tx).await.map_err(TransactionError::Operation)?;
    let (outcome, value) =
        value.encode(context).await.map_err(|why| TransactionError::NotStored(why.to_string()))?;
    let not_stored = |why: crate::store::EncodeError| TransactionError::NotStored(why.to_string());
    let encoded = context.encoded(outcome.clone()).map_err(not_stored)?;
    // During a move between namings, under the other names too, in the same commit.
    let other = match where_kept {
        Kept::InRecord(_) => context.encoded_other(outcome).map_err(not_stored)?,
        Kept::Beside(_) => None,
    };
    for encoded in std::iter::once(&encoded).chain(&other) {
        match write(&mut tx, encoded, timeout, statement).await {
            Ok(true) => {}
            Ok(false) => return Err(TransactionError::Store(StoreError::FencedOut)),
            Err(error) => return Err(TransactionError::Store(error)),
        }
    }
    running.committing();
    match tokio::time::timeout(timeout, tx.commit()).await {
        Ok(Ok(())) => {
            running.end_with(match where_kept {
                Kept::InRecord(_) => Commit::Committed(encoded.outcome),
                Kept::Beside(_) => Commit::CommittedBeside(encoded.outcome),
            });
            Ok(value)
        }
        // The server answered that it refused the commit and rolled the transaction back (a
        // deferred constraint, a serialization failure, the transaction ended for idling).
        Ok(Err(error)) if rolled_back(&error) => {
            running.end_with(Commit::RolledBack);
            Err(TransactionError::Store(StoreError::unavailable(error)))
        }
        Ok(Err(error)) => {
            running.end_with(Commit::Unknown);
            Err(TransactionError::CommitUnknown(StoreError::unavailable(error)))
        }
        // Dropped mid-flight: sent or not, its fate is unknown.
        Err(_) => {
            running.end_with(Commit::Unknown);
            Err(TransactionError::CommitUnknown(StoreError::Timeout(timeout)))
        }
    }
}

/// Whether the error the server answered a COMMIT with says the transaction was rolled back:
/// an integrity constraint checked at commit (class 23), a serialization failure or deadlock
/// (40), an invalid transaction state, the idle-in-transaction timeout among them (25). Any
/// other answer (an operator's shutdown, class 57, may follow a durable commit) leaves the
/// commit's fate unknown.
fn rolled_back(error: &sqlx::Error) -> bool {
    let code = error.as_database_error().and_then(sqlx::error::DatabaseError::code);
    code.is_some_and(|code| ["23", "25", "40"].iter().any(|class| code.starts_with(class)))
}

/// How long the database keeps a transaction that went idle after its outcome was written
/// (its COMMIT lost on the way) before it ends it, and with it the record's row lock: the
/// command timeout, past which the caller took the commit's fate as unknown anyway.
pub(crate) fn idle_limit(timeout: Duration) -> String {
    millis(timeout).max(1).to_string()
}

impl PostgresStore {
    /// Runs `operation` in a transaction the store begins on its own pool, then writes the
    /// operation's outcome in that same transaction and commits it: the side effect and its
    /// idempotency record commit together, or neither does. The one way to commit an
    /// outcome with its side effect, for every front door: the HTTP door (the handler finds
    /// `context` in its request's extensions) and the consumer door (`Idempotent::run` hands
    /// it to the operation).
    ///
    /// `operation` gets the transaction's connection and returns the outcome: an
    /// `axum::response::Response` (the HTTP door stores it as it stores a handler's response,
    /// under its store policy and limits) or an `axum::Json<T>` (the consumer door's result
    /// `T`; for the HTTP door, a 200 JSON response). It is handed back as the call's `Ok`; the
    /// door answers the committed outcome, and every retry replays it from the committed row,
    /// even when the process dies before the door answers.
    ///
    /// ```no_run
    /// # async fn run(
    /// #     idem: axum_idempotency::Idempotent<axum_idempotency::store::PostgresStore>,
    /// #     store: axum_idempotency::store::PostgresStore,
    /// # ) {
    /// use axum::Json;
    ///
    /// let outcome = idem
    ///     .run("payments", "evt_1", br#"{"amount":100}"#, move |context| async move {
    ///         let Json(id) = store
    ///             .transaction(&context, |tx| {
    ///                 Box::pin(async move {
    ///                     let sql = "INSERT INTO payments (amount) VALUES (100) RETURNING id";
    ///                     let id: i64 = sqlx::query_scalar(sql).fetch_one(&mut *tx).await?;
    ///                     Ok::<_, sqlx::Error>(Json(id))
    ///                 })
    ///             })
    ///             .await?;
    ///         Ok::<_, axum_idempotency::store::TransactionError<sqlx::Error>>(id)
    ///     })
    ///     .await;
    /// # }
    /// # use axum_idempotency::store::sqlx;
    /// ```
    ///
    /// What a misuse gets, each by construction or refused before anything is written:
    ///
    /// - *Retrying the call after an error*: allowed only when the transaction was rolled back
    ///   (every variant of [`TransactionError`] but `CommitUnknown`). After
    ///   [`CommitUnknown`](TransactionError::CommitUnknown) (the commit's answer was lost), or
    ///   after a commit, the call is refused with [`TransactionError::Misuse`]: the outcome is
    ///   never committed twice. The next claim of the key answers from the database.
    /// - *Nesting it* (a call inside another's operation, for the same claim): refused
    ///   ([`TransactionError::Misuse`]).
    /// - *Another store* (another table, or the layer's records are in Redis): the record is
    ///   written only where this claim's owner token holds a live claim of the same
    ///   fingerprint in this store's table; anywhere else the write is refused,
    ///   [`StoreError::FencedOut`], and the transaction is rolled back.
    /// - *A savepoint or the caller's own transaction*: cannot be passed; the store begins its
    ///   own top-level transaction.
    /// - *A holder whose lease was taken over*: [`StoreError::FencedOut`], rolled back; the
    ///   other holder runs the operation.
    /// - *A transaction longer than the lease* (a slow provider call inside it), at any
    ///   isolation level: it holds its key by a lock of its session, taken before its
    ///   `BEGIN` (with the lease renewed, fenced) and let go after its `COMMIT`. The lease is
    ///   not renewed while it runs (a renewal's write of the record would make a REPEATABLE
    ///   READ or SERIALIZABLE transaction's own write of it fail); every duplicate is answered
    ///   "in progress" meanwhile, and never takes the key over. A process that dies inside it
    ///   ends its session, and the lock with it: the retry takes over once the lease lapses.
    ///   It holds for as long as the recovery window (the retention by default).
    /// - *Spawning the transaction and returning before it ended*: the door waits for it (a
    ///   transaction that runs, until it ends; a clone of the context still alive, 250 ms at
    ///   most) and answers what it committed. A transaction that begins after the door
    ///   settled is refused before it writes ([`TransactionError::Misuse`]): await it.
    ///
    /// A transaction whose COMMIT is lost on the way (a partition) keeps the record's row
    /// locked until the database ends it: the store sets the transaction's
    /// `idle_in_transaction_session_timeout` to the command timeout once the outcome is
    /// written, and meanwhile every claim of the key answers "in progress".
    ///
    /// # Errors
    ///
    /// [`TransactionError`]: the operation's own error, the store's, an outcome the door does
    /// not store, a misuse (each rolled back, nothing written), or a commit whose answer was
    /// lost ([`TransactionError::CommitUnknown`]). Whatever the operation returns then, the
    /// door writes nothing of its own and releases the claim with a fenced delete, which a
    /// committed record refuses: the retry replays the outcome if it committed, and runs the
    /// operation again if not.
    pub async fn transaction<O, E, F>(
        &self,
        context: &IdempotencyContext,
        operation: F,
    ) -> Result<O, TransactionError<E>>
    where
        O: Committable,
        F: for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, Result<O, E>> + Send,
    {
        let pool = (&self.inner.pool, self.command_timeout);
        let write: Write =
            |tx, encoded, timeout, statement| Box::pin(write(tx, encoded, timeout, statement));
        let statements = &self.inner.statements;
        let lock = KeyLock { table: &statements.table, touch: &statements.touch };
        run(pool, (write, &statements.commit), Kept::InRecord(lock), context, operation).await
    }
}

/// Completes the claim in the transaction, fenced by its owner token (the store's `commit`
/// function).
async fn write(
    tx: &mut PgConnection,
    encoded: &EncodedOutcome,
    timeout: Duration,
    statement: &str,
) -> Result<bool, StoreError> {
    let query = sqlx::query(statement)
        .bind(encoded.key.as_str())
        .bind(encoded.owner.as_bytes())
        .bind(encoded.fingerprint.as_bytes())
        .bind(&encoded.stored[..])
        .bind(millis(encoded.retention))
        .bind(millis(timeout).max(1));
    let row = bounded(timeout, query.fetch_one(tx)).await?;
    let outcome: i32 = row.try_get(0).map_err(corrupt)?;
    Ok(outcome == 1)
}
