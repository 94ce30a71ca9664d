//! [`Completer`]: settles abandoned claims (a holder that died, a client that never came back)
//! from the system of record when it knows the outcome, and reports those it cannot, so that
//! "stuck in progress" is something an operator sees, not something a client discovers.
//!
//! It is a front door's: built from its operator's handle (`layer::Operator::completer`,
//! `consumer::Operator::completer`), over the door's store, with the door's own settings (its
//! key prefix, its header filter, its encryption at rest, its retention, its recovery window
//! and timeout), and it asks the door's [`Recover`](crate::recovery::Recover) hook: the same
//! hook value the door has, asked with a [`Lookup`](crate::recovery::Lookup) whose `request`
//! is `None` (the completer knows a claim's key hash and fingerprint, never its request).
//! `DurableOutcomes` is such a hook. It works over every store that lists its abandoned claims
//! ([`Admin::abandoned`]).
//!
//! A claim is abandoned only while its record outlives its lease: within the recovery window
//! that a door keeps when it has a recovery hook. A known outcome is stored (after a takeover,
//! fenced as any) and every retry replays it; an unknown one is left for its client's retry,
//! and reported:
//!
//! - a warning naming the key hash and how long ago its lease lapsed;
//! - with the `metrics` feature, `idempotency_abandoned_claims_total{result}`, `result` one of
//!   [`Completed`]: `settled`, `unresolved`, `failed` (the hook or the store failed),
//!   `skipped` (a retry took it meanwhile).
//!
//! What it cannot know, and what follows:
//! - **The scope.** The store keeps a claim's key hash, never its scope or its key: the
//!   lookup's context has an empty scope. A hook the completer asks finds the outcome by the
//!   key hash alone (it names the scope: `IdempotencyContext::key_hash`).
//! - **The door.** A door's claims are told apart by their key prefix alone: give each door
//!   over a store its own prefix (the defaults differ: `idempotency`, `idempotency-consumer`),
//!   or a completer may store one door's outcome under another's key, which that door cannot
//!   read (500 `corrupt-record` on its retries, and nothing runs).
//! - **Which claims to list.** The store lists the oldest abandoned claims of every door, and
//!   the completer keeps its own prefix's: a claim it cannot settle stays listed for its
//!   recovery window. Keep [`batch`](Completer::batch) above the claims that stay unresolved,
//!   or newer ones wait behind them.

use std::{fmt, future::Future, sync::Arc, time::Duration};

use futures_util::future::BoxFuture;

pub use crate::engine::Completed;
use crate::{
    context::IdempotencyContext,
    engine::{Door, Engine, observe},
    key::RecordKey,
    recovery::{BoxError, Recovered},
    store::{AbandonedClaim, Admin, StoreError},
};

/// What one pass of [`Completer::complete_abandoned`] did: how many claims ended each way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Pass {
    /// Claims whose outcome the hook knew, now stored ([`Completed::Settled`]).
    pub settled: usize,
    /// Claims the hook knew nothing of: left as they were, and reported
    /// ([`Completed::Unresolved`]).
    pub unresolved: usize,
    /// Claims the hook or the store failed on: left as they were, tried again next pass
    /// ([`Completed::Failed`]).
    pub failed: usize,
    /// Claims a retry took (or settled) between the listing and the completer's takeover
    /// ([`Completed::Skipped`]).
    pub skipped: usize,
}

impl Pass {
    /// Counts one claim.
    fn count(&mut self, completed: Completed) {
        match completed {
            Completed::Settled => self.settled += 1,
            Completed::Unresolved => self.unresolved += 1,
            Completed::Failed => self.failed += 1,
            Completed::Skipped => self.skipped += 1,
        }
    }
}

/// One abandoned claim completed as the door would.
type Complete = dyn Fn(AbandonedClaim) -> BoxFuture<'static, Completed> + Send + Sync;

