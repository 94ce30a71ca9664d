//! The store contract: every transition (claim, complete, release, touch) against every state a
//! record can be in (absent, in progress by this owner, in progress by another owner, completed,
//! expired, and, for the Redis stores, a value the layer did not write), with the exact answer
//! and what the store holds afterwards. One suite, run against every store.
//!
//! Each test names the promise it pins; `TESTING.md` lists the mutants of `lua/*.lua` and
//! `src/store/memory.rs` that these tests kill.
// The Redis-only tests are compiled, unused, without the `redis` feature.
#![cfg_attr(not(feature = "redis"), allow(dead_code))]

#[macro_use]
mod common;

use std::time::Duration;

use axum_idempotency::{
    Fingerprint,
    store::{Claim, Fenced, Lease, OwnerToken, RecordKey, Store, StoreError},
};
use bytes::Bytes;
use common::*;

every_store!(
    claim_on_absent_claims_for_the_lease,
    claim_while_in_progress_reports_the_remaining_lease_or_mismatch,
    claim_on_completed_replays_the_exact_bytes_or_mismatches,
    claim_after_the_lease_lapsed_claims_anew,
    complete_by_the_owner_stores_the_response_for_its_retention,
    complete_by_a_stale_holder_over_a_new_owners_claim_is_fenced_out,
    complete_by_a_stranger_while_the_owner_holds_is_fenced_out,
    complete_over_a_completed_record_is_fenced_out,
    complete_after_a_lapsed_lease_nobody_took_stores_the_response,
    release_by_the_owner_frees_the_key,
    release_by_a_stale_holder_over_a_new_owners_claim_is_fenced_out,
    release_never_deletes_a_completed_record,
    release_of_an_absent_key_is_rejected_and_writes_nothing,
    touch_by_the_owner_renews_the_lease,
    touch_by_a_stale_holder_neither_renews_nor_takes_the_new_owners_claim,
    touch_of_a_completed_record_is_rejected_and_keeps_its_retention,
    touch_of_an_absent_key_is_rejected_and_writes_nothing,
    a_completed_record_whose_response_is_the_owner_token_is_not_a_claim,
    a_lapsed_claim_within_its_recovery_window_is_taken_over_and_its_holder_fenced_out,
    a_lapsed_claim_within_its_recovery_window_is_a_mismatch_for_another_fingerprint,
    a_lapsed_holder_nobody_took_over_from_may_still_settle,
    a_taken_over_claim_is_remembered_for_a_window_again,
    touch_with_a_zero_lease_hands_the_key_to_the_next_claim,
    in_progress_reports_the_time_to_the_deadline_not_to_the_end_of_the_window,
    a_replay_reports_the_time_left_of_its_retention;
    redis stores:
    an_in_progress_record_without_a_deadline_is_still_read,
    records_are_written_byte_for_byte,
    fenced_out_writes_leave_the_new_owners_record_byte_for_byte,
    foreign_values_are_reported_and_never_overwritten,
);

const LONG: Duration = Duration::from_secs(30);
const SHORT: Duration = Duration::from_millis(150);
/// Longer than [`SHORT`], so a lease of that length has lapsed after it.
const PAST_SHORT: Duration = Duration::from_millis(300);

fn key(name: &str) -> RecordKey {
    RecordKey::new("contract", b"tenant", name.as_bytes())
}

fn fp(body: &str) -> Fingerprint {
    Fingerprint::new("POST", "/payments", "", body.as_bytes())
}

fn response(body: &'static str) -> Bytes {
    Bytes::from_static(body.as_bytes())
}

/// A claim that must succeed.
async fn claimed<S: Store>(
    store: &S,
    key: &RecordKey,
    fp: &Fingerprint,
    lease: Duration,
) -> OwnerToken {
    let owner = OwnerToken::random();
    assert_eq!(store.claim(key, fp, &owner, lease.into()).await.unwrap(), Claim::Claimed);
    owner
}

