//! The gRPC front door (feature `tonic`): [`GrpcIdempotencyLayer`], a tower layer for tonic
//! servers that makes the unary methods it lists run once per key, and replays their
//! responses to every retry.
//!
//! It is the HTTP layer's sibling over the same engine and stores: the same claim, waiting,
//! lease renewal, takeover of a dead holder's key, encryption at rest
//! ([`encrypt_at_rest`](GrpcIdempotencyLayer::encrypt_at_rest)), metrics (labelled with the
//! method's path as their `route`), and the commit of a response in the handler's own
//! PostgreSQL transaction.
//!
//! ```
//! use std::time::Duration;
//! use axum_idempotency::{MemoryStore, grpc::{GrpcIdempotencyLayer, HeaderScope}};
//!
//! let layer = GrpcIdempotencyLayer::new(MemoryStore::new())
//!     .unary("/payments.v1.Payments/Charge")
//!     .scope(HeaderScope::new("x-tenant-id").unwrap())
//!     .retention(Duration::from_secs(24 * 3600));
//! // tonic::transport::Server::builder().layer(layer).add_service(PaymentsServer::new(svc))
//! ```
//!
//! - **which methods**: the unary methods listed with [`unary`](GrpcIdempotencyLayer::unary),
//!   by path. Every other call passes through untouched, streaming methods included: a
//!   stream has no one message to fingerprint nor one response to replay.
//! - **the key**: the `idempotency-key` metadata entry (an opaque ASCII metadata value: 1 to
//!   255 printable ASCII characters, spaces and commas included but not first or last, taken
//!   as they are; given once, and not as `idempotency-key-bin`), or the request message's own
//!   id, read by [`key_from_message`](GrpcIdempotencyLayer::key_from_message) (AIP-155's
//!   `request_id`); a call that carries both carries the same key twice, or is refused.
//! - **the scope**: whose key it is, as the HTTP layer's [scopes](crate::layer::scope) say it:
//!   a metadata entry ([`HeaderScope`]), or the principal an authentication layer put in the
//!   request's extensions (a closure over the request's parts, or an
//!   [`ExtractorScope`](crate::layer::scope::ExtractorScope)):
//!
//! ```
//! use axum_idempotency::{MemoryStore, grpc::GrpcIdempotencyLayer};
//! use http::request::Parts;
//!
//! // The principal an authentication layer put in the request's extensions.
//! #[derive(Clone)]
//! struct Principal(String);
//!
//! let layer = GrpcIdempotencyLayer::new(MemoryStore::new())
//!     .scope(|parts: &Parts| parts.extensions.get::<Principal>().map(|p| p.0.clone()));
//! ```
//! - **the fingerprint**: the method's full path and the request message's bytes (the
//!   frame's payload), uncompressed: tonic's decoder reads the frame, and a gzip or deflate
//!   request uncompressed (at most the message limit, compressed and uncompressed); another
//!   encoding is refused (`UNIMPLEMENTED`, with `grpc-accept-encoding: gzip, deflate,
//!   identity`). The handler gets the same bytes, uncompressed.
//! - **the reply** is stored, and replayed, uncompressed: the layer takes the call's
//!   `grpc-accept-encoding` away before the handler, so that a reply stored for a client that
//!   accepts gzip is readable by a retry that accepts no compression.
//! - **deadlines**: a retry waits for a running original up to the layer's wait
//!   ([`waiting`](GrpcIdempotencyLayer::waiting)), and within its own `grpc-timeout`, counted
//!   from its arrival, less a tenth of it (at least 50 ms) for the last claim and the answer:
//!   its `ABORTED`, with when to retry, reaches the client before the client gives up. A
//!   deadline shorter than a claim's round trip ends the call on the client's side first
//!   (`DEADLINE_EXCEEDED`, or tonic's `CANCELLED`); nothing runs twice either way.
//!   **Tell the layer the server's own timeout**
//!   ([`server_timeout`](GrpcIdempotencyLayer::server_timeout)) when it has one
//!   (`Server::builder().timeout(d)`): tonic applies it around every layer, this one included,
//!   without telling it, and a duplicate still waiting when it fires is answered
//!   `CANCELLED "Timeout expired"`, which no retry policy lists (the handler still runs once;
//!   a later call replays). Told, the layer counts it as it counts the call's own deadline, and
//!   the duplicate gets `ABORTED` with `RetryInfo` first, as long as the layers in front of
//!   this one, and the store's round trip, take less than the tenth it keeps: make it the
//!   server's first layer. A client retry policy lists `ABORTED`
//!   beside
//!   `UNAVAILABLE`, or a waiting duplicate's answer ends the call:
//!
//!   ```json
//!   { "methodConfig": [{ "name": [{ "service": "payments.v1.Payments" }],
//!       "retryPolicy": { "maxAttempts": 5, "initialBackoff": "0.2s", "maxBackoff": "5s",
//!         "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE", "ABORTED"] } }] }
//!   ```
//!
//!   A replayed error is a trailers-only response: its `idempotency-replayed: true` arrives
//!   with the status, in the trailers (tonic: `Status::metadata()`); a replayed `OK`'s, in the
//!   response's metadata (`examples/grpc/tests/grpc.rs` reads both).
//! - **a takeover** (the holder's process died) runs the call again, or asks the recovery
//!   hook first ([`recover`](GrpcIdempotencyLayer::recover)) whether it happened.
//! - **the handler** finds the [`IdempotencyContext`](crate::IdempotencyContext) in the
//!   request's extensions (`request.extensions().get::<IdempotencyContext>()`), and may commit
//!   its `tonic::Response` in the store's transaction with its side effect
//!   (`PostgresStore::transaction`, or `DurableOutcomes::transaction` with Redis in front and
//!   the outcomes as the layer's [`recover`](GrpcIdempotencyLayer::recover) hook); a [`TransactionError`](crate::store::TransactionError)
//!   converts to a `tonic::Status` with `?`. `PostgresStore::transaction` holds its key
//!   however long it runs (a lock of its session, from before its `BEGIN` to after its
//!   `COMMIT`): a retry meanwhile is in progress, never run; one whose claim was taken over
//!   before it began is rolled back, and its caller gets `UNAVAILABLE` ("rolled back: …").
//!
//! | situation | answer |
//! |---|---|
//! | first call | the handler's response |
//! | retry of a completed call | the stored response (metadata, message, trailers) with `idempotency-replayed: true` |
//! | retry while the call runs | waits for it (up to 10 s by default, and within its own deadline and the [`server_timeout`](GrpcIdempotencyLayer::server_timeout)), then as above; past the wait `ABORTED` with `RetryInfo` and `grpc-retry-pushback-ms` |
//! | the same key with another message | `FAILED_PRECONDITION` |
//! | no key on a listed method, a malformed key (the `idempotency-key` entry: 1 to 255 printable ASCII characters, no space first or last, once, never `idempotency-key-bin`; a request id: 1 to 255 bytes of any text), a metadata key and a request id that differ | `INVALID_ARGUMENT` |
//! | no scope: the scope extractor refused the call | `INVALID_ARGUMENT` with its reason; its 401 `UNAUTHENTICATED`, its 403 `PERMISSION_DENIED`, its 429 and 502–504 `UNAVAILABLE`, another 5xx `UNKNOWN` |
//! | a request message over [`Limits`]'s `body` (1 MiB) | `RESOURCE_EXHAUSTED` |
//! | no request message, or two | `INVALID_ARGUMENT` |
//! | a request message that cannot be read (cut short, an unknown flag, corrupt compression, compressed without its `grpc-encoding`) | `INTERNAL`, as tonic's server answers |
//! | a call whose client resets its stream after its message | `CANCELLED`; the handler does not run |
//! | a request compressed with another encoding than gzip or deflate | `UNIMPLEMENTED`, `grpc-accept-encoding: gzip, deflate, identity` |
//! | the store unavailable | `UNAVAILABLE`, with `RetryInfo` |
//! | a response over the stored limits, or not one message (a streaming method listed as unary, whose status the store policy keeps: it is read whole first), retried | `INTERNAL` (the call ran; it does not run again) |
//!
//! Another message under a used key is `FAILED_PRECONDITION`, not `INVALID_ARGUMENT`: the
//! message is valid in itself, and would succeed under a fresh key; what refuses it is the
//! state the key is in. So Go's `idemlease` answers too.
//!
//! Which statuses are stored is the [`GrpcStorePolicy`]'s call: `OK` by default. Any other
//! status releases the key, so that a retry runs the handler again; list the business
//! errors that must be replayed rather than retried (a declined charge).

