#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod fingerprint;
mod key;
mod layer;
mod problem;
mod record;
pub mod scope;
mod service;
pub mod store;

pub use deadpool_redis;

pub use crate::{
    fingerprint::Fingerprint,
    key::{KeyError, MAX_KEY_LEN, RecordKey, parse_key},
    layer::{IdempotencyLayer, StorePolicy, default_store_policy},
    scope::{ExtractorScope, GlobalScope, HeaderScope, ScopeExtractor},
    service::{Idempotency, REPLAYED_HEADER, ResponseFuture},
    store::{Claim, Fenced, MemoryStore, OwnerToken, RedisStore, Store, StoreError},
};
