//! [`GrpcIdempotencyLayer`], the builder, and [`GrpcIdempotency`], the middleware it makes.

use std::{
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use axum::body::Body;
use bytes::Bytes;
use http::{Request, Response};
use tower_layer::Layer;
use tower_service::Service;

use super::{GrpcStorePolicy, KeyFromMessage, Reply, call, config::Config};
use crate::{
    engine::{Engine, RenewalsCell, Settings, engine_setters, inner_service_accessors},
    layer::{
        ResponseFuture, request_door_setters,
        scope::{GlobalScope, ScopeExtractor},
    },
    recovery::{BoxError, Hook, Recover},
    store::Store,
};

/// Makes the unary methods it lists idempotent, in a tonic server: the gRPC front door.
///
/// See the [module](super) for what it answers and how to apply it.
#[must_use]
#[derive(Clone, Debug)]
pub struct GrpcIdempotencyLayer<St, Sc = GlobalScope> {
    store: St,
    scope: Sc,
    settings: Arc<Settings>,
    config: Arc<Config>,
    /// Where the leases of this layer's running calls are renewed.
    renewals: RenewalsCell<St>,
}

impl<St: Store> GrpcIdempotencyLayer<St> {
    /// Records in `store`, with the HTTP layer's defaults for the lease (10 s) and waiting
    /// (a retry waits up to 10 s for the call it repeats), and no method handled yet.
    pub fn new(store: St) -> Self {
        Self {
            store,
            scope: GlobalScope,
            settings: Arc::new(Settings::for_requests()),
            config: Arc::new(Config::default()),
            renewals: RenewalsCell::default(),
        }
    }
}

impl<St, Sc> GrpcIdempotencyLayer<St, Sc> {
    fn settings(&mut self) -> &mut Settings {
        // New settings, new renewals: a lease changed after a claim is renewed as set.
        self.renewals = RenewalsCell::default();
        // And a fleet of their own: what the door announces changes with them.
        let settings = Arc::make_mut(&mut self.settings);
        settings.fleet = Arc::default();
        settings
    }

    fn config(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.config)
    }

    engine_setters!();

    request_door_setters! {
        GrpcIdempotencyLayer;
        /// Sets whose keys are whose, as the HTTP layer's scopes do (see [`scope`](crate::layer::scope)):
        /// [`HeaderScope`](super::HeaderScope) reads a metadata entry, a closure over the request's
        /// parts or [`ExtractorScope`](crate::layer::scope::ExtractorScope) an authenticated
        /// principal in its extensions. A call whose scope is not found is `INVALID_ARGUMENT` (the
        /// extractor's 401 `UNAUTHENTICATED`, its 403 `PERMISSION_DENIED`), with the reason.
        /// Defaults to one scope for every caller.
        scope;
        /// Whether a call of a listed method without a key is refused (`INVALID_ARGUMENT`), or
        /// passed through without idempotency. Defaults to `true`: a listed method is a mutation
        /// that must not run twice.
        require_key;
        /// Sets the prefix of every record key in the store. Defaults to `idempotency-grpc`.
        key_prefix;
        /// Sets what the layer reads and stores, as the HTTP layer's [`Limits`](super::Limits) do: `body` is the
        /// request message (its frame's five-byte prefix not counted, as tonic counts; a larger one
        /// is `RESOURCE_EXHAUSTED`; while it is read, a call holds up to twice it, as tonic's
        /// own server does: its decoder sets aside a message's declared length, and a second
        /// message is read to be refused); `stored_body` the stored message (its prefix not counted
        /// either), and `stored_headers` the
        /// stored metadata, headers and trailers (a reply over either is answered, and its key
        /// keeps a record that the call ran: every retry gets `INTERNAL`, never a second run, unless
        /// `release_when_too_large`). Defaults to [`Limits::default`](super::Limits::default): 1 MiB a message, 64 KiB of
        /// metadata. It sets the whole group.
        limits;
    }

    /// Handles the unary method with this path (`/package.Service/Method`, as
    /// `tonic::GrpcMethod` and the `:path` of a call name it). Call once per method. Every
    /// other method, streaming ones included, passes through untouched.
    pub fn unary(mut self, path: impl Into<String>) -> Self {
        self.config().methods.insert(path.into());
        self
    }

    /// Reads the key from the request message when the call has no `idempotency-key`
    /// metadata entry: AIP-155's `request_id`. `find` gets the method's path and the message's
    /// bytes (uncompressed), and decodes the field. An empty id is no id.
    ///
    /// ```
    /// use axum_idempotency::{MemoryStore, grpc::GrpcIdempotencyLayer};
    ///
    /// // `request_id` is field 1, a string: decode it with the service's own message type
    /// // (`ChargeRequest::decode(message)`); here, by hand.
    /// let layer = GrpcIdempotencyLayer::new(MemoryStore::new())
    ///     .unary("/payments.v1.Payments/Charge")
    ///     .key_from_message(|_path: &str, message: &[u8]| match message {
    ///         [0x0a, len, rest @ ..] if rest.len() >= *len as usize => {
    ///             String::from_utf8(rest[..*len as usize].to_vec()).ok()
    ///         }
    ///         _ => None,
    ///     });
    /// ```
    pub fn key_from_message(mut self, find: impl KeyFromMessage) -> Self {
        self.config().key_from_message = Some(Arc::new(find));
        self
    }

    /// Tells the layer the server's own timeout (`Server::builder().timeout(d)`), which tonic
    /// applies around every layer without telling it: a duplicate still waiting for its
    /// original when it fires would be answered `CANCELLED "Timeout expired"`, which no retry
    /// policy lists. With it, a duplicate waits within the shorter of the server's timeout and
    /// its own `grpc-timeout`, less a tenth (at least 50 ms), and is answered `ABORTED` with
    /// `RetryInfo` first. The original itself is still cut at the server's timeout; a handler
    /// whose claim was won runs on to its end, once, and a later call replays its reply (a
    /// timeout shorter than a claim's round trip cuts the call before anything runs).
    ///
    /// The deadline is counted from the call's arrival at this layer, and a tenth of it (at
    /// least 50 ms) is kept for the last claim and the answer: make this layer the first given
    /// to the server (`Server::builder().layer(idempotency)` before any other, the outermost),
    /// since time a layer in front of it spends counts against the server's timeout unseen,
    /// and keep the timeout well above the store's round trip. Unset by default; set on the
    /// layer alone, duplicates stop waiting at that deadline all the same.
    ///
    /// ```
    /// use std::time::Duration;
    /// use axum_idempotency::{MemoryStore, grpc::GrpcIdempotencyLayer};
    ///
    /// let timeout = Duration::from_secs(5);
    /// let layer = GrpcIdempotencyLayer::new(MemoryStore::new())
    ///     .unary("/payments.v1.Payments/Charge")
    ///     .server_timeout(timeout);
    /// // tonic::transport::Server::builder().timeout(timeout).layer(layer) ...
    /// ```
    pub fn server_timeout(mut self, timeout: Duration) -> Self {
        self.config().server_timeout = Some(timeout);
        self
    }

    /// Sets which statuses are stored and replayed: see [`GrpcStorePolicy`]. Defaults to `OK`
    /// alone.
    pub fn store_policy(mut self, policy: impl GrpcStorePolicy) -> Self {
        self.config().store_policy = Arc::new(policy);
        self
    }

    /// Asks `hook` before a call runs again after a takeover (the holder's lease lapsed: its
    /// process died, perhaps after its side effect committed), or before every new call with
    /// [`Recovery::every_claim`](crate::settings::Recovery::every_claim): the hook gets the
    /// [`IdempotencyContext`](crate::IdempotencyContext) and the request message's bytes, and
    /// looks the call up in the system of record. [`Recovered::Happened`] with the handler's
    /// reply (`Reply::from(tonic::Response::new(reply))`) is stored and answered as a replay,
    /// and the handler does not run; [`Recovered::Unknown`] runs it; a failed hook is
    /// `UNAVAILABLE`, and nothing runs
    /// ([`Recovery::run_when_failed`](crate::settings::Recovery::run_when_failed) runs it
    /// instead).
    ///
    ///
    /// `DurableOutcomes` is such a hook (feature `postgres`): with Redis in front, a handler
    /// commits its reply to it in its transaction (`DurableOutcomes::transaction`), and every
    /// claim asks it, so that a record Redis lost is replayed from PostgreSQL.
    ///
    /// [`Recovered::Happened`]: crate::recovery::Recovered::Happened
    /// [`Recovered::Unknown`]: crate::recovery::Recovered::Unknown
    pub fn recover(mut self, hook: impl Recover<Bytes, Reply>) -> Self {
        self.config().recover = Some(Hook::new(hook));
        self.settings().recovering = true;
        self
    }
}

