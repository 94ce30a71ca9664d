//! Settling a claim: complete and release, fenced by the owner token, retried in the
//! background when the store fails.

use super::observe::Label;
use std::{future::Future, time::Duration};

use tokio_util::task::TaskTracker;

use bytes::Bytes;

use super::observe;
use crate::{
    fingerprint::Fingerprint,
    key::RecordKey,
    store::{Fenced, Lease, OwnerToken, Store, StoreError},
};

/// How often, and how far apart, a failed `release` is tried again.
const SETTLE_RETRIES: [Duration; 3] =
    [Duration::from_millis(50), Duration::from_millis(200), Duration::from_millis(800)];

/// The first and the longest pause between tries of a `complete` the store failed: short, so
/// that the outcome lands soon after a stall ends, well within the lease.
const COMPLETE_FIRST_DELAY: Duration = Duration::from_millis(50);
const COMPLETE_LONGEST_DELAY: Duration = Duration::from_millis(250);

/// What became of a complete.
#[must_use]
pub(super) enum Completed {
    /// The store answered.
    Settled(Fenced),
    /// The store never answered while the claim was held: the last error.
    GaveUp(StoreError),
}

impl Completed {
    /// Counts and logs what became of the complete; what the store answered, if it did.
    pub(super) fn report(self, hash: &str, route: &Label) -> Option<Fenced> {
        match self {
            Self::Settled(Fenced::Applied) => {
                observe::settle(route, "stored");
                tracing::debug!(key_hash = hash, "idempotency: completed");
                Some(Fenced::Applied)
            }
            Self::Settled(Fenced::Rejected) => {
                observe::settle(route, "fenced_out");
                tracing::warn!(
                    key_hash = hash,
                    "idempotency: lease lapsed and the key was taken over; outcome not stored"
                );
                Some(Fenced::Rejected)
            }
            Self::GaveUp(error) => {
                observe::settle(route, "failed");
                tracing::error!(
                    key_hash = hash,
                    %error,
                    "idempotency: the response could not be stored while the key was held; a retry after the lease ends will run the handler again"
                );
                None
            }
        }
    }
}

/// Stores `outcome`, calls `answered` after the first attempt, then tries a failed attempt
/// again (backing off to a quarter second) for as long as `held` says the claim is held, so
/// that a retry is replayed rather than run again.
pub(super) async fn complete_while_held<St: Store>(
    (store, key, owner, fingerprint): (&St, &RecordKey, &OwnerToken, &Fingerprint),
    route: &Label,
    outcome: Bytes,
    retention: Duration,
    answered: impl FnOnce(),
    held: impl Fn() -> bool,
) -> Completed {
    let hash = key.hash();
    let first = store.complete(key, owner, fingerprint, outcome.clone(), retention).await;
    answered();
    let error = match first {
        Ok(result) => return Completed::Settled(result),
        Err(error) => error,
    };
    observe::store_error(route, "complete");
    tracing::warn!(key_hash = hash, %error, "idempotency: storing the response failed; retrying while the key is held");
    let mut delay = COMPLETE_FIRST_DELAY;
    let mut failures = 1_u32;
    while held() {
        tokio::time::sleep(delay).await;
        match store.complete(key, owner, fingerprint, outcome.clone(), retention).await {
            Ok(result) => {
                tracing::info!(
                    key_hash = hash,
                    failures,
                    outcome = ?result,
                    "idempotency: store answered on retry"
                );
                return Completed::Settled(result);
            }
            Err(again) => {
                tracing::debug!(key_hash = hash, error = %again, "idempotency: storing the response failed again");
            }
        }
        failures += 1;
        delay = (delay * 2).min(COMPLETE_LONGEST_DELAY);
    }
    // The lease is no longer held, perhaps because an earlier try landed after its answer was
    // lost (a renewal then found the record completed): a last try tells, fenced as ever.
    match store.complete(key, owner, fingerprint, outcome, retention).await {
        Ok(result) => Completed::Settled(result),
        Err(last) => Completed::GaveUp(last),
    }
}

