//! The task that looks over one runtime's claims and renews the due ones, each renewal in a
//! task of its own ([`look_over`]), and what a renewal's end tells the claim ([`Touched`]).

use std::{
    sync::{Arc, Weak},
    time::Duration,
};

use tokio::{runtime, time::Instant};

use super::{Shared, Ticket, later};
use crate::{
    engine::observe::{self, Label},
    key::RecordKey,
    store::{CommitSlot, Fenced, OwnerToken, Store},
};

/// Every quarter of a period (so that a renewal is sent between three quarters of a period and
/// a period after the last, and a failed one is tried again while the lease runs),
/// sends the due renewals of the claims made on `runtime`, the one it runs on. Ends when the
/// engine and every claim of it are gone.
pub(super) async fn look_over<St: Store>(
    shared: Weak<Shared<St>>,
    period: Duration,
    runtime: runtime::Id,
) {
    let tick = (period / 4).max(Duration::from_millis(1));
    loop {
        tokio::time::sleep(tick).await;
        let Some(shared) = shared.upgrade() else { return };
        let now = Instant::now();
        let mut state = shared.lock();
        let (mut given_up, mut due) = (Vec::new(), Vec::new());
        for (index, entry) in &mut state.claims {
            if entry.runtime != runtime
                || entry.touching
                || now.duration_since(entry.renewed_at) < shared.period - tick
            {
                continue;
            }
            if entry.commit.holds_record() {
                // The operation's transaction writes the record: a renewal would conflict with
                // it. Looked at again a period on.
                entry.renewed_at = now;
                continue;
            }
            if now >= entry.give_up_at {
                tracing::warn!(
                    key_hash = entry.key.hash(),
                    "idempotency: keep-alive ceiling reached; the lease will lapse"
                );
                given_up.push(index);
                continue;
            }
            entry.touching = true;
            entry.renewed_at = now;
            let ticket = Ticket { index, serial: entry.serial };
            // Made before the task, so that a task the runtime drops unstarted still ends it.
            let touched = Touched {
                shared: shared.clone(),
                ticket,
                keep: true,
                soon: false,
                held_until: None,
            };
            let touch = (entry.key.clone(), entry.owner.clone());
            due.push((touched, touch, entry.route.clone(), entry.commit.clone()));
        }
        for index in given_up {
            state.claims.remove(index);
        }
        // Spawned with the lock released: a runtime shutting down drops a task it is given at
        // once, and its `Touched` takes the lock.
        drop(state);
        for (touched, touch, route, commit) in due {
            drop(tokio::spawn(renew(touched, touch, route, commit)));
        }
    }
}

/// One renewal of one claim.
async fn renew<St: Store>(
    mut touched: Touched<St>,
    (key, owner): (RecordKey, OwnerToken),
    route: Label,
    commit: Arc<CommitSlot>,
) {
    let hash = key.hash();
    let sent = Instant::now();
    match touched.shared.store.touch(&key, &owner, touched.shared.lease).await {
        Ok(Fenced::Applied) => {
            touched.held_until = Some(later(sent, touched.shared.lease.duration));
        }
        // The holder's own complete, or the operation's own transaction, settled the record
        // (the renewal ran beside it, or waited on its row lock): not a lease lost.
        Ok(Fenced::Rejected) if commit.begun() => {
            touched.keep = false;
            tracing::debug!(key_hash = hash, "idempotency: the record was settled by its holder");
        }
        Ok(Fenced::Rejected) => {
            touched.keep = false;
            tracing::warn!(key_hash = hash, "idempotency: lease lost to another request");
        }
        // Tried again a quarter period on, not a period: a store that stalls for most of a
        // lease is renewed as soon as it answers again.
        Err(error) => {
            touched.soon = true;
            observe::store_error(&route, "touch");
            tracing::warn!(key_hash = hash, %error, "idempotency: lease renewal failed");
        }
    }
}

/// The end of a renewal on the wire, however it ends (answered, or its task dropped): the
/// claim is renewed again when due, or removed (lost, or settled meanwhile, whose settle is
/// told).
struct Touched<St> {
    shared: Arc<Shared<St>>,
    ticket: Ticket,
    /// Whether the claim is still to be renewed.
    keep: bool,
    /// The renewal failed: the next is due a quarter period on.
    soon: bool,
    /// The renewal was applied: the lease holds until then.
    held_until: Option<Instant>,
}

impl<St> Drop for Touched<St> {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        let period = self.shared.period;
        let Some(entry) = state.entry(self.ticket) else { return };
        entry.touching = false;
        if let Some(held_until) = self.held_until {
            entry.held_until = held_until;
        }
        if self.soon {
            let now = Instant::now();
            entry.renewed_at = now.checked_sub(period - period / 4).unwrap_or(now);
        }
        match entry.ended.take() {
            Some(waiter) => {
                state.claims.remove(self.ticket.index);
                drop(state);
                if let Some(waiter) = waiter {
                    let _ = waiter.send(());
                }
            }
            None if !self.keep => drop(state.claims.remove(self.ticket.index)),
            None => {}
        }
    }
}
