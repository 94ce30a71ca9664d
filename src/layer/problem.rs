//! The responses the layer itself sends: `application/problem+json` (RFC 9457).

use axum::body::Body;
use http::{HeaderValue, Response, StatusCode, header};
use serde::Serialize;

/// The `type` URIs of the layer's problems. They are stable: clients may match on them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ProblemType {
    KeyMissing,
    KeyMalformed,
    ScopeMissing,
    BodyTooLarge,
    BodyUnreadable,
    InProgress,
    Mismatch,
    StoreUnavailable,
    CorruptRecord,
    HandlerFailed,
    EncodingNotAcceptable,
    RecoveryFailed,
    RebuildFailed,
    ResponseNotReplayable,
    FleetDisagrees,
}

impl ProblemType {
    /// Every type, for the test that holds the documented table (`src/docs/answers.md`) to them.
    #[cfg(test)]
    const ALL: [Self; 15] = [
        Self::KeyMissing,
        Self::KeyMalformed,
        Self::ScopeMissing,
        Self::BodyTooLarge,
        Self::BodyUnreadable,
        Self::InProgress,
        Self::Mismatch,
        Self::StoreUnavailable,
        Self::CorruptRecord,
        Self::HandlerFailed,
        Self::EncodingNotAcceptable,
        Self::RecoveryFailed,
        Self::RebuildFailed,
        Self::ResponseNotReplayable,
        Self::FleetDisagrees,
    ];

    fn uri_and_title(self) -> (&'static str, &'static str) {
        match self {
            Self::KeyMissing => {
                ("urn:axum-idempotency:problem:key-missing", "Idempotency-Key header is required")
            }
            Self::KeyMalformed => (
                "urn:axum-idempotency:problem:key-malformed",
                "Idempotency-Key header is malformed",
            ),
            Self::ScopeMissing => (
                "urn:axum-idempotency:problem:scope-missing",
                "The request has no idempotency scope",
            ),
            Self::BodyTooLarge => (
                "urn:axum-idempotency:problem:body-too-large",
                "Request body is larger than the idempotency limit",
            ),
            Self::BodyUnreadable => {
                ("urn:axum-idempotency:problem:body-unreadable", "Request body could not be read")
            }
            Self::InProgress => (
                "urn:axum-idempotency:problem:in-progress",
                "A request with this Idempotency-Key is still being processed",
            ),
            Self::Mismatch => (
                "urn:axum-idempotency:problem:key-reused",
                "This Idempotency-Key was used with a different request",
            ),
            Self::StoreUnavailable => (
                "urn:axum-idempotency:problem:store-unavailable",
                "The idempotency store is unavailable",
            ),
            Self::CorruptRecord => (
                "urn:axum-idempotency:problem:corrupt-record",
                "The stored idempotency record could not be read",
            ),
            Self::EncodingNotAcceptable => (
                "urn:axum-idempotency:problem:encoding-not-acceptable",
                "The stored response's content encoding is not acceptable to this request",
            ),
            Self::RecoveryFailed => (
                "urn:axum-idempotency:problem:recovery-failed",
                "An earlier attempt's outcome could not be checked; the request did not run",
            ),
            Self::RebuildFailed => (
                "urn:axum-idempotency:problem:rebuild-failed",
                "The stored response could not be rebuilt from the system of record; the request did not run",
            ),
            Self::HandlerFailed => {
                ("urn:axum-idempotency:problem:handler-failed", "The request handler failed")
            }
            Self::FleetDisagrees => (
                "urn:axum-idempotency:problem:fleet-disagrees",
                "This instance names records in a way that cannot serve beside its fleet; the request did not run",
            ),
            Self::ResponseNotReplayable => (
                "urn:axum-idempotency:problem:response-not-replayable",
                "The request ran, but its response was too large to keep; it does not run again",
            ),
        }
    }
}

#[derive(Serialize)]
struct ProblemBody<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    title: &'a str,
    status: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<&'a str>,
}

/// Builds a problem+json response.
pub(crate) fn problem(
    status: StatusCode,
    kind: ProblemType,
    detail: Option<&str>,
) -> Response<Body> {
    let (uri, title) = kind.uri_and_title();
    let body = ProblemBody { kind: uri, title, status: status.as_u16(), detail };
    // Serializing a struct of strings and an integer cannot fail.
    let json = serde_json::to_vec(&body).unwrap_or_default();
    let mut response = Response::new(Body::from(json));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
    response
}

/// A handler's answer to a request whose key it found reused with another payload
/// ([`StoreError::KeyReused`](crate::store::StoreError::KeyReused), from
/// `Checkpoints::done`): the layer answers its mismatch problem (409 `key-reused`, 422
/// under the IETF preset) and releases the key, so that the request the key's steps belong
/// to can still resume.
#[derive(Debug, Clone, Copy, Default)]
pub struct KeyReused;

impl axum::response::IntoResponse for KeyReused {
    fn into_response(self) -> Response<Body> {
        let mut response = problem(StatusCode::CONFLICT, ProblemType::Mismatch, None);
        response.extensions_mut().insert(self);
        response
    }
}

/// Builds a problem+json response with a `Retry-After` of `seconds`.
pub(crate) fn problem_retry_after(
    status: StatusCode,
    kind: ProblemType,
    detail: Option<&str>,
    seconds: u64,
) -> Response<Body> {
    let mut response = problem(status, kind, detail);
    response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    response
}

#[cfg(test)]
mod tests {
    use super::ProblemType;

    /// The layer's documentation (`src/docs/answers.md`, on `IdempotencyLayer`) lists every
    /// problem type, and no other: clients match on them.
    #[test]
    fn the_docs_list_every_problem_type() {
        let docs = include_str!("../docs/answers.md");
        let listed: Vec<&str> = docs
            .lines()
            .filter_map(|line| line.strip_prefix("| `urn:axum-idempotency:problem:"))
            .filter_map(|rest| rest.split('`').next())
            .collect();
        let mut ours: Vec<&str> = ProblemType::ALL
            .iter()
            .map(|kind| kind.uri_and_title().0.trim_start_matches("urn:axum-idempotency:problem:"))
            .collect();
        let mut listed_sorted = listed.clone();
        listed_sorted.sort_unstable();
        ours.sort_unstable();
        assert_eq!(listed_sorted, ours);
    }
}
