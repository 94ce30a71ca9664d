//! The operator's calls on every store (`store::Admin`, and the doors' `inspect`, `forget`,
//! `abandoned`): each record state inspected, forgotten and listed, as an operator sees it and
//! as the client's next retry then sees it.

#[macro_use]
mod common;

use std::time::Duration;

use axum::Router;
use axum_idempotency::settings::Waiting;
use axum_idempotency::{
    Fingerprint, IdempotencyLayer, Idempotent,
    consumer::Outcome,
    store::{Admin, Claim, Forgotten, Lease, OwnerToken, RecordKey, RecordStatus, Store},
};
use common::*;

every_store!(
    inspect_tells_each_state_and_the_body_only_when_asked,
    a_lapsed_claim_is_inspected_listed_and_forgotten,
    forget_lets_the_next_retry_run_and_refuses_a_running_one_unless_forced,
    a_forced_forget_wakes_the_duplicate_that_waits,
    the_consumer_door_inspects_and_forgets_by_scope_and_key,
    an_abandoned_claims_marker_is_no_record_and_is_left_alone,
    ; redis stores:
    a_value_the_layer_did_not_write_is_reported_and_left,
);

fn layer<H: Harness>(h: &H) -> IdempotencyLayer<H::Store> {
    IdempotencyLayer::new(h.store()).retention(Duration::from_secs(600))
}

