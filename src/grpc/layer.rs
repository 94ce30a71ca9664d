//! [`GrpcIdempotencyLayer`], the builder, and [`GrpcIdempotency`], the middleware it makes.

use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use bytes::Bytes;
use futures_util::future::BoxFuture;
use http::{Request, Response};
use tonic::body::Body;
use tower_layer::Layer;
use tower_service::Service;
use tracing::Instrument as _;

use super::{
    GrpcScope, GrpcStorePolicy, KeyFromMessage, Reply, call,
    config::{self, Config},
};
use crate::{
    engine::{
        DEFAULT_HTTP_LEASE, DEFAULT_HTTP_WAIT, Engine, RenewalsCell, Settings, engine_setters,
    },
    recovery::{BoxError, Recover},
    store::Store,
};

/// Makes the unary methods it lists idempotent, in a tonic server: the gRPC front door.
///
/// See the [module](super) for what it answers and how to apply it.
#[must_use]
#[derive(Clone)]
pub struct GrpcIdempotencyLayer<St> {
    store: St,
    settings: Arc<Settings>,
    config: Arc<Config>,
    /// Where the leases of this layer's running calls are renewed.
    renewals: RenewalsCell<St>,
}

impl<St: fmt::Debug> fmt::Debug for GrpcIdempotencyLayer<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GrpcIdempotencyLayer")
            .field("store", &self.store)
            .field("settings", &self.settings)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<St: Store> GrpcIdempotencyLayer<St> {
    /// Records in `store`, with the HTTP layer's defaults for the lease (10 s) and waiting
    /// (a retry waits up to 10 s for the call it repeats), and no method handled yet.
    pub fn new(store: St) -> Self {
        Self {
            store,
            settings: Arc::new(Settings {
                lease: DEFAULT_HTTP_LEASE,
                wait: Some(DEFAULT_HTTP_WAIT),
                ..Settings::default()
            }),
            config: Arc::new(Config::default()),
            renewals: RenewalsCell::default(),
        }
    }
}

impl<St> GrpcIdempotencyLayer<St> {
    fn settings(&mut self) -> &mut Settings {
        // New settings, new renewals: a lease changed after a claim is renewed as set.
        self.renewals = RenewalsCell::default();
        Arc::make_mut(&mut self.settings)
    }

    fn config(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.config)
    }

    engine_setters!();

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

    /// Whether a call of a listed method without a key is refused (`INVALID_ARGUMENT`), or
    /// passed through without idempotency. Defaults to `true`: a listed method is a mutation
    /// that must not run twice.
    pub fn require_key(mut self, require: bool) -> Self {
        self.config().require_key = require;
        self
    }

    /// Sets whose keys are whose: see [`GrpcScope`]. Defaults to one scope for every caller.
    pub fn scope(mut self, scope: impl GrpcScope) -> Self {
        self.config().scope = Arc::new(scope);
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
        self.config().recover = Some(config::hook(hook));
        self.settings().recovering = true;
        self
    }

    /// Releases the key of a response over the stored limit, so that a retry runs the
    /// handler again. **The risk:** a client whose answer was lost retries, and the side
    /// effect happens twice. Defaults to `false`: the key keeps a "completed, not replayable"
    /// record, and every retry is `INTERNAL`, never a second run.
    pub fn release_when_too_large(mut self, release: bool) -> Self {
        self.settings().release_too_large = release;
        self
    }

    /// Sets the prefix of every record key in the store. Defaults to `idempotency-grpc`.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.config().prefix = prefix.into();
        self
    }

    /// Sets the largest request message read, in bytes (its frame's five-byte prefix not
    /// counted, as tonic counts): a larger one is `RESOURCE_EXHAUSTED`. Defaults to 4 MiB,
    /// tonic's own limit for a decoded message.
    pub fn message_limit(mut self, bytes: usize) -> Self {
        self.config().message_limit = bytes;
        self
    }

    /// Sets the largest stored response (headers, message and trailers), in bytes. A larger
    /// one is answered, and its key keeps a record that the call ran: every retry gets
    /// `INTERNAL`, never a second run
    /// ([`release_when_too_large`](Self::release_when_too_large) releases the key instead).
    /// Defaults to 1 MiB.
    pub fn stored_limit(mut self, bytes: usize) -> Self {
        self.config().stored_limit = bytes;
        self
    }
}

impl<S, St: Store> Layer<S> for GrpcIdempotencyLayer<St> {
    type Service = GrpcIdempotency<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        let engine = Engine::new(self.store.clone(), self.settings.clone(), &self.renewals);
        GrpcIdempotency { inner, engine, config: self.config.clone() }
    }
}

/// The middleware [`GrpcIdempotencyLayer`] makes.
#[derive(Clone)]
pub struct GrpcIdempotency<S, St> {
    inner: S,
    engine: Engine<St>,
    config: Arc<Config>,
}

impl<S, St> GrpcIdempotency<S, St> {
    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The wrapped service, unwrapped.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: fmt::Debug, St: fmt::Debug> fmt::Debug for GrpcIdempotency<S, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GrpcIdempotency")
            .field("inner", &self.inner)
            .field("store", self.engine.store())
            .field("config", &self.config)
            .finish()
    }
}

impl<S, St, ReqBody, ResBody> Service<Request<ReqBody>> for GrpcIdempotency<S, St>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: Store,
    ReqBody: http_body::Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        if !self.config.methods.contains(request.uri().path()) {
            let passed = self.inner.call(request.map(Body::new));
            return ResponseFuture(Box::pin(async move { Ok(passed.await?.map(Body::new)) }));
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
        let handling = call::handle(inner, self.engine.clone(), self.config.clone(), request);
        ResponseFuture(Box::pin(handling.instrument(span)))
    }
}

/// The response future of [`GrpcIdempotency`].
pub struct ResponseFuture<E>(BoxFuture<'static, Result<Response<Body>, E>>);

impl<E> Future for ResponseFuture<E> {
    type Output = Result<Response<Body>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.0.as_mut().poll(cx)
    }
}

impl<E> fmt::Debug for ResponseFuture<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
