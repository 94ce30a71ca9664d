//! [`seal`]: a response encoded as the HTTP door stores it, for the handler to commit in its own
//! transaction beside its side effect; and how the door settles a claim whose handler did.

use std::{
    fmt,
    time::{Duration, SystemTime},
};

use axum::{
    body::Body,
    response::{IntoResponse, Response},
};
use bytes::Bytes;
use http::StatusCode;
use http_body::Body as HttpBody;

use super::{
    BoxError, Minimal,
    body::{CollectedBody, collect_response},
    config::Config,
    record, replay,
};
use crate::{
    context::IdempotencyContext,
    engine::{Answer, Holder, envelope},
    store::{Commit, SealError, SealedOutcome, Store},
};

/// A response sealed by [`seal`]: the outcome to commit in the handler's transaction
/// (`PostgresStore::commit(tx, &sealed)`), and the response to return, the same one.
pub struct SealedResponse {
    outcome: SealedOutcome,
    head: http::response::Parts,
    body: Bytes,
}

impl SealedResponse {
    /// The outcome to commit, as the layer stores it.
    #[must_use]
    pub fn outcome(&self) -> &SealedOutcome {
        &self.outcome
    }
}

impl AsRef<SealedOutcome> for SealedResponse {
    fn as_ref(&self) -> &SealedOutcome {
        &self.outcome
    }
}

impl IntoResponse for SealedResponse {
    fn into_response(self) -> Response {
        Response::from_parts(self.head, Body::from(self.body))
    }
}

impl fmt::Debug for SealedResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SealedResponse")
            .field("status", &self.head.status)
            .field("outcome", &self.outcome)
            .finish_non_exhaustive()
    }
}

/// `response` as the idempotency layer stores it (the status, the headers it keeps, the
/// body), for the handler to commit in its own transaction, beside its side effect, so that
/// both commit or neither does: with `PostgresStore`,
/// [`commit`](crate::store::PostgresStore::commit) the handler's transaction with it, then
/// return it.
///
/// The layer then writes nothing more: the committed row is the record, and every retry is
/// replayed from it, even when the process dies between the commit and the answer. The client
/// is answered the committed response: a handler that returns another one after the commit
/// has the committed one answered instead (a warning is logged; headers the layer never
/// stores, such as `Set-Cookie`, go only with a returned response that is the committed one).
/// When the commit fails (or is fenced out), the layer writes nothing either and releases the
/// key, whatever the handler returns: the retry replays the response if the commit landed
/// after all, and runs the handler if it did not.
///
/// The body is read here, up to the layer's stored body limit.
///
/// # Errors
///
/// - [`SealError::NotStored`]: the layer would not store this response (a status its store
///   policy does not keep, a 405, headers or a body over the stored limits, a body that
///   failed). Answer it without committing an outcome; the key is released as for any such
///   response.
/// - [`SealError::NotClaimed`]: the context is not one the idempotency layer gave.
pub async fn seal(
    context: &IdempotencyContext,
    response: impl IntoResponse,
) -> Result<SealedResponse, SealError> {
    let completion = context.completion().ok_or(SealError::NotClaimed)?;
    let config = completion
        .rules
        .as_deref()
        .and_then(|rules| rules.downcast_ref::<Config>())
        .ok_or(SealError::NotClaimed)?;
    let (head, body) = response.into_response().into_parts();
    if let Some(why) = not_stored(config, &head, &body) {
        return Err(SealError::NotStored(why));
    }
    // A minimal record stores nothing of the body: no stored limit applies to it.
    let limit = match head.extensions.get::<Minimal>() {
        Some(_) => usize::MAX,
        None => config.stored_body_limit,
    };
    let body = match collect_response(body, limit).await {
        CollectedBody::Whole(body) => body,
        CollectedBody::TooLarge(_) => return Err(SealError::NotStored(OVER_BODY_LIMIT)),
        CollectedBody::Failed(_) => return Err(SealError::NotStored("the response body failed")),
    };
    let outcome = record::encode_response(&head, &config.header_filter, &body);
    let outcome = context.sealed(outcome)?;
    Ok(SealedResponse { outcome, head, body })
}

const OVER_BODY_LIMIT: &str = "the response is over the stored body limit";

/// Why the layer does not store a response with this head and body, if it does not: its store
/// policy, a 405, or the stored limits as far as the body's size hint tells.
pub(super) fn not_stored<B: HttpBody>(
    config: &Config,
    head: &http::response::Parts,
    body: &B,
) -> Option<&'static str> {
    if !(config.store_policy)(head.status) {
        Some("the status is not stored")
    } else if head.status == StatusCode::METHOD_NOT_ALLOWED {
        // The route exists, the method does not: the request was never handled.
        Some("a 405 is never stored")
    } else if record::stored_headers_len(&head.headers, &config.header_filter)
        > config.stored_headers_limit
    {
        Some("the response headers are over the stored limit")
    } else if head.extensions.get::<super::Minimal>().is_none()
        && body.size_hint().lower() > config.stored_body_limit as u64
    {
        Some(OVER_BODY_LIMIT)
    } else {
        None
    }
}

/// Settles a claim whose handler committed its response in its own transaction, or tried to:
/// the layer writes nothing. The committed response is the answer, whatever the handler
/// returned; a commit that failed releases the key (a fenced delete, which a committed record
/// refuses), whatever the handler returned.
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
        Commit::NotCommitted => {
            holder.release("the handler's transaction did not commit its response").await;
            return answer.send(response.map(Body::new));
        }
    };
    let (head, body) = response.into_parts();
    // The returned response is the committed one when it encodes to the same record: a
    // minimal one by its head alone (its body streams on), any other by its body too.
    let returned = match head.extensions.get::<Minimal>() {
        Some(_) => Some((Body::new(body), Bytes::new())),
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
