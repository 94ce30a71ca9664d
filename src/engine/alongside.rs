//! The look at a request's other names after a claim, while a service moves from one naming
//! to another ([`crate::hashing`]).

use std::{future::Future, time::Duration};

use tokio::{sync::oneshot, task::JoinHandle, time::Instant};
use tokio_util::task::TaskTracker;

use super::{
    Claimed, Engine, Holder, UnsettledClaim, observe,
    observe::Label,
    settle::{abandon, release},
    spawn,
};
use crate::{
    fingerprint::Fingerprint,
    hashing::Named,
    key::RecordKey,
    store::{Claim, Fenced, Lease, OwnerToken, Store, StoreError},
};

impl<St: Store> Engine<St> {
    /// After a claim won under `named`'s names for `owner`, the request's names alongside,
    /// claimed for a moment, decide. Nothing there (or a claim of ours that lapsed): the claim
    /// stands (`None`). A completed request there is replayed; one running there is in
    /// progress (waited for first, ours kept, when our names sort first: below); another
    /// request there is a mismatch; a lapsed holder there is taken over under
    /// those names, so that a fence keyed by them (a table beside the store) still fences it
    /// out. Except when the claim stands, ours is let go (handed back when it was a takeover).
    ///
    /// Nothing is copied between the names: every record under the names a deploy before
    /// stops claiming under expires before the deploy after stops looking there (see the
    /// module's three deploys). A caller that goes away during the look abandons our claim
    /// and the claim the look made (a claim it took over is handed back with its lapse):
    /// nothing stays held.
    pub(super) async fn look_alongside(
        &self,
        named: &Named,
        owner: &OwnerToken,
        taken_over: bool,
        route: &Label,
        waits_until: Option<Instant>,
    ) -> Result<Option<Claimed<St>>, StoreError> {
        let (our_key, our_fingerprint) = (&named.key, &named.fingerprint);
        let Some((key, fingerprint)) = &named.alongside else { return Ok(None) };
        let abandoned = self.settings.abandoned_lease();
        let tasks = self.settings.tasks.as_ref();
        let mut guard = UnsettledClaim {
            armed: Some((&self.store, our_key, owner, our_fingerprint, abandoned)),
            tasks,
        };
        let mut looked = self.claim_once(key, fingerprint, false).await;
        // Two requests of neighbouring deploys whose claims land within a round trip of each
        // other each see the other's in progress. Were both to let go, their releases would
        // wake both deploys' waiters together, to collide again, wave after wave, until every
        // duplicate is answered 202 and none ran: safe, not live. So one of the two, the one
        // whose own names sort first (both see the same two), keeps its claim and waits on
        // the names alongside (woken by their release) within its wait and a quarter of a
        // lease; the other lets go, as before.
        let mut kept = false;
        if matches!(looked, Ok((Claim::InProgress { .. }, _)))
            && our_key.as_str() < key.as_str()
            && let Some(wait) = waits_until
                .map(|until| until.saturating_duration_since(Instant::now()))
                .map(|left| left.min(self.settings.lease / 4))
                .filter(|wait| !wait.is_zero())
            && let Ok(_place) = self.settings.waiters.clone().try_acquire_owned()
        {
            tracing::debug!(
                key_hash = our_key.hash(),
                "idempotency: waiting on the names alongside"
            );
            let started = Instant::now();
            looked = self.wait(key, fingerprint, wait).await;
            if looked.is_ok() {
                observe::waited(route, started.elapsed());
            }
            kept = true;
        }
        let ours = (our_key, owner, our_fingerprint, taken_over);
        // Ours is let go before the answer (a retry right after it finds the key free), with
        // the guard still armed: a caller that goes away meanwhile abandons it.
        let decided = match looked {
            Err(error) => {
                observe::store_error(route, "claim");
                self.let_go(ours, "the names alongside could not be looked at").await;
                Err(error)
            }
            Ok((Claim::Claimed, other)) => {
                // Released before ours runs (a retry on the other names finds them free), and
                // abandoned, never left held, by a caller that goes away meanwhile.
                let lease = Lease::new(self.settings.lease);
                let mut probe = UnsettledClaim {
                    armed: Some((&self.store, key, &other, fingerprint, lease)),
                    tasks,
                };
                release(&self.store, key, &other, None, "looked at alongside", tasks).await;
                probe.disarm();
                match kept.then_some(ours) {
                    None => Ok(None),
                    Some(ours) => match self.still_ours(ours, route, &mut guard, None).await {
                        Ok(true) => Ok(None),
                        Ok(false) => Ok(Some(self.lapsed_meanwhile(route))),
                        Err(error) => Err(error),
                    },
                }
            }
            Ok((Claim::TakenOver, other)) => {
                // Held under `other` from here: its holder, and its lease's renewals, first.
                tracing::warn!(key_hash = key.hash(), "idempotency: took over a lapsed claim");
                let held = named.clone().swapped();
                let holder = Holder::new(self, held, other, route.clone(), true);
                let holder = HandBack(Some(holder), self.settings.tasks.clone());
                if kept {
                    // Our own wait may have let ours lapse, and another request take it over
                    // and run under it: the claim taken over runs only once ours is renewed
                    // (fenced), and is handed back with its lapse otherwise (renewed
                    // meanwhile, when keep-alive is on; handed back by a caller that goes
                    // away). Within a third of its lease, so that it runs with most of its
                    // lease left, renewed or not.
                    let bound = Some(self.settings.lease / 3);
                    match self.still_ours(ours, route, &mut guard, bound).await {
                        Ok(true) => {
                            // Ours is let go by `run_taken_over`, in a task of its own.
                            guard.disarm();
                            Ok(Some(self.run_taken_over(holder, ours, route).await))
                        }
                        Ok(false) => {
                            drop(holder.give_back("ours was taken over meanwhile").await);
                            Ok(Some(self.lapsed_meanwhile(route)))
                        }
                        Err(error) => {
                            drop(holder.give_back("ours could not be renewed").await);
                            Err(error)
                        }
                    }
                } else {
                    guard.disarm();
                    Ok(Some(self.run_taken_over(holder, ours, route).await))
                }
            }
            Ok((Claim::Replay { response, .. }, _)) => {
                let opened = self.settings.at_rest.open(key, fingerprint, response);
                self.let_go(ours, "the request completed under the names alongside").await;
                observe::claim(route, "replayed");
                opened.map(|outcome| Some(Claimed::Replay(outcome)))
            }
            Ok((Claim::InProgress { remaining }, _)) => {
                self.let_go(ours, "the request runs under the names alongside").await;
                observe::claim(route, "in_progress");
                let retry_after = self.settings.retry_after.min(remaining);
                Ok(Some(Claimed::InProgress { retry_after }))
            }
            Ok((Claim::Mismatch, _)) => {
                self.let_go(ours, "another request holds the names alongside").await;
                observe::claim(route, "mismatch");
                Ok(Some(Claimed::Mismatch))
            }
        };
        guard.disarm();
        decided
    }

