//! An operator's look at one record through a front door: the store's [`Inspection`], the
//! outcome decrypted and its envelope read.

use std::time::SystemTime;

use super::{
    Engine,
    envelope::{self, Parsed},
};
use crate::{
    key::RecordKey,
    store::{Admin, KeyReport, StoreError},
};

impl<St: Admin> Engine<St> {
    /// What the store holds under `key`, and the outcome as the door wrote it (decrypted, its
    /// envelope read) when it is completed. The outcome is read to tell its age, even when the
    /// caller does not ask for it; `reader` turns it into what the door answers, and is
    /// called only when `with_outcome`.
    pub(crate) async fn report<T>(
        &self,
        key: &RecordKey,
        with_outcome: bool,
        reader: impl FnOnce(Parsed) -> Result<T, StoreError>,
    ) -> Result<Option<KeyReport<T>>, StoreError> {
        let Some(mut record) = self.store().inspect(key, true).await? else { return Ok(None) };
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
}
