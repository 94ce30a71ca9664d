//! Deletes expired rows in bounded batches, so that no sweep holds a claim back: each batch
//! is one short statement, and rows a claim holds locked are skipped. Each round also counts
//! the claims whose lease lapsed, for the `metrics` feature's gauges.

use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::schema::Statements;
use crate::store::StoreError;

/// What [`PostgresStore::lapsed_claims`](super::PostgresStore::lapsed_claims) found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct LapsedClaims {
    /// How many in-progress records have a lapsed lease.
    pub count: u64,
    /// How long ago the oldest of them lapsed; `None` when there is none.
    pub oldest: Option<Duration>,
}

/// The default for [`PostgresStore::sweep_every`](super::PostgresStore::sweep_every).
pub(super) const DEFAULT_EVERY: Duration = Duration::from_secs(60);

/// Rows one statement of the background sweep deletes at most.
const BATCH: u32 = 1000;

/// The background sweep of one store: stopped when dropped.
pub(super) struct Sweeper {
    _stop: DropGuard,
}

impl Sweeper {
    pub(super) fn start(pool: PgPool, statements: Statements, every: Duration) -> Self {
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        drop(tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = stopped.cancelled() => return,
                    () = tokio::time::sleep(every) => {}
                }
                if let Err(error) = sweep(&pool, &statements.sweep, BATCH).await {
                    tracing::warn!(%error, "idempotency: sweeping expired records failed; retrying later");
                }
                #[cfg(feature = "metrics")]
                if let Ok(lapsed) = lapsed(&pool, &statements.lapsed).await {
                    let table = statements.table.clone();
                    #[allow(clippy::cast_precision_loss)] // a count far below 2^52
                    metrics::gauge!("idempotency_lapsed_claims", "table" => table.clone())
                        .set(lapsed.count as f64);
                    metrics::gauge!("idempotency_oldest_lapsed_claim_seconds", "table" => table)
                        .set(lapsed.oldest.map_or(0.0, |age| age.as_secs_f64()));
                }
            }
        }));
        Self { _stop: stop.drop_guard() }
    }
}

/// Deletes expired rows, `batch` at a time (at least one), until a batch finds fewer.
pub(super) async fn sweep(pool: &PgPool, statement: &str, batch: u32) -> Result<u64, StoreError> {
    // A batch of 0 would never find fewer than itself: the loop would not end.
    let batch = batch.max(1);
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

/// The in-progress records whose lease lapsed, and the age of the oldest lapse.
pub(super) async fn lapsed(pool: &PgPool, statement: &str) -> Result<LapsedClaims, StoreError> {
    let (count, oldest_ms): (i64, Option<i64>) =
        sqlx::query_as(statement).fetch_one(pool).await.map_err(StoreError::unavailable)?;
    Ok(LapsedClaims {
        count: u64::try_from(count).unwrap_or(0),
        oldest: oldest_ms.map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0))),
    })
}
