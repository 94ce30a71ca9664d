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
    recovery::{BoxError, DurableTable, Lookup, Recover, Recovered},
};

/// The hook's lookup of one request.
pub(super) type HookFuture =
    Pin<Box<dyn Future<Output = Result<Recovered<Response<Bytes>>, BoxError>> + Send>>;

/// The layer's recovery hook, its type erased: it is asked only on a takeover (or on every
/// claim, when so configured), so a boxed future costs nothing on the common path.
#[derive(Clone)]
pub(super) struct Hook {
    ask: Arc<dyn Fn(Lookup<Request<Bytes>>) -> HookFuture + Send + Sync>,
    /// What [`Recover::durable`] said of it.
    durable: Option<DurableTable>,
}

impl Hook {
    pub(super) fn new<H: Recover<Request<Bytes>, Response<Bytes>>>(hook: H) -> Self {
        let durable = hook.durable();
        let hook = Arc::new(hook);
        let ask = Arc::new(move |lookup| {
            let hook = hook.clone();
            Box::pin(async move { hook.recover(lookup).await }) as HookFuture
        });
        Self { ask, durable }
    }

    /// The hook's lookup of one request, not yet started.
    pub(super) fn ask(&self, lookup: Lookup<Request<Bytes>>) -> HookFuture {
        (self.ask)(lookup)
    }

    /// Whether the hook answers from outcomes committed beside the record store.
    pub(super) fn durable(&self) -> Option<DurableTable> {
        self.durable.clone()
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