impl<S, St: Store, Sc: Clone> Layer<S> for GrpcIdempotencyLayer<St, Sc> {
    type Service = GrpcIdempotency<S, St, Sc>;

    fn layer(&self, inner: S) -> Self::Service {
        let engine = Engine::new(self.store.clone(), self.settings.clone(), &self.renewals);
        let (scope, config) = (self.scope.clone(), self.config.clone());
        GrpcIdempotency { inner, engine, scope, config }
    }
}

/// The middleware [`GrpcIdempotencyLayer`] makes.
#[derive(Clone, Debug)]
pub struct GrpcIdempotency<S, St, Sc = GlobalScope> {
    inner: S,
    engine: Engine<St>,
    scope: Sc,
    config: Arc<Config>,
}

impl<S, St, Sc> GrpcIdempotency<S, St, Sc> {
    inner_service_accessors!();
}

impl<S, St, Sc, ReqBody, ResBody> Service<Request<ReqBody>> for GrpcIdempotency<S, St, Sc>
where
    S: Service<Request<tonic::body::Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: Store,
    Sc: ScopeExtractor,
    ReqBody: http_body::Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let request = request.map(tonic::body::Body::new);
        if !self.config.methods.contains(request.uri().path()) {
            return ResponseFuture::pass_through(self.inner.call(request));
        }
        // The clone is not ready; the one `poll_ready` readied goes with this call.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let span = tracing::info_span!(
            "idempotency",
            method = request.uri().path(),
            key_hash = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        let call = call::Call {
            inner,
            engine: self.engine.clone(),
            scope: self.scope.clone(),
            config: self.config.clone(),
        };
        ResponseFuture::handled(call.handle(request), span)
    }
}
