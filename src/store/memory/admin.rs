//! [`Admin`] for [`MemoryStore`]: under the store's lock, so that each call sees and changes one
//! consistent map.

use std::time::{Duration, Instant};

use super::{MemoryStore, Record, State};
use crate::{
    key::RecordKey,
    store::{
        AbandonedClaim, Admin, Forgotten, Inspection, RecordStatus, StoreError, admin::in_progress,
    },
};

/// Milliseconds from `now` to `deadline`, negative when it has passed.
fn signed_millis(deadline: Instant, now: Instant) -> i64 {
    let millis = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
    match deadline.checked_duration_since(now) {
        Some(ahead) => millis(ahead),
        None => -millis(now - deadline),
    }
}

impl Admin for MemoryStore {
    async fn inspect(
        &self,
        key: &RecordKey,
        with_outcome: bool,
    ) -> Result<Option<Inspection>, StoreError> {
        let now = Instant::now();
        let records = self.lock();
        let Some(record) = records.live(key.as_str(), now) else { return Ok(None) };
        let (state, outcome) = match &record.state {
            State::InProgress { deadline, .. } => {
                (in_progress(signed_millis(*deadline, now)), None)
            }
            State::Completed(outcome) => (RecordStatus::Completed, Some(outcome.clone())),
        };
        Ok(Some(Inspection {
            state,
            time_left: record.expires_at - now,
            size: outcome.as_ref().map_or(0, bytes::Bytes::len),
            waited_for: self.waiters.is_waited(key.as_str()),
            fingerprint: record.fingerprint.clone(),
            outcome: outcome.filter(|_| with_outcome),
        }))
    }

    async fn forget(&self, key: &RecordKey, force: bool) -> Result<Forgotten, StoreError> {
        let now = Instant::now();
        let mut records = self.lock();
        let forgotten = match records.live(key.as_str(), now) {
            None => Forgotten::Absent,
            Some(Record { state: State::InProgress { deadline, .. }, .. })
                if *deadline > now && !force =>
            {
                Forgotten::Running
            }
            Some(_) => {
                records.map.remove(key.as_str());
                Forgotten::Deleted
            }
        };
        drop(records);
        if forgotten == Forgotten::Deleted {
            self.waiters.notify(key.as_str());
        }
        Ok(forgotten)
    }

    async fn abandoned(
        &self,
        lapsed_for: Duration,
        limit: u32,
    ) -> Result<Vec<AbandonedClaim>, StoreError> {
        let now = Instant::now();
        let records = self.lock();
        let mut lapsed: Vec<AbandonedClaim> = records
            .map
            .iter()
            .filter(|(_, record)| record.expires_at > now)
            .filter_map(|(key, record)| match &record.state {
                State::InProgress { deadline, .. } if *deadline <= now => {
                    let lapsed = now - *deadline;
                    let key = RecordKey::from_stored(key.clone())?;
                    (lapsed >= lapsed_for)
                        .then(|| AbandonedClaim::new(key, record.fingerprint.clone(), lapsed))
                }
                _ => None,
            })
            .collect();
        drop(records);
        lapsed.sort_by_key(|claim| std::cmp::Reverse(claim.lapsed_for));
        lapsed.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
        Ok(lapsed)
    }
}
