//! The store knows its fleet (`Store::announce`): an instance whose naming cannot serve beside
//! what its fleet's registry lists is refused (503 `fleet-disagrees`, nothing run), on every
//! store, for each step an operator in a hurry skips during a move between namings; and an
//! instance refused at start leaves the fleet it was refused by serving.

use crate::common;

use std::time::Duration;

use axum::Router;
use axum_idempotency::{
    IdempotencyLayer, Idempotent,
    consumer::Error,
    hashing::{Deploy, Hashing},
    store::StoreError,
};
use common::*;

every_store!(
    each_hurried_step_is_refused_and_runs_nothing,
    a_door_refused_at_start_leaves_its_fleet_serving
);

fn keyed(byte: u8) -> Hashing {
    Hashing::keyed([byte; 32])
}

fn moving(from: Hashing, to: Hashing, deploy: Deploy) -> Hashing {
    from.moving_to(to, deploy).unwrap()
}

/// An instance in the fleet whose keys have `prefix`.
fn instance<H: Harness>(h: &H, calls: &Calls, prefix: &str, hashing: Hashing) -> Router {
    app(calls).layer(IdempotencyLayer::new(h.store()).key_prefix(prefix).hashing(hashing))
}

async fn each_hurried_step_is_refused_and_runs_nothing<H: Harness>(h: H) {
    let plain = Hashing::plain;
    // (what runs, what starts beside it): each is refused.
    let hurried = [
        // The naming changed in one deploy.
        (plain(), keyed(1)),
        // Deploy 1 skipped; deploy 2 skipped.
        (plain(), moving(plain(), keyed(1), Deploy::Second)),
        (moving(plain(), keyed(1), Deploy::First), keyed(1)),
        // Another secret during deploy 2.
        (moving(plain(), keyed(1), Deploy::Second), moving(plain(), keyed(3), Deploy::Second)),
        // A rotation begun during deploy 1.
        (moving(plain(), keyed(1), Deploy::First), moving(keyed(1), keyed(2), Deploy::First)),
        // A rollback too far: deploy 2 runs, deploy 0 starts.
        (moving(plain(), keyed(1), Deploy::Second), plain()),
    ];
    for (i, (running, starting)) in hurried.into_iter().enumerate() {
        let (calls, prefix) = (Calls::default(), format!("hurry-{i}"));
        let running = instance(&h, &calls, &prefix, running);
        let ran = send(&running, common::keyed("POST", "/payments", "k1", "{}")).await;
        assert_eq!(ran.status, 201, "case {i}");
        let starting = instance(&h, &calls, &prefix, starting);
        for key in ["k1", "k2"] {
            let refused = send(&starting, common::keyed("POST", "/payments", key, "{}")).await;
            refused.assert_problem(503, "fleet-disagrees");
            assert_eq!(refused.header("retry-after"), Some("1"), "case {i}");
        }
        assert_eq!(calls.get(), 1, "case {i}: nothing runs on the instance refused");
        // Failing open does not pass a refused request through.
        let open =
            IdempotencyLayer::new(h.store()).key_prefix(&prefix).hashing(keyed(9)).fail_open(true);
        let open = app(&calls).layer(open);
        let refused = send(&open, common::keyed("POST", "/payments", "k3", "{}")).await;
        refused.assert_problem(503, "fleet-disagrees");
        assert_eq!(calls.get(), 1, "case {i}: failing open ran it");
    }
    // The consumer door: a typed error that says which step is missing.
    let first = Idempotent::new(h.store()).hashing(moving(plain(), keyed(1), Deploy::First));
    let ran = first.run("orders", "evt-1", b"{}", |_| async { Ok::<_, String>(1_u32) }).await;
    assert!(ran.is_ok(), "{ran:?}");
    let new = Idempotent::new(h.store()).hashing(keyed(1));
    let refused = new.run("orders", "evt-2", b"{}", |_| async { Ok::<_, String>(2_u32) }).await;
    let Err(Error::Store(StoreError::Misplaced(why))) = refused else { panic!("{refused:?}") };
    assert!(why.contains("`Deploy::Second`) is missing"), "{why}");
}

async fn a_door_refused_at_start_leaves_its_fleet_serving<H: Harness>(h: H) {
    let calls = Calls::default();
    let prefix = "refused-at-start";
    let first = instance(&h, &calls, prefix, moving(Hashing::plain(), keyed(1), Deploy::First));
    assert_eq!(send(&first, common::keyed("POST", "/payments", "k1", "{}")).await.status, 201);
    let skipped = instance(&h, &calls, prefix, keyed(1));
    send(&skipped, common::keyed("POST", "/payments", "k2", "{}"))
        .await
        .assert_problem(503, "fleet-disagrees");
    // The fleet serves on past its next announcements (a third of a ten-second lease each),
    // and the instance refused stays refused.
    tokio::time::sleep(Duration::from_millis(3600)).await;
    for key in ["k2", "k3"] {
        let ran = send(&first, common::keyed("POST", "/payments", key, "{}")).await;
        assert_eq!((ran.status.as_u16(), ran.replayed()), (201, false), "{ran:?}");
    }
    send(&skipped, common::keyed("POST", "/payments", "k4", "{}"))
        .await
        .assert_problem(503, "fleet-disagrees");
    // Deploy 2 beside deploy 1: serves, and replays what deploy 1 ran.
    let second = instance(&h, &calls, prefix, moving(Hashing::plain(), keyed(1), Deploy::Second));
    assert!(send(&second, common::keyed("POST", "/payments", "k2", "{}")).await.replayed());
    assert_eq!(calls.get(), 3);
}
