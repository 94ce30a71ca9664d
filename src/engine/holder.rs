//! [`Holder`]: what a claim that won holds, and the only way to settle it.

use super::observe::Label;
use std::{any::Any, fmt, future::Future, panic::AssertUnwindSafe, sync::Arc, time::Duration};

use bytes::Bytes;
use futures_util::FutureExt as _;

use super::{
    Engine, Held, Settings, observe,
    renewals::Renewing,
    settle::{complete_while_held, release},
};
use crate::{
    context::{Completion, Encoding, IdempotencyContext},
    fingerprint::Fingerprint,
    hashing::{Named, Next},
    key::RecordKey,
    store::{CommitSlot, Fenced, Lease, OwnerToken, Store},
};

/// A panic's payload, carried to where it is resumed.
pub(crate) type Panic = Box<dyn Any + Send>;

/// The owner of a claimed key. It settles the key exactly once: [`complete`](Self::complete)
/// or [`release`](Self::release) consume it.
///
/// From the claim to the settle, whatever runs in between (the recovery hook, the operation,
/// a response body), the engine's [`Renewals`] renew the lease every third of a lease (at most
/// every second), for at most the keep-alive ceiling from the claim. A release stops them
/// first, and waits for a renewal on the wire, so that no renewal lands after it; a complete
/// keeps them running until the store answered it.
pub(crate) struct Holder<St> {
    store: St,
    key: RecordKey,
    fingerprint: Fingerprint,
    /// While a service moves between namings: the claim under the names moved to, held
    /// beside this one (boxed: rarely there); and whether it is completed first.
    next: Option<Box<Holder<St>>>,
    next_first: bool,
    /// The request's plain key: for the operation's context.
    plain: Option<RecordKey>,
    owner: OwnerToken,
    settings: Arc<Settings>,
    /// The metrics label: a route or a scope, never a key.
    route: Label,
    /// The claim took over from a holder whose lease lapsed.
    taken_over: bool,
    /// The lease's renewals, when keep-alive is on; they stop when the holder settles or is
    /// dropped.
    renewal: Option<Renewing<St>>,
    /// Where a store says that the operation committed its outcome in its own transaction.
    commit: Arc<CommitSlot>,
}

impl<St> fmt::Debug for Holder<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Holder").field("key_hash", &self.key.hash()).finish_non_exhaustive()
    }
}

impl<St: Store> Holder<St> {
    /// The holder of a claim `engine` just won for `owner`; `taken_over` when it took over a
    /// lapsed claim. Registers the lease's renewals, when the engine renews.
    pub(super) fn new(
        engine: &Engine<St>,
        named: Named,
        owner: OwnerToken,
        route: Label,
        taken_over: bool,
    ) -> Self {
        Self::sharing(engine, named, owner, route, taken_over, Arc::default())
    }

    /// The holder of the claim `engine` won under `named`'s names moved to for `owner`, held
    /// beside this one: the same commit slot (a store's transaction commits both).
    pub(super) fn beside(&self, engine: &Engine<St>, named: Named, owner: OwnerToken) -> Self {
        let commit = self.commit.clone();
        Self::sharing(engine, named, owner, self.route.clone(), false, commit)
    }

    /// This holder holding `next` beside it (see [`beside`](Self::beside)); `taken_over`
    /// when either claim took a lapsed one over.
    pub(super) fn holding(mut self, next: Self, next_first: bool, taken_over: bool) -> Self {
        self.next_first = next_first;
        self.next = Some(Box::new(next));
        self.taken_over = taken_over;
        self
    }

    fn sharing(
        engine: &Engine<St>,
        named: Named,
        owner: OwnerToken,
        route: Label,
        taken_over: bool,
        commit: Arc<CommitSlot>,
    ) -> Self {
        let Named { key, fingerprint, next: _, plain } = named;
        let renewal = engine
            .renewals
            .as_ref()
            .map(|renewals| renewals.register(&key, &owner, &route, &commit));
        let (store, settings) = (engine.store.clone(), engine.settings.clone());
        Self {
            store,
            key,
            fingerprint,
            next: None,
            next_first: false,
            plain,
            owner,
            settings,
            route,
            taken_over,
            renewal,
            commit,
        }
    }