/// The key holds an in-progress claim by someone: a probe with the same fingerprint is told so,
/// and is not given the key. The probe's token is never used again.
async fn assert_in_progress<S: Store>(store: &S, key: &RecordKey, fp: &Fingerprint) -> Duration {
    match store.claim(key, fp, &OwnerToken::random(), LONG.into()).await.unwrap() {
        Claim::InProgress { remaining } => remaining,
        other => panic!("expected the key in progress, found {other:?}"),
    }
}

/// The key holds a completed record with exactly `expected` as its response.
async fn assert_replays<S: Store>(store: &S, key: &RecordKey, fp: &Fingerprint, expected: &Bytes) {
    let probe = OwnerToken::random();
    match store.claim(key, fp, &probe, LONG.into()).await.unwrap() {
        Claim::Replay { response, remaining } => {
            assert_eq!(&response, expected);
            assert!(remaining > Duration::ZERO, "a live record with no time left");
        }
        other => panic!("expected a replay, found {other:?}"),
    }
}

/// The key is free: a claim takes it (and the test owns that claim afterwards).
async fn assert_free<S: Store>(store: &S, key: &RecordKey, fp: &Fingerprint) -> OwnerToken {
    claimed(store, key, fp, LONG).await
}

/// A lease of SHORT held by a first owner, lapsed, and the key then claimed by a second owner
/// for LONG: the setting in which fencing matters. Returns (stale holder, new owner).
async fn stale_and_new_owner<S: Store>(
    store: &S,
    key: &RecordKey,
    fp: &Fingerprint,
) -> (OwnerToken, OwnerToken) {
    let stale = claimed(store, key, fp, SHORT).await;
    tokio::time::sleep(PAST_SHORT).await;
    let new = claimed(store, key, fp, LONG).await;
    (stale, new)
}

async fn claim_on_absent_claims_for_the_lease<H: Harness>(h: H) {
    let store = h.store();
    let k = key("a");
    assert_eq!(h.held(&k).await, None);
    claimed(&store, &k, &fp("1"), LONG).await;
    assert_eq!(h.held(&k).await, Some(Held::InProgress));
    assert_eq!(h.record_count().await, 1);
}

async fn claim_while_in_progress_reports_the_remaining_lease_or_mismatch<H: Harness>(h: H) {
    let store = h.store();
    let k = key("a");
    claimed(&store, &k, &fp("1"), LONG).await;
    let remaining = assert_in_progress(&store, &k, &fp("1")).await;
    assert!(remaining <= LONG && remaining > LONG - Duration::from_secs(2), "{remaining:?}");
    assert_eq!(
        store.claim(&k, &fp("2"), &OwnerToken::random(), LONG.into()).await.unwrap(),
        Claim::Mismatch
    );
    // Neither probe took the key or changed it.
    assert_eq!(h.held(&k).await, Some(Held::InProgress));
    assert_eq!(h.record_count().await, 1);
}

async fn claim_on_completed_replays_the_exact_bytes_or_mismatches<H: Harness>(h: H) {
    let store = h.store();
    let k = key("a");
    let owner = claimed(&store, &k, &fp("1"), LONG).await;
    let stored = Bytes::from(vec![0u8, 255, 1, 254, b'x']);
    assert_eq!(
        store.complete(&k, &owner, &fp("1"), stored.clone(), LONG).await.unwrap(),
        Fenced::Applied
    );
    assert_replays(&store, &k, &fp("1"), &stored).await;
    assert_eq!(
        store.claim(&k, &fp("2"), &OwnerToken::random(), LONG.into()).await.unwrap(),
        Claim::Mismatch
    );
    assert_eq!(h.held(&k).await, Some(Held::Completed));
}

async fn claim_after_the_lease_lapsed_claims_anew<H: Harness>(h: H) {
    let store = h.store();
    let k = key("a");
    claimed(&store, &k, &fp("1"), SHORT).await;
    tokio::time::sleep(PAST_SHORT).await;
    // Even with another fingerprint: a lapsed claim holds nothing.
    claimed(&store, &k, &fp("2"), LONG).await;
    assert_in_progress(&store, &k, &fp("2")).await;
}

