//! Redis Cluster faults: records spread over the masters, a dead master, a failover. Each test
//! starts its own cluster of private `redis-server` processes.
#![cfg(feature = "cluster")]

use crate::common;

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use axum::http::StatusCode;
use axum_idempotency::{IdempotencyLayer, store::deadpool_redis::redis};
use common::{
    cluster::{RedisCluster, key_slot},
    *,
};
use futures_util::future::join_all;

fn owner_of(masters: &[(u16, Vec<(u16, u16)>)], slot: u16) -> u16 {
    masters
        .iter()
        .find(|(_, ranges)| ranges.iter().any(|(start, end)| (*start..=*end).contains(&slot)))
        .map(|(port, _)| *port)
        .expect("every slot has a master")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_spread_over_every_master() {
    let cluster = RedisCluster::start(3, 0);
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(cluster.store()));
    let masters = cluster.masters().await;
    let mut expected: BTreeMap<u16, usize> = BTreeMap::new();
    for i in 0..300 {
        let key = format!("order-{i}");
        assert_eq!(send(&app, keyed("POST", "/payments", &key, "{}")).await.status, 201);
        let slot = key_slot(global(&key).as_str());
        *expected.entry(owner_of(&masters, slot)).or_default() += 1;
    }
    let sizes: BTreeMap<u16, usize> = cluster.dbsize_per_master().await.into_iter().collect();
    assert_eq!(sizes.len(), 3);
    assert!(sizes.values().all(|n| *n > 50), "uneven spread: {sizes:?}");
    // Each record lives on the master that owns its slot: one key, one slot, one node.
    assert_eq!(sizes, expected);
    assert_eq!(calls.get(), 300);
}

