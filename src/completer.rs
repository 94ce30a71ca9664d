//! [`Completer`]: settles abandoned claims (a holder that died, a client that never came back)
//! from the system of record when it knows the outcome, and reports those it cannot, so that
//! "stuck in progress" is something an operator sees, not something a client discovers.
//!
//! It works over [`PostgresStore`], which can list its abandoned claims
//! ([`PostgresStore::abandoned_claims`]). A claim is abandoned only while its record outlives
//! its lease: within the recovery window that a door keeps when it has a recovery hook
//! (`IdempotencyLayer::recover`, `Idempotent::recover`). The completer asks the app's resolver
//! what became of each (typically the same lookup as the hook, by the key hash); a known
//! outcome is stored (after a takeover, fenced as any) and every retry replays it; an unknown
//! one is left for its client's retry, and reported:
//!
//! - a warning naming the key hash and how long ago its lease lapsed;
//! - with the `metrics` feature, `idempotency_abandoned_claims_total{result}`, `result` =
//!   `settled`, `unresolved`, `failed` (the resolver or the store failed), `skipped` (a retry
//!   took it meanwhile).

use std::{future::Future, time::Duration};

use bytes::Bytes;
use http::Response;
use serde::Serialize;

use crate::{
    at_rest::AtRest,
    consumer,
    engine::observe,
    http::record::{self, HeaderFilter},
    recovery::BoxError,
    store::{AbandonedClaim, Claim, EncodeError, Fenced, Lease, OwnerToken, PostgresStore, Store},
};

/// What the system of record says became of an abandoned claim's operation.
#[derive(Debug, Clone)]
pub struct Resolution {
    outcome: Option<Bytes>,
}

impl Resolution {
    /// Nothing is known: the claim is left for its client's retry, and reported.
    #[must_use]
    pub fn unknown() -> Self {
        Self { outcome: None }
    }

    /// The HTTP handler's operation happened, and this is its response, stored as the layer
    /// stores one with its default header filter (without `Set-Cookie`, `Date`, hop-by-hop
    /// headers and `Content-Length`) and replayed to every retry.
    #[must_use]
    pub fn response(response: &Response<Bytes>) -> Self {
        let filter = HeaderFilter::default();
        let stored =
            record::encode(response.status(), response.headers(), &filter, response.body());
        Self { outcome: Some(stored) }
    }

    /// The consumer door's operation happened, with this result, stored as the door stores
    /// one and replayed to every redelivery.
    ///
    /// # Errors
    ///
    /// [`EncodeError::Unencodable`] when serde cannot encode `value`, or it holds NaN or an
    /// infinity.
    pub fn value<T: Serialize>(value: &T) -> Result<Self, EncodeError> {
        Ok(Self { outcome: Some(consumer::stored_form(value)?) })
    }
}

/// What one pass of [`Completer::complete_abandoned`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Pass {
    /// Claims whose outcome the resolver knew, now stored.
    pub settled: usize,
    /// Claims the resolver knew nothing of: left as they were, and reported.
    pub unresolved: usize,
    /// Claims the resolver or the store failed on: left as they were, tried again next pass.
    pub failed: usize,
    /// Claims a retry took (or settled) between the listing and the completer's takeover.
    pub skipped: usize,
}

/// Settles abandoned claims from the system of record, or reports them (see the
/// [module](self)).
///
/// ```no_run
/// # async fn run(store: axum_idempotency::store::PostgresStore) {
/// use std::time::Duration;
/// use axum_idempotency::completer::{Completer, Resolution};
///
/// let completer = Completer::new(store, |claim: axum_idempotency::store::AbandonedClaim| async move {
///     // SELECT status, body FROM idempotency_outbox WHERE key_hash = claim.key.hash()
///     let found: Option<(u16, Vec<u8>)> = None;
///     Ok::<_, axum_idempotency::recovery::BoxError>(match found {
///         Some((status, body)) => {
///             let response = http::Response::builder().status(status).body(body.into())?;
///             Resolution::response(&response)
///         }
///         None => Resolution::unknown(),
///     })
/// });
/// let _task = completer.spawn(Duration::from_secs(60));
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Completer<F> {
    store: PostgresStore,
    resolve: F,
    lapsed_for: Duration,
    batch: u32,
    retention: Duration,
    at_rest: AtRest,
}

/// How long the completer holds a claim it took over, between its takeover and its store.
const TAKEOVER_LEASE: Duration = Duration::from_secs(30);

