//! The look at a request's other names after a claim, while a service moves from one naming
//! to another ([`crate::hashing`]).

use std::time::Duration;

use super::{
    Claimed, Engine, Holder, UnsettledClaim, observe,
    observe::Label,
    settle::{abandon, release},
};
use crate::{
    hashing::Named,
    store::{Claim, Fenced, OwnerToken, Store, StoreError},
};

impl<St: Store> Engine<St> {
    /// After a claim won under `named`'s names for `owner`, the request's names alongside,
    /// claimed for a moment, decide. Nothing there (or a claim of ours that lapsed): the claim
    /// stands (`None`). A completed request there is replayed, and copied under our names; one
    /// running there is in progress; another request there is a mismatch; a lapsed holder
    /// there is taken over under those names, so that a fence keyed by them (a table beside
    /// the store) still fences it out. Except when the claim stands, ours is let go (handed back
    /// when it was a takeover). A caller that goes away meanwhile abandons our claim, as one
    /// that goes away during its claim does.
    pub(super) async fn look_alongside(
        &self,
        named: &Named,
        owner: &OwnerToken,
        taken_over: bool,
        route: &Label,
    ) -> Result<Option<Claimed<St>>, StoreError> {
        let (our_key, our_fingerprint) = (&named.key, &named.fingerprint);
        let Some((key, fingerprint)) = &named.alongside else { return Ok(None) };
        let abandoned = self.settings.abandoned_lease();
        let mut guard = UnsettledClaim {
            armed: Some((&self.store, our_key, owner, our_fingerprint, abandoned)),
        };
        // Ours let go: released when it was a fresh claim (nothing ran under it); handed back
        // when it took a lapsed one over (its lease ends, the record stays for its window), so
        // that the next claim is a takeover again and asks the recovery hook: the operation may
        // have happened under it.
        let ours = |why| async move {
            if taken_over {
                let lease = self.settings.lease();
                abandon(&self.store, our_key, owner, our_fingerprint, lease).await;
            } else {
                release(&self.store, our_key, owner, None, why).await;
            }
        };
        let looked = self.claim_once(key, fingerprint, false).await;
        let decided = match looked {
            Err(error) => {
                observe::store_error(route, "claim");
                ours("the names alongside could not be looked at").await;
                Err(error)
            }
            Ok((Claim::Claimed, other)) => {
                release(&self.store, key, &other, None, "looked at alongside").await;
                Ok(None)
            }
            Ok((Claim::TakenOver, other)) => {
                ours("a lapsed claim under the names alongside is taken over").await;
                tracing::warn!(key_hash = key.hash(), "idempotency: took over a lapsed claim");
                observe::claim(route, "taken_over");
                let held = named.clone().swapped();
                Ok(Some(Claimed::Run(Holder::new(self, held, other, route.clone(), true))))
            }
            Ok((Claim::Replay { response, remaining }, _)) => {
                match self.settings.at_rest.open(key, fingerprint, response) {
                    Ok(outcome) => {
                        // Copied under our names, for as long as the original is kept (a second
                        // at least: a store refuses a zero expiry), so that they alone find it.
                        let sealed =
                            self.settings.at_rest.seal(our_key, our_fingerprint, outcome.clone());
                        let kept = remaining.max(Duration::from_secs(1));
                        let copy =
                            self.store.complete(our_key, owner, our_fingerprint, sealed, kept);
                        if !matches!(copy.await, Ok(Fenced::Applied)) {
                            ours("the copy of the record alongside was not stored").await;
                        }
                        observe::claim(route, "replayed");
                        Ok(Some(Claimed::Replay(outcome)))
                    }
                    Err(error) => {
                        ours("the record alongside cannot be read").await;
                        Err(error)
                    }
                }
            }
            Ok((Claim::InProgress { remaining }, _)) => {
                ours("the request runs under the names alongside").await;
                observe::claim(route, "in_progress");
                let retry_after = self.settings.retry_after.min(remaining);
                Ok(Some(Claimed::InProgress { retry_after }))
            }
            Ok((Claim::Mismatch, _)) => {
                ours("another request holds the names alongside").await;
                observe::claim(route, "mismatch");
                Ok(Some(Claimed::Mismatch))
            }
        };
        guard.disarm();
        decided
    }
}
