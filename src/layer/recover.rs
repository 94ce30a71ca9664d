//! Recovery on the HTTP door: asking the app's hook before a taken-over request runs again,
//! and the [`IdempotencyContext`] extractor.

use std::convert::Infallible;

use axum::{
    body::Body,
    extract::{FromRequestParts, OptionalFromRequestParts},
    response::Response,
};
use bytes::Bytes;
use http::{Request, StatusCode, request::Parts};

use super::problem::{ProblemType, problem};
use crate::{context::IdempotencyContext, recovery::Hook as ErasedHook};

/// The layer's recovery hook, its type erased.
pub(super) type Hook = ErasedHook<Request<Bytes>, Response<Bytes>>;

/// The hook's copy of the request: its head and the buffered body. Extensions stay with the
/// handler's request (they need not be `Clone`); the context is the one the hook needs.
pub(super) fn lookup_request(parts: &Parts, body: &Bytes) -> Request<Bytes> {
    let mut request = Request::new(body.clone());
    *request.method_mut() = parts.method.clone();
    *request.uri_mut() = parts.uri.clone();
    *request.version_mut() = parts.version;
    *request.headers_mut() = parts.headers.clone();
    request
}

/// The handler's own view of its claim, put in the request's extensions by the layer.
///
/// Rejects with 400 problem+json (`key-missing`) when the request carries no key (or did not
/// pass through the layer); take `Option<IdempotencyContext>` for routes where the key is
/// optional.
impl<S: Send + Sync> FromRequestParts<S> for IdempotencyContext {
    type Rejection = Response<Body>;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<Self>().cloned().ok_or_else(|| {
            problem(
                StatusCode::BAD_REQUEST,
                ProblemType::KeyMissing,
                Some("this endpoint needs an Idempotency-Key"),
            )
        })
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for IdempotencyContext {
    type Rejection = Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<Self>().cloned())
    }
}
