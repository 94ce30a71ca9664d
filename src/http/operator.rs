//! [`Operator`]: the operator's calls on the records an [`IdempotencyLayer`] writes.

use super::record;
#[cfg(doc)]
use super::{
    IdempotencyLayer,
    scope::{GlobalScope, ScopeExtractor},
};
use crate::{
    engine::{Engine, Operations},
    key::RecordKey,
    store::{AbandonedClaim, Admin, Forgotten, KeyReport, StoreError},
};

/// The operator's calls (see [`Admin`]), by a client's scope and key: what a support tool or an
/// admin route holds ([`IdempotencyLayer::operator`]). Each answers for the records its layer
/// writes (its key prefix), and decrypts what it encrypts.
///
/// Cloning is cheap.
#[derive(Debug, Clone)]
pub struct Operator<St>(Operations<St>);

impl<St> Operator<St> {
    pub(super) fn new(engine: Engine<St>, prefix: String) -> Self {
        Self(Operations::new(engine, prefix))
    }
}

impl<St: Admin> Operator<St> {
    /// What the store holds for `key` in `scope` (the scope's bytes, as the layer's
    /// [`ScopeExtractor`] gives them; empty for [`GlobalScope`]; `key` as the client sent it,
    /// unquoted): its state, its time left and size, whether a duplicate waits for it, how
    /// long ago it completed; the stored response only when `with_response`.
    ///
    /// # Errors
    ///
    /// The store's; [`StoreError::CorruptRecord`] when the record cannot be read (or
    /// decrypted).
    pub async fn inspect(
        &self,
        scope: &[u8],
        key: &str,
        with_response: bool,
    ) -> Result<Option<KeyReport<http::Response<bytes::Bytes>>>, StoreError> {
        let reader = |opened| {
            let stored = record::decode_parsed(opened)
                .map_err(|error| StoreError::CorruptRecord(error.0.to_owned()))?;
            let mut response = http::Response::new(stored.body);
            *response.status_mut() = stored.status;
            *response.headers_mut() = stored.headers;
            Ok(response)
        };
        self.0.report(&self.record_key(scope, key), with_response, reader).await
    }

    /// Deletes the record of `key` in `scope`, so that the client's next retry runs its
    /// request as new (see [`Admin::forget`]): one in progress whose lease runs only when
    /// `force`.
    ///
    /// # Errors
    ///
    /// The store's.
    pub async fn forget(
        &self,
        scope: &[u8],
        key: &str,
        force: bool,
    ) -> Result<Forgotten, StoreError> {
        self.0.forget(&self.record_key(scope, key), force).await
    }

    /// The claims whose lease lapsed at least `lapsed_for` ago and that nobody took over, oldest
    /// first, at most `limit` (see [`Admin::abandoned`]): of every door over this store, each
    /// named by its record key (the prefix, then the key hash; the store never keeps a
    /// client's key).
    ///
    /// # Errors
    ///
    /// The store's.
    pub async fn abandoned(
        &self,
        lapsed_for: std::time::Duration,
        limit: u32,
    ) -> Result<Vec<AbandonedClaim>, StoreError> {
        self.0.abandoned(lapsed_for, limit).await
    }

    fn record_key(&self, scope: &[u8], key: &str) -> RecordKey {
        self.0.record_key(scope, key.as_bytes())
    }
}
