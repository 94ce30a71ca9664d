//! [`DurableRecovery`]: the consumer door's hook over [`DurableOutcomes`], and
//! [`Idempotent::durable`].

use bytes::Bytes;
use serde::de::DeserializeOwned;

use super::{Idempotent, record::decode};
use crate::{
    engine::Label,
    recovery::{BoxError, Lookup, Recover, Recovered},
    store::{DurableOutcomes, Store},
};

/// The consumer door's recovery hook over [`DurableOutcomes`] (see [`Idempotent::durable`]):
/// the committed result of the delivery's key, when the table holds one of the same payload.
#[derive(Debug, Clone)]
pub struct DurableRecovery(DurableOutcomes);

impl<T: DeserializeOwned + Send + 'static> Recover<Bytes, T> for DurableRecovery {
    async fn recover(&self, lookup: Lookup<Bytes>) -> Result<Recovered<T>, BoxError> {
        let context = &lookup.context;
        let Some((fingerprint, outcome)) = self.0.read(context.key()).await? else {
            return Ok(Recovered::Unknown);
        };
        if &fingerprint != context.fingerprint() {
            return Ok(Recovered::Mismatch);
        }
        let outcome = context.open_stored(outcome)?;
        let label = Label::scope(String::from_utf8_lossy(context.scope()));
        let value = decode::<T, std::convert::Infallible>(outcome, context.key_hash(), &label)
            .map_err(|error| format!("the committed outcome is unreadable: {error:?}"))?;
        Ok(Recovered::Happened(value))
    }
}

impl<St: Store, H> Idempotent<St, H> {
    /// Answers from `outcomes` what the record store cannot: the durable half beside a fast
    /// record store (Redis), for operations that commit their results to it in its
    /// transactions (`DurableOutcomes::transaction`, which refuses a door without this). Every
    /// new claim and
    /// every takeover asks the table first (one primary-key read), so that a lapsed lease, a
    /// worker that died after its commit, or a record Redis lost is replayed from PostgreSQL,
    /// and the operation does not run again. It is the recovery hook
    /// ([`recover`](Self::recover)) and [`Recovery::every_claim`](crate::settings::Recovery::every_claim) in one.
    ///
    /// A delivery with another payload under a key whose result only the table still holds
    /// is [`Outcome::Mismatch`](super::Outcome::Mismatch), never run.
    pub fn durable(self, outcomes: DurableOutcomes) -> Idempotent<St, DurableRecovery> {
        let mut door = self.recover(DurableRecovery(outcomes));
        door.settings().durable = true;
        door
    }
}