async fn complete_by_the_owner_stores_the_response_for_its_retention<H: Harness>(h: H) {
    let store = h.store();
    let k = key("a");
    let owner = claimed(&store, &k, &fp("1"), LONG).await;
    assert_eq!(
        store.complete(&k, &owner, &fp("1"), response("r1"), SHORT).await.unwrap(),
        Fenced::Applied
    );
    assert_replays(&store, &k, &fp("1"), &response("r1")).await;
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(h.held(&k).await, None);
    assert_free(&store, &k, &fp("1")).await;
}

async fn complete_by_a_stale_holder_over_a_new_owners_claim_is_fenced_out<H: Harness>(h: H) {
    let store = h.store();
    let k = key("a");
    let (stale, new) = stale_and_new_owner(&store, &k, &fp("1")).await;
    assert_eq!(
        store.complete(&k, &stale, &fp("1"), response("stale"), LONG).await.unwrap(),
        Fenced::Rejected
    );
    // The new owner's claim is untouched: still in progress, not the stale response.
    assert_eq!(h.held(&k).await, Some(Held::InProgress));
    assert_in_progress(&store, &k, &fp("1")).await;
    assert_eq!(
        store.complete(&k, &new, &fp("1"), response("new"), LONG).await.unwrap(),
        Fenced::Applied
    );
    assert_replays(&store, &k, &fp("1"), &response("new")).await;
}

async fn complete_by_a_stranger_while_the_owner_holds_is_fenced_out<H: Harness>(h: H) {
    let store = h.store();
    let k = key("a");
    let owner = claimed(&store, &k, &fp("1"), LONG).await;
    let stranger = OwnerToken::random();
    assert_eq!(
        store.complete(&k, &stranger, &fp("1"), response("stranger"), LONG).await.unwrap(),
        Fenced::Rejected
    );
    assert_in_progress(&store, &k, &fp("1")).await;
    assert_eq!(
        store.complete(&k, &owner, &fp("1"), response("owner"), LONG).await.unwrap(),
        Fenced::Applied
    );
    assert_replays(&store, &k, &fp("1"), &response("owner")).await;
}

async fn complete_over_a_completed_record_is_fenced_out<H: Harness>(h: H) {
    let store = h.store();
    let k = key("a");
    let owner = claimed(&store, &k, &fp("1"), LONG).await;
    assert_eq!(
        store.complete(&k, &owner, &fp("1"), response("first"), LONG).await.unwrap(),
        Fenced::Applied
    );
    // Neither the owner again (a duplicate settle) nor anyone else rewrites a stored response.
    for writer in [owner, OwnerToken::random()] {
        assert_eq!(
            store.complete(&k, &writer, &fp("1"), response("second"), LONG).await.unwrap(),
            Fenced::Rejected
        );
    }
    assert_replays(&store, &k, &fp("1"), &response("first")).await;
}

async fn complete_after_a_lapsed_lease_nobody_took_stores_the_response<H: Harness>(h: H) {
    let store = h.store();
    let k = key("a");
    let owner = claimed(&store, &k, &fp("1"), SHORT).await;
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(h.held(&k).await, None);
    // The response is still the one answer for the key.
    assert_eq!(
        store.complete(&k, &owner, &fp("1"), response("late"), LONG).await.unwrap(),
        Fenced::Applied
    );
    assert_replays(&store, &k, &fp("1"), &response("late")).await;
    assert_eq!(h.held(&k).await, Some(Held::Completed));
}

async fn release_by_the_owner_frees_the_key<H: Harness>(h: H) {
    let store = h.store();
    let k = key("a");
    let owner = claimed(&store, &k, &fp("1"), LONG).await;
    assert_eq!(store.release(&k, &owner).await.unwrap(), Fenced::Applied);
    assert_eq!(h.held(&k).await, None);
    assert_eq!(h.record_count().await, 0);
    // A released key is free for any request, whatever its fingerprint.
    assert_free(&store, &k, &fp("2")).await;
}

async fn release_by_a_stale_holder_over_a_new_owners_claim_is_fenced_out<H: Harness>(h: H) {
    let store = h.store();
    let k = key("a");
    let (stale, new) = stale_and_new_owner(&store, &k, &fp("1")).await;
    assert_eq!(store.release(&k, &stale).await.unwrap(), Fenced::Rejected);
    assert_eq!(store.release(&k, &OwnerToken::random()).await.unwrap(), Fenced::Rejected);
    assert_eq!(h.held(&k).await, Some(Held::InProgress));
    assert_in_progress(&store, &k, &fp("1")).await;
    // The new owner still holds it, and only it can release it.
    assert_eq!(store.release(&k, &new).await.unwrap(), Fenced::Applied);
    assert_eq!(h.held(&k).await, None);
}

