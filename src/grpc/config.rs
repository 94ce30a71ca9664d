//! What a [`GrpcIdempotencyLayer`](super::GrpcIdempotencyLayer) configures.

use std::{collections::HashSet, fmt, sync::Arc};

use bytes::Bytes;
use futures_util::future::BoxFuture;

use super::{DefaultGrpcStorePolicy, GrpcScope, GrpcStorePolicy, KeyFromMessage, Reply};
use crate::{
    layer::scope::GlobalScope,
    recovery::{BoxError, DurableTable, Lookup, Recover, Recovered},
};

/// The lookup of one call by the recovery hook, not yet started.
pub(super) type HookFuture = BoxFuture<'static, Result<Recovered<Reply>, BoxError>>;

/// The layer's recovery hook, its type erased, and whether it is durable
/// ([`Recover::durable`]).
pub(super) type Hook =
    (Arc<dyn Fn(Lookup<Bytes>) -> HookFuture + Send + Sync>, Option<DurableTable>);

/// `hook`, its type erased.
pub(super) fn hook(hook: impl Recover<Bytes, Reply>) -> Hook {
    let durable = hook.durable();
    let hook = Arc::new(hook);
    let ask = Arc::new(move |lookup| {
        let hook = hook.clone();
        Box::pin(async move { hook.recover(lookup).await }) as HookFuture
    });
    (ask, durable)
}

#[derive(Clone)]
pub(super) struct Config {
    pub(super) prefix: String,
    /// The unary methods handled, by path (`/package.Service/Method`).
    pub(super) methods: HashSet<String>,
    pub(super) key_from_message: Option<Arc<dyn KeyFromMessage>>,
    pub(super) require_key: bool,
    pub(super) scope: Arc<dyn GrpcScope>,
    pub(super) store_policy: Arc<dyn GrpcStorePolicy>,
    pub(super) recover: Option<Hook>,
    pub(super) message_limit: usize,
    pub(super) stored_limit: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            prefix: "idempotency-grpc".to_owned(),
            methods: HashSet::new(),
            key_from_message: None,
            require_key: true,
            scope: Arc::new(GlobalScope),
            store_policy: Arc::new(DefaultGrpcStorePolicy),
            recover: None,
            message_limit: 4 * 1024 * 1024,
            stored_limit: 1024 * 1024,
        }
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("prefix", &self.prefix)
            .field("methods", &self.methods)
            .field("key_from_message", &self.key_from_message.is_some())
            .field("require_key", &self.require_key)
            .field("recovers", &self.recover.is_some())
            .field("message_limit", &self.message_limit)
            .field("stored_limit", &self.stored_limit)
            .finish_non_exhaustive()
    }
}
