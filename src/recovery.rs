//! Recovery from the system of record: what a claim that takes over asks before it runs again.
//!
//! Redis guards one boundary; the service's database guards another. When a holder commits
//! its side effect and dies before its outcome reaches the store, its in-progress record lapses
//! at the end of its lease, and the next retry *takes it over* ([`Claim::TakenOver`]). Before
//! running the operation again, the front door asks a [`Recover`] hook, given the request's
//! [`IdempotencyContext`]: when the system of record knows the outcome (an outbox row written
//! in the same transaction as the side effect), it is stored and answered as a replay, and the
//! operation does not run. When the hook answers [`Recovered::Unknown`], it runs.
//!
//! The same trait is every question the crate puts to the system of record: the outcomes
//! committed beside the record store (`durable::DurableOutcomes` is a [`Recover`] for both
//! doors), the [`Completer`](crate::completer::Completer) of abandoned claims (which asks the
//! door's hook with no request), and the rebuild of a minimal record's replay.
//!
//! [`Claim::TakenOver`]: crate::store::Claim::TakenOver

use std::{fmt, future::Future, sync::Arc};

use futures_util::future::BoxFuture;

pub use crate::context::DurableTable;
use crate::context::IdempotencyContext;

/// An error a [`Recover`] hook returns.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What a [`Recover`] hook is asked about: the claimed request's context, and the request
/// itself (the HTTP door: an `http::Request<Bytes>` with the buffered body; the consumer door:
/// the payload bytes) when the asker has it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Lookup<R> {
    /// Who the request is: look it up by its [`key_hash`](IdempotencyContext::key_hash).
    pub context: IdempotencyContext,
    /// The request: `Some` when a front door asks, before it runs the request again (and,
    /// for the rebuild of a minimal record, what the record kept); `None` when the
    /// [`Completer`](crate::completer::Completer) asks about an abandoned claim, which knows
    /// its key and its fingerprint, never its request.
    pub request: Option<R>,
}

impl<R> Lookup<R> {
    pub(crate) fn new(context: IdempotencyContext, request: Option<R>) -> Self {
        Self { context, request }
    }
}

/// A [`Recover`] hook's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recovered<T> {
    /// The operation happened; this was its outcome. It is stored and answered as a replay,
    /// and the operation does not run.
    Happened(T),
    /// The system of record has no trace of it: the operation runs.
    Unknown,
    /// The system of record holds the outcome of another request (another payload) under
    /// this key: answered as a key reused with a different request (the HTTP door's 409, the
    /// consumer door's `Outcome::Mismatch`), and nothing runs. The claim is released, so that
    /// the request that owns the key is answered when it comes.
    Mismatch,
}

impl<T> Recovered<T> {
    /// The same answer, its outcome mapped by `f`.
    pub(crate) fn map<U>(self, f: impl FnOnce(T) -> U) -> Recovered<U> {
        match self {
            Self::Happened(outcome) => Recovered::Happened(f(outcome)),
            Self::Unknown => Recovered::Unknown,
            Self::Mismatch => Recovered::Mismatch,
        }
    }
}

/// Asks the system of record whether a claimed operation already happened: the one way the
/// crate asks it, for the front doors' takeovers ([`IdempotencyLayer::recover`],
/// [`Idempotent::recover`]), for the [`Completer`](crate::completer::Completer) of abandoned
/// claims (`Operator::completer`), which takes the same hook, and for the rebuild of a
/// minimal record ([`IdempotencyLayer::rebuild`], with `R = http::Rebuild`).
///
/// Implemented for every `Fn(Lookup<R>) -> impl Future<Output = Result<Recovered<T>, E>>`
/// with `E: Into<BoxError>`. The HTTP door asks with `R = http::Request<Bytes>` for
/// `T = http::Response<Bytes>`; the consumer door with `R = Bytes` (the payload) for its result
/// type. `DurableOutcomes` (feature `postgres`) implements it for every door: the outcomes
/// operations committed beside the record store.
///
/// An error, a panic, or no answer within the recovery timeout is a failed recovery: the
/// operation does not run (the HTTP door answers 503), unless the front door is told to run
/// when recovery fails.
///
/// [`IdempotencyLayer::recover`]: crate::IdempotencyLayer::recover
/// [`IdempotencyLayer::rebuild`]: crate::IdempotencyLayer::rebuild
/// [`Idempotent::recover`]: crate::Idempotent::recover
#[doc = include_str!("docs/recovery.md")]
pub trait Recover<R, T>: Send + Sync + 'static {
    /// Looks the request up.
    fn recover(
        &self,
        lookup: Lookup<R>,
    ) -> impl Future<Output = Result<Recovered<T>, BoxError>> + Send;

    /// The table beside the record store the hook answers from, when it answers from outcomes
    /// the operations commit there in their own transactions (`DurableOutcomes`): the door then
    /// asks it on every claim, not only on a takeover (a record the record store lost is
    /// answered from there too), and lets its operations commit into that table, and no other.
    /// `None` for every hook but the crate's tables (a [`DurableTable`] has no public
    /// constructor).
    fn durable(&self) -> Option<DurableTable> {
        None
    }
}

impl<F, Fut, R, T, E> Recover<R, T> for F
where
    F: Fn(Lookup<R>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Recovered<T>, E>> + Send,
    E: Into<BoxError>,
    R: Send,
{
    async fn recover(&self, lookup: Lookup<R>) -> Result<Recovered<T>, BoxError> {
        self(lookup).await.map_err(Into::into)
    }
}

/// No recovery hook: the default of the consumer door.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoRecovery;

impl<R: Send + 'static, T: Send + 'static> Recover<R, T> for NoRecovery {
    async fn recover(&self, _lookup: Lookup<R>) -> Result<Recovered<T>, BoxError> {
        Ok(Recovered::Unknown)
    }
}

/// A [`Recover`] hook, its type erased, as a door's configuration keeps it: it is asked only
/// on a takeover (or on every claim, when durable), so a boxed future costs nothing on the
/// common path.
pub(crate) struct Hook<R, T> {
    ask: Arc<dyn Fn(Lookup<R>) -> HookFuture<T> + Send + Sync>,
    /// What [`Recover::durable`] said of it.
    durable: Option<DurableTable>,
}

/// One lookup by a [`Hook`], not yet started.
pub(crate) type HookFuture<T> = BoxFuture<'static, Result<Recovered<T>, BoxError>>;

impl<R: Send + 'static, T: 'static> Hook<R, T> {
    pub(crate) fn new(hook: impl Recover<R, T>) -> Self {
        let durable = hook.durable();
        let hook = Arc::new(hook);
        let ask = Arc::new(move |lookup| {
            let hook = hook.clone();
            Box::pin(async move { hook.recover(lookup).await }) as HookFuture<T>
        });
        Self { ask, durable }
    }
}

impl<R, T> Hook<R, T> {
    /// The hook's lookup of one request, not yet started.
    pub(crate) fn ask(&self, lookup: Lookup<R>) -> HookFuture<T> {
        (self.ask)(lookup)
    }

    /// Whether the hook answers from outcomes committed beside the record store.
    pub(crate) fn durable(&self) -> Option<DurableTable> {
        self.durable.clone()
    }
}

impl<R, T> Clone for Hook<R, T> {
    fn clone(&self) -> Self {
        Self { ask: self.ask.clone(), durable: self.durable.clone() }
    }
}

impl<R, T> fmt::Debug for Hook<R, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Hook").field("durable", &self.durable).finish_non_exhaustive()
    }
}
