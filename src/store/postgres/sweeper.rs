//! Deletes expired rows in bounded batches, so that no sweep holds a claim back: each batch
//! is one short statement, and rows a claim holds locked are skipped. Each round also counts
//! the claims whose lease lapsed, for the `metrics` feature's gauges.

use std::time::Duration;

use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::{PostgresStore, bounded, millis, schema::Statements};
use crate::{
    fingerprint::Fingerprint,
    key::RecordKey,
    store::{AbandonedClaim, StoreError},
};

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
    task: JoinHandle<()>,
}

impl Sweeper {
    pub(super) fn start(pool: PgPool, statements: Statements, every: Duration) -> Self {
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
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
        });
        Self { _stop: stop.drop_guard(), task }
    }

    /// Whether the sweep's task ended: its runtime shut down (the store stops it only by
    /// dropping it).
    pub(super) fn ended(&self) -> bool {
        self.task.is_finished()
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

impl PostgresStore {
    /// Deletes expired rows, at most `batch` (at least 1) at a time until none is left, and
    /// returns how many. Rows locked by a claim meanwhile are skipped, never waited for: no
    /// claim waits for a sweep's lock, though a large sweep competes with claims for the
    /// database (BENCHMARKS.md: a sweep of a million rows slowed claims to two thirds).
    ///
    /// # Errors
    ///
    /// When the database cannot be reached.
    pub async fn sweep_expired(&self, batch: u32) -> Result<u64, StoreError> {
        sweep(&self.inner.pool, &self.inner.statements.sweep, batch).await
    }

    /// The in-progress records whose lease lapsed and that no claim took over since: holders
    /// that died or stalled, whose clients have not come back. Each is taken over by its next
    /// retry (within its recovery window); an operator looks at the old ones. With the
    /// `metrics` feature, the store's sweep publishes the same as the gauges
    /// `idempotency_lapsed_claims{table}` and `idempotency_oldest_lapsed_claim_seconds{table}`.
    ///
    /// One statement, which reads every in-progress row: for an operator's dashboard, not a
    /// request path.
    ///
    /// # Errors
    ///
    /// When the database cannot be reached.
    pub async fn lapsed_claims(&self) -> Result<LapsedClaims, StoreError> {
        lapsed(&self.inner.pool, &self.inner.statements.lapsed).await
    }

    /// The abandoned claims, oldest lapse first: in-progress records whose lease lapsed at
    /// least `lapsed_for` ago, within their recovery window, that no claim took over since (a
    /// holder that died or stalled, a client that never came back), at most `limit` of them.
    /// What a [`Completer`](crate::completer::Completer) settles, and an operator looks at.
    ///
    /// # Errors
    ///
    /// When the database cannot be reached, within the command timeout; a row this store did
    /// not write is [`StoreError::CorruptRecord`].
    pub async fn abandoned_claims(
        &self,
        lapsed_for: Duration,
        limit: u32,
    ) -> Result<Vec<AbandonedClaim>, StoreError> {
        let query = sqlx::query_as::<_, (String, Vec<u8>, i64)>(&self.inner.statements.abandoned)
            .bind(millis(lapsed_for))
            .bind(i64::from(limit));
        let rows = bounded(self.command_timeout, query.fetch_all(&self.inner.pool)).await?;
        rows.into_iter()
            .map(|(key, fingerprint, lapsed_ms)| {
                let unreadable =
                    || StoreError::CorruptRecord("an abandoned claim's key or fingerprint".into());
                Ok(AbandonedClaim::new(
                    RecordKey::from_stored(key).ok_or_else(unreadable)?,
                    Fingerprint::from_stored(&fingerprint).ok_or_else(unreadable)?,
                    Duration::from_millis(u64::try_from(lapsed_ms).unwrap_or(0)),
                ))
            })
            .collect()
    }
}
