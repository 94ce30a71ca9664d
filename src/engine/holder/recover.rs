//! A claim's recovery hook asked before the operation runs: what its answer leaves the
//! [`Holder`] to do.

use std::{future::Future, panic::AssertUnwindSafe};

use futures_util::FutureExt as _;

use super::{Holder, observe};
use crate::{
    recovery::{BoxError, Recovered},
    store::Store,
};

/// What a recovery hook's answer leaves the holder to do.
pub(crate) enum Asked<St, T> {
    /// Nothing is known of a first run: run the operation.
    Run(Holder<St>),
    /// The operation happened, with this outcome: store it and answer it as a replay.
    Happened(Holder<St>, T),
    /// The hook failed: the operation must not run. The key is handed back, so that the
    /// next claim takes it over and asks again.
    Refused,
    /// The system of record holds another request's outcome under the key: nothing runs, and
    /// the claim was released.
    Mismatch,
}

impl<St: Store> Holder<St> {
    /// Waits (within the recovery timeout) for the hook's `lookup`, and says what to do.
    pub(crate) async fn recover<T>(
        self,
        lookup: impl Future<Output = Result<Recovered<T>, BoxError>>,
    ) -> Asked<St, T> {
        let policy = self.settings.recovery;
        let hash = self.key.hash();
        let lookup = AssertUnwindSafe(lookup).catch_unwind();
        let failure = match tokio::time::timeout(policy.timeout, lookup).await {
            Ok(Ok(Ok(Recovered::Happened(outcome)))) => {
                tracing::warn!(
                    key_hash = hash,
                    "idempotency: recovered the outcome from the system of record"
                );
                observe::recovery(&self.route, "happened");
                return Asked::Happened(self, outcome);
            }
            Ok(Ok(Ok(Recovered::Mismatch))) => {
                tracing::info!(
                    key_hash = hash,
                    "idempotency: the system of record holds another request's outcome under the key"
                );
                observe::recovery(&self.route, "mismatch");
                self.release("the key belongs to another request").await;
                return Asked::Mismatch;
            }
            Ok(Ok(Ok(Recovered::Unknown))) => {
                tracing::debug!(
                    key_hash = hash,
                    "idempotency: the system of record knows nothing of it"
                );
                observe::recovery(&self.route, "unknown");
                return Asked::Run(self);
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
            return Asked::Run(self);
        }
        tracing::error!(
            key_hash = hash,
            failure,
            "idempotency: recovery failed; the operation does not run"
        );
        self.hand_back("recovery failed").await;
        Asked::Refused
    }
}
