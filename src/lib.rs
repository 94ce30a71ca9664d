#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

// Front doors → engine → store; `key` and `fingerprint` are the vocabulary all three share.
#[cfg(feature = "conformance")]
pub mod conformance;
pub mod consumer;
mod context;
mod engine;
mod fingerprint;
mod http;
mod key;
pub mod recovery;
pub mod store;

#[cfg(feature = "redis")]
pub use deadpool_redis;

#[cfg(feature = "redis")]
pub use crate::store::RedisStore;
pub use crate::{
    consumer::Idempotent,
    context::IdempotencyContext,
    fingerprint::Fingerprint,
    http::{
        Idempotency, IdempotencyLayer, KeyError, MAX_KEY_LEN, MakeFingerprint, REPLAYED_HEADER,
        ResponseFuture, StorePolicy, default_store_policy, parse_key, scope,
        scope::{ExtractorScope, GlobalScope, HeaderScope, ScopeExtractor},
    },
    key::RecordKey,
    recovery::{Recover, Recovered},
    store::{Claim, Fenced, Lease, MemoryStore, OwnerToken, Store, StoreError},
};
