//! The consumer door's behaviour suite, run against every store: the same guarantees as the
//! HTTP door, for code that is not behind HTTP.

use crate::common;

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum_idempotency::{
    Fingerprint, IdempotencyContext, Idempotent,
    consumer::{Error, Outcome},
    store::{OwnerToken, RecordKey, Store},
};
use common::*;
use serde::{Deserialize, Serialize};

every_store!(
    runs_once_and_replays_an_equal_result,
    same_id_with_another_payload_is_a_mismatch,
    canonical_json_makes_a_reordered_redelivery_the_same_event_and_ignores_named_members,
    fingerprint_with_decides_what_makes_a_redelivery_the_same_event,
    a_delivery_while_the_first_runs_is_in_progress,
    a_retryable_failure_releases_the_key,
    a_final_failure_is_stored_and_replayed,
    a_panic_releases_the_key_and_reaches_the_caller,
    a_lapsed_lease_is_taken_over_and_the_stale_holder_fenced_out,
    keep_alive_holds_the_key_for_an_operation_four_times_its_lease,
    fifty_deliveries_across_two_workers_run_the_operation_once,
    consumers_with_different_scopes_each_run_once,
    a_stored_result_of_another_type_is_an_error_naming_the_key_hash,
    a_result_over_the_stored_limit_is_returned_and_never_run_again,
    a_result_over_the_stored_limit_is_released_when_so_configured,
    a_result_of_exactly_the_stored_limit_is_stored,
);

const SCOPE: &str = "payments-consumer";
const PAYLOAD: &[u8] = br#"{"amount":100}"#;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Receipt {
    charge: String,
    amount: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
enum Declined {
    InsufficientFunds,
}

fn record_key(event: &str) -> RecordKey {
    RecordKey::new("idempotency-consumer", SCOPE.as_bytes(), event.as_bytes())
}

/// Counts side effects; each returns a receipt naming its call.
#[derive(Clone, Default)]
struct Charges(Arc<AtomicUsize>);

impl Charges {
    fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }

    /// A charge that takes `delay`.
    fn charge(
        &self,
        delay: Duration,
    ) -> impl FnOnce(
        IdempotencyContext,
    ) -> std::pin::Pin<
        Box<dyn Future<Output = Result<Receipt, std::io::Error>> + Send>,
    > + Send
    + 'static {
        let counter = self.0.clone();
        move |_context| {
            Box::pin(async move {
                let call = counter.fetch_add(1, Ordering::SeqCst) + 1;
                tokio::time::sleep(delay).await;
                Ok(Receipt { charge: format!("ch_{call}"), amount: 100 })
            })
        }
    }
}

async fn runs_once_and_replays_an_equal_result<H: Harness>(h: H) {
    let idem = Idempotent::new(h.store());
    let charges = Charges::default();
    let first = idem.run(SCOPE, "evt_1", PAYLOAD, charges.charge(Duration::ZERO)).await.unwrap();
    let receipt = Receipt { charge: "ch_1".into(), amount: 100 };
    assert_eq!(first, Outcome::Ran(receipt.clone()));
    for _ in 0..3 {
        let again = idem.run(SCOPE, "evt_1", PAYLOAD, charges.charge(Duration::ZERO)).await;
        assert_eq!(again.unwrap(), Outcome::Replayed(receipt.clone()));
    }
    assert_eq!(charges.count(), 1);
    assert_eq!(h.held(&record_key("evt_1")).await, Some(Held::Completed));
}

