//! The HTTP door's settings, grouped by the job they do (as [`crate::settings`] groups those
//! every door shares): [`Limits`], what the layer buffers and stores; [`Answers`], what a retry
//! that does not run is answered with.

use http::{HeaderName, StatusCode};

use super::header_filter::HeaderFilter;

/// What the layer buffers and stores
/// ([`IdempotencyLayer::limits`](super::IdempotencyLayer::limits)).
///
/// ```
/// use axum_idempotency::{IdempotencyLayer, MemoryStore, layer::Limits};
///
/// let layer = IdempotencyLayer::new(MemoryStore::new())
///     .limits(Limits::default().body(64 * 1024).stored_body(256 * 1024));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub struct Limits {
    pub(crate) body: usize,
    pub(crate) stored_body: usize,
    pub(crate) stored_headers: usize,
    pub(crate) release_when_too_large: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            body: 1024 * 1024,
            stored_body: 1024 * 1024,
            stored_headers: 64 * 1024,
            release_when_too_large: false,
        }
    }
}

impl Limits {
    /// Sets the largest request body buffered, in bytes; a larger one gets 413. Defaults to
    /// 1 MiB.
    pub fn body(mut self, bytes: usize) -> Self {
        self.body = bytes;
        self
    }

    /// Sets the largest response body stored for replay, in bytes. A larger response is sent
    /// to the client, and its key keeps a "completed, not replayable" record (see
    /// [`release_when_too_large`](Self::release_when_too_large)). Defaults to 1 MiB. A
    /// response the recovery hook or the completer found is stored whole, whatever its size:
    /// its operation happened, and is answered as it was, never run again.
    pub fn stored_body(mut self, bytes: usize) -> Self {
        self.stored_body = bytes;
        self
    }

    /// Sets the largest response header section stored for replay, in bytes (names and
    /// values of the headers kept, plus 6 bytes each). A response with more is answered as
    /// one over the [`stored_body`](Self::stored_body) limit: a stored record is at most the
    /// sum of the two. Defaults to 64 KiB.
    pub fn stored_headers(mut self, bytes: usize) -> Self {
        self.stored_headers = bytes;
        self
    }

    /// Releases the key of a response too large to keep (its headers or body over the stored
    /// limits, a stream whose copy went past them), so that a retry runs the handler again.
    /// **The risk:** a client whose answer was lost on the way retries, and the side effect
    /// happens twice. Defaults to `false`: the key keeps a small "completed, not replayable"
    /// record (the status and the reason, no body), and every retry is answered 500
    /// problem+json `response-not-replayable`, never by running the handler again.
    pub fn release_when_too_large(mut self, release: bool) -> Self {
        self.release_when_too_large = release;
        self
    }
}

/// What a retry that does not run is answered with: the statuses of the layer's own answers,
/// and what a replay carries ([`IdempotencyLayer::answers`](super::IdempotencyLayer::answers)).
///
/// ```
/// use axum_idempotency::{IdempotencyLayer, MemoryStore, layer::Answers};
///
/// let layer = IdempotencyLayer::new(MemoryStore::new()).answers(
///     Answers::ietf_draft().include_replayed_header(http::header::SET_COOKIE),
/// );
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct Answers {
    pub(super) in_progress_status: StatusCode,
    pub(super) mismatch_status: StatusCode,
    pub(super) advertise_expiry: bool,
    pub(super) replayed_headers: HeaderFilter,
}

impl Default for Answers {
    fn default() -> Self {
        Self {
            in_progress_status: StatusCode::ACCEPTED,
            mismatch_status: StatusCode::CONFLICT,
            advertise_expiry: false,
            replayed_headers: HeaderFilter::default(),
        }
    }
}

impl Answers {
    /// The IETF draft's statuses (draft-ietf-httpapi-idempotency-key-header): 409 while the
    /// original request runs (past the wait), 422 for a key reused with a different request;
    /// the rest as [`default`](Self::default).
    ///
    /// Prefer it behind clients that take any 2xx as final, as Stripe's SDKs do: past the wait
    /// they retry on 409, but would take a 202 as the answer.
    pub fn ietf_draft() -> Self {
        Self::default()
            .in_progress_status(StatusCode::CONFLICT)
            .mismatch_status(StatusCode::UNPROCESSABLE_ENTITY)
    }

    /// Sets the status of the answer to a retry whose original is still running (past the
    /// wait). Defaults to 202 Accepted.
    pub fn in_progress_status(mut self, status: StatusCode) -> Self {
        self.in_progress_status = status;
        self
    }

    /// Sets the status of the answer to a key reused with a different request. Defaults to
    /// 409 Conflict.
    pub fn mismatch_status(mut self, status: StatusCode) -> Self {
        self.mismatch_status = status;
        self
    }

    /// Tells clients how long their key is kept: stored and replayed responses carry
    /// [`EXPIRES_HEADER`](super::EXPIRES_HEADER) (`Idempotency-Key-Expires`), the HTTP date at
    /// which the key's record expires (its completion, by the clock of the instance that
    /// stored it, plus the retention); a retry after it runs as new. Not a standard header
    /// (the IETF draft discusses advertising the key's lifetime, and names none). Off by
    /// default; a response that is not stored never carries it.
    pub fn advertise_expiry(mut self, advertise: bool) -> Self {
        self.advertise_expiry = advertise;
        self
    }

    /// Leaves a response header out of stored responses, and so out of replays. By default
    /// `Set-Cookie`, `Date`, `Content-Length` and the hop-by-hop headers are left out.
    pub fn exclude_replayed_header(mut self, name: HeaderName) -> Self {
        self.replayed_headers.exclude(name);
        self
    }

    /// Stores a response header that is left out by default, such as `Set-Cookie`, so that
    /// replays carry it.
    pub fn include_replayed_header(mut self, name: HeaderName) -> Self {
        self.replayed_headers.include(&name);
        self
    }
}

/// The setters the two request doors (this layer and the gRPC door) share, over a builder
/// with `store`, `scope`, `settings`, `config` and `renewals` fields, and `fn settings` and
/// `fn config`: whose keys are whose, whether a key is required, the keys' prefix, and the
/// [`Limits`]. Each door writes its own docs.
macro_rules! request_door_setters {
    (
        $layer:ident;
        $(#[$scope:meta])* scope;
        $(#[$require:meta])* require_key;
        $(#[$prefix:meta])* key_prefix;
        $(#[$limits:meta])* limits;
    ) => {
        $(#[$scope])*
        pub fn scope<Sc2: $crate::layer::scope::ScopeExtractor>(self, scope: Sc2) -> $layer<St, Sc2> {
            let Self { store, settings, config, renewals, .. } = self;
            $layer { store, scope, settings, config, renewals }
        }

        $(#[$require])*
        pub fn require_key(mut self, require: bool) -> Self {
            self.config().require_key = require;
            self
        }

        $(#[$prefix])*
        pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
            self.config().prefix = prefix.into();
            self
        }

        $(#[$limits])*
        pub fn limits(mut self, limits: $crate::layer::Limits) -> Self {
            self.settings().release_too_large = limits.release_when_too_large;
            self.config().limits = limits;
            self
        }
    };
}

pub(crate) use request_door_setters;
