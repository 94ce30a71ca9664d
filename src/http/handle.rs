//! The path of one request that carries a valid key: scope, body and fingerprint, the claim,
//! and the claimed request's task (the handler, then the settle).

use std::{
    sync::Arc,
    time::{Duration, SystemTime},
};

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
    BoxError, Minimal,
    body::{CollectedBody, Streamed, Teed, collect_response, forward, read_body, tee},
    config::Config,
    problem::{KeyReused, ProblemType, problem, problem_retry_after},
    record,
    recover::lookup_request,
    replay::Replay,
    scope::ScopeExtractor,
    seal::{HttpEncoding, NotStored, OVER_BODY_LIMIT, not_stored, settle_sealed},
};
use crate::{
    context::{Completion, IdempotencyContext},
    engine::{Answer, Claimed, Ended, Engine, Holder, Recovering},
    key::RecordKey,
    recovery::Lookup,
    store::{Commit, Store, StoreError},
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
        let body = match read_body(&parts, body, self.config.body_limit).await {
            Ok(body) => body,
            Err(response) => return Ok(response),
        };
        // The concrete path, not the route template: one key sent to `/orders/1` and then
        // `/orders/2` is two requests. axum's `OriginalUri` is the path before any `nest`
        // stripped its prefix, so the fingerprint does not depend on where the layer sits.
        let uri = parts.extensions.get::<OriginalUri>().map_or(&parts.uri, |original| &original.0);
        let query = uri.query().unwrap_or("");
        let fingerprint = self.config.intent.fingerprint(&parts, uri.path(), query, &body);

        // 5. claim
        let config = &self.config;
        // A clone shares the key's text: the logs below name its hash.
        let logged = record_key.clone();
        let hash = logged.hash();
        let span = tracing::Span::current();
        span.record("key_hash", hash);
        let route: Arc<str> =
            parts.extensions.get::<MatchedPath>().map_or("unrouted", MatchedPath::as_str).into();
        let claimed = self.engine.claim(record_key, fingerprint, route.clone()).await;
        span.record("outcome", outcome_name(&claimed));
        span.record("replayed", matches!(claimed, Ok(Claimed::Replay(_))));
        let holder = match claimed {
            Ok(Claimed::Run(holder)) => holder,
            Ok(Claimed::Replay(blob)) => {
                let answer = Replay {
                    config,
                    route: &route,
                    request: &parts.headers,
                    retention: self.engine.retention(),
                    rebuild_timeout: self.engine.recovery_timeout(),
                };
                return Ok(answer.replay(blob, hash).await);
            }
            Ok(Claimed::InProgress { retry_after }) => {
                tracing::debug!(key_hash = hash, ?retry_after, "idempotency: in progress");
                // Whole seconds, rounded up, never 0 ("retry now").
                let seconds = retry_after.as_millis().div_ceil(1000).max(1);
                return Ok(problem_retry_after(
                    config.in_progress_status,
                    ProblemType::InProgress,
                    None,
                    u64::try_from(seconds).unwrap_or(u64::MAX),
                ));
            }
            Ok(Claimed::Mismatch) => {
                tracing::info!(key_hash = hash, "idempotency: key reused with a different request");
                return Ok(problem(config.mismatch_status, ProblemType::Mismatch, None));
            }
            Err(error) if error.is_unavailable() && config.fail_open => {
                tracing::warn!(key_hash = hash, %error, "idempotency: store unavailable; running without idempotency (fail open)");
                let request = Request::from_parts(parts, Body::from(body));
                return self.inner.oneshot(request).await.map(|response| response.map(Body::new));
            }
            Err(error) => return Ok(store_error_response(&error, hash)),
        };

        // The handler's view of its claim; the recovery hook's too, with a copy of the request
        // when it is to be asked.
        // What a handler that commits its response in a store's transaction needs.
        let completion = Completion::new(
            holder.owner().clone(),
            holder.retention(),
            holder.commit_slot().clone(),
            holder.at_rest().clone(),
            Arc::new(HttpEncoding(self.config.clone())),
            holder.durable(),
        );
        let context = IdempotencyContext::new(
            scope,
            holder.key(),
            holder.fingerprint().clone(),
            holder.taken_over(),
            Some(completion),
        );
        let recovery = match &config.recover {
            Some(hook) if holder.needs_recovery() => {
                let lookup = Lookup::new(context.clone(), lookup_request(&parts, &body));
                let (config, headers) = (config.clone(), parts.headers.clone());
                let (route, timeout) = (route.clone(), self.engine.recovery_timeout());
                Some(Recovering {
                    lookup: hook.ask(lookup),
                    happened: move |holder, response, answer| {
                        let request = (route, headers, timeout);
                        settle_recovered(config, holder, response, request, answer)
                    },
                })
            }
            _ => None,
        };
        parts.extensions.insert(context.clone());

        // 6 and 7 detachable: run here, and in a task of their own if the client goes away, so
        // that it neither cancels its handler (nor its recovery) nor leaves its key claimed
        // until the lease ends.
        let handler = self.inner.oneshot(Request::from_parts(parts, Body::from(body)));
        let config = self.config.clone();
        let rebuild_timeout = self.engine.recovery_timeout();
        let settle = move |holder: Holder<St>,
                           response: Response<ResBody>,
                           answer: Answer<Response, S::Error>| async move {
            let commit = context.commit();
            let committed =
                matches!(commit, Some(Commit::Committed(_) | Commit::CommittedBeside(_)));
            if !committed && response.extensions().get::<KeyReused>().is_some() {
                holder.release("the handler found the key reused with another request").await;
                return answer.send(problem(config.mismatch_status, ProblemType::Mismatch, None));
            }
            match commit {
                // The handler committed its response in a store's transaction, or tried
                // to: the layer writes nothing of its own.
                Some(commit) => {
                    let route = (&*route, rebuild_timeout);
                    settle_sealed(&config, holder, commit, response, route, answer).await;
                }
                None => settle_response(config, holder, response, answer).await,
            }
        };
        match self.engine.run_claimed(holder, recovery, handler, settle).await {
            Ended::Answered(response) => Ok(response),
            Ended::Failed(error) => Err(error),
            Ended::Refused => Ok(problem_retry_after(
                StatusCode::SERVICE_UNAVAILABLE,
                ProblemType::RecoveryFailed,
                None,
                1,
            )),
            Ended::Mismatch => {
                Ok(problem(self.config.mismatch_status, ProblemType::Mismatch, None))
            }
            Ended::Cancelled => {
                Ok(problem(StatusCode::SERVICE_UNAVAILABLE, ProblemType::HandlerFailed, None))
            }
        }
    }
}

