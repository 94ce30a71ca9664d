//! The path of one request that carries a valid key: scope, body and fingerprint; then the
//! engine's claim, run and settle ([`Engine::operate`]), and the answer to what it decided.

use std::{marker::PhantomData, sync::Arc};

use axum::{
    body::Body,
    extract::{MatchedPath, OriginalUri},
    response::Response,
};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body::Body as HttpBody;
use tower::ServiceExt as _;
use tower_service::Service;

use super::{
    BoxError,
    body::read_body,
    config::Config,
    door::HttpDoor,
    problem::{ProblemType, problem, problem_retry_after},
    recover::lookup_request,
    replay::{Replay, Whose},
    scope::ScopeExtractor,
};
use crate::{
    context::IdempotencyContext,
    engine::{Claiming, Decided, Ended, Engine, Label, Operated, Start},
    key::RecordKey,
    recovery::Lookup,
    store::{Store, StoreError},
};

/// How long a client is told to wait when the store is unavailable.
const UNAVAILABLE_RETRY_AFTER_SECS: u64 = 1;

/// A request that carries a valid key, with what it needs to be handled.
pub(super) struct KeyedRequest<S, St, Sc> {
    pub(super) inner: S,
    pub(super) engine: Engine<St>,
    pub(super) scope: Sc,
    pub(super) config: Arc<Config>,
}

impl<S, St, Sc, ResBody> KeyedRequest<S, St, Sc>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: Store,
    Sc: ScopeExtractor,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    pub(super) async fn handle<ReqBody>(
        self,
        req: Request<ReqBody>,
        key: Vec<u8>,
    ) -> Result<Response, S::Error>
    where
        ReqBody: HttpBody<Data = Bytes> + Send + 'static,
        ReqBody::Error: Into<BoxError>,
    {
        let (mut parts, body) = req.into_parts();

        // 3. scope
        let scope = match self.scope.scope(&mut parts).await {
            Ok(scope) => scope,
            Err(response) => return Ok(response),
        };
        let record_key = RecordKey::new(&self.config.prefix, &scope, &key);

        // 4. body + fingerprint
        let body = match read_body(&parts, body, self.config.limits.body).await {
            Ok(body) => body,
            Err(response) => return Ok(response),
        };
        // The concrete path, not the route template: one key sent to `/orders/1` and then
        // `/orders/2` is two requests. axum's `OriginalUri` is the path before any `nest`
        // stripped its prefix, so the fingerprint does not depend on where the layer sits.
        let uri = parts.extensions.get::<OriginalUri>().map_or(&parts.uri, |original| &original.0);
        let query = uri.query().unwrap_or("");
        let fingerprint = self.config.fingerprinting.fingerprint(&parts, uri.path(), query, &body);

        // 5. claim, run, settle: the engine's.
        let config = &self.config;
        let span = tracing::Span::current();
        let named = self.engine.name(record_key, fingerprint);
        span.record("key_hash", named.key.hash());
        let route = Label::route(
            parts.extensions.get::<MatchedPath>().map_or("unrouted", MatchedPath::as_str),
        );
        let rebuild_timeout = self.engine.recovery_timeout();
        let door = HttpDoor {
            config: config.clone(),
            route: route.clone(),
            span,
            rebuild_timeout,
            scope: scope.clone(),
            body: PhantomData,
        };
        // Whose record a replay answers, should the claim find one.
        // Whose record a replay answers, should the claim find one; its key's hash names it
        // in the logs below.
        let (replayed, replay_scope) = (named.clone(), scope.clone());
        let hash = replayed.key.hash();
        let claiming = Claiming { named, route: route.clone(), scope, wait_until: None };
        let recover = &config.recover;
        let start = |(inner, mut parts, body): (S, http::request::Parts, Bytes),
                     context: IdempotencyContext,
                     due| {
            // The recovery hook's question, with a copy of the request, when it is due.
            let lookup = recover.as_ref().filter(|_| due).map(|hook| {
                let headers = parts.headers.clone();
                let lookup =
                    hook.ask(Lookup::new(context.clone(), Some(lookup_request(&parts, &body))));
                async move {
                    let found = lookup.await?;
                    Ok(found.map(|response| (response, headers)))
                }
            });
            parts.extensions.insert(context);
            let operation = inner.oneshot(Request::from_parts(parts, Body::from(body)));
            Start { operation, lookup }
        };
        let decided =
            match self.engine.operate(door, claiming, (self.inner, parts, body), start).await {
                Operated::Ended(ended) => return ended_response(ended, config),
                Operated::Decided(request, decided) => (request, decided),
            };
        match decided {
            ((_, parts, _), Decided::Replay(blob)) => {
                let answer = Replay {
                    config,
                    route: &route,
                    request: &parts.headers,
                    retention: self.engine.retention(),
                    rebuild_timeout,
                };
                let whose = Whose { named: replayed.clone(), scope: &replay_scope };
                Ok(answer.replay(blob, whose).await)
            }
            (_, Decided::InProgress { retry_after }) => {
                tracing::debug!(key_hash = hash, ?retry_after, "idempotency: in progress");
                // Whole seconds, rounded up, never 0 ("retry now").
                let seconds = retry_after.as_millis().div_ceil(1000).max(1);
                Ok(problem_retry_after(
                    config.answers.in_progress_status,
                    ProblemType::InProgress,
                    None,
                    u64::try_from(seconds).unwrap_or(u64::MAX),
                ))
            }
            ((inner, parts, body), Decided::Failed(error))
                if error.is_unavailable() && config.fail_open =>
            {
                tracing::warn!(key_hash = hash, %error, "idempotency: store unavailable; running without idempotency (fail open)");
                let request = Request::from_parts(parts, Body::from(body));
                inner.oneshot(request).await.map(|response| response.map(Body::new))
            }
            (_, Decided::Failed(error)) => Ok(store_error_response(&error, hash)),
        }
    }
}

/// The answer for a claimed request that ended.
fn ended_response<E>(ended: Ended<Response, E>, config: &Config) -> Result<Response, E> {
    match ended {
        Ended::Answered(response) => Ok(response),
        Ended::Failed(error) => Err(error),
        Ended::Refused => Ok(problem_retry_after(
            StatusCode::SERVICE_UNAVAILABLE,
            ProblemType::RecoveryFailed,
            None,
            1,
        )),
        Ended::Mismatch => Ok(problem(config.answers.mismatch_status, ProblemType::Mismatch, None)),
        Ended::Cancelled => {
            Ok(problem(StatusCode::SERVICE_UNAVAILABLE, ProblemType::HandlerFailed, None))
        }
    }
}

fn store_error_response(error: &StoreError, hash: &str) -> Response {
    if let StoreError::Misplaced(_) = error {
        tracing::error!(key_hash = hash, %error, "idempotency: refused beside its fleet");
        problem_retry_after(
            StatusCode::SERVICE_UNAVAILABLE,
            ProblemType::FleetDisagrees,
            None,
            UNAVAILABLE_RETRY_AFTER_SECS,
        )
    } else if error.is_unavailable() {
        tracing::error!(key_hash = hash, %error, "idempotency: store unavailable");
        problem_retry_after(
            StatusCode::SERVICE_UNAVAILABLE,
            ProblemType::StoreUnavailable,
            None,
            UNAVAILABLE_RETRY_AFTER_SECS,
        )
    } else {
        tracing::error!(key_hash = hash, %error, "idempotency: record not written by this layer");
        problem(StatusCode::INTERNAL_SERVER_ERROR, ProblemType::CorruptRecord, None)
    }
}
