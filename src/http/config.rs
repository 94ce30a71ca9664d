//! The HTTP front door's configuration, shared by the layer that builds it and the service
//! that reads it.

use http::{HeaderName, Method, StatusCode};

use super::{
    fingerprinting::Intent, minimal::RebuildHook, record::HeaderFilter, recover::Hook,
    store_policy::Policy,
};

#[derive(Debug, Clone)]
pub(super) struct Config {
    pub(super) methods: Vec<Method>,
    pub(super) header: HeaderName,
    pub(super) require_key: bool,
    pub(super) prefix: String,
    pub(super) body_limit: usize,
    pub(super) stored_body_limit: usize,
    pub(super) stored_headers_limit: usize,
    pub(super) intent: Intent,
    pub(super) in_progress_status: StatusCode,
    pub(super) mismatch_status: StatusCode,
    pub(super) store_policy: Policy,
    pub(super) header_filter: HeaderFilter,
    pub(super) fail_open: bool,
    /// Say on stored and replayed responses when the key's record expires.
    pub(super) advertise_expiry: bool,
    pub(super) recover: Option<Hook>,
    /// Rebuilds the replay of a minimal record.
    pub(super) rebuild: Option<RebuildHook>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            methods: vec![Method::POST, Method::PATCH],
            header: HeaderName::from_static("idempotency-key"),
            require_key: false,
            prefix: "idempotency".to_owned(),
            body_limit: 1024 * 1024,
            stored_body_limit: 1024 * 1024,
            stored_headers_limit: 64 * 1024,
            intent: Intent::default(),
            in_progress_status: StatusCode::ACCEPTED,
            mismatch_status: StatusCode::CONFLICT,
            store_policy: Policy::default(),
            header_filter: HeaderFilter::default(),
            fail_open: false,
            advertise_expiry: false,
            recover: None,
            rebuild: None,
        }
    }
}
