//! What a [`GrpcIdempotencyLayer`](super::GrpcIdempotencyLayer) configures.

use std::{collections::HashSet, fmt, sync::Arc, time::Duration};

use bytes::Bytes;

use super::{GrpcStorePolicy, KeyFromMessage, Reply};
use crate::{
    layer::{Limits, record::HeaderFilter},
    recovery::Hook,
};

#[derive(Clone)]
pub(super) struct Config {
    pub(super) prefix: String,
    /// The unary methods handled, by path (`/package.Service/Method`).
    pub(super) methods: HashSet<String>,
    pub(super) key_from_message: Option<Arc<dyn KeyFromMessage>>,
    pub(super) require_key: bool,
    pub(super) store_policy: Arc<dyn GrpcStorePolicy>,
    pub(super) recover: Option<Hook<Bytes, Reply>>,
    /// `body` is the request message's; `stored_body` the stored message's; `stored_headers`
    /// the stored metadata's, headers and trailers.
    pub(super) limits: Limits,
    /// Which of a response's headers and trailers are stored: the HTTP layer's default.
    pub(super) filter: HeaderFilter,
    /// The server's own timeout (`Server::builder().timeout`), which tonic applies around this
    /// layer without telling it: a call's deadline is the shorter of it and the call's own.
    pub(super) server_timeout: Option<Duration>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            prefix: "idempotency-grpc".to_owned(),
            methods: HashSet::new(),
            key_from_message: None,
            require_key: true,
            store_policy: Arc::new(|code| code == tonic::Code::Ok),
            recover: None,
            limits: Limits::default(),
            filter: HeaderFilter::default(),
            server_timeout: None,
        }
    }
}

impl Config {
    /// Whether a reply's record would be over the stored limits.
    pub(super) fn over_limits(&self, reply: &super::record::Collected) -> bool {
        let (message, metadata) = reply.stored_sizes(&self.filter);
        message > self.limits.stored_body || metadata > self.limits.stored_headers
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("prefix", &self.prefix)
            .field("methods", &self.methods)
            .field("key_from_message", &self.key_from_message.is_some())
            .field("require_key", &self.require_key)
            .field("recover", &self.recover)
            .field("limits", &self.limits)
            .field("server_timeout", &self.server_timeout)
            .finish_non_exhaustive()
    }
}
