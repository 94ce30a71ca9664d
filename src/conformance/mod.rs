//! The store conformance kit: the behaviour every [`Store`] must have, as checks any store can
//! run against itself (feature `conformance`).
//!
//! The layer's guarantees rest on the store's: a claim that runs two handlers, a fenced write
//! that lands for a holder who lost its key, or a replay of other bytes is a payment made twice.
//! The checks drive a store through its public methods only, each against every state a record
//! can be in (absent, in progress by the caller or by another owner, lapsed within a recovery
//! window, completed, expired), and assert the exact answer and what a later claim sees.
//! [`MemoryStore`](crate::MemoryStore), [`RedisStore`](crate::RedisStore) (standalone and
//! Cluster), [`CachingStore`](crate::store::CachingStore) and
//! [`RegionalStore`](crate::store::RegionalStore) run them in this crate's tests,
//! and so does a store written in `tests/` against the public API alone.
//!
//! One test per check, in a test file of your store's crate:
//!
//! ```
//! // tests/conformance.rs
//! async fn store() -> axum_idempotency::MemoryStore {
//!     axum_idempotency::MemoryStore::new() // your store, connected to a fresh backend
//! }
//!
//! axum_idempotency::store_conformance_tests!(store);
//! # fn main() {}
//! ```
//!
//! or every check in one test: `conformance::check_all(&store).await`. A store that implements
//! the operator's calls ([`Admin`](crate::store::Admin)) runs [`check_admin`] too.
//!
//! Each check uses keys of its own (a random scope), so checks may share one backend and run
//! in parallel. They take about a second in all: leases of 150 ms are left to lapse. They
//! panic, naming the promise, on the first answer that breaks it.
//!
//! Not covered, because a black box cannot reach it: a value under a key that no store wrote
//! (a store must answer [`StoreError::CorruptRecord`](crate::store::StoreError::CorruptRecord) and
//! leave it alone), and a claim landing late after its caller gave up (a store whose claims can
//! arrive late implements [`Store::abandon`] and tests it against its backend).

mod admin;
mod checks;
mod fleet;
mod sequences;

use std::time::Duration;

use bytes::Bytes;

pub use self::admin::check_admin;
pub use self::checks::*;
pub use self::fleet::the_fleet_registry_keeps_each_entry_for_its_time;
pub use self::sequences::random_sequences_agree_with_the_model;
use crate::{
    fingerprint::Fingerprint,
    key::RecordKey,
    store::{Claim, Lease, OwnerToken, Store},
};

/// The name of every check, once: expands to `__conformance_each!` with `$mode` and the list.
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_checks {
    ($($mode:tt)*) => {
        $crate::__conformance_each!(($($mode)*)
            claim_on_absent_claims_for_the_lease,
            concurrent_claims_of_an_absent_key_take_it_once,
            claim_while_in_progress_reports_the_remaining_lease_or_mismatch,
            a_completed_record_replays_its_exact_bytes_for_its_retention,
            a_stored_response_is_never_overwritten,
            a_repeated_complete_of_the_same_response_is_applied,
            a_lapsed_claim_holds_nothing,
            a_stale_holder_is_fenced_out_of_the_new_owners_claim,
            a_stranger_is_fenced_out_while_the_owner_holds,
            release_by_the_owner_frees_the_key,
            release_and_touch_never_touch_a_completed_or_absent_key,
            touch_by_the_owner_renews_the_lease,
            a_lapsed_holder_nobody_took_over_from_may_still_complete,
            a_lapsed_claim_within_its_recovery_window_is_taken_over,
            a_taken_over_claim_is_remembered_for_a_window_again,
            touch_with_a_zero_lease_hands_the_key_to_the_next_claim,
            in_progress_reports_the_time_to_the_lease_deadline_not_the_window,
            abandon_ends_the_callers_claim_and_keeps_a_takeover,
            abandon_never_frees_another_owners_key,
            a_response_equal_to_the_owner_token_is_not_a_claim,
            a_waiter_is_woken_by_the_settle,
            random_sequences_agree_with_the_model,
            the_fleet_registry_keeps_each_entry_for_its_time,
        );
    };
}

/// What each check expands to: a `#[test]` ([`store_conformance_tests!`]) or a call
/// ([`check_all`]).
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_each {
    ((tests $make:path) $($check:ident),* $(,)?) => {
        $(
            #[test]
            fn $check() {
                $crate::conformance::block_on(async {
                    let store = $make().await;
                    $crate::conformance::$check(&store).await;
                });
            }
        )*
    };
    ((all $store:expr) $($check:ident),* $(,)?) => {
        $(
            $crate::conformance::$check($store).await;
        )*
    };
}

