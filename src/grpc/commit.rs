//! The gRPC door's side of a store's transaction: how it encodes the response a handler
//! commits ([`Committable`] for `tonic::Response<M>`), and the [`Reply`] a recovery hook finds.

use std::sync::Arc;

use bytes::Bytes;
use http::HeaderMap;

use super::{
    config::Config,
    record::{self, Collected, OVER_STORED_LIMIT, frame},
};
use crate::{
    context::{Encoding, IdempotencyContext},
    engine::Label,
    store::{Committable, EncodeError},
};

/// The gRPC door's encoding of a committed outcome: a unary OK response, as tonic sends it.
pub(super) struct GrpcEncoding(pub(super) Arc<Config>);

impl Encoding for GrpcEncoding {
    /// A committed response, as `DurableOutcomes` hands it to the gRPC door's hook: its
    /// headers and its framed message (its trailers are `OK`'s).
    fn read_response(&self, stored: Bytes) -> Result<http::Response<Bytes>, String> {
        let stored = record::decode(stored, &Label::route("durable-outcomes"))
            .map_err(|_| "not a gRPC response this door stored".to_owned())?;
        let mut response = http::Response::new(stored.body);
        *response.headers_mut() = stored.head.headers;
        Ok(response)
    }

    fn grpc(&self, metadata: HeaderMap, framed: Bytes) -> Result<Bytes, EncodeError> {
        if !self.0.store_policy.stores(tonic::Code::Ok) {
            return Err(EncodeError::NotStored("the store policy does not keep OK"));
        }
        let reply = Collected::ok(metadata, framed);
        if self.0.over_limits(&reply) {
            return Err(EncodeError::NotStored(OVER_STORED_LIMIT));
        }
        Ok(reply.encode(&self.0.filter))
    }
}

/// A reply a recovery hook found in the system of record
/// ([`GrpcIdempotencyLayer::recover`](super::GrpcIdempotencyLayer::recover)): its metadata and
/// its message, made from the handler's own `tonic::Response`.
#[derive(Debug)]
pub struct Reply(pub(super) Collected);

impl Reply {
    /// A committed response, as [`read_response`](Encoding::read_response) reads it.
    #[cfg(feature = "postgres")]
    pub(crate) fn from_stored(response: http::Response<Bytes>) -> Self {
        let (head, framed) = response.into_parts();
        Self(Collected::ok(head.headers, framed))
    }
}

impl<M: prost::Message> From<tonic::Response<M>> for Reply {
    fn from(response: tonic::Response<M>) -> Self {
        let framed = frame(&response.get_ref().encode_to_vec());
        Self(Collected::ok(response.into_parts().0.into_headers(), framed))
    }
}

/// A gRPC handler's response, committed as the gRPC door stores it: its metadata and its
/// message (framed, uncompressed), with `OK`. A response committed for another door is
/// refused ([`TransactionError::NotStored`](crate::store::TransactionError::NotStored)).
impl<M: prost::Message + Send + 'static> Committable for tonic::Response<M> {
    async fn encode(self, context: &IdempotencyContext) -> Result<(Bytes, Self), EncodeError> {
        let completion = context.completion().ok_or(EncodeError::NotClaimed)?;
        let metadata = self.metadata().clone().into_headers();
        let framed = frame(&self.get_ref().encode_to_vec());
        Ok((completion.encoding.grpc(metadata, framed)?, self))
    }
}
