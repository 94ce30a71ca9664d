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

    /// The crate docs' Getting started is the README's, one heading level up: one text,
    /// which cannot drift (the README's is the one doc-tested with every feature).
    #[test]
    fn the_crate_docs_getting_started_is_the_readmes() {
        fn between<'a>(text: &'a str, from: &str, to: &str) -> &'a str {
            let start = text.find(from).expect(from);
            let end = start + text[start..].find(to).expect(to);
            &text[start..end]
        }
        let readme = between(
            include_str!("../README.md"),
            "## Getting started",
            "### Redis: every instance",
        );
        let raised: Vec<&str> = readme
            .lines()
            .map(|line| line.strip_prefix('#').filter(|_| line.starts_with("##")).unwrap_or(line))
            .collect();
        let docs =
            between(include_str!("docs/crate.md"), "# Getting started", "## Redis and PostgreSQL");
        assert_eq!(docs.lines().collect::<Vec<_>>(), raised);
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