/// Takes one master out with `fault`, then sends 60 fresh keys at once: those on its shard
/// must get 503 within the store's command timeout (1 s, with slack for a loaded machine), and
/// none may hang. Keys on the live shards succeed, at the latest on a client's retries within
/// a few seconds: while redis-rs's cluster client refreshes its slot map after a node failure
/// it holds every request, so a burst that lands in that refresh may be answered
/// 503 + Retry-After too (fail closed: the handler does not run).
async fn one_master_down(fault: &str, fail: impl FnOnce(&mut RedisCluster, u16)) {
    let mut cluster = RedisCluster::start(3, 0);
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(cluster.store()));
    let masters = cluster.masters().await;
    assert_eq!(send(&app, keyed("POST", "/payments", "warm", "{}")).await.status, 201);
    let down = masters[0].0;
    fail(&mut cluster, down);
    let fault_at = Instant::now();

    let requests = (0..60).map(|i| {
        let app = app.clone();
        async move {
            let key = format!("after-{i}");
            let started = Instant::now();
            let request = keyed("POST", "/payments", &key, "{}");
            let seen = tokio::time::timeout(Duration::from_secs(5), send(&app, request))
                .await
                .unwrap_or_else(|_| panic!("request for {key} hung on a {fault} shard"));
            (key, seen, started.elapsed())
        }
    });
    let answers: Vec<_> = join_all(requests)
        .await
        .into_iter()
        .map(|(key, seen, took)| {
            let on_down_shard = owner_of(&masters, key_slot(global(&key).as_str())) == down;
            (key, on_down_shard, seen, took)
        })
        .collect();
    let mut slowest_503 = Duration::ZERO;
    let mut slowest_201 = Duration::ZERO;
    let mut retried = 0;
    let mut recovered_in = Duration::ZERO;
    for (key, on_down_shard, seen, took) in &answers {
        if *on_down_shard {
            seen.assert_problem(503, "store-unavailable");
            slowest_503 = slowest_503.max(*took);
        } else if seen.status == StatusCode::CREATED {
            slowest_201 = slowest_201.max(*took);
        } else {
            seen.assert_problem(503, "store-unavailable");
            slowest_503 = slowest_503.max(*took);
            retried += 1;
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await; // Retry-After: 1
                let retry = send(&app, keyed("POST", "/payments", key, "{}")).await;
                if retry.status == StatusCode::CREATED {
                    break;
                }
                retry.assert_problem(503, "store-unavailable");
                let stalled = fault_at.elapsed();
                assert!(
                    stalled < Duration::from_secs(8),
                    "{key} on a live shard still fails after {stalled:?}"
                );
            }
            recovered_in = recovered_in.max(fault_at.elapsed());
        }
    }
    let on_down = answers.iter().filter(|a| a.1).count();
    assert!(
        on_down > 0 && on_down < answers.len(),
        "{on_down} of {} keys on the {fault} shard",
        answers.len()
    );
    assert!(slowest_503 < Duration::from_millis(2500), "a 503 took {slowest_503:?}");
    eprintln!(
        "{fault} master: {on_down} of 60 keys on its shard answered 503; of the rest, {retried} needed retries (all through {recovered_in:?} after the fault); slowest 503 {slowest_503:?}, slowest 201 {slowest_201:?}"
    );
    // Every live-shard key ran exactly once; no dead-shard key ran.
    assert_eq!(calls.get(), 1 + answers.len() - on_down);
    if fault == "paused" {
        // Longer than the guard of an unanswered claim once kept trying (about 5 s).
        tokio::time::sleep(Duration::from_secs(6)).await;
        cluster.node(down).signal("-CONT");
        // The paused master's claims sat in its socket buffers and land on the resume: each
        // writes nothing (past its deadline) or is abandoned by its guard. Every key on that
        // shard runs on its retry, none is locked for a lease (202).
        tokio::time::sleep(Duration::from_millis(1500)).await;
        for (key, _, _, _) in answers.iter().filter(|a| a.1) {
            let resumed = Instant::now();
            loop {
                let retry = send(&app, keyed("POST", "/payments", key, "{}")).await;
                if retry.status == StatusCode::CREATED {
                    break;
                }
                // The cluster client may still be refreshing its view of the node: 503.
                retry.assert_problem(503, "store-unavailable");
                assert!(resumed.elapsed() < Duration::from_secs(8), "{key} still fails");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
        assert_eq!(calls.get(), 1 + answers.len(), "a key on the paused shard ran twice or never");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_master_fails_its_own_keys_with_503_and_no_others() {
    one_master_down("killed", |cluster, port| cluster.node_mut(port).kill()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_master_fails_its_own_keys_with_503_in_bounded_time() {
    one_master_down("paused", |cluster, port| cluster.node(port).signal("-STOP")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_mid_load_recovers_and_keeps_completed_records() {
    let cluster = RedisCluster::start(3, 1);
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(cluster.store()));
    // Records completed before the failover.
    for i in 0..100 {
        assert_eq!(
            send(&app, keyed("POST", "/payments", &format!("before-{i}"), "{}")).await.status,
            201
        );
    }
    let masters = cluster.masters().await;
    let masters_before: Vec<u16> = masters.iter().map(|(port, _)| *port).collect();
    let replica = cluster
        .nodes
        .iter()
        .map(|n| n.port)
        .find(|port| !masters_before.contains(port))
        .expect("a replica");

    // A manual failover needs the replica in sync with its master.
    let mut connection = cluster.node(replica).connection().await;
    eventually("the replica is in sync", async || {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut connection.clone())
            .await
            .unwrap();
        info.contains("master_link_status:up")
    })
    .await;

    let statuses: Arc<Mutex<BTreeMap<u16, usize>>> = Arc::default();
    let stop_at = Instant::now() + Duration::from_secs(4);
    let load: Vec<_> = (0..4)
        .map(|worker| {
            let (app, statuses) = (app.clone(), statuses.clone());
            tokio::spawn(async move {
                let mut n = 0;
                while Instant::now() < stop_at {
                    n += 1;
                    let key = format!("during-{worker}-{n}");
                    let seen = tokio::time::timeout(
                        Duration::from_secs(5),
                        send(&app, keyed("POST", "/payments", &key, "{}")),
                    )
                    .await
                    .unwrap_or_else(|_| panic!("{key} hung during the failover"));
                    *statuses.lock().unwrap().entry(seen.status.as_u16()).or_default() += 1;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let () = redis::cmd("CLUSTER").arg("FAILOVER").query_async(&mut connection).await.unwrap();
    let failover_sent = Instant::now();
    loop {
        let info: String =
            redis::cmd("INFO").arg("replication").query_async(&mut connection).await.unwrap();
        if info.contains("role:master") {
            break;
        }
        assert!(failover_sent.elapsed() < Duration::from_secs(10), "the replica was not promoted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let promoted_in = failover_sent.elapsed();
    for worker in load {
        worker.await.unwrap();
    }

    // After the failover: new keys succeed (their scripts load on the promoted node), and the
    // records completed before it are still replayed.
    let started = Instant::now();
    loop {
        let seen = send(
            &app,
            keyed("POST", "/payments", &format!("after-{}", started.elapsed().as_nanos()), "{}"),
        )
        .await;
        if seen.status == StatusCode::CREATED {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "no success after the failover: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut replayed = 0;
    for i in 0..100 {
        let seen = send(&app, keyed("POST", "/payments", &format!("before-{i}"), "{}")).await;
        replayed += usize::from(seen.replayed());
    }
    let statuses = statuses.lock().unwrap().clone();
    // The promoted node had never seen the scripts: the first EVALSHA on it met NOSCRIPT, and
    // the store loaded the script there and ran it again.
    let stats: String =
        redis::cmd("INFO").arg("commandstats").query_async(&mut connection).await.unwrap();
    assert!(stats.contains("cmdstat_script|load:"), "no script was loaded on the promoted node");
    eprintln!(
        "failover: promoted in {promoted_in:?}; answers during the load {statuses:?}; {replayed} of 100 records written before it replayed"
    );
    assert!(statuses.keys().all(|s| [201, 503].contains(s)), "{statuses:?}");
    assert_eq!(replayed, 100, "a manual failover is coordinated: no completed record may be lost");
}
