//! The store contract where an answer was lost: a claim abandoned by a caller that never saw
//! its answer ([`Store::abandon`]), a complete repeated after it landed, and durations as
//! long as `Duration::MAX`. One suite, run against every store (see `tests/store_contract.rs`
//! for the other transitions).
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
    an_abandoned_takeover_keeps_the_record_for_the_next_takeover,
    an_abandoned_claim_without_a_window_frees_the_key,
    abandon_never_touches_another_owners_claim_or_a_stored_response,
    a_complete_repeated_after_it_landed_is_applied_and_rewrites_nothing,
    durations_as_long_as_duration_max_never_panic;
    redis stores:
    a_claim_landing_after_its_abandon_is_refused_and_blocks_nobody_else,
);

const LONG: Duration = Duration::from_secs(30);
const SHORT: Duration = Duration::from_millis(150);
const PAST_SHORT: Duration = Duration::from_millis(300);
const WINDOW: Duration = Duration::from_secs(60);

fn key(name: &str) -> RecordKey {
    RecordKey::new("lost", b"tenant", name.as_bytes())
}

fn fp(body: &str) -> Fingerprint {
    Fingerprint::new("POST", "/payments", "", body.as_bytes())
}

fn windowed(lease: Duration) -> Lease {
    Lease::new(lease).recovery_window(WINDOW)
}

async fn an_abandoned_takeover_keeps_the_record_for_the_next_takeover<H: Harness>(h: H) {
    // A holder dies after its side effect; a retry takes its claim over, but never hears so.
    let store = h.store();
    let k = key("a");
    let dead = OwnerToken::random();
    assert_eq!(store.claim(&k, &fp("1"), &dead, windowed(SHORT)).await.unwrap(), Claim::Claimed);
    tokio::time::sleep(PAST_SHORT).await;
    let unheard = OwnerToken::random();
    assert_eq!(
        store.claim(&k, &fp("1"), &unheard, windowed(LONG)).await.unwrap(),
        Claim::TakenOver
    );
    // Its guard abandons it: the lease ends, the record stays for the window.
    assert_eq!(
        store.abandon(&k, &unheard, &fp("1"), windowed(LONG)).await.unwrap(),
        Fenced::Applied
    );
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(h.held(&k).await, Some(Held::InProgress));
    // The next retry is told it takes over (so it asks the system of record), never a fresh
    // claim that would run the operation blind.
    let next = OwnerToken::random();
    assert_eq!(store.claim(&k, &fp("1"), &next, windowed(LONG)).await.unwrap(), Claim::TakenOver);
    // The abandoned owner is fenced out like any lapsed holder.
    assert_eq!(store.touch(&k, &unheard, windowed(LONG)).await.unwrap(), Fenced::Rejected);
    assert_eq!(
        store.complete(&k, &unheard, &fp("1"), Bytes::from_static(b"x"), LONG).await.unwrap(),
        Fenced::Rejected
    );
}

async fn an_abandoned_claim_without_a_window_frees_the_key<H: Harness>(h: H) {
    let store = h.store();
    let k = key("a");
    let owner = OwnerToken::random();
    assert_eq!(store.claim(&k, &fp("1"), &owner, LONG.into()).await.unwrap(), Claim::Claimed);
    assert_eq!(store.abandon(&k, &owner, &fp("1"), LONG.into()).await.unwrap(), Fenced::Applied);
    let next = OwnerToken::random();
    assert_eq!(store.claim(&k, &fp("1"), &next, LONG.into()).await.unwrap(), Claim::Claimed);
    assert_eq!(h.held(&k).await, Some(Held::InProgress));
}

