//! [`Operator`]: the operator's calls on the consumer door (see [`Admin`]), by a consumer's
//! scope and an event's key.

use std::time::Duration;

use crate::{
    engine::{
        Engine, Operations,
        envelope::{Format, Parsed},
    },
    key::RecordKey,
    store::{AbandonedClaim, Admin, Forgotten, KeyReport, StoreError},
};

use super::Idempotent;

impl<St: Admin, H> Idempotent<St, H> {
    /// The operator's calls for the records this door writes (its key prefix, decrypted as it
    /// encrypts). See [`Operator`]. It takes the door as configured when called: call it on
    /// the finished door.
    pub fn operator(&self) -> Operator<St> {
        let engine = Engine::new(self.store.clone(), self.settings.clone(), &self.renewals);
        Operator(Operations::new(engine, self.prefix.clone()))
    }
}

/// The operator's calls on the consumer door (see [`Admin`]), by a consumer's scope and an
/// event's key ([`Idempotent::operator`]).
///
/// Cloning is cheap.
#[derive(Debug, Clone)]
pub struct Operator<St>(Operations<St>);

impl<St: Admin> Operator<St> {
    /// What the store holds for `key` in `scope` (as [`Idempotent::run`] was given them): its
    /// state, its time left and size, whether a duplicate waits for it, how long ago it
    /// completed; the stored result, as JSON, only when `with_result`. A result that ran but
    /// could not be stored is `{"result_not_stored": "<why>"}`.
    ///
    /// # Errors
    ///
    /// The store's; [`StoreError::CorruptRecord`] when the record cannot be read (or
    /// decrypted), or was not written by this door.
    pub async fn inspect(
        &self,
        scope: &str,
        key: impl AsRef<[u8]>,
        with_result: bool,
    ) -> Result<Option<KeyReport<serde_json::Value>>, StoreError> {
        let reader = |opened: Parsed| match opened.format {
            Format::Json => serde_json::from_slice(&opened.payload)
                .map_err(|error| StoreError::CorruptRecord(error.to_string())),
            Format::NotStored => Ok(serde_json::json!({
                "result_not_stored": String::from_utf8_lossy(&opened.payload),
            })),
            _ => Err(StoreError::CorruptRecord("not a result the consumer door stored".into())),
        };
        self.0.report(&self.record_key(scope, key.as_ref()), with_result, reader).await
    }

    /// Deletes the record of `key` in `scope`, so that its next delivery runs the operation
    /// as new (see [`Admin::forget`]): one in progress whose lease runs only when `force`.
    ///
    /// # Errors
    ///
    /// The store's.
    pub async fn forget(
        &self,
        scope: &str,
        key: impl AsRef<[u8]>,
        force: bool,
    ) -> Result<Forgotten, StoreError> {
        self.0.forget(&self.record_key(scope, key.as_ref()), force).await
    }

    /// The claims whose lease lapsed at least `lapsed_for` ago and that nobody took over,
    /// oldest first, at most `limit` (see [`Admin::abandoned`]): of every door over this
    /// store, each named by its record key.
    ///
    /// # Errors
    ///
    /// The store's.
    pub async fn abandoned(
        &self,
        lapsed_for: Duration,
        limit: u32,
    ) -> Result<Vec<AbandonedClaim>, StoreError> {
        self.0.abandoned(lapsed_for, limit).await
    }
}

impl<St, H> Idempotent<St, H> {
    /// The record key of `key` in `scope`: where [`run`](Self::run) keeps its record.
    pub(super) fn record_key(&self, scope: &str, key: &[u8]) -> RecordKey {
        RecordKey::new(&self.prefix, scope.as_bytes(), key)
    }
}

impl<St> Operator<St> {
    /// The record key of `key` in `scope`, as the door names it.
    fn record_key(&self, scope: &str, key: &[u8]) -> RecordKey {
        self.0.record_key(scope.as_bytes(), key)
    }
}
