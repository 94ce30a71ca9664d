//! Recovery points (`RecoveryPoints`): `POST /orders` of `examples/ledger.rs` makes an order row
//! (a step), calls the payment provider (a step), then records the charge on the order with the
//! response, and is killed with SIGKILL after each step committed. The takeover resumes after
//! the last step that committed: the steps before it do not run again (one order row, one call
//! to the provider), in both set-ups (PostgreSQL alone; Redis in front).
//!
//! Needs PostgreSQL at `DATABASE_URL` and `redis-server` on PATH; fails when either is missing.
#![cfg(all(feature = "postgres", feature = "redis"))]

mod common;

use common::ledger::*;
use serde_json::json;

/// The order rows, and the charge recorded on the one there should be.
async fn orders(world: &World) -> (i64, Option<(i64, Option<String>)>) {
    let client = world.db.client().await;
    let count = client.query_one("SELECT count(*) FROM ledger_orders", &[]).await.unwrap().get(0);
    let row = client.query_opt("SELECT id, charge FROM ledger_orders LIMIT 1", &[]).await.unwrap();
    (count, row.map(|row| (row.get(0), row.get(1))))
}

/// Killed after `point`'s step committed; the retry (the layer waits out the dead holder's
/// lease, then takes it over) resumes after it, and every later retry replays the order.
async fn resumes_after(point: &str) {
    in_both_set_ups(async |world| {
        let service = world.serve(None).await;
        killed_at_path(world, "/orders", point).await;
        let (calls_before, orders_before) = (world.provider.counts().1, orders(world).await.0);
        assert_eq!(orders_before, 1, "the order step committed");
        let retry = post(service.port, "/orders", "pay-1").await.unwrap();
        assert_eq!((retry.status, retry.replayed), (201, false), "{retry:?}");
        let (count, order) = orders(world).await;
        let (id, charge) = order.unwrap();
        assert_eq!(count, 1, "the order step ran again");
        assert_eq!(retry.body, json!({ "order": id, "charge": charge.unwrap(), "amount": 100 }));
        // The charge step ran once: once before the crash, or once in the takeover.
        assert_eq!(world.provider.counts(), (1, 1), "calls before the crash: {calls_before}");
        let again = post(service.port, "/orders", "pay-1").await.unwrap();
        assert_eq!((again.status, again.replayed, &again.body), (201, true, &retry.body));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_after_the_order_step_makes_no_second_order() {
    resumes_after("after-order").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_after_the_charge_step_calls_the_provider_no_more() {
    resumes_after("after-charge").await;
}
