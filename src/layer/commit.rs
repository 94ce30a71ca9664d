//! The HTTP door's side of a store's transaction: how it encodes the outcome a handler commits
//! ([`Committable`] for `Response`), and how it answers a [`TransactionError`]; and which
//! responses it does not store ([`not_stored`]), for both its settle and its commits.

use std::{fmt, sync::Arc};

use axum::{
    body::Body,
    response::{IntoResponse, Response},
};
use bytes::Bytes;
use futures_util::future::BoxFuture;
use http::{HeaderValue, StatusCode, header};
use http_body::Body as HttpBody;

use super::{
    Minimal,
    body::{CollectedBody, collect_response},
    config::Config,
    problem::{ProblemType, problem, problem_retry_after},
    record,
    store_policy::ReleaseKey,
};
use crate::{
    context::{Encoding, IdempotencyContext},
    store::{Committable, EncodeError, TransactionError, transaction::Failure},
};

/// The HTTP door's encoding of a committed outcome: the layer's own rules (store policy,
/// limits, header filter).
pub(super) struct HttpEncoding(pub(super) Arc<Config>);

impl Encoding for HttpEncoding {
    fn response(
        &self,
        response: Response,
    ) -> BoxFuture<'static, Result<(Bytes, Response), EncodeError>> {
        let config = self.0.clone();
        Box::pin(async move {
            let (head, body) = response.into_parts();
            if let Some(why) = not_stored(&config, &head, &body) {
                return Err(EncodeError::NotStored(why.reason()));
            }
            // A minimal record stores nothing of the body: no stored limit applies to it.
            let limit = match head.extensions.get::<Minimal>() {
                Some(_) => usize::MAX,
                None => config.limits.stored_body,
            };
            let body = match collect_response(body, limit).await {
                CollectedBody::Whole(body) => body,
                CollectedBody::TooLarge(_) => return Err(EncodeError::NotStored(OVER_BODY_LIMIT)),
                CollectedBody::Failed(_) => {
                    return Err(EncodeError::NotStored("the response body failed"));
                }
            };
            let outcome = record::encode_response(&head, &config.answers.replayed_headers, &body);
            Ok((outcome, Response::from_parts(head, Body::from(body))))
        })
    }

    fn json(&self, json: Bytes) -> Result<Bytes, EncodeError> {
        // What `axum::Json` answers: 200, `application/json`.
        let mut response = Response::new(Body::empty());
        let json_type = HeaderValue::from_static("application/json");
        response.headers_mut().insert(header::CONTENT_TYPE, json_type);
        let (head, _) = response.into_parts();
        let body = http_body_util::Full::new(json.clone());
        if let Some(why) = not_stored(&self.0, &head, &body) {
            return Err(EncodeError::NotStored(why.reason()));
        }
        Ok(record::encode_response(&head, &self.0.answers.replayed_headers, &json))
    }

    fn read_response(&self, stored: Bytes) -> Result<http::Response<Bytes>, String> {
        let label = crate::engine::Label::route("durable-outcomes");
        let stored = record::decode(stored, &label).map_err(|error| error.0.to_owned())?;
        let mut response = http::Response::new(stored.body);
        *response.status_mut() = stored.status;
        *response.headers_mut() = stored.headers;
        Ok(response)
    }
}

/// The handler's response, committed as the layer stores it.
impl Committable for Response {
    async fn encode(self, context: &IdempotencyContext) -> Result<(Bytes, Self), EncodeError> {
        let completion = context.completion().ok_or(EncodeError::NotClaimed)?;
        completion.encoding.response(self).await
    }
}

/// A transaction that did not commit, answered as the layer answers its own failures
/// (`application/problem+json`): the operation's error 500 `handler-failed` (logged, never
/// shown); a store error 503 `store-unavailable` with `Retry-After`; a commit whose answer was
/// lost 503 `store-unavailable` with `Retry-After` (the retry learns what committed); an
/// outcome the layer does not store and a misuse 500 `handler-failed`, with the reason.
impl<E: fmt::Display> IntoResponse for TransactionError<E> {
    fn into_response(self) -> Response {
        match self.failure() {
            Failure::Handler(reason) => problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                ProblemType::HandlerFailed,
                reason.as_deref(),
            ),
            Failure::Store(detail) => {
                let status = StatusCode::SERVICE_UNAVAILABLE;
                problem_retry_after(status, ProblemType::StoreUnavailable, Some(&detail), 1)
            }
        }
    }
}

pub(super) const OVER_BODY_LIMIT: &str = "the response is over the stored body limit";

/// Why the layer does not store a response.
#[derive(Debug, Clone, Copy)]
pub(super) enum NotStored {
    /// Its policy: a response marked `ReleaseKey`, one its store policy does not keep, a 405.
    /// The key is released.
    Policy(&'static str),
    /// Over the stored limits: kept as "completed, not replayable", unless the layer releases
    /// such keys.
    TooLarge(&'static str),
}

impl NotStored {
    pub(super) fn reason(self) -> &'static str {
        match self {
            Self::Policy(why) | Self::TooLarge(why) => why,
        }
    }
}

/// Why the layer does not store a response with this head and body, if it does not: its store
/// policy, a 405, or the stored limits as far as the body's size hint tells.
pub(super) fn not_stored<B: HttpBody>(
    config: &Config,
    head: &http::response::Parts,
    body: &B,
) -> Option<NotStored> {
    if head.extensions.get::<ReleaseKey>().is_some() {
        Some(NotStored::Policy("the handler marked its response not to be stored (ReleaseKey)"))
    } else if !config.store_policy.0.stores(head) {
        Some(NotStored::Policy("the store policy does not keep it"))
    } else if head.status == StatusCode::METHOD_NOT_ALLOWED {
        // The route exists, the method does not: the request was never handled.
        Some(NotStored::Policy("a 405 is never stored"))
    } else if record::stored_headers_len(&head.headers, &config.answers.replayed_headers)
        > config.limits.stored_headers
    {
        Some(NotStored::TooLarge("the response headers are over the stored limit"))
    } else if head.extensions.get::<super::Minimal>().is_none()
        && body.size_hint().lower() > config.limits.stored_body as u64
    {
        Some(NotStored::TooLarge(OVER_BODY_LIMIT))
    } else {
        None
    }
}