/// Settles abandoned claims from the system of record, or reports them (see the
/// [module](self)). Built from a door's operator: `operator.completer(hook)`.
///
/// ```no_run
/// # async fn run(store: axum_idempotency::MemoryStore) {
/// use std::time::Duration;
/// use axum_idempotency::{IdempotencyLayer, recovery::{BoxError, Lookup, Recovered}};
/// use bytes::Bytes;
/// use http::{Request, Response};
///
/// // The layer's own recovery hook: the outbox row the handler wrote with its side effect.
/// let hook = |lookup: Lookup<Request<Bytes>>| async move {
///     // SELECT status, body FROM idempotency_outbox WHERE key_hash = lookup.context.key_hash()
///     let found: Option<(u16, Vec<u8>)> = None;
///     Ok::<_, BoxError>(match found {
///         Some((status, body)) => {
///             Recovered::Happened(Response::builder().status(status).body(body.into())?)
///         }
///         None => Recovered::Unknown,
///     })
/// };
/// let layer = IdempotencyLayer::new(store).recover(hook);
/// let completer = layer.operator().completer(hook);
/// let _task = completer.spawn(Duration::from_secs(60));
/// # }
/// ```
#[must_use]
pub struct Completer<St> {
    store: St,
    /// The door's key prefix: the claims of other doors over the store are not its own.
    prefix: Arc<str>,
    complete: Arc<Complete>,
    lapsed_for: Duration,
    batch: u32,
}

impl<St: Clone> Clone for Completer<St> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            prefix: self.prefix.clone(),
            complete: self.complete.clone(),
            lapsed_for: self.lapsed_for,
            batch: self.batch,
        }
    }
}

impl<St> fmt::Debug for Completer<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Completer")
            .field("prefix", &self.prefix)
            .field("lapsed_for", &self.lapsed_for)
            .field("batch", &self.batch)
            .finish_non_exhaustive()
    }
}

impl<St: Admin> Completer<St> {
    /// A completer of the claims `engine`'s store lists under `prefix`, each completed as
    /// `door` stores a recovered outcome, after `ask` asked the door's hook with its context.
    /// Defaults: claims lapsed a minute ago or more, 100 a pass.
    pub(crate) fn new<D, L>(
        engine: Engine<St>,
        prefix: &str,
        door: D,
        ask: impl Fn(IdempotencyContext) -> L + Send + Sync + 'static,
    ) -> Self
    where
        D: Door,
        L: Future<Output = Result<Recovered<D::Recovered>, BoxError>> + Send + 'static,
    {
        let (store, door, ask) = (engine.store().clone(), Arc::new(door), Arc::new(ask));
        let complete = move |claim| {
            let (engine, door, ask) = (engine.clone(), door.clone(), ask.clone());
            Box::pin(async move { engine.complete_abandoned(&*door, claim, &*ask).await })
                as BoxFuture<'static, Completed>
        };
        let (lapsed_for, batch) = (Duration::from_secs(60), 100);
        // The prefix as the door's record keys write it.
        let prefix = RecordKey::new(prefix, b"", b"").prefix().into();
        Self { store, prefix, complete: Arc::new(complete), lapsed_for, batch }
    }

    /// Only claims whose lease lapsed at least this long ago: give a client time to retry
    /// first (its retry takes the claim over and asks the door's own hook). Defaults to a
    /// minute.
    pub fn lapsed_for(mut self, lapsed_for: Duration) -> Self {
        self.lapsed_for = lapsed_for;
        self
    }

    /// At most this many claims a pass, of every door over the store (the listing is the
    /// store's, oldest first; unresolved claims stay listed for their recovery window: keep it
    /// above how many stay unresolved). Defaults to 100.
    pub fn batch(mut self, batch: u32) -> Self {
        self.batch = batch;
        self
    }

    /// One pass: lists the abandoned claims, asks the door's hook about each of this door's
    /// (its key prefix), and stores what it knows (a takeover with the claim's own
    /// fingerprint, then a fenced complete).
    ///
    /// # Errors
    ///
    /// When the listing fails; a failure on one claim is counted in [`Pass::failed`].
    pub async fn complete_abandoned(&self) -> Result<Pass, StoreError> {
        let mut pass = Pass::default();
        for claim in self.store.abandoned(self.lapsed_for, self.batch).await? {
            if claim.key.prefix() != &*self.prefix {
                continue;
            }
            let completed = (self.complete)(claim).await;
            pass.count(completed);
            observe::abandoned(completed.as_str());
        }
        Ok(pass)
    }

    /// Runs a pass every `every`, for as long as the task runs; errors are logged.
    pub fn spawn(self, every: Duration) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            loop {
                if let Err(error) = self.complete_abandoned().await {
                    tracing::warn!(%error, "idempotency: the completer could not list abandoned claims");
                }
                tokio::time::sleep(every).await;
            }
        })
    }
}
