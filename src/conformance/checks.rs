//! The checks of the conformance kit, one promise of the [`Store`] contract each.

use std::time::Duration;

use bytes::Bytes;

use super::{
    Keys, LONG, PAST_SHORT, SHORT, assert_free, assert_in_progress, assert_replays, claimed, fp,
    probe, response, windowed,
};
use crate::store::{Claim, Fenced, Lease, OwnerToken, Store};

fn ok<T, E: std::fmt::Display>(result: Result<T, E>, what: &str) -> T {
    result.unwrap_or_else(|error| panic!("{what}: the store failed: {error}"))
}

/// An absent key is claimed for the caller's token; a second claim does not take it.
pub async fn claim_on_absent_claims_for_the_lease<St: Store>(store: &St) {
    let k = Keys::new().key("a");
    claimed(store, &k, &fp("1"), LONG.into(), "a first claim").await;
    assert_in_progress(store, &k, &fp("1"), "a second claim of a claimed key").await;
}

/// Claims of one absent key sent at once: exactly one takes it, and every other sees it in
/// progress (the claim is one atomic step, however the store finds the key absent).
pub async fn concurrent_claims_of_an_absent_key_take_it_once<St: Store>(store: &St) {
    let keys = Keys::new();
    for round in 0..20 {
        let k = keys.key(&format!("k{round}"));
        let owners: Vec<OwnerToken> = (0..8).map(|_| OwnerToken::random()).collect();
        let fingerprint = fp("1");
        let claims = owners.iter().map(|owner| store.claim(&k, &fingerprint, owner, LONG.into()));
        let answers = futures_util::future::join_all(claims).await;
        let mut taken = 0;
        for answer in answers {
            match ok(answer, "a claim among concurrent ones") {
                Claim::Claimed => taken += 1,
                Claim::InProgress { .. } => {}
                other => panic!("a claim among concurrent ones of an absent key: {other:?}"),
            }
        }
        assert_eq!(taken, 1, "concurrent claims of an absent key: {taken} took it, not one");
    }
}

/// A claim in progress answers a duplicate with the time left of its lease, and another
/// request with a mismatch; neither takes the key.
pub async fn claim_while_in_progress_reports_the_remaining_lease_or_mismatch<St: Store>(
    store: &St,
) {
    let what = "a claim while another is in progress";
    let k = Keys::new().key("a");
    let owner = claimed(store, &k, &fp("1"), LONG.into(), what).await;
    let remaining = assert_in_progress(store, &k, &fp("1"), what).await;
    assert!(
        remaining <= LONG && remaining > LONG - Duration::from_secs(2),
        "{what}: {remaining:?} left of a 30 s lease"
    );
    assert_eq!(probe(store, &k, &fp("2")).await, Claim::Mismatch, "{what}, another request");
    // The probes took nothing: the owner still completes.
    let completed = store.complete(&k, &owner, &fp("1"), response("r"), LONG).await;
    assert_eq!(ok(completed, what), Fenced::Applied, "{what}: the owner's complete");
}

/// A completed record replays the exact bytes it was given, binary included, for its
/// retention, with the time left; another request is a mismatch; after the retention the key
/// is free.
pub async fn a_completed_record_replays_its_exact_bytes_for_its_retention<St: Store>(store: &St) {
    let what = "a completed record";
    let k = Keys::new().key("a");
    let owner = claimed(store, &k, &fp("1"), LONG.into(), what).await;
    let stored = Bytes::from(vec![0u8, 255, 1, 254, b'x', 0]);
    let completed = store.complete(&k, &owner, &fp("1"), stored.clone(), SHORT * 3).await;
    assert_eq!(ok(completed, what), Fenced::Applied, "{what}: the owner's complete");
    match probe(store, &k, &fp("1")).await {
        Claim::Replay { response, remaining } => {
            assert_eq!(response, stored, "{what}: the replay is not the stored bytes");
            assert!(
                remaining > Duration::ZERO && remaining <= SHORT * 3,
                "{what}: {remaining:?} left of a {:?} retention",
                SHORT * 3
            );
        }
        other => panic!("{what}: expected a replay, found {other:?}"),
    }
    assert_eq!(probe(store, &k, &fp("2")).await, Claim::Mismatch, "{what}, another request");
    tokio::time::sleep(SHORT * 3 + PAST_SHORT).await;
    assert_free(store, &k, "a completed record past its retention").await;
}

