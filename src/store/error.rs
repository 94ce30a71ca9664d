//! [`StoreError`]: what a [`Store`](super::Store) reports, whatever the backend.

use std::{fmt, time::Duration};

#[cfg(doc)]
use super::{MemoryStore, Store};

/// An error from a [`Store`], whatever the backend.
///
/// Whether the layer answers 503 (or fails open) is decided by the variant
/// ([`is_unavailable`](Self::is_unavailable)), never by which backend raised it: a store of
/// another crate reports its connection and pool errors as [`Unavailable`](Self::Unavailable).
#[derive(Debug)]
#[non_exhaustive]
pub enum StoreError {
    /// The store could not be reached or answered with an error: a connection refused or
    /// lost, no pooled connection, an error reply. The source is the backend's own error.
    Unavailable(Box<dyn std::error::Error + Send + Sync>),
    /// The operation did not finish within the store's command timeout. Whether it was
    /// applied is unknown.
    Timeout(Duration),
    /// The value under the key was not written by this layer, or by another record version.
    CorruptRecord(String),
    /// A [`MemoryStore`] holds as many live records as its capacity: nothing is evicted to
    /// make room, so the claim is refused.
    CapacityReached(usize),
    /// The claim reached the store after its caller gave up on it (after the deadline it
    /// carried, or after its caller abandoned it with [`Store::abandon`]): it was not applied.
    ClaimAbandoned,
    /// The server is older than the crate supports; the message says what was found and
    /// what is needed. Nothing is written to it; the layer answers 503 (and logs the message),
    /// as for a server it cannot reach.
    UnsupportedServer(String),
    /// The outcome was not written, and the transaction that would have carried it was
    /// rolled back (`PostgresStore::transaction`, `DurableOutcomes::transaction`): the
    /// claim is not this store's live claim. Another claim holds the key now (this holder's
    /// lease lapsed and a duplicate took it over: the other holder runs the operation), or
    /// the key was claimed in another store than the one asked to commit.
    FencedOut,
    /// The store's tables or functions are missing from the database: run the store's
    /// `migrate()` at start (or apply its schema). The database's message. Answered 503, as
    /// for a store that cannot serve.
    SchemaMissing(String),
    /// The key's checkpoints were committed for another request (another payload under
    /// the same key): its steps are not this request's to resume. A key reused with a
    /// different request, answered as the doors answer a mismatch.
    KeyReused,
    /// A dedup door's event time (`first_seen_at`) is older than its strategy keeps: the
    /// event's bucket has expired already, so a check against it would answer every event new.
    /// How far past the horizon it is.
    BeyondHorizon(Duration),
    /// This instance cannot serve beside its fleet (see [`crate::hashing`]): the fleet's
    /// registry lists instances that name records another way, running now or recently
    /// enough that their records may live, whose records this one could not see, or that
    /// could not see its own (a deploy of a move skipped, another secret, a rollback too
    /// far). Says which step is missing. Its requests are refused (503, never run without
    /// idempotency, whatever `fail_open` says) until the disagreement ends.
    Misplaced(String),
}

impl StoreError {
    /// An [`Unavailable`](Self::Unavailable) error with `source`: for a store's connection,
    /// pool and server errors.
    pub fn unavailable(source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self::Unavailable(source.into())
    }

    /// Whether the store could not be reached, did not answer, or cannot serve (as opposed to
    /// holding a record it cannot read). The layer answers these with 503, or passes the request
    /// through when it fails open.
    #[must_use]
    pub fn is_unavailable(&self) -> bool {
        !matches!(
            self,
            Self::CorruptRecord(_)
                | Self::FencedOut
                | Self::KeyReused
                | Self::BeyondHorizon(_)
                | Self::Misplaced(_)
        )
    }

    /// The same error, saying that the operation was never sent (no connection could be had):
    /// a claim that failed so holds nothing, and its caller abandons nothing.
    #[cfg_attr(not(feature = "redis"), allow(dead_code, reason = "said by the Redis stores"))]
    pub(crate) fn never_sent(self) -> Self {
        match self {
            Self::Unavailable(error) => Self::Unavailable(Box::new(NeverSent(error))),
            other => other,
        }
    }

    /// The same error, no longer saying that the operation was never sent: an earlier attempt
    /// of it may have been.
    #[cfg_attr(not(feature = "redis"), allow(dead_code, reason = "said by the Redis stores"))]
    pub(crate) fn maybe_sent(self) -> Self {
        match self {
            Self::Unavailable(error) => match error.downcast::<NeverSent>() {
                Ok(never_sent) => Self::Unavailable(never_sent.0),
                Err(error) => Self::Unavailable(error),
            },
            other => other,
        }
    }

    /// Whether the operation was never sent ([`never_sent`](Self::never_sent)).
    pub(crate) fn was_never_sent(&self) -> bool {
        matches!(self, Self::Unavailable(error) if error.is::<NeverSent>())
    }
}

/// An error of an operation that was never sent; it reads as the error it wraps.
#[derive(Debug)]
struct NeverSent(Box<dyn std::error::Error + Send + Sync>);

impl fmt::Display for NeverSent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for NeverSent {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unavailable(e) => write!(f, "store unavailable: {e}"),
            Self::Timeout(after) => write!(f, "store did not answer within {after:?}"),
            Self::CorruptRecord(why) => write!(f, "record not written by this layer: {why}"),
            Self::CapacityReached(records) => {
                write!(f, "the memory store is full ({records} live records)")
            }
            Self::ClaimAbandoned => f.write_str("the claim was abandoned by its caller"),
            Self::UnsupportedServer(why) => write!(f, "unsupported server: {why}"),
            Self::FencedOut => f.write_str(
                "the claim is not this store's live claim (taken over, or claimed in another \
                 store): nothing was written",
            ),
            Self::BeyondHorizon(past) => write!(
                f,
                "the event's time is {past:?} past what the dedup strategy keeps: it cannot be \
                 checked (every such event would be answered new)"
            ),
            Self::KeyReused => f.write_str(
                "the key's checkpoints belong to another request: a key reused with a \
                 different payload",
            ),
            Self::SchemaMissing(why) => write!(
                f,
                "the store's schema is missing: run migrate() at start, or apply its schema \
                 ({why})"
            ),
            Self::Misplaced(why) => write!(f, "this instance cannot serve beside its fleet: {why}"),
        }
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Unavailable(e) => Some(&**e),
            Self::Timeout(_)
            | Self::CorruptRecord(_)
            | Self::CapacityReached(_)
            | Self::ClaimAbandoned
            | Self::UnsupportedServer(_)
            | Self::SchemaMissing(_)
            | Self::KeyReused
            | Self::BeyondHorizon(_)
            | Self::Misplaced(_)
            | Self::FencedOut => None,
        }
    }
}
