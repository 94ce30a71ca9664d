//! [`IdempotencyLayer`]: the builder.

use std::sync::Arc;

use http::{HeaderName, Method, StatusCode};
use tower_layer::Layer;

use super::{
    config::Config,
    operator::Operator,
    recover::Hook,
    scope::{GlobalScope, ScopeExtractor},
    service::Idempotency,
    store_policy::Policy,
};
use crate::{
    engine::{
        DEFAULT_HTTP_LEASE, DEFAULT_HTTP_WAIT, Engine, RenewalsCell, Settings, engine_setters,
    },
    fingerprint::{PayloadRules, payload_rule_setters},
    store::{Admin, Store},
};

/// Makes POST and PATCH requests that carry an `Idempotency-Key` idempotent.
///
/// The first request with a key runs the inner service and its response is stored; a retry
/// with the same key and the same request gets the stored response back with
/// `Idempotency-Replayed: true`. While the first request runs, a retry waits for it (10 s by
/// default) and gets its response; the same key with a different request gets 409. Every other
/// request passes through untouched, with no store call and no body buffering.
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
/// # #[cfg(feature = "redis")] {
/// use axum_idempotency::{IdempotencyLayer, RedisStore};
///
/// let store = RedisStore::from_url("redis://127.0.0.1:6379").expect("a valid Redis URL");
/// let layer = IdempotencyLayer::new(store);
/// # }
/// ```
///
#[doc = include_str!("../docs/answers.md")]
#[doc = ""]
#[doc = include_str!("../docs/configuration.md")]
#[derive(Debug, Clone)]
#[must_use]
pub struct IdempotencyLayer<St, Sc = GlobalScope> {
    store: St,
    scope: Sc,
    config: Arc<Config>,
    settings: Arc<Settings>,
    /// Where the leases of the claims of every service this layer wraps are renewed.
    renewals: RenewalsCell<St>,
}

impl<St: Store> IdempotencyLayer<St> {
    /// A layer keeping its records in `store`, with the default settings and [`GlobalScope`].
    pub fn new(store: St) -> Self {
        Self {
            store,
            scope: GlobalScope,
            config: Arc::new(Config::default()),
            settings: Arc::new(Settings {
                lease: DEFAULT_HTTP_LEASE,
                wait: Some(DEFAULT_HTTP_WAIT),
                ..Settings::default()
            }),
            renewals: RenewalsCell::default(),
        }
    }
}