/// Neither the owner again nor anyone else rewrites a stored response.
pub async fn a_stored_response_is_never_overwritten<St: Store>(store: &St) {
    let what = "a complete over a completed record";
    let k = Keys::new().key("a");
    let owner = claimed(store, &k, &fp("1"), LONG.into(), what).await;
    let first = store.complete(&k, &owner, &fp("1"), response("first"), LONG).await;
    assert_eq!(ok(first, what), Fenced::Applied, "{what}: the first complete");
    for writer in [owner, OwnerToken::random()] {
        let again = store.complete(&k, &writer, &fp("1"), response("second"), LONG).await;
        assert_eq!(ok(again, what), Fenced::Rejected, "{what}: another response was stored");
    }
    assert_replays(store, &k, &fp("1"), &response("first"), what).await;
}

/// A complete whose answer was lost is retried: the same response for the same request
/// already stored is applied (the retry learns it landed), and nothing changes.
pub async fn a_repeated_complete_of_the_same_response_is_applied<St: Store>(store: &St) {
    let what = "a complete repeated after a lost answer";
    let k = Keys::new().key("a");
    let owner = claimed(store, &k, &fp("1"), LONG.into(), what).await;
    for attempt in ["first", "repeated"] {
        let completed = store.complete(&k, &owner, &fp("1"), response("r"), LONG).await;
        assert_eq!(ok(completed, what), Fenced::Applied, "{what}: the {attempt} complete");
    }
    assert_replays(store, &k, &fp("1"), &response("r"), what).await;
}

/// A claim whose lease lapsed (without a recovery window) holds nothing: any request claims
/// the key anew.
pub async fn a_lapsed_claim_holds_nothing<St: Store>(store: &St) {
    let k = Keys::new().key("a");
    claimed(store, &k, &fp("1"), SHORT.into(), "a short claim").await;
    tokio::time::sleep(PAST_SHORT).await;
    assert_free(store, &k, "a claim past its lease").await;
}

/// A holder whose lease lapsed, and whose key another owner then claimed, can neither
/// complete, release nor renew over the new owner's claim; the new owner still completes.
pub async fn a_stale_holder_is_fenced_out_of_the_new_owners_claim<St: Store>(store: &St) {
    let what = "a stale holder's write over a new owner's claim";
    let k = Keys::new().key("a");
    let stale = claimed(store, &k, &fp("1"), SHORT.into(), what).await;
    tokio::time::sleep(PAST_SHORT).await;
    let new = claimed(store, &k, &fp("1"), LONG.into(), what).await;
    let complete = store.complete(&k, &stale, &fp("1"), response("stale"), LONG).await;
    assert_eq!(ok(complete, what), Fenced::Rejected, "{what}: complete");
    assert_eq!(ok(store.release(&k, &stale).await, what), Fenced::Rejected, "{what}: release");
    let touch = store.touch(&k, &stale, LONG.into()).await;
    assert_eq!(ok(touch, what), Fenced::Rejected, "{what}: touch");
    assert_in_progress(store, &k, &fp("1"), what).await;
    let completed = store.complete(&k, &new, &fp("1"), response("new"), LONG).await;
    assert_eq!(ok(completed, what), Fenced::Applied, "{what}: the new owner's complete");
    assert_replays(store, &k, &fp("1"), &response("new"), what).await;
}

/// A token that never held the key writes nothing while the owner holds it.
pub async fn a_stranger_is_fenced_out_while_the_owner_holds<St: Store>(store: &St) {
    let what = "a stranger's write while the owner holds the key";
    let k = Keys::new().key("a");
    let owner = claimed(store, &k, &fp("1"), LONG.into(), what).await;
    let stranger = OwnerToken::random();
    let complete = store.complete(&k, &stranger, &fp("1"), response("stranger"), LONG).await;
    assert_eq!(ok(complete, what), Fenced::Rejected, "{what}: complete");
    assert_eq!(ok(store.release(&k, &stranger).await, what), Fenced::Rejected, "{what}: release");
    assert_eq!(
        ok(store.touch(&k, &stranger, SHORT.into()).await, what),
        Fenced::Rejected,
        "{what}: touch"
    );
    let remaining = assert_in_progress(store, &k, &fp("1"), what).await;
    assert!(remaining > SHORT, "{what}: the stranger's touch shortened the lease");
    let completed = store.complete(&k, &owner, &fp("1"), response("owner"), LONG).await;
    assert_eq!(ok(completed, what), Fenced::Applied, "{what}: the owner's complete");
    assert_replays(store, &k, &fp("1"), &response("owner"), what).await;
}

