//! [`IdempotencyLayer`]: the builder.

use std::{sync::Arc, time::Duration};

use http::{HeaderName, Method, StatusCode};
use tokio_util::task::TaskTracker;
use tower_layer::Layer;

use crate::{
    record::HeaderFilter,
    scope::{GlobalScope, ScopeExtractor},
    service::Idempotency,
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
}

/// Decides from the status whether a response is stored for replay (`true`) or the key is
/// released so that a retry runs the handler again (`false`).
pub type StorePolicy = fn(StatusCode) -> bool;

/// The default [`StorePolicy`]: store 2xx and 4xx, except 408 and 429; release on
/// everything else (5xx, 408, 429, 1xx, 3xx).
///
/// ```
/// use axum_idempotency::default_store_policy;
/// use http::StatusCode;
///
/// assert!(default_store_policy(StatusCode::CREATED));
/// assert!(default_store_policy(StatusCode::UNPROCESSABLE_ENTITY));
/// assert!(!default_store_policy(StatusCode::TOO_MANY_REQUESTS));
/// assert!(!default_store_policy(StatusCode::SERVICE_UNAVAILABLE));
/// ```
#[must_use]
pub fn default_store_policy(status: StatusCode) -> bool {
    (status.is_success() || status.is_client_error())
        && status != StatusCode::REQUEST_TIMEOUT
        && status != StatusCode::TOO_MANY_REQUESTS
}

#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) methods: Vec<Method>,
    pub(crate) header: HeaderName,
    pub(crate) require_key: bool,
    pub(crate) prefix: String,
    pub(crate) body_limit: usize,
    pub(crate) stored_body_limit: usize,
    pub(crate) lease: Duration,
    pub(crate) retention: Duration,
    pub(crate) in_progress_status: StatusCode,
    pub(crate) mismatch_status: StatusCode,
    pub(crate) store_policy: StorePolicy,
    pub(crate) header_filter: HeaderFilter,
    pub(crate) fail_open: bool,
    pub(crate) keep_alive: Option<Duration>,
    pub(crate) tasks: Option<TaskTracker>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            methods: vec![Method::POST, Method::PATCH],
            header: HeaderName::from_static("idempotency-key"),
            require_key: false,
            prefix: "idempotency".to_owned(),
            body_limit: 1024 * 1024,
            stored_body_limit: 1024 * 1024,
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(24 * 60 * 60),
            in_progress_status: StatusCode::ACCEPTED,
            mismatch_status: StatusCode::CONFLICT,
            store_policy: default_store_policy,
            header_filter: HeaderFilter::default(),
            fail_open: false,
            keep_alive: Some(Duration::from_secs(5 * 60)),
            tasks: None,
        }
    }
}

impl<St: Store> IdempotencyLayer<St> {
    /// A layer keeping its records in `store`, with the default settings and [`GlobalScope`].
    pub fn new(store: St) -> Self {
        Self { store, scope: GlobalScope, config: Arc::new(Config::default()) }
    }
}

impl<St, Sc> IdempotencyLayer<St, Sc> {
    fn config(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.config)
    }

    /// Sets how a request's scope is found (see [`ScopeExtractor`]). Defaults to
    /// [`GlobalScope`].
    pub fn scope<Sc2: ScopeExtractor>(self, scope: Sc2) -> IdempotencyLayer<St, Sc2> {
        IdempotencyLayer { store: self.store, scope, config: self.config }
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

    /// Sets how long a claim holds its key without renewal. While the handler runs, keep-alive
    /// renews the lease (see [`keep_alive`](Self::keep_alive)); a holder that stops renewing,
    /// because its process died, frees the key within one lease. Defaults to 30 seconds.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.config().lease = lease;
        self
    }

    /// Sets how long a completed response is kept for replay. Defaults to 24 hours.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.config().retention = retention;
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

    /// Sets which responses are stored for replay. Defaults to [`default_store_policy`].
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

    /// Renews the lease of a running handler every third of a lease, for at most `ceiling`
    /// from the claim; `None` turns renewal off. Past the ceiling, or without renewal, a
    /// handler that outlives its lease can be taken over by a retry, which then runs the
    /// handler again (the first holder's response is not stored). Defaults to 5 minutes.
    pub fn keep_alive(mut self, ceiling: Option<Duration>) -> Self {
        self.config().keep_alive = ceiling;
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
        self.config().tasks = Some(tracker);
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

impl<S, St: Clone, Sc: Clone> Layer<S> for IdempotencyLayer<St, Sc> {
    type Service = Idempotency<S, St, Sc>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::from_parts(inner, self.store.clone(), self.scope.clone(), self.config.clone())
    }
}
