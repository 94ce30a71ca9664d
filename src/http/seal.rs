//! The HTTP door's side of a store's transaction: how it encodes the outcome a handler commits
//! ([`Committable`] for `Response`), how it answers a [`TransactionError`], and how it settles
//! a claim whose handler committed (or tried to).

use std::{
    fmt,
    sync::Arc,
    time::{Duration, SystemTime},
};

use axum::{
    body::Body,
    response::{IntoResponse, Response},
};
use bytes::Bytes;
use futures_util::future::BoxFuture;
use http::{HeaderValue, StatusCode, header};
use http_body::Body as HttpBody;

use super::{
    BoxError, Minimal,
    body::{CollectedBody, collect_response},
    config::Config,
    problem::{ProblemType, problem, problem_retry_after},
    record, replay,
};
use crate::{
    context::{Encoding, IdempotencyContext},
    engine::{Answer, Holder, envelope},
    store::{Commit, Committable, SealError, Store, TransactionError},
};

/// The HTTP door's encoding of a committed outcome: the layer's own rules (store policy,
/// limits, header filter).
pub(super) struct HttpEncoding(pub(super) Arc<Config>);

impl Encoding for HttpEncoding {
    fn response(
        &self,
        response: Response,
    ) -> BoxFuture<'static, Result<(Bytes, Response), SealError>> {
        let config = self.0.clone();
        Box::pin(async move {
            let (head, body) = response.into_parts();
            if let Some(why) = not_stored(&config, &head, &body) {
                return Err(SealError::NotStored(why.reason()));
            }
            // A minimal record stores nothing of the body: no stored limit applies to it.
            let limit = match head.extensions.get::<Minimal>() {
                Some(_) => usize::MAX,
                None => config.stored_body_limit,
            };
            let body = match collect_response(body, limit).await {
                CollectedBody::Whole(body) => body,
                CollectedBody::TooLarge(_) => return Err(SealError::NotStored(OVER_BODY_LIMIT)),
                CollectedBody::Failed(_) => {
                    return Err(SealError::NotStored("the response body failed"));
                }
            };
            let outcome = record::encode_response(&head, &config.header_filter, &body);
            Ok((outcome, Response::from_parts(head, Body::from(body))))
        })
    }

    fn json(&self, json: Bytes) -> Result<Bytes, SealError> {
        // What `axum::Json` answers: 200, `application/json`.
        let mut response = Response::new(Body::empty());
        let json_type = HeaderValue::from_static("application/json");
        response.headers_mut().insert(header::CONTENT_TYPE, json_type);
        let (head, _) = response.into_parts();
        let body = http_body_util::Full::new(json.clone());
        if let Some(why) = not_stored(&self.0, &head, &body) {
            return Err(SealError::NotStored(why.reason()));
        }
        Ok(record::encode_response(&head, &self.0.header_filter, &json))
    }
}

/// The handler's response, committed as the layer stores it.
impl Committable for Response {
    async fn encode(self, context: &IdempotencyContext) -> Result<(Bytes, Self), SealError> {
        let completion = context.completion().ok_or(SealError::NotClaimed)?;
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
        match self {
            Self::Operation(error) => {
                tracing::error!(%error, "idempotency: the handler's transaction failed");
                problem(StatusCode::INTERNAL_SERVER_ERROR, ProblemType::HandlerFailed, None)
            }
            Self::Store(error) => {
                tracing::error!(%error, "idempotency: the handler's transaction was rolled back");
                let detail = error.to_string();
                let status = StatusCode::SERVICE_UNAVAILABLE;
                problem_retry_after(status, ProblemType::StoreUnavailable, Some(&detail), 1)
            }
            Self::CommitUnknown(error) => {
                tracing::error!(%error, "idempotency: the commit's answer was lost");
                let detail = "the commit's answer was lost: retry to learn its outcome";
                let status = StatusCode::SERVICE_UNAVAILABLE;
                problem_retry_after(status, ProblemType::StoreUnavailable, Some(detail), 1)
            }
            Self::NotStored(reason) => {
                tracing::error!(reason, "idempotency: the handler's outcome is not stored");
                let status = StatusCode::INTERNAL_SERVER_ERROR;
                problem(status, ProblemType::HandlerFailed, Some(&reason))
            }
            Self::Misuse(reason) => {
                tracing::error!(reason, "idempotency: the handler's transaction was refused");
                problem(StatusCode::INTERNAL_SERVER_ERROR, ProblemType::HandlerFailed, Some(reason))
            }
        }
    }
}

