//! What a claim leaves behind when its caller goes away: the guard that abandons a claim whose
//! answer nobody saw, and the tasks that finish a claim's let-go, counted on the service's
//! task tracker when it has one.

use std::future::Future;

use tokio::task::JoinHandle;
use tokio_util::task::TaskTracker;

use super::settle::abandon;
use crate::{
    fingerprint::Fingerprint,
    key::RecordKey,
    store::{Lease, OwnerToken, Store},
};

/// Abandons, on drop, a claim whose outcome its caller never saw (counted on `tasks`, when
/// there is a tracker: a service shutting down waits for it).
pub(super) struct UnsettledClaim<'a, St: Store> {
    pub(super) armed: Option<(&'a St, &'a RecordKey, &'a OwnerToken, &'a Fingerprint, Lease)>,
    pub(super) tasks: Option<&'a TaskTracker>,
}

impl<St: Store> UnsettledClaim<'_, St> {
    pub(super) fn disarm(&mut self) {
        self.armed = None;
    }
}

impl<St: Store> Drop for UnsettledClaim<'_, St> {
    fn drop(&mut self) {
        // Dropped outside any runtime (its own shut down): nothing can abandon it, and the
        // claim lapses with its lease, as a holder's does when its process dies.
        if let Some((store, key, owner, fingerprint, lease)) = self.armed.take()
            && tokio::runtime::Handle::try_current().is_ok()
        {
            let (store, key, owner, fingerprint) =
                (store.clone(), key.clone(), owner.clone(), fingerprint.clone());
            // Fenced by the token: ends the claim only if it landed, and refuses it if it
            // lands later.
            let abandoning =
                async move { abandon(&store, &key, &owner, &fingerprint, lease).await };
            drop(spawn(self.tasks, abandoning));
        }
    }
}

/// Spawns `work` on the current runtime, counted on `tracker` when there is one: the work a
/// claim leaves behind (a let-go, a release's retries, an abandon), which a service shutting
/// down waits for.
pub(super) fn spawn(
    tracker: Option<&TaskTracker>,
    work: impl Future<Output = ()> + Send + 'static,
) -> JoinHandle<()> {
    match tracker {
        Some(tracker) => tracker.spawn(work),
        None => tokio::spawn(work),
    }
}
