//! An operator's look at one record through a front door: the store's [`Inspection`], the
//! outcome decrypted and its envelope read.

use std::time::SystemTime;

use super::{
    Engine,
    envelope::{self, Parsed},
};
use crate::{
    key::RecordKey,
    placement::{self, Phase},
    store::{Admin, Forgotten, KeyReport, StoreError},
};

impl<St: Admin> Engine<St> {
    /// The record keys of a plain one: under the names the door claims first, and under the
    /// names (or in the placement, its store's) a move goes to.
    fn record_keys(&self, plain: &RecordKey) -> (RecordKey, Option<RecordKey>) {
        let (ours, alongside) = self.settings.hashing.record_keys(plain);
        let placed = || self.store().moves(&ours).map(|_| ours.in_next_placement());
        let alongside = alongside.or_else(placed);
        (ours, alongside)
    }

    /// What the store holds under `key`, and the outcome as the door wrote it (decrypted, its
    /// envelope read) when it is completed. The outcome is read to tell its age, even when the
    /// caller does not ask for it; `reader` turns it into what the door answers, and is
    /// called only when `with_outcome`.
    ///
    /// `plain` is the key's plain record key: the record is looked for under the names the
    /// door claims with, then under the names alongside ([`crate::hashing`]).
    pub(crate) async fn report<T>(
        &self,
        plain: &RecordKey,
        with_outcome: bool,
        reader: impl FnOnce(Parsed) -> Result<T, StoreError>,
    ) -> Result<Option<KeyReport<T>>, StoreError> {
        let (ours, alongside) = self.record_keys(plain);
        let mut found = self.store().inspect(&ours, true).await?.map(|record| (ours, record));
        if let (None, Some(other)) = (&found, alongside) {
            found = self.store().inspect(&other, true).await?.map(|record| (other, record));
        }
        let Some((key, mut record)) = found else { return Ok(None) };
        let key = &key;
        let stored = record.outcome.take();
        // Only a completed record has an outcome.
        let opened = match stored {
            Some(stored) => {
                let opened = self.settings.at_rest.open(key, &record.fingerprint, stored)?;
                Some(envelope::read(opened).ok_or_else(|| {
                    StoreError::CorruptRecord("no front door's outcome".to_owned())
                })?)
            }
            None => None,
        };
        let completed_ago = opened
            .as_ref()
            .map(|opened| opened.completed_at)
            .map(|at| SystemTime::now().duration_since(at).unwrap_or_default());
        let outcome = match opened {
            Some(opened) if with_outcome => Some(reader(opened)?),
            _ => None,
        };
        Ok(Some(KeyReport { key_hash: key.hash().to_owned(), record, completed_ago, outcome }))
    }

    /// Deletes the record of the key whose plain record key is `plain`, under the names the
    /// door claims with and under the names alongside ([`crate::hashing`]): a record left under
    /// either would still answer the key. One whose lease runs is refused
    /// ([`Forgotten::Running`]) unless `force`: under the names claimed with, before anything
    /// is deleted; under the names alongside, after the first is. Refused
    /// ([`StoreError::Misplaced`]) when the fleet's registry lists an instance that reads
    /// names this door's naming does not (forget through a build of the move).
    pub(crate) async fn forget(
        &self,
        plain: &RecordKey,
        force: bool,
    ) -> Result<Forgotten, StoreError> {
        // Refused when an instance reads names this operator does not: the record under them
        // would still answer the key.
        let registry = placement::registry(plain.prefix());
        let phase = Phase::of_door(&self.settings.hashing, self.store().placement())
            .map_err(StoreError::Misplaced)?;
        if let Some(listed) = self.store().announce(&registry, &[]).await?
            && let Some(why) = placement::uncovered(&phase, &listed)
        {
            return Err(StoreError::Misplaced(why));
        }
        let (ours, alongside) = self.record_keys(plain);
        let forgotten = self.store().forget(&ours, force).await?;
        let Some(other) = alongside.filter(|_| forgotten != Forgotten::Running) else {
            return Ok(forgotten);
        };
        Ok(match self.store().forget(&other, force).await? {
            Forgotten::Absent => forgotten,
            other => other,
        })
    }
}
