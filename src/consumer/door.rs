//! The consumer door's side of a claimed operation ([`Door`]): what the engine stores of a
//! result (its JSON, or the record that it ran but has no stored form), and what the caller
//! gets.

use std::{marker::PhantomData, panic::AssertUnwindSafe, sync::Arc};

use bytes::Bytes;
use serde::{Serialize, de::DeserializeOwned};

use super::{
    Outcome,
    commit::ConsumerEncoding,
    record::{Unstorable, decode, encode},
};
use crate::{
    context::Encoding,
    engine::{
        Door, Held, Label, Panic, Settlement,
        envelope::{self, not_stored},
    },
};

/// One call's side of its claim: the stored limit and the scope's label (its metrics, and the
/// name a record it cannot read is logged under).
pub(super) struct ConsumerDoor<T> {
    pub(super) stored_limit: usize,
    pub(super) label: Label,
    /// Whether the door's hook answers from outcomes committed beside the record store.
    pub(super) durable: Option<crate::recovery::DurableTable>,
    pub(super) result: PhantomData<fn() -> T>,
}

impl<T> Door for ConsumerDoor<T>
where
    T: Serialize + DeserializeOwned + Send + 'static,
{
    type Output = T;
    type Recovered = T;
    type Answer = Outcome<T>;

    fn encoding(&self) -> Arc<dyn Encoding> {
        Arc::new(ConsumerEncoding(self.label.clone()))
    }

    fn durable(&self) -> Option<crate::recovery::DurableTable> {
        self.durable.clone()
    }

    /// Stored, or kept as "completed, not replayable" when over the stored limit (or when it
    /// has no stored form); answered as run.
    async fn settle(&self, value: T, held: &Held) -> Settlement<Outcome<T>> {
        match store_form(&value, self.stored_limit, held.key.hash()) {
            Err(panic) => Settlement::Panicked(panic),
            Ok(Ok(stored)) => Settlement::Store(stored, Outcome::Ran(value)),
            Ok(Err(())) => {
                let why = "the result is over the stored limit";
                Settlement::TooLarge { record: not_stored(why), why, answer: Outcome::Ran(value) }
            }
        }
    }

    /// Stored whatever its size and whatever its form (the operation must not run again), and
    /// answered as a replay.
    async fn recovered(&self, value: T, held: &Held) -> Settlement<Outcome<T>> {
        match self.recorded(&value, held) {
            Err(panic) => Settlement::Panicked(panic),
            Ok(stored) => Settlement::Store(stored, Outcome::Replayed(value)),
        }
    }

    fn recorded(&self, value: &T, held: &Held) -> Result<Bytes, Panic> {
        // Without a limit nothing is over it.
        let stored = store_form(value, usize::MAX, held.key.hash())?;
        Ok(stored.unwrap_or_else(|()| not_stored("over the limit")))
    }

    /// The returned value when it encodes to the committed record; the committed one otherwise.
    async fn committed(&self, value: T, committed: Bytes, held: &Held) -> Outcome<T> {
        // What the door would store for `value`; a `Serialize` that panics is not the same.
        let same = std::panic::catch_unwind(AssertUnwindSafe(|| encode(&value, usize::MAX)))
            .is_ok_and(|encoded| encoded.is_ok_and(|own| envelope::same_payload(&own, &committed)));
        if same {
            return Outcome::Ran(value);
        }
        let hash = held.key.hash();
        tracing::warn!(
            key_hash = hash,
            "idempotency: the operation returned another value than it committed; the committed one is answered"
        );
        // A value of another type (stored as one, returned as another) cannot be read back:
        // the operation's own is answered, and the committed one replayed.
        Outcome::Ran(decode::<T, ()>(committed, hash, &self.label).unwrap_or(value))
    }

    fn uncommitted(&self, value: T) -> Outcome<T> {
        Outcome::Ran(value)
    }
}

/// What to store for `value`: its encoding; the record of a result that cannot be encoded
/// (logged: the operation ran and will not run again); `Ok(Err(()))` when it is over `limit`;
/// `Err` when its `Serialize` panicked.
fn store_form<T: Serialize>(
    value: &T,
    limit: usize,
    hash: &str,
) -> Result<Result<Bytes, ()>, Panic> {
    let encoded = std::panic::catch_unwind(AssertUnwindSafe(|| encode(value, limit)))?;
    Ok(match encoded {
        Ok(stored) => Ok(stored),
        Err(Unstorable::OverLimit) => Err(()),
        Err(Unstorable::Unencodable(reason)) => {
            tracing::error!(
                key_hash = hash,
                reason,
                "idempotency: the result cannot be stored; its key is completed without it, so the operation does not run again"
            );
            Ok(not_stored(&reason))
        }
    })
}
