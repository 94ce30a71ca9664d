//! Waiting instead of bouncing: a retry that finds its original in progress waits for it to
//! settle and answers with its outcome. Run against every store.
// The Redis-only tests are compiled, unused, without the `redis` feature.
#![cfg_attr(not(feature = "redis"), allow(dead_code))]

#[macro_use]
mod common;

use std::time::{Duration, Instant};

use axum::Router;
use axum_idempotency::settings::Waiting;
use axum_idempotency::{IdempotencyLayer, Idempotent, consumer::Outcome};
use common::*;

every_store!(
    a_default_layer_answers_a_retry_during_a_one_second_handler_with_the_original_response,
    a_retry_of_an_original_that_answers_503_claims_and_runs,
    past_the_deadline_the_answer_is_202_with_retry_after_1,
    past_the_deadline_the_ietf_preset_answers_409_with_retry_after_1,
    fifty_duplicates_with_waiting_all_get_the_one_response,
    waiting_off_answers_at_once_with_retry_after_1,
    past_max_waiters_a_retry_is_answered_at_once,
    a_delivery_waits_for_the_running_one_and_gets_its_result,
    a_store_used_again_on_a_new_runtime_serves_and_wakes_its_waiters;
    redis stores:
    a_waiter_whose_client_goes_away_leaves_no_subscription,
);

fn waiting<H: Harness>(h: &H, calls: &Calls, wait: Duration) -> Router {
    app(calls).layer(IdempotencyLayer::new(h.store()).waiting(Waiting::up_to(wait)))
}

async fn a_default_layer_answers_a_retry_during_a_one_second_handler_with_the_original_response<
    H: Harness,
