//! [`Renewals`]: the leases of one engine's running claims, renewed by one task per runtime for them all.
//!
//! A claim registers here ([`Renewals::register`]: a lock and a slab slot) and is renewed every
//! third of a lease (every second at most), from the claim to its settle, for at most the keep-alive ceiling. One task
//! per engine and runtime looks over that runtime's claims every twelfth of a lease and sends
//! each due renewal in a task of its own; a claim settled first costs no task and no timer of
//! its own. The renewals run beside the request's task, not in it, so that an operation that
//! holds its thread for longer than a lease (blocking where it should await) does not stop them
//! on a multi-threaded runtime; and on the claim's own runtime, not the first claim's, so that
//! a runtime that idles (a current-thread runtime between two `block_on`) stops no other
//! runtime's renewals.
//!
//! A settle stops its claim's renewals and waits for one on the wire ([`Renewing::stop`]), so
//! that no renewal lands after the settle: a hand-back (a lease ended now) would otherwise be
//! undone by a renewal landing after it, and the key held for another lease.

use super::observe::Label;
use std::{
    sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError},
    time::Duration,
};

use slab::Slab;
use tokio::{runtime, sync::oneshot, task::JoinHandle, time::Instant};

use self::look_over::look_over;
use super::Settings;
use crate::{
    key::RecordKey,
    store::{CommitSlot, Lease, OwnerToken, Store},
};

mod look_over;

/// A door's renewals: made on its first claim, for its settings then, and shared by every
/// engine the door makes (the HTTP layer makes one per service it wraps, an axum `Router` not
/// turned into a service first one per request; the consumer door one per operation). A door
/// whose settings change starts a new cell.
pub(crate) struct RenewalsCell<St>(Arc<OnceLock<Option<Renewals<St>>>>);

impl<St> Default for RenewalsCell<St> {
    fn default() -> Self {
        Self(Arc::default())
    }
}

impl<St> Clone for RenewalsCell<St> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<St> std::fmt::Debug for RenewalsCell<St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("RenewalsCell").field(&self.0.get().is_some()).finish()
    }
}

impl<St: Clone> RenewalsCell<St> {
    /// The renewals of claims on `store` under `settings`: `None` when keep-alive is off.
    pub(crate) fn get(&self, store: &St, settings: &Settings) -> Option<Renewals<St>> {
        let renewals = self.0.get_or_init(|| {
            let ceiling = settings.keep_alive?;
            Some(Renewals::new(store.clone(), settings.lease(), ceiling))
        });
        renewals.clone()
    }
}

/// The renewals of one door's claims; clones share them.
pub(crate) struct Renewals<St> {
    shared: Arc<Shared<St>>,
}

impl<St> Clone for Renewals<St> {
    fn clone(&self) -> Self {
        Self { shared: self.shared.clone() }
    }
}

impl<St> std::fmt::Debug for Renewals<St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Renewals").field("lease", &self.shared.lease).finish_non_exhaustive()
    }
}

struct Shared<St> {
    store: St,
    /// The lease each renewal sets.
    lease: Lease,
    /// How long after the last renewal (or the claim) the next is due: a third of the lease,
    /// so that a failed renewal is tried again while the lease still runs.
    period: Duration,
    /// How long from its claim a claim is renewed at most.
    ceiling: Duration,
    state: Mutex<State>,
}

struct State {
    claims: Slab<Entry>,
    /// Tells a slot's claims apart over time, so that a settled claim's ticket never reaches
    /// the claim that took its slot.
    serial: u64,
    /// The tasks that look over the claims, one per runtime that claimed, each spawned on its
    /// runtime's first claim and ended with that runtime. Few (an application has one runtime
    /// or a handful), so a list.
    tasks: Vec<(runtime::Id, JoinHandle<()>)>,
}

/// One running claim.
struct Entry {
    serial: u64,
    key: RecordKey,
    owner: OwnerToken,
    /// The runtime the claim was made on, whose task renews it.
    runtime: runtime::Id,
    route: Label,
    commit: Arc<CommitSlot>,
    /// The claim, then each renewal's sending.
    renewed_at: Instant,
    /// Until when the lease surely holds: a lease from the claim, then from the sending of the
    /// last renewal the store applied.
    held_until: Instant,
    give_up_at: Instant,
    /// A renewal is on the wire.
    touching: bool,
    /// The claim settled (or its holder was dropped) while a renewal was on the wire: the
    /// renewal's end removes it, and tells the settle, which waits, here.
    ended: Option<Option<oneshot::Sender<()>>>,
}

/// A claim's place among the renewals.
#[derive(Debug, Clone, Copy)]
struct Ticket {
    index: usize,
    serial: u64,
}

impl<St> Renewals<St> {
    /// Renewals of claims on `store` with `lease`, each for at most `ceiling` from its claim.
    fn new(store: St, lease: Lease, ceiling: Duration) -> Self {
        let period = period(lease.duration);
        let state = State { claims: Slab::new(), serial: 0, tasks: Vec::new() };
        Self {
            shared: Arc::new(Shared { store, lease, period, ceiling, state: Mutex::new(state) }),
        }
    }
}

