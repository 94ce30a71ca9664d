//! [`Operator`]: the operator's calls on the consumer door (see [`Admin`]), by a consumer's
//! scope and an event's key.

use std::{fmt, marker::PhantomData, sync::Arc, time::Duration};

use bytes::Bytes;
use serde::{Serialize, de::DeserializeOwned};

use crate::{
    completer::Completer,
    engine::{
        Engine, Label,
        envelope::{Format, Parsed},
    },
    key::RecordKey,
    recovery::{Lookup, Recover},
    store::{AbandonedClaim, Admin, Forgotten, KeyReport, StoreError},
};

use super::{Idempotent, door::ConsumerDoor};

impl<St: Admin, H> Idempotent<St, H> {
    /// The operator's calls for the records this door writes (its key prefix, decrypted as it
    /// encrypts). See [`Operator`]. It takes the door as configured when called: call it on
    /// the finished door.
    pub fn operator(&self) -> Operator<St> {
        let engine = Engine::new(self.store.clone(), self.settings.clone(), &self.renewals);
        Operator { engine, prefix: self.prefix.clone(), stored_limit: self.stored_limit }
    }
}

/// The operator's calls on the consumer door (see [`Admin`]), by a consumer's scope and an
/// event's key ([`Idempotent::operator`]).
///
/// Cloning is cheap.
#[derive(Clone)]
pub struct Operator<St> {
    engine: Engine<St>,
    prefix: String,
    stored_limit: usize,
}

impl<St> fmt::Debug for Operator<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Operator").field("prefix", &self.prefix).finish_non_exhaustive()
    }
}

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
        self.engine.report(&self.record_key(scope, key.as_ref()), with_result, reader).await
    }

    /// Announces this door to its fleet's registry and says whether it may serve beside it
    /// (see [`crate::hashing`]): for a readiness check at start, so that an instance of a
    /// skipped deploy is kept out of the rotation rather than answering 503 to every
    /// request. Each request checks the same, once known without a round trip.
    ///
    /// # Errors
    ///
    /// [`StoreError::Misplaced`] (saying which step of a move is missing) when the door cannot
    /// serve beside its fleet; the store's when its registry cannot be read.
    pub async fn check_fleet(&self) -> Result<(), StoreError> {
        self.engine.check_fleet(&self.record_key("", b"")).await
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
        self.engine.forget(&self.record_key(scope, key.as_ref()), force).await
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
        self.engine.store().abandoned(lapsed_for, limit).await
    }

    /// A [`Completer`] of this door's abandoned claims, asking `hook` (the door's own recovery
    /// hook, or any [`Recover`] of its results `T`: `DurableOutcomes` too) with each claim's
    /// context and no payload, and storing the result it knows as the door stores a recovered
    /// one: its encryption at rest, its retention.
    pub fn completer<T, H>(&self, hook: H) -> Completer<St>
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        H: Recover<Bytes, T>,
    {
        let door = ConsumerDoor::<T> {
            stored_limit: self.stored_limit,
            label: Label::scope("completer"),
            durable: hook.durable(),
            result: PhantomData,
        };
        let hook = Arc::new(hook);
        let ask = move |context| {
            let hook = hook.clone();
            async move { hook.recover(Lookup::new(context, None)).await }
        };
        Completer::new(self.engine.clone(), &self.prefix, door, ask)
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
        RecordKey::new(&self.prefix, scope.as_bytes(), key)
    }
}
