//! The HTTP front door: [`IdempotencyLayer`], the [`Idempotency`] middleware it makes, and
//! what its configuration names (scopes, the store policy, the fingerprint function, the key
//! header's parser).
//!
//! It turns a request into the engine's terms (a record key from the scope and the
//! `Idempotency-Key`, a fingerprint of the request, the response encoded for the store) and the
//! engine's answers back into HTTP (the handler's response, a replay, a problem+json answer).

// - `builder.rs`: the builder; `settings.rs`: its groups of settings; `config.rs`: what it
//   configures.
// - `service.rs`: the middleware (filter and key); `handle.rs`: the rest of a keyed request;
//   `future.rs`: its response future; `body.rs`: request and response bodies.
// - `fingerprinting.rs`: what the fingerprint covers; `key_header.rs`: the key header;
//   `scope.rs`: whose key it is; `record.rs`: the stored response; `problem.rs`: the layer's
//   own answers; `recover.rs`: the recovery hook and the `IdempotencyContext` extractor;
//   `commit.rs`: a response committed in the handler's own transaction; `minimal.rs`: a
//   response stored as its status, headers and a small value, rebuilt by a hook.

mod body;
mod builder;
mod commit;
mod config;
mod door;
mod fingerprinting;
mod future;
mod handle;
mod header_filter;
mod key_header;
mod minimal;
mod operator;
mod problem;
pub(crate) mod record;
mod recover;
mod replay;
pub mod scope;
mod service;
mod settings;
mod store_policy;

#[cfg(feature = "tonic")]
pub(crate) use self::settings::request_door_setters;
pub use self::{
    builder::IdempotencyLayer,
    fingerprinting::{Fingerprinting, MakeFingerprint},
    future::ResponseFuture,
    key_header::{KeyError, MAX_KEY_LEN, parse_key},
    minimal::{Minimal, Rebuild},
    operator::Operator,
    problem::KeyReused,
    service::Idempotency,
    settings::{Answers, Limits},
    store_policy::{DefaultStorePolicy, ReleaseKey, StorePolicy},
};

use crate::recovery::BoxError;

/// The header that marks a replayed response.
pub const REPLAYED_HEADER: &str = "idempotency-replayed";

/// The header that says when the key's record expires, on stored and replayed responses, when
/// [`Answers::advertise_expiry`] is on: an HTTP date. Not a standard header.
pub const EXPIRES_HEADER: &str = "idempotency-key-expires";
