#![doc = include_str!("docs/crate.md")]
#![doc = include_str!("docs/operating.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

// The README's snippets are compiled and run as doc tests, as the crate docs' are, without
// being rendered: the README is the repository's front page, the crate docs are docs.rs's.
// Each block compiles as a reader sees it (no hidden lines), so they are tested with the
// features they use: all of them (`scripts/test`, CI).
#[cfg(all(doctest, feature = "redis", feature = "postgres", feature = "tonic"))]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

#[cfg(test)]
mod readme {
    /// GitHub shows rustdoc's hidden lines (`# fn main() {`, `# #[cfg(…)]`) as they are: a
    /// block copied from the README must compile as shown.
    #[test]
    fn the_readme_rust_blocks_have_no_hidden_lines() {
        let readme = include_str!("../README.md");
        let mut in_rust = false;
        for (number, line) in readme.lines().enumerate() {
            if let Some(fence) = line.strip_prefix("```") {
                in_rust = !in_rust && fence.starts_with("rust");
                continue;
            }
            let hidden = line == "#" || line.starts_with("# ");
            assert!(!(in_rust && hidden), "README.md:{}: a hidden line: {line}", number + 1);
        }
    }
}

// Front doors → engine → store; `key`, `fingerprint`, `hashing` and `at_rest` are the
// vocabulary all three share.
mod at_rest;
pub mod completer;
#[cfg(feature = "conformance")]
pub mod conformance;
pub mod consumer;
mod context;
pub mod dedup;
pub mod durable;
#[cfg(feature = "encryption")]
pub mod encryption;
mod engine;
mod fingerprint;
#[cfg(feature = "tonic")]
pub mod grpc;
pub mod hashing;
mod key;
pub mod layer;
mod placement;
pub mod recovery;
pub mod settings;
pub mod store;

// The root holds what a first user writes; the rest is in the modules: `layer` (the layer's
// middleware, key parsing, scopes, store policy), `consumer`, `store` (the `Store` trait and
// what it speaks: claims, leases, tokens, record keys), `recovery`.
#[cfg(feature = "redis")]
pub use crate::store::RedisStore;
pub use crate::{
    consumer::Idempotent,
    context::IdempotencyContext,
    fingerprint::Fingerprint,
    layer::{IdempotencyLayer, scope::HeaderScope},
    store::MemoryStore,
};