    /// Stops the lease's renewals, and waits for a renewal on the wire: before a settle, so
    /// that no renewal lands after it.
    async fn stop_renewal(&mut self) {
        if let Some(renewal) = self.renewal.take() {
            renewal.stop().await;
        }
        if let Some(next) = &mut self.next
            && let Some(renewal) = next.renewal.take()
        {
            renewal.stop().await;
        }
    }

    /// Whether this claim spawned its runtime's renewals task: see
    /// [`Renewing::spawned_task`].
    pub(crate) fn spawned_renewals(&self) -> bool {
        self.renewal.as_ref().is_some_and(Renewing::spawned_task)
            || self.next.as_ref().is_some_and(|next| next.spawned_renewals())
    }

    pub(crate) fn key(&self) -> &RecordKey {
        &self.key
    }

    /// Where a store says that the operation committed its outcome in its own transaction.
    pub(crate) fn commit_slot(&self) -> &Arc<CommitSlot> {
        &self.commit
    }

    /// Whether the operation may commit its outcome in a transaction of the store.
    pub(super) fn commits_in_transactions(&self) -> bool {
        self.store.commits_in_transactions()
    }

    /// How long the claim holds its key without a renewal.
    pub(super) fn lease_duration(&self) -> Duration {
        self.settings.lease
    }

    /// The claim completed first, and the other one (during a move): the names the
    /// operation's context and a store's transaction name it by first.
    fn completed_first(&self) -> (&Self, Option<&Self>) {
        match self.next.as_deref() {
            Some(next) if self.next_first => (next, Some(self)),
            next => (self, next),
        }
    }

    /// What the door knows of this claim when it settles it.
    pub(super) fn held(&self) -> Held {
        let (first, other) = self.completed_first();
        let (key, fingerprint) = (first.key.clone(), first.fingerprint.clone());
        let alongside = other.map(|other| (other.key.clone(), other.fingerprint.clone()));
        let plain = self.plain.clone();
        Held { key, fingerprint, retention: self.settings.retention, alongside, plain }
    }

    /// The operation's context: who it is, for the operation and its recovery hook, and what
    /// an outcome it commits in a store's transaction needs (encoded as `encoding` says).
    pub(super) fn context(
        &self,
        scope: Vec<u8>,
        encoding: Arc<dyn Encoding>,
        durable: Option<crate::recovery::DurableTable>,
    ) -> IdempotencyContext {
        let (first, other) = self.completed_first();
        let completion = Completion::new(
            (first.owner.clone(), other.map(|other| other.owner.clone())),
            (self.settings.retention, self.settings.lease()),
            self.commit.clone(),
            self.settings.at_rest.clone(),
            encoding,
            durable,
        );
        let next = other.map(|other| Next {
            key: other.key.clone(),
            fingerprint: other.fingerprint.clone(),
            completed_first: false,
        });
        let named = Named {
            key: first.key.clone(),
            fingerprint: first.fingerprint.clone(),
            next,
            plain: self.plain.clone(),
        };
        IdempotencyContext::new(scope, named, self.taken_over, Some(completion))
    }

    /// Whether the claim took over from a holder whose lease lapsed.
    pub(crate) fn taken_over(&self) -> bool {
        self.taken_over
    }

    /// Whether the front door must ask its recovery hook before it runs the operation: on a
    /// takeover, or on every claim when so configured or when the hook is `durable`.
    pub(crate) fn needs_recovery(&self, durable: bool) -> bool {
        self.settings.recovering
            && (self.taken_over || self.settings.recovery.every_claim || durable)
    }

