//! [`Idempotency`]: the request path.
//!
//! 1. filter: methods not made idempotent, and requests without a key, pass through.
//! 2. key: parse and validate the key header.
//! 3. scope: find whose key it is.
//! 4. body + fingerprint: buffer the body once, with a limit, and hash the request.
//! 5. claim: one store call decides: run, replay, wait, or mismatch.
//! 6. inner service: run the handler with the rebuilt request.
//! 7. settle: store the response, or release the key so a retry can run.
//!
//! Steps 6 and 7 run in a task of their own, so a client that goes away while its handler runs
//! neither cancels the handler nor leaves its key claimed until the lease ends. A request
//! dropped during step 5 releases whatever its claim may have taken.

use std::{
    any::Any,
    collections::VecDeque,
    fmt,
    future::Future,
    panic::AssertUnwindSafe,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use axum::{
    body::Body,
    extract::OriginalUri,
    response::{IntoResponse, Response},
};
use bytes::{Bytes, BytesMut};
use futures_util::FutureExt as _;
use http::{HeaderValue, Request, StatusCode, header, request::Parts};
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tokio::sync::oneshot;
use tower::ServiceExt as _;
use tower_service::Service;

use crate::{
    fingerprint::Fingerprint,
    key::{RecordKey, parse_key},
    layer::Config,
    problem::{ProblemType, problem, problem_retry_after},
    record,
    scope::ScopeExtractor,
    store::{Claim, Fenced, OwnerToken, Store, StoreError},
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The header that marks a replayed response.
pub const REPLAYED_HEADER: &str = "idempotency-replayed";

/// How long a client is told to wait when the store is unavailable.
const UNAVAILABLE_RETRY_AFTER_SECS: u64 = 1;

/// How often, and how far apart, a failed `complete` or `release` is tried again, in the
/// background.
const SETTLE_RETRIES: [Duration; 3] =
    [Duration::from_millis(50), Duration::from_millis(200), Duration::from_millis(800)];

/// The middleware made by [`IdempotencyLayer`](crate::IdempotencyLayer).
#[derive(Clone)]
pub struct Idempotency<S, St, Sc> {
    inner: S,
    store: St,
    scope: Sc,
    config: Arc<Config>,
}

impl<S, St, Sc> Idempotency<S, St, Sc> {
    pub(crate) fn from_parts(inner: S, store: St, scope: Sc, config: Arc<Config>) -> Self {
        Self { inner, store, scope, config }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes the middleware, returning the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: fmt::Debug, St: fmt::Debug, Sc: fmt::Debug> fmt::Debug for Idempotency<S, St, Sc> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .field("store", &self.store)
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
        let key = if self.config.methods.contains(req.method()) {
            parse_key(req.headers(), &self.config.header)
        } else {
            Ok(None)
        };
        let key = match key {
            Ok(Some(key)) => key,
            Ok(None) if !self.config.require_key || !self.config.methods.contains(req.method()) => {
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
            store: self.store.clone(),
            scope: self.scope.clone(),
            config: self.config.clone(),
        };
        ResponseFuture::handled(Box::pin(request.handle(req, key)))
    }
}

/// A request that carries a valid key, with what it needs to be handled.
struct KeyedRequest<S, St, Sc> {
    inner: S,
    store: St,
    scope: Sc,
    config: Arc<Config>,
}

/// How a claimed request ended, as sent from its task to the response future.
enum Finished<E> {
    Response(Response),
    Error(E),
    Panic(Box<dyn Any + Send>),
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
    async fn handle<ReqBody>(
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
        let fingerprint = Fingerprint::new(parts.method.as_str(), uri.path(), query, &body);

        // 5. claim. A request dropped while its claim is on the wire, or whose claim timed out,
        // may own the key without knowing it: the guard releases what its token may hold.
        let owner = OwnerToken::random();
        let config = &self.config;
        let hash = record_key.hash();
        let claim = {
            let mut guard = UnsettledClaim::new(&self.store, &record_key, &owner);
            let claim = self.store.claim(&record_key, &fingerprint, &owner, config.lease).await;
            if !matches!(&claim, Err(error) if error.is_unavailable()) {
                guard.disarm();
            }
            claim
        };
        match claim {
            Ok(Claim::Claimed) => tracing::debug!(key_hash = hash, "idempotency: claimed"),
            Ok(Claim::Replay(blob)) => return Ok(replay(blob, hash)),
            Ok(Claim::InProgress { remaining }) => {
                tracing::debug!(key_hash = hash, ?remaining, "idempotency: in progress");
                let seconds = remaining.as_millis().div_ceil(1000).max(1);
                return Ok(problem_retry_after(
                    config.in_progress_status,
                    ProblemType::InProgress,
                    None,
                    u64::try_from(seconds).unwrap_or(u64::MAX),
                ));
            }
            Ok(Claim::Mismatch) => {
                tracing::info!(key_hash = hash, "idempotency: key reused with a different request");
                return Ok(problem(config.mismatch_status, ProblemType::Mismatch, None));
            }
            Err(error) if error.is_unavailable() && config.fail_open => {
                tracing::warn!(key_hash = hash, %error, "idempotency: store unavailable; running without idempotency (fail open)");
                let request = Request::from_parts(parts, Body::from(body));
                return self.inner.oneshot(request).await.map(|response| response.map(Body::new));
            }
            Err(error) => return Ok(store_error_response(&error, hash)),
        }

        // 6 and 7 in a task of their own: see the module docs.
        let (finished_tx, finished_rx) = oneshot::channel();
        let tasks = self.config.tasks.clone();
        // Boxed here, so that this future does not carry the task's state inline.
        let task =
            Box::pin(self.run_claimed(record_key, fingerprint, owner, parts, body, finished_tx));
        match tasks {
            Some(tracker) => drop(tracker.spawn(task)),
            None => drop(tokio::spawn(task)),
        }
        match finished_rx.await {
            Ok(Finished::Response(response)) => Ok(response),
            Ok(Finished::Error(error)) => Err(error),
            Ok(Finished::Panic(payload)) => std::panic::resume_unwind(payload),
            // The task was dropped unfinished: the runtime is shutting down.
            Err(_) => {
                Ok(problem(StatusCode::SERVICE_UNAVAILABLE, ProblemType::HandlerFailed, None))
            }
        }
    }

    async fn run_claimed(
        self,
        record_key: RecordKey,
        fingerprint: Fingerprint,
        owner: OwnerToken,
        parts: Parts,
        body: Bytes,
        finished: oneshot::Sender<Finished<S::Error>>,
    ) {
        let config = &self.config;
        let hash = record_key.hash();

        // 6. inner service. A panic is caught here only to release the key; it is then
        // resumed in the response future, as if the layer were not there.
        let request = Request::from_parts(parts, Body::from(body));
        let handler = AssertUnwindSafe(self.inner.oneshot(request)).catch_unwind();
        let outcome = match config.keep_alive {
            Some(ceiling) => {
                keep_alive(handler, &self.store, &record_key, &owner, config.lease, ceiling).await
            }
            None => handler.await,
        };
        let response = match outcome {
            Ok(Ok(response)) => response,
            Ok(Err(error)) => {
                release(&self.store, &record_key, &owner, "the inner service failed").await;
                let _ = finished.send(Finished::Error(error));
                return;
            }
            Err(payload) => {
                release(&self.store, &record_key, &owner, "the handler panicked").await;
                let _ = finished.send(Finished::Panic(payload));
                return;
            }
        };

        // 7. settle
        let (head, body) = response.into_parts();
        if !(config.store_policy)(head.status) {
            release(&self.store, &record_key, &owner, "the status is not stored").await;
            let _ = finished.send(Finished::Response(Response::from_parts(head, Body::new(body))));
            return;
        }
        let body = match collect_response(body, config.stored_body_limit).await {
            CollectedBody::Whole(body) => body,
            CollectedBody::TooLarge(body) => {
                release(
                    &self.store,
                    &record_key,
                    &owner,
                    "the response is over the stored body limit",
                )
                .await;
                let _ = finished.send(Finished::Response(Response::from_parts(head, body)));
                return;
            }
            CollectedBody::Failed(error) => {
                tracing::error!(key_hash = hash, error = %error, "idempotency: response body failed");
                release(&self.store, &record_key, &owner, "the response body failed").await;
                let response =
                    problem(StatusCode::INTERNAL_SERVER_ERROR, ProblemType::HandlerFailed, None);
                let _ = finished.send(Finished::Response(response));
                return;
            }
        };
        let blob = record::encode(head.status, &head.headers, &config.header_filter, &body);
        let first = self
            .store
            .complete(&record_key, &owner, &fingerprint, blob.clone(), config.retention)
            .await;
        let _ = finished.send(Finished::Response(Response::from_parts(head, Body::from(body))));
        match first {
            Ok(Fenced::Applied) => tracing::debug!(key_hash = hash, "idempotency: completed"),
            Ok(Fenced::Rejected) => tracing::warn!(
                key_hash = hash,
                "idempotency: lease lapsed and the key was taken over; response not stored"
            ),
            Err(error) => {
                // The client has its response; keep trying to store it, so that a retry is
                // replayed rather than run again.
                tracing::warn!(key_hash = hash, %error, "idempotency: storing the response failed; retrying");
                let stored = retry_settle(|| {
                    self.store.complete(
                        &record_key,
                        &owner,
                        &fingerprint,
                        blob.clone(),
                        config.retention,
                    )
                })
                .await;
                if let Some(outcome) = stored {
                    tracing::info!(
                        key_hash = hash,
                        ?outcome,
                        "idempotency: store answered on retry"
                    );
                    return;
                }
                tracing::error!(
                    key_hash = hash,
                    %error,
                    "idempotency: the response could not be stored; a retry after the lease ends will run the handler again"
                );
            }
        }
    }
}

/// Releases, on drop, a claim whose outcome its request never saw: the request was dropped
/// mid-claim, or the store did not answer in time.
struct UnsettledClaim<'a, St: Store> {
    armed: Option<(&'a St, &'a RecordKey, &'a OwnerToken)>,
}

impl<'a, St: Store> UnsettledClaim<'a, St> {
    fn new(store: &'a St, key: &'a RecordKey, owner: &'a OwnerToken) -> Self {
        Self { armed: Some((store, key, owner)) }
    }

    fn disarm(&mut self) {
        self.armed = None;
    }
}

impl<St: Store> Drop for UnsettledClaim<'_, St> {
    fn drop(&mut self) {
        if let Some((store, key, owner)) = self.armed.take() {
            let (store, key, owner) = (store.clone(), key.clone(), owner.clone());
            // Fenced by the token: deletes the record only if this request's claim landed.
            drop(tokio::spawn(async move {
                release(&store, &key, &owner, "the claim's outcome is unknown").await;
            }));
        }
    }
}

/// Runs `handler`, renewing the lease every third of a lease until it finishes, the key is
/// lost, or `ceiling` has passed since the claim.
async fn keep_alive<St: Store, T>(
    handler: impl Future<Output = T>,
    store: &St,
    key: &RecordKey,
    owner: &OwnerToken,
    lease: Duration,
    ceiling: Duration,
) -> T {
    let period = (lease / 3).max(Duration::from_millis(1));
    let give_up_at = tokio::time::Instant::now() + ceiling;
    let mut renewals = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    renewals.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut renewing = true;
    tokio::pin!(handler);
    loop {
        tokio::select! {
            biased;
            output = &mut handler => return output,
            now = renewals.tick(), if renewing => {
                if now >= give_up_at {
                    tracing::warn!(key_hash = key.hash(), "idempotency: keep-alive ceiling reached; the lease will lapse");
                    renewing = false;
                    continue;
                }
                match store.touch(key, owner, lease).await {
                    Ok(Fenced::Applied) => {}
                    Ok(Fenced::Rejected) => {
                        tracing::warn!(key_hash = key.hash(), "idempotency: lease lost to another request");
                        renewing = false;
                    }
                    // The next tick tries again; the lease has two more periods to run.
                    Err(error) => tracing::warn!(key_hash = key.hash(), %error, "idempotency: lease renewal failed"),
                }
            }
        }
    }
}

/// Buffers the request body, answering 413 for one over `limit` (before reading a byte when
/// `Content-Length` says so).
async fn read_body<B>(parts: &Parts, body: B, limit: usize) -> Result<Bytes, Response>
where
    B: HttpBody<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let too_large = || {
        problem(
            StatusCode::PAYLOAD_TOO_LARGE,
            ProblemType::BodyTooLarge,
            Some(&format!("the limit is {limit} bytes")),
        )
    };
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64)
        || body.size_hint().lower() > limit as u64
    {
        return Err(too_large());
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.is::<LengthLimitError>() => Err(too_large()),
        Err(_) => Err(problem(StatusCode::BAD_REQUEST, ProblemType::BodyUnreadable, None)),
    }
}