async fn release_never_deletes_a_completed_record<H: Harness>(h: H) {
    let store = h.store();
    let k = key("a");
    let owner = claimed(&store, &k, &fp("1"), LONG).await;
    assert_eq!(
        store.complete(&k, &owner, &fp("1"), response("kept"), LONG).await.unwrap(),
        Fenced::Applied
    );
    // A late release by the owner itself (a guard firing after the complete) or by anyone else.
    for releaser in [owner, OwnerToken::random()] {
        assert_eq!(store.release(&k, &releaser).await.unwrap(), Fenced::Rejected);
    }
    assert_eq!(h.held(&k).await, Some(Held::Completed));
    assert_replays(&store, &k, &fp("1"), &response("kept")).await;
}

async fn release_of_an_absent_key_is_rejected_and_writes_nothing<H: Harness>(h: H) {
    let store = h.store();
    let k = key("a");
    assert_eq!(store.release(&k, &OwnerToken::random()).await.unwrap(), Fenced::Rejected);
    assert_eq!(h.held(&k).await, None);
    assert_eq!(h.record_count().await, 0);
}

async fn touch_by_the_owner_renews_the_lease<H: Harness>(h: H) {
    let store = h.store();
    let k = key("a");
    let owner = claimed(&store, &k, &fp("1"), SHORT).await;
    assert_eq!(store.touch(&k, &owner, LONG.into()).await.unwrap(), Fenced::Applied);
    tokio::time::sleep(PAST_SHORT).await;
    let remaining = assert_in_progress(&store, &k, &fp("1")).await;
    assert!(remaining > LONG - Duration::from_secs(2), "lease not renewed: {remaining:?}");
    // Still the owner's claim: it completes.
    assert_eq!(
        store.complete(&k, &owner, &fp("1"), response("r"), LONG).await.unwrap(),
        Fenced::Applied
    );
}

async fn touch_by_a_stale_holder_neither_renews_nor_takes_the_new_owners_claim<H: Harness>(h: H) {
    let store = h.store();
    let k = key("a");
    let stale = claimed(&store, &k, &fp("1"), SHORT).await;
    tokio::time::sleep(PAST_SHORT).await;
    let new = claimed(&store, &k, &fp("1"), SHORT).await;
    assert_eq!(store.touch(&k, &stale, LONG.into()).await.unwrap(), Fenced::Rejected);
    assert_eq!(
        store.touch(&k, &OwnerToken::random(), LONG.into()).await.unwrap(),
        Fenced::Rejected
    );
    // The new owner's short lease was not extended: it lapses on time.
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(h.held(&k).await, None);
    // And the stale holder did not become the owner: it cannot release what a third request
    // now claims, and the new owner cannot either.
    let third = claimed(&store, &k, &fp("1"), LONG).await;
    assert_eq!(store.release(&k, &stale).await.unwrap(), Fenced::Rejected);
    assert_eq!(store.release(&k, &new).await.unwrap(), Fenced::Rejected);
    assert_eq!(store.release(&k, &third).await.unwrap(), Fenced::Applied);
}

async fn touch_of_a_completed_record_is_rejected_and_keeps_its_retention<H: Harness>(h: H) {
    let store = h.store();
    let k = key("a");
    let owner = claimed(&store, &k, &fp("1"), LONG).await;
    assert_eq!(
        store.complete(&k, &owner, &fp("1"), response("r"), SHORT).await.unwrap(),
        Fenced::Applied
    );
    assert_eq!(store.touch(&k, &owner, LONG.into()).await.unwrap(), Fenced::Rejected);
    assert_replays(&store, &k, &fp("1"), &response("r")).await;
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(h.held(&k).await, None);
}

