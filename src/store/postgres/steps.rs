//! [`RecoveryPoints`]: the steps of an operation that makes more than one foreign call, each
//! marked done in the transaction that commits it, so that a takeover resumes after the last
//! step that committed instead of starting over.

use std::time::Duration;

use serde::{Serialize, de::DeserializeOwned};
use sqlx::{PgConnection, PgPool};

use super::{bounded, millis};
use crate::store::StoreError;

/// The steps an operation marked done, in the table `idempotency_steps` of the app's own
/// PostgreSQL database, keyed by the operation's key hash
/// ([`IdempotencyContext::key_hash`](crate::IdempotencyContext::key_hash)) and the step's
/// name.
///
/// An operation with several foreign side effects (create a row, then call a payment provider,
/// then record the charge) marks each step in the transaction that commits it, with its
/// result ([`mark`](Self::mark)), and asks before each step whether it committed already
/// ([`done`](Self::done)): a takeover after a crash then skips the steps that committed, with
/// their results, and runs the rest. A step is committed once: of two holders of one key, the
/// second to mark a step is refused with [`StoreError::FencedOut`], and its transaction must
/// roll back.
///
/// ```no_run
/// # async fn run(
/// #     pool: axum_idempotency::store::sqlx::PgPool,
/// #     steps: axum_idempotency::store::RecoveryPoints,
/// #     context: axum_idempotency::IdempotencyContext,
/// # ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// use axum_idempotency::store::sqlx;
///
/// let order: i64 = match steps.done(context.key_hash(), "order").await? {
///     Some(order) => order, // committed by an earlier holder: not run again
///     None => {
///         let mut tx = pool.begin().await?;
///         let (order,): (i64,) = sqlx::query_as("INSERT INTO orders DEFAULT VALUES RETURNING id")
///             .fetch_one(&mut *tx)
///             .await?;
///         steps.mark(&mut tx, context.key_hash(), "order", &order).await?;
///         tx.commit().await?;
///         order
///     }
/// };
/// # let _ = order; Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct RecoveryPoints {
    pool: PgPool,
    retention: Duration,
    command_timeout: Duration,
}

impl RecoveryPoints {
    /// The table, safe to run on every start.
    pub const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS idempotency_steps (
    key_hash TEXT NOT NULL,
    step TEXT NOT NULL,
    result BYTEA NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (key_hash, step)
);
CREATE INDEX IF NOT EXISTS idempotency_steps_expires_at ON idempotency_steps (expires_at);";

    /// Steps in `pool`'s database, kept 24 hours (the doors' default retention), every call
    /// bounded by a command timeout of a second.
    #[must_use]
    pub fn new(pool: PgPool) -> Self {
        let (retention, command_timeout) = (Duration::from_secs(24 * 3600), Duration::from_secs(1));
        Self { pool, retention, command_timeout }
    }

    /// How long a marked step is kept: at least as long as its operation's claim may be taken
    /// over (its lease and recovery window).
    #[must_use]
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Creates the table when it is missing ([`SCHEMA`](Self::SCHEMA)).
    ///
    /// # Errors
    ///
    /// When the database cannot be reached or refuses the schema.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        sqlx::raw_sql(Self::SCHEMA).execute(&self.pool).await.map_err(StoreError::unavailable)?;
        Ok(())
    }

    /// The result of `step` of the operation whose key hash is `key_hash`, if an earlier run
    /// of it committed the step.
    ///
    /// # Errors
    ///
    /// When the database cannot be reached, within the command timeout; a result that does not
    /// read back as a `T` is [`StoreError::CorruptRecord`].
    pub async fn done<T: DeserializeOwned>(
        &self,
        key_hash: &str,
        step: &str,
    ) -> Result<Option<T>, StoreError> {
        let select = "SELECT result FROM idempotency_steps
            WHERE key_hash = $1 AND step = $2 AND expires_at > clock_timestamp()";
        let query = sqlx::query_scalar::<_, Vec<u8>>(select).bind(key_hash).bind(step);
        let row = bounded(self.command_timeout, query.fetch_optional(&self.pool)).await?;
        row.map(|result| {
            serde_json::from_slice(&result).map_err(|error| {
                StoreError::CorruptRecord(format!("step {step:?} of {key_hash}: {error}"))
            })
        })
        .transpose()
    }

    /// Marks `step` done with `result`, in the caller's transaction (or on any connection of
    /// the caller's): it is done if and only if the transaction commits.
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
        key_hash: &str,
        step: &str,
        result: &T,
    ) -> Result<(), StoreError> {
        let result = serde_json::to_vec(result)
            .map_err(|error| StoreError::CorruptRecord(format!("step {step:?}: {error}")))?;
        // An expired mark is the past: taken over. A live one is another holder's.
        let insert = "INSERT INTO idempotency_steps AS t (key_hash, step, result, expires_at)
            VALUES ($1, $2, $3, clock_timestamp() + $4 * interval '1 millisecond')
            ON CONFLICT (key_hash, step) DO UPDATE SET result = excluded.result,
                expires_at = excluded.expires_at
            WHERE t.expires_at <= clock_timestamp()
            RETURNING 1";
        let query = sqlx::query_scalar::<_, i32>(insert)
            .bind(key_hash)
            .bind(step)
            .bind(result)
            .bind(millis(self.retention));
        match bounded(self.command_timeout, query.fetch_optional(connection)).await? {
            Some(_) => Ok(()),
            None => Err(StoreError::FencedOut),
        }
    }

    /// Deletes the expired steps, and returns how many.
    ///
    /// # Errors
    ///
    /// When the database cannot be reached.
    pub async fn sweep_expired(&self) -> Result<u64, StoreError> {
        let delete = "DELETE FROM idempotency_steps WHERE expires_at <= clock_timestamp()";
        let done =
            sqlx::query(delete).execute(&self.pool).await.map_err(StoreError::unavailable)?;
        Ok(done.rows_affected())
    }
}