async fn same_id_with_another_payload_is_a_mismatch<H: Harness>(h: H) {
    let idem = Idempotent::new(h.store());
    let charges = Charges::default();
    idem.run(SCOPE, "evt_1", PAYLOAD, charges.charge(Duration::ZERO)).await.unwrap();
    let other =
        idem.run(SCOPE, "evt_1", br#"{"amount":999}"#, charges.charge(Duration::ZERO)).await;
    assert_eq!(other.unwrap(), Outcome::Mismatch);
    assert_eq!(charges.count(), 1);
}

async fn canonical_json_makes_a_reordered_redelivery_the_same_event_and_ignores_named_members<
    H: Harness,
>(
    h: H,
) {
    let first = br#"{"amount":100,"currency":"eur","delivery_attempt":1}"#;
    let redelivered = br#"{ "delivery_attempt": 2, "currency": "eur", "amount": 1e2 }"#;
    let charges = Charges::default();
    // The bytes as sent, by default: the redelivery is another payload.
    let bytes = Idempotent::new(h.store()).key_prefix("bytes");
    bytes.run(SCOPE, "evt_1", first, charges.charge(Duration::ZERO)).await.unwrap();
    let other = bytes.run(SCOPE, "evt_1", redelivered, charges.charge(Duration::ZERO)).await;
    assert_eq!(other.unwrap(), Outcome::Mismatch);
    // Canonical, without the attempt counter: the same event, replayed.
    let json = Idempotent::new(h.store()).ignore_json_member("/delivery_attempt");
    let ran = json.run(SCOPE, "evt_1", first, charges.charge(Duration::ZERO)).await.unwrap();
    let again = json.run(SCOPE, "evt_1", redelivered, charges.charge(Duration::ZERO)).await;
    assert_eq!(again.unwrap(), Outcome::Replayed(ran.into_result().unwrap()));
    // A member that matters still does.
    let changed = br#"{"amount":101,"currency":"eur","delivery_attempt":3}"#;
    let other = json.run(SCOPE, "evt_1", changed, charges.charge(Duration::ZERO)).await;
    assert_eq!(other.unwrap(), Outcome::Mismatch);
    assert_eq!(charges.count(), 2);
}

async fn fingerprint_with_decides_what_makes_a_redelivery_the_same_event<H: Harness>(h: H) {
    // Only the `amount` member counts.
    let idem =
        Idempotent::new(h.store()).canonical_json(true).fingerprint_with(|payload: &[u8]| {
            let json: serde_json::Value = serde_json::from_slice(payload).unwrap_or_default();
            Fingerprint::of_payload(json["amount"].to_string().as_bytes())
        });
    let charges = Charges::default();
    let ran = idem
        .run(SCOPE, "evt_1", br#"{"amount":100,"note":"a"}"#, charges.charge(Duration::ZERO))
        .await
        .unwrap();
    let same = idem
        .run(SCOPE, "evt_1", br#"{"note":"b","amount":100}"#, charges.charge(Duration::ZERO))
        .await;
    assert_eq!(same.unwrap(), Outcome::Replayed(ran.into_result().unwrap()));
    let other = idem.run(SCOPE, "evt_1", br#"{"amount":7}"#, charges.charge(Duration::ZERO)).await;
    assert_eq!(other.unwrap(), Outcome::Mismatch);
    assert_eq!(charges.count(), 1);
}

async fn a_delivery_while_the_first_runs_is_in_progress<H: Harness>(h: H) {
    let idem = Idempotent::new(h.store()).lease(Duration::from_secs(5));
    let charges = Charges::default();
    let first = {
        let (idem, charge) = (idem.clone(), charges.charge(Duration::from_millis(400)));
        tokio::spawn(async move { idem.run(SCOPE, "evt_1", PAYLOAD, charge).await.unwrap() })
    };
    eventually("the first delivery holds the key", async || {
        h.held(&record_key("evt_1")).await == Some(Held::InProgress)
    })
    .await;
    let second = idem.run(SCOPE, "evt_1", PAYLOAD, charges.charge(Duration::ZERO)).await.unwrap();
    let Outcome::InProgress { retry_after } = second else { panic!("{second:?}") };
    assert!(
        retry_after > Duration::ZERO && retry_after <= Duration::from_secs(5),
        "{retry_after:?}"
    );
    let ran = first.await.unwrap();
    assert!(matches!(ran, Outcome::Ran(_)));
    let third = idem.run(SCOPE, "evt_1", PAYLOAD, charges.charge(Duration::ZERO)).await.unwrap();
    assert_eq!(third, Outcome::Replayed(ran.into_result().unwrap()));
    assert_eq!(charges.count(), 1);
}

async fn a_retryable_failure_releases_the_key<H: Harness>(h: H) {
    let idem = Idempotent::new(h.store());
    let calls = Arc::new(AtomicUsize::new(0));
    let operation = |calls: Arc<AtomicUsize>| {
        move |_| async move {
            if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                return Err("provider timed out");
            }
            Ok(Receipt { charge: "ch_2".into(), amount: 100 })
        }
    };
    let failed = idem.run(SCOPE, "evt_1", PAYLOAD, operation(calls.clone())).await;
    assert!(matches!(failed, Err(Error::Operation("provider timed out"))), "{failed:?}");
    assert_eq!(h.held(&record_key("evt_1")).await, None);
    let retried = idem.run(SCOPE, "evt_1", PAYLOAD, operation(calls.clone())).await.unwrap();
    assert_eq!(retried, Outcome::Ran(Receipt { charge: "ch_2".into(), amount: 100 }));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

async fn a_final_failure_is_stored_and_replayed<H: Harness>(h: H) {
    let idem = Idempotent::new(h.store());
    let calls = Arc::new(AtomicUsize::new(0));
    // A declined card is final: returned inside `Ok`, it is the stored result.
    let decline = |calls: Arc<AtomicUsize>| {
        move |_| async move {
            calls.fetch_add(1, Ordering::SeqCst);
            Ok::<Result<Receipt, Declined>, std::io::Error>(Err(Declined::InsufficientFunds))
        }
    };
    let first = idem.run(SCOPE, "evt_1", PAYLOAD, decline(calls.clone())).await.unwrap();
    assert_eq!(first, Outcome::Ran(Err(Declined::InsufficientFunds)));
    let again = idem.run(SCOPE, "evt_1", PAYLOAD, decline(calls.clone())).await.unwrap();
    assert_eq!(again, Outcome::Replayed(Err(Declined::InsufficientFunds)));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(h.held(&record_key("evt_1")).await, Some(Held::Completed));
}

async fn a_panic_releases_the_key_and_reaches_the_caller<H: Harness>(h: H) {
    let idem = Idempotent::new(h.store());
    let run = {
        let idem = idem.clone();
        tokio::spawn(async move {
            idem.run(SCOPE, "evt_1", PAYLOAD, |_| async {
                if true {
                    panic!("operation panicked on purpose");
                }
                Ok::<u8, std::io::Error>(0)
            })
            .await
        })
    };
    let panic = run.await.expect_err("the panic reaches the caller").into_panic();
    assert_eq!(panic.downcast_ref::<&str>().copied(), Some("operation panicked on purpose"));
    assert_eq!(h.held(&record_key("evt_1")).await, None);
    let charges = Charges::default();
    let next = idem.run(SCOPE, "evt_1", PAYLOAD, charges.charge(Duration::ZERO)).await.unwrap();
    assert!(matches!(next, Outcome::Ran(_)));
}

async fn a_lapsed_lease_is_taken_over_and_the_stale_holder_fenced_out<H: Harness>(h: H) {
    let idem = Idempotent::new(h.store()).lease(Duration::from_millis(150)).keep_alive(None);
    let charges = Charges::default();
    let first = {
        let (idem, charge) = (idem.clone(), charges.charge(Duration::from_millis(600)));
        tokio::spawn(async move { idem.run(SCOPE, "evt_1", PAYLOAD, charge).await.unwrap() })
    };
    eventually("the first delivery holds the key", async || {
        h.held(&record_key("evt_1")).await == Some(Held::InProgress)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(250)).await;
    // The first holder looks dead: this delivery takes the key over and completes.
    let second = idem.run(SCOPE, "evt_1", PAYLOAD, charges.charge(Duration::ZERO)).await.unwrap();
    assert_eq!(second, Outcome::Ran(Receipt { charge: "ch_2".into(), amount: 100 }));
    // The first finishes later: its caller gets its own result, but the record stays the
    // second's.
    let first = first.await.unwrap();
    assert_eq!(first, Outcome::Ran(Receipt { charge: "ch_1".into(), amount: 100 }));
    let third = idem.run(SCOPE, "evt_1", PAYLOAD, charges.charge(Duration::ZERO)).await.unwrap();
    assert_eq!(third, Outcome::Replayed(Receipt { charge: "ch_2".into(), amount: 100 }));
    assert_eq!(charges.count(), 2);
}

async fn keep_alive_holds_the_key_for_an_operation_four_times_its_lease<H: Harness>(h: H) {
    let idem = Idempotent::new(h.store()).lease(Duration::from_millis(150));
    let charges = Charges::default();
    let first = {
        let (idem, charge) = (idem.clone(), charges.charge(Duration::from_millis(600)));
        tokio::spawn(async move { idem.run(SCOPE, "evt_1", PAYLOAD, charge).await.unwrap() })
    };
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(120)).await;
        let during = idem.run(SCOPE, "evt_1", PAYLOAD, charges.charge(Duration::ZERO)).await;
        assert!(matches!(during.unwrap(), Outcome::InProgress { .. }));
    }
    assert!(matches!(first.await.unwrap(), Outcome::Ran(_)));
    assert_eq!(charges.count(), 1);
}

async fn fifty_deliveries_across_two_workers_run_the_operation_once<H: Harness>(h: H) {
    let workers = [Idempotent::new(h.store()), Idempotent::new(h.second_store())];
    let charges = Charges::default();
    let deliveries: Vec<_> = (0..50)
        .map(|i| {
            let (idem, charge) =
                (workers[i % 2].clone(), charges.charge(Duration::from_millis(50)));
            tokio::spawn(async move { idem.run(SCOPE, "evt_1", PAYLOAD, charge).await.unwrap() })
        })
        .collect();
    let mut ran = 0;
    for delivery in deliveries {
        match delivery.await.unwrap() {
            Outcome::Ran(receipt) => {
                ran += 1;
                assert_eq!(receipt.charge, "ch_1");
            }
            Outcome::Replayed(receipt) => assert_eq!(receipt.charge, "ch_1"),
            Outcome::InProgress { .. } => {}
            Outcome::Mismatch => panic!("same payload reported as a mismatch"),
        }
    }
    assert_eq!(ran, 1);
    assert_eq!(charges.count(), 1);
}

async fn consumers_with_different_scopes_each_run_once<H: Harness>(h: H) {
    let idem = Idempotent::new(h.store());
    let charges = Charges::default();
    for scope in ["ledger-consumer", "email-consumer", "ledger-consumer", "email-consumer"] {
        idem.run(scope, "evt_1", PAYLOAD, charges.charge(Duration::ZERO)).await.unwrap();
    }
    assert_eq!(charges.count(), 2);
    assert_eq!(h.record_count().await, 2);
}

async fn a_stored_result_of_another_type_is_an_error_naming_the_key_hash<H: Harness>(h: H) {
    let idem = Idempotent::new(h.store());
    let charges = Charges::default();
    idem.run(SCOPE, "evt_1", PAYLOAD, charges.charge(Duration::ZERO)).await.unwrap();
    // A deploy changed the result type: the stored receipt is not a number.
    let reread =
        idem.run(SCOPE, "evt_1", PAYLOAD, |_| async { Ok::<u64, std::io::Error>(7) }).await;
    match reread {
        Err(Error::Corrupt { key_hash, .. }) => assert_eq!(key_hash, record_key("evt_1").hash()),
        other => panic!("expected a corrupt-record error, got {other:?}"),
    }
    // A value the consumer door did not write (an HTTP record) is refused the same way.
    let store = h.store();
    let key = record_key("evt_2");
    let fingerprint = Fingerprint::of_payload(PAYLOAD);
    let owner = OwnerToken::random();
    store.claim(&key, &fingerprint, &owner, Duration::from_secs(60).into()).await.unwrap();
    // Format 2 (an HTTP response), its completion time, status 200, no header.
    let http_record = bytes::Bytes::from_static(&[2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 200, 0, 0]);
    store.complete(&key, &owner, &fingerprint, http_record, Duration::from_secs(60)).await.unwrap();
    let foreign = idem.run(SCOPE, "evt_2", PAYLOAD, charges.charge(Duration::ZERO)).await;
    assert!(matches!(foreign, Err(Error::Corrupt { .. })), "{foreign:?}");
    assert_eq!(charges.count(), 1, "a corrupt record never runs the operation again");
    assert_eq!(h.held(&record_key("evt_1")).await, Some(Held::Completed));
}

async fn a_result_over_the_stored_limit_is_returned_and_never_run_again<H: Harness>(h: H) {
    let idem = Idempotent::new(h.store()).stored_limit(16);
    let charges = Charges::default();
    // The receipt encodes to more than 16 bytes.
    let ran = idem.run(SCOPE, "evt_1", PAYLOAD, charges.charge(Duration::ZERO)).await.unwrap();
    assert!(matches!(ran, Outcome::Ran(_)));
    assert_eq!(h.held(&record_key("evt_1")).await, Some(Held::Completed));
    let again = idem.run(SCOPE, "evt_1", PAYLOAD, charges.charge(Duration::ZERO)).await;
    let Err(Error::ResultNotStored { reason, .. }) = again else { panic!("{again:?}") };
    assert!(reason.contains("over the stored limit"), "{reason}");
    assert_eq!(charges.count(), 1);
}

async fn a_result_over_the_stored_limit_is_released_when_so_configured<H: Harness>(h: H) {
    let idem = Idempotent::new(h.store()).stored_limit(16).release_when_too_large(true);
    let charges = Charges::default();
    for _ in 0..2 {
        let ran = idem.run(SCOPE, "evt_1", PAYLOAD, charges.charge(Duration::ZERO)).await.unwrap();
        assert!(matches!(ran, Outcome::Ran(_)));
        assert_eq!(h.held(&record_key("evt_1")).await, None);
    }
    assert_eq!(charges.count(), 2);
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_store_is_an_error_and_nothing_runs() {
    let store =
        axum_idempotency::RedisStore::from_url(&format!("redis://127.0.0.1:{}", free_port()))
            .unwrap()
            .command_timeout(Duration::from_millis(300));
    let idem = Idempotent::new(store);
    let charges = Charges::default();
    let result = idem.run(SCOPE, "evt_1", PAYLOAD, charges.charge(Duration::ZERO)).await;
    assert!(matches!(result, Err(Error::Store(ref e)) if e.is_unavailable()), "{result:?}");
    assert_eq!(charges.count(), 0);
}

async fn a_result_of_exactly_the_stored_limit_is_stored<H: Harness>(h: H) {
    // `12345` encodes to 5 bytes of JSON: a limit of 5 stores it, 4 does not.
    let five = |_| async { Ok::<u32, std::io::Error>(12345) };
    let at_limit = Idempotent::new(h.store()).stored_limit(5);
    assert_eq!(at_limit.run(SCOPE, "evt_1", PAYLOAD, five).await.unwrap(), Outcome::Ran(12345));
    assert_eq!(
        at_limit.run(SCOPE, "evt_1", PAYLOAD, five).await.unwrap(),
        Outcome::Replayed(12345)
    );
    let under = Idempotent::new(h.store()).stored_limit(4);
    assert_eq!(under.run(SCOPE, "evt_2", PAYLOAD, five).await.unwrap(), Outcome::Ran(12345));
    // Too large to keep: held as completed, not replayable.
    assert_eq!(h.held(&record_key("evt_2")).await, Some(Held::Completed));
    let again = under.run(SCOPE, "evt_2", PAYLOAD, five).await;
    assert!(matches!(again, Err(Error::ResultNotStored { .. })), "{again:?}");
}
