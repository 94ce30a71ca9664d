//! `CachingStore` over a private Redis: what the near cache promises beyond the behaviour
//! suite (which runs against it as `cached::*`): copies never outlive their records, the first
//! retry copies a record and the ones after it cost no round trip, and a record deleted by
//! hand is replayed for at most `max_age`.

use crate::common;

use std::{collections::BTreeMap, time::Duration};

use axum_idempotency::{
    Fingerprint, IdempotencyLayer,
    store::{
        CachingStore, Claim, Fenced, OwnerToken, RecordKey, Store,
        deadpool_redis::redis::AsyncCommands,
    },
};
use bytes::Bytes;
use common::*;

fn fp(body: &str) -> Fingerprint {
    Fingerprint::new("POST", "/payments", "", body.as_bytes())
}

async fn complete<S: Store>(store: &S, key: &RecordKey, retention: Duration) {
    let owner = OwnerToken::random();
    let lease = Duration::from_secs(30).into();
    assert_eq!(store.claim(key, &fp("1"), &owner, lease).await.unwrap(), Claim::Claimed);
    let response = Bytes::from_static(b"r");
    let written = store.complete(key, &owner, &fp("1"), response, retention).await;
    assert_eq!(written.unwrap(), Fenced::Applied);
}

async fn claim<S: Store>(store: &S, key: &RecordKey, body: &str) -> Claim {
    store
        .claim(key, &fp(body), &OwnerToken::random(), Duration::from_secs(30).into())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_of_a_record_stored_elsewhere_expires_with_the_record() {
    let server = RedisServer::start();
    let (a, b) = (CachingStore::new(server.store()), CachingStore::new(server.store()));
    let key = RecordKey::new("idempotency", b"", b"k1");
    complete(&a, &key, Duration::from_millis(600)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // B learns of the record from Redis, with its remaining retention, and keeps a copy.
    assert!(matches!(claim(&b, &key, "1").await, Claim::Replay { .. }));
    assert_eq!(b.cached(), 1);
    tokio::time::sleep(Duration::from_millis(400)).await;
    // The record expired 600 ms after it was stored: so did B's copy, well before max_age.
    assert_eq!(server.held(&key).await, None);
    assert_eq!(claim(&b, &key, "1").await, Claim::Claimed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_deleted_by_hand_is_replayed_for_at_most_max_age() {
    let server = RedisServer::start();
    let store = CachingStore::new(server.store()).max_age(Duration::from_millis(400));
    let key = RecordKey::new("idempotency", b"", b"k1");
    complete(&store, &key, Duration::from_secs(3600)).await;
    // Stored, not copied: the first retry reads Redis, and copies it.
    assert_eq!(store.cached(), 0);
    assert!(matches!(claim(&store, &key, "1").await, Claim::Replay { .. }));
    assert_eq!(store.cached(), 1);
    let () = server.connection().await.del(key.as_str()).await.unwrap();
    // The copy still answers, for the same request and against another one.
    assert!(
        matches!(claim(&store, &key, "1").await, Claim::Replay { response, .. } if response == "r")
    );
    assert_eq!(claim(&store, &key, "2").await, Claim::Mismatch);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(claim(&store, &key, "1").await, Claim::Claimed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_replay_or_mismatch_costs_no_round_trip() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(CachingStore::new(server.store())));
    assert_eq!(send(&app, keyed("POST", "/payments", "k1", "{}")).await.status, 201);
    // The first retry reads Redis (one round trip) and copies the record; the storm after it
    // costs none.
    reset_command_stats(&server).await;
    assert!(send(&app, keyed("POST", "/payments", "k1", "{}")).await.replayed());
    let first = command_calls(&server).await;
    assert_eq!(first, BTreeMap::from([("evalsha".to_owned(), 1)]), "first retry: one claim");
    let n = 50;
    reset_command_stats(&server).await;
    for _ in 0..n {
        let replay = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
        assert!(replay.replayed());
        assert!(replay.body.starts_with(r#"{"call":1,"#), "{}", replay.body);
    }
    send(&app, keyed("POST", "/payments", "k1", r#"{"other":1}"#))
        .await
        .assert_problem(409, "key-reused");
    assert_eq!(command_calls(&server).await, BTreeMap::new(), "cached answers: no command");
    assert_eq!(calls.get(), 1);
    // A fresh key still costs its two round trips.
    reset_command_stats(&server).await;
    assert_eq!(send(&app, keyed("POST", "/payments", "k2", "{}")).await.status, 201);
    let fresh = command_calls(&server).await;
    assert_eq!(fresh, BTreeMap::from([("evalsha".to_owned(), 2)]), "fresh: claim + complete");
}
