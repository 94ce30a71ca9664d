//! The `dedup` door's exact strategies (markers, bucketed sets) on every store that implements
//! `DedupStore` (memory, Redis, a real Cluster): no false negative within the window, no false
//! positive for an id never seen, a bucket boundary losing nothing, a page with duplicates in
//! it, and what the store holds.

mod common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum_idempotency::{
    dedup::{Dedup, Strategy},
    store::DedupStore,
};
use proptest::prop_assert;

const WINDOW: Duration = Duration::from_secs(60);

/// A time at the start of a bucket of `WINDOW`, a few buckets from now (bucket times drive the
/// sets; their expiries must lie ahead of the store's clock).
fn bucket_start(buckets_ahead: u64) -> SystemTime {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64;
    let window = WINDOW.as_millis() as u64;
    UNIX_EPOCH + Duration::from_millis((now / window + buckets_ahead) * window)
}

async fn markers_are_exact_within_their_window<St: DedupStore>(store: St) {
    let window = Duration::from_millis(400);
    let door = Dedup::new(store, Strategy::markers(window));
    assert!(door.first_seen("clicks", "a").await.unwrap());
    assert!(!door.first_seen("clicks", "a").await.unwrap(), "a duplicate within the window");
    assert!(door.first_seen("other", "a").await.unwrap(), "scopes are apart");
    assert!(door.first_seen("clicks", "b").await.unwrap(), "never seen: no false positive");
    let page = door.first_seen_batch("clicks", &["a", "c", "c", "d", "b"]).await.unwrap();
    assert_eq!(page, [false, true, false, true, false]);
    tokio::time::sleep(window + Duration::from_millis(200)).await;
    assert!(door.first_seen("clicks", "a").await.unwrap(), "past the window it is new again");
}

async fn buckets_lose_nothing_at_a_boundary<St: DedupStore>(store: St) {
    let door = Dedup::new(store, Strategy::buckets(WINDOW));
    let start = bucket_start(2);
    let last_ms = start - Duration::from_millis(1);
    // Seen in the last millisecond of a bucket, then again in the first of the next.
    assert_eq!(door.first_seen_at("clicks", &["edge"], last_ms).await.unwrap(), [true]);
    assert_eq!(door.first_seen_at("clicks", &["edge"], start).await.unwrap(), [false]);
    // Seen in the next bucket by an instance whose clock is a whole window behind.
    let seen_late = start + WINDOW;
    assert_eq!(door.first_seen_at("clicks", &["late"], seen_late).await.unwrap(), [true]);
    assert_eq!(door.first_seen_at("clicks", &["late"], start).await.unwrap(), [false]);
    // Three windows on, an event is new again.
    let later = start + 3 * WINDOW;
    assert_eq!(door.first_seen_at("clicks", &["edge"], later).await.unwrap(), [true]);
}

macro_rules! on_every_dedup_store {
    ($($test:ident),*) => {
        mod memory {
            $(
                #[tokio::test]
                async fn $test() {
                    super::$test(axum_idempotency::MemoryStore::new()).await;
                }
            )*
        }
        #[cfg(feature = "redis")]
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    let server = crate::common::RedisServer::start();
                    super::$test(server.store()).await;
                }
            )*
        }
        #[cfg(feature = "cluster")]
        mod cluster {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    let cluster = <crate::common::ClusterHarness as crate::common::Harness>::start().await;
                    super::$test(crate::common::Harness::store(&cluster)).await;
                }
            )*
        }
    };
}

on_every_dedup_store!(markers_are_exact_within_their_window, buckets_lose_nothing_at_a_boundary);

fn bucket_of(at: SystemTime) -> u128 {
    at.duration_since(UNIX_EPOCH).unwrap().as_millis() / WINDOW.as_millis()
}

