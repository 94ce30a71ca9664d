//! The gRPC door's side of a claimed call ([`Door`]): what the engine stores of a handler's
//! response (whole, with its trailers), and what the client is answered.

use std::{marker::PhantomData, sync::Arc};

use axum::body::Body;
use bytes::Bytes;
use http::Response;
use tonic::Status;

use super::{
    commit::{GrpcEncoding, Reply},
    config::Config,
    record::{self, OVER_STORED_LIMIT, collect, replay},
    status::answer,
};
use crate::{
    context::Encoding,
    engine::{Door, Held, Label, Panic, Settlement, envelope},
    recovery::{BoxError, DurableTable},
};

/// Why the reply of a streaming method listed as unary is not kept.
const NOT_UNARY: &str =
    "its reply is not one message, as a unary call's is (is a streaming method listed as unary?)";

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

    fn durable(&self) -> Option<DurableTable> {
        self.config.recover.as_ref().and_then(crate::recovery::Hook::durable)
    }

    fn claimed(&self, outcome: &'static str) {
        self.span.record("outcome", outcome);
    }

    /// Read whole (a unary response is one message and its trailers), then stored when the
    /// store policy keeps its status; kept as "completed, not replayable" when over the stored
    /// limits; released when its body failed.
    async fn settle(&self, response: Response<ResBody>, held: &Held) -> Settlement<Response<Body>> {
        let reply = match collect(response).await {
            Ok(reply) => reply,
            Err(error) => {
                tracing::error!(key_hash = held.key.hash(), %error, "idempotency: the response body failed");
                let failed = answer(Status::internal("the response failed"));
                return Settlement::Release("the response body failed", failed);
            }
        };
        if !self.config.store_policy.stores(reply.code()) {
            let why = "the store policy does not keep its status";
            return Settlement::Release(why, reply.into_response());
        }
        if !reply.is_unary() {
            // A streaming method listed as unary (or an OK without its message): it ran, and its
            // reply cannot be replayed.
            tracing::error!(
                key_hash = held.key.hash(),
                "idempotency: a listed method's reply is not one message"
            );
            let record = record::not_replayable(NOT_UNARY);
            return Settlement::Store(record, reply.into_response());
        }
        if self.config.over_limits(&reply) {
            let record = record::not_replayable(OVER_STORED_LIMIT);
            let answer = reply.into_response();
            return Settlement::TooLarge { record, why: OVER_STORED_LIMIT, answer };
        }
        Settlement::Store(reply.encode(&self.config.filter), reply.into_response())
    }

    /// Stored whatever its size and the store policy (the call must not run again), and
    /// answered as a replay.
    async fn recovered(&self, reply: Reply, held: &Held) -> Settlement<Response<Body>> {
        let stored = reply.0.encode(&self.config.filter);
        Settlement::Store(stored.clone(), replay(stored, &self.route, held.key.hash()))
    }

    fn recorded(&self, reply: &Reply, _held: &Held) -> Result<Bytes, Panic> {
        Ok(reply.0.encode(&self.config.filter))
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
            && envelope::same_payload(&returned.encode(&self.config.filter), &committed)
        {
            return returned.into_response();
        }
        tracing::warn!(
            key_hash = held.key.hash(),
            "idempotency: the handler returned another response than it committed; the committed one is answered"
        );
        record::decode(committed, &self.route).map_or_else(answer, record::Collected::into_response)
    }

    fn uncommitted(&self, response: Response<ResBody>) -> Response<Body> {
        response.map(Body::new)
    }
}