/// Stores the response the recovery hook found, through the header filter as the handler's
/// would be, and answers it as a replay.
async fn settle_recovered<St: Store, E>(
    config: Arc<Config>,
    holder: Holder<St>,
    response: Response<Bytes>,
    (route, request, rebuild_timeout): (Arc<str>, http::HeaderMap, Duration),
    answer: Answer<Response, E>,
) {
    let (head, body) = response.into_parts();
    let blob = record::encode_response(&head, &config.header_filter, &body);
    let replay = Replay {
        config: &config,
        route: &route,
        request: &request,
        retention: holder.retention(),
        rebuild_timeout,
    };
    let response = replay.replay(blob.clone(), holder.key().hash()).await;
    holder.complete(blob, move || answer.send(response)).await;
}

/// Step 7: the handler's response is stored (whole, or streamed through), or its key
/// released when the store policy or a limit says so.
async fn settle_response<St: Store, E, ResBody>(
    config: Arc<Config>,
    holder: Holder<St>,
    response: Response<ResBody>,
    answer: Answer<Response, E>,
) where
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let (head, body) = response.into_parts();
    let body = Body::new(body);
    match not_stored(&config, &head, &body) {
        Some(NotStored::Policy(why)) => {
            holder.release(why).await;
            return answer.send(Response::from_parts(head, body));
        }
        Some(NotStored::TooLarge(why)) => {
            let record = record::not_replayable(head.status, why);
            let answered = move || answer.send(Response::from_parts(head, body));
            return holder.complete_too_large(record, why, answered).await;
        }
        None => {}
    }
    // Stored minimally: the record needs nothing of the body, which streams to the client
    // whatever its size.
    if head.extensions.get::<Minimal>().is_some() {
        let blob = record::encode_response(&head, &config.header_filter, &[]);
        let mut head = head;
        let expiry = config.advertise_expiry.then(|| holder.retention());
        record::advertise_expiry(&mut head.headers, SystemTime::now(), expiry);
        return holder.complete(blob, move || answer.send(Response::from_parts(head, body))).await;
    }
    // A body of known size is read whole and stored before the client gets it, so that the
    // client's own next retry finds the record. Any other body streams through.
    if body.size_hint().exact().is_some() {
        settle_whole(&config, holder, head, body, answer).await;
    } else {
        settle_streamed(&config, holder, head, body, answer).await;
    }
}