async fn abandon_never_touches_another_owners_claim_or_a_stored_response<H: Harness>(h: H) {
    let store = h.store();
    let k = key("a");
    let owner = OwnerToken::random();
    assert_eq!(store.claim(&k, &fp("1"), &owner, windowed(LONG)).await.unwrap(), Claim::Claimed);
    let stranger = OwnerToken::random();
    assert_eq!(
        store.abandon(&k, &stranger, &fp("1"), windowed(LONG)).await.unwrap(),
        Fenced::Rejected
    );
    match store.claim(&k, &fp("1"), &OwnerToken::random(), windowed(LONG)).await.unwrap() {
        Claim::InProgress { remaining } => assert!(remaining > LONG - Duration::from_secs(2)),
        other => panic!("the owner's claim was disturbed: {other:?}"),
    }
    let response = Bytes::from_static(b"stored");
    let completed = store.complete(&k, &owner, &fp("1"), response.clone(), LONG).await;
    assert_eq!(completed.unwrap(), Fenced::Applied);
    for token in [&owner, &stranger] {
        assert_eq!(
            store.abandon(&k, token, &fp("1"), windowed(LONG)).await.unwrap(),
            Fenced::Rejected
        );
    }
    match store.claim(&k, &fp("1"), &OwnerToken::random(), LONG.into()).await.unwrap() {
        Claim::Replay { response: replayed, .. } => assert_eq!(replayed, response),
        other => panic!("the stored response was disturbed: {other:?}"),
    }
    // A response whose first bytes are the owner's token: in Redis the completed record has
    // the owner's bytes where an in-progress claim keeps them. Only its state tells.
    let k = key("lookalike");
    let owner = OwnerToken::random();
    assert_eq!(store.claim(&k, &fp("1"), &owner, windowed(LONG)).await.unwrap(), Claim::Claimed);
    let lookalike = Bytes::copy_from_slice(&[owner.as_bytes(), b"and more"].concat());
    let completed = store.complete(&k, &owner, &fp("1"), lookalike.clone(), LONG).await;
    assert_eq!(completed.unwrap(), Fenced::Applied);
    assert_eq!(
        store.abandon(&k, &owner, &fp("1"), windowed(LONG)).await.unwrap(),
        Fenced::Rejected
    );
    match store.claim(&k, &fp("1"), &OwnerToken::random(), LONG.into()).await.unwrap() {
        Claim::Replay { response: replayed, .. } => assert_eq!(replayed, lookalike),
        other => panic!("the stored response was disturbed: {other:?}"),
    }
}

async fn a_complete_repeated_after_it_landed_is_applied_and_rewrites_nothing<H: Harness>(h: H) {
    // A complete whose answer was lost is tried again: it finds its own response stored.
    let store = h.store();
    let k = key("a");
    let owner = OwnerToken::random();
    assert_eq!(store.claim(&k, &fp("1"), &owner, LONG.into()).await.unwrap(), Claim::Claimed);
    let response = Bytes::from_static(b"the response");
    for _ in 0..2 {
        let written = store.complete(&k, &owner, &fp("1"), response.clone(), LONG).await;
        assert_eq!(written.unwrap(), Fenced::Applied);
    }
    // Another response, or the same bytes under another fingerprint, is fenced out.
    let other = store.complete(&k, &owner, &fp("1"), Bytes::from_static(b"another"), LONG).await;
    assert_eq!(other.unwrap(), Fenced::Rejected);
    let refingerprinted = store.complete(&k, &owner, &fp("2"), response.clone(), LONG).await;
    assert_eq!(refingerprinted.unwrap(), Fenced::Rejected);
    match store.claim(&k, &fp("1"), &OwnerToken::random(), LONG.into()).await.unwrap() {
        Claim::Replay { response: replayed, .. } => assert_eq!(replayed, response),
        other => panic!("expected the first response, found {other:?}"),
    }
}

