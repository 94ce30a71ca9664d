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
    store::{Fenced, OwnerToken, Store},
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
    ) -> Self {
        Self { store, key, fingerprint, owner, settings, route }
    }

    pub(crate) fn key(&self) -> &RecordKey {
        &self.key
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
        let Self { store, key, fingerprint, owner, settings, route } = self;
        let write = (&store, &key, &owner, &fingerprint);
        complete_with_retries(write, &route, outcome, settings.retention, answered).await;
    }

    /// Runs `operation`, renewing the lease every third of a lease until it finishes, the
    /// key is lost, or `ceiling` has passed since the claim.
    async fn keep_alive<T>(&self, operation: impl Future<Output = T>, ceiling: Duration) -> T {
        let lease = self.settings.lease;
        let hash = self.key.hash();
        let period = (lease / 3).max(Duration::from_millis(1));
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
