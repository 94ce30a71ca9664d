//! The consumer door's side of a store's transaction: how it encodes the result an operation
//! commits ([`Committable`] for `axum::Json`).

use axum::{Json, response::Response};
use bytes::Bytes;
use futures_util::future::BoxFuture;
use serde::Serialize;

use super::{finite, record::encode_json};
use crate::{
    context::{Encoding, IdempotencyContext},
    store::{Committable, EncodeError},
};

/// The consumer door's encoding of a committed outcome: a value, as JSON.
pub(super) struct ConsumerEncoding;

impl Encoding for ConsumerEncoding {
    fn response(
        &self,
        _response: Response,
    ) -> BoxFuture<'static, Result<(Bytes, Response), EncodeError>> {
        Box::pin(async {
            Err(EncodeError::NotStored(
                "the consumer door stores values (axum::Json), not HTTP responses",
            ))
        })
    }

    fn json(&self, json: Bytes) -> Result<Bytes, EncodeError> {
        Ok(encode_json(&json))
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

/// `value` as the consumer door stores it, whatever its size.
#[cfg(feature = "postgres")]
pub(crate) fn stored_form<T: Serialize>(value: &T) -> Result<Bytes, EncodeError> {
    match super::record::encode(value, usize::MAX) {
        Ok(outcome) => Ok(outcome),
        Err(super::record::Unstorable::Unencodable(reason)) => {
            Err(EncodeError::Unencodable(reason))
        }
        // No result is over a limit of usize::MAX.
        Err(super::record::Unstorable::OverLimit) => {
            Err(EncodeError::Unencodable("too large".into()))
        }
    }
}
