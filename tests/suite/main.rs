//! The integration tests, built and linked as one binary: a module a subject (the files
//! beside this one). A binary each built and linked the crate's dependencies' generic code
//! again for every file, minutes of every CI run. The tests that change their process (a
//! global metrics recorder, a global log subscriber and panic hook, the environment), that run
//! their own binary again as a child process, or that `scripts/hand-mutants.py` runs by name
//! stay binaries of their own, beside this folder.
//!
//! ```sh
//! scripts/test --test suite hashing::    # one module
//! ```

#[macro_use]
#[path = "../common/mod.rs"]
mod common;

mod behaviour;
#[cfg(feature = "redis")]
mod caching;
#[cfg(feature = "redis")]
mod clickstream_example;
mod cluster;
mod completer;
mod consumer;
mod consumer_results;
mod durable;
#[cfg(all(feature = "encryption", feature = "redis"))]
mod encryption;
mod expiry_header;
mod faults;
mod fleet;
mod hashing;
mod hashing_crashes;
mod hashing_moves;
mod hashing_reviews;
mod hostile;
mod key_prefixes;
mod late_claim_answers;
mod lease_held;
mod ledger;
#[cfg(feature = "redis")]
mod minimal;
#[cfg(feature = "redis")]
mod recovery;
mod recovery_hook;
mod recovery_points;
#[cfg(feature = "redis")]
mod redis;
#[cfg(feature = "redis")]
mod redis_connections;
#[cfg(feature = "tls-rustls")]
mod redis_tls;
#[cfg(all(feature = "conformance", feature = "redis"))]
mod regions;
#[cfg(all(feature = "conformance", feature = "redis"))]
mod regions_moves;
mod request_path;
#[cfg(feature = "sentinel")]
mod sentinel;
#[cfg(feature = "redis")]
mod server_example;
#[cfg(all(feature = "redis", feature = "postgres"))]
mod settle_stall;
mod streaming;
#[cfg(feature = "redis")]
mod streams;
#[cfg(feature = "redis")]
mod webhook_example;
