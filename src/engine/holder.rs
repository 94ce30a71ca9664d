//! [`Holder`]: what a claim that won holds, and the only way to settle it.

use std::{any::Any, fmt, future::Future, panic::AssertUnwindSafe, sync::Arc, time::Duration};

use bytes::Bytes;
use futures_util::FutureExt as _;

use super::{
    Settings, observe,
    settle::{complete_with_retries, release},
};
use crate::{
    fingerprint::Fingerprint,
    key::RecordKey,
    recovery::{BoxError, Recovered},
    store::{Fenced, Lease, OwnerToken, Store},
};

/// A panic's payload, carried to where it is resumed.
pub(crate) type Panic = Box<dyn Any + Send>;

/// The owner of a claimed key. It settles the key exactly once: [`complete`](Self::complete)
/// or [`release`](Self::release) consume it.
pub(crate) struct Holder<St> {
    store: St,
    key: RecordKey,
    fingerprint: Fingerprint,
    owner: OwnerToken,
    settings: Arc<Settings>,
    /// The metrics label: a route or a scope, never a key.
    route: Arc<str>,
    /// The claim took over from a holder whose lease lapsed.
    taken_over: bool,
}

/// What a recovery hook's answer leaves the holder to do.
pub(crate) enum Recovery<St, T> {
    /// Nothing is known of a first run: run the operation.
    Run(Holder<St>),
    /// The operation happened, with this outcome: store it and answer it as a replay.
    Happened(Holder<St>, T),
    /// The hook failed: the operation must not run. The key is handed back, so that the
    /// next claim takes it over and asks again.
    Refused,
}

impl<St> fmt::Debug for Holder<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Holder").field("key_hash", &self.key.hash()).finish_non_exhaustive()
    }
}

impl<St: Store> Holder<St> {
    pub(super) fn new(
        store: St,
        key: RecordKey,
        fingerprint: Fingerprint,
        owner: OwnerToken,
        settings: Arc<Settings>,
        route: Arc<str>,
        taken_over: bool,
    ) -> Self {
        Self { store, key, fingerprint, owner, settings, route, taken_over }
    }

    pub(crate) fn key(&self) -> &RecordKey {
        &self.key
    }