async fn durations_as_long_as_duration_max_never_panic<H: Harness>(h: H) {
    let store = h.store();
    let forever = Lease::new(Duration::MAX).recovery_window(Duration::MAX);
    let k = key("a");
    let owner = OwnerToken::random();
    assert_eq!(store.claim(&k, &fp("1"), &owner, forever).await.unwrap(), Claim::Claimed);
    assert_eq!(store.touch(&k, &owner, forever).await.unwrap(), Fenced::Applied);
    match store.claim(&k, &fp("1"), &OwnerToken::random(), forever).await.unwrap() {
        Claim::InProgress { remaining } => {
            assert!(remaining > Duration::from_secs(365 * 24 * 3600), "{remaining:?}");
        }
        other => panic!("expected in progress, found {other:?}"),
    }
    let response = Bytes::from_static(b"r");
    let written = store.complete(&k, &owner, &fp("1"), response.clone(), Duration::MAX).await;
    assert_eq!(written.unwrap(), Fenced::Applied);
    match store.claim(&k, &fp("1"), &OwnerToken::random(), forever).await.unwrap() {
        Claim::Replay { response: replayed, .. } => assert_eq!(replayed, response),
        other => panic!("expected a replay, found {other:?}"),
    }
    let ended = Lease::new(Duration::ZERO).recovery_window(Duration::MAX);
    let k = key("b");
    let owner = OwnerToken::random();
    assert_eq!(store.claim(&k, &fp("1"), &owner, forever).await.unwrap(), Claim::Claimed);
    assert_eq!(store.abandon(&k, &owner, &fp("1"), ended).await.unwrap(), Fenced::Applied);
    assert_eq!(
        store.claim(&k, &fp("1"), &OwnerToken::random(), forever).await.unwrap(),
        Claim::TakenOver
    );
}

async fn a_claim_landing_after_its_abandon_is_refused_and_blocks_nobody_else<H: RawHarness>(h: H) {
    // The claim sat in a paused server's socket buffer; its caller timed out, and its guard's
    // abandon reached the server first.
    let store = h.store();
    let k = key("a");
    let late = OwnerToken::random();
    assert_eq!(store.abandon(&k, &late, &fp("1"), LONG.into()).await.unwrap(), Fenced::Applied);
    let mut marker = vec![b'1', b'X'];
    marker.extend_from_slice(fp("1").as_bytes());
    marker.extend_from_slice(late.as_bytes());
    assert_eq!(h.raw(&k).await, Some(marker));
    let ttl = h.pttl(&k).await;
    assert!(ttl > 28_000 && ttl <= 30_000, "the marker lives one lease: {ttl} ms");
    assert_eq!(h.held(&k).await, Some(Held::Abandoned));
    // The late claim lands: refused, and nothing written.
    assert!(matches!(
        store.claim(&k, &fp("1"), &late, LONG.into()).await,
        Err(StoreError::ClaimAbandoned)
    ));
    assert_eq!(store.touch(&k, &late, LONG.into()).await.unwrap(), Fenced::Rejected);
    assert_eq!(store.release(&k, &late).await.unwrap(), Fenced::Rejected);
    // Anyone else sees an absent key: a claim (any fingerprint) takes it, and a holder whose
    // lease lapsed with nobody taking over may still store its response.
    let lapsed = OwnerToken::random();
    let written = store.complete(&k, &lapsed, &fp("1"), Bytes::from_static(b"r"), LONG).await;
    assert_eq!(written.unwrap(), Fenced::Applied);
    assert_eq!(h.held(&k).await, Some(Held::Completed));
    let k = key("b");
    assert_eq!(store.abandon(&k, &late, &fp("1"), LONG.into()).await.unwrap(), Fenced::Applied);
    let next = OwnerToken::random();
    assert_eq!(store.claim(&k, &fp("2"), &next, LONG.into()).await.unwrap(), Claim::Claimed);
    assert_eq!(h.held(&k).await, Some(Held::InProgress));
    // And the late claim, landing now, finds another's claim: it takes nothing.
    assert!(matches!(
        store.claim(&k, &fp("1"), &late, LONG.into()).await.unwrap(),
        Claim::Mismatch
    ));
    assert_eq!(store.release(&k, &next).await.unwrap(), Fenced::Applied);
}
