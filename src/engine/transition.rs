//! The second claim of a request while a service moves from one naming to another
//! ([`crate::hashing`]): after the names moved from, the names moved to, always in that order,
//! both held until the settle. The protocol's model (`tests/model/protocol.rs`,
//! `Placement::Transition`) checked it first.

use tokio::time::Instant;

use super::{
    Claimed, Engine, Holder, UnsettledClaim,
    claim_once::heard_in_time,
    observe,
    observe::Label,
    settle::{abandon, release},
};
use crate::{
    hashing::Named,
    store::{Claim, OwnerToken, Store, StoreError},
};

/// What the second claim decided.
pub(super) enum Second<St> {
    /// Both names are held: run.
    Held(Holder<St>),
    /// Answered without running (a replay, in progress, a mismatch).
    Decided(Claimed<St>),
    /// The request under the names moved to settled while it was waited for, and left them
    /// free: both names are claimed again, in order.
    Again,
}

impl<St: Store> Engine<St> {
    /// After the claim under `named`'s first names won for `owner` (sent at `sent`), claims its
    /// names moved to. Won too: both held, by one holder. A response stored there: replayed,
    /// and written under the first names too (a neighbour that reads only those replays it
    /// as well). In progress there: the first let go, and the request there waited for within
    /// `waits_until`. Another request there, or a store that fails: the first let go.
    ///
    /// Both claims must be heard within the first's lease, counted from its sending: later,
    /// the first may have lapsed and been taken over meanwhile, and both are let go (503). A
    /// caller that goes away during the second claim abandons both (each by its own guard).
    pub(super) async fn claim_next(
        &self,
        named: &Named,
        (owner, taken_over, sent): (OwnerToken, bool, Instant),
        route: &Label,
        waits_until: Option<Instant>,
    ) -> Result<Second<St>, StoreError> {
        let Some(next) = named.next_names() else {
            let holder = Holder::new(self, named.clone(), owner, route.clone(), taken_over);
            return Ok(Second::Held(holder));
        };
        let (key, fingerprint) = (&named.key, &named.fingerprint);
        let tasks = self.settings.tasks.as_ref();
        let abandoned = self.settings.abandoned_lease();
        let mut guard = UnsettledClaim {
            armed: Some((&self.store, key, &owner, fingerprint, abandoned)),
            tasks,
        };
        let claimed = self.claim_once(&next.key, &next.fingerprint, false).await;
        // Let go of the first claim: released when fresh, abandoned (its lapse kept for the
        // recovery hook) when it took a lapsed one over; before the answer, with the guard
        // still armed.
        let owner_ = &owner;
        let let_go = |why: &'static str| async move {
            if taken_over {
                abandon(&self.store, key, owner_, fingerprint, self.settings.lease()).await;
            } else {
                release(&self.store, key, owner_, Some(route), why, tasks).await;
            }
        };
        let decided = match claimed {
            Err(error) => {
                observe::store_error(route, "claim");
                let_go("the names moved to could not be claimed").await;
                Err(error)
            }
            Ok((Claim::Claimed | Claim::TakenOver, next_owner, _))
                if !heard_in_time(sent.elapsed(), self.settings.lease) =>
            {
                tracing::warn!(
                    key_hash = key.hash(),
                    "idempotency: the second claim of a move came too late to hold the first's lease; both let go, nothing run"
                );
                // Abandoned as a late claim is: a lapsed claim it took over keeps its lapse
                // (the next claim is a takeover, and asks the recovery hook).
                let (next_key, next_fp) = (&next.key, &next.fingerprint);
                abandon(&self.store, next_key, &next_owner, next_fp, abandoned).await;
                let_go("late").await;
                Err(StoreError::Timeout(self.settings.lease))
            }
            Ok((claim @ (Claim::Claimed | Claim::TakenOver), next_owner, _)) => {
                let next_taken_over = claim == Claim::TakenOver;
                let first = Holder::new(self, named.clone(), owner.clone(), route.clone(), false);
                let second = first.beside(self, next, next_owner);
                let next_first = named.next.as_ref().is_some_and(|next| next.completed_first);
                let holder = first.holding(second, next_first, taken_over || next_taken_over);
                guard.disarm();
                Ok(Second::Held(holder))
            }
            Ok((Claim::Replay { response, .. }, _, _)) => {
                match self.settings.at_rest.open(&next.key, &next.fingerprint, response) {
                    Ok(outcome) => {
                        // Written under the first names too, once; a store that fails it
                        // leaves them to lapse (a retry finds the response again here).
                        let sealed = self.settings.at_rest.seal(key, fingerprint, outcome.clone());
                        let retention = self.settings.retention;
                        let written =
                            self.store.complete(key, &owner, fingerprint, sealed, retention).await;
                        if written.is_err() {
                            let_go("the replay could not be written under the first names").await;
                        }
                        observe::claim(route, "replayed");
                        Ok(Second::Decided(Claimed::Replay(outcome)))
                    }
                    Err(error) => {
                        let_go("the stored response could not be read").await;
                        Err(error)
                    }
                }
            }
            Ok((Claim::InProgress { remaining }, _, _)) => {
                let_go("the request runs under the names moved to").await;
                let left = waits_until.map(|until| until.saturating_duration_since(Instant::now()));
                // A place among the waiters, as any wait takes: past them, answered at once.
                let place = left.filter(|left| !left.is_zero()).and_then(|left| {
                    Some((left, self.settings.waiters.clone().try_acquire_owned().ok()?))
                });
                match place {
                    Some((wait, _place)) => {
                        guard.disarm();
                        let (claim, waited, _) =
                            self.wait(&next.key, &next.fingerprint, wait).await?;
                        return Ok(match claim {
                            Claim::Claimed | Claim::TakenOver => {
                                // Let go, to be claimed again in order: a lapsed claim taken
                                // over keeps its lapse (abandoned), so that the claim in order
                                // is a takeover again, and asks the recovery hook.
                                let (next_key, next_fp) = (&next.key, &next.fingerprint);
                                if claim == Claim::TakenOver {
                                    let lease = self.settings.lease();
                                    abandon(&self.store, next_key, &waited, next_fp, lease).await;
                                } else {
                                    let why = "claimed again in order";
                                    release(
                                        &self.store,
                                        next_key,
                                        &waited,
                                        Some(route),
                                        why,
                                        tasks,
                                    )
                                    .await;
                                }
                                Second::Again
                            }
                            Claim::Replay { response, .. } => {
                                observe::claim(route, "replayed");
                                let outcome = self.settings.at_rest.open(
                                    &next.key,
                                    &next.fingerprint,
                                    response,
                                )?;
                                Second::Decided(Claimed::Replay(outcome))
                            }
                            Claim::InProgress { remaining } => {
                                observe::claim(route, "in_progress");
                                let retry_after = self.settings.retry_after.min(remaining);
                                Second::Decided(Claimed::InProgress { retry_after })
                            }
                            Claim::Mismatch => {
                                observe::claim(route, "mismatch");
                                Second::Decided(Claimed::Mismatch)
                            }
                        });
                    }
                    None => {
                        observe::claim(route, "in_progress");
                        let retry_after = self.settings.retry_after.min(remaining);
                        Ok(Second::Decided(Claimed::InProgress { retry_after }))
                    }
                }
            }
            Ok((Claim::Mismatch, _, _)) => {
                let_go("another request holds the names moved to").await;
                observe::claim(route, "mismatch");
                Ok(Second::Decided(Claimed::Mismatch))
            }
        };
        guard.disarm();
        decided
    }
}
