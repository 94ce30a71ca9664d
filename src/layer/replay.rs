//! A stored response answered again: decoded, or rebuilt by the layer's hook when it was stored
//! minimally ([`Minimal`](super::Minimal)), marked as a replay.

use std::time::Duration;

use axum::{body::Body, response::Response};
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};

use super::{
    REPLAYED_HEADER,
    config::Config,
    minimal::Rebuild,
    problem::{ProblemType, problem, problem_retry_after},
    record::{self, StoredResponse},
};
use crate::{
    context::IdempotencyContext,
    engine::{
        Label,
        envelope::{self, Format},
    },
    hashing::Named,
};

/// Whose record a replay answers: its key, and the request's fingerprint and scope (the rebuild
/// hook's context).
pub(super) struct Whose<'a> {
    pub(super) named: Named,
    pub(super) scope: &'a [u8],
}

impl Whose<'_> {
    /// The context the rebuild hook is asked with: no claim holds the key while it replays.
    fn context(&self) -> IdempotencyContext {
        IdempotencyContext::new(self.scope.to_vec(), self.named.clone(), false, None)
    }
}

/// What a replay needs besides the record: the layer's configuration (its rebuild hook), the
/// route, the retry's headers, the retention (for the expiry header) and the hook's bound.
pub(super) struct Replay<'a> {
    pub(super) config: &'a Config,
    pub(super) route: &'a Label,
    pub(super) request: &'a HeaderMap,
    pub(super) retention: Duration,
    pub(super) rebuild_timeout: Duration,
}

impl Replay<'_> {
    /// The stored response in `blob`, as a replay, with its expiry when the layer advertises
    /// it. Never panics: an unreadable record, or one the hook cannot rebuild, is a problem.
    pub(super) async fn replay(&self, blob: Bytes, whose: Whose<'_>) -> Response {
        let hash = whose.named.key.hash();
        let opened = envelope::parse(blob, self.route);
        if let Some(opened) = opened.as_ref().filter(|opened| opened.format == Format::NotStored) {
            let reason = String::from_utf8_lossy(&opened.payload);
            tracing::warn!(
                key_hash = hash,
                %reason,
                "idempotency: the request ran before, but its response was too large to keep"
            );
            let status = StatusCode::INTERNAL_SERVER_ERROR;
            return problem(status, ProblemType::ResponseNotReplayable, Some(&reason));
        }
        let decoded = opened
            .ok_or(record::DecodeError("unknown response format, or a truncated header"))
            .and_then(record::decode_parsed);
        let stored = match decoded {
            Ok(stored) => stored,
            Err(error) => {
                tracing::error!(
                    key_hash = hash,
                    reason = error.0,
                    "idempotency: stored response is unreadable"
                );
                return problem(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    ProblemType::CorruptRecord,
                    None,
                );
            }
        };
        if !record::encoding_acceptable(&stored.headers, self.request) {
            // A compression layer inside this one stored an encoded body, and this retry does
            // not accept that encoding. The handler ran already: refuse, never run it again.
            tracing::warn!(
                key_hash = hash,
                "idempotency: the stored response's encoding is not acceptable to the retry; put compression outside the idempotency layer"
            );
            return problem(StatusCode::NOT_ACCEPTABLE, ProblemType::EncodingNotAcceptable, None);
        }
        let completed_at = stored.completed_at;
        let mut response =
            match response(self.config, self.route, self.rebuild_timeout, stored, &whose).await {
                Ok(response) => response,
                Err(problem) => return problem,
            };
        tracing::debug!(key_hash = hash, "idempotency: replayed");
        response.headers_mut().insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
        let expiry = self.config.answers.advertise_expiry.then_some(self.retention);
        record::advertise_expiry(response.headers_mut(), completed_at, expiry);
        response
    }
}

/// `stored` as a response: as it is, or rebuilt by the layer's hook (within `timeout`) when it
/// is minimal; the problem to answer when it cannot be.
pub(super) async fn response(
    config: &Config,
    route: &str,
    timeout: Duration,
    stored: StoredResponse,
    whose: &Whose<'_>,
) -> Result<Response, Response> {
    let hash = whose.named.key.hash();
    let as_response = |status, headers, body: Bytes| {
        let mut response = Response::new(Body::from(body));
        *response.status_mut() = status;
        *response.headers_mut() = headers;
        response
    };
    if !stored.minimal {
        return Ok(as_response(stored.status, stored.headers, stored.body));
    }
    let Some(hook) = &config.rebuild else {
        tracing::error!(
            key_hash = hash,
            "idempotency: a minimal record, and no rebuild hook is set"
        );
        let detail = Some("the response was stored minimally, and no rebuild hook is set");
        return Err(problem(StatusCode::INTERNAL_SERVER_ERROR, ProblemType::RebuildFailed, detail));
    };
    let rebuild = Rebuild {
        status: stored.status,
        headers: stored.headers,
        value: stored.body,
        route: route.to_owned(),
    };
    match hook.rebuild(whose.context(), rebuild, timeout).await {
        Ok(rebuilt) => {
            let (head, body) = rebuilt.into_parts();
            Ok(as_response(head.status, head.headers, body))
        }
        Err(failure) => {
            tracing::error!(
                key_hash = hash,
                failure,
                "idempotency: the rebuild hook failed; the handler does not run"
            );
            let status = StatusCode::SERVICE_UNAVAILABLE;
            Err(problem_retry_after(status, ProblemType::RebuildFailed, None, 1))
        }
    }
}
