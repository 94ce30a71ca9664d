//! The HTTP front door's configuration, shared by the layer that builds it and the service
//! that reads it.

use http::{HeaderName, Method};

use super::{
    fingerprinting::Fingerprinting,
    minimal::RebuildHook,
    recover::Hook,
    settings::{Answers, Limits},
    store_policy::Policy,
};

#[derive(Debug, Clone)]
pub(super) struct Config {
    pub(super) methods: Vec<Method>,
    pub(super) header: HeaderName,
    pub(super) require_key: bool,
    pub(super) prefix: String,
    pub(super) limits: Limits,
    pub(super) fingerprinting: Fingerprinting,
    pub(super) answers: Answers,
    pub(super) store_policy: Policy,
    pub(super) fail_open: bool,
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
            limits: Limits::default(),
            fingerprinting: Fingerprinting::default(),
            answers: Answers::default(),
            store_policy: Policy::default(),
            fail_open: false,
            recover: None,
            rebuild: None,
        }
    }
}