/// Random events over eight buckets, asked in time order, against a model: never a false
/// negative within the window, never "seen" for an id never seen or seen more than a bucket
/// away. Each case in a scope of its own on the one store.
fn buckets_never_miss_an_event_within_the_window<St: DedupStore>(store: St) {
    use proptest::test_runner::{Config, TestRunner};
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let door = Dedup::new(store, Strategy::buckets(WINDOW));
    let mut runner = TestRunner::new(Config { cases: 48, ..Config::default() });
    let events = proptest::collection::vec((0u8..12, 0u64..8 * 60_000), 1..60);
    let case = std::sync::atomic::AtomicUsize::new(0);
    let result = runner.run(&events, |mut events| {
        let case = case.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let scope = format!("case-{case}-{}", rand_suffix());
        events.sort_by_key(|(_, at)| *at);
        runtime.block_on(async {
            let start = bucket_start(2);
            // When each id was last added (first seen), by the model.
            let mut added: std::collections::HashMap<u8, SystemTime> = Default::default();
            for (id, offset) in events {
                let at = start + Duration::from_millis(offset);
                let new = door.first_seen_at(&scope, &[[id]], at).await.unwrap()[0];
                match added.get(&id) {
                    Some(then) if at.duration_since(*then).unwrap() < WINDOW => {
                        prop_assert!(
                            !new,
                            "id {id} seen {:?} ago was new",
                            at.duration_since(*then)
                        );
                    }
                    Some(then) if bucket_of(at) > bucket_of(*then) + 1 => {
                        prop_assert!(new, "id {id} seen two buckets ago was a duplicate");
                    }
                    None => prop_assert!(new, "id {id} never seen was a duplicate"),
                    Some(_) => {}
                }
                if new {
                    added.insert(id, at);
                }
            }
            Ok(())
        })
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
}

fn rand_suffix() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64
}

mod properties {
    #[test]
    fn on_memory() {
        super::buckets_never_miss_an_event_within_the_window(axum_idempotency::MemoryStore::new());
    }

    #[cfg(feature = "redis")]
    #[test]
    fn on_redis() {
        let server = crate::common::RedisServer::start();
        super::buckets_never_miss_an_event_within_the_window(server.store());
    }

    #[cfg(feature = "cluster")]
    #[test]
    fn on_a_cluster() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let harness =
            runtime.block_on(<crate::common::ClusterHarness as crate::common::Harness>::start());
        let store = crate::common::Harness::store(&harness);
        super::buckets_never_miss_an_event_within_the_window(store);
        drop(harness);
    }
}

/// What Redis holds: a key per event with markers, a set per shard with buckets, each with
/// its expiry.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_holds_a_key_per_event_for_markers_and_a_set_per_shard_for_buckets() {
    let server = common::RedisServer::start();
    let mut control = server.connection().await;
    let ids: Vec<String> = (0..1000).map(|i| format!("evt_{i}")).collect();
    let dbsize = async |control: &mut ::redis::aio::MultiplexedConnection| -> i64 {
        ::redis::cmd("DBSIZE").query_async(control).await.unwrap()
    };
    let markers = Dedup::new(server.store(), Strategy::markers(WINDOW));
    assert!(markers.first_seen_batch("s", &ids).await.unwrap().iter().all(|new| *new));
    assert_eq!(dbsize(&mut control).await, 1000);
    let () = ::redis::cmd("FLUSHALL").query_async(&mut control).await.unwrap();

    let buckets = Dedup::new(server.store(), Strategy::buckets(WINDOW));
    assert!(buckets.first_seen_batch("s", &ids).await.unwrap().iter().all(|new| *new));
    assert!(buckets.first_seen_batch("s", &ids).await.unwrap().iter().all(|new| !new));
    let keys: Vec<String> =
        ::redis::cmd("KEYS").arg("dedup:b:*").query_async(&mut control).await.unwrap();
    assert_eq!(keys.len(), 16, "one set per shard of the bucket: {keys:?}");
    let mut members = 0;
    for key in &keys {
        let count: i64 = ::redis::cmd("SCARD").arg(key).query_async(&mut control).await.unwrap();
        let pttl: i64 = ::redis::cmd("PTTL").arg(key).query_async(&mut control).await.unwrap();
        let window = WINDOW.as_millis() as i64;
        assert!(pttl > 2 * window && pttl <= 3 * window, "{key}: {pttl} ms left");
        members += count;
    }
    assert_eq!(members, 1000);
}