/// Generates one `#[test]` per conformance check, each with a store from `$make`, an
/// `async fn() -> impl Store` (a path to one). Each test runs on a current-thread tokio
/// runtime with every driver your tokio build has.
#[macro_export]
macro_rules! store_conformance_tests {
    ($make:path) => {
        $crate::__conformance_checks!(tests $make);
    };
}

/// Runs every check against `store`, one after the other.
///
/// # Panics
///
/// On the first answer that breaks the contract, naming the check and the promise.
pub async fn check_all<St: Store>(store: &St) {
    crate::__conformance_checks!(all store);
}

/// Runs `test` to completion on a current-thread runtime with every driver tokio was built
/// with: what [`store_conformance_tests!`](crate::store_conformance_tests) runs each check on.
///
/// # Panics
///
/// When the runtime cannot be built, or `test` panics.
#[doc(hidden)]
pub fn block_on<F: Future>(test: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime for the conformance check")
        .block_on(test)
}

/// A lease that does not lapse during a check.
pub(crate) const LONG: Duration = Duration::from_secs(30);
/// A lease a check lets lapse.
pub(crate) const SHORT: Duration = Duration::from_millis(150);
/// Longer than [`SHORT`]: a lease of that length has lapsed after it.
pub(crate) const PAST_SHORT: Duration = Duration::from_millis(300);

/// Keys of one check: a random scope, so that checks sharing a backend never meet.
pub(crate) struct Keys(Vec<u8>);

impl Keys {
    pub(crate) fn new() -> Self {
        let scope: [u8; 8] = rand::random();
        Self(scope.iter().map(|b| format!("{b:02x}")).collect::<String>().into_bytes())
    }

    pub(crate) fn key(&self, name: &str) -> RecordKey {
        RecordKey::new("conformance", &self.0, name.as_bytes())
    }
}

pub(crate) fn fp(body: &str) -> Fingerprint {
    Fingerprint::new("POST", "/payments", "", body.as_bytes())
}

pub(crate) fn response(body: &'static str) -> Bytes {
    Bytes::from_static(body.as_bytes())
}

/// A lease of `duration` remembered for a long recovery window once it lapses.
pub(crate) fn windowed(duration: Duration) -> Lease {
    Lease::new(duration).recovery_window(LONG)
}

/// A claim that must take the key.
pub(crate) async fn claimed<St: Store>(
    store: &St,
    key: &RecordKey,
    fp: &Fingerprint,
    lease: Lease,
    what: &str,
) -> OwnerToken {
    let owner = OwnerToken::random();
    match store.claim(key, fp, &owner, lease).await {
        Ok(Claim::Claimed) => owner,
        other => panic!("{what}: a claim of the key was expected to succeed, found {other:?}"),
    }
}

/// A probe with `fp`, under a token never used again: what a duplicate would be told.
pub(crate) async fn probe<St: Store>(store: &St, key: &RecordKey, fp: &Fingerprint) -> Claim {
    let probe = OwnerToken::random();
    match store.claim(key, fp, &probe, LONG.into()).await {
        Ok(claim) => claim,
        Err(error) => panic!("a claim failed: {error}"),
    }
}

/// The key holds a claim in progress: a probe is told so, with the time left.
pub(crate) async fn assert_in_progress<St: Store>(
    store: &St,
    key: &RecordKey,
    fp: &Fingerprint,
    what: &str,
) -> Duration {
    match probe(store, key, fp).await {
        Claim::InProgress { remaining } => remaining,
        other => panic!("{what}: expected the key in progress, found {other:?}"),
    }
}

/// The key holds exactly `expected`, completed for `fp`.
pub(crate) async fn assert_replays<St: Store>(
    store: &St,
    key: &RecordKey,
    fp: &Fingerprint,
    expected: &Bytes,
    what: &str,
) {
    match probe(store, key, fp).await {
        Claim::Replay { response, remaining } => {
            assert_eq!(&response, expected, "{what}: the replay is not the stored response");
            assert!(remaining > Duration::ZERO, "{what}: a live record with no time left");
        }
        other => panic!("{what}: expected a replay, found {other:?}"),
    }
}

/// The key is free: a claim with another fingerprint takes it.
pub(crate) async fn assert_free<St: Store>(store: &St, key: &RecordKey, what: &str) {
    claimed(store, key, &fp("a probe of another request"), LONG.into(), what).await;
}
