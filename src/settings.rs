//! Settings both front doors take, grouped by the job they do: [`Waiting`], how a duplicate of
//! a request still running waits for it.

use std::time::Duration;

use crate::engine::DEFAULT_MAX_WAITERS;

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