/// The owner's release frees the key for any request, and only once.
pub async fn release_by_the_owner_frees_the_key<St: Store>(store: &St) {
    let what = "the owner's release";
    let k = Keys::new().key("a");
    let owner = claimed(store, &k, &fp("1"), LONG.into(), what).await;
    assert_eq!(ok(store.release(&k, &owner).await, what), Fenced::Applied, "{what}");
    assert_eq!(ok(store.release(&k, &owner).await, what), Fenced::Rejected, "{what}, again");
    assert_free(store, &k, what).await;
}

/// Release and touch never delete or change a completed record, and never create one.
pub async fn release_and_touch_never_touch_a_completed_or_absent_key<St: Store>(store: &St) {
    let what = "a release or touch of a completed or absent key";
    let keys = Keys::new();
    let (done, absent) = (keys.key("done"), keys.key("absent"));
    let owner = claimed(store, &done, &fp("1"), LONG.into(), what).await;
    let completed = store.complete(&done, &owner, &fp("1"), response("r"), LONG).await;
    assert_eq!(ok(completed, what), Fenced::Applied, "{what}: the owner's complete");
    for token in [owner.clone(), OwnerToken::random()] {
        let released = store.release(&done, &token).await;
        assert_eq!(ok(released, what), Fenced::Rejected, "{what}: release of a completed record");
        let touched = store.touch(&done, &token, Lease::new(Duration::ZERO)).await;
        assert_eq!(ok(touched, what), Fenced::Rejected, "{what}: touch of a completed record");
    }
    assert_replays(store, &done, &fp("1"), &response("r"), what).await;
    let released = store.release(&absent, &owner).await;
    assert_eq!(ok(released, what), Fenced::Rejected, "{what}: release of an absent key");
    let touched = store.touch(&absent, &owner, LONG.into()).await;
    assert_eq!(ok(touched, what), Fenced::Rejected, "{what}: touch of an absent key");
    assert_free(store, &absent, what).await;
}

/// The owner's touch renews the lease past its first end.
pub async fn touch_by_the_owner_renews_the_lease<St: Store>(store: &St) {
    let what = "the owner's touch";
    let k = Keys::new().key("a");
    let owner = claimed(store, &k, &fp("1"), (SHORT * 2).into(), what).await;
    let touched = store.touch(&k, &owner, LONG.into()).await;
    assert_eq!(ok(touched, what), Fenced::Applied, "{what}");
    tokio::time::sleep(SHORT * 2 + PAST_SHORT).await;
    let remaining = assert_in_progress(store, &k, &fp("1"), "a renewed lease").await;
    assert!(remaining > LONG - Duration::from_secs(3), "{what}: {remaining:?} left");
}

/// A holder whose lapsed lease nobody took over may still complete: its response is the one
/// answer for the key.
pub async fn a_lapsed_holder_nobody_took_over_from_may_still_complete<St: Store>(store: &St) {
    let what = "a complete after a lapsed lease nobody took";
    let k = Keys::new().key("a");
    let owner = claimed(store, &k, &fp("1"), SHORT.into(), what).await;
    tokio::time::sleep(PAST_SHORT).await;
    let completed = store.complete(&k, &owner, &fp("1"), response("late"), LONG).await;
    assert_eq!(ok(completed, what), Fenced::Applied, "{what}");
    assert_replays(store, &k, &fp("1"), &response("late"), what).await;
}

