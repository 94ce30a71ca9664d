//! Recovery on the HTTP door: asking the app's hook before a taken-over request runs again,
//! and the [`IdempotencyContext`] extractor.

use std::{convert::Infallible, fmt, future::Future, pin::Pin, sync::Arc};

use axum::{
    body::Body,
    extract::{FromRequestParts, OptionalFromRequestParts},
    response::Response,
};
use bytes::Bytes;
use http::{Request, StatusCode, request::Parts};

use super::problem::{ProblemType, problem};
use crate::{
    context::IdempotencyContext,
    recovery::{BoxError, Lookup, Recover, Recovered},
};

/// The hook's lookup of one request.
pub(super) type HookFuture =
    Pin<Box<dyn Future<Output = Result<Recovered<Response<Bytes>>, BoxError>> + Send>>;

/// The layer's recovery hook, its type erased: it is asked only on a takeover (or on every
/// claim, when so configured), so a boxed future costs nothing on the common path.
#[derive(Clone)]
pub(super) struct Hook(Arc<dyn Fn(Lookup<Request<Bytes>>) -> HookFuture + Send + Sync>);

impl Hook {
    pub(super) fn new<H: Recover<Request<Bytes>, Response<Bytes>>>(hook: H) -> Self {
        let hook = Arc::new(hook);
        Self(Arc::new(move |lookup| {
            let hook = hook.clone();
            Box::pin(async move { hook.recover(lookup).await })
        }))
    }
}

impl Hook {
    /// The hook's lookup of one request, not yet started.
    pub(super) fn ask(&self, lookup: Lookup<Request<Bytes>>) -> HookFuture {
        (self.0)(lookup)
    }
}

impl fmt::Debug for Hook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Hook(..)")
    }
}

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

/// The layer's hook over [`DurableOutcomes`](crate::store::DurableOutcomes): the committed
/// response of the request's key, when the table holds one of the same request.
#[cfg(feature = "postgres")]
pub(super) struct Durable(pub(super) crate::store::DurableOutcomes);

#[cfg(feature = "postgres")]
impl Recover<Request<Bytes>, Response<Bytes>> for Durable {
    async fn recover(
        &self,
        lookup: Lookup<Request<Bytes>>,
    ) -> Result<Recovered<Response<Bytes>>, BoxError> {
        let Some((fingerprint, outcome)) = self.0.read(lookup.context.key()).await? else {
            return Ok(Recovered::Unknown);
        };
        if &fingerprint != lookup.context.fingerprint() {
            return Ok(Recovered::Mismatch);
        }
        let outcome = lookup.context.open_stored(outcome)?;
        let stored =
            super::record::decode(outcome, &crate::engine::Label::route("durable-outcomes"))
                .map_err(|error| format!("the committed outcome is unreadable: {}", error.0))?;
        let mut response = Response::new(stored.body);
        *response.status_mut() = stored.status;
        *response.headers_mut() = stored.headers;
        Ok(Recovered::Happened(response))
    }
}
