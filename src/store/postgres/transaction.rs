//! [`PostgresStore::commit`]: an outcome committed in the caller's own transaction, with the
//! side effect written there, or neither.

use std::time::Duration;

use bytes::Bytes;
use sqlx::{Postgres, Row as _, Transaction};

use super::{PostgresStore, bounded, corrupt, millis};
use crate::store::{Commit, SealedOutcome, StoreError};

/// Commits `transaction` once `written` holds, and tells the front door what became of it:
/// `committed` with the outcome, or not committed (the write failed or was fenced out, and the
/// transaction is rolled back; or the commit failed, and its fate is unknown).
pub(super) async fn finish(
    transaction: Transaction<'_, Postgres>,
    sealed: &SealedOutcome,
    written: Result<(), StoreError>,
    timeout: Duration,
    committed: fn(Bytes) -> Commit,
) -> Result<(), StoreError> {
    let result = match written {
        // A commit cut off by the timeout drops the transaction mid-flight: its fate is
        // unknown, and answered as for any failed commit.
        Ok(()) => bounded(timeout, transaction.commit()).await,
        // Dropped unfinished: sqlx rolls it back.
        Err(error) => Err(error),
    };
    sealed.settle(match result {
        Ok(()) => committed(sealed.outcome().clone()),
        Err(_) => Commit::NotCommitted,
    });
    result
}

impl PostgresStore {
    /// Writes `sealed` in the caller's transaction and commits it: the record completes if and
    /// only if the side effect written in `transaction` commits. Fenced by the claim's owner
    /// token, as [`Store::complete`](crate::store::Store::complete) is. The front door then
    /// writes nothing: every retry is answered from the committed row, even when the process
    /// dies before the door answers.
    ///
    /// ```no_run
    /// # #[cfg(feature = "postgres")] async fn run(
    /// #     idem: axum_idempotency::Idempotent<axum_idempotency::store::PostgresStore>,
    /// #     store: axum_idempotency::store::PostgresStore,
    /// #     pool: axum_idempotency::store::sqlx::PgPool,
    /// # ) {
    /// use axum_idempotency::consumer;
    ///
    /// let outcome = idem
    ///     .run("payments", "evt_1", br#"{"amount":100}"#, move |context| async move {
    ///         let mut tx = pool.begin().await?;
    ///         let (id,): (i64,) =
    ///             sqlx::query_as("INSERT INTO payments (amount) VALUES (100) RETURNING id")
    ///                 .fetch_one(&mut *tx)
    ///                 .await?;
    ///         store.commit(tx, &consumer::seal(&context, &id)?).await?;
    ///         Ok::<_, Box<dyn std::error::Error + Send + Sync>>(id)
    ///     })
    ///     .await;
    /// # }
    /// # use axum_idempotency::store::sqlx;
    /// ```
    ///
    /// # Errors
    ///
    /// - [`StoreError::FencedOut`] when another claim holds the key now (this holder's lease
    ///   lapsed and a duplicate took it over): the transaction is rolled back, nothing of it
    ///   was written.
    /// - A database error or the command timeout, as for every call: the transaction is rolled
    ///   back, or, when the commit itself failed, its fate is unknown. Either way the front
    ///   door writes nothing and releases the key with a fenced delete, which a committed
    ///   record refuses: the retry replays the outcome if it committed, and runs again if not.
    pub async fn commit(
        &self,
        mut transaction: Transaction<'_, Postgres>,
        sealed: impl AsRef<SealedOutcome>,
    ) -> Result<(), StoreError> {
        let sealed = sealed.as_ref();
        sealed.begin();
        let written = self.write_sealed(&mut transaction, sealed).await;
        finish(transaction, sealed, written, self.command_timeout, Commit::Committed).await
    }

    /// Writes `sealed` in `transaction`, fenced by its owner token.
    async fn write_sealed(
        &self,
        transaction: &mut Transaction<'_, Postgres>,
        sealed: &SealedOutcome,
    ) -> Result<(), StoreError> {
        let query = sqlx::query(&self.inner.statements.complete)
            .bind(sealed.key().as_str())
            .bind(sealed.owner().as_bytes())
            .bind(sealed.fingerprint().as_bytes())
            .bind(&sealed.stored()[..])
            .bind(millis(sealed.retention()));
        let row = bounded(self.command_timeout, query.fetch_one(&mut **transaction)).await?;
        let outcome: i32 = row.try_get(0).map_err(corrupt)?;
        if outcome == 0 {
            return Err(StoreError::FencedOut);
        }
        Ok(())
    }
}
