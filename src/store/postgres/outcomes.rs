//! [`DurableOutcomes`]: the durable half beside a fast record store (Redis). An operation
//! commits its outcome to a table the crate owns, in the transaction that writes its side
//! effect; the record store keeps the fast claim and the replays; a takeover, a lapsed lease or
//! a record the record store lost is answered from the table.

use std::time::Duration;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use sqlx::{PgConnection, PgPool};

use super::{
    bounded, millis,
    transaction::{Kept, Write, idle_limit, run},
};
use crate::{
    context::IdempotencyContext,
    fingerprint::Fingerprint,
    key::RecordKey,
    store::{Committable, EncodedOutcome, StoreError, TransactionError},
};

/// Writes an outcome, unless the table holds a live one for its key: an expired row is the
/// past, taken over; a live one is another holder's. The transaction is then left to the
/// database's `idle_in_transaction_session_timeout` (`$5` ms) should its COMMIT be lost.
const INSERT: &str = "WITH idle AS (
        SELECT set_config('idle_in_transaction_session_timeout', $5, true))
    INSERT INTO idempotency_outcomes AS t (key, fingerprint, outcome, expires_at)
    SELECT $1, $2, $3, clock_timestamp() + $4 * interval '1 millisecond' FROM idle
    ON CONFLICT (key) DO UPDATE SET fingerprint = excluded.fingerprint,
        outcome = excluded.outcome, expires_at = excluded.expires_at
    WHERE t.expires_at <= clock_timestamp()
    RETURNING 1";

/// Writes `encoded` in the transaction: `Ok(false)` when the table holds another live outcome.
async fn write(
    tx: &mut PgConnection,
    encoded: &EncodedOutcome,
    timeout: Duration,
    statement: &str,
) -> Result<bool, StoreError> {
    let query = sqlx::query_scalar::<_, i32>(statement)
        .bind(encoded.key.as_str())
        .bind(&encoded.fingerprint.as_bytes()[..])
        .bind(&encoded.stored[..])
        .bind(millis(encoded.retention))
        .bind(idle_limit(timeout));
    Ok(bounded(timeout, query.fetch_optional(tx)).await?.is_some())
}

/// Outcomes committed with their side effects, in the table `idempotency_outcomes` of the
/// app's own PostgreSQL database, beside a record store that does not share that database
/// (Redis). Set up once, and handlers commit their outcomes to it
/// ([`transaction`](Self::transaction)); the front doors answer from it what the record store cannot
/// (`IdempotencyLayer::durable`, `Idempotent::durable`).
///
/// The table's primary key is the fence: of two holders of one key (one that was slow, not
/// dead, and the one that took its lease over) only the first to commit keeps its side
/// effect; the other's commit is refused with [`StoreError::FencedOut`] and its transaction,
/// side effect included, is rolled back.
#[derive(Debug, Clone)]
pub struct DurableOutcomes {
    pool: PgPool,
    command_timeout: Duration,
}

impl DurableOutcomes {
    /// The table, safe to run on every start.
    pub const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS idempotency_outcomes (
    key TEXT PRIMARY KEY,
    fingerprint BYTEA NOT NULL,
    outcome BYTEA NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL
);
CREATE INDEX IF NOT EXISTS idempotency_outcomes_expires_at ON idempotency_outcomes (expires_at);";

    /// Outcomes in `pool`'s database. Every call is bounded by a command timeout of a second
    /// ([`command_timeout`](Self::command_timeout)).
    #[must_use]
    pub fn new(pool: PgPool) -> Self {
        Self { pool, command_timeout: Duration::from_secs(1) }
    }

    /// Sets the longest a call may take.
    #[must_use]
    pub fn command_timeout(mut self, timeout: Duration) -> Self {
        self.command_timeout = timeout;
        self
    }

    /// Creates the table when it is missing ([`SCHEMA`](Self::SCHEMA)), under an advisory
    /// lock, so that instances starting side by side do not collide. Safe on every start.
    ///
    /// # Errors
    ///
    /// When the database cannot be reached or refuses the schema.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        super::migrate(&self.pool, "idempotency_outcomes", Self::SCHEMA).await
    }

    /// Runs `operation` in a transaction the table's pool begins, writes the operation's
    /// outcome to the table in that same transaction and commits it: the outcome is kept if
    /// and only if the side effect commits. The front door then stores it in its record store
    /// too, as the outcome it answers. Used as
    /// [`PostgresStore::transaction`](super::PostgresStore::transaction) is, with the same
    /// outcomes, errors and refusals of misuse.
    ///
    /// # Errors
    ///
    /// [`TransactionError`]; [`StoreError::FencedOut`] (rolled back) when the table holds a
    /// live outcome for the key already: another holder of the key committed first.
    pub async fn transaction<O, E, F>(
        &self,
        context: &IdempotencyContext,
        operation: F,
    ) -> Result<O, TransactionError<E>>
    where
        O: Committable,
        F: for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, Result<O, E>> + Send,
    {
        let pool = (&self.pool, self.command_timeout);
        let write: Write =
            |tx, encoded, timeout, statement| Box::pin(write(tx, encoded, timeout, statement));
        run(pool, (write, INSERT), Kept::Beside, context, operation).await
    }

    /// The live outcome of `key`, with the fingerprint of the request that made it.
    pub(crate) async fn read(
        &self,
        key: &RecordKey,
    ) -> Result<Option<(Fingerprint, Bytes)>, StoreError> {
        let select = "SELECT fingerprint, outcome FROM idempotency_outcomes
            WHERE key = $1 AND expires_at > clock_timestamp()";
        let query = sqlx::query_as::<_, (Vec<u8>, Vec<u8>)>(select).bind(key.as_str());
        let row = bounded(self.command_timeout, query.fetch_optional(&self.pool)).await?;
        row.map(|(fingerprint, outcome)| {
            let fingerprint = Fingerprint::from_stored(&fingerprint)
                .ok_or_else(|| StoreError::CorruptRecord("an outcome's fingerprint".into()))?;
            Ok((fingerprint, Bytes::from(outcome)))
        })
        .transpose()
    }

    /// Deletes the expired outcomes, and returns how many.
    ///
    /// # Errors
    ///
    /// When the database cannot be reached.
    pub async fn sweep_expired(&self) -> Result<u64, StoreError> {
        let delete = "DELETE FROM idempotency_outcomes WHERE expires_at <= clock_timestamp()";
        let done =
            sqlx::query(delete).execute(&self.pool).await.map_err(StoreError::unavailable)?;
        Ok(done.rows_affected())
    }
}