    /// Ends the lease now, keeping the record for its recovery window, so that the next
    /// claim takes it over (and asks the hook again) rather than claiming it fresh. Without
    /// a window there is nothing to keep: the claim is released.
    pub(super) async fn hand_back(mut self, why: &'static str) {
        if let Some(next) = self.next.take() {
            Box::pin(next.hand_back(why)).await;
        }
        self.stop_renewal().await;
        let lease = self.settings.lease();
        if lease.recovery_window.is_zero() {
            return self.release(why).await;
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

    /// Runs `operation` (the lease is renewed all along). A panic releases the key and comes
    /// back as `Err`, for the front door to resume where its caller sees it.
    pub(crate) async fn run<F: Future>(self, operation: F) -> Result<(Self, F::Output), Panic> {
        let started = tokio::time::Instant::now();
        let outcome = AssertUnwindSafe(operation).catch_unwind().await;
        observe::ran(&self.route, started.elapsed());
        match outcome {
            Ok(output) => Ok((self, output)),
            Err(panic) => {
                self.release("the operation panicked").await;
                Err(panic)
            }
        }
    }

    /// Leaves the key as the operation's own transaction settled it (its outcome was
    /// written there): stops the renewal, and writes nothing.
    pub(crate) async fn settled_in_transaction(mut self, answered: impl FnOnce()) {
        self.stop_renewal().await;
        observe::settle(&self.route, "stored_in_transaction");
        answered();
    }

    /// Settles an operation whose outcome is too large to keep: by default a "completed, not
    /// replayable" record (`record`, made by the door: the reason, no outcome), so that a
    /// retry is answered an error and the operation never runs again; its key released when
    /// the door is so configured.
    pub(crate) async fn complete_too_large(
        self,
        record: Bytes,
        why: &'static str,
        answered: impl FnOnce(),
    ) {
        if self.settings.release_too_large {
            self.release(why).await;
            return answered();
        }
        tracing::warn!(
            key_hash = self.key.hash(),
            why,
            "idempotency: the outcome is too large to keep; retries are answered that it ran"
        );
        self.complete(record, answered).await;
    }

    /// Deletes the claim, so that a retry runs the operation again.
    pub(crate) async fn release(mut self, why: &'static str) {
        if let Some(next) = self.next.take() {
            Box::pin(next.release(why)).await;
        }
        self.stop_renewal().await;
        let tasks = self.settings.tasks.as_ref();
        release(&self.store, &self.key, &self.owner, Some(&self.route), why, tasks).await;
    }

    /// Stores `outcome` for the retention period. `answered` runs after the first attempt,
    /// whatever the store said: the front door's caller gets its answer there. A failed
    /// attempt is tried again in this task, the lease renewed meanwhile, until the store
    /// answers or the lease no longer holds (lost, past the keep-alive ceiling, or lapsed for
    /// want of a renewal the store applied; the lease itself without keep-alive): a stall of
    /// the store shorter than the lease less a renewal period never lets a retry take the key
    /// over and run the operation again. A renewal that lands after the
    /// complete is refused by the completed record.
    ///
    /// During a move, under both names, in the order the deploy's outer neighbour reads
    /// ([`crate::hashing`]): fenced out of the first (taken over there), the response is not
    /// the key's, and the second is released; the first not answered while held, the second
    /// is handed back (its lapse kept, so that the next claim is a takeover, and asks the
    /// recovery hook).
    pub(crate) async fn complete(mut self, outcome: Bytes, answered: impl FnOnce()) {
        let Some(next) = self.next.take() else {
            self.complete_one(outcome, answered).await;
            return;
        };
        let (first, second) = if self.next_first { (*next, self) } else { (self, *next) };
        let route = first.route.clone();
        match first.complete_one(outcome.clone(), answered).await {
            Some(Fenced::Applied) => drop(second.complete_one(outcome, || {}).await),
            Some(Fenced::Rejected) => second.release("fenced out under the other names").await,
            None => {
                observe::store_error(&route, "complete");
                second.hand_back("not stored under the other names").await;
            }
        }
    }

    /// [`complete`](Self::complete) under one name: what the store answered, if it did.
    async fn complete_one(mut self, outcome: Bytes, answered: impl FnOnce()) -> Option<Fenced> {
        let outcome = self.settings.at_rest.seal(&self.key, &self.fingerprint, outcome);
        let retention = self.settings.retention;
        // A renewal that finds the record completed from here is this complete's, not a lease
        // lost.
        self.commit.completing();
        let holding = match &self.renewal {
            Some(_) => None,
            None => Some(super::after(self.settings.lease)),
        };
        let write = (&self.store, &self.key, &self.owner, &self.fingerprint);
        let renewal = &self.renewal;
        let still_held = || match holding {
            Some(lease_end) => tokio::time::Instant::now() < lease_end,
            None => renewal.as_ref().is_some_and(Renewing::is_held),
        };
        let settled =
            complete_while_held(write, &self.route, outcome, retention, answered, still_held).await;
        self.stop_renewal().await;
        settled.report(self.key.hash(), &self.route)
    }
}

mod recover;
#[cfg(test)]
mod tests;

pub(crate) use self::recover::Asked;