async fn touch_of_an_absent_key_is_rejected_and_writes_nothing<H: Harness>(h: H) {
    let store = h.store();
    let k = key("a");
    assert_eq!(
        store.touch(&k, &OwnerToken::random(), LONG.into()).await.unwrap(),
        Fenced::Rejected
    );
    assert_eq!(h.held(&k).await, None);
    assert_eq!(h.record_count().await, 0);
}

async fn a_completed_record_whose_response_is_the_owner_token_is_not_a_claim<H: Harness>(h: H) {
    let store = h.store();
    let k = key("a");
    let owner = claimed(&store, &k, &fp("1"), LONG).await;
    // A 16-byte response equal to the token: in Redis the record has the length, and the
    // tail, of an in-progress claim. Only its state says it is completed.
    let lookalike = Bytes::copy_from_slice(owner.as_bytes());
    assert_eq!(
        store.complete(&k, &owner, &fp("1"), lookalike.clone(), LONG).await.unwrap(),
        Fenced::Applied
    );
    assert_eq!(
        store.complete(&k, &owner, &fp("1"), response("second"), LONG).await.unwrap(),
        Fenced::Rejected
    );
    assert_eq!(store.touch(&k, &owner, LONG.into()).await.unwrap(), Fenced::Rejected);
    assert_eq!(store.release(&k, &owner).await.unwrap(), Fenced::Rejected);
    assert_replays(&store, &k, &fp("1"), &lookalike).await;
}

/// `version '1' | state | fingerprint (32) | owner (16) | deadline, or response`, as
/// `lua/claim.lua` documents it.
fn record(state: u8, fp: &Fingerprint, tail: &[u8]) -> Vec<u8> {
    let mut record = vec![b'1', state];
    record.extend_from_slice(fp.as_bytes());
    record.extend_from_slice(tail);
    record
}

/// Splits an in-progress record into its first 50 bytes and its lease deadline, in
/// milliseconds from now by this machine's clock (the test's Redis runs on it).
fn split_deadline(raw: Option<Vec<u8>>) -> (Vec<u8>, i64) {
    let raw = raw.expect("a record");
    assert!(raw.len() > 50, "no deadline in {raw:?}");
    let deadline: i64 = std::str::from_utf8(&raw[50..]).unwrap().parse().unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    (raw[..50].to_vec(), deadline - i64::try_from(now.as_millis()).unwrap())
}

async fn records_are_written_byte_for_byte<H: RawHarness>(h: H) {
    let store = h.store();
    let k = key("a");
    let owner = claimed(&store, &k, &fp("1"), LONG).await;
    let (head, deadline_in) = split_deadline(h.raw(&k).await);
    assert_eq!(head, record(b'P', &fp("1"), owner.as_bytes()));
    assert!(deadline_in > 28_000 && deadline_in <= 30_000, "lease deadline in {deadline_in} ms");
    // Without a recovery window the record goes with its lease.
    let pttl = h.pttl(&k).await;
    assert!(pttl > 28_000 && pttl <= 30_000, "lease PTTL {pttl}");
    assert_eq!(
        store.touch(&k, &owner, Duration::from_secs(60).into()).await.unwrap(),
        Fenced::Applied
    );
    assert!(h.pttl(&k).await > 58_000, "touch did not renew");
    let (head, deadline_in) = split_deadline(h.raw(&k).await);
    assert_eq!(head, record(b'P', &fp("1"), owner.as_bytes()));
    assert!(
        deadline_in > 58_000 && deadline_in <= 60_000,
        "touch moved the deadline to {deadline_in}"
    );
    // A recovery window keeps the record past the deadline.
    let windowed = Lease::new(Duration::from_secs(60)).recovery_window(Duration::from_secs(3600));
    assert_eq!(store.touch(&k, &owner, windowed).await.unwrap(), Fenced::Applied);
    let pttl = h.pttl(&k).await;
    assert!(pttl > 3_658_000 && pttl <= 3_660_000, "lease + window PTTL {pttl}");
    let (_, deadline_in) = split_deadline(h.raw(&k).await);
    assert!(deadline_in > 58_000 && deadline_in <= 60_000, "deadline {deadline_in}");
    let body = Bytes::from(vec![7u8; 300]);
    assert_eq!(
        store
            .complete(&k, &owner, &fp("1"), body.clone(), Duration::from_secs(3600))
            .await
            .unwrap(),
        Fenced::Applied
    );
    assert_eq!(h.raw(&k).await, Some(record(b'C', &fp("1"), &body)));
    let pttl = h.pttl(&k).await;
    assert!(pttl > 3_590_000 && pttl <= 3_600_000, "retention PTTL {pttl}");
}