/// Within its recovery window, a lapsed claim is taken over by the same request (which then
/// holds it, fencing the lapsed holder out) and is a mismatch for another request.
pub async fn a_lapsed_claim_within_its_recovery_window_is_taken_over<St: Store>(store: &St) {
    let what = "a lapsed claim within its recovery window";
    let k = Keys::new().key("a");
    let stale = OwnerToken::random();
    let first = store.claim(&k, &fp("1"), &stale, windowed(SHORT)).await;
    assert_eq!(ok(first, what), Claim::Claimed, "{what}: the first claim");
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(probe(store, &k, &fp("2")).await, Claim::Mismatch, "{what}, another request");
    let new = OwnerToken::random();
    let taken = store.claim(&k, &fp("1"), &new, windowed(LONG)).await;
    assert_eq!(ok(taken, what), Claim::TakenOver, "{what}: the same request's claim");
    assert_in_progress(store, &k, &fp("1"), "a taken-over claim").await;
    let complete = store.complete(&k, &stale, &fp("1"), response("stale"), LONG).await;
    assert_eq!(ok(complete, what), Fenced::Rejected, "{what}: the lapsed holder's complete");
    let completed = store.complete(&k, &new, &fp("1"), response("new"), LONG).await;
    assert_eq!(ok(completed, what), Fenced::Applied, "{what}: the new owner's complete");
    assert_replays(store, &k, &fp("1"), &response("new"), what).await;
}

/// A takeover that lapses in turn is remembered for a window again: the next claim is a
/// takeover too, never a fresh claim.
pub async fn a_taken_over_claim_is_remembered_for_a_window_again<St: Store>(store: &St) {
    let what = "a lapsed takeover";
    let k = Keys::new().key("a");
    claimed(store, &k, &fp("1"), windowed(SHORT), what).await;
    tokio::time::sleep(PAST_SHORT).await;
    let second = store.claim(&k, &fp("1"), &OwnerToken::random(), windowed(SHORT)).await;
    assert_eq!(ok(second, what), Claim::TakenOver, "{what}: the first takeover");
    tokio::time::sleep(PAST_SHORT).await;
    let third = store.claim(&k, &fp("1"), &OwnerToken::random(), windowed(LONG)).await;
    assert_eq!(ok(third, what), Claim::TakenOver, "{what}: the second takeover");
}

/// A touch with a zero lease ends the lease now and keeps the record for its window: the next
/// claim takes it over at once.
pub async fn touch_with_a_zero_lease_hands_the_key_to_the_next_claim<St: Store>(store: &St) {
    let what = "a touch with a zero lease";
    let k = Keys::new().key("a");
    let owner = claimed(store, &k, &fp("1"), windowed(LONG), what).await;
    let ended = Lease::new(Duration::ZERO).recovery_window(LONG);
    assert_eq!(ok(store.touch(&k, &owner, ended).await, what), Fenced::Applied, "{what}");
    let next = store.claim(&k, &fp("1"), &OwnerToken::random(), windowed(LONG)).await;
    assert_eq!(ok(next, what), Claim::TakenOver, "{what}: the next claim");
}

/// A claim with a recovery window is in progress until its lease ends, not its window, and
/// says so.
pub async fn in_progress_reports_the_time_to_the_lease_deadline_not_the_window<St: Store>(
    store: &St,
) {
    let what = "a windowed claim in progress";
    let k = Keys::new().key("a");
    claimed(store, &k, &fp("1"), Lease::new(SHORT * 4).recovery_window(LONG), what).await;
    let remaining = assert_in_progress(store, &k, &fp("1"), what).await;
    assert!(remaining <= SHORT * 4, "{what}: {remaining:?} left of a {:?} lease", SHORT * 4);
}

/// The caller's abandon ends its claim: without a window the key is free, with one the next
/// claim of the same request takes it over (the operation may have happened).
pub async fn abandon_ends_the_callers_claim_and_keeps_a_takeover<St: Store>(store: &St) {
    let what = "an abandon of the caller's claim";
    let keys = Keys::new();
    let (plain, kept) = (keys.key("plain"), keys.key("kept"));
    let owner = claimed(store, &plain, &fp("1"), LONG.into(), what).await;
    let abandoned = store.abandon(&plain, &owner, &fp("1"), LONG.into()).await;
    assert_eq!(ok(abandoned, what), Fenced::Applied, "{what}, without a window");
    assert_free(store, &plain, what).await;
    let owner = claimed(store, &kept, &fp("1"), windowed(LONG), what).await;
    let abandoned = store.abandon(&kept, &owner, &fp("1"), windowed(LONG)).await;
    assert_eq!(ok(abandoned, what), Fenced::Applied, "{what}, with a window");
    let next = store.claim(&kept, &fp("1"), &OwnerToken::random(), windowed(LONG)).await;
    assert_eq!(ok(next, what), Claim::TakenOver, "{what}: the next claim of the same request");
}