>(
    h: H,
) {
    let calls = Calls::default();
    // The defaults: waiting is on (10 s), nothing configured.
    let app = app(&calls).layer(IdempotencyLayer::new(h.store()));
    // A client that retries 0.5 s after sending, against a handler that takes 1 s (a first
    // answer lost on the way back): it must get the original, not a 202 that a client such as
    // stripe-python would take for the created resource.
    let first = {
        let app = app.clone();
        tokio::spawn(async move {
            let seen = send(&app, delayed("/slow", "k1", 1000, "{}")).await;
            (seen, Instant::now())
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let retry = send(&app, delayed("/slow", "k1", 1000, "{}")).await;
    let retry_answered = Instant::now();
    let (first, first_answered) = first.await.unwrap();
    assert_eq!(first.status, 201);
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(retry.header("x-payment"), Some("pay_1"));
    assert_eq!(calls.get(), 1);
    // Woken by the settle, not by its 10 s deadline: it answered within moments of the original.
    let gap = retry_answered.saturating_duration_since(first_answered)
        + first_answered.saturating_duration_since(retry_answered);
    assert!(gap < Duration::from_millis(500), "the waiter answered {gap:?} away from the original");
}

async fn a_retry_of_an_original_that_answers_503_claims_and_runs<H: Harness>(h: H) {
    let calls = Calls::default();
    let app = waiting(&h, &calls, Duration::from_secs(5));
    let first = send_until_claimed(&h, &app, delayed("/slow-flaky", "k1", 400, "{}"), "k1").await;
    let started = Instant::now();
    let retry = send(&app, delayed("/slow-flaky", "k1", 400, "{}")).await;
    assert_eq!(first.await.unwrap().status, 503);
    // The original released its key: the waiter claimed it and ran the handler itself.
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(retry.header("x-payment"), Some("pay_2"));
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    assert_eq!(calls.get(), 2);
    assert_eq!(h.held(&global("k1")).await, Some(Held::Completed));
}

async fn past_the_deadline_the_answer_is_202_with_retry_after_1<H: Harness>(h: H) {
    let calls = Calls::default();
    let app = waiting(&h, &calls, Duration::from_millis(300));
    let first = send_until_claimed(&h, &app, delayed("/slow", "k1", 1500, "{}"), "k1").await;
    let started = Instant::now();
    let retry = send(&app, delayed("/slow", "k1", 1500, "{}")).await;
    let waited = started.elapsed();
    retry.assert_problem(202, "in-progress");
    assert_eq!(retry.header("retry-after"), Some("1"));
    assert!(waited >= Duration::from_millis(300), "answered before its deadline: {waited:?}");
    assert!(waited < Duration::from_millis(1200), "waited past its deadline: {waited:?}");
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(calls.get(), 1);
}

async fn past_the_deadline_the_ietf_preset_answers_409_with_retry_after_1<H: Harness>(h: H) {
    let calls = Calls::default();
    let layer = IdempotencyLayer::new(h.store())
        .answers(axum_idempotency::layer::Answers::ietf_draft())
        .waiting(Waiting::up_to(Duration::from_millis(200)));
    let app = app(&calls).layer(layer);
    let first = send_until_claimed(&h, &app, delayed("/slow", "k1", 800, "{}"), "k1").await;
    let retry = send(&app, delayed("/slow", "k1", 800, "{}")).await;
    retry.assert_problem(409, "in-progress");
    assert_eq!(retry.header("retry-after"), Some("1"));
    assert_eq!(first.await.unwrap().status, 201);
}

async fn fifty_duplicates_with_waiting_all_get_the_one_response<H: Harness>(h: H) {
    let calls = Calls::default();
    let app = waiting(&h, &calls, Duration::from_secs(5));
    let requests: Vec<_> =
        (0..50).map(|_| send_in_background(&app, delayed("/slow", "k1", 200, "{}"))).collect();
    let mut bodies = Vec::new();
    for request in requests {
        let seen = request.await.unwrap();
        assert_eq!(seen.status, 201, "{seen:?}");
        assert_eq!(seen.header("x-payment"), Some("pay_1"));
        bodies.push(seen.body);
    }
    bodies.dedup();
    assert_eq!(bodies.len(), 1, "more than one body: {bodies:?}");
    assert_eq!(calls.get(), 1);
}

async fn waiting_off_answers_at_once_with_retry_after_1<H: Harness>(h: H) {
    let calls = Calls::default();
    // A long lease: Retry-After is a short hint, not the lease. A zero wait turns waiting off.
    let layer = IdempotencyLayer::new(h.store()).waiting(Waiting::off());
    let app = app(&calls).layer(layer.lease(Duration::from_secs(30)));
    let first = send_until_claimed(&h, &app, delayed("/slow", "k1", 500, "{}"), "k1").await;
    let started = Instant::now();
    let retry = send(&app, delayed("/slow", "k1", 500, "{}")).await;
    assert!(started.elapsed() < Duration::from_millis(300));
    retry.assert_problem(202, "in-progress");
    assert_eq!(retry.header("retry-after"), Some("1"));
    first.await.unwrap();
}

async fn past_max_waiters_a_retry_is_answered_at_once<H: Harness>(h: H) {
    let calls = Calls::default();
    let layer = IdempotencyLayer::new(h.store())
        .waiting(Waiting::up_to(Duration::from_secs(5)).max_waiters(1));
    let app = app(&calls).layer(layer);
    let first = send_until_claimed(&h, &app, delayed("/slow", "k1", 800, "{}"), "k1").await;
    let waiter = send_in_background(&app, delayed("/slow", "k1", 800, "{}"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The one place is taken: this retry is not made to wait.
    let started = Instant::now();
    let bounced = send(&app, delayed("/slow", "k1", 800, "{}")).await;
    assert!(started.elapsed() < Duration::from_millis(400), "{:?}", started.elapsed());
    bounced.assert_problem(202, "in-progress");
    assert!(waiter.await.unwrap().replayed());
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(calls.get(), 1);
}

async fn a_delivery_waits_for_the_running_one_and_gets_its_result<H: Harness>(h: H) {
    let idem = Idempotent::new(h.store()).waiting(Waiting::up_to(Duration::from_secs(5)));
    let operation = |value: u32, delay: u64| {
        move |_context| async move {
            tokio::time::sleep(Duration::from_millis(delay)).await;
            Ok::<_, std::io::Error>(value)
        }
    };
    let first = {
        let idem = idem.clone();
        tokio::spawn(async move { idem.run("consumer", "evt_1", b"p", operation(1, 500)).await })
    };
    let key =
        axum_idempotency::store::RecordKey::new("idempotency-consumer", b"consumer", b"evt_1");
    eventually("the first delivery holds the key", async || {
        h.held(&key).await == Some(Held::InProgress)
    })
    .await;
    let second = idem.run("consumer", "evt_1", b"p", operation(2, 0)).await.unwrap();
    assert_eq!(first.await.unwrap().unwrap(), Outcome::Ran(1));
    assert_eq!(second, Outcome::Replayed(1));
}

async fn a_store_used_again_on_a_new_runtime_serves_and_wakes_its_waiters<H: Harness>(h: H) {
    // A store shared by runtimes one after another (tests with a static store, a runtime per
    // job): what the store started on the first (a connection's driver, the settle listener)
    // went with it. On the next, requests are served (no 503 from the dead connection), and a
    // waiter is woken by the settle, not left to its deadline.
    let calls = Calls::default();
    let store = h.store_shared_by_runtimes();
    let app = app(&calls)
        .layer(IdempotencyLayer::new(store).waiting(Waiting::up_to(Duration::from_secs(5))));
    let runtimes = tokio::task::spawn_blocking(move || {
        for key in ["first-runtime", "second-runtime"] {
            let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
            runtime.block_on(async {
                // A pool that lends connections of an ended runtime answers 503 once for each
                // (see the harness); a client's retry gets through once they are spent. Any
                // other store serves the first request at once.
                let tries = if H::LENDS_CONNECTIONS_OF_ENDED_RUNTIMES { 5 } else { 1 };
                let mut first = None;
                for _ in 0..tries {
                    let seen =
                        send(&app, keyed("POST", "/payments", &format!("{key}-first"), "{}"));
                    first = Some(seen.await);
                    if first.as_ref().is_some_and(|seen| seen.status != 503) {
                        break;
                    }
                }
                let first = first.unwrap();
                assert_eq!(first.status, 201, "{key}: {first:?}");
                let original = send_in_background(&app, delayed("/slow", key, 600, "{}"));
                tokio::time::sleep(Duration::from_millis(100)).await;
                let started = Instant::now();
                let waiter = send(&app, delayed("/slow", key, 600, "{}")).await;
                let took = started.elapsed();
                let original = original.await.unwrap();
                assert_eq!(original.status, 201, "{key}: {original:?}");
                assert!(waiter.replayed(), "{key}: {waiter:?}");
                assert!(took < Duration::from_secs(2), "{key}: woken by its deadline: {took:?}");
            });
        }
    });
    runtimes.await.unwrap();
    assert_eq!(calls.get(), 4);
}

async fn a_waiter_whose_client_goes_away_leaves_no_subscription<H: RawHarness>(h: H) {
    let calls = Calls::default();
    let app = waiting(&h, &calls, Duration::from_secs(5));
    let first = send_until_claimed(&h, &app, delayed("/slow", "k1", 800, "{}"), "k1").await;
    let waiter = send_in_background(&app, delayed("/slow", "k1", 800, "{}"));
    eventually("the waiter subscribed", async || h.subscribers(&global("k1")).await == 1).await;
    // Its client goes away: the request future is dropped mid-wait.
    waiter.abort();
    eventually("the subscription is gone", async || h.subscribers(&global("k1")).await == 0).await;
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(calls.get(), 1);
    assert_eq!(h.subscribers(&global("k1")).await, 0);
}
