//! Minimal records: a response stored as its status, its kept headers and a small value (the
//! resource's id), never its body, and replayed through a hook that rebuilds it from the system
//! of record ([`Minimal`], [`Rebuild`], `IdempotencyLayer::rebuild`): a
//! [`Recover`] hook, asked with a [`Lookup`] of the [`Rebuild`].

use std::{fmt, panic::AssertUnwindSafe, time::Duration};

use axum::response::{IntoResponseParts, ResponseParts};
use bytes::Bytes;
use futures_util::FutureExt as _;
use http::{HeaderMap, Response, StatusCode};
use serde::Serialize;

use crate::{
    context::IdempotencyContext,
    recovery::{Hook, Lookup, Recover, Recovered},
};

/// Marks a response to be stored minimally: its status, the headers the layer keeps, and this
/// small value (a resource id, a reference), never its body. The client that made the request
/// gets the whole response; a retry gets the response the layer's rebuild hook
/// (`IdempotencyLayer::rebuild`) makes from the status, the headers and the value, reading the
/// system of record: the stored copy of a response holding card fragments, personal data or
/// tokens is then none of them, and a large response costs the store a few bytes.
///
/// Put it in the response (it is a response part):
///
/// ```
/// use axum::{Json, http::StatusCode, response::IntoResponse};
/// use axum_idempotency::layer::Minimal;
///
/// async fn create_order() -> impl IntoResponse {
///     let order = serde_json::json!({"id": 42, "card": "4242 4242 4242 4242"});
///     (StatusCode::CREATED, Minimal::new("42"), Json(order))
/// }
/// ```
///
/// The body is not read to be stored: it streams to the client whatever its size, and the
/// stored body limit does not apply.
///
#[doc = include_str!("../docs/minimal.md")]
#[derive(Clone, PartialEq, Eq)]
pub struct Minimal(pub(super) Bytes);

impl Minimal {
    /// A minimal record holding `value`.
    pub fn new(value: impl Into<Bytes>) -> Self {
        Self(value.into())
    }

    /// A minimal record holding `value` as JSON.
    ///
    /// # Errors
    ///
    /// When serde cannot encode `value`.
    pub fn json<T: Serialize>(value: &T) -> Result<Self, serde_json::Error> {
        serde_json::to_vec(value).map(|json| Self(json.into()))
    }

    /// The value stored.
    #[must_use]
    pub fn value(&self) -> &Bytes {
        &self.0
    }
}

impl fmt::Debug for Minimal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Minimal").field(&self.0.len()).finish()
    }
}

impl IntoResponseParts for Minimal {
    type Error = std::convert::Infallible;

    fn into_response_parts(self, mut res: ResponseParts) -> Result<ResponseParts, Self::Error> {
        res.extensions_mut().insert(self);
        Ok(res)
    }
}

/// What a minimal record kept, for the rebuild hook to make the replay from: the request of
/// its [`Lookup`] (whose context names the record's key hash, scope and fingerprint).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Rebuild {
    /// The stored status.
    pub status: StatusCode,
    /// The stored headers (those the layer keeps: no `Set-Cookie`, no `Date`).
    pub headers: HeaderMap,
    /// The handler's [`Minimal`] value.
    pub value: Bytes,
    /// The matched route, as axum's `MatchedPath` has it (`"unrouted"` without one).
    pub route: String,
}

/// The layer's rebuild hook, its type erased: called on a replay of a minimal record alone.
#[derive(Clone, Debug)]
pub(super) struct RebuildHook(Hook<Rebuild, Response<Bytes>>);

impl RebuildHook {
    pub(super) fn new<H: Recover<Rebuild, Response<Bytes>>>(hook: H) -> Self {
        Self(Hook::new(hook))
    }

    /// The rebuilt response; an error naming why not (the hook failed, panicked, took more
    /// than `timeout`, or found nothing of the operation the record says happened).
    pub(super) async fn rebuild(
        &self,
        context: IdempotencyContext,
        rebuild: Rebuild,
        timeout: Duration,
    ) -> Result<Response<Bytes>, String> {
        let call = AssertUnwindSafe(self.0.ask(Lookup::new(context, Some(rebuild)))).catch_unwind();
        match tokio::time::timeout(timeout, call).await {
            Ok(Ok(Ok(Recovered::Happened(response)))) => Ok(response),
            Ok(Ok(Ok(Recovered::Unknown))) => {
                Err("the system of record knows nothing of the stored outcome".to_owned())
            }
            Ok(Ok(Ok(Recovered::Mismatch))) => {
                Err("the system of record holds another request's outcome".to_owned())
            }
            Ok(Ok(Err(error))) => Err(error.to_string()),
            Ok(Err(_panic)) => Err("the rebuild hook panicked".to_owned()),
            Err(_) => Err(format!("no answer within {timeout:?}")),
        }
    }
}
