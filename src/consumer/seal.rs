//! The consumer door's side of a store's transaction: how it encodes the result an operation
//! commits ([`Committable`] for `axum::Json`), and how it settles a claim whose operation
//! committed (or tried to).

use std::panic::AssertUnwindSafe;

use axum::{Json, response::Response};
use bytes::Bytes;
use futures_util::future::BoxFuture;
use serde::{Serialize, de::DeserializeOwned};

use super::{
    Outcome, finite,
    record::{decode, encode, encode_json},
};
use crate::{
    context::{Encoding, IdempotencyContext},
    engine::{Answer, Holder, envelope},
    store::{Commit, Committable, SealError, Store},
};

/// The consumer door's encoding of a committed outcome: a value, as JSON.
pub(super) struct ConsumerEncoding;

impl Encoding for ConsumerEncoding {
    fn response(
        &self,
        _response: Response,
    ) -> BoxFuture<'static, Result<(Bytes, Response), SealError>> {
        Box::pin(async {
            Err(SealError::NotStored(
                "the consumer door stores values (axum::Json), not HTTP responses",
            ))
        })
    }

    fn json(&self, json: Bytes) -> Result<Bytes, SealError> {
        Ok(encode_json(&json))
    }
}

/// A value committed as the context's front door stores it: the consumer door's result `T`,
/// or, for the HTTP door, the 200 JSON response `axum::Json` answers. A value that holds NaN
/// or an infinity (which JSON would store as `null`) is refused, as serde's own failures are.
impl<T: Serialize + Send + 'static> Committable for Json<T> {
    async fn encode(self, context: &IdempotencyContext) -> Result<(Bytes, Self), SealError> {
        let completion = context.completion().ok_or(SealError::NotClaimed)?;
        finite::check(&self.0).map_err(|error| SealError::Unencodable(error.to_string()))?;
        let json = serde_json::to_vec(&self.0)
            .map_err(|error| SealError::Unencodable(error.to_string()))?;
        Ok((completion.encoding.json(Bytes::from(json))?, self))
    }
}

/// `value` as the consumer door stores it, whatever its size.
#[cfg(feature = "postgres")]
pub(crate) fn stored_form<T: Serialize>(value: &T) -> Result<Bytes, SealError> {
    match encode(value, usize::MAX) {
        Ok(outcome) => Ok(outcome),
        Err(super::record::Unstorable::Unencodable(reason)) => Err(SealError::Unencodable(reason)),
        // No result is over a limit of usize::MAX.
        Err(super::record::Unstorable::OverLimit) => {
            Err(SealError::Unencodable("too large".into()))
        }
    }
}

/// Settles a claim whose operation committed its outcome in a store's transaction, or tried
/// to: the door writes nothing. A committed outcome is the answer, whatever the operation
/// returned; a transaction rolled back, or whose commit's answer was lost, releases the key (a
/// fenced delete, which a committed record refuses), whatever the operation returned.
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
        Commit::RolledBack | Commit::Unknown => {
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