fn replay(blob: Bytes, hash: &str) -> Response {
    match record::decode(blob) {
        Ok(stored) => {
            tracing::debug!(key_hash = hash, "idempotency: replayed");
            let mut response = Response::new(Body::from(stored.body));
            *response.status_mut() = stored.status;
            *response.headers_mut() = stored.headers;
            response.headers_mut().insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
            response
        }
        Err(error) => {
            tracing::error!(
                key_hash = hash,
                reason = error.0,
                "idempotency: stored response is unreadable"
            );
            problem(StatusCode::INTERNAL_SERVER_ERROR, ProblemType::CorruptRecord, None)
        }
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

/// Releases the key if `owner` still holds it. A release the store fails is tried again in
/// the background (fenced, so a late one cannot delete another owner's record).
async fn release<St: Store>(store: &St, key: &RecordKey, owner: &OwnerToken, why: &'static str) {
    let hash = key.hash();
    let error = match store.release(key, owner).await {
        Ok(Fenced::Applied) => {
            return tracing::debug!(key_hash = hash, why, "idempotency: released");
        }
        Ok(Fenced::Rejected) => {
            return tracing::debug!(
                key_hash = hash,
                why,
                "idempotency: nothing to release: the key is not held by this request"
            );
        }
        Err(error) => error,
    };
    tracing::warn!(key_hash = hash, why, %error, "idempotency: release failed; retrying");
    let (store, key, owner) = (store.clone(), key.clone(), owner.clone());
    drop(tokio::spawn(async move {
        if let Some(outcome) = retry_settle(|| store.release(&key, &owner)).await {
            return tracing::info!(
                key_hash = key.hash(),
                why,
                ?outcome,
                "idempotency: store answered the release on retry"
            );
        }
        tracing::error!(
            key_hash = key.hash(),
            why,
            %error,
            "idempotency: release failed; the key stays claimed until its lease ends"
        );
    }));
}

/// Tries a fenced write (`complete`, `release`) again after each of [`SETTLE_RETRIES`], until
/// the store answers. `None` when it never did.
async fn retry_settle<F, Fut>(mut attempt: F) -> Option<Fenced>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Fenced, StoreError>>,
{
    for delay in SETTLE_RETRIES {
        tokio::time::sleep(delay).await;
        if let Ok(outcome) = attempt().await {
            return Some(outcome);
        }
    }
    None
}

enum CollectedBody {
    Whole(Bytes),
    /// Over the limit: what was read, followed by the rest, unread.
    TooLarge(Body),
    Failed(BoxError),
}

/// Reads a response body up to `limit` bytes without losing what is read when it is larger.
async fn collect_response<B>(body: B, limit: usize) -> CollectedBody
where
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let mut body = Body::new(body);
    if body.size_hint().lower() > limit as u64 {
        return CollectedBody::TooLarge(body);
    }
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut read = 0usize;
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(error) => return CollectedBody::Failed(error.into()),
        };
        // Trailers are not stored: a replay has none.
        let Ok(data) = frame.into_data() else { continue };
        read += data.len();
        chunks.push(data);
        if read > limit {
            return CollectedBody::TooLarge(Body::new(Prefixed {
                read: chunks.into(),
                rest: body,
            }));
        }
    }
    CollectedBody::Whole(match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.pop().unwrap_or_default(),
        _ => {
            let mut whole = BytesMut::with_capacity(read);
            for chunk in chunks {
                whole.extend_from_slice(&chunk);
            }
            whole.freeze()
        }
    })
}

