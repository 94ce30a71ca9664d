//! The gRPC door's side of a claimed call ([`Door`]): what the engine stores of a handler's
//! response (whole, with its trailers), and what the client is answered.

use std::{marker::PhantomData, sync::Arc};

use bytes::Bytes;
use http::Response;
use tonic::{Code, Status, body::Body};

use super::{
    commit::{GrpcEncoding, Reply, ok_record},
    config::Config,
    record::{self, Stored, collect},
    status::answer,
};
use crate::{
    context::Encoding,
    engine::{Door, Held, Label, Panic, Settlement, envelope},
    recovery::BoxError,
};

/// One call's side of its claim: the layer's configuration, the method, the call's span.
pub(super) struct GrpcDoor<ResBody> {
    pub(super) config: Arc<Config>,
    pub(super) route: Label,
    pub(super) span: tracing::Span,
    pub(super) body: PhantomData<fn() -> ResBody>,
}

impl<ResBody> Door for GrpcDoor<ResBody>
where
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Output = Response<ResBody>;
    /// The reply the recovery hook found.
    type Recovered = Reply;
    type Answer = Response<Body>;

    fn encoding(&self) -> Arc<dyn Encoding> {
        Arc::new(GrpcEncoding(self.config.clone()))
    }

    fn durable(&self) -> Option<crate::recovery::DurableTable> {
        self.config.recover.as_ref().and_then(|(_, durable)| durable.clone())
    }

    fn claimed(&self, outcome: &'static str) {
        self.span.record("outcome", outcome);
    }

    /// Read whole (a unary response is one message and its trailers), then stored when the
    /// store policy keeps its status; kept as "completed, not replayable" when over the stored
    /// limit; released when its body failed.
    async fn settle(&self, response: Response<ResBody>, held: &Held) -> Settlement<Response<Body>> {
        let collected = match collect(response).await {
            Ok(collected) => collected,
            Err(error) => {
                tracing::error!(key_hash = held.key.hash(), %error, "idempotency: the response body failed");
                let failed = answer(Status::internal("the response failed"));
                return Settlement::Release("the response body failed", failed);
            }
        };
        if !self.config.store_policy.stores(collected.code()) {
            return Settlement::Release(
                "the store policy does not keep its status",
                collected.into_response(),
            );
        }
        let stored = collected.encode();
        if stored.len() > self.config.stored_limit {
            let record = record::not_replayable(record::OVER_STORED_LIMIT);
            let answer = collected.into_response();
            return Settlement::TooLarge { record, why: record::OVER_STORED_LIMIT, answer };
        }
        Settlement::Store(stored, collected.into_response())
    }

    /// Stored whatever its size and the store policy (the call must not run again), and
    /// answered as a replay.
    async fn recovered(&self, reply: Reply, held: &Held) -> Settlement<Response<Body>> {
        let stored = ok_record(reply.metadata, &reply.framed);
        Settlement::Store(stored.clone(), replay(stored, &self.route, held.key.hash()))
    }

    fn recorded(&self, reply: &Reply, _held: &Held) -> Result<Bytes, Panic> {
        Ok(ok_record(reply.metadata.clone(), &reply.framed))
    }

    /// The returned response when it encodes to the committed record; the committed one
    /// otherwise.
    async fn committed(
        &self,
        response: Response<ResBody>,
        committed: Bytes,
        held: &Held,
    ) -> Response<Body> {
        if let Ok(returned) = collect(response).await
            && envelope::same_payload(&returned.encode(), &committed)
        {
            return returned.into_response();
        }
        tracing::warn!(
            key_hash = held.key.hash(),
            "idempotency: the handler returned another response than it committed; the committed one is answered"
        );
        match record::decode(committed, &self.route) {
            Some(Stored::Response(stored)) => stored.into_response(),
            // The door encoded it a moment ago: unreachable.
            _ => answer(Status::internal("the committed response cannot be read")),
        }
    }

    fn uncommitted(&self, response: Response<ResBody>) -> Response<Body> {
        response.map(Body::new)
    }
}

/// The answer to a retry of a completed call: its stored response, marked as replayed.
pub(super) fn replay(stored: Bytes, route: &Label, hash: &str) -> Response<Body> {
    match record::decode(stored, route) {
        Some(Stored::Response(stored)) => record::replayed(stored),
        Some(Stored::NotReplayable(why)) => answer(Status::new(
            Code::Internal,
            format!("the call completed, and its response cannot be replayed: {why}"),
        )),
        None => {
            tracing::error!(key_hash = hash, "idempotency: record not written by this door");
            answer(Status::internal("the idempotency record cannot be read"))
        }
    }
}
