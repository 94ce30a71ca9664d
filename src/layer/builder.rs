//! [`IdempotencyLayer`]: the builder.

use std::sync::Arc;

use http::{HeaderName, Method};
use tower_layer::Layer;

use super::{
    config::Config,
    fingerprinting::Fingerprinting,
    operator::Operator,
    recover::Hook,
    scope::GlobalScope,
    service::Idempotency,
    settings::{Answers, request_door_setters},
    store_policy::Policy,
};
use crate::{
    engine::{Engine, RenewalsCell, Settings, engine_setters},
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
    /// A layer keeping its records in `store`, with the default settings and [`GlobalScope`]:
    /// **every client shares one key space**, so two customers who send the same key and
    /// body share one record, and the second is replayed the first's response. It is the
    /// default because only the app knows who its clients are; set
    /// [`scope`](Self::scope) to the authenticated customer or tenant (a closure over the
    /// request's parts, [`ExtractorScope`](super::scope::ExtractorScope) over your own
    /// extractor) unless the service has one client.
    pub fn new(store: St) -> Self {
        Self {
            store,
            scope: GlobalScope,
            config: Arc::new(Config::default()),
            settings: Arc::new(Settings::for_requests()),
            renewals: RenewalsCell::default(),
        }
    }
}

impl<St, Sc> IdempotencyLayer<St, Sc> {
    fn config(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.config)
    }

    fn settings(&mut self) -> &mut Settings {
        // New settings, new renewals: a lease changed after a claim is renewed as set.
        self.renewals = RenewalsCell::default();
        // And a fleet of their own: what the door announces changes with them.
        let settings = Arc::make_mut(&mut self.settings);
        settings.fleet = Arc::default();
        settings
    }

    engine_setters!();

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

    request_door_setters! {
        IdempotencyLayer;
        /// Sets how a request's scope is found (see [`ScopeExtractor`](super::scope::ScopeExtractor)). Defaults to
        /// [`GlobalScope`].
        scope;
        /// Answers a request without a key with 400 instead of passing it through. Defaults to
        /// `false`. Use it with `route_layer` on the routes that must have a key.
        require_key;
        /// Sets the prefix of every record key in the store. Defaults to `idempotency`.
        key_prefix;
        /// Sets what the layer buffers and stores: the request body, the stored response, and
        /// what becomes of a response too large to keep. See [`Limits`](super::Limits). Like each group's setter, it
        /// sets the whole group: what the value leaves out is back to its default.
        limits;
    }

    /// Sets what a request's fingerprint covers (canonical JSON, members left out, request
    /// headers, or the app's own function). See [`Fingerprinting`]. It sets the whole group.
    pub fn fingerprinting(mut self, fingerprinting: Fingerprinting) -> Self {
        self.config().fingerprinting = fingerprinting;
        self
    }

    /// Sets what a retry that does not run is answered with: the in-progress and mismatch
    /// statuses ([`Answers::ietf_draft`] for the IETF draft's), the expiry header, the headers
    /// a replay carries. See [`Answers`]. It sets the whole group.
    pub fn answers(mut self, answers: Answers) -> Self {
        self.config().answers = answers;
        self
    }

    /// Sets which responses are stored for replay: a [`StorePolicy`](crate::layer::StorePolicy),
    /// or a closure over the response's head. Defaults to
    /// [`DefaultStorePolicy`](crate::layer::DefaultStorePolicy). A response marked
    /// [`ReleaseKey`](crate::layer::ReleaseKey) is never stored, whatever the policy.
    pub fn store_policy(mut self, policy: impl crate::layer::StorePolicy) -> Self {
        self.config().store_policy = Policy(Arc::new(policy));
        self
    }

    /// Asks `hook` before a request runs again after a takeover: when a claim finds the same
    /// request's lease lapsed (its holder died, perhaps after its side effect committed), the
    /// hook looks the request up in the system of record. [`Recovered::Happened`] is stored and
    /// answered as a replay (`Idempotency-Replayed: true`) without running the handler;
    /// [`Recovered::Unknown`] runs it. A hook that fails, panics or times out
    /// ([`Recovery::timeout`](crate::settings::Recovery::timeout)) is answered 503 problem+json
    /// (`recovery-failed`) and the handler does not run (see
    /// [`Recovery::run_when_failed`](crate::settings::Recovery::run_when_failed)).
    ///
    /// The handler finds the [`IdempotencyContext`] in its request (an extractor): write its
    /// key hash with the outcome, in the transaction of the side effect, for the hook to find.
    /// A takeover is recognised within the [`Recovery::window`](crate::settings::Recovery::window).
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
    /// ([`Recovery::timeout`](crate::settings::Recovery::timeout), 5 seconds by default). A hook that fails,
    /// panics, times out or finds nothing ([`Recovered::Unknown`], [`Recovered::Mismatch`]) is
    /// answered 503 problem+json (`rebuild-failed`) with `Retry-After`, and never runs the
    /// handler again; a minimal record without a hook, 500.
    ///
    /// ```
    /// use axum_idempotency::{
    ///     IdempotencyLayer, MemoryStore,
    ///     layer::Rebuild,
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
