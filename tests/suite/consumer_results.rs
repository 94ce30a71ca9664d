//! The consumer door's promise, "once", for the results and panics it cannot store the usual
//! way: a result serde cannot encode, a float JSON cannot hold, a panic when the operation is
//! called or when its result is serialized, a hook that panics when called; and the keys it
//! refuses or keeps apart (an empty event id, two prefixes). Every store.

use crate::common;

use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum_idempotency::{
    Fingerprint, IdempotencyContext, Idempotent,
    consumer::{Error, Outcome},
    recovery::{Lookup, Recovered},
    store::{Claim, Lease, OwnerToken, RecordKey, Store},
};
use bytes::Bytes;
use common::*;
use serde::{Deserialize, Serialize};

every_store!(
    a_result_serde_cannot_encode_runs_once_and_never_again,
    a_non_finite_float_runs_once_and_is_never_replayed_as_another_value,
    a_recovered_result_serde_cannot_encode_keeps_the_key,
    a_panic_when_the_operation_is_called_releases_the_key_and_reaches_the_caller,
    a_panic_in_the_results_serialize_releases_the_key_and_reaches_the_caller,
    a_hook_that_panics_when_called_runs_nothing_and_keeps_the_key,
    two_prefixes_never_share_a_key_hash_or_a_derived_key,
    an_empty_event_id_is_refused_and_writes_nothing,
);

const SCOPE: &str = "payments-consumer";

fn record_key(event: &str) -> RecordKey {
    RecordKey::new("idempotency-consumer", SCOPE.as_bytes(), event.as_bytes())
}

/// An operation that counts its runs and returns `value`.
fn counted<T: Clone + Send + 'static>(
    runs: &Arc<AtomicUsize>,
    value: T,
) -> impl FnOnce(IdempotencyContext) -> std::future::Ready<Result<T, std::io::Error>> + Send + 'static
{
    let runs = runs.clone();
    move |_context| {
        runs.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Ok(value))
    }
}

