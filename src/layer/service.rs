//! [`Idempotency`]: the request path.
//!
//! 1. filter: methods not made idempotent, requests no route matched, and requests without a
//!    key, pass through.
//! 2. key: parse and validate the key header.
//! 3. scope: find whose key it is.
//! 4. body + fingerprint: buffer the body once, with a limit, and hash the request.
//! 5. claim: one store call decides: run, replay, in progress, or mismatch.
//! 6. inner service: run the handler with the rebuilt request.
//! 7. settle: store the response, or release the key so a retry can run.
//!
//! Steps 1 and 2 are here; the rest is `handle.rs`, over the engine. Steps 6 and 7 run in a
//! task of their own, so a client that goes away while its handler runs neither cancels the
//! handler nor leaves its key claimed until the lease ends. A request dropped during step 5
//! releases whatever its claim may have taken.

use std::{
    fmt,
    sync::Arc,
    task::{Context, Poll},
};

use axum::{
    body::Body,
    extract::{MatchedPath, OriginalUri},
    response::Response,
};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body::Body as HttpBody;
use tower_service::Service;

use super::{
    BoxError,
    config::Config,
    future::ResponseFuture,
    handle::KeyedRequest,
    key_header::parse_key,
    problem::{ProblemType, problem},
    scope::ScopeExtractor,
};
use crate::{
    engine::{Engine, inner_service_accessors},
    store::Store,
};

/// Whether an axum router saw the request and no route matched it: it goes to the fallback
/// (a 404), and must not use up its key. A router inserts `OriginalUri` before it routes, and
/// `MatchedPath` once a route matched; outside any router (a bare service) neither is there,
/// and every request is handled.
fn unrouted<B>(req: &Request<B>) -> bool {
    req.extensions().get::<OriginalUri>().is_some()
        && req.extensions().get::<MatchedPath>().is_none()
}

/// The middleware made by [`IdempotencyLayer`](crate::IdempotencyLayer).
#[derive(Clone)]
pub struct Idempotency<S, St, Sc> {
    inner: S,
    engine: Engine<St>,
    scope: Sc,
    config: Arc<Config>,
}

impl<S, St, Sc> Idempotency<S, St, Sc> {
    pub(super) fn from_parts(inner: S, engine: Engine<St>, scope: Sc, config: Arc<Config>) -> Self {
        Self { inner, engine, scope, config }
    }

    inner_service_accessors!();
}

impl<S: fmt::Debug, St: fmt::Debug, Sc: fmt::Debug> fmt::Debug for Idempotency<S, St, Sc> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .field("store", self.engine.store())
            .field("scope", &self.scope)
            .finish_non_exhaustive()
    }
}

impl<S, St, Sc, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S, St, Sc>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: Store,
    Sc: ScopeExtractor,
    ReqBody: HttpBody<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        // 1. filter. 2. key. Both are cheap and synchronous, so a request that passes through
        // costs no allocation beyond the inner service's own.
        let handled = self.config.methods.contains(req.method()) && !unrouted(&req);
        let key = if handled { parse_key(req.headers(), &self.config.header) } else { Ok(None) };
        let key = match key {
            Ok(Some(key)) => key,
            Ok(None) if !self.config.require_key || !handled => {
                return ResponseFuture::pass_through(self.inner.call(req.map(Body::new)));
            }
            Ok(None) => {
                return ResponseFuture::ready(problem(
                    StatusCode::BAD_REQUEST,
                    ProblemType::KeyMissing,
                    None,
                ));
            }
            Err(error) => {
                return ResponseFuture::ready(problem(
                    StatusCode::BAD_REQUEST,
                    ProblemType::KeyMalformed,
                    Some(error.detail()),
                ));
            }
        };

        // The clone is not ready; the one `poll_ready` readied goes with this request.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let request = KeyedRequest {
            inner,
            engine: self.engine.clone(),
            scope: self.scope.clone(),
            config: self.config.clone(),
        };
        // One span per handled request; it nests under the caller's (`TraceLayer`'s) span, and
        // the claimed request's task carries it too.
        let span = tracing::info_span!(
            "idempotency",
            key_hash = tracing::field::Empty,
            outcome = tracing::field::Empty,
            replayed = tracing::field::Empty,
        );
        ResponseFuture::handled(request.handle(req, key), span)
    }
}
