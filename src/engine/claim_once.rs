//! One claim of a key under a fresh owner token, its guard, and the bound on when its answer
//! may still be acted on.

use std::time::Duration;

use tokio::time::Instant;

use super::{Engine, UnsettledClaim, renewals};
use crate::{
    fingerprint::Fingerprint,
    key::RecordKey,
    store::{Claim, OwnerToken, Store, StoreError},
};

impl<St: Store> Engine<St> {
    /// One claim, under a fresh owner token. A caller dropped while the claim is on the wire,
    /// or whose claim timed out, may own the key without knowing it, or may come to own it
    /// when the claim lands late: a guard abandons whatever its token may hold. A claim won
    /// but answered too late to hold its lease is abandoned so, and the key claimed again,
    /// once: the caller gets what holds it now, and when the claim it got was sent.
    pub(super) async fn claim_once(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        waiting: bool,
    ) -> Result<(Claim, OwnerToken, Instant), StoreError> {
        match self.claim_in_time(key, fingerprint, waiting).await {
            // Claimed again, once, under a fresh token: what holds the key now (the holder
            // that took it over, its stored response) answers the caller.
            Err(Late) => self
                .claim_in_time(key, fingerprint, waiting)
                .await
                .map_err(|Late| StoreError::Timeout(self.settings.lease))?,
            Ok(claimed) => claimed,
        }
    }

    /// One claim, under a fresh owner token; `Err(Late)` when it was won but answered too late
    /// to hold its lease ([`heard_in_time`]): its guard abandons it, fenced by its token (a
    /// record taken over meanwhile, or completed by the other holder, is left as it is), and
    /// it never runs.
    async fn claim_in_time(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        waiting: bool,
    ) -> Result<Result<(Claim, OwnerToken, Instant), StoreError>, Late> {
        let owner = OwnerToken::random();
        let lease = self.settings.lease();
        let abandoned = self.settings.abandoned_lease();
        let mut guard = UnsettledClaim {
            armed: Some((&self.store, key, &owner, fingerprint, abandoned)),
            tasks: self.settings.tasks.as_ref(),
        };
        let sent = Instant::now();
        let claim = if waiting {
            self.store.claim_waiting(key, fingerprint, &owner, lease).await
        } else {
            self.store.claim(key, fingerprint, &owner, lease).await
        };
        if let Ok(Claim::Claimed | Claim::TakenOver) = &claim
            && !heard_in_time(sent.elapsed(), lease.duration)
        {
            tracing::warn!(
                key_hash = key.hash(),
                elapsed_ms = sent.elapsed().as_millis(),
                "idempotency: a claim's answer came too late to hold its lease; abandoned, not run"
            );
            // Abandoned here, before the key is claimed again: left to the guard's task, the
            // next claim could find this very claim still held and answer "in progress" for a
            // request nothing runs. A store that fails it leaves it to the guard.
            if self.store.abandon(key, &owner, fingerprint, abandoned).await.is_ok() {
                guard.disarm();
            }
            drop(guard);
            return Err(Late);
        }
        if !matches!(&claim, Err(error) if error.is_unavailable() && !error.was_never_sent()) {
            guard.disarm();
        }
        drop(guard);
        Ok(claim.map(|claim| (claim, owner, sent)))
    }
}

/// A claim won, but answered too late to hold its lease.
struct Late;

/// Whether a claim won `elapsed` after it was sent can be held: its first renewal, a renewal
/// period after its answer, comes before its lease ends. A claim answered later (its process
/// paused, its answer held up on the wire) may have lapsed and been taken over meanwhile, its
/// record even completed by the other holder, and is never run: the model of the protocol
/// (`tests/model/protocol.rs`) found the run after a stored response without this bound.
pub(crate) fn heard_in_time(elapsed: Duration, lease: Duration) -> bool {
    // Half the lease at least: a lease of a few milliseconds is no longer than its period.
    elapsed < lease.saturating_sub(renewals::period(lease)).max(lease / 2)
}