impl<St: Store> Renewals<St> {
    /// Renews `owner`'s claim of `key` until the returned [`Renewing`] stops or is dropped.
    pub(crate) fn register(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        route: &Label,
        commit: &Arc<CommitSlot>,
    ) -> Renewing<St> {
        let now = Instant::now();
        let runtime = runtime::Handle::current().id();
        let give_up_at = super::after(self.shared.ceiling);
        let (key, owner, route, commit) =
            (key.clone(), owner.clone(), route.clone(), commit.clone());
        let mut state = self.shared.lock();
        state.serial += 1;
        let serial = state.serial;
        let entry = Entry {
            serial,
            key,
            owner,
            runtime,
            route,
            commit,
            renewed_at: now,
            held_until: later(now, self.shared.lease.duration),
            give_up_at,
            touching: false,
            ended: None,
        };
        let index = state.claims.insert(entry);
        let spawned_task =
            !state.tasks.iter().any(|(id, task)| *id == runtime && !task.is_finished());
        if spawned_task {
            // A finished task's runtime is gone (its claims went with it).
            state.tasks.retain(|(_, task)| !task.is_finished());
            let shared = Arc::downgrade(&self.shared);
            let task = tokio::spawn(look_over(shared, self.shared.period, runtime));
            state.tasks.push((runtime, task));
        }
        drop(state);
        let ticket = Ticket { index, serial };
        Renewing { renewals: Some(self.clone()), ticket, spawned_task }
    }
}

impl<St> Shared<St> {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl State {
    fn entry(&mut self, ticket: Ticket) -> Option<&mut Entry> {
        self.claims.get_mut(ticket.index).filter(|entry| entry.serial == ticket.serial)
    }

    /// Ends `ticket`'s renewals: at once, or, with a renewal on the wire, when it ends. Then,
    /// when `wait`, the receiver hears that end.
    fn end(&mut self, ticket: Ticket, wait: bool) -> Option<oneshot::Receiver<()>> {
        let entry = self.entry(ticket)?;
        if entry.touching {
            let (waiter, on_the_wire) = match wait {
                true => {
                    let (waiter, on_the_wire) = oneshot::channel();
                    (Some(waiter), Some(on_the_wire))
                }
                false => (None, None),
            };
            entry.ended = Some(waiter);
            return on_the_wire;
        }
        self.claims.remove(ticket.index);
        None
    }
}

/// A claim's renewals; dropped, they stop (without waiting for one on the wire).
pub(crate) struct Renewing<St> {
    renewals: Option<Renewals<St>>,
    ticket: Ticket,
    /// This claim spawned its runtime's renewals task (the runtime's first claim).
    spawned_task: bool,
}

impl<St> Renewing<St> {
    /// Whether this claim spawned its runtime's renewals task. A task spawned from a worker of a
    /// multi-threaded runtime waits in that worker's LIFO slot, which no other worker steals:
    /// behind an operation run in the same task that blocks the thread (a handler that
    /// blocks where it should await) for longer than a lease, it would not renew the lease.
    pub(crate) fn spawned_task(&self) -> bool {
        self.spawned_task
    }

    /// Whether the lease still holds: renewed (neither lost to another request nor past the
    /// keep-alive ceiling), and not lapsed for want of a renewal the store applied.
    pub(crate) fn is_held(&self) -> bool {
        self.renewals.as_ref().is_some_and(|renewals| {
            let mut state = renewals.shared.lock();
            state
                .entry(self.ticket)
                .is_some_and(|entry| entry.ended.is_none() && Instant::now() < entry.held_until)
        })
    }

    /// Stops the renewals, and waits for one on the wire: before a settle, so that no renewal
    /// lands after it.
    pub(crate) async fn stop(mut self) {
        let Some(renewals) = self.renewals.take() else { return };
        let on_the_wire = renewals.shared.lock().end(self.ticket, true);
        if let Some(on_the_wire) = on_the_wire {
            // Err when the renewal's task was dropped with its runtime: nothing is on the wire.
            let _ = on_the_wire.await;
        }
    }
}

impl<St> Drop for Renewing<St> {
    fn drop(&mut self) {
        if let Some(renewals) = self.renewals.take() {
            renewals.shared.lock().end(self.ticket, false);
        }
    }
}

/// `at` plus `by`, saturating as `store::later` does (a lease of `Duration::MAX` means "kept").
fn later(at: Instant, by: Duration) -> Instant {
    Instant::from_std(crate::store::later(at.into_std(), by))
}

/// The longest time between two renewals of a claim: the lease's last renewal is never more
/// than this old, so that a store that stalls for the lease less this (a failover, a paused
/// server) never lets a retry take over a key whose holder is alive and settling.
const LONGEST_PERIOD: Duration = Duration::from_secs(1);

/// How often a claim of `lease` is renewed: a third of its lease, a second at most.
pub(crate) fn period(lease: Duration) -> Duration {
    (lease / 3).min(LONGEST_PERIOD).max(Duration::from_millis(1))
}