async fn a_result_serde_cannot_encode_runs_once_and_never_again<H: Harness>(h: H) {
    // JSON has no map with tuple keys.
    let idem = Idempotent::new(h.store());
    let runs = Arc::new(AtomicUsize::new(0));
    let result: HashMap<(u8, u8), u32> = HashMap::from([((1, 2), 3)]);
    let first = idem.run(SCOPE, "evt_1", b"{}", counted(&runs, result.clone())).await.unwrap();
    assert_eq!(first, Outcome::Ran(result.clone()));
    for _ in 0..2 {
        let again = idem.run(SCOPE, "evt_1", b"{}", counted(&runs, result.clone())).await;
        match again {
            Err(Error::ResultNotStored { key_hash, reason }) => {
                assert_eq!(key_hash, record_key("evt_1").hash());
                assert!(reason.contains("key must be a string"), "{reason}");
            }
            other => panic!("expected ResultNotStored, found {other:?}"),
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the operation ran again");
    assert_eq!(h.held(&record_key("evt_1")).await, Some(Held::Completed));
}

async fn a_non_finite_float_runs_once_and_is_never_replayed_as_another_value<H: Harness>(h: H) {
    let idem = Idempotent::new(h.store());
    let runs = Arc::new(AtomicUsize::new(0));
    let first = idem.run(SCOPE, "evt_nan", b"{}", counted(&runs, f64::NAN)).await.unwrap();
    assert!(matches!(first, Outcome::Ran(value) if value.is_nan()));
    let again = idem.run(SCOPE, "evt_nan", b"{}", counted(&runs, f64::NAN)).await;
    assert!(matches!(again, Err(Error::ResultNotStored { .. })), "{again:?}");
    // serde_json would have stored `null`, replayed as `None`: another value than ran.
    let first = idem.run(SCOPE, "evt_inf", b"{}", counted(&runs, Some(f64::INFINITY))).await;
    assert_eq!(first.unwrap(), Outcome::Ran(Some(f64::INFINITY)));
    let again = idem.run(SCOPE, "evt_inf", b"{}", counted(&runs, Some(f64::INFINITY))).await;
    match again {
        Err(Error::ResultNotStored { reason, .. }) => {
            assert_eq!(reason, "inf has no JSON form; it would be stored as null");
        }
        other => panic!("expected ResultNotStored, found {other:?}"),
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    // Finite floats are stored and replayed as they ran.
    let ran = idem.run(SCOPE, "evt_ok", b"{}", counted(&runs, Some(0.1_f64))).await.unwrap();
    let replayed = idem.run(SCOPE, "evt_ok", b"{}", counted(&runs, Some(0.1_f64))).await.unwrap();
    assert_eq!((ran, replayed), (Outcome::Ran(Some(0.1)), Outcome::Replayed(Some(0.1))));
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}

/// A claim on the consumer door whose worker died: its lease has lapsed when this returns.
async fn dead_worker<S: Store>(store: &S, event: &str) {
    let lease = Lease::new(Duration::from_millis(50)).recovery_window(Duration::from_secs(3600));
    let fingerprint = Fingerprint::of_payload(b"{}");
    let claim = store.claim(&record_key(event), &fingerprint, &OwnerToken::random(), lease).await;
    assert_eq!(claim.unwrap(), Claim::Claimed);
    tokio::time::sleep(Duration::from_millis(150)).await;
}

async fn a_recovered_result_serde_cannot_encode_keeps_the_key<H: Harness>(h: H) {
    let result: HashMap<(u8, u8), u32> = HashMap::from([((1, 2), 3)]);
    let hook = {
        let result = result.clone();
        move |_lookup: Lookup<Bytes>| {
            std::future::ready(Ok::<_, std::io::Error>(Recovered::Happened(result.clone())))
        }
    };
    let idem = Idempotent::new(h.store()).recover(hook);
    let runs = Arc::new(AtomicUsize::new(0));
    dead_worker(&h.store(), "evt_1").await;
    let recovered = idem.run(SCOPE, "evt_1", b"{}", counted(&runs, result.clone())).await;
    assert_eq!(recovered.unwrap(), Outcome::Replayed(result.clone()));
    // The hook said it happened: the record is kept, and nothing runs, ever.
    let again = idem.run(SCOPE, "evt_1", b"{}", counted(&runs, result.clone())).await;
    assert!(matches!(again, Err(Error::ResultNotStored { .. })), "{again:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(h.held(&record_key("evt_1")).await, Some(Held::Completed));
}

async fn a_panic_when_the_operation_is_called_releases_the_key_and_reaches_the_caller<
    H: Harness,
>(
    h: H,
) {
    let idem = Idempotent::new(h.store());
    let delivery = {
        let idem = idem.clone();
        tokio::spawn(async move {
            // The closure panics before it returns its future.
            idem.run(
                SCOPE,
                "evt_1",
                b"{}",
                |_context: IdempotencyContext| -> std::future::Ready<Result<u8, std::io::Error>> {
                    panic!("the closure's own bug")
                },
            )
            .await
        })
    };
    let joined = delivery.await;
    assert!(joined.as_ref().is_err_and(tokio::task::JoinError::is_panic), "{joined:?}");
    assert_eq!(h.held(&record_key("evt_1")).await, None, "the key stayed claimed");
    let runs = Arc::new(AtomicUsize::new(0));
    let next = idem.run(SCOPE, "evt_1", b"{}", counted(&runs, 7_u8)).await.unwrap();
    assert_eq!(next, Outcome::Ran(7));
}

/// A result whose `Serialize` panics: a bug in a hand-written impl.
#[derive(Debug, Clone, PartialEq, Deserialize)]
struct Fragile;

impl Serialize for Fragile {
    fn serialize<S: serde::Serializer>(&self, _serializer: S) -> Result<S::Ok, S::Error> {
        panic!("Serialize's own bug")
    }
}

async fn a_panic_in_the_results_serialize_releases_the_key_and_reaches_the_caller<H: Harness>(
    h: H,
) {
    let idem = Idempotent::new(h.store());
    let runs = Arc::new(AtomicUsize::new(0));
    let delivery = {
        let (idem, operation) = (idem.clone(), counted(&runs, Fragile));
        tokio::spawn(async move { idem.run(SCOPE, "evt_1", b"{}", operation).await })
    };
    let joined = delivery.await;
    assert!(joined.as_ref().is_err_and(tokio::task::JoinError::is_panic), "{joined:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(h.held(&record_key("evt_1")).await, None, "the key stayed claimed");
    let next = idem.run(SCOPE, "evt_1", b"{}", counted(&runs, 7_u8)).await.unwrap();
    assert_eq!(next, Outcome::Ran(7));
}

async fn a_hook_that_panics_when_called_runs_nothing_and_keeps_the_key<H: Harness>(h: H) {
    let hook =
        |_lookup: Lookup<Bytes>| -> std::future::Ready<Result<Recovered<u8>, std::io::Error>> {
            panic!("the hook's own bug, before its future")
        };
    let idem = Idempotent::new(h.store()).recover(hook);
    let runs = Arc::new(AtomicUsize::new(0));
    dead_worker(&h.store(), "evt_1").await;
    let refused = idem.run(SCOPE, "evt_1", b"{}", counted(&runs, 7_u8)).await;
    assert!(matches!(refused, Err(Error::Recovery)), "{refused:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    // Handed back, not released: the next delivery takes over and asks again.
    assert_eq!(h.held(&record_key("evt_1")).await, Some(Held::InProgress));
}

async fn two_prefixes_never_share_a_key_hash_or_a_derived_key<H: Harness>(h: H) {
    let seen = |prefix: &'static str| {
        let idem = Idempotent::new(h.store()).key_prefix(prefix);
        async move {
            let outcome = idem
                .run(SCOPE, "evt_1", b"{}", |context: IdempotencyContext| async move {
                    Ok::<_, std::io::Error>((
                        context.key_hash().to_owned(),
                        context.derived_key("psp").unwrap(),
                    ))
                })
                .await
                .unwrap();
            outcome.into_result().unwrap()
        }
    };
    let (a, b) = (seen("billing").await, seen("shipping").await);
    assert_ne!(a.0, b.0, "two prefixes share a key hash (and an outbox row)");
    assert_ne!(a.1, b.1, "two prefixes share a downstream idempotency key");
    assert_eq!(a.0, RecordKey::new("billing", SCOPE.as_bytes(), b"evt_1").hash());
}

async fn an_empty_event_id_is_refused_and_writes_nothing<H: Harness>(h: H) {
    let idem = Idempotent::new(h.store());
    let runs = Arc::new(AtomicUsize::new(0));
    let refused = idem.run(SCOPE, "", b"{}", counted(&runs, 7_u8)).await;
    assert!(matches!(refused, Err(Error::EmptyKey)), "{refused:?}");
    assert_eq!(refused.unwrap_err().to_string(), "the key (event id) is empty");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(h.record_count().await, 0);
}
