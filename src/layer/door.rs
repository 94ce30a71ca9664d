//! The HTTP door's side of a claimed request ([`Door`]): what the engine stores of a handler's
//! response (whole, minimal, streamed, or nothing), and what the client is answered.

use std::{
    marker::PhantomData,
    panic::AssertUnwindSafe,
    sync::Arc,
    time::{Duration, SystemTime},
};

use axum::{body::Body, response::Response};
use bytes::Bytes;
use futures_util::FutureExt as _;
use http::{HeaderMap, StatusCode};
use http_body::Body as HttpBody;

use super::{
    BoxError, Minimal,
    body::{CollectedBody, Streamed, Teed, collect_response, forward, tee},
    commit::{HttpEncoding, NotStored, OVER_BODY_LIMIT, not_stored},
    config::Config,
    problem::{KeyReused, ProblemType, problem},
    record,
    replay::{self, Replay, Whose},
};
use crate::{
    context::Encoding,
    engine::{Door, Held, Label, Panic, Settlement, StreamEnd, Streaming, envelope},
};

/// One request's side of its claim: the layer's configuration, the matched route, the
/// request's span, the rebuild hook's bound.
pub(super) struct HttpDoor<ResBody> {
    pub(super) config: Arc<Config>,
    pub(super) route: Label,
    pub(super) span: tracing::Span,
    /// The longest the layer's hook may take to rebuild a minimal record.
    pub(super) rebuild_timeout: Duration,
    /// The request's scope, for the rebuild hook's context.
    pub(super) scope: Vec<u8>,
    pub(super) body: PhantomData<fn() -> ResBody>,
}

impl<ResBody> HttpDoor<ResBody> {
    /// A replay of a stored response for a request with these headers.
    fn replay<'a>(&'a self, request: &'a HeaderMap, held: &Held) -> Replay<'a> {
        Replay {
            config: &self.config,
            route: &self.route,
            request,
            retention: held.retention,
            rebuild_timeout: self.rebuild_timeout,
        }
    }

    /// Whose record a replay of `held` answers.
    fn whose<'a>(&'a self, held: &'a Held) -> Whose<'a> {
        Whose { named: held.named(), scope: &self.scope }
    }

    /// `head`, with the record's expiry when the layer advertises it.
    fn advertised(&self, mut head: http::response::Parts, held: &Held) -> http::response::Parts {
        let expiry = self.config.answers.advertise_expiry.then_some(held.retention);
        record::advertise_expiry(&mut head.headers, SystemTime::now(), expiry);
        head
    }
}

