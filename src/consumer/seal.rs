//! [`seal`]: a result encoded as the consumer door stores it, for the operation to commit in
//! its own transaction.

use std::panic::AssertUnwindSafe;

use bytes::Bytes;

use serde::{Serialize, de::DeserializeOwned};

use super::{
    Outcome,
    record::{Unstorable, decode, encode},
};
use crate::{
    context::IdempotencyContext,
    engine::{Answer, Holder, envelope},
    store::{Commit, SealError, SealedOutcome, Store},
};

/// `value` as the consumer door stores it, for the operation to commit in its own transaction,
/// beside its side effect, so that both commit or neither does: with `PostgresStore`,
/// [`commit`](crate::store::PostgresStore::commit) the operation's transaction with it, then
/// return `Ok(value)`.
///
/// The door then writes nothing more: the committed row is the record, and every redelivery
/// is answered from it, even when the process dies between the commit and the door's answer.
/// The committed value is the outcome: an operation that returns another value after the
/// commit has the committed one answered (a warning is logged). When the commit fails (or is
/// fenced out), the door writes nothing either and releases the key, whatever the operation
/// returns: the redelivery replays the outcome if the commit landed after all, and runs the
/// operation if it did not.
///
/// # Errors
///
/// [`SealError::Unencodable`] when serde cannot encode `value`, or it holds NaN or an infinity;
/// [`SealError::NotClaimed`] for a context no front door gave.
pub fn seal<T: Serialize>(
    context: &IdempotencyContext,
    value: &T,
) -> Result<SealedOutcome, SealError> {
    context.sealed(stored_form(value)?)
}

/// `value` as the consumer door stores it, whatever its size.
pub(crate) fn stored_form<T: Serialize>(value: &T) -> Result<Bytes, SealError> {
    match encode(value, usize::MAX) {
        Ok(outcome) => Ok(outcome),
        Err(Unstorable::Unencodable(reason)) => Err(SealError::Unencodable(reason)),
        // No result is over a limit of usize::MAX.
        Err(Unstorable::OverLimit) => Err(SealError::Unencodable("too large".into())),
    }
}

/// Settles a claim whose operation committed its outcome in its own transaction, or tried to:
/// the door writes nothing. A committed outcome is the answer, whatever the operation
/// returned; a commit that failed releases the key (a fenced delete, which a committed record
/// refuses), whatever the operation returned.
pub(super) async fn settle_sealed<St: Store, T, E>(
    holder: Holder<St>,
    commit: Commit,
    value: T,
    scope: &str,
    answer: Answer<Outcome<T>, E>,
) where
    T: Serialize + DeserializeOwned,
{
    let (committed, in_store) = match commit {
        Commit::Committed(committed) => (committed, true),
        Commit::CommittedBeside(committed) => (committed, false),
        Commit::NotCommitted => {
            holder.release("the operation's transaction did not commit its outcome").await;
            return answer.send(Outcome::Ran(value));
        }
    };
    // What the door would store for `value`; a `Serialize` that panics is not the same.
    let same = std::panic::catch_unwind(AssertUnwindSafe(|| encode(&value, usize::MAX)))
        .is_ok_and(|encoded| encoded.is_ok_and(|own| envelope::same_payload(&own, &committed)));
    let value = if same {
        value
    } else {
        let hash = holder.key().hash();
        tracing::warn!(
            key_hash = hash,
            "idempotency: the operation returned another value than it committed; the committed one is answered"
        );
        // A value of another type (sealed from one, returned as another) cannot be read back:
        // the operation's own is answered, and the committed one replayed.
        decode::<T, E>(committed.clone(), hash, scope).unwrap_or(value)
    };
    if in_store {
        holder.settled_in_transaction(move || answer.send(Outcome::Ran(value))).await;
    } else {
        // Committed beside the record store: stored there too, as the outcome answered.
        holder.complete(committed, move || answer.send(Outcome::Ran(value))).await;
    }
}