async fn settle_whole<St: Store, E>(
    config: &Config,
    holder: Holder<St>,
    head: http::response::Parts,
    body: Body,
    answer: Answer<Response, E>,
) {
    let body = match collect_response(body, config.stored_body_limit).await {
        CollectedBody::Whole(body) => body,
        CollectedBody::TooLarge(body) => {
            let record = record::not_replayable(head.status, OVER_BODY_LIMIT);
            let answered = move || answer.send(Response::from_parts(head, body));
            return holder.complete_too_large(record, OVER_BODY_LIMIT, answered).await;
        }
        CollectedBody::Failed(error) => {
            tracing::error!(key_hash = holder.key().hash(), error = %error, "idempotency: response body failed");
            holder.release("the response body failed").await;
            return answer.send(problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                ProblemType::HandlerFailed,
                None,
            ));
        }
    };
    let mut head = head;
    let blob = record::encode(head.status, &head.headers, &config.header_filter, &body);
    let expiry = config.advertise_expiry.then(|| holder.retention());
    record::advertise_expiry(&mut head.headers, SystemTime::now(), expiry);
    holder.complete(blob, move || answer.send(Response::from_parts(head, Body::from(body)))).await;
}

/// Sends the head at once and every frame as the handler produces it; stores the copy when
/// the stream ends within the limit, and releases the key otherwise.
async fn settle_streamed<St: Store, E>(
    config: &Config,
    holder: Holder<St>,
    head: http::response::Parts,
    body: Body,
    answer: Answer<Response, E>,
) {
    let (status, headers) = (head.status, head.headers.clone());
    // Stored when the stream ends within the limit: from now, within the stream's time.
    let mut head = head;
    let expiry = config.advertise_expiry.then(|| holder.retention());
    record::advertise_expiry(&mut head.headers, SystemTime::now(), expiry);
    let (client, streamed) = Streamed::channel();
    answer.send(Response::from_parts(head, Body::new(streamed)));
    // The lease is renewed while the stream runs, as while the handler ran.
    let (holder, teed) = match holder.run(tee(body, &client, config.stored_body_limit)).await {
        Ok(teed) => teed,
        Err(_panic) => {
            return tracing::error!("idempotency: the response body panicked; key released");
        }
    };
    match teed {
        Teed::Whole(copy) => {
            let blob = record::encode(status, &headers, &config.header_filter, &copy);
            holder.complete(blob, || {}).await;
        }
        Teed::OverLimit(rest) => {
            // The client gets the whole stream first: the settle does not hold it up.
            let forwarded = forward(rest, &client);
            let record = record::not_replayable(status, OVER_BODY_LIMIT);
            let settled = holder.complete_too_large(record, OVER_BODY_LIMIT, || {});
            futures_util::future::join(forwarded, settled).await;
        }
        Teed::Failed(error) => {
            tracing::error!(key_hash = holder.key().hash(), %error, "idempotency: response body failed");
            holder.release("the response body failed").await;
        }
    }
}

/// The `outcome` field of the request's span.
fn outcome_name<St: Store>(claimed: &Result<Claimed<St>, StoreError>) -> &'static str {
    match claimed {
        Ok(Claimed::Run(holder)) if holder.taken_over() => "taken_over",
        Ok(Claimed::Run(_)) => "claimed",
        Ok(Claimed::Replay(_)) => "replayed",
        Ok(Claimed::InProgress { .. }) => "in_progress",
        Ok(Claimed::Mismatch) => "mismatch",
        Err(error) if error.is_unavailable() => "store_unavailable",
        Err(_) => "corrupt_record",
    }
}

fn store_error_response(error: &StoreError, hash: &str) -> Response {
    if error.is_unavailable() {
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
