//! The outcome committed with the side effect (`examples/ledger.rs`, the documented way), both
//! doors, in both set-ups: PostgreSQL alone (`PostgresStore`), and Redis in front with
//! PostgreSQL the authority (`DurableOutcomes`, a private redis-server per test). The service
//! (and a consumer's delivery) runs as child processes over a database of each test's own
//! (dropped at the end) and is killed with SIGKILL at each window of a payment; each test runs
//! its window in both set-ups. The payment provider runs in the test, outside the killed process, and counts
//! its calls and charges per idempotency key. What a client sees, what the database holds and
//! what the provider charged are asserted from outside the processes: the retry gets the
//! committed response replayed, or runs the payment once; never twice, never an answer the
//! database does not hold.
//!
//! Needs PostgreSQL at `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`,
//! a role that may create databases) and `redis-server` on PATH; fails when either is missing.
#![cfg(all(feature = "postgres", feature = "redis"))]

use crate::common;

use common::ledger::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_before_the_claim_the_retry_runs_once() {
    in_both_set_ups(async |world| {
        let service = world.serve(None).await;
        killed_at(world, "before-claim").await;
        assert_eq!((world.record().await, world.payments().await), (None, 0));
        assert_eq!(world.provider.counts(), (0, 0));
        the_retry_runs_once(world, &service).await;
        assert_eq!(world.provider.counts(), (1, 1));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_right_after_the_claim_the_retry_waits_out_the_lease_and_runs_once() {
    in_both_set_ups(async |world| {
        // Started first: the retry comes within the dead holder's lease.
        let service = world.serve(None).await;
        killed_at(world, "after-claim").await;
        assert_eq!((world.record().await.as_deref(), world.payments().await), (Some("P"), 0));
        // At once, within the dead holder's lease: the layer waits (its default) until the
        // lease lapses, takes the key over, and runs the payment once.
        the_retry_runs_once(world, &service).await;
        assert_eq!(world.provider.counts(), (1, 1));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_external_call_before_its_row_the_retry_charges_nothing_more() {
    in_both_set_ups(async |world| {
        let service = world.serve(None).await;
        killed_at(world, "after-call").await;
        assert_eq!(world.provider.counts(), (1, 1));
        assert_eq!((world.record().await.as_deref(), world.payments().await), (Some("P"), 0));
        tokio::time::sleep(PAST_LEASE).await;
        // The handler runs again and calls the provider again, with the same derived key:
        // the provider answers its first charge, and charges nothing more.
        the_retry_runs_once(world, &service).await;
        assert_eq!(world.provider.counts(), (1, 2));
        assert_eq!(world.committed().await.unwrap().1, "ch_1");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_row_before_the_commit_the_retry_runs_once() {
    in_both_set_ups(async |world| {
        let service = world.serve(None).await;
        killed_at(world, "before-commit").await;
        // The row went with the transaction.
        assert_eq!((world.record().await.as_deref(), world.payments().await), (Some("P"), 0));
        tokio::time::sleep(PAST_LEASE).await;
        the_retry_runs_once(world, &service).await;
        assert_eq!(world.provider.counts(), (1, 2));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_commit_before_the_layer_stored_anything_the_retry_is_a_replay() {
    in_both_set_ups(async |world| {
        let service = world.serve(None).await;
        killed_at(world, "after-commit").await;
        assert_eq!(world.payments().await, 1);
        if world.redis.is_some() {
            // Redis still holds the dead claim; the outcome is in PostgreSQL. The retry waits
            // out the lease, takes the claim over, and the table answers it.
            assert_eq!(world.record().await.as_deref(), Some("P"));
            assert!(world.durable_outcome().await);
        } else {
            // The committed row is the record: the retry is a replay at once, within the
            // dead holder's lease, with no hook.
            assert_eq!(world.record().await.as_deref(), Some("C"));
        }
        the_retry_is_a_replay(world, &service).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_store_before_the_response_was_sent_the_retry_is_a_replay() {
    in_both_set_ups(async |world| {
        let service = world.serve(None).await;
        killed_at(world, "after-store").await;
        assert_eq!((world.record().await.as_deref(), world.payments().await), (Some("C"), 1));
        the_retry_is_a_replay(world, &service).await;
    })
    .await;
}

/// The retry is the committed payment, replayed; nothing ran again.
async fn the_retry_is_a_replay(world: &World, service: &Service) {
    let retry = pay(service.port, "pay-1").await.unwrap();
    assert_eq!((retry.status, retry.replayed), (201, true), "{retry:?}");
    the_answer_is_what_the_database_holds(world, &retry).await;
    assert_eq!((world.payments().await, world.provider.counts()), (1, (1, 1)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_losing_its_records_is_answered_from_postgresql_on_both_doors() {
    in_both_set_ups(async |world| {
        let Some(redis) = &world.redis else { return };
        let service = world.serve(None).await;
        let first = pay(service.port, "pay-1").await.unwrap();
        assert_eq!((first.status, first.replayed), (201, false), "{first:?}");
        let (what, delivered_first) = delivered(world).await;
        assert_eq!(what, "ran");
        let () = axum_idempotency::store::deadpool_redis::redis::cmd("FLUSHALL")
            .query_async(&mut redis.connection().await)
            .await
            .unwrap();
        let retry = pay(service.port, "pay-1").await.unwrap();
        assert_eq!((retry.status, retry.replayed, &retry.body), (201, true, &first.body));
        assert_eq!(delivered(world).await, ("replayed".to_owned(), delivered_first));
        // Two payments (one a door), two charges: nothing ran again.
        let sql = "SELECT count(*) FROM ledger_payments";
        let payments: i64 = world.db.client().await.query_one(sql, &[]).await.unwrap().get(0);
        assert_eq!((payments, world.provider.counts().0), (2, 2));
    })
    .await;
}

// The consumer door: `ledger consume`, one delivery of `evt_1` a process.

async fn worker_killed_at(world: &World, point: &str) {
    let mut doomed = deliver(world, Some(point));
    assert_eq!(doomed.line_starting("paused").await, format!("paused {point}"));
    doomed.sigkill().await;
}

/// The redelivery runs the payment once, and the one after it replays it.
async fn the_redelivery_runs_once(world: &World) {
    let (what, body) = delivered(world).await;
    assert_eq!(what, "ran", "{body}");
    let answer = Answer { status: 0, replayed: false, body: body.clone() };
    the_answer_is_what_the_database_holds(world, &answer).await;
    assert_eq!(delivered(world).await, ("replayed".to_owned(), body));
    assert_eq!(world.payments().await, 1);
    assert_eq!(world.provider.counts().0, 1, "the provider charged twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_before_the_claim_leaves_nothing_and_the_redelivery_runs_once() {
    in_both_set_ups(async |world| {
        worker_killed_at(world, "before-claim").await;
        assert_eq!((world.record().await, world.payments().await), (None, 0));
        the_redelivery_runs_once(world).await;
        assert_eq!(world.provider.counts(), (1, 1));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_right_after_the_claim_is_in_progress_then_runs_once_after_the_lease() {
    in_both_set_ups(async |world| {
        worker_killed_at(world, "after-claim").await;
        assert_eq!((world.record().await.as_deref(), world.payments().await), (Some("P"), 0));
        // The consumer door does not wait: within the lease, the redelivery is told to come
        // back.
        let (what, _) = delivered(world).await;
        assert!(what.starts_with("InProgress"), "{what}");
        tokio::time::sleep(PAST_LEASE).await;
        the_redelivery_runs_once(world).await;
        assert_eq!(world.provider.counts(), (1, 1));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_after_the_external_call_is_charged_once() {
    in_both_set_ups(async |world| {
        worker_killed_at(world, "after-call").await;
        assert_eq!(world.provider.counts(), (1, 1));
        assert_eq!((world.record().await.as_deref(), world.payments().await), (Some("P"), 0));
        tokio::time::sleep(PAST_LEASE).await;
        the_redelivery_runs_once(world).await;
        assert_eq!(world.provider.counts(), (1, 2));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_after_its_row_before_the_commit_runs_once_after_the_lease() {
    in_both_set_ups(async |world| {
        worker_killed_at(world, "before-commit").await;
        assert_eq!((world.record().await.as_deref(), world.payments().await), (Some("P"), 0));
        tokio::time::sleep(PAST_LEASE).await;
        the_redelivery_runs_once(world).await;
        assert_eq!(world.provider.counts(), (1, 2));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_after_its_commit_before_the_door_heard_of_it_is_replayed() {
    in_both_set_ups(async |world| {
        worker_killed_at(world, "after-commit").await;
        assert_eq!(world.payments().await, 1);
        if world.redis.is_some() {
            // Redis holds the dead claim until its lease lapses; then the table answers.
            assert_eq!(world.record().await.as_deref(), Some("P"));
            assert!(world.durable_outcome().await);
            tokio::time::sleep(PAST_LEASE).await;
        } else {
            assert_eq!(world.record().await.as_deref(), Some("C"));
        }
        the_redelivery_is_a_replay(world).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_after_the_door_settled_before_its_caller_heard_is_replayed() {
    in_both_set_ups(async |world| {
        worker_killed_at(world, "after-store").await;
        assert_eq!((world.record().await.as_deref(), world.payments().await), (Some("C"), 1));
        the_redelivery_is_a_replay(world).await;
    })
    .await;
}

async fn the_redelivery_is_a_replay(world: &World) {
    let (what, body) = delivered(world).await;
    assert_eq!(what, "replayed", "{body}");
    the_answer_is_what_the_database_holds(world, &Answer { status: 0, replayed: true, body }).await;
    assert_eq!((world.payments().await, world.provider.counts()), (1, (1, 1)));
}
