//! placeholder
pub struct Idempotent;
