//! [`Admin`] for [`PostgresStore`]: one statement a call, by the database's clock.

use std::time::Duration;

use bytes::Bytes;

use super::{PostgresStore, bounded};
use crate::{
    fingerprint::Fingerprint,
    key::RecordKey,
    store::{
        AbandonedClaim, Admin, Forgotten, Inspection, RecordStatus, StoreError, admin::in_progress,
    },
};

type InspectRow = (String, Vec<u8>, i32, Option<Vec<u8>>, i64, Option<i64>, bool);

impl Admin for PostgresStore {
    async fn inspect(
        &self,
        key: &RecordKey,
        with_outcome: bool,
    ) -> Result<Option<Inspection>, StoreError> {
        let query = sqlx::query_as::<_, InspectRow>(&self.inner.statements.inspect)
            .bind(key.as_str())
            .bind(with_outcome);
        let Some(row) =
            bounded(self.command_timeout, query.fetch_optional(&self.inner.pool)).await?
        else {
            return Ok(None);
        };
        let (state, fingerprint, size, outcome, time_left_ms, lease_left_ms, waited) = row;
        let unreadable = || StoreError::CorruptRecord("an inspected record's row".into());
        let state = match (state.as_str(), lease_left_ms) {
            ("C", _) => RecordStatus::Completed,
            ("P", Some(lease_left_ms)) => in_progress(lease_left_ms),
            _ => return Err(unreadable()),
        };
        Ok(Some(Inspection {
            state,
            time_left: Duration::from_millis(u64::try_from(time_left_ms).unwrap_or(0)),
            size: usize::try_from(size).unwrap_or(0),
            waited_for: waited && state != RecordStatus::Completed,
            fingerprint: Fingerprint::from_stored(&fingerprint).ok_or_else(unreadable)?,
            outcome: outcome.map(Bytes::from),
        }))
    }

    async fn forget(&self, key: &RecordKey, force: bool) -> Result<Forgotten, StoreError> {
        let query = sqlx::query_as::<_, (i32, i32, bool)>(&self.inner.statements.forget)
            .bind(key.as_str())
            .bind(force);
        let (found, gone, waited) =
            bounded(self.command_timeout, query.fetch_one(&self.inner.pool)).await?;
        if waited {
            // As a settle does: the waiters claim again, and run.
            let notify = sqlx::query("SELECT pg_notify($1, $2)")
                .bind(&self.inner.statements.channel)
                .bind(key.as_str());
            bounded(self.command_timeout, notify.execute(&self.inner.pool)).await?;
        }
        Ok(match (found, gone) {
            (0, _) => Forgotten::Absent,
            (_, 0) => Forgotten::Running,
            _ => Forgotten::Deleted,
        })
    }

    async fn abandoned(
        &self,
        lapsed_for: Duration,
        limit: u32,
    ) -> Result<Vec<AbandonedClaim>, StoreError> {
        self.abandoned_claims(lapsed_for, limit).await
    }
}
