//! Deletes expired rows in bounded batches, so that no sweep holds a claim back: each batch
//! is one short statement, and rows a claim holds locked are skipped.

use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::store::StoreError;

/// The default for [`PostgresStore::sweep_every`](super::PostgresStore::sweep_every).
pub(super) const DEFAULT_EVERY: Duration = Duration::from_secs(60);

/// Rows one statement of the background sweep deletes at most.
const BATCH: u32 = 1000;

/// The background sweep of one store: stopped when dropped.
pub(super) struct Sweeper {
    _stop: DropGuard,
}

impl Sweeper {
    pub(super) fn start(pool: PgPool, statement: String, every: Duration) -> Self {
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        drop(tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = stopped.cancelled() => return,
                    () = tokio::time::sleep(every) => {}
                }
                if let Err(error) = sweep(&pool, &statement, BATCH).await {
                    tracing::warn!(%error, "idempotency: sweeping expired records failed; retrying later");
                }
            }
        }));
        Self { _stop: stop.drop_guard() }
    }
}

/// Deletes expired rows, `batch` at a time, until a batch finds fewer.
pub(super) async fn sweep(pool: &PgPool, statement: &str, batch: u32) -> Result<u64, StoreError> {
    let mut deleted = 0;
    loop {
        let done = sqlx::query(statement)
            .bind(i64::from(batch))
            .execute(pool)
            .await
            .map_err(StoreError::unavailable)?
            .rows_affected();
        deleted += done;
        if done < u64::from(batch) {
            return Ok(deleted);
        }
        // Between batches, let the claims waiting for a connection have one.
        tokio::task::yield_now().await;
    }
}
