//! The engine: the idempotency state machine, knowing nothing of HTTP or of any one front door.
//!
//! 1. claim: one store call decides: run, replay, in progress, or mismatch. A claim whose
//!    answer never reached its caller (the caller was dropped, or the store timed out) is
//!    released by a guard, fenced by its owner token.
//! 2. run: the front door runs its operation through the [`Holder`] of the claim, in a task
//!    of its own ([`Engine::spawn`]), with the lease renewed while it runs; a panic releases
//!    the key.
//! 3. settle: complete (store the outcome) or release (let a retry run), both fenced by the
//!    owner token, and retried in the background when the store fails.
//!
//! The front doors (`crate::http`, `crate::consumer`) turn their world into a record key, a
//! fingerprint and bytes to store, and the engine's answers back into theirs.

mod holder;
mod settle;

use std::{future::Future, sync::Arc, time::Duration};

use bytes::Bytes;
use tokio_util::task::TaskTracker;

pub(crate) use self::holder::{Holder, Panic};
use self::settle::release;
use crate::{
    fingerprint::Fingerprint,
    key::RecordKey,
    store::{Claim, OwnerToken, Store, StoreError},
};

/// What the engine needs to know of a front door's configuration.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    /// How long a claim holds its key without renewal.
    pub(crate) lease: Duration,
    /// How long a completed outcome is kept.
    pub(crate) retention: Duration,
    /// Renew the lease of a running operation, for at most this long from the claim.
    pub(crate) keep_alive: Option<Duration>,
    /// Where claimed operations are spawned; plain `tokio::spawn` when `None`.
    pub(crate) tasks: Option<TaskTracker>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(24 * 60 * 60),
            keep_alive: Some(Duration::from_secs(5 * 60)),
            tasks: None,
        }
    }
}

/// The state machine over one store.
#[derive(Debug, Clone)]
pub(crate) struct Engine<St> {
    store: St,
    settings: Arc<Settings>,
}

/// What a claim found.
#[derive(Debug)]
pub(crate) enum Claimed<St> {
    /// The key is the caller's: run the operation through this holder.
    Run(Holder<St>),
    /// The same request completed: its stored outcome.
    Replay(Bytes),
    /// The same request is running elsewhere; its lease ends in `remaining`.
    InProgress { remaining: Duration },
    /// The key is held by a different request.
    Mismatch,
}

impl<St> Engine<St> {
    pub(crate) fn new(store: St, settings: Arc<Settings>) -> Self {
        Self { store, settings }
    }

    pub(crate) fn store(&self) -> &St {
        &self.store
    }
}

impl<St: Store> Engine<St> {
    /// Claims `key` for a request with `fingerprint`.
    ///
    /// A caller dropped while the claim is on the wire, or whose claim timed out, may own the
    /// key without knowing it: a guard releases whatever its token may hold.
    pub(crate) async fn claim(
        &self,
        key: RecordKey,
        fingerprint: Fingerprint,
    ) -> Result<Claimed<St>, StoreError> {
        let owner = OwnerToken::random();
        let claim = {
            let mut guard = UnsettledClaim::new(&self.store, &key, &owner);
            let claim = self.store.claim(&key, &fingerprint, &owner, self.settings.lease).await;
            if !matches!(&claim, Err(error) if error.is_unavailable()) {
                guard.disarm();
            }
            claim
        };
        Ok(match claim? {
            Claim::Claimed => {
                tracing::debug!(key_hash = key.hash(), "idempotency: claimed");
                Claimed::Run(Holder::new(
                    self.store.clone(),
                    key,
                    fingerprint,
                    owner,
                    self.settings.clone(),
                ))
            }
            Claim::Replay(stored) => Claimed::Replay(stored),
            Claim::InProgress { remaining } => Claimed::InProgress { remaining },
            Claim::Mismatch => Claimed::Mismatch,
        })
    }

    /// Spawns a claimed operation's task: on the configured `TaskTracker`, or with
    /// `tokio::spawn`. The task is detached: a caller that goes away does not cancel it.
    pub(crate) fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        // Boxed here, so that the caller's future does not carry the task's state inline.
        let task = Box::pin(task);
        match &self.settings.tasks {
            Some(tracker) => drop(tracker.spawn(task)),
            None => drop(tokio::spawn(task)),
        }
    }
}

/// Releases, on drop, a claim whose outcome its caller never saw.
struct UnsettledClaim<'a, St: Store> {
    armed: Option<(&'a St, &'a RecordKey, &'a OwnerToken)>,
}

impl<'a, St: Store> UnsettledClaim<'a, St> {
    fn new(store: &'a St, key: &'a RecordKey, owner: &'a OwnerToken) -> Self {
        Self { armed: Some((store, key, owner)) }
    }

    fn disarm(&mut self) {
        self.armed = None;
    }
}

impl<St: Store> Drop for UnsettledClaim<'_, St> {
    fn drop(&mut self) {
        if let Some((store, key, owner)) = self.armed.take() {
            let (store, key, owner) = (store.clone(), key.clone(), owner.clone());
            // Fenced by the token: deletes the record only if this claim landed.
            drop(tokio::spawn(async move {
                release(&store, &key, &owner, "the claim's outcome is unknown").await;
            }));
        }
    }
}