impl<F, Fut> Completer<F>
where
    F: Fn(AbandonedClaim) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Resolution, BoxError>> + Send,
{
    /// A completer over `store`, asking `resolve` what became of each abandoned claim.
    /// Defaults: claims lapsed a minute ago or more, 100 a pass, outcomes kept 24 hours.
    pub fn new(store: PostgresStore, resolve: F) -> Self {
        let (lapsed_for, retention) = (Duration::from_secs(60), Duration::from_secs(24 * 3600));
        Self { store, resolve, lapsed_for, batch: 100, retention, at_rest: AtRest::default() }
    }

    /// Only claims whose lease lapsed at least this long ago: give a client time to retry
    /// first (its retry takes the claim over and asks the door's own hook). Defaults to a
    /// minute.
    #[must_use]
    pub fn lapsed_for(mut self, lapsed_for: Duration) -> Self {
        self.lapsed_for = lapsed_for;
        self
    }

    /// At most this many claims a pass. Defaults to 100.
    #[must_use]
    pub fn batch(mut self, batch: u32) -> Self {
        self.batch = batch;
        self
    }

    /// How long a settled outcome is kept; the door's retention. Defaults to 24 hours.
    #[must_use]
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Encrypts the outcomes it stores under `keyring`, as the door's own
    /// `encrypt_at_rest` does: give it the door's keyring.
    #[cfg(feature = "encryption")]
    #[must_use]
    pub fn encrypt_at_rest(mut self, keyring: crate::encryption::Keyring) -> Self {
        self.at_rest = AtRest::encrypted(keyring);
        self
    }

    /// One pass: lists the abandoned claims, asks the resolver about each, and stores what it
    /// knows (a takeover with the claim's own fingerprint, then a fenced complete).
    ///
    /// # Errors
    ///
    /// When the listing fails; a failure on one claim is counted in [`Pass::failed`].
    pub async fn complete_abandoned(&self) -> Result<Pass, crate::store::StoreError> {
        let mut pass = Pass::default();
        for claim in self.store.abandoned_claims(self.lapsed_for, self.batch).await? {
            let result = self.settle(claim).await;
            match result {
                "settled" => pass.settled += 1,
                "unresolved" => pass.unresolved += 1,
                "skipped" => pass.skipped += 1,
                _ => pass.failed += 1,
            }
            observe::abandoned(result);
        }
        Ok(pass)
    }

    /// Runs a pass every `every`, for as long as the task runs; errors are logged.
    pub fn spawn(self, every: Duration) -> tokio::task::JoinHandle<()>
    where
        Fut: 'static,
    {
        tokio::spawn(async move {
            loop {
                if let Err(error) = self.complete_abandoned().await {
                    tracing::warn!(%error, "idempotency: the completer could not list abandoned claims");
                }
                tokio::time::sleep(every).await;
            }
        })
    }

    /// Settles one claim; the result's metric label.
    async fn settle(&self, claim: AbandonedClaim) -> &'static str {
        let (key, fingerprint) = (claim.key.clone(), claim.fingerprint.clone());
        let (hash, lapsed_ms) = (key.hash(), claim.lapsed_for.as_millis());
        let outcome = match (self.resolve)(claim).await {
            Ok(Resolution { outcome: Some(outcome) }) => outcome,
            Ok(Resolution { outcome: None }) => {
                tracing::warn!(
                    key_hash = hash,
                    lapsed_ms,
                    "idempotency: an abandoned claim the system of record knows nothing of; it waits for its client's retry"
                );
                return "unresolved";
            }
            Err(error) => {
                tracing::error!(key_hash = hash, %error, "idempotency: the completer's resolver failed");
                return "failed";
            }
        };
        let outcome = self.at_rest.seal(&key, &fingerprint, outcome);
        let owner = OwnerToken::random();
        let lease = Lease::new(TAKEOVER_LEASE).recovery_window(self.retention);
        match self.store.claim(&key, &fingerprint, &owner, lease).await {
            Ok(Claim::TakenOver | Claim::Claimed) => {}
            Ok(_) => return "skipped",
            Err(error) => {
                tracing::warn!(key_hash = hash, %error, "idempotency: the completer's takeover failed");
                return "failed";
            }
        }
        match self.store.complete(&key, &owner, &fingerprint, outcome, self.retention).await {
            Ok(Fenced::Applied) => {
                tracing::info!(
                    key_hash = hash,
                    "idempotency: an abandoned claim was settled from the system of record"
                );
                "settled"
            }
            Ok(Fenced::Rejected) => "skipped",
            Err(error) => {
                // The takeover's lease lapses: the claim is abandoned again, for the next pass.
                tracing::warn!(key_hash = hash, %error, "idempotency: the completer's store failed");
                "failed"
            }
        }
    }
}