    /// Whether the claim under our names still holds (renewed to a whole lease, fenced by its
    /// owner): `false` when another request took it over after it lapsed (a pause past its
    /// lease), which may have run under it. `Err` (the store failed, or did not answer within
    /// `bound`) lets ours go.
    ///
    /// The touch runs in a task of its own; when nobody is left to hear its answer (the caller
    /// went away, or `bound` ran out), ours is let go once it has landed, by that task or by
    /// the [`Unheard`] answer: a let-go sent while the touch is on the wire could land first,
    /// and the touch would then hold ours for a lease, with nobody there. Meanwhile `guard`
    /// is disarmed.
    async fn still_ours(
        &self,
        ours: (&RecordKey, &OwnerToken, &Fingerprint, bool),
        route: &Label,
        guard: &mut UnsettledClaim<'_, St>,
        bound: Option<Duration>,
    ) -> Result<bool, StoreError> {
        let (key, owner, ..) = ours;
        let (store, lease) = (self.store.clone(), self.settings.lease());
        let (key_, owner_) = (key.clone(), owner.clone());
        let why = "its caller went away while ours was renewed";
        let (sender, answer) = oneshot::channel();
        let mut unheard = Unheard {
            answer,
            let_go: Some(self.let_go(ours, why)),
            tasks: self.settings.tasks.clone(),
        };
        let let_go = self.let_go(ours, why);
        let armed = guard.armed.take();
        drop(spawn(self.settings.tasks.as_ref(), async move {
            let touched = store.touch(&key_, &owner_, lease).await;
            if let Err(Ok(Fenced::Applied) | Err(_)) = sender.send(touched) {
                let_go.await;
            }
        }));
        let answered = match bound {
            Some(bound) => tokio::time::timeout(bound, &mut unheard.answer).await.ok(),
            None => Some((&mut unheard.answer).await),
        };
        let Some(answered) = answered else {
            // Ours is let go once the touch lands (`unheard`, or the task): the guard stays
            // disarmed.
            observe::store_error(route, "touch");
            return Err(StoreError::Timeout(bound.unwrap_or_default()));
        };
        let error = match answered {
            Ok(Ok(Fenced::Applied)) => {
                guard.armed = armed;
                return Ok(true);
            }
            // Not ours any more: nothing of ours to guard, nor to let go.
            Ok(Ok(Fenced::Rejected)) => {
                tracing::warn!(
                    key_hash = key.hash(),
                    "idempotency: the claim lapsed during the look alongside"
                );
                return Ok(false);
            }
            Ok(Err(error)) => error,
            // Its task was dropped unfinished: the runtime shuts down.
            Err(_) => StoreError::unavailable("the touch ended without an answer"),
        };
        observe::store_error(route, "touch");
        // Let go once, here, in a task a caller that goes away does not stop: the guard stays
        // disarmed.
        let letting_go =
            spawn(self.settings.tasks.as_ref(), self.let_go(ours, "ours could not be renewed"));
        drop(letting_go.await);
        Err(error)
    }

