//! The metrics an operator alerts on, read back through `metrics-util`'s debugging recorder
//! after a scripted sequence: fresh, replay, mismatch, in progress, a 5xx release, and a store
//! that is down. (Built with the `metrics` feature only: `cargo test --all-features`.)

mod common;

use std::{collections::BTreeMap, time::Duration};

use axum_idempotency::settings::Waiting;
use axum_idempotency::{IdempotencyLayer, MemoryStore, RedisStore};
use common::*;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};

/// Counter values by `name{label=value,...}`.
type Entry =
    (metrics_util::CompositeKey, Option<metrics::Unit>, Option<metrics::SharedString>, DebugValue);

fn counters(snapshot: Vec<Entry>) -> BTreeMap<String, u64> {
    snapshot
        .into_iter()
        .filter_map(|(key, _, _, value)| {
            let DebugValue::Counter(count) = value else { return None };
            let key = key.key();
            let mut labels: Vec<String> =
                key.labels().map(|l| format!("{}={}", l.key(), l.value())).collect();
            labels.sort();
            Some((format!("{}{{{}}}", key.name(), labels.join(",")), count))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_follow_what_the_layer_decides_labelled_by_route() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install().expect("the only recorder of this test binary");

    let calls = Calls::default();
    // Waiting off: the in-progress answer is counted as such.
    let layer = IdempotencyLayer::new(MemoryStore::new()).waiting(Waiting::off());
    let routes = app(&calls).layer(layer);
    // Fresh, then its replay, then the same key with another body.
    assert_eq!(send(&routes, keyed("POST", "/payments", "k1", "{}")).await.status, 201);
    assert!(send(&routes, keyed("POST", "/payments", "k1", "{}")).await.replayed());
    send(&routes, keyed("POST", "/payments", "k1", "{\"other\":1}"))
        .await
        .assert_problem(409, "key-reused");
    // In progress.
    let slow = send_in_background(&routes, delayed("/slow", "k2", 300, "{}"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    send(&routes, delayed("/slow", "k2", 300, "{}")).await.assert_problem(202, "in-progress");
    assert_eq!(slow.await.unwrap().status, 201);
    // A 5xx: released.
    assert_eq!(send(&routes, keyed("POST", "/status/503", "k3", "")).await.status, 503);
    // A store that is down.
    let down = RedisStore::from_url(&format!("redis://127.0.0.1:{}", free_port()))
        .unwrap()
        .command_timeout(Duration::from_millis(200));
    let down = app(&calls).layer(IdempotencyLayer::new(down));
    send(&down, keyed("POST", "/payments", "k4", "{}"))
        .await
        .assert_problem(503, "store-unavailable");

    // The consumer door labels by its scope, named so: a delivery and its redelivery.
    let idem = axum_idempotency::Idempotent::new(MemoryStore::new());
    for _ in 0..2 {
        let ran = idem.run("billing", "evt_1", b"{}", |_| async { Ok::<u32, std::io::Error>(7) });
        assert_eq!(ran.await.unwrap().into_result(), Some(7));
    }

    // One snapshot: reading a histogram drains it.
    let snapshot = snapshotter.snapshot().into_vec();
    // Every metric carries its description (Prometheus's `# HELP`), and a histogram of
    // seconds says so.
    for (key, unit, description, value) in &snapshot {
        let name = key.key().name();
        assert!(description.as_ref().is_some_and(|d| !d.is_empty()), "{name} is not described");
        if matches!(value, DebugValue::Histogram(_)) {
            assert_eq!(*unit, Some(metrics::Unit::Seconds), "{name}");
        }
    }
    let handler_runs: usize = snapshot
        .iter()
        .filter(|(key, ..)| key.key().name() == "idempotency_handler_seconds")
        .map(|(.., value)| match value {
            DebugValue::Histogram(values) => values.len(),
            _ => 0,
        })
        .sum();
    let ages: Vec<f64> = snapshot
        .iter()
        .filter(|(key, ..)| key.key().name() == "idempotency_replayed_record_age_seconds")
        .flat_map(|(.., value)| match value {
            DebugValue::Histogram(values) => values.iter().map(|v| v.into_inner()).collect(),
            _ => Vec::new(),
        })
        .collect();
    let counters = counters(snapshot);
    let expected = BTreeMap::from([
        ("idempotency_claims_total{outcome=claimed,route=/payments}".to_owned(), 1),
        ("idempotency_claims_total{outcome=replayed,route=/payments}".to_owned(), 1),
        ("idempotency_claims_total{outcome=mismatch,route=/payments}".to_owned(), 1),
        ("idempotency_claims_total{outcome=claimed,route=/slow}".to_owned(), 1),
        ("idempotency_claims_total{outcome=in_progress,route=/slow}".to_owned(), 1),
        ("idempotency_claims_total{outcome=claimed,route=/status/{code}}".to_owned(), 1),
        ("idempotency_settles_total{result=stored,route=/payments}".to_owned(), 1),
        ("idempotency_settles_total{result=stored,route=/slow}".to_owned(), 1),
        ("idempotency_settles_total{result=released,route=/status/{code}}".to_owned(), 1),
        ("idempotency_store_errors_total{phase=claim,route=/payments}".to_owned(), 1),
        ("idempotency_claims_total{outcome=claimed,scope=billing}".to_owned(), 1),
        ("idempotency_claims_total{outcome=replayed,scope=billing}".to_owned(), 1),
        ("idempotency_settles_total{result=stored,scope=billing}".to_owned(), 1),
    ]);
    assert_eq!(counters, expected);
    // The handler's duration is recorded for each claimed operation: three handlers and one
    // consumer operation ran.
    assert_eq!(handler_runs, 4);
    // Two replays (the HTTP door's, the consumer's): their records' age, from the completion
    // time each record carries.
    assert_eq!(ages.len(), 2, "{ages:?}");
    assert!(ages.iter().all(|age| (0.0..5.0).contains(age)), "{ages:?}");
}
