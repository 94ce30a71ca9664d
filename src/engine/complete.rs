//! An abandoned claim completed from the system of record, for the completer: the door's
//! recovery hook asked with the claim's key and fingerprint, what it knows stored as the door
//! stores a recovered outcome (its encoding, its encryption, its retention), after a takeover
//! fenced as any.

use std::{future::Future, panic::AssertUnwindSafe, sync::Arc, time::Duration};

use futures_util::FutureExt as _;

use super::{Door, Engine, Held};
use crate::{
    context::{Completion, IdempotencyContext},
    hashing::Named,
    recovery::{BoxError, Recovered},
    store::{AbandonedClaim, Claim, CommitSlot, Fenced, Lease, OwnerToken, Store},
};

/// What the [`Completer`](crate::completer::Completer) did with one abandoned claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Completed {
    /// The recovery hook knew its outcome: stored, and every retry replays it.
    Settled,
    /// The recovery hook knew nothing of it (or found another request's outcome under its
    /// key): left as it was for its client's retry, and reported.
    Unresolved,
    /// The recovery hook or the store failed: left as it was, tried again on the next pass.
    Failed,
    /// A retry took (or settled) the claim between the listing and the completer's takeover.
    Skipped,
}

impl Completed {
    /// Its name, as the metric `idempotency_abandoned_claims_total{result}` labels it:
    /// `settled`, `unresolved`, `failed`, `skipped`.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Settled => "settled",
            Self::Unresolved => "unresolved",
            Self::Failed => "failed",
            Self::Skipped => "skipped",
        }
    }
}

/// How long the completer holds a claim it took over, between its takeover and its store.
const TAKEOVER_LEASE: Duration = Duration::from_secs(30);

impl<St: Store> Engine<St> {
    /// Completes `claim` from the system of record: `ask` gets the claim's context (its key,
    /// its fingerprint, the door's encoding; no scope, no request) and asks the door's
    /// recovery hook, within the recovery timeout; an outcome it knows is encoded by `door`,
    /// then stored after a takeover with the claim's own fingerprint, under a fresh owner.
    pub(crate) async fn complete_abandoned<D, L>(
        &self,
        door: &D,
        claim: AbandonedClaim,
        ask: impl FnOnce(IdempotencyContext) -> L,
    ) -> Completed
    where
        D: Door,
        L: Future<Output = Result<Recovered<D::Recovered>, BoxError>>,
    {
        let AbandonedClaim { key, fingerprint, lapsed_for, .. } = claim;
        let (hash, lapsed_ms) = (key.hash(), lapsed_for.as_millis());
        let settings = &self.settings;
        let owner = OwnerToken::random();
        let completion = Completion::new(
            (owner.clone(), None),
            (settings.retention, settings.lease()),
            Arc::new(CommitSlot::default()),
            settings.at_rest.clone(),
            door.encoding(),
            door.durable(),
        );
        let named = Named::stored(key.clone(), fingerprint.clone(), &settings.hashing);
        let plain = named.plain.clone();
        let context = IdempotencyContext::new(Vec::new(), named, true, Some(completion));
        let asked = AssertUnwindSafe(ask(context)).catch_unwind();
        let failure = match tokio::time::timeout(settings.recovery.timeout, asked).await {
            Ok(Ok(Ok(Recovered::Happened(outcome)))) => {
                let (retention, fingerprint) = (settings.retention, fingerprint.clone());
                let held =
                    Held { key: key.clone(), fingerprint, retention, alongside: None, plain };
                let recorded =
                    std::panic::catch_unwind(AssertUnwindSafe(|| door.recorded(&outcome, &held)));
                match recorded {
                    Ok(Ok(record)) => {
                        return self.settle_abandoned(&key, &held.fingerprint, record).await;
                    }
                    _ => "the door's encoding of the outcome panicked".to_owned(),
                }
            }
            Ok(Ok(Ok(Recovered::Unknown | Recovered::Mismatch))) => {
                tracing::warn!(
                    key_hash = hash,
                    lapsed_ms,
                    "idempotency: an abandoned claim the system of record knows nothing of; it waits for its client's retry"
                );
                return Completed::Unresolved;
            }
            Ok(Ok(Err(error))) => error.to_string(),
            Ok(Err(_panic)) => "the recovery hook panicked".to_owned(),
            Err(_) => format!("no answer within {:?}", settings.recovery.timeout),
        };
        tracing::error!(key_hash = hash, failure, "idempotency: the completer's recovery failed");
        Completed::Failed
    }

    /// Takes the abandoned claim of `key` over and stores `record` for it.
    async fn settle_abandoned(
        &self,
        key: &crate::key::RecordKey,
        fingerprint: &crate::fingerprint::Fingerprint,
        record: bytes::Bytes,
    ) -> Completed {
        let (settings, hash) = (&self.settings, key.hash());
        let stored = settings.at_rest.seal(key, fingerprint, record);
        let owner = OwnerToken::random();
        let lease = Lease::new(TAKEOVER_LEASE).recovery_window(settings.lease().recovery_window);
        match self.store.claim(key, fingerprint, &owner, lease).await {
            Ok(Claim::TakenOver | Claim::Claimed) => {}
            Ok(_) => return Completed::Skipped,
            Err(error) => {
                tracing::warn!(key_hash = hash, %error, "idempotency: the completer's takeover failed");
                return Completed::Failed;
            }
        }
        match self.store.complete(key, &owner, fingerprint, stored, settings.retention).await {
            Ok(Fenced::Applied) => {
                tracing::info!(
                    key_hash = hash,
                    "idempotency: an abandoned claim was settled from the system of record"
                );
                Completed::Settled
            }
            Ok(Fenced::Rejected) => Completed::Skipped,
            Err(error) => {
                // The takeover's lease lapses: the claim is abandoned again, for the next pass.
                tracing::warn!(key_hash = hash, %error, "idempotency: the completer's store failed");
                Completed::Failed
            }
        }
    }
}