async fn fenced_out_writes_leave_the_new_owners_record_byte_for_byte<H: RawHarness>(h: H) {
    let store = h.store();
    let k = key("a");
    let (stale, new) = stale_and_new_owner(&store, &k, &fp("1")).await;
    let expected = h.raw(&k).await;
    assert_eq!(split_deadline(expected.clone()).0, record(b'P', &fp("1"), new.as_bytes()));
    let pttl_before = h.pttl(&k).await;
    assert_eq!(
        store.complete(&k, &stale, &fp("1"), response("stale"), LONG).await.unwrap(),
        Fenced::Rejected
    );
    assert_eq!(store.release(&k, &stale).await.unwrap(), Fenced::Rejected);
    assert_eq!(
        store.touch(&k, &stale, Duration::from_secs(600).into()).await.unwrap(),
        Fenced::Rejected
    );
    assert_eq!(h.raw(&k).await, expected);
    let pttl_after = h.pttl(&k).await;
    assert!(
        pttl_after <= pttl_before,
        "a stale touch renewed the new owner's lease: {pttl_before} -> {pttl_after}"
    );
}

async fn foreign_values_are_reported_and_never_overwritten<H: RawHarness>(h: H) {
    let store = h.store();
    let mut in_progress_of_another_version = record(b'P', &fp("1"), &[9; 16]);
    in_progress_of_another_version[0] = b'2';
    let foreign = [
        ("plain text", RawValue::String(b"someone else's value".to_vec())),
        ("another version", RawValue::String(in_progress_of_another_version)),
        ("truncated", RawValue::String(b"1C".to_vec())),
        ("unknown state", RawValue::String(record(b'X', &fp("1"), b"body"))),
        ("in progress of the wrong length", RawValue::String(record(b'P', &fp("1"), &[9; 15]))),
        ("a deadline that is no number", RawValue::String(record(b'W', &fp("1"), &[b'x'; 20]))),
        ("a hash", RawValue::Hash),
    ];
    for (what, value) in foreign {
        let k = key(what);
        h.plant(&k, value).await;
        let before = h.describe(&k).await;
        let claim = store.claim(&k, &fp("1"), &OwnerToken::random(), LONG.into()).await;
        // The reason names what is wrong, from the script itself.
        let Err(StoreError::CorruptRecord(reason)) = claim else {
            panic!("{what}: claim gave {claim:?}")
        };
        let expected = match what {
            "a hash" => "not a string",
            "plain text" | "another version" | "truncated" => "unknown version or truncated",
            _ => "unknown state",
        };
        assert_eq!(reason, expected, "{what}");
        let owner = OwnerToken::random();
        assert_eq!(
            store.complete(&k, &owner, &fp("1"), response("r"), LONG).await.unwrap(),
            Fenced::Rejected,
            "{what}"
        );
        assert_eq!(store.release(&k, &owner).await.unwrap(), Fenced::Rejected, "{what}");
        assert_eq!(store.touch(&k, &owner, LONG.into()).await.unwrap(), Fenced::Rejected, "{what}");
        assert_eq!(h.describe(&k).await, before, "{what}: the value changed");
        assert_eq!(h.pttl(&k).await, -1, "{what}: an expiry was set");
    }
    // Another version's record under the very owner token that completes it (a claim's
    // record, its version byte rewritten): still not this layer's to write.
    let k = key("another version, the same owner");
    let owner = claimed(&store, &k, &fp("1"), LONG).await;
    let mut raw = h.raw(&k).await.expect("a record");
    raw[0] = b'2';
    h.plant(&k, RawValue::String(raw.clone())).await;
    assert_eq!(
        store.complete(&k, &owner, &fp("1"), response("r"), LONG).await.unwrap(),
        Fenced::Rejected
    );
    assert_eq!(h.raw(&k).await, Some(raw));
}

