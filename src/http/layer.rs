//! [`IdempotencyLayer`]: the builder.

use std::{sync::Arc, time::Duration};

use http::{HeaderName, Method, StatusCode};
use tokio_util::task::TaskTracker;
use tower_layer::Layer;

use super::{
    config::{Config, StorePolicy},
    recover::Hook,
    scope::{GlobalScope, ScopeExtractor},
    service::Idempotency,
};
use crate::{
    engine::{Engine, Settings},
    store::Store,
};

/// Makes POST and PATCH requests that carry an `Idempotency-Key` idempotent.
///
/// The first request with a key runs the inner service and its response is stored; a retry
/// with the same key and the same request gets the stored response back with
/// `Idempotency-Replayed: true`. While the first request runs, a retry gets 202 with
/// `Retry-After`; the same key with a different request gets 409. Every other request passes
/// through untouched, with no store call and no body buffering.
///
/// ```
/// use axum::{Router, routing::post};
/// use axum_idempotency::{IdempotencyLayer, MemoryStore};
///
/// async fn create_payment() -> &'static str { "paid" }
///
/// let app: Router = Router::new()
///     .route("/payments", post(create_payment))
///     .layer(IdempotencyLayer::new(MemoryStore::new()));
/// ```
///
/// With Redis, every instance of the service shares the records:
///
/// ```no_run
/// use axum_idempotency::{IdempotencyLayer, RedisStore};
///
/// let store = RedisStore::from_url("redis://127.0.0.1:6379").expect("a valid Redis URL");
/// let layer = IdempotencyLayer::new(store);
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct IdempotencyLayer<St, Sc = GlobalScope> {
    store: St,
    scope: Sc,
    config: Arc<Config>,
    settings: Arc<Settings>,
}

impl<St: Store> IdempotencyLayer<St> {
    /// A layer keeping its records in `store`, with the default settings and [`GlobalScope`].
    pub fn new(store: St) -> Self {
        Self {
            store,
            scope: GlobalScope,
            config: Arc::new(Config::default()),
            settings: Arc::new(Settings::default()),
        }
    }
}

