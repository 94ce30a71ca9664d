//! The engine: the idempotency state machine, knowing nothing of HTTP or of any one front door.
//!
//! 1. claim: one store call decides: run, replay, in progress, or mismatch. A claim whose
//!    answer never reached its caller (the caller was dropped, or the store timed out) is
//!    abandoned by a guard ([`Store::abandon`]), fenced by its owner token: its lease ends,
//!    what it may have taken over is kept, and a claim still on the wire cannot land.
//! 2. run: the engine runs the claimed operation from claim to settle
//!    ([`Engine::run_claimed`]), in the caller's task and in one of its own once the caller
//!    goes away (it never cancels it): the recovery hook when one is due, the
//!    operation, a failure or a panic that releases the key (the panic resumed in the
//!    caller); the [`Holder`] renews the lease from the claim to the settle (recovery hook,
//!    operation, response body).
//! 3. settle: the front door's, given the holder: complete (store the outcome) or release
//!    (let a retry run), both fenced by the owner token, and retried in the background when
//!    the store fails; it answers the caller through [`Answer`].
//!
//! The front doors (`crate::layer`, `crate::consumer`) turn their world into a record key, a
//! fingerprint, an operation and bytes to store, and the engine's answers ([`Claimed`],
//! [`Ended`]) back into theirs.

mod claim_once;
mod complete;
mod door;
pub(crate) mod envelope;
mod fleet;
mod holder;
pub(crate) mod observe;
mod operate;
mod renewals;
mod run;
mod setters;
mod settle;
mod transition;
mod unsettled;

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use tokio::sync::Semaphore;
use tokio_util::task::TaskTracker;

pub use self::complete::Completed;
pub(crate) use self::door::{Door, Held, Settlement, StreamEnd, Streaming};
pub(crate) use self::holder::{Asked, Holder, Panic};
pub(crate) use self::observe::Label;
pub(crate) use self::renewals::{Renewals, RenewalsCell};
pub(crate) use self::run::{Claiming, Decided, Ended, Operated, Start};
pub(crate) use self::setters::{engine_setters, inner_service_accessors};
use self::transition::Second;
use self::unsettled::{UnsettledClaim, spawn};
use crate::{
    at_rest::AtRest,
    fingerprint::Fingerprint,
    hashing::{Deploy, Named, Next},
    key::RecordKey,
    settings::DEFAULT_MAX_WAITERS,
    store::{Claim, Lease, OwnerToken, Store, StoreError, later},
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
    /// How long a duplicate waits for an in-progress original to settle; `None`: not at all.
    pub(crate) wait: Option<Duration>,
    /// Places for waiters, shared by every clone of these settings: past them, a duplicate
    /// is answered at once.
    pub(crate) waiters: Arc<Semaphore>,
    /// The longest `Retry-After` hint given to a duplicate that is not waited for.
    pub(crate) retry_after: Duration,
    /// When and how a claim asks the front door's recovery hook.
    pub(crate) recovery: crate::settings::Recovery,
    /// Whether the front door has a recovery hook: only then is a lapsed claim remembered
    /// for a window, and the hook asked.
    pub(crate) recovering: bool,
    /// Whether outcomes are encrypted at rest.
    pub(crate) at_rest: AtRest,
    /// Release the key of an outcome too large to keep, rather than keep a "completed, not
    /// replayable" record of it.
    pub(crate) release_too_large: bool,
    /// How records are named in the store: plain or keyed hashes.
    pub(crate) hashing: crate::hashing::Hashing,
    /// What the door last learned of its fleet, shared by every clone of these settings.
    pub(crate) fleet: Arc<self::fleet::Fleet>,
}

impl Settings {
    /// The lease of a claim, with its recovery window.
    pub(crate) fn lease(&self) -> Lease {
        // Kept with a hook or without: a claim after a lapse is a takeover, counted and traced
        // as one (a holder died), whether or not a hook is there to ask.
        let window = self.recovery.window.unwrap_or(self.retention);
        Lease::new(self.lease).recovery_window(window)
    }

    /// The lease a claim whose answer was never seen is abandoned with: a record it may have
    /// taken over is kept for the window only when a hook is there to ask (without one, the
    /// claim never ran anything, and the key is freed).
    pub(crate) fn abandoned_lease(&self) -> Lease {
        match self.recovering {
            true => self.lease(),
            false => Lease::new(self.lease),
        }
    }
}

/// How often a waiter polls a store that cannot notify: at first, and at most.
const FIRST_POLL: Duration = Duration::from_millis(50);
const LAST_POLL: Duration = Duration::from_secs(1);

/// The default for how long a duplicate request waits for its in-progress original: long
/// enough for the handlers of a payment or an order to finish, short of the 60 s that proxies
/// (nginx's `proxy_read_timeout`, AWS ALB's idle timeout) and clients (stripe-python's 80 s)
/// give a request.
const DEFAULT_HTTP_WAIT: Duration = Duration::from_secs(10);

