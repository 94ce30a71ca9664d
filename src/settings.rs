//! Settings every front door takes, grouped by the job they do: [`Waiting`], how a duplicate of
//! a request still running waits for it; [`Recovery`], when and how a door asks its recovery
//! hook.

use std::time::Duration;

/// The default for the number of waiters at once.
pub(crate) const DEFAULT_MAX_WAITERS: usize = 1024;

/// How a duplicate whose original is still running waits for it
/// ([`IdempotencyLayer::waiting`](crate::IdempotencyLayer::waiting),
/// [`Idempotent::waiting`](crate::Idempotent::waiting)).
///
/// A duplicate that waits is answered with the original's stored outcome when it settles (or
/// runs, when the original released its key: a failure, a panic); past the wait, or when
/// waiting is off, it gets the in-progress answer with a retry hint. The HTTP layer waits 10
/// seconds by default; the consumer door does not wait by default (a worker is better given
/// the next message, and the broker redelivers).
///
/// HTTP clients that take any 2xx as the final answer (Stripe's SDKs, most HTTP clients'
/// retry middleware) would take a 202 as the created resource: behind them, keep waiting on.
/// The settle wakes the waiters (in process for `MemoryStore`; Redis pub/sub on one connection
/// per store for a `RedisStore` with a subscriber, sharded on a Cluster); a store that cannot
/// notify is polled, every 50 ms at first and at most every second, one claim each.
///
/// ```
/// use std::time::Duration;
/// use axum_idempotency::{IdempotencyLayer, MemoryStore, settings::Waiting};
///
/// let layer = IdempotencyLayer::new(MemoryStore::new())
///     .waiting(Waiting::up_to(Duration::from_secs(5)).max_waiters(256));
/// let answer_at_once = IdempotencyLayer::new(MemoryStore::new())
///     .waiting(Waiting::off().retry_after(Duration::from_secs(2)));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Waiting {
    pub(crate) wait: Option<Duration>,
    pub(crate) max_waiters: usize,
    pub(crate) retry_after: Duration,
}

impl Waiting {
    /// Waits up to `wait` for the original to settle; `Duration::ZERO` is [`off`](Self::off).
    #[must_use]
    pub fn up_to(wait: Duration) -> Self {
        Self { wait: (!wait.is_zero()).then_some(wait), ..Self::off() }
    }

    /// Answers a duplicate at once, with the in-progress answer.
    #[must_use]
    pub fn off() -> Self {
        Self { wait: None, max_waiters: DEFAULT_MAX_WAITERS, retry_after: Duration::from_secs(1) }
    }

    /// Sets how many duplicates may wait at once, shared by every clone of the door; past it,
    /// one is answered at once. Defaults to 1024.
    #[must_use]
    pub fn max_waiters(mut self, waiters: usize) -> Self {
        self.max_waiters = waiters;
        self
    }

    /// Sets the longest retry hint of an in-progress answer (`Retry-After`, or
    /// `Outcome::InProgress { retry_after }`); it is never past the original's remaining lease
    /// (and, over HTTP, at least one second). Defaults to 1 second.
    #[must_use]
    pub fn retry_after(mut self, hint: Duration) -> Self {
        self.retry_after = hint;
        self
    }
}

/// When and how a door asks its recovery hook ([`Recover`](crate::recovery::Recover), set with
/// `recover`): [`IdempotencyLayer::recovery`](crate::IdempotencyLayer::recovery),
/// [`Idempotent::recovery`](crate::Idempotent::recovery). Without a hook, only the
/// [`window`](Self::window) applies.
///
/// ```
/// use std::time::Duration;
/// use axum_idempotency::{IdempotencyLayer, MemoryStore, settings::Recovery};
///
/// let layer = IdempotencyLayer::new(MemoryStore::new()).recovery(
///     Recovery::default().window(Duration::from_secs(3600)).timeout(Duration::from_secs(2)),
/// );
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recovery {
    /// How long a lapsed claim is remembered; the retention when `None`.
    pub(crate) window: Option<Duration>,
    pub(crate) every_claim: bool,
    pub(crate) timeout: Duration,
    pub(crate) run_on_failure: bool,
}

impl Default for Recovery {
    fn default() -> Self {
        Self {
            window: None,
            every_claim: false,
            timeout: Duration::from_secs(5),
            run_on_failure: false,
        }
    }
}

impl Recovery {
    /// Sets how long after its lease a lapsed claim is remembered, so that a duplicate in
    /// that window is a takeover (counted and traced as one) and asks the recovery hook. After
    /// it the record is gone and a duplicate runs as new. Defaults to the door's retention.
    #[must_use]
    pub fn window(mut self, window: Duration) -> Self {
        self.window = Some(window);
        self
    }

    /// Asks the recovery hook on every claim, not only on a takeover: for a store that may
    /// lose records (Redis restarted without persistence, a failover that lost writes, a
    /// `MemoryStore` across a restart). Costs one hook lookup per new operation. Off by
    /// default.
    #[must_use]
    pub fn every_claim(mut self, every: bool) -> Self {
        self.every_claim = every;
        self
    }

    /// Sets the longest the recovery hook may take; past it, recovery has failed. Defaults to
    /// 5 seconds.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// When the recovery hook fails, runs the operation anyway (logged at error level and
    /// counted) instead of refusing it (HTTP: 503 `recovery-failed`; consumer:
    /// `Error::Recovery`). Defaults to `false`: a payment is better refused than run twice.
    #[must_use]
    pub fn run_when_failed(mut self, run: bool) -> Self {
        self.run_on_failure = run;
        self
    }
}