const WINDOW: Duration = Duration::from_secs(3600);

fn windowed(lease: Duration) -> Lease {
    Lease::new(lease).recovery_window(WINDOW)
}

async fn a_lapsed_claim_within_its_recovery_window_is_taken_over_and_its_holder_fenced_out<
    H: Harness,
>(
    h: H,
) {
    let store = h.store();
    let k = key("a");
    let stale = OwnerToken::random();
    assert_eq!(store.claim(&k, &fp("1"), &stale, windowed(SHORT)).await.unwrap(), Claim::Claimed);
    tokio::time::sleep(PAST_SHORT).await;
    // Past the lease the record is still there, and a claim takes it over.
    assert_eq!(h.held(&k).await, Some(Held::InProgress));
    let new = OwnerToken::random();
    assert_eq!(store.claim(&k, &fp("1"), &new, windowed(LONG)).await.unwrap(), Claim::TakenOver);
    // The new owner holds it for its lease: a probe is told so, and the lapsed holder can
    // neither complete, release nor renew.
    assert!(assert_in_progress(&store, &k, &fp("1")).await > LONG - Duration::from_secs(2));
    assert_eq!(
        store.complete(&k, &stale, &fp("1"), response("stale"), LONG).await.unwrap(),
        Fenced::Rejected
    );
    assert_eq!(store.release(&k, &stale).await.unwrap(), Fenced::Rejected);
    assert_eq!(store.touch(&k, &stale, windowed(LONG)).await.unwrap(), Fenced::Rejected);
    assert_eq!(
        store.complete(&k, &new, &fp("1"), response("new"), LONG).await.unwrap(),
        Fenced::Applied
    );
    assert_replays(&store, &k, &fp("1"), &response("new")).await;
}

async fn a_lapsed_claim_within_its_recovery_window_is_a_mismatch_for_another_fingerprint<
    H: Harness,
>(
    h: H,
) {
    let store = h.store();
    let k = key("a");
    let short_window = Lease::new(SHORT).recovery_window(Duration::from_millis(400));
    let owner = OwnerToken::random();
    assert_eq!(store.claim(&k, &fp("1"), &owner, short_window).await.unwrap(), Claim::Claimed);
    tokio::time::sleep(PAST_SHORT).await;
    // The first request may have happened: its key is not another request's yet.
    assert_eq!(
        store.claim(&k, &fp("2"), &OwnerToken::random(), windowed(LONG)).await.unwrap(),
        Claim::Mismatch
    );
    tokio::time::sleep(PAST_SHORT).await;
    // Past the window the record is gone: any request claims the key afresh.
    assert_eq!(h.held(&k).await, None);
    assert_eq!(
        store.claim(&k, &fp("2"), &OwnerToken::random(), windowed(LONG)).await.unwrap(),
        Claim::Claimed
    );
}

async fn a_lapsed_holder_nobody_took_over_from_may_still_settle<H: Harness>(h: H) {
    let store = h.store();
    let (completed, released) = (key("completed"), key("released"));
    let (first, second) = (OwnerToken::random(), OwnerToken::random());
    assert_eq!(
        store.claim(&completed, &fp("1"), &first, windowed(SHORT)).await.unwrap(),
        Claim::Claimed
    );
    assert_eq!(
        store.claim(&released, &fp("1"), &second, windowed(SHORT)).await.unwrap(),
        Claim::Claimed
    );
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(
        store.complete(&completed, &first, &fp("1"), response("late"), LONG).await.unwrap(),
        Fenced::Applied
    );
    assert_replays(&store, &completed, &fp("1"), &response("late")).await;
    assert_eq!(store.release(&released, &second).await.unwrap(), Fenced::Applied);
    assert_eq!(h.held(&released).await, None);
    // Released, the key is claimed afresh: nothing of the first run is left to recover.
    assert_eq!(
        store.claim(&released, &fp("1"), &OwnerToken::random(), windowed(LONG)).await.unwrap(),
        Claim::Claimed
    );
}