/// The default lease of a request's door: no longer than its wait, so that a retry that waits for a
/// holder that died takes its key over within the wait (the lease is renewed while the handler
/// runs, so a handler may run longer).
const DEFAULT_HTTP_LEASE: Duration = DEFAULT_HTTP_WAIT;

impl Settings {
    /// The defaults of a door whose callers wait for their answer (the HTTP and gRPC doors): a
    /// retry waits for a running original, and the lease is no longer than that wait.
    pub(crate) fn for_requests() -> Self {
        Self { lease: DEFAULT_HTTP_LEASE, wait: Some(DEFAULT_HTTP_WAIT), ..Self::default() }
    }
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(24 * 60 * 60),
            keep_alive: Some(Duration::from_secs(5 * 60)),
            tasks: None,
            wait: None,
            waiters: Arc::new(Semaphore::new(DEFAULT_MAX_WAITERS)),
            retry_after: Duration::from_secs(1),
            recovery: crate::settings::Recovery::default(),
            recovering: false,
            at_rest: AtRest::default(),
            release_too_large: false,
            hashing: crate::hashing::Hashing::default(),
            fleet: Arc::default(),
        }
    }
}

/// The state machine over one store.
#[derive(Debug, Clone)]
pub(crate) struct Engine<St> {
    store: St,
    settings: Arc<Settings>,
    /// Where the leases of running claims are renewed; `None` when keep-alive is off.
    renewals: Option<Renewals<St>>,
}

/// What a claim found.
#[derive(Debug)]
enum Claimed<St> {
    /// The key is the caller's: run the operation through this holder.
    Run(Holder<St>),
    /// The same request completed: its stored outcome.
    Replay(Bytes),
    /// The same request is running elsewhere (and did not settle within the wait, when
    /// waiting is on): ask again after `retry_after`, a short hint, never past the lease.
    InProgress { retry_after: Duration },
    /// The key is held by a different request.
    Mismatch,
}

impl<St: Clone> Engine<St> {
    /// An engine for a door whose claims' leases `renewals` renew.
    pub(crate) fn new(store: St, settings: Arc<Settings>, renewals: &RenewalsCell<St>) -> Self {
        let renewals = renewals.get(&store, &settings);
        Self { store, settings, renewals }
    }
}

impl<St: Store> Engine<St> {
    /// A request's names in the store, from its plain record key and fingerprint: what a
    /// front door claims, logs and gives its operation's context. During a move of the
    /// store's own (a `RegionalStore` between region lists) that changes the key's home, its
    /// names in the placement moved to come second, as a move between namings' do; the fleet
    /// refuses a door whose naming and store move at once.
    pub(crate) fn name(&self, key: RecordKey, fingerprint: Fingerprint) -> Named {
        let mut named = self.settings.hashing.name(key, fingerprint);
        if named.next.is_none()
            && let Some(deploy) = self.store.moves(&named.key)
        {
            named.next = Some(Next {
                key: named.key.in_next_placement(),
                fingerprint: named.fingerprint.clone(),
                completed_first: deploy == Deploy::Second,
            });
        }
        named
    }
}

impl<St> Engine<St> {
    pub(crate) fn store(&self) -> &St {
        &self.store
    }

    /// How long a completed outcome is kept.
    pub(crate) fn retention(&self) -> Duration {
        self.settings.retention
    }

    /// The longest a front door's hook into the system of record may take.
    pub(crate) fn recovery_timeout(&self) -> Duration {
        self.settings.recovery.timeout
    }
}

impl<St: Store> Engine<St> {
    /// Claims `key` for a request with `fingerprint`. When the same request is in progress
    /// and waiting is on, waits (bounded) for it to settle: then replays it, or runs when it
    /// was released.
    ///
    /// `route` labels the metrics (the matched route, or the consumer's scope): never a key.
    /// `wait_until` ends the wait sooner: the caller's own deadline.
    async fn claim(
        &self,
        named: Named,
        route: Label,
        wait_until: Option<tokio::time::Instant>,
    ) -> Result<Claimed<St>, StoreError> {
        // Counted as the claim's: the first claim of a door announces it to its fleet.
        if let Err(error) = self.in_its_fleet(&named.key).await {
            if error.is_unavailable() {
                observe::store_error(&route, "claim");
            }
            return Err(error);
        }
        // During a move, the request's whole wait, its own caller's deadline within it: a wait
        // on the names moved to waits only within what is left of it.
        let waits_until = (self.settings.wait)
            .filter(|_| named.next.is_some())
            .map(after)
            .map(|end| wait_until.map_or(end, |until| end.min(until)));
        let mut in_order_again = true;
        loop {
            // Claimed again in order after a wait under the names moved to: within what is left
            // of the request's wait, not a wait of its own.
            let until = if in_order_again { wait_until } else { waits_until.or(wait_until) };
            let claimed = self.claim_or_wait(&named.key, &named.fingerprint, &route, until).await;
            let (claim, owner, sent) = match claimed {
                Ok(claimed) => claimed,
                Err(error) => {
                    observe::store_error(&route, "claim");
                    return Err(error);
                }
            };
            if !matches!(claim, Claim::Claimed | Claim::TakenOver) {
                return self.found(claim, &named, &route);
            }
            // During a move, the names moved to are claimed next (claimed again in order, once,
            // when the request there settled and left them free while it was waited for).
            let taken_over = claim == Claim::TakenOver;
            let waits = waits_until.filter(|_| in_order_again);
            let holder =
                match self.claim_next(&named, (owner, taken_over, sent), &route, waits).await? {
                    Second::Held(holder) => holder,
                    Second::Decided(decided) => return Ok(decided),
                    Second::Again => {
                        in_order_again = false;
                        continue;
                    }
                };
            let key = &named.key;
            return Ok({
                if holder.taken_over() {
                    tracing::warn!(key_hash = key.hash(), "idempotency: took over a lapsed claim");
                    observe::claim(&route, "taken_over");
                } else {
                    tracing::debug!(key_hash = key.hash(), "idempotency: claimed");
                    observe::claim(&route, "claimed");
                }
                Claimed::Run(holder)
            });
        }
    }