async fn inspect_tells_each_state_and_the_body_only_when_asked<H: Harness>(h: H)
where
    H::Store: Admin,
{
    let calls = Calls::default();
    let layer = layer(&h);
    let app: Router = app(&calls).layer(layer.clone());
    assert!(layer.operator().inspect(b"", "k1", true).await.unwrap().is_none(), "absent");

    let first = send_until_claimed(&h, &app, delayed("/slow", "k1", 600, "{}"), "k1").await;
    let running = layer.operator().inspect(b"", "k1", true).await.unwrap().expect("in progress");
    let RecordStatus::Running { lease_left } = running.record.state else { panic!("{running:?}") };
    assert!(lease_left > Duration::ZERO && lease_left <= Duration::from_secs(30), "{lease_left:?}");
    assert_eq!((running.record.size, running.outcome.is_none()), (0, true));
    assert!(!running.record.waited_for, "nobody waits for it yet");
    assert_eq!(running.completed_ago, None);
    assert_eq!(running.key_hash, global("k1").hash());
    assert_eq!(first.await.unwrap().status, 201);

    let quiet = layer.operator().inspect(b"", "k1", false).await.unwrap().expect("completed");
    assert_eq!(quiet.record.state, RecordStatus::Completed);
    assert!(quiet.outcome.is_none() && quiet.record.outcome.is_none(), "{quiet:?}");
    assert!(quiet.record.size > 20, "{quiet:?}");
    assert!(!quiet.record.waited_for);
    let left = quiet.record.time_left;
    assert!(left > Duration::from_secs(590) && left <= Duration::from_secs(600), "{left:?}");
    assert!(quiet.completed_ago.expect("stored with its time") < Duration::from_secs(5));

    let loud = layer.operator().inspect(b"", "k1", true).await.unwrap().expect("completed");
    let response = loud.outcome.expect("asked for");
    assert_eq!(response.status(), 201);
    assert_eq!(response.headers()["x-payment"], "pay_1");
    assert_eq!(&response.body()[..], br#"{"call":1,"request":{}}"#);
    // Another scope, another record.
    assert!(layer.operator().inspect(b"tenant-b", "k1", false).await.unwrap().is_none());
    assert_eq!(calls.get(), 1);
}

/// Claims `key` under a 100 ms lease remembered for a minute after it, and lets it lapse.
async fn lapsed_claim<St: Store>(store: &St, key: &RecordKey, body: &str) -> Fingerprint {
    let fingerprint = Fingerprint::new("POST", "/payments", "", body.as_bytes());
    let lease = Lease::new(Duration::from_millis(100)).recovery_window(Duration::from_secs(60));
    let claim = store.claim(key, &fingerprint, &OwnerToken::random(), lease).await.unwrap();
    assert_eq!(claim, Claim::Claimed);
    fingerprint
}

async fn a_lapsed_claim_is_inspected_listed_and_forgotten<H: Harness>(h: H)
where
    H::Store: Admin,
{
    let store = h.store();
    let (older, newer) = (global("older"), global("newer"));
    let older_fingerprint = lapsed_claim(&store, &older, "a").await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    lapsed_claim(&store, &newer, "b").await;
    // A running claim and a completed record are never listed.
    let layer = layer(&h);
    let app: Router = app(&Calls::default()).layer(layer.clone());
    assert_eq!(send(&app, keyed("POST", "/payments", "done", "{}")).await.status, 201);
    let running = send_until_claimed(&h, &app, delayed("/slow", "running", 400, "{}"), "running");
    let running = running.await;
    tokio::time::sleep(Duration::from_millis(250)).await;

    let inspected = store.inspect(&older, false).await.unwrap().expect("kept for its window");
    let RecordStatus::Lapsed { lapsed_for } = inspected.state else { panic!("{inspected:?}") };
    assert!(lapsed_for >= Duration::from_millis(250), "{lapsed_for:?}");
    assert!(inspected.time_left > Duration::from_secs(50), "{inspected:?}");
    assert_eq!(inspected.fingerprint, older_fingerprint);

    let listed = layer.operator().abandoned(Duration::ZERO, 10).await.unwrap();
    let keys: Vec<&RecordKey> = listed.iter().map(|claim| &claim.key).collect();
    assert_eq!(keys, [&older, &newer], "oldest lapse first, nothing else: {listed:?}");
    assert_eq!(listed[0].fingerprint, older_fingerprint);
    assert!(listed[0].lapsed_for > listed[1].lapsed_for);
    let one = store.abandoned(Duration::ZERO, 1).await.unwrap();
    assert_eq!(one.iter().map(|claim| &claim.key).collect::<Vec<_>>(), [&older]);
    let long_ago = store.abandoned(Duration::from_secs(3600), 10).await.unwrap();
    assert!(long_ago.is_empty(), "{long_ago:?}");

    // A lapsed claim needs no force.
    assert_eq!(store.forget(&older, false).await.unwrap(), Forgotten::Deleted);
    assert!(store.inspect(&older, false).await.unwrap().is_none());
    let listed = store.abandoned(Duration::ZERO, 10).await.unwrap();
    assert_eq!(listed.iter().map(|claim| &claim.key).collect::<Vec<_>>(), [&newer]);
    assert_eq!(running.await.unwrap().status, 201);
}

async fn forget_lets_the_next_retry_run_and_refuses_a_running_one_unless_forced<H: Harness>(h: H)
where
    H::Store: Admin,
{
    let calls = Calls::default();
    // A duplicate is answered at once, so that it sees the original running.
    let layer = layer(&h).waiting(Waiting::off());
    let app: Router = app(&calls).layer(layer.clone());
    assert_eq!(layer.operator().forget(b"", "k1", false).await.unwrap(), Forgotten::Absent);

    assert_eq!(send(&app, keyed("POST", "/payments", "k1", "{}")).await.status, 201);
    assert!(send(&app, keyed("POST", "/payments", "k1", "{}")).await.replayed());
    assert_eq!(layer.operator().forget(b"", "k1", false).await.unwrap(), Forgotten::Deleted);
    assert_eq!(h.held(&global("k1")).await, None);
    let rerun = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    assert_eq!((rerun.status.as_u16(), rerun.replayed()), (201, false));
    assert_eq!(rerun.header("x-payment"), Some("pay_2"));

    let slow = send_until_claimed(&h, &app, delayed("/slow", "k2", 500, "{}"), "k2").await;
    assert_eq!(layer.operator().forget(b"", "k2", false).await.unwrap(), Forgotten::Running);
    assert_eq!(h.held(&global("k2")).await, Some(Held::InProgress), "refused, nothing deleted");
    send(&app, keyed("POST", "/slow", "k2", "{}")).await.assert_problem(202, "in-progress");
    assert_eq!(layer.operator().forget(b"", "k2", true).await.unwrap(), Forgotten::Deleted);
    assert_eq!(h.held(&global("k2")).await, None, "the key is free at once");
    // The operation ran on: its response, finished before any retry claimed the key, is
    // stored as the one answer, as for a lease that lapsed with nobody taking over.
    assert_eq!(slow.await.unwrap().status, 201);
    assert_eq!(h.held(&global("k2")).await, Some(Held::Completed));
    let replay = send(&app, keyed("POST", "/slow", "k2", "{}")).await;
    assert_eq!((replay.replayed(), replay.header("x-payment")), (true, Some("pay_3")));
    assert_eq!(calls.get(), 3);
}

async fn a_forced_forget_wakes_the_duplicate_that_waits<H: Harness>(h: H)
where
    H::Store: Admin,
{
    let calls = Calls::default();
    let layer = layer(&h).waiting(Waiting::up_to(Duration::from_secs(20)));
    let app: Router = app(&calls).layer(layer.clone());
    let first = send_until_claimed(&h, &app, delayed("/first-slow", "k1", 3000, "{}"), "k1").await;
    let duplicate = send_in_background(&app, delayed("/first-slow", "k1", 3000, "{}"));
    eventually("the duplicate marks the record as waited for", async || {
        let report = layer.operator().inspect(b"", "k1", false).await.unwrap();
        report.is_some_and(|report| report.record.waited_for)
    })
    .await;
    assert_eq!(layer.operator().forget(b"", "k1", true).await.unwrap(), Forgotten::Deleted);
    // Woken, the duplicate claims the key and runs: the second call answers at once.
    let woken = duplicate.await.unwrap();
    assert_eq!((woken.status.as_u16(), woken.replayed()), (201, false), "{woken:?}");
    assert_eq!(woken.header("x-payment"), Some("pay_2"));
    assert!(!first.is_finished(), "the duplicate did not wait for the original");
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(calls.get(), 2);
}

async fn the_consumer_door_inspects_and_forgets_by_scope_and_key<H: Harness>(h: H)
where
    H::Store: Admin,
{
    let idem = Idempotent::new(h.store());
    let runs = Calls::default();
    let deliver = || {
        let runs = runs.clone();
        idem.run("billing", "evt_1", br#"{"amount":100}"#, move |_| async move {
            Ok::<_, std::io::Error>(serde_json::json!({"charge": runs.next_call()}))
        })
    };
    assert!(matches!(deliver().await.unwrap(), Outcome::Ran(_)));
    let report =
        idem.operator().inspect("billing", "evt_1", true).await.unwrap().expect("completed");
    assert_eq!(report.record.state, RecordStatus::Completed);
    assert_eq!(report.outcome, Some(serde_json::json!({"charge": 1})));
    assert!(idem.operator().inspect("other", "evt_1", true).await.unwrap().is_none());
    assert!(matches!(deliver().await.unwrap(), Outcome::Replayed(_)));
    assert_eq!(
        idem.operator().forget("billing", "evt_1", false).await.unwrap(),
        Forgotten::Deleted
    );
    let again = deliver().await.unwrap();
    assert!(matches!(&again, Outcome::Ran(value) if value["charge"] == 2), "{again:?}");
    assert_eq!(runs.get(), 2);
}

