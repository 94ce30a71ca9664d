//! The consumer door's side of a store's transaction: how it encodes the result an operation
//! commits ([`Committable`] for `axum::Json`).

use axum::Json;
use bytes::Bytes;
use serde::Serialize;

use super::{finite, record::encode_json};
use crate::{
    context::{Encoding, IdempotencyContext},
    engine::{
        Label,
        envelope::{self, Format},
    },
    store::{Committable, EncodeError},
};

/// The consumer door's encoding of a committed outcome: a value, as JSON. The label names the
/// door's scope in the metrics of a record read back.
pub(super) struct ConsumerEncoding(
    #[allow(dead_code, reason = "read back by the tables beside the stores (`durable`)")]
    pub(super) Label,
);

impl Encoding for ConsumerEncoding {
    fn json(&self, json: Bytes) -> Result<Bytes, EncodeError> {
        Ok(encode_json(&json))
    }

    fn read_json(&self, stored: Bytes) -> Result<Bytes, String> {
        match envelope::parse(stored, &self.0) {
            Some(opened) if opened.format == Format::Json => Ok(opened.payload),
            Some(opened) if opened.format == Format::NotStored => Err(format!(
                "the operation ran, but its result could not be stored: {}",
                String::from_utf8_lossy(&opened.payload)
            )),
            _ => Err("not a result stored by the consumer door".to_owned()),
        }
    }
}

/// A value committed as the context's front door stores it: the consumer door's result `T`,
/// or, for the HTTP door, the 200 JSON response `axum::Json` answers. A value that holds NaN
/// or an infinity (which JSON would store as `null`) is refused, as serde's own failures are.
impl<T: Serialize + Send + 'static> Committable for Json<T> {
    async fn encode(self, context: &IdempotencyContext) -> Result<(Bytes, Self), EncodeError> {
        let completion = context.completion().ok_or(EncodeError::NotClaimed)?;
        finite::check(&self.0).map_err(|error| EncodeError::Unencodable(error.to_string()))?;
        let json = serde_json::to_vec(&self.0)
            .map_err(|error| EncodeError::Unencodable(error.to_string()))?;
        Ok((completion.encoding.json(Bytes::from(json))?, self))
    }
}