    /// What a claim under `named`'s first names found, when it did not win it.
    fn found(&self, claim: Claim, named: &Named, route: &Label) -> Result<Claimed<St>, StoreError> {
        Ok(match claim {
            Claim::Claimed | Claim::TakenOver => unreachable!("a claim won is run"),
            Claim::Replay { response: stored, .. } => {
                observe::claim(route, "replayed");
                Claimed::Replay(self.settings.at_rest.open(
                    &named.key,
                    &named.fingerprint,
                    stored,
                )?)
            }
            Claim::InProgress { remaining } => {
                observe::claim(route, "in_progress");
                Claimed::InProgress { retry_after: self.settings.retry_after.min(remaining) }
            }
            Claim::Mismatch => {
                tracing::info!(
                    key_hash = named.key.hash(),
                    "idempotency: key reused with a different request"
                );
                observe::claim(route, "mismatch");
                Claimed::Mismatch
            }
        })
    }

    /// One claim and, when the request is in progress and waiting is on, the wait.
    async fn claim_or_wait(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        route: &Label,
        wait_until: Option<tokio::time::Instant>,
    ) -> Result<(Claim, OwnerToken, tokio::time::Instant), StoreError> {
        let (mut claim, mut owner, mut sent) = self.claim_once(key, fingerprint, false).await?;
        let left = |wait: Duration| match wait_until {
            Some(until) => wait.min(until.saturating_duration_since(tokio::time::Instant::now())),
            None => wait,
        };
        if matches!(claim, Claim::InProgress { .. })
            && let Some(wait) = self.settings.wait.map(left).filter(|wait| !wait.is_zero())
        {
            match self.settings.waiters.clone().try_acquire_owned() {
                Ok(_place) => {
                    let started = tokio::time::Instant::now();
                    (claim, owner, sent) = self.wait(key, fingerprint, wait).await?;
                    observe::waited(route, started.elapsed());
                }
                Err(_) => tracing::debug!(
                    key_hash = key.hash(),
                    "idempotency: too many waiters; not waiting"
                ),
            }
        }
        Ok((claim, owner, sent))
    }

    /// Waits up to `wait` for an in-progress record to settle: subscribe, claim again
    /// (marking the record as waited for, so its settle publishes), then sleep until the
    /// settle, the original's lease lapsing, or the deadline. A lost notification cannot strand
    /// the waiter: at the deadline a last claim decides. A store that cannot notify ([`Subscription::is_live`] false) is
    /// polled instead, every 50 ms at first and backing off to every second.
    async fn wait(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        wait: Duration,
    ) -> Result<(Claim, OwnerToken, tokio::time::Instant), StoreError> {
        let deadline = after(wait);
        let mut subscription = self.store.subscribe(key).await;
        let mut poll = (!subscription.is_live()).then_some(FIRST_POLL);
        loop {
            let (claim, owner, sent) = self.claim_once(key, fingerprint, true).await?;
            let Claim::InProgress { remaining } = claim else {
                tracing::debug!(key_hash = key.hash(), "idempotency: waited for the original");
                return Ok((claim, owner, sent));
            };
            // Claim again when the original's lease would lapse (a holder that died settles
            // nothing: its key is taken over then, within the wait), or when the store says to
            // look again (a row another transaction holds locked).
            let lapse = after(remaining.max(FIRST_POLL));
            let wake = poll.map_or(deadline, |every| after(every).min(deadline)).min(lapse);
            tokio::select! {
                () = subscription.settled() => {}
                () = tokio::time::sleep_until(wake) => if wake >= deadline { break },
            }
            poll = poll.map(|every| (every * 2).min(LAST_POLL));
        }
        drop(subscription);
        self.claim_once(key, fingerprint, false).await
    }
}

/// The instant `duration` from now on tokio's clock, saturating as [`later`] does.
pub(crate) fn after(duration: Duration) -> tokio::time::Instant {
    let now = tokio::time::Instant::now().into_std();
    tokio::time::Instant::from_std(later(now, duration))
}
