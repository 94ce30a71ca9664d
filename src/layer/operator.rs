//! [`Operator`]: the operator's calls on the records an [`IdempotencyLayer`] writes.

use std::{fmt, marker::PhantomData, sync::Arc};

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, Request, Response};

#[cfg(doc)]
use super::{
    IdempotencyLayer,
    scope::{GlobalScope, ScopeExtractor},
};
use super::{config::Config, door::HttpDoor, record};
use crate::{
    completer::Completer,
    engine::{Engine, Label},
    key::RecordKey,
    recovery::{Lookup, Recover},
    store::{AbandonedClaim, Admin, Forgotten, KeyReport, StoreError},
};

/// The operator's calls (see [`Admin`]), by a client's scope and key: what a support tool or an
/// admin route holds ([`IdempotencyLayer::operator`]). Each answers for the records its layer
/// writes (its key prefix), and decrypts what it encrypts.
///
/// Cloning is cheap.
#[derive(Clone)]
pub struct Operator<St> {
    engine: Engine<St>,
    config: Arc<Config>,
}

impl<St> Operator<St> {
    pub(super) fn new(engine: Engine<St>, config: Arc<Config>) -> Self {
        Self { engine, config }
    }
}

impl<St> fmt::Debug for Operator<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Operator").field("prefix", &self.config.prefix).finish_non_exhaustive()
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
        self.engine.report(&self.record_key(scope, key), with_response, reader).await
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
        self.engine.check_fleet(&self.record_key(b"", "")).await
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
        self.engine.forget(&self.record_key(scope, key), force).await
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
        self.engine.store().abandoned(lapsed_for, limit).await
    }

    /// A [`Completer`] of this layer's abandoned claims, asking `hook` (the layer's own
    /// recovery hook, or any [`Recover`] of the HTTP door: `DurableOutcomes` too) with each
    /// claim's context and no request, and storing what it knows as the layer stores a
    /// recovered response: its header filter, its encryption at rest, its retention.
    pub fn completer<H>(&self, hook: H) -> Completer<St>
    where
        H: Recover<Request<Bytes>, Response<Bytes>>,
    {
        let door = HttpDoor::<Body> {
            config: self.config.clone(),
            route: Label::route("completer"),
            span: tracing::Span::none(),
            rebuild_timeout: self.engine.recovery_timeout(),
            scope: Vec::new(),
            body: PhantomData,
        };
        let hook = Arc::new(hook);
        let ask = move |context| {
            let hook = hook.clone();
            async move {
                let found = hook.recover(Lookup::new(context, None)).await?;
                Ok(found.map(|response| (response, HeaderMap::new())))
            }
        };
        Completer::new(self.engine.clone(), &self.config.prefix, door, ask)
    }

    fn record_key(&self, scope: &[u8], key: &str) -> RecordKey {
        RecordKey::new(&self.config.prefix, scope, key.as_bytes())
    }
}
