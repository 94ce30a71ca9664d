//! The conformance check of [`Admin`]: the operator's calls on every state a record can be in.

use super::{
    Keys, LONG, PAST_SHORT, SHORT, assert_free, assert_in_progress, claimed, fp, probe, response,
    windowed,
};
use crate::store::{Admin, Claim, Fenced, Forgotten, RecordStatus};

fn ok<T, E: std::fmt::Display>(result: Result<T, E>, what: &str) -> T {
    result.unwrap_or_else(|error| panic!("{what}: the store failed: {error}"))
}

/// The operator's calls of a store that implements [`Admin`] (`inspect`, `forget`,
/// `abandoned`), against an absent key, a running claim, a lapsed one and a completed record:
/// what each reports, what each deletes or refuses, and what a later claim then sees.
///
/// # Panics
///
/// On the first answer that breaks the contract, naming the promise.
pub async fn check_admin<St: Admin>(store: &St) {
    let keys = Keys::new();
    let (absent, running, lapsed) = (keys.key("absent"), keys.key("running"), keys.key("lapsed"));
    let what = "inspect of an absent key";
    assert!(ok(store.inspect(&absent, true).await, what).is_none(), "{what}: a record");
    assert_eq!(
        ok(store.forget(&absent, true).await, "forget"),
        Forgotten::Absent,
        "forget of an absent key"
    );

    claimed(store, &running, &fp("1"), LONG.into(), "a running claim").await;
    let inspected = ok(store.inspect(&running, true).await, "inspect").expect("a running claim");
    let RecordStatus::Running { lease_left } = inspected.state else {
        panic!("inspect of a running claim: {inspected:?}");
    };
    assert!(lease_left <= LONG && lease_left > LONG / 2, "a running claim's lease: {lease_left:?}");
    assert_eq!(
        (inspected.size, inspected.outcome.as_ref()),
        (0, None),
        "a running claim's outcome"
    );
    assert_eq!(inspected.fingerprint, fp("1"), "a running claim's fingerprint");
    assert!(!inspected.waited_for, "a running claim nobody waits for is not waited for");

    claimed(store, &lapsed, &fp("2"), windowed(SHORT), "a claim left to lapse").await;
    tokio::time::sleep(PAST_SHORT).await;
    let inspected =
        ok(store.inspect(&lapsed, false).await, "inspect").expect("a lapsed claim in its window");
    assert!(
        matches!(inspected.state, RecordStatus::Lapsed { .. }),
        "inspect of a lapsed claim: {inspected:?}"
    );
    assert!(inspected.time_left > LONG / 2, "a lapsed claim is kept for its window: {inspected:?}");
    let listed = ok(store.abandoned(std::time::Duration::ZERO, u32::MAX).await, "abandoned");
    // Other checks may share the backend: only this check's keys are looked at.
    let mine = [&absent, &running, &lapsed];
    let ours: Vec<_> = listed.iter().filter(|claim| mine.contains(&&claim.key)).collect();
    assert_eq!(ours.len(), 1, "the abandoned listing: the lapsed claim alone, {ours:?}");
    assert_eq!((&ours[0].key, &ours[0].fingerprint), (&lapsed, &fp("2")), "the abandoned claim");

    assert_eq!(
        ok(store.forget(&running, false).await, "forget"),
        Forgotten::Running,
        "forget of a running claim, unforced"
    );
    assert_in_progress(store, &running, &fp("1"), "a running claim an unforced forget refused")
        .await;
    assert_eq!(
        ok(store.forget(&running, true).await, "forget"),
        Forgotten::Deleted,
        "forget of a running claim, forced"
    );
    assert_free(store, &running, "a running claim a forced forget deleted").await;
    assert_eq!(
        ok(store.forget(&lapsed, false).await, "forget"),
        Forgotten::Deleted,
        "forget of a lapsed claim"
    );
    assert_eq!(
        probe(store, &lapsed, &fp("2")).await,
        Claim::Claimed,
        "a lapsed claim forgotten is no takeover"
    );
    complete_check(store, &keys).await;
}

/// A completed record: inspected with its exact bytes when asked, forgotten without force.
async fn complete_check<St: Admin>(store: &St, keys: &Keys) {
    let k = keys.key("done");
    let owner = claimed(store, &k, &fp("4"), LONG.into(), "a claim to complete").await;
    let body = response("the stored response");
    let applied = ok(store.complete(&k, &owner, &fp("4"), body.clone(), LONG).await, "complete");
    assert_eq!(applied, Fenced::Applied, "complete");
    let inspected = ok(store.inspect(&k, true).await, "inspect").expect("a completed record");
    assert_eq!(inspected.state, RecordStatus::Completed, "inspect of a completed record");
    assert_eq!(inspected.outcome.as_ref(), Some(&body), "a completed record's outcome, asked for");
    assert_eq!(inspected.size, body.len(), "a completed record's size");
    assert!(inspected.time_left <= LONG && inspected.time_left > LONG / 2, "{inspected:?}");
    let quiet = ok(store.inspect(&k, false).await, "inspect").expect("a completed record");
    assert_eq!(quiet.outcome, None, "a completed record's outcome, not asked for");
    assert_eq!(
        ok(store.forget(&k, false).await, "forget"),
        Forgotten::Deleted,
        "forget of a completed record"
    );
    assert_free(store, &k, "a completed record forgotten").await;
}