async fn a_taken_over_claim_is_remembered_for_a_window_again<H: Harness>(h: H) {
    let store = h.store();
    let k = key("a");
    let lease = Lease::new(SHORT).recovery_window(Duration::from_millis(400));
    assert_eq!(
        store.claim(&k, &fp("1"), &OwnerToken::random(), lease).await.unwrap(),
        Claim::Claimed
    );
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(
        store.claim(&k, &fp("1"), &OwnerToken::random(), lease).await.unwrap(),
        Claim::TakenOver
    );
    // The first claim's lease and window ended 550 ms after it, at 600 ms the record is still
    // there: the takeover's own lease and window keep it.
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(
        store.claim(&k, &fp("1"), &OwnerToken::random(), lease).await.unwrap(),
        Claim::TakenOver
    );
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(h.held(&k).await, None);
}

async fn touch_with_a_zero_lease_hands_the_key_to_the_next_claim<H: Harness>(h: H) {
    let store = h.store();
    let k = key("a");
    let owner = OwnerToken::random();
    assert_eq!(store.claim(&k, &fp("1"), &owner, windowed(LONG)).await.unwrap(), Claim::Claimed);
    let ended = Lease::new(Duration::ZERO).recovery_window(WINDOW);
    assert_eq!(store.touch(&k, &OwnerToken::random(), ended).await.unwrap(), Fenced::Rejected);
    assert!(assert_in_progress(&store, &k, &fp("1")).await > LONG - Duration::from_secs(2));
    assert_eq!(store.touch(&k, &owner, ended).await.unwrap(), Fenced::Applied);
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(h.held(&k).await, Some(Held::InProgress));
    assert_eq!(
        store.claim(&k, &fp("1"), &OwnerToken::random(), windowed(LONG)).await.unwrap(),
        Claim::TakenOver
    );
}

async fn in_progress_reports_the_time_to_the_deadline_not_to_the_end_of_the_window<H: Harness>(
    h: H,
) {
    let store = h.store();
    let k = key("a");
    let owner = OwnerToken::random();
    assert_eq!(store.claim(&k, &fp("1"), &owner, windowed(LONG)).await.unwrap(), Claim::Claimed);
    let remaining = assert_in_progress(&store, &k, &fp("1")).await;
    assert!(remaining <= LONG && remaining > LONG - Duration::from_secs(2), "{remaining:?}");
    let _ = h;
}

async fn an_in_progress_record_without_a_deadline_is_still_read<H: RawHarness>(h: H) {
    // An in-progress record of 50 bytes, as written before deadlines: it lives as long as its
    // lease, and is reported in progress (never taken over) until then.
    let store = h.store();
    let k = key("legacy");
    h.plant(&k, RawValue::String(record(b'P', &fp("1"), &[9; 16]))).await;
    assert!(matches!(
        store.claim(&k, &fp("1"), &OwnerToken::random(), windowed(LONG)).await.unwrap(),
        Claim::InProgress { .. }
    ));
    assert_eq!(
        store.claim(&k, &fp("2"), &OwnerToken::random(), windowed(LONG)).await.unwrap(),
        Claim::Mismatch
    );
    let stranger = OwnerToken::random();
    assert_eq!(store.release(&k, &stranger).await.unwrap(), Fenced::Rejected);
    assert_eq!(h.raw(&k).await, Some(record(b'P', &fp("1"), &[9; 16])));
}

async fn a_replay_reports_the_time_left_of_its_retention<H: Harness>(h: H) {
    let store = h.store();
    let k = key("a");
    let owner = claimed(&store, &k, &fp("1"), LONG).await;
    let retention = Duration::from_secs(60);
    let written = store.complete(&k, &owner, &fp("1"), response("r"), retention).await;
    assert_eq!(written.unwrap(), Fenced::Applied);
    tokio::time::sleep(Duration::from_millis(200)).await;
    match store.claim(&k, &fp("1"), &OwnerToken::random(), LONG.into()).await.unwrap() {
        Claim::Replay { remaining, .. } => assert!(
            remaining > Duration::from_secs(58) && remaining <= Duration::from_millis(59_850),
            "{remaining:?} left of 60 s, 200 ms in"
        ),
        other => panic!("expected a replay, found {other:?}"),
    }
}
