//! [`PostgresStore::complete_in`]: an outcome written in the caller's own transaction, so
//! that it commits with the side effect written there, or neither does.

use sqlx::Row as _;

use super::{PostgresStore, corrupt, millis};
use crate::store::{SealedOutcome, StoreError};

impl PostgresStore {
    /// Writes `sealed` in the caller's transaction (or on any connection of the caller's): the
    /// record completes if and only if the transaction commits, with the side effect written
    /// in it. Fenced by the claim's owner token, as [`Store::complete`](crate::store::Store::complete) is.
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
    ///         let sealed = consumer::seal(&context, &id)?;
    ///         store.complete_in(&mut tx, &sealed).await?;
    ///         tx.commit().await?;
    ///         Ok::<_, Box<dyn std::error::Error + Send + Sync>>(id)
    ///     })
    ///     .await;
    /// # }
    /// # use axum_idempotency::store::sqlx;
    /// ```
    ///
    /// # Errors
    ///
    /// [`StoreError::FencedOut`] when another claim holds the key now (this holder's lease
    /// lapsed and a duplicate took it over): nothing was written, and the transaction must
    /// roll back. A database error or the command timeout as for every call.
    pub async fn complete_in(
        &self,
        connection: &mut sqlx::PgConnection,
        sealed: &SealedOutcome,
    ) -> Result<(), StoreError> {
        let query = sqlx::query(&self.inner.statements.complete)
            .bind(sealed.key().as_str())
            .bind(sealed.owner().as_bytes())
            .bind(sealed.fingerprint().as_bytes())
            .bind(&sealed.outcome()[..])
            .bind(millis(sealed.retention()));
        let timeout = self.command_timeout;
        let row = match tokio::time::timeout(timeout, query.fetch_one(connection)).await {
            Ok(Ok(row)) => row,
            Ok(Err(error)) => return Err(StoreError::unavailable(error)),
            Err(_) => return Err(StoreError::Timeout(timeout)),
        };
        let outcome: i32 = row.try_get(0).map_err(corrupt)?;
        if outcome == 0 {
            return Err(StoreError::FencedOut);
        }
        sealed.mark_written();
        Ok(())
    }
}