    /// The answer when ours lapsed during the look, and was taken over: in progress.
    fn lapsed_meanwhile(&self, route: &Label) -> Claimed<St> {
        observe::claim(route, "in_progress");
        Claimed::InProgress { retry_after: self.settings.retry_after }
    }

    /// Runs under the names alongside, whose lapsed claim `holder` took over: ours is let go.
    async fn run_taken_over(
        &self,
        holder: HandBack<St>,
        ours: (&RecordKey, &OwnerToken, &Fingerprint, bool),
        route: &Label,
    ) -> Claimed<St> {
        observe::claim(route, "taken_over");
        // Ours is let go before the answer, so that a retry right after it finds the request
        // under the names it runs under alone, not ours still held (202). In a task of its own
        // (a caller that goes away does not stop it), waited for a third of a lease at most,
        // and only while renewals hold the claim taken over: an abandon of ours tries for up
        // to a lease, and the operation must not spend the lease it holds waiting for it. A
        // caller gone meanwhile hands it back. Counted on the task tracker, as the operation
        // is: a service that shuts down waits for it, and does not leave ours held for a lease.
        let why = "a lapsed claim under the names alongside is taken over";
        let letting_go = spawn(self.settings.tasks.as_ref(), self.let_go(ours, why));
        if self.renewals.is_some() {
            drop(tokio::time::timeout(self.settings.lease / 3, letting_go).await);
        }
        Claimed::Run(holder.keep())
    }

    /// Lets a claim go: released when it was a fresh claim (nothing ran under it); handed back
    /// when it took a lapsed one over (its lease ends, the record stays for its window), so
    /// that the next claim is a takeover again and asks the recovery hook: the operation may
    /// have happened under it.
    fn let_go(
        &self,
        (key, owner, fingerprint, taken_over): (&RecordKey, &OwnerToken, &Fingerprint, bool),
        why: &'static str,
    ) -> impl Future<Output = ()> + Send + 'static {
        let (store, key, owner) = (self.store.clone(), key.clone(), owner.clone());
        let (fingerprint, lease) = (fingerprint.clone(), self.settings.lease());
        let tasks = self.settings.tasks.clone();
        async move {
            if taken_over {
                abandon(&store, &key, &owner, &fingerprint, lease).await;
            } else {
                release(&store, &key, &owner, None, why, tasks.as_ref()).await;
            }
        }
    }
}

/// The answer of a touch of ours on the wire ([`Engine::still_ours`]). Dropped unread, it
/// closes: a touch not answered yet then finds nobody to answer, and its task lets ours go; one
/// answered already (applied, or failed, so perhaps landed) is read here, and ours let go.
/// Either way once, after the touch.
struct Unheard<F: Future<Output = ()> + Send + 'static> {
    answer: oneshot::Receiver<Result<Fenced, StoreError>>,
    let_go: Option<F>,
    tasks: Option<TaskTracker>,
}

impl<F: Future<Output = ()> + Send + 'static> Drop for Unheard<F> {
    fn drop(&mut self) {
        self.answer.close();
        if let Ok(Ok(Fenced::Applied) | Err(_)) = self.answer.try_recv()
            && let Some(let_go) = self.let_go.take()
            && tokio::runtime::Handle::try_current().is_ok()
        {
            drop(spawn(self.tasks.as_ref(), let_go));
        }
    }
}

/// The holder of a claim taken over under the names alongside, handed back (its renewals
/// stopped first, so that none lands after; its lapse kept for the next claim) if it is
/// dropped before it is kept: its caller went away. The hand-back is counted on the task
/// tracker, when there is one.
struct HandBack<St: Store>(Option<Holder<St>>, Option<TaskTracker>);

impl<St: Store> HandBack<St> {
    fn keep(mut self) -> Holder<St> {
        // `None` only inside `drop` (as tokio-util's `DropGuard::disarm` says of its own).
        self.0.take().expect("a holder is taken only once")
    }

    /// Hands it back now, because `why`: in a task of its own (counted on the tracker), which
    /// a caller that goes away does not stop.
    fn give_back(mut self, why: &'static str) -> JoinHandle<()> {
        let holder = self.0.take().expect("a holder is taken only once");
        spawn(self.1.as_ref(), holder.hand_back(why))
    }
}

impl<St: Store> Drop for HandBack<St> {
    fn drop(&mut self) {
        // Dropped outside any runtime (its own shut down): nothing can hand it back, and its
        // lease lapses, as a holder's does when its process dies.
        if tokio::runtime::Handle::try_current().is_ok()
            && let Some(holder) = self.0.take()
        {
            drop(spawn(self.1.as_ref(), holder.hand_back("its caller went away")));
        }
    }
}