async fn an_abandoned_claims_marker_is_no_record_and_is_left_alone<H: Harness>(h: H)
where
    H::Store: Admin,
{
    // A claim whose answer was lost, abandoned before it landed: the stores whose claims can
    // land late leave a marker under the absent key, which refuses that claim.
    let (store, key) = (h.store(), global("marker"));
    let fingerprint = Fingerprint::new("POST", "/payments", "", b"{}");
    let owner = OwnerToken::random();
    store.abandon(&key, &owner, &fingerprint, Lease::new(Duration::from_secs(60))).await.unwrap();
    let marked = h.held(&key).await;
    assert!(matches!(marked, None | Some(Held::Abandoned)), "{marked:?}");
    assert!(store.inspect(&key, true).await.unwrap().is_none());
    assert_eq!(store.forget(&key, true).await.unwrap(), Forgotten::Absent);
    assert_eq!(h.held(&key).await, marked, "the marker is left: it still refuses the late claim");
    assert!(store.abandoned(Duration::ZERO, 10).await.unwrap().is_empty());
}

async fn a_value_the_layer_did_not_write_is_reported_and_left<H: RawHarness>(h: H)
where
    H::Store: Admin,
{
    let key = global("planted");
    h.plant(&key, RawValue::String(b"not a record".to_vec())).await;
    let store = h.store();
    let error = store.inspect(&key, true).await.unwrap_err();
    assert!(!error.is_unavailable(), "{error}");
    let error = store.forget(&key, true).await.unwrap_err();
    assert!(!error.is_unavailable(), "{error}");
    assert_eq!(h.raw(&key).await.as_deref(), Some(&b"not a record"[..]), "left as it was");
    let other = global("planted-hash");
    h.plant(&other, RawValue::Hash).await;
    assert!(store.inspect(&other, false).await.is_err());
    assert!(store.abandoned(Duration::ZERO, 10).await.unwrap().is_empty());
}
