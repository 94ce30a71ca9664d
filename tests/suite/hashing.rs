//! Keyed hashes (`hashing(Hashing::keyed(secret))`), on every store: what is stored names no
//! record by the plain SHA-256 of its key, and holds no plain fingerprint of its request, so
//! that a reader of the store cannot confirm a guess; and a running service turns them on in
//! three deploys without running anything twice or losing a stored response.

use crate::common;

use std::time::Duration;

use axum::Router;
use axum_idempotency::{
    Fingerprint, IdempotencyLayer, Idempotent,
    consumer::Outcome,
    hashing::{Deploy, Hashing, HashingError},
    store::{Admin, Claim, Forgotten, Lease, OwnerToken, Store},
};
use common::*;

every_store!(
    keyed_names_hide_the_key_and_the_request,
    the_consumer_door_names_its_records_keyed_too,
    turning_keyed_hashes_on_in_three_deploys_strands_nothing,
    instances_of_neighbouring_deploys_run_a_request_once,
    a_holder_lapsed_under_the_old_names_is_taken_over_under_them,
    forgetting_a_key_forgets_it_under_both_names,
);

const SECRET: [u8; 32] = [0x5e; 32];

fn deploy(h: &impl Harness<Store: Admin>, calls: &Calls, hashing: Hashing) -> Router {
    app(calls).layer(IdempotencyLayer::new(h.store()).hashing(hashing))
}

fn plain_to_keyed() -> Hashing {
    Hashing::plain().moving_to(Hashing::keyed(SECRET), Deploy::First).unwrap()
}

fn keyed_from_plain() -> Hashing {
    Hashing::plain().moving_to(Hashing::keyed(SECRET), Deploy::Second).unwrap()
}