impl<St, Sc> IdempotencyLayer<St, Sc> {
    fn config(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.config)
    }

    fn payload_rules(&mut self) -> &mut PayloadRules {
        &mut self.config().intent.payload
    }

    fn settings(&mut self) -> &mut Settings {
        // New settings, new renewals: a lease changed after a claim is renewed as set.
        self.renewals = RenewalsCell::default();
        Arc::make_mut(&mut self.settings)
    }

    engine_setters!();

    /// Sets how a request's scope is found (see [`ScopeExtractor`]). Defaults to
    /// [`GlobalScope`].
    pub fn scope<Sc2: ScopeExtractor>(self, scope: Sc2) -> IdempotencyLayer<St, Sc2> {
        let Self { store, config, settings, renewals, .. } = self;
        IdempotencyLayer { store, scope, config, settings, renewals }
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

    payload_rule_setters!();

    /// Makes a request header part of the fingerprint (an API version, `Content-Type`): a
    /// retry with another value, or without the header, is another request.
    pub fn fingerprint_header(mut self, name: HeaderName) -> Self {
        self.config().intent.headers.push(name);
        self
    }

    /// Fingerprints requests with the app's own function instead (see [`MakeFingerprint`]);
    /// the other fingerprint options no longer apply.
    ///
    /// [`MakeFingerprint`]: crate::http::MakeFingerprint
    pub fn fingerprint_with(mut self, make: impl super::fingerprinting::MakeFingerprint) -> Self {
        self.config().intent.custom = Some(Arc::new(make));
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
    /// original request runs (past the wait), 422 for a key reused with a different request.
    /// It sets these two statuses and nothing else: every other setting, before or after it
    /// in the chain, is kept.
    ///
    /// Prefer it behind clients that take any 2xx as final, as Stripe's SDKs do: past the wait
    /// they retry on 409, but would take a 202 as the answer.
    pub fn ietf_draft(self) -> Self {
        self.in_progress_status(StatusCode::CONFLICT)
            .mismatch_status(StatusCode::UNPROCESSABLE_ENTITY)
    }

    /// Sets which responses are stored for replay: a [`StorePolicy`](crate::http::StorePolicy),
    /// or a closure over the response's head. Defaults to
    /// [`DefaultStorePolicy`](crate::http::DefaultStorePolicy). A response marked
    /// [`ReleaseKey`](crate::http::ReleaseKey) is never stored, whatever the policy.
    pub fn store_policy(mut self, policy: impl crate::http::StorePolicy) -> Self {
        self.config().store_policy = Policy(Arc::new(policy));
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
    /// [`Recovered::Happened`]: crate::recovery::Recovered::Happened
    /// [`Recovered::Unknown`]: crate::recovery::Recovered::Unknown
    /// [`IdempotencyContext`]: crate::IdempotencyContext
    pub fn recover<H>(mut self, hook: H) -> Self
    where
        H: crate::recovery::Recover<http::Request<bytes::Bytes>, http::Response<bytes::Bytes>>,
    {
        self.config().recover = Some(Hook::new(hook));
        self.settings().recovering = true;
        self
    }

    /// Rebuilds the replay of a response its handler stored minimally ([`Minimal`]: the
    /// status, the kept headers and a small value): `hook`, a [`Recover`] hook asked with a
    /// [`Lookup`] whose request is the [`Rebuild`] (and whose context names the record),
    /// reads the system of record and answers [`Recovered::Happened`] with the whole response,
    /// which the retry gets with `Idempotency-Replayed: true`. Bounded by the recovery timeout
    /// ([`recovery_timeout`](Self::recovery_timeout), 5 seconds by default). A hook that fails,
    /// panics, times out or finds nothing ([`Recovered::Unknown`], [`Recovered::Mismatch`]) is
    /// answered 503 problem+json (`rebuild-failed`) with `Retry-After`, and never runs the
    /// handler again; a minimal record without a hook, 500.
    ///
    /// ```
    /// use axum_idempotency::{
    ///     IdempotencyLayer, MemoryStore,
    ///     http::Rebuild,
    ///     recovery::{BoxError, Lookup, Recovered},
    /// };
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).rebuild(|lookup: Lookup<Rebuild>| async move {
    ///     let stored = lookup.request.ok_or("a replay always has its record")?;
    ///     // SELECT * FROM orders WHERE id = stored.value
    ///     let order = format!(r#"{{"id":{}}}"#, String::from_utf8_lossy(&stored.value));
    ///     let mut response = http::Response::new(bytes::Bytes::from(order));
    ///     *response.status_mut() = stored.status;
    ///     *response.headers_mut() = stored.headers;
    ///     Ok::<_, BoxError>(Recovered::Happened(response))
    /// });
    /// ```
    ///
    /// [`Minimal`]: super::Minimal
    /// [`Rebuild`]: super::Rebuild
    /// [`Recover`]: crate::recovery::Recover
    /// [`Lookup`]: crate::recovery::Lookup
    /// [`Recovered::Happened`]: crate::recovery::Recovered::Happened
    /// [`Recovered::Unknown`]: crate::recovery::Recovered::Unknown
    /// [`Recovered::Mismatch`]: crate::recovery::Recovered::Mismatch
    pub fn rebuild<H>(mut self, hook: H) -> Self
    where
        H: crate::recovery::Recover<super::Rebuild, http::Response<bytes::Bytes>>,
    {
        self.config().rebuild = Some(super::minimal::RebuildHook::new(hook));
        self
    }

    /// When the store is unavailable, runs the request without idempotency instead of
    /// answering 503. Defaults to `false` (fail closed): a payment is better refused than
    /// run twice.
    pub fn fail_open(mut self, fail_open: bool) -> Self {
        self.config().fail_open = fail_open;
        self
    }

    /// Tells clients how long their key is kept: stored and replayed responses carry
    /// [`EXPIRES_HEADER`](super::EXPIRES_HEADER) (`Idempotency-Key-Expires`), the HTTP date at
    /// which the key's record expires (its completion, by the clock of the instance that
    /// stored it, plus the [`retention`](Self::retention)); a retry after it runs as new.
    /// Not a standard header (the IETF draft discusses advertising the key's lifetime, and
    /// names none). Off by default; a response that is not stored never carries it.
    pub fn advertise_expiry(mut self, advertise: bool) -> Self {
        self.config().advertise_expiry = advertise;
        self
    }
}

impl<S, St: Store, Sc: Clone> Layer<S> for IdempotencyLayer<St, Sc> {
    type Service = Idempotency<S, St, Sc>;

    fn layer(&self, inner: S) -> Self::Service {
        let engine = Engine::new(self.store.clone(), self.settings.clone(), &self.renewals);
        Idempotency::from_parts(inner, engine, self.scope.clone(), self.config.clone())
    }
}

impl<St: Admin, Sc> IdempotencyLayer<St, Sc> {
    /// The operator's calls for the records this layer writes (its key prefix, decrypted as it
    /// encrypts): what a support tool or an admin route holds. See [`Operator`]. It takes the
    /// layer as configured when called: call it on the finished layer.
    pub fn operator(&self) -> Operator<St> {
        let engine = Engine::new(self.store.clone(), self.settings.clone(), &self.renewals);
        Operator::new(engine, self.config.clone())
    }
}