/// Releases the key if `owner` still holds it. A release the store fails is tried again in
/// the background (fenced, so a late one cannot delete another owner's record), counted on
/// `tasks` when there is a tracker.
///
/// `route` labels the metrics; the guard of a claim whose outcome is unknown passes `None`:
/// its claim's failure is counted already, and it settles nothing the caller claimed.
pub(super) async fn release<St: Store>(
    store: &St,
    key: &RecordKey,
    owner: &OwnerToken,
    route: Option<&Label>,
    why: &'static str,
    tasks: Option<&TaskTracker>,
) {
    let hash = key.hash();
    let error = match store.release(key, owner).await {
        Ok(Fenced::Applied) => {
            if let Some(route) = route {
                observe::settle(route, "released");
            }
            return tracing::debug!(key_hash = hash, why, "idempotency: released");
        }
        Ok(Fenced::Rejected) => {
            return tracing::debug!(
                key_hash = hash,
                why,
                "idempotency: nothing to release: the key is not held by this request"
            );
        }
        Err(error) => error,
    };
    if let Some(route) = route {
        observe::store_error(route, "release");
    }
    tracing::warn!(key_hash = hash, why, %error, "idempotency: release failed; retrying");
    let (store, key, owner) = (store.clone(), key.clone(), owner.clone());
    let route = route.cloned();
    drop(super::spawn(tasks, async move {
        if let Some(outcome) = retry_settle(|| store.release(&key, &owner)).await {
            if let (Fenced::Applied, Some(route)) = (outcome, &route) {
                observe::settle(route, "released");
            }
            return tracing::info!(
                key_hash = key.hash(),
                why,
                ?outcome,
                "idempotency: store answered the release on retry"
            );
        }
        if let Some(route) = &route {
            observe::settle(route, "failed");
        }
        tracing::error!(
            key_hash = key.hash(),
            why,
            %error,
            "idempotency: release failed; the key stays claimed until its lease ends"
        );
    }));
}

/// Abandons a claim whose answer its caller never saw ([`Store::abandon`]), trying until the
/// store answers, for as long as the claim's lease: a claim delayed on the wire (a paused
/// server) lands when the server resumes, and one answered abandon, landing before or after
/// it, is enough. Past a lease of tries, a claim that lands holds its key for one lease.
pub(super) async fn abandon<St: Store>(
    store: &St,
    key: &RecordKey,
    owner: &OwnerToken,
    fingerprint: &Fingerprint,
    lease: Lease,
) {
    let hash = key.hash();
    let give_up_at = super::after(lease.duration);
    let mut delay = ABANDON_FIRST_DELAY;
    let mut failures = 0_u32;
    loop {
        match store.abandon(key, owner, fingerprint, lease).await {
            Ok(outcome) => {
                return tracing::debug!(
                    key_hash = hash,
                    ?outcome,
                    failures,
                    "idempotency: abandoned a claim whose outcome was unknown"
                );
            }
            Err(error) if tokio::time::Instant::now() + delay >= give_up_at => {
                return tracing::error!(
                    key_hash = hash,
                    %error,
                    failures,
                    "idempotency: could not abandon a claim whose outcome is unknown; if it landed, the key stays claimed until its lease ends"
                );
            }
            Err(error) => {
                if failures == 0 {
                    tracing::warn!(key_hash = hash, %error, "idempotency: abandoning a claim whose outcome is unknown failed; retrying");
                }
                failures += 1;
            }
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(ABANDON_LONGEST_DELAY);
    }
}

/// The first and the longest pause between tries of [`abandon`].
const ABANDON_FIRST_DELAY: Duration = Duration::from_millis(50);
const ABANDON_LONGEST_DELAY: Duration = Duration::from_secs(1);

/// Tries a fenced write again after each of [`SETTLE_RETRIES`], until the store answers.
/// `None` when it never did.
async fn retry_settle<F, Fut>(mut attempt: F) -> Option<Fenced>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Fenced, StoreError>>,
{
    for delay in SETTLE_RETRIES {
        tokio::time::sleep(delay).await;
        if let Ok(outcome) = attempt().await {
            return Some(outcome);
        }
    }
    None
}
