//! The look at a request's other names after a claim, while a service moves from one naming
//! to another ([`crate::hashing`]).

use std::future::Future;

use super::{
    Claimed, Engine, Holder, UnsettledClaim, observe,
    observe::Label,
    settle::{abandon, release},
};
use crate::{
    fingerprint::Fingerprint,
    hashing::Named,
    key::RecordKey,
    store::{Claim, Lease, OwnerToken, Store, StoreError},
};

impl<St: Store> Engine<St> {
    /// After a claim won under `named`'s names for `owner`, the request's names alongside,
    /// claimed for a moment, decide. Nothing there (or a claim of ours that lapsed): the claim
    /// stands (`None`). A completed request there is replayed; one running there is in
    /// progress; another request there is a mismatch; a lapsed holder there is taken over under
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
    ) -> Result<Option<Claimed<St>>, StoreError> {
        let (our_key, our_fingerprint) = (&named.key, &named.fingerprint);
        let Some((key, fingerprint)) = &named.alongside else { return Ok(None) };
        let abandoned = self.settings.abandoned_lease();
        let mut guard = UnsettledClaim {
            armed: Some((&self.store, our_key, owner, our_fingerprint, abandoned)),
        };
        let looked = self.claim_once(key, fingerprint, false).await;
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
                let mut probe =
                    UnsettledClaim { armed: Some((&self.store, key, &other, fingerprint, lease)) };
                release(&self.store, key, &other, None, "looked at alongside").await;
                probe.disarm();
                Ok(None)
            }
            Ok((Claim::TakenOver, other)) => {
                // Held under `other` from here, its lease renewed, before anything is awaited:
                // letting ours go may take a lease of tries (an abandon, when ours was a
                // takeover too), and a lapse meanwhile would let a retry take it over and run.
                tracing::warn!(key_hash = key.hash(), "idempotency: took over a lapsed claim");
                observe::claim(route, "taken_over");
                let held = named.clone().swapped();
                let holder = Holder::new(self, held, other.clone(), route.clone(), true);
                // Ours is let go before the answer too: a retry right after it must find the
                // request under the names it runs under alone, not ours still held (202). A
                // caller that goes away meanwhile hands the claim taken over back with its
                // lapse (its holder, dropped, renews it no more).
                let lease = self.settings.lease();
                let mut taken =
                    UnsettledClaim { armed: Some((&self.store, key, &other, fingerprint, lease)) };
                self.let_go(ours, "a lapsed claim under the names alongside is taken over").await;
                taken.disarm();
                Ok(Some(Claimed::Run(holder)))
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
        async move {
            if taken_over {
                abandon(&store, &key, &owner, &fingerprint, lease).await;
            } else {
                release(&store, &key, &owner, None, why).await;
            }
        }
    }
}