impl<ResBody> Door for HttpDoor<ResBody>
where
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Output = Response<ResBody>;
    /// The response the recovery hook found, and the request's headers (for its replay).
    type Recovered = (Response<Bytes>, HeaderMap);
    type Answer = Response;

    fn encoding(&self) -> Arc<dyn Encoding> {
        Arc::new(HttpEncoding(self.config.clone()))
    }

    fn durable(&self) -> Option<crate::recovery::DurableTable> {
        self.config.recover.as_ref().and_then(super::recover::Hook::durable)
    }

    fn claimed(&self, outcome: &'static str) {
        self.span.record("outcome", outcome);
        self.span.record("replayed", outcome == "replayed");
    }

    /// Stored whole when its body's size is known (before the client gets it, so that the
    /// client's own next retry finds the record), minimally by its head alone, or streamed
    /// through (stored when it ends within the limit); released when the store policy says so,
    /// or when the handler found its key reused.
    async fn settle(&self, response: Response<ResBody>, held: &Held) -> Settlement<Response> {
        if response.extensions().get::<KeyReused>().is_some() {
            let mismatch =
                problem(self.config.answers.mismatch_status, ProblemType::Mismatch, None);
            return Settlement::Release(
                "the handler found the key reused with another request",
                mismatch,
            );
        }
        let (head, body) = response.into_parts();
        let body = Body::new(body);
        match not_stored(&self.config, &head, &body) {
            Some(NotStored::Policy(why)) => {
                return Settlement::Release(why, Response::from_parts(head, body));
            }
            Some(NotStored::TooLarge(why)) => {
                let record = record::not_replayable(head.status, why);
                let answer = Response::from_parts(head, body);
                return Settlement::TooLarge { record, why, answer };
            }
            None => {}
        }
        // Stored minimally: the record needs nothing of the body, which streams to the client
        // whatever its size.
        if head.extensions.get::<Minimal>().is_some() {
            let record = record::encode_response(&head, &self.config.answers.replayed_headers, &[]);
            return Settlement::Store(
                record,
                Response::from_parts(self.advertised(head, held), body),
            );
        }
        if body.size_hint().exact().is_none() {
            return self.streamed(head, body, held);
        }
        let body = match collect_response(body, self.config.limits.stored_body).await {
            CollectedBody::Whole(body) => body,
            CollectedBody::TooLarge(body) => {
                let record = record::not_replayable(head.status, OVER_BODY_LIMIT);
                let answer = Response::from_parts(head, body);
                return Settlement::TooLarge { record, why: OVER_BODY_LIMIT, answer };
            }
            CollectedBody::Failed(error) => {
                tracing::error!(key_hash = held.key.hash(), %error, "idempotency: response body failed");
                let failed =
                    problem(StatusCode::INTERNAL_SERVER_ERROR, ProblemType::HandlerFailed, None);
                return Settlement::Release("the response body failed", failed);
            }
        };
        let record = record::encode(
            head.status,
            &head.headers,
            &self.config.answers.replayed_headers,
            &body,
        );
        Settlement::Store(
            record,
            Response::from_parts(self.advertised(head, held), Body::from(body)),
        )
    }

    /// Stored through the header filter as the handler's response would be, and answered as a
    /// replay.
    async fn recovered(
        &self,
        recovered: (Response<Bytes>, HeaderMap),
        held: &Held,
    ) -> Settlement<Response> {
        let record = match self.recorded(&recovered, held) {
            Ok(record) => record,
            Err(panic) => return Settlement::Panicked(panic),
        };
        let replay = self.replay(&recovered.1, held);
        let replayed = replay.replay(record.clone(), self.whose(held)).await;
        Settlement::Store(record, replayed)
    }

    fn recorded(
        &self,
        (response, _): &(Response<Bytes>, HeaderMap),
        _: &Held,
    ) -> Result<Bytes, Panic> {
        Ok(record::encode_whole(response, &self.config.answers.replayed_headers))
    }

    /// The returned response when it encodes to the committed record: a minimal one by its
    /// head alone (its body streams on), any other by its body too, read only when its length
    /// is known (a stream the handler returned after its commit may never end, or wait for the
    /// client: the committed response is answered without reading it). The committed one
    /// otherwise.
    async fn committed(
        &self,
        response: Response<ResBody>,
        committed: Bytes,
        held: &Held,
    ) -> Response {
        let config = &self.config;
        let (head, body) = response.into_parts();
        let returned = match head.extensions.get::<Minimal>() {
            Some(_) => Some((Body::new(body), Bytes::new())),
            None if body.size_hint().exact().is_none() => None,
            None => match collect_response(body, config.limits.stored_body).await {
                CollectedBody::Whole(body) => Some((Body::from(body.clone()), body)),
                CollectedBody::TooLarge(_) | CollectedBody::Failed(_) => None,
            },
        };
        let same = returned.as_ref().is_some_and(|(_, stored)| {
            let own = record::encode_response(&head, &config.answers.replayed_headers, stored);
            envelope::same_payload(&own, &committed)
        });
        let mut response = match returned {
            Some((body, _)) if same => Response::from_parts(head, body),
            _ => {
                let hash = held.key.hash();
                tracing::warn!(
                    key_hash = hash,
                    "idempotency: the handler returned another response than it committed; the committed one is answered"
                );
                let timeout = self.rebuild_timeout;
                match record::decode(committed, &self.route) {
                    Ok(stored) => {
                        replay::response(config, &self.route, timeout, stored, &self.whose(held))
                            .await
                            .unwrap_or_else(|problem| problem)
                    }
                    // The layer encoded it a moment ago: unreachable, and answered as any
                    // unreadable record would be.
                    Err(_) => {
                        let status = StatusCode::INTERNAL_SERVER_ERROR;
                        problem(status, ProblemType::CorruptRecord, None)
                    }
                }
            }
        };
        let expiry = config.answers.advertise_expiry.then_some(held.retention);
        record::advertise_expiry(response.headers_mut(), SystemTime::now(), expiry);
        response
    }

    /// The handler's response as it returned it; a mismatch when it found its key reused.
    fn uncommitted(&self, response: Response<ResBody>) -> Response {
        match response.extensions().get::<KeyReused>() {
            Some(_) => problem(self.config.answers.mismatch_status, ProblemType::Mismatch, None),
            None => response.map(Body::new),
        }
    }
}

impl<ResBody> HttpDoor<ResBody> {
    /// Sends the head at once and every frame as the handler produces it; stores the copy when
    /// the stream ends within the limit.
    fn streamed(
        &self,
        head: http::response::Parts,
        body: Body,
        held: &Held,
    ) -> Settlement<Response> {
        let (status, headers) = (head.status, head.headers.clone());
        // Stored when the stream ends within the limit: from now, within the stream's time.
        let head = self.advertised(head, held);
        let (client, streamed) = Streamed::channel();
        let config = self.config.clone();
        let rest = async move {
            let limit = config.limits.stored_body;
            // A body that panics is caught here, so that the client gets an error where its
            // body broke off (not a body that looks whole), and its stream ends only once the
            // key is released.
            let teed = AssertUnwindSafe(tee(body, &client, limit)).catch_unwind().await;
            let teed = teed.unwrap_or_else(|_panic| Teed::Panicked);
            let ended = match teed {
                Teed::Whole(copy) => {
                    let filter = &config.answers.replayed_headers;
                    Streaming::Stored(record::encode(status, &headers, filter, &copy))
                }
                Teed::OverLimit(rest) => {
                    let to = client.clone();
                    Streaming::OverLimit {
                        record: record::not_replayable(status, OVER_BODY_LIMIT),
                        why: OVER_BODY_LIMIT,
                        forward: Box::pin(async move { forward(rest, &to).await }),
                    }
                }
                Teed::Failed(error) => Streaming::Failed(error.to_string()),
                Teed::Panicked => {
                    let error = axum::Error::new("the response body panicked");
                    let _ = client.send(Err(error)).await;
                    Streaming::Failed("the response body panicked".to_owned())
                }
            };
            StreamEnd { ended, open: Box::new(client) }
        };
        Settlement::Streamed(Response::from_parts(head, Body::new(streamed)), Box::pin(rest))
    }
}
