//! The gRPC door's side of a store's transaction: how it encodes the response a handler
//! commits ([`Committable`] for `tonic::Response<M>`).

use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderValue, header};

use super::{
    config::Config,
    record::{self, OVER_STORED_LIMIT},
};
use crate::{
    context::{Encoding, IdempotencyContext},
    store::{Committable, EncodeError},
};

/// The gRPC door's encoding of a committed outcome: a unary OK response, as tonic sends it.
pub(super) struct GrpcEncoding(pub(super) Arc<Config>);

impl Encoding for GrpcEncoding {
    /// A committed response, as `DurableOutcomes` hands it to the gRPC door's hook: its
    /// headers and its framed message (its trailers are `OK`'s).
    fn read_response(&self, stored: Bytes) -> Result<http::Response<Bytes>, String> {
        match record::decode(stored, &crate::engine::Label::route("durable-outcomes")) {
            Some(record::Stored::Response(stored)) => {
                let mut response = http::Response::new(stored.body);
                *response.headers_mut() = stored.head.headers;
                Ok(response)
            }
            _ => Err("not a gRPC response this door stored".to_owned()),
        }
    }

    fn grpc(&self, metadata: HeaderMap, message: Bytes) -> Result<Bytes, EncodeError> {
        if !self.0.store_policy.stores(tonic::Code::Ok) {
            return Err(EncodeError::NotStored("the store policy does not keep OK"));
        }
        let stored = ok_record(metadata, &message);
        if stored.len() > self.0.stored_limit {
            return Err(EncodeError::NotStored(OVER_STORED_LIMIT));
        }
        Ok(stored)
    }
}

/// The record of an `OK` response with `metadata` and the `framed` message, as tonic sends it.
pub(super) fn ok_record(mut metadata: HeaderMap, framed: &[u8]) -> Bytes {
    metadata.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    record::encode(&metadata, framed, Some(&trailers))
}

/// `message`, framed as a gRPC body carries it: uncompressed, after its five-byte prefix.
fn framed(message: &impl prost::Message) -> Bytes {
    let message = message.encode_to_vec();
    let mut framed = BytesMut::with_capacity(5 + message.len());
    framed.put_u8(0);
    framed.put_u32(u32::try_from(message.len()).unwrap_or(u32::MAX));
    framed.put_slice(&message);
    framed.freeze()
}

/// A reply a recovery hook found in the system of record
/// ([`GrpcIdempotencyLayer::recover`](super::GrpcIdempotencyLayer::recover)): its metadata and
/// its message, made from the handler's own `tonic::Response`.
#[derive(Debug, Clone)]
pub struct Reply {
    pub(super) metadata: HeaderMap,
    pub(super) framed: Bytes,
}

impl Reply {
    /// A committed response, as [`read_response`](Encoding::read_response) reads it.
    #[cfg(feature = "postgres")]
    pub(crate) fn from_stored(response: http::Response<Bytes>) -> Self {
        let (head, framed) = response.into_parts();
        Self { metadata: head.headers, framed }
    }
}

impl<M: prost::Message> From<tonic::Response<M>> for Reply {
    fn from(response: tonic::Response<M>) -> Self {
        let framed = framed(response.get_ref());
        Self { metadata: response.into_parts().0.into_headers(), framed }
    }
}

/// A gRPC handler's response, committed as the gRPC door stores it: its metadata and its
/// message (framed, uncompressed), with `OK`. A response committed for another door is
/// refused ([`TransactionError::NotStored`](crate::store::TransactionError::NotStored)).
impl<M: prost::Message + Send + 'static> Committable for tonic::Response<M> {
    async fn encode(self, context: &IdempotencyContext) -> Result<(Bytes, Self), EncodeError> {
        let completion = context.completion().ok_or(EncodeError::NotClaimed)?;
        let metadata = self.metadata().clone().into_headers();
        Ok((completion.encoding.grpc(metadata, framed(self.get_ref()))?, self))
    }
}