async fn keyed_names_hide_the_key_and_the_request<H: Harness>(h: H)
where
    H::Store: Admin,
{
    let calls = Calls::default();
    let layer = IdempotencyLayer::new(h.store()).hashing(Hashing::keyed(SECRET));
    let app = app(&calls).layer(layer.clone());
    let first = send(&app, keyed("POST", "/payments", "k1", r#"{"amount":1}"#)).await;
    assert_eq!(first.status, 201, "{first:?}");
    let retry = send(&app, keyed("POST", "/payments", "k1", r#"{"amount":1}"#)).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, first.body);
    send(&app, keyed("POST", "/payments", "k1", r#"{"amount":2}"#))
        .await
        .assert_problem(409, "key-reused");
    assert_eq!(calls.get(), 1);

    // Nothing is stored under the plain SHA-256 of the key: a reader cannot confirm "k1".
    assert_eq!(h.store().inspect(&global("k1"), false).await.unwrap(), None);
    assert_eq!(h.held(&global("k1")).await, None);
    assert_eq!(h.record_count().await, 1);
    // The operator finds it, under its keyed name, with a fingerprint that is not the
    // request's plain SHA-256.
    let report = layer.operator().inspect(b"", "k1", false).await.unwrap().expect("a record");
    assert_ne!(report.key_hash, global("k1").hash());
    let plain = Fingerprint::new("POST", "/payments", "", br#"{"amount":1}"#);
    assert_ne!(report.record.fingerprint, plain);
    // Another secret names another record, which would not find the old one: an instance
    // of it beside this one is refused (503, nothing run), and so is one with plain names.
    for other in [Hashing::keyed([0x77; 32]), Hashing::plain()] {
        let other = deploy(&h, &calls, other);
        send(&other, keyed("POST", "/payments", "k1", r#"{"amount":1}"#))
            .await
            .assert_problem(503, "fleet-disagrees");
    }
    assert_eq!(calls.get(), 1);
    // Under another prefix, another fleet: it serves.
    let apart = IdempotencyLayer::new(h.store()).key_prefix("other").hashing(Hashing::plain());
    let apart =
        send(&common::app(&calls).layer(apart), keyed("POST", "/payments", "k1", "{}")).await;
    assert_eq!((apart.status.as_u16(), calls.get()), (201, 2));
}

async fn the_consumer_door_names_its_records_keyed_too<H: Harness>(h: H)
where
    H::Store: Admin,
{
    let door = Idempotent::new(h.store()).hashing(Hashing::keyed(SECRET));
    let run = || door.run("orders", "evt-1", b"charge 100", |_| async { Ok::<_, String>(7_u32) });
    assert!(matches!(run().await, Ok(Outcome::Ran(7))));
    assert!(matches!(run().await, Ok(Outcome::Replayed(7))));
    let plain = axum_idempotency::store::RecordKey::new("idempotency", b"orders", b"evt-1");
    assert_eq!(h.store().inspect(&plain, false).await.unwrap(), None);
    let report = door.operator().inspect("orders", "evt-1", false).await.unwrap();
    let report = report.expect("a record under the keyed name");
    assert_ne!(report.record.fingerprint, Fingerprint::of_payload(b"charge 100"));
}

async fn turning_keyed_hashes_on_in_three_deploys_strands_nothing<H: Harness>(h: H)
where
    H::Store: Admin,
{
    let calls = Calls::default();
    // Short-lived records, so that deploy 3 may start once deploy 1's have expired.
    let short = |hashing| {
        let layer = IdempotencyLayer::new(h.store())
            .hashing(hashing)
            .lease(Duration::from_millis(300))
            .keep_alive(Some(Duration::from_millis(300)))
            .retention(Duration::from_secs(5));
        app(&calls).layer(layer)
    };
    let before = short(Hashing::plain());
    let pay = |key, body| keyed("POST", "/payments", key, body);

    // Completed before any deploy: replayed by deploy 1, and the key is still the request's.
    let done = send(&before, pay("done", "{}")).await;
    assert_eq!(done.status, 201);
    let first = short(plain_to_keyed());
    let retry = send(&first, pay("done", "{}")).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!((retry.status, &retry.body), (done.status, &done.body));
    send(&first, pay("done", r#"{"a":2}"#)).await.assert_problem(409, "key-reused");

    // Run by deploy 1: replayed by deploy 0 beside it.
    let ran = send(&first, pay("one", "{}")).await;
    assert_eq!((ran.status.as_u16(), ran.replayed()), (201, false));
    assert!(send(&before, pay("one", "{}")).await.replayed());
    // Deploy 2 while deploy 0 runs (a deploy skipped): refused. Once deploy 0's last instance
    // stopped (forgotten three announcements after, a second each here), deploy 2 replays it.
    let second = short(keyed_from_plain());
    send(&second, pay("one", "{}")).await.assert_problem(503, "fleet-disagrees");
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let second = short(keyed_from_plain());
    assert!(send(&second, pay("one", "{}")).await.replayed());
    // Deploy 3 while deploy 1's records may live: refused, saying that deploy 2 comes first
    // and deploy 3 after deploy 1's records expired.
    let after = short(Hashing::keyed(SECRET));
    send(&after, pay("two", "{}")).await.assert_problem(503, "fleet-disagrees");
    // Run by deploy 2.
    let ran = send(&second, pay("two", "{}")).await;
    assert_eq!((ran.status.as_u16(), ran.replayed()), (201, false));
    assert_eq!(calls.get(), 3);
    // Deploy 1's records expired (a lease, the keep-alive ceiling, the retention and its
    // recovery window, 10.6 s, after it last announced itself), and deploy 0's: deploy 3
    // serves, and replays what deploy 2 completed meanwhile.
    tokio::time::sleep(Duration::from_millis(8000)).await;
    let three = send(&second, pay("three", "{}")).await;
    assert_eq!((three.status.as_u16(), three.replayed()), (201, false));
    let after = short(Hashing::keyed(SECRET));
    let retry = send(&after, pay("three", "{}")).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, three.body);
    assert_eq!(calls.get(), 4);
}

async fn instances_of_neighbouring_deploys_run_a_request_once<H: Harness>(h: H)
where
    H::Store: Admin,
{
    let calls = Calls::default();
    // Each rolling deploy runs two neighbours side by side (a fleet, a key prefix, each): 50
    // duplicates spread over them, one handler run, every other answer 202 or the replay.
    let deploys = [Hashing::plain(), plain_to_keyed(), keyed_from_plain(), Hashing::keyed(SECRET)];
    for (round, pair) in deploys.windows(2).enumerate() {
        let instances: Vec<Router> = pair
            .iter()
            .map(|hashing| {
                let layer = IdempotencyLayer::new(h.store()).key_prefix(format!("round-{round}"));
                app(&calls).layer(layer.hashing(hashing.clone()))
            })
            .collect();
        let key: &'static str = Box::leak(format!("k{round}").into_boxed_str());
        let requests: Vec<_> = (0..50)
            .map(|i| send_in_background(&instances[i % 2], delayed("/slow", key, 50, "{}")))
            .collect();
        let mut originals = 0;
        for request in requests {
            let seen = request.await.unwrap();
            match seen.status.as_u16() {
                201 if !seen.replayed() => originals += 1,
                201 => assert_eq!(seen.header("x-payment"), Some(&*format!("pay_{}", round + 1))),
                202 => seen.assert_problem(202, "in-progress"),
                other => panic!("unexpected status {other}: {seen:?}"),
            }
        }
        assert_eq!(originals, 1, "deploys {round} and {}", round + 1);
        assert_eq!(calls.get(), round + 1);
    }
}

async fn a_holder_lapsed_under_the_old_names_is_taken_over_under_them<H: Harness>(h: H)
where
    H::Store: Admin,
{
    // An instance before the change claimed the key and died: its lease lapsed, its record is
    // kept for the recovery window.
    let plain = Fingerprint::new("POST", "/payments", "", b"{}");
    let lease = Lease::new(Duration::from_millis(100)).recovery_window(Duration::from_secs(60));
    let claimed = h.store().claim(&global("k1"), &plain, &OwnerToken::random(), lease).await;
    assert_eq!(claimed.unwrap(), Claim::Claimed);
    tokio::time::sleep(Duration::from_millis(300)).await;

    let calls = Calls::default();
    let second = deploy(&h, &calls, keyed_from_plain());
    let ran = send(&second, keyed("POST", "/payments", "k1", "{}")).await;
    assert_eq!((ran.status.as_u16(), ran.replayed()), (201, false));
    // Taken over under the plain name and claimed under the keyed one: completed under both,
    // so that the neighbours on either side replay it.
    assert_eq!(h.held(&global("k1")).await, Some(Held::Completed));
    assert_eq!(h.record_count().await, 2);
    let first = deploy(&h, &calls, plain_to_keyed());
    for instance in [&first, &second] {
        assert!(send(instance, keyed("POST", "/payments", "k1", "{}")).await.replayed());
    }
    assert_eq!(calls.get(), 1);
}

async fn forgetting_a_key_forgets_it_under_both_names<H: Harness>(h: H)
where
    H::Store: Admin,
{
    let calls = Calls::default();
    let layer = IdempotencyLayer::new(h.store()).hashing(keyed_from_plain());
    let second = app(&calls).layer(layer.clone());
    // Completed by deploy 2: under both names.
    send(&second, keyed("POST", "/payments", "k1", "{}")).await;
    assert_eq!((h.record_count().await, calls.get()), (2, 1));
    assert!(send(&second, keyed("POST", "/payments", "k1", "{}")).await.replayed());
    assert_eq!(layer.operator().forget(b"", "k1", false).await.unwrap(), Forgotten::Deleted);
    assert_eq!(h.record_count().await, 0);
    for instance in [&second, &deploy(&h, &calls, Hashing::keyed(SECRET))] {
        let again = send(instance, keyed("POST", "/payments", "k1", "{}")).await;
        assert_eq!(again.header("x-payment"), Some("pay_2"), "{again:?}");
    }
    assert_eq!(calls.get(), 2);
}

#[test]
fn a_move_is_between_two_other_namings() {
    let same = Hashing::keyed(SECRET).moving_to(Hashing::keyed(SECRET), Deploy::First);
    assert_eq!(same.unwrap_err(), HashingError::SameNames);
    let nested = Hashing::keyed(SECRET).moving_to(plain_to_keyed(), Deploy::Second);
    assert_eq!(nested.unwrap_err(), HashingError::Nested);
}