    pub(crate) fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }

    /// Whether the claim took over from a holder whose lease lapsed.
    pub(crate) fn taken_over(&self) -> bool {
        self.taken_over
    }

    /// Whether the front door must ask its recovery hook before it runs the operation: on a
    /// takeover, or on every claim when so configured.
    pub(crate) fn needs_recovery(&self) -> bool {
        self.settings.recovering && (self.taken_over || self.settings.recovery.every_claim)
    }

    /// Waits (within the recovery timeout) for the hook's `lookup`, and says what to do.
    pub(crate) async fn recover<T>(
        self,
        lookup: impl Future<Output = Result<Recovered<T>, BoxError>>,
    ) -> Recovery<St, T> {
        let policy = self.settings.recovery.clone();
        let hash = self.key.hash();
        let lookup = AssertUnwindSafe(lookup).catch_unwind();
        let failure = match tokio::time::timeout(policy.timeout, lookup).await {
            Ok(Ok(Ok(Recovered::Happened(outcome)))) => {
                tracing::warn!(
                    key_hash = hash,
                    "idempotency: recovered the outcome from the system of record"
                );
                observe::recovery(&self.route, "happened");
                return Recovery::Happened(self, outcome);
            }
            Ok(Ok(Ok(Recovered::Unknown))) => {
                tracing::debug!(
                    key_hash = hash,
                    "idempotency: the system of record knows nothing of it"
                );
                observe::recovery(&self.route, "unknown");
                return Recovery::Run(self);
            }
            Ok(Ok(Err(error))) => error.to_string(),
            Ok(Err(_panic)) => "the recovery hook panicked".to_owned(),
            Err(_) => format!("no answer within {:?}", policy.timeout),
        };
        observe::recovery(&self.route, "failed");
        if policy.run_on_failure {
            tracing::error!(
                key_hash = hash,
                failure,
                "idempotency: recovery failed; running the operation as configured"
            );
            return Recovery::Run(self);
        }
        tracing::error!(
            key_hash = hash,
            failure,
            "idempotency: recovery failed; the operation does not run"
        );
        self.hand_back().await;
        Recovery::Refused
    }

    /// Ends the lease now, keeping the record for its recovery window, so that the next
    /// claim takes it over (and asks the hook again) rather than claiming it fresh. Without
    /// a window there is nothing to keep: the claim is released.
    async fn hand_back(self) {
        let lease = self.settings.lease();
        if lease.recovery_window.is_zero() {
            return self.release("recovery failed").await;
        }
        let ended = Lease::new(Duration::ZERO).recovery_window(lease.recovery_window);
        match self.store.touch(&self.key, &self.owner, ended).await {
            Ok(_) => {}
            // The lease lapses on its own: a later claim takes over all the same.
            Err(error) => {
                observe::store_error(&self.route, "touch");
                tracing::warn!(key_hash = self.key.hash(), %error, "idempotency: could not hand the key back; it lapses with its lease");
            }
        }
    }

    /// Runs `operation` with the lease renewed while it runs. A panic releases the key and
    /// comes back as `Err`, for the front door to resume where its caller sees it.
    pub(crate) async fn run<F: Future>(self, operation: F) -> Result<(Self, F::Output), Panic> {
        let operation = AssertUnwindSafe(operation).catch_unwind();
        let started = tokio::time::Instant::now();
        let outcome = match self.settings.keep_alive {
            Some(ceiling) => self.keep_alive(operation, ceiling).await,
            None => operation.await,
        };
        observe::ran(&self.route, started.elapsed());
        match outcome {
            Ok(output) => Ok((self, output)),
            Err(panic) => {
                self.release("the operation panicked").await;
                Err(panic)
            }
        }
    }

    /// Deletes the claim, so that a retry runs the operation again.
    pub(crate) async fn release(self, why: &'static str) {
        release(&self.store, &self.key, &self.owner, Some(&self.route), why).await;
    }

    /// Stores `outcome` for the retention period. `answered` runs after the first attempt,
    /// whatever the store said: the front door's caller gets its answer there, and a failed
    /// first attempt is then retried in the background of this task.
    pub(crate) async fn complete(self, outcome: Bytes, answered: impl FnOnce()) {
        let Self { store, key, fingerprint, owner, settings, route, .. } = self;
        let write = (&store, &key, &owner, &fingerprint);
        complete_with_retries(write, &route, outcome, settings.retention, answered).await;
    }

    /// Runs `operation`, renewing the lease every third of a lease until it finishes, the
    /// key is lost, or `ceiling` has passed since the claim.
    async fn keep_alive<T>(&self, operation: impl Future<Output = T>, ceiling: Duration) -> T {
        let lease = self.settings.lease();
        let hash = self.key.hash();
        let period = (lease.duration / 3).max(Duration::from_millis(1));
        let give_up_at = tokio::time::Instant::now() + ceiling;
        let mut renewals = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        renewals.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut renewing = true;
        tokio::pin!(operation);
        loop {
            tokio::select! {
                biased;
                output = &mut operation => return output,
                now = renewals.tick(), if renewing => {
                    if now >= give_up_at {
                        tracing::warn!(key_hash = hash, "idempotency: keep-alive ceiling reached; the lease will lapse");
                        renewing = false;
                        continue;
                    }
                    match self.store.touch(&self.key, &self.owner, lease).await {
                        Ok(Fenced::Applied) => {}
                        Ok(Fenced::Rejected) => {
                            tracing::warn!(key_hash = hash, "idempotency: lease lost to another request");
                            renewing = false;
                        }
                        // The next tick tries again; the lease has two more periods to run.
                        Err(error) => {
                            observe::store_error(&self.route, "touch");
                            tracing::warn!(key_hash = hash, %error, "idempotency: lease renewal failed");
                        }
                    }
                }
            }
        }
    }
}