mod call;
mod commit;
mod config;
mod door;
mod layer;
mod record;
mod request;
mod status;

use tonic::Code;

pub use self::{
    commit::Reply,
    layer::{GrpcIdempotency, GrpcIdempotencyLayer},
};
pub use crate::layer::{
    Limits,
    scope::{GlobalScope, HeaderScope},
};

/// The metadata entry that carries the key.
pub const KEY_METADATA: &str = "idempotency-key";

/// The metadata entry that marks a replayed response: `idempotency-replayed: true`.
pub const REPLAYED_METADATA: &str = "idempotency-replayed";

/// Reads the key from a request message: AIP-155's `request_id`.
///
/// Implemented for closures `Fn(&str, &[u8]) -> Option<String>`, given the method's path and
/// the message's bytes; `None` (or an empty id) when the message has no key.
pub trait KeyFromMessage: Send + Sync + 'static {
    /// The key of the call of `method` with `message`, if it has one.
    fn key(&self, method: &str, message: &[u8]) -> Option<String>;
}

impl<F> KeyFromMessage for F
where
    F: Fn(&str, &[u8]) -> Option<String> + Send + Sync + 'static,
{
    fn key(&self, method: &str, message: &[u8]) -> Option<String> {
        self(method, message).filter(|key| !key.is_empty())
    }
}

/// Decides whether a call's response is stored for replay (`true`), or its key released so
/// that a retry runs the handler again (`false`), by its status code.
///
/// Implemented for closures `Fn(tonic::Code) -> bool`. The default stores `OK` alone, as Go's
/// `idemlease` does: every error releases the key.
///
/// ```
/// use axum_idempotency::{MemoryStore, grpc::GrpcIdempotencyLayer};
/// use tonic::Code;
///
/// // A declined charge (FAILED_PRECONDITION) is an answer, replayed, not retried.
/// let layer = GrpcIdempotencyLayer::new(MemoryStore::new())
///     .store_policy(|code: Code| matches!(code, Code::Ok | Code::FailedPrecondition));
/// ```
pub trait GrpcStorePolicy: Send + Sync + 'static {
    /// Whether a response with this status is stored.
    fn stores(&self, code: Code) -> bool;
}

impl<F> GrpcStorePolicy for F
where
    F: Fn(Code) -> bool + Send + Sync + 'static,
{
    fn stores(&self, code: Code) -> bool {
        self(code)
    }
}