/// A body that yields chunks already read, then the rest of the original body.
struct Prefixed {
    read: VecDeque<Bytes>,
    rest: Body,
}

impl HttpBody for Prefixed {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Some(chunk) = self.read.pop_front() {
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }

    fn size_hint(&self) -> SizeHint {
        let read: u64 = self.read.iter().map(|chunk| chunk.len() as u64).sum();
        let rest = self.rest.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower() + read);
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper + read);
        }
        hint
    }
}

pin_project_lite::pin_project! {
    /// The response future of [`Idempotency`].
    pub struct ResponseFuture<F, E> {
        #[pin]
        kind: Kind<F, E>,
    }
}

pin_project_lite::pin_project! {
    #[project = KindProj]
    enum Kind<F, E> {
        PassThrough { #[pin] future: F },
        Ready { response: Option<Response> },
        Handled { future: Pin<Box<dyn Future<Output = Result<Response, E>> + Send>> },
    }
}

impl<F, E> ResponseFuture<F, E> {
    fn pass_through(future: F) -> Self {
        Self { kind: Kind::PassThrough { future } }
    }

    fn ready(response: Response) -> Self {
        Self { kind: Kind::Ready { response: Some(response) } }
    }

    fn handled(future: Pin<Box<dyn Future<Output = Result<Response, E>> + Send>>) -> Self {
        Self { kind: Kind::Handled { future } }
    }
}

impl<F, E> fmt::Debug for ResponseFuture<F, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<F, E, ResBody> Future for ResponseFuture<F, E>
where
    F: Future<Output = Result<Response<ResBody>, E>>,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Output = Result<Response, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::PassThrough { future } => {
                future.poll(cx).map(|result| result.map(|response| response.map(Body::new)))
            }
            KindProj::Ready { response } => Poll::Ready(Ok(response
                .take()
                .unwrap_or_else(|| StatusCode::INTERNAL_SERVER_ERROR.into_response()))),
            KindProj::Handled { future } => future.as_mut().poll(cx),
        }
    }
}