pub(super) const OVER_BODY_LIMIT: &str = "the response is over the stored body limit";

/// Why the layer does not store a response.
#[derive(Debug, Clone, Copy)]
pub(super) enum NotStored {
    /// Its policy: a status its store policy does not keep, a 405. The key is released.
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
    if !(config.store_policy)(head.status) {
        Some(NotStored::Policy("the status is not stored"))
    } else if head.status == StatusCode::METHOD_NOT_ALLOWED {
        // The route exists, the method does not: the request was never handled.
        Some(NotStored::Policy("a 405 is never stored"))
    } else if record::stored_headers_len(&head.headers, &config.header_filter)
        > config.stored_headers_limit
    {
        Some(NotStored::TooLarge("the response headers are over the stored limit"))
    } else if head.extensions.get::<super::Minimal>().is_none()
        && body.size_hint().lower() > config.stored_body_limit as u64
    {
        Some(NotStored::TooLarge(OVER_BODY_LIMIT))
    } else {
        None
    }
}

/// Settles a claim whose handler committed its response in a store's transaction, or tried
/// to: the layer writes nothing. The committed response is the answer, whatever the handler
/// returned; a transaction rolled back, or whose commit's answer was lost, releases the key (a
/// fenced delete, which a committed record refuses), whatever the handler returned.
pub(super) async fn settle_sealed<St: Store, E, ResBody>(
    config: &Config,
    holder: Holder<St>,
    commit: Commit,
    response: Response<ResBody>,
    (route, rebuild_timeout): (&str, Duration),
    answer: Answer<Response, E>,
) where
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let (committed, in_store) = match commit {
        Commit::Committed(committed) => (committed, true),
        Commit::CommittedBeside(committed) => (committed, false),
        Commit::RolledBack | Commit::Unknown => {
            holder.release("the handler's transaction did not commit its response").await;
            return answer.send(response.map(Body::new));
        }
    };
    let (head, body) = response.into_parts();
    // The returned response is the committed one when it encodes to the same record: a
    // minimal one by its head alone (its body streams on), any other by its body too, read
    // only when its length is known (a stream the handler returned after its commit may never
    // end, or wait for the client: the committed response is answered without reading it).
    let returned = match head.extensions.get::<Minimal>() {
        Some(_) => Some((Body::new(body), Bytes::new())),
        None if body.size_hint().exact().is_none() => None,
        None => match collect_response(body, config.stored_body_limit).await {
            CollectedBody::Whole(body) => Some((Body::from(body.clone()), body)),
            CollectedBody::TooLarge(_) | CollectedBody::Failed(_) => None,
        },
    };
    let same = returned.as_ref().is_some_and(|(_, stored)| {
        let own = record::encode_response(&head, &config.header_filter, stored);
        envelope::same_payload(&own, &committed)
    });
    let mut response = match returned {
        Some((body, _)) if same => Response::from_parts(head, body),
        _ => {
            tracing::warn!(
                key_hash = holder.key().hash(),
                "idempotency: the handler returned another response than it committed; the committed one is answered"
            );
            let committed = match record::decode(committed.clone(), route) {
                Ok(stored) => {
                    let hash = holder.key().hash();
                    replay::response(config, route, rebuild_timeout, stored, hash).await
                }
                // The layer encoded it a moment ago: unreachable, and answered as any
                // unreadable record would be.
                Err(_) => Err(super::problem::problem(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    super::problem::ProblemType::CorruptRecord,
                    None,
                )),
            };
            committed.unwrap_or_else(|problem| problem)
        }
    };
    let expiry = config.advertise_expiry.then(|| holder.retention());
    record::advertise_expiry(response.headers_mut(), SystemTime::now(), expiry);
    if in_store {
        holder.settled_in_transaction(move || answer.send(response)).await;
    } else {
        // Committed beside the record store: stored there too, as the outcome answered.
        holder.complete(committed, move || answer.send(response)).await;
    }
}
