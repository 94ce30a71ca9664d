//! [`Checkpoints`]: the steps of an operation that makes more than one foreign call, each
//! marked done in the transaction that commits it and bound to its request, so that the same
//! request run again resumes after the last step that committed instead of starting over.

use std::time::Duration;

use serde::{Serialize, de::DeserializeOwned};
use sqlx::{PgConnection, PgPool};

use crate::{
    IdempotencyContext,
    store::{
        StoreError,
        postgres::{bounded, millis},
    },
};

/// The steps an operation marked done, in the table `idempotency_steps` of the app's own
/// PostgreSQL database, keyed by the operation's key hash
/// ([`IdempotencyContext::key_hash`]) and the step's name, and bound to the request's
/// fingerprint.
///
/// An operation with several foreign side effects (create a row, then call a payment provider,
/// then record the charge) marks each step in the transaction that commits it, with its
/// result ([`mark`](Self::mark)), and asks before each step whether it committed already
/// ([`done`](Self::done)): the same request run again (a takeover after a crash, a retry
/// after a failure) then skips the steps that committed, with their results, and runs the
/// rest. A step is committed once: of two holders of one key, the second to mark a step is
/// refused with [`StoreError::FencedOut`], and its transaction must roll back.
///
/// Steps belong to the request that marked them: asked by another request under the same
/// key (another payload), [`done`](Self::done) answers [`StoreError::KeyReused`], never the
/// other request's results; answer it with
/// [`layer::KeyReused`](crate::layer::KeyReused) (the layer's mismatch problem, 409 or 422). A
/// step is kept as long as the key's outcome is (the door's retention, from the mark): a key
/// whose record expired starts afresh.
///
/// ```no_run
/// # async fn run(
/// #     pool: axum_idempotency::store::sqlx::PgPool,
/// #     steps: axum_idempotency::durable::Checkpoints,
/// #     context: axum_idempotency::IdempotencyContext,
/// # ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use axum_idempotency::store::sqlx;
///
/// let order: i64 = match steps.done(&context, "order").await? {
///     Some(order) => order, // committed by an earlier run of this request: not run again
///     None => {
///         let mut tx = pool.begin().await?;
///         let (order,): (i64,) = sqlx::query_as("INSERT INTO orders DEFAULT VALUES RETURNING id")
///             .fetch_one(&mut *tx)
///             .await?;
///         steps.mark(&mut tx, &context, "order", &order).await?;
///         tx.commit().await?;
///         order
///     }
/// };
/// # let _ = order; Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Checkpoints {
    pool: PgPool,
    command_timeout: Duration,
}

impl Checkpoints {
    /// The table, safe to run on every start.
    pub const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS idempotency_steps (
    key_hash TEXT NOT NULL,
    step TEXT NOT NULL,
    fingerprint BYTEA NOT NULL,
    result BYTEA NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (key_hash, step)
);
-- A table of the previous version: its steps, bound to no request, are never resumed (every
-- request is answered `KeyReused` for them until they expire).
ALTER TABLE idempotency_steps ADD COLUMN IF NOT EXISTS fingerprint BYTEA NOT NULL DEFAULT '';
CREATE INDEX IF NOT EXISTS idempotency_steps_expires_at ON idempotency_steps (expires_at);";

    table_calls!("idempotency_steps", "Steps in `pool`'s database.");

    /// The result of `step` of `context`'s request, if an earlier run of it committed the
    /// step.
    ///
    /// # Errors
    ///
    /// - [`StoreError::KeyReused`] when the step was committed for another request under the
    ///   same key (another payload): its result is not this request's.
    /// - When the database cannot be reached, within the command timeout; a result that does
    ///   not read back as a `T` is [`StoreError::CorruptRecord`].
    pub async fn done<T: DeserializeOwned>(
        &self,
        context: &IdempotencyContext,
        step: &str,
    ) -> Result<Option<T>, StoreError> {
        // Under the names the claim holds, then (while a service moves between namings) under
        // the request's other names, which an instance of the neighbouring deploy marks under.
        let mut row = None;
        for (key, fingerprint) in context.names() {
            let select = "SELECT result, fingerprint = $3 FROM idempotency_steps
                WHERE key_hash = $1 AND step = $2 AND expires_at > clock_timestamp()";
            let query = sqlx::query_as::<_, (Vec<u8>, bool)>(select)
                .bind(key.hash())
                .bind(step)
                .bind(&fingerprint.as_bytes()[..]);
            row = bounded(self.command_timeout, query.fetch_optional(&self.pool)).await?;
            if row.is_some() {
                break;
            }
        }
        let Some((result, same_request)) = row else { return Ok(None) };
        if !same_request {
            return Err(StoreError::KeyReused);
        }
        serde_json::from_slice(&result).map(Some).map_err(|error| {
            let key_hash = context.key_hash();
            StoreError::CorruptRecord(format!("step {step:?} of {key_hash}: {error}"))
        })
    }

    /// Marks `step` of `context`'s request done with `result`, in the caller's transaction
    /// (or on any connection of the caller's; inside `PostgresStore::transaction`, the
    /// transaction's): it is done if and only if the transaction commits. It is kept for the
    /// context's retention.
    ///
    /// Mark a step last, just before the commit: from the mark, the database ends the
    /// transaction (rolls it back) if it waits for the app longer than the claim's lease (at
    /// least the command timeout), so that a transaction whose app died or was cut off does
    /// not hold the step's row for as long as TCP keep-alive takes to notice (hours).
    ///
    /// # Errors
    ///
    /// - [`StoreError::FencedOut`] when the step is marked already (another holder of the key
    ///   committed it): roll the transaction back, and read it with [`done`](Self::done).
    /// - [`StoreError::CorruptRecord`] when serde cannot encode `result`.
    /// - A database error or the command timeout, as for every call.
    pub async fn mark<T: Serialize>(
        &self,
        connection: &mut PgConnection,
        context: &IdempotencyContext,
        step: &str,
        result: &T,
    ) -> Result<(), StoreError> {
        let result = serde_json::to_vec(result)
            .map_err(|error| StoreError::CorruptRecord(format!("step {step:?}: {error}")))?;
        // An expired mark is the past: taken over. A live one is another holder's. From the
        // mark, the transaction holds the step's row: one left idle (its app gone, or cut off
        // from the database) is ended by the database after the claim's lease, rather than
        // after TCP keep-alive gives up (hours), holding the step and every `migrate` back.
        let insert = "INSERT INTO idempotency_steps AS t
                (key_hash, step, fingerprint, result, expires_at)
            VALUES ($1, $2, $3, $4, clock_timestamp() + $5 * interval '1 millisecond')
            ON CONFLICT (key_hash, step) DO UPDATE SET fingerprint = excluded.fingerprint,
                result = excluded.result, expires_at = excluded.expires_at
            WHERE t.expires_at <= clock_timestamp()
            RETURNING set_config('idle_in_transaction_session_timeout', $6, true)";
        let idle = millis(context.lease().max(self.command_timeout)).max(1).to_string();
        let query = sqlx::query_scalar::<_, String>(insert)
            .bind(context.key_hash())
            .bind(step)
            .bind(&context.fingerprint().as_bytes()[..])
            .bind(result)
            .bind(millis(context.retention()))
            .bind(idle);
        match bounded(self.command_timeout, query.fetch_optional(connection)).await? {
            Some(_) => Ok(()),
            None => Err(StoreError::FencedOut),
        }
    }
}
