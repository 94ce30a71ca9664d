//! What a door's operator holds ([`Operations`]), and its look at one record: the store's
//! [`Inspection`], the outcome decrypted and its envelope read.

use std::{
    fmt,
    time::{Duration, SystemTime},
};

use super::{
    Engine,
    envelope::{self, Parsed},
};
use crate::{
    key::RecordKey,
    store::{AbandonedClaim, Admin, Forgotten, KeyReport, StoreError},
};

/// What a door's `Operator` holds: the engine over the door's records (their store, decrypted
/// as the door encrypts) and their key prefix. Each door's `Operator` wraps it and says how its
/// world names a record and reads an outcome.
#[derive(Clone)]
pub(crate) struct Operations<St> {
    engine: Engine<St>,
    prefix: String,
}

impl<St> fmt::Debug for Operations<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Operator").field("prefix", &self.prefix).finish_non_exhaustive()
    }
}

impl<St> Operations<St> {
    pub(crate) fn new(engine: Engine<St>, prefix: String) -> Self {
        Self { engine, prefix }
    }

    /// The record key of `key` in `scope`, under the door's prefix.
    pub(crate) fn record_key(&self, scope: &[u8], key: &[u8]) -> RecordKey {
        RecordKey::new(&self.prefix, scope, key)
    }
}

impl<St: Admin> Operations<St> {
    /// See [`Engine::report`].
    pub(crate) async fn report<T>(
        &self,
        key: &RecordKey,
        with_outcome: bool,
        reader: impl FnOnce(Parsed) -> Result<T, StoreError>,
    ) -> Result<Option<KeyReport<T>>, StoreError> {
        self.engine.report(key, with_outcome, reader).await
    }

    /// See [`Admin::forget`].
    pub(crate) async fn forget(
        &self,
        key: &RecordKey,
        force: bool,
    ) -> Result<Forgotten, StoreError> {
        self.engine.store().forget(key, force).await
    }

    /// See [`Admin::abandoned`].
    pub(crate) async fn abandoned(
        &self,
        lapsed_for: Duration,
        limit: u32,
    ) -> Result<Vec<AbandonedClaim>, StoreError> {
        self.engine.store().abandoned(lapsed_for, limit).await
    }
}

impl<St: Admin> Engine<St> {
    /// What the store holds under `key`, and the outcome as the door wrote it (decrypted, its
    /// envelope read) when it is completed. The outcome is read to tell its age, even when the
    /// caller does not ask for it; `reader` turns it into what the door answers, and is
    /// called only when `with_outcome`.
    async fn report<T>(
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