impl<St, Sc> IdempotencyLayer<St, Sc> {
    fn config(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.config)
    }

    fn settings(&mut self) -> &mut Settings {
        Arc::make_mut(&mut self.settings)
    }

    /// Sets how a request's scope is found (see [`ScopeExtractor`]). Defaults to
    /// [`GlobalScope`].
    pub fn scope<Sc2: ScopeExtractor>(self, scope: Sc2) -> IdempotencyLayer<St, Sc2> {
        IdempotencyLayer { store: self.store, scope, config: self.config, settings: self.settings }
    }

    /// Sets the methods made idempotent. Defaults to POST and PATCH.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config().methods = methods.into_iter().collect();
        self
    }

    /// Sets the name of the key header. Defaults to `Idempotency-Key`.
    pub fn header_name(mut self, name: HeaderName) -> Self {
        self.config().header = name;
        self
    }

    /// Answers a request without a key with 400 instead of passing it through. Defaults to
    /// `false`. Use it with `route_layer` on the routes that must have a key.
    pub fn require_key(mut self, require: bool) -> Self {
        self.config().require_key = require;
        self
    }

    /// Sets the prefix of every record key in the store. Defaults to `idempotency`.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.config().prefix = prefix.into();
        self
    }

    /// Sets the largest request body buffered, in bytes; a larger one gets 413. Defaults to
    /// 1 MiB.
    pub fn body_limit(mut self, bytes: usize) -> Self {
        self.config().body_limit = bytes;
        self
    }

    /// Sets the largest response body stored for replay, in bytes. A larger response is sent
    /// to the client and its key released, so a retry runs the handler again. Defaults to
    /// 1 MiB.
    pub fn stored_body_limit(mut self, bytes: usize) -> Self {
        self.config().stored_body_limit = bytes;
        self
    }

    /// Sets the largest response header section stored for replay, in bytes (names and
    /// values of the headers kept, plus 6 bytes each). A response with more is sent to the
    /// client and its key released, like one over the
    /// [`stored_body_limit`](Self::stored_body_limit): a stored record is at most the sum of
    /// the two. Defaults to 64 KiB.
    pub fn stored_headers_limit(mut self, bytes: usize) -> Self {
        self.config().stored_headers_limit = bytes;
        self
    }

    /// Fingerprints a JSON body in its RFC 8785 canonical form (JCS, by
    /// `serde_json_canonicalizer`): member order, whitespace and number form do not make a
    /// retry another request. A body that is not JSON is fingerprinted as its bytes. Numbers
    /// are IEEE 754 doubles, as RFC 8785 says: integers beyond 2^53 that differ only past a
    /// double's precision fingerprint alike; send such values as strings. Defaults to `false`
    /// (the bytes as sent).
    pub fn canonical_json(mut self, canonical: bool) -> Self {
        self.config().intent.canonical_json = canonical;
        self
    }

    /// Leaves the JSON member that `pointer` (RFC 6901, such as `/client_sent_at`) names out
    /// of the fingerprint, so that a volatile field does not make every retry a mismatch.
    /// Turns [`canonical_json`](Self::canonical_json) on.
    pub fn ignore_json_member(mut self, pointer: impl Into<String>) -> Self {
        let intent = &mut self.config().intent;
        intent.canonical_json = true;
        intent.ignored_members.push(pointer.into());
        self
    }

    /// Makes a request header part of the fingerprint (an API version, `Content-Type`): a
    /// retry with another value, or without the header, is another request.
    pub fn fingerprint_header(mut self, name: HeaderName) -> Self {
        self.config().intent.headers.push(name);
        self
    }

    /// Fingerprints requests with the app's own function instead (see [`MakeFingerprint`]);
    /// the other fingerprint options no longer apply.
    ///
    /// [`MakeFingerprint`]: crate::MakeFingerprint
    pub fn fingerprint_with(mut self, make: impl crate::MakeFingerprint) -> Self {
        self.config().intent.custom = Some(Arc::new(make));
        self
    }

    /// Sets how long a claim holds its key without renewal. While the handler runs, keep-alive
    /// renews the lease (see [`keep_alive`](Self::keep_alive)); a holder that stops renewing,
    /// because its process died, frees the key within one lease. Defaults to 30 seconds.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.settings().lease = lease;
        self
    }

    /// Sets how long a completed response is kept for replay. Defaults to 24 hours.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.settings().retention = retention;
        self
    }

    /// Lets a retry whose original is still running wait up to `wait` for it to settle, and
    /// answer with its stored response (or run, when the original released the key: a 5xx, a
    /// panic). Past the wait, the answer is the in-progress one. Off by default.
    ///
    /// Recommended behind clients that take any 2xx as the final answer (Stripe's SDKs, most
    /// HTTP clients' retry middleware): they would take the 202 as the created resource. Waiting
    /// never polls: the settle wakes the waiters (in process for `MemoryStore`; Redis pub/sub on
    /// one connection per store for `RedisStore`, sharded on a Cluster).
    ///
    /// ```
    /// use std::time::Duration;
    /// use axum_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .wait_for_in_progress(Duration::from_secs(10));
    /// ```
    pub fn wait_for_in_progress(mut self, wait: Duration) -> Self {
        self.settings().wait = Some(wait);
        self
    }

    /// Sets how many requests may wait at once ([`wait_for_in_progress`](Self::wait_for_in_progress));
    /// past it a retry is answered at once. Defaults to 1024.
    pub fn max_waiters(mut self, waiters: usize) -> Self {
        self.settings().waiters = Arc::new(tokio::sync::Semaphore::new(waiters));
        self
    }

    /// Sets the longest `Retry-After` sent with an in-progress answer; it is never more than
    /// the original's remaining lease, and at least one second. Defaults to 1 second.
    pub fn retry_after(mut self, hint: Duration) -> Self {
        self.settings().retry_after = hint;
        self
    }

    /// Sets the status of the answer to a retry whose original is still running. Defaults to
    /// 202 Accepted.
    pub fn in_progress_status(mut self, status: StatusCode) -> Self {
        self.config().in_progress_status = status;
        self
    }

    /// Sets the status of the answer to a key reused with a different request. Defaults to
    /// 409 Conflict.
    pub fn mismatch_status(mut self, status: StatusCode) -> Self {
        self.config().mismatch_status = status;
        self
    }

    /// The IETF draft's statuses (draft-ietf-httpapi-idempotency-key-header): 409 while the
    /// original request runs, 422 for a key reused with a different request.
    ///
    /// Prefer it behind clients that take any 2xx as final, as Stripe's SDKs do: they retry on
    /// 409, but take the default 202 as the answer.
    pub fn ietf_draft(self) -> Self {
        self.in_progress_status(StatusCode::CONFLICT)
            .mismatch_status(StatusCode::UNPROCESSABLE_ENTITY)
    }

    /// Sets which responses are stored for replay. Defaults to [`default_store_policy`](crate::default_store_policy).
    pub fn store_policy(mut self, policy: StorePolicy) -> Self {
        self.config().store_policy = policy;
        self
    }

    /// Leaves a response header out of stored responses. By default `Set-Cookie`, `Date`,
    /// `Content-Length` and the hop-by-hop headers are left out.
    pub fn exclude_replayed_header(mut self, name: HeaderName) -> Self {
        self.config().header_filter.exclude(name);
        self
    }

    /// Stores a response header that is left out by default, such as `Set-Cookie`.
    pub fn include_replayed_header(mut self, name: HeaderName) -> Self {
        self.config().header_filter.include(&name);
        self
    }

    /// Renews the lease every third of a lease from the claim to the settle (the recovery
    /// hook, the handler, the response body), for at most `ceiling` from the claim; `None`
    /// turns renewal off. A duration too long for the clock saturates. Past the ceiling, or
    /// without renewal, a
    /// handler that outlives its lease can be taken over by a retry, which then runs the
    /// handler again (the first holder's response is not stored). Defaults to 5 minutes.
    pub fn keep_alive(mut self, ceiling: Option<Duration>) -> Self {
        self.settings().keep_alive = ceiling;
        self
    }

    /// Spawns every claimed request's task on `tracker`, so that a server shutting down can
    /// wait for the handlers still running and the responses they store:
    ///
    /// ```
    /// use axum_idempotency::{IdempotencyLayer, MemoryStore};
    /// use tokio_util::task::TaskTracker;
    ///
    /// # async fn shutdown() {
    /// let tasks = TaskTracker::new();
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).task_tracker(tasks.clone());
    /// // ... serve with graceful shutdown, then:
    /// tasks.close();
    /// tasks.wait().await;
    /// # }
    /// ```
    ///
    /// Without it the tasks are plain `tokio::spawn` tasks. A claimed request runs in a task of
    /// its own either way, so that a client that goes away does not cancel its handler.
    pub fn task_tracker(mut self, tracker: TaskTracker) -> Self {
        self.settings().tasks = Some(tracker);
        self
    }

    /// Asks `hook` before a request runs again after a takeover: when a claim finds the same
    /// request's lease lapsed (its holder died, perhaps after its side effect committed), the
    /// hook looks the request up in the system of record. [`Recovered::Happened`] is stored and
    /// answered as a replay (`Idempotency-Replayed: true`) without running the handler;
    /// [`Recovered::Unknown`] runs it. A hook that fails, panics or times out
    /// ([`recovery_timeout`](Self::recovery_timeout)) is answered 503 problem+json
    /// (`recovery-failed`) and the handler does not run (see
    /// [`run_when_recovery_fails`](Self::run_when_recovery_fails)).
    ///
    /// The handler finds the [`IdempotencyContext`] in its request (an extractor): write its
    /// key hash with the outcome, in the transaction of the side effect, for the hook to find.
    /// A takeover is recognised within the [`recovery_window`](Self::recovery_window).
    ///
    /// ```
    /// use axum_idempotency::{IdempotencyContext, IdempotencyLayer, MemoryStore, recovery::{Lookup, Recovered}};
    /// use bytes::Bytes;
    /// use http::{Request, Response};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).recover(
    ///     |lookup: Lookup<Request<Bytes>>| async move {
    ///         // SELECT status, body FROM outbox WHERE key_hash = $1
    ///         let _ = lookup.context.key_hash();
    ///         Ok::<_, std::io::Error>(Recovered::<Response<Bytes>>::Unknown)
    ///     },
    /// );
    /// ```
    ///
    /// [`Recovered::Happened`]: crate::Recovered::Happened
    /// [`Recovered::Unknown`]: crate::Recovered::Unknown
    /// [`IdempotencyContext`]: crate::IdempotencyContext
    pub fn recover<H>(mut self, hook: H) -> Self
    where
        H: crate::Recover<http::Request<bytes::Bytes>, http::Response<bytes::Bytes>>,
    {
        self.config().recover = Some(Hook::new(hook));
        self.settings().recovering = true;
        self
    }

    /// Sets how long after its lease a lapsed claim is remembered, so that a retry in that
    /// window is a takeover and asks the [`recover`](Self::recover) hook. After it the record
    /// is gone and a retry runs as a new request. Defaults to the
    /// [`retention`](Self::retention). Only used with a hook.
    pub fn recovery_window(mut self, window: Duration) -> Self {
        self.settings().recovery.window = Some(window);
        self
    }

    /// Asks the [`recover`](Self::recover) hook on every claim, not only on a takeover: for a
    /// store that may lose records (Redis restarted without persistence, a failover that lost
    /// writes, a `MemoryStore` across a restart). Costs one hook lookup per new request.
    /// Off by default.
    pub fn recover_every_claim(mut self, every: bool) -> Self {
        self.settings().recovery.every_claim = every;
        self
    }

    /// Sets the longest the [`recover`](Self::recover) hook may take; past it, recovery has
    /// failed. Defaults to 5 seconds.
    pub fn recovery_timeout(mut self, timeout: Duration) -> Self {
        self.settings().recovery.timeout = timeout;
        self
    }

    /// When the [`recover`](Self::recover) hook fails, runs the handler anyway (logged at
    /// error level and counted) instead of answering 503. Defaults to `false`: a payment is
    /// better refused than run twice.
    pub fn run_when_recovery_fails(mut self, run: bool) -> Self {
        self.settings().recovery.run_on_failure = run;
        self
    }

    /// When the store is unavailable, runs the request without idempotency instead of
    /// answering 503. Defaults to `false` (fail closed): a payment is better refused than
    /// run twice.
    pub fn fail_open(mut self, fail_open: bool) -> Self {
        self.config().fail_open = fail_open;
        self
    }
}

impl<S, St: Store, Sc: Clone> Layer<S> for IdempotencyLayer<St, Sc> {
    type Service = Idempotency<S, St, Sc>;

    fn layer(&self, inner: S) -> Self::Service {
        let engine = Engine::new(self.store.clone(), self.settings.clone());
        Idempotency::from_parts(inner, engine, self.scope.clone(), self.config.clone())
    }
}
