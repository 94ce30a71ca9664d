//! [`Door`]: what a front door tells the engine about the outcomes of the operations it runs,
//! and [`Settlement`], what the engine does with one. The engine writes the store; a door only
//! encodes and answers.

use std::{future::Future, sync::Arc, time::Duration};

use bytes::Bytes;
use futures_util::future::BoxFuture;

use super::Panic;
use crate::{context::Encoding, fingerprint::Fingerprint, key::RecordKey};

/// A front door's side of a claimed operation: how its outcomes are stored and answered. The
/// engine runs the operation from claim to settle and calls these to learn what to write; none
/// of them touches the store.
pub(crate) trait Door: Send + Sync + 'static {
    /// What the operation returns when it succeeds.
    type Output: Send + 'static;
    /// What the recovery hook finds when the operation happened before.
    type Recovered: Send + 'static;
    /// What the door's caller is answered.
    type Answer: Send + 'static;

    /// How the door encodes an outcome its operation commits in a store's transaction.
    fn encoding(&self) -> Arc<dyn Encoding>;

    /// Whether the door's recovery hook answers from outcomes committed beside the record store
    /// ([`Recover::durable`](crate::recovery::Recover::durable)): it is then asked on every
    /// claim, and the operations may commit there. `None` by default.
    fn durable(&self) -> Option<crate::recovery::DurableTable> {
        None
    }

    /// The claim's outcome, as the span of the door's caller records it: `claimed`,
    /// `taken_over`, `replayed`, `in_progress`, `mismatch`, `store_unavailable` or
    /// `corrupt_record`. Nothing by default.
    fn claimed(&self, _outcome: &'static str) {}

    /// What becomes of the operation's output: stored, released, kept as too large, streamed.
    fn settle(
        &self,
        output: Self::Output,
        held: &Held,
    ) -> impl Future<Output = Settlement<Self::Answer>> + Send;

    /// What the recovery hook found: stored whatever its size (the operation must not run
    /// again), and answered as a replay.
    fn recovered(
        &self,
        outcome: Self::Recovered,
        held: &Held,
    ) -> impl Future<Output = Settlement<Self::Answer>> + Send;

    /// What the recovery hook found, as the door stores it (whatever its size: the operation
    /// must not run again); `Err` when the door's encoding panicked. [`recovered`]'s record,
    /// and the completer's.
    ///
    /// [`recovered`]: Door::recovered
    fn recorded(&self, outcome: &Self::Recovered, held: &Held) -> Result<Bytes, Panic>;

    /// The answer for an operation that committed `committed` (as the door encoded it) in a
    /// store's transaction and returned `output`: the committed outcome, whatever was returned.
    fn committed(
        &self,
        output: Self::Output,
        committed: Bytes,
        held: &Held,
    ) -> impl Future<Output = Self::Answer> + Send;

    /// The answer for an operation whose store transaction did not commit (rolled back, or
    /// its commit's answer lost): its key is released.
    fn uncommitted(&self, output: Self::Output) -> Self::Answer;
}

/// What a door knows of the claim it settles.
#[derive(Debug)]
pub(crate) struct Held {
    /// The claim's record key (its hash names it in logs).
    pub(crate) key: RecordKey,
    /// The fingerprint of the request that holds it.
    pub(crate) fingerprint: Fingerprint,
    /// How long a completed outcome is kept.
    pub(crate) retention: Duration,
    /// The request's other names, while a service moves between namings, and its plain key.
    pub(crate) alongside: Option<(RecordKey, Fingerprint)>,
    pub(crate) plain: Option<RecordKey>,
}

impl Held {
    /// The claim's names, for a context asked about it (a replay's rebuild hook).
    pub(crate) fn named(&self) -> crate::hashing::Named {
        crate::hashing::Named {
            key: self.key.clone(),
            fingerprint: self.fingerprint.clone(),
            next: self.alongside.clone().map(|(key, fingerprint)| crate::hashing::Next {
                key,
                fingerprint,
                completed_first: false,
            }),
            plain: self.plain.clone(),
        }
    }
}

/// What the engine does with an operation's outcome, as its door says.
pub(crate) enum Settlement<A> {
    /// Stores the outcome (as the door encoded it), then answers.
    Store(Bytes, A),
    /// Stores nothing and releases the key, so that a retry runs the operation again; then
    /// answers.
    Release(&'static str, A),
    /// The outcome is too large to keep: a "completed, not replayable" `record` (the door's,
    /// with the reason), or the key released when the door is so configured; then answers.
    TooLarge { record: Bytes, why: &'static str, answer: A },
    /// Answers now, and settles when the rest of the outcome (a streamed body) ends, the lease
    /// renewed meanwhile.
    Streamed(A, BoxFuture<'static, StreamEnd>),
    /// The door's encoding panicked: the key is released and the panic resumed in the caller.
    Panicked(Panic),
}

/// The end of a streamed outcome.
pub(crate) struct StreamEnd {
    /// How it ended.
    pub(crate) ended: Streaming,
    /// The caller's end of the stream, closed only once the settle is done: a caller that
    /// has the whole stream finds it settled.
    pub(crate) open: Box<dyn Send>,
}

/// How the rest of a streamed outcome ended.
pub(crate) enum Streaming {
    /// Whole, within the limit: stores it.
    Stored(Bytes),
    /// Over the limit: the "completed, not replayable" `record`, written while `forward`
    /// sends the rest to the caller.
    OverLimit { record: Bytes, why: &'static str, forward: BoxFuture<'static, ()> },
    /// The stream failed: releases the key.
    Failed(String),
}