/// An abandon by a token that does not hold the key frees nothing: not another owner's
/// claim, not a stored response; on an absent key, every other claim still claims it.
pub async fn abandon_never_frees_another_owners_key<St: Store>(store: &St) {
    let what = "an abandon by a token that does not hold the key";
    let keys = Keys::new();
    let (held, done, absent) = (keys.key("held"), keys.key("done"), keys.key("absent"));
    let owner = claimed(store, &held, &fp("1"), LONG.into(), what).await;
    let abandoned = store.abandon(&held, &OwnerToken::random(), &fp("1"), LONG.into()).await;
    assert_eq!(ok(abandoned, what), Fenced::Rejected, "{what}: another owner's claim");
    assert_in_progress(store, &held, &fp("1"), what).await;
    let completed = store.complete(&done, &owner, &fp("1"), response("r"), LONG).await;
    assert_eq!(ok(completed, what), Fenced::Applied, "{what}: a complete of an absent key");
    let abandoned = store.abandon(&done, &owner, &fp("1"), LONG.into()).await;
    assert_eq!(ok(abandoned, what), Fenced::Rejected, "{what}: a stored response");
    assert_replays(store, &done, &fp("1"), &response("r"), what).await;
    // Applied (a marker against that token's late claim) or Rejected (nothing to do): either
    // way the key is free for everyone else.
    ok(store.abandon(&absent, &OwnerToken::random(), &fp("1"), LONG.into()).await, what);
    claimed(store, &absent, &fp("1"), LONG.into(), "a claim of an abandoned absent key").await;
}

/// A response whose bytes equal the owner token is a completed record like any other, not
/// the owner's claim.
pub async fn a_response_equal_to_the_owner_token_is_not_a_claim<St: Store>(store: &St) {
    let what = "a response equal to the owner token";
    let k = Keys::new().key("a");
    let owner = claimed(store, &k, &fp("1"), LONG.into(), what).await;
    let token = Bytes::copy_from_slice(owner.as_bytes());
    let completed = store.complete(&k, &owner, &fp("1"), token.clone(), LONG).await;
    assert_eq!(ok(completed, what), Fenced::Applied, "{what}: the owner's complete");
    assert_eq!(ok(store.release(&k, &owner).await, what), Fenced::Rejected, "{what}: release");
    let touched = store.touch(&k, &owner, LONG.into()).await;
    assert_eq!(ok(touched, what), Fenced::Rejected, "{what}: touch");
    assert_replays(store, &k, &fp("1"), &token, what).await;
}

/// A waiter subscribes, claims with `claim_waiting` (which answers as `claim` does), and is
/// woken by the settle, a complete or a release. A store that cannot notify returns
/// [`Subscription::unsupported`](crate::store::Subscription::unsupported) (its waiters are
/// polled); only its answers are checked.
pub async fn a_waiter_is_woken_by_the_settle<St: Store>(store: &St) {
    let what = "a waiter";
    let keys = Keys::new();
    for (name, complete) in [("completed", true), ("released", false)] {
        let k = keys.key(name);
        let owner = claimed(store, &k, &fp("1"), LONG.into(), what).await;
        let mut subscription = store.subscribe(&k).await;
        let waiting = store.claim_waiting(&k, &fp("1"), &OwnerToken::random(), LONG.into()).await;
        assert!(
            matches!(ok(waiting, what), Claim::InProgress { .. }),
            "{what}: claim_waiting of a claim in progress"
        );
        let other = store.claim_waiting(&k, &fp("2"), &OwnerToken::random(), LONG.into()).await;
        assert_eq!(ok(other, what), Claim::Mismatch, "{what}: claim_waiting, another request");
        let settled = if complete {
            store.complete(&k, &owner, &fp("1"), response("r"), LONG).await
        } else {
            store.release(&k, &owner).await
        };
        assert_eq!(ok(settled, what), Fenced::Applied, "{what}: the settle ({name})");
        if subscription.is_live() {
            let woken = tokio::time::timeout(Duration::from_secs(2), subscription.settled()).await;
            assert!(woken.is_ok(), "{what} was not woken within 2 s of the settle ({name})");
        }
        match (complete, probe(store, &k, &fp("1")).await) {
            (true, Claim::Replay { response: r, .. }) => assert_eq!(r, response("r"), "{what}"),
            (false, Claim::Claimed) => {}
            (_, other) => panic!("{what}: after the settle ({name}), found {other:?}"),
        }
    }
}
