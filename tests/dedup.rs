//! The `dedup` door's strategies (markers, bucketed sets, Bloom filters) on every store that
//! implements `DedupStore` (memory, Redis, a real Cluster): no false negative within the
//! window, no false positive for an id never seen (the exact ones), a bucket boundary losing
//! nothing, a page with duplicates in it, concurrent callers, and what the store holds.

mod common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum_idempotency::{
    dedup::{Dedup, Strategy},
    hashing::{Deploy, Hashing},
    store::{DedupStore, StoreError},
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

/// The bucketed strategies under test, each sized so generously (Bloom: a millionth at ten
/// thousand events) that these few events meet no false positive.
fn bucketed() -> [Strategy; 2] {
    [Strategy::buckets(WINDOW), Strategy::bloom(WINDOW, 10_000, 1e-6)]
}

async fn bucketed_strategies_lose_nothing_at_a_boundary<St: DedupStore>(store: St) {
    for strategy in bucketed() {
        let door = Dedup::new(store.clone(), strategy);
        let start = bucket_start(2);
        let last_ms = start - Duration::from_millis(1);
        // Seen in the last millisecond of a bucket, then again in the first of the next.
        assert_eq!(door.first_seen_at("clicks", &["edge"], last_ms).await.unwrap(), [true]);
        assert_eq!(
            door.first_seen_at("clicks", &["edge"], start).await.unwrap(),
            [false],
            "{strategy:?}"
        );
        // Seen in the next bucket by an instance whose clock is a whole window behind.
        let seen_late = start + WINDOW;
        assert_eq!(door.first_seen_at("clicks", &["late"], seen_late).await.unwrap(), [true]);
        assert_eq!(
            door.first_seen_at("clicks", &["late"], start).await.unwrap(),
            [false],
            "{strategy:?}"
        );
        // Two buckets on, an event is new again.
        let later = start + 2 * WINDOW;
        assert_eq!(
            door.first_seen_at("clicks", &["edge"], later).await.unwrap(),
            [true],
            "{strategy:?}"
        );
        // A page: duplicates within it count once; one seen before is not new.
        let page = door.first_seen_at("clicks", &["p1", "edge", "p1", "p2"], later).await;
        assert_eq!(page.unwrap(), [true, false, false, true], "{strategy:?}");
    }
}

/// A backfill whose times are older than a bucket is kept (two windows and a quarter past its
/// start) is refused, never answered new; one within the horizon is deduplicated as ever.
async fn a_backfill_past_the_horizon_is_refused_never_answered_new<St: DedupStore>(store: St) {
    for strategy in bucketed() {
        let door = Dedup::new(store.clone(), strategy);
        let long_ago = SystemTime::now() - 3 * WINDOW;
        let refused = door.first_seen_at("clicks", &["old"], long_ago).await;
        assert!(matches!(refused, Err(StoreError::BeyondHorizon(_))), "{strategy:?}: {refused:?}");
        let again = door.first_seen_at("clicks", &["old"], long_ago).await;
        assert!(again.is_err(), "{strategy:?}: a duplicate past the horizon was answered");
        let recent = SystemTime::now() - WINDOW / 2;
        assert_eq!(door.first_seen_at("clicks", &["recent"], recent).await.unwrap(), [true]);
        assert_eq!(
            door.first_seen_at("clicks", &["recent"], recent).await.unwrap(),
            [false],
            "{strategy:?}"
        );
    }
}

/// A backfill whose original sits in the bucket before its own (seen late in a bucket, asked
/// half a window on, in the next), asked once that bucket would have expired under the old
/// horizon (its own bucket's): never answered new, each of 200 ids; and refused, never answered
/// new, once the bucket before it has expired.
async fn a_backfill_whose_original_is_a_bucket_back_is_never_answered_new<St: DedupStore>(
    store: St,
) {
    let window = Duration::from_secs(2);
    for strategy in [Strategy::buckets(window), Strategy::bloom(window, 10_000, 1e-6)] {
        let door = Dedup::new(store.clone(), strategy);
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        let w = window.as_millis() as u64;
        let bucket = now.as_millis() as u64 / w;
        let seen = UNIX_EPOCH + Duration::from_millis(bucket * w + w * 3 / 4);
        let ids: Vec<String> = (0..200).map(|i| format!("evt_{i}")).collect();
        let first = door.first_seen_at("backfill", &ids, seen).await.unwrap();
        assert!(first.iter().all(|new| *new), "{strategy:?}");
        let asked = seen + window / 2;
        // Past `seen`'s bucket's old expiry (two windows and a quarter from its start).
        let old_expiry = UNIX_EPOCH + Duration::from_millis((bucket + 2) * w + w / 4 + 100);
        tokio::time::sleep(old_expiry.duration_since(SystemTime::now()).unwrap_or_default()).await;
        for id in &ids {
            match door.first_seen_at("backfill", &[id], asked).await {
                Ok(answer) => assert_eq!(answer, [false], "{strategy:?}: {id} answered new"),
                Err(error) => assert!(matches!(error, StoreError::BeyondHorizon(_)), "{error}"),
            }
        }
        // Past the bucket before `asked`'s own: refused, every one.
        let gone = UNIX_EPOCH + Duration::from_millis((bucket + 3) * w + w / 4 + 100);
        tokio::time::sleep(gone.duration_since(SystemTime::now()).unwrap_or_default()).await;
        for id in &ids {
            let refused = door.first_seen_at("backfill", &[id], asked).await;
            assert!(
                matches!(refused, Err(StoreError::BeyondHorizon(_))),
                "{strategy:?}: {refused:?}"
            );
        }
    }
}

/// A window as long as `Duration::MAX` keeps its buckets "for ever" (thirty years on), as a
/// store takes it: the first check is new, the second not (Redis refused the expiry after the
/// script wrote the member: an error, then "not new" for an event never handled).
async fn a_window_as_long_as_duration_max_deduplicates<St: DedupStore>(store: St) {
    for strategy in [Strategy::buckets(Duration::MAX), Strategy::bloom(Duration::MAX, 100, 0.01)] {
        let door = Dedup::new(store.clone(), strategy);
        assert_eq!(door.first_seen_batch("forever", &["e"]).await.unwrap(), [true], "{strategy:?}");
        assert_eq!(
            door.first_seen_batch("forever", &["e"]).await.unwrap(),
            [false],
            "{strategy:?}"
        );
    }
}

/// A rolling deploy changes the strategy (markers to buckets, buckets to Bloom, a window or a
/// rate): instances of the new configuration that keep checking the previous one
/// (`during_change_from`) answer every event the old ones saw as seen, and new ones as new.
async fn a_configuration_change_keeps_deduplicating_against_the_previous_one<St: DedupStore>(
    store: St,
) {
    let changes = [
        (Strategy::markers(WINDOW), Strategy::buckets(WINDOW)),
        (Strategy::buckets(WINDOW), Strategy::bloom(WINDOW, 10_000, 1e-6)),
        (Strategy::bloom(WINDOW, 10_000, 1e-6), Strategy::bloom(WINDOW, 20_000, 1e-6)),
        (Strategy::buckets(WINDOW), Strategy::buckets(2 * WINDOW)),
    ];
    for (i, (old, new)) in changes.into_iter().enumerate() {
        let scope = format!("clicks-{i}");
        let ids: Vec<String> = (0..200).map(|n| format!("evt-{n}")).collect();
        let before = Dedup::new(store.clone(), old);
        assert!(before.first_seen_batch(&scope, &ids).await.unwrap().iter().all(|&new| new));
        let after = Dedup::new(store.clone(), new).during_change_from(old);
        let again = after.first_seen_batch(&scope, &ids).await.unwrap();
        let answered_new = again.iter().filter(|&&new| new).count();
        assert_eq!(answered_new, 0, "{old:?} -> {new:?}: seen ids answered new");
        assert_eq!(after.first_seen_batch(&scope, &["fresh"]).await.unwrap(), [true]);
        // An old instance, still running, sees what the new ones saw meanwhile.
        assert_eq!(before.first_seen_batch(&scope, &["fresh"]).await.unwrap(), [false]);
    }
}

/// Keyed names (`Dedup::hashing`) deduplicate as plain ones do, apart from them: a plain
/// instance's ids are new to a keyed one. Moving a running stream to them is one rolling
/// deploy of the move's first build, which keeps every id the plain instances saw, and
/// which they see in turn.
async fn keyed_names_deduplicate_and_a_move_to_them_keeps_deduplicating<St: DedupStore>(store: St) {
    let strategies = [
        Strategy::markers(WINDOW),
        Strategy::buckets(WINDOW),
        Strategy::bloom(WINDOW, 10_000, 1e-6),
    ];
    for (i, strategy) in strategies.into_iter().enumerate() {
        let scope = format!("clicks-{i}");
        let ids: Vec<String> = (0..200).map(|n| format!("evt-{n}")).collect();
        let plain = Dedup::new(store.clone(), strategy);
        let keyed = Dedup::new(store.clone(), strategy).hashing(Hashing::keyed([9; 32]));
        let moving = Dedup::new(store.clone(), strategy)
            .hashing(Hashing::plain().moving_to(Hashing::keyed([9; 32]), Deploy::First).unwrap());
        assert!(plain.first_seen_batch(&scope, &ids).await.unwrap().iter().all(|&new| new));
        // Under its own names only, a keyed instance has seen none of them.
        assert_eq!(
            keyed.first_seen_batch(&scope, &ids[..1]).await.unwrap(),
            [true],
            "{strategy:?}"
        );
        assert_eq!(
            keyed.first_seen_batch(&scope, &ids[..1]).await.unwrap(),
            [false],
            "{strategy:?}"
        );
        let again = moving.first_seen_batch(&scope, &ids).await.unwrap();
        assert_eq!(again.iter().filter(|&&new| new).count(), 0, "{strategy:?}: seen ids new");
        assert_eq!(moving.first_seen_batch(&scope, &["fresh"]).await.unwrap(), [true]);
        // Plain instances still running and the keyed ones after the move see it.
        assert_eq!(plain.first_seen_batch(&scope, &["fresh"]).await.unwrap(), [false]);
        assert_eq!(keyed.first_seen_batch(&scope, &["fresh"]).await.unwrap(), [false]);
    }
}

/// Eight callers at once with the same 300 ids, in pages of 50 and one at a time: each id is
/// new to exactly one of them, whatever the strategy.
async fn concurrent_callers_see_each_event_new_once<St: DedupStore>(store: St) {
    let strategies = [Strategy::markers(WINDOW), bucketed()[0], bucketed()[1]];
    for (n, strategy) in strategies.into_iter().enumerate() {
        let door = Dedup::new(store.clone(), strategy);
        let scope = format!("concurrent-{n}");
        let ids: Vec<String> = (0..300).map(|i| format!("evt_{i}")).collect();
        let callers = (0..8).map(|caller| {
            let (door, ids, scope) = (door.clone(), ids.clone(), scope.clone());
            tokio::spawn(async move {
                let mut new = Vec::new();
                if caller % 2 == 0 {
                    for page in ids.chunks(50) {
                        let fresh = door.first_seen_batch(&scope, page).await.unwrap();
                        new.extend(
                            page.iter().zip(fresh).filter(|(_, f)| *f).map(|(id, _)| id.clone()),
                        );
                    }
                } else {
                    for id in ids.iter().rev() {
                        if door.first_seen(&scope, id).await.unwrap() {
                            new.push(id.clone());
                        }
                    }
                }
                new
            })
        });
        let mut new: Vec<String> = Vec::new();
        for caller in callers {
            new.extend(caller.await.unwrap());
        }
        new.sort();
        let mut expected = ids.clone();
        expected.sort();
        assert_eq!(new, expected, "{strategy:?}: each id new to exactly one caller");
    }
}

/// A Bloom variant built by hand with no bits and no hashes is held to a filter's least
/// size: it still never misses a duplicate, and the stores agree.
async fn a_bloom_variant_of_zero_size_still_answers<St: DedupStore>(store: St) {
    let strategy = Strategy::Bloom { window: WINDOW, shards: 0, bits: 0, hashes: 0 };
    let door = Dedup::new(store, strategy);
    assert_eq!(door.first_seen_batch("z", &["a", "a"]).await.unwrap(), [true, false]);
    assert!(!door.first_seen("z", "a").await.unwrap());
}

/// A Bloom filter at its design load: no seen event is ever new again, and new events are
/// taken for seen at about the rate it was sized for (1 %; here at most 4 %, the binomial's
/// far tail).
async fn a_bloom_filter_never_forgets_and_rarely_drops_a_new_event<St: DedupStore>(store: St) {
    let door = Dedup::new(store, Strategy::bloom(WINDOW, 4_000, 0.01));
    let at = bucket_start(2);
    let seen: Vec<String> = (0..4_000).map(|i| format!("seen_{i}")).collect();
    let mut filling = 0;
    for page in seen.chunks(500) {
        filling += door.first_seen_at("s", page, at).await.unwrap().iter().filter(|n| !**n).count();
    }
    assert!(filling < 40, "{filling} of 4,000 new events dropped while filling");
    for page in seen.chunks(500) {
        let again = door.first_seen_at("s", page, at).await.unwrap();
        assert!(again.iter().all(|new| !new), "a seen event was new again");
    }
    // Asked in the next bucket: this bucket's full filter is the one that answers.
    let fresh: Vec<String> = (0..4_000).map(|i| format!("fresh_{i}")).collect();
    let mut dropped = 0;
    for page in fresh.chunks(100) {
        let answers = door.first_seen_at("s", page, at + WINDOW).await.unwrap();
        dropped += answers.iter().filter(|new| !**new).count();
    }
    assert!(dropped <= 160, "{dropped} of 4,000 new events taken for seen");
    assert!(dropped > 0, "4,000 new events against a full 1 % filter and not one false positive");
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

on_every_dedup_store!(
    markers_are_exact_within_their_window,
    bucketed_strategies_lose_nothing_at_a_boundary,
    concurrent_callers_see_each_event_new_once,
    a_bloom_filter_never_forgets_and_rarely_drops_a_new_event,
    a_bloom_variant_of_zero_size_still_answers,
    a_backfill_past_the_horizon_is_refused_never_answered_new,
    a_backfill_whose_original_is_a_bucket_back_is_never_answered_new,
    a_window_as_long_as_duration_max_deduplicates,
    a_configuration_change_keeps_deduplicating_against_the_previous_one,
    keyed_names_deduplicate_and_a_move_to_them_keeps_deduplicating
);

fn bucket_of(at: SystemTime) -> u128 {
    at.duration_since(UNIX_EPOCH).unwrap().as_millis() / WINDOW.as_millis()
}

/// Random events over eight buckets, asked in time order, against a model: never a false
/// negative within the window, never "seen" for an id never seen or seen more than a bucket
/// away (for the Bloom filter too: sized for far more events than a case holds). Each case in
/// a scope of its own on the one store, for each bucketed strategy.
fn buckets_never_miss_an_event_within_the_window<St: DedupStore>(
    runtime: &tokio::runtime::Runtime,
    store: St,
) {
    for strategy in bucketed() {
        never_miss_an_event_within_the_window(runtime, store.clone(), strategy);
    }
}

fn never_miss_an_event_within_the_window<St: DedupStore>(
    runtime: &tokio::runtime::Runtime,
    store: St,
    strategy: Strategy,
) {
    use proptest::test_runner::{Config, TestRunner};
    let door = Dedup::new(store, strategy);
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
                            "{strategy:?}: id {id} seen {:?} ago was new",
                            at.duration_since(*then)
                        );
                    }
                    Some(then) if bucket_of(at) > bucket_of(*then) + 1 => {
                        prop_assert!(
                            new,
                            "{strategy:?}: id {id} seen two buckets ago was a duplicate"
                        );
                    }
                    None => prop_assert!(new, "{strategy:?}: id {id} never seen was a duplicate"),
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

/// Random pages of ids (repeats within a page and across pages), within one window, against a
/// model, for every strategy: an exact one answers exactly as the model (new the first time
/// only); the Bloom filter, sized far above these few events, too. Each case in a scope of its
/// own on the one store.
fn every_strategy_matches_a_model_within_the_window<St: DedupStore>(
    runtime: &tokio::runtime::Runtime,
    store: St,
) {
    use proptest::test_runner::{Config, TestRunner};
    let strategies = [Strategy::markers(WINDOW), bucketed()[0], bucketed()[1]];
    let mut runner = TestRunner::new(Config { cases: 32, ..Config::default() });
    let pages = proptest::collection::vec(proptest::collection::vec(0u8..24, 1..12), 1..10);
    let case = std::sync::atomic::AtomicUsize::new(0);
    let result = runner.run(&pages, |pages| {
        let case = case.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        runtime.block_on(async {
            for strategy in strategies {
                let door = Dedup::new(store.clone(), strategy);
                let scope = format!("model-{case}-{}", rand_suffix());
                let mut seen = std::collections::HashSet::new();
                for page in &pages {
                    let ids: Vec<[u8; 1]> = page.iter().map(|id| [*id]).collect();
                    let answers = match ids.len() {
                        1 => vec![door.first_seen(&scope, ids[0]).await.unwrap()],
                        _ => door.first_seen_batch(&scope, &ids).await.unwrap(),
                    };
                    let expected: Vec<bool> = page.iter().map(|id| seen.insert(*id)).collect();
                    prop_assert!(answers == expected, "{strategy:?}: {page:?}: {answers:?}");
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

/// Each store's properties on one runtime: the store's connections live on it.
mod properties {
    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
    }

    #[test]
    fn on_memory() {
        let runtime = runtime();
        let store = axum_idempotency::MemoryStore::new();
        super::buckets_never_miss_an_event_within_the_window(&runtime, store.clone());
        super::every_strategy_matches_a_model_within_the_window(&runtime, store);
    }

    #[cfg(feature = "redis")]
    #[test]
    fn on_redis() {
        let runtime = runtime();
        let server = crate::common::RedisServer::start();
        super::buckets_never_miss_an_event_within_the_window(&runtime, server.store());
        super::every_strategy_matches_a_model_within_the_window(&runtime, server.store());
    }

    #[cfg(feature = "cluster")]
    #[test]
    fn on_a_cluster() {
        let runtime = runtime();
        let harness =
            runtime.block_on(<crate::common::ClusterHarness as crate::common::Harness>::start());
        let store = crate::common::Harness::store(&harness);
        super::buckets_never_miss_an_event_within_the_window(&runtime, store.clone());
        super::every_strategy_matches_a_model_within_the_window(&runtime, store);
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

    // Keyed: a marker per event too, none under the plain hash of its id.
    let keyed =
        Dedup::new(server.store(), Strategy::markers(WINDOW)).hashing(Hashing::keyed([3; 32]));
    assert!(keyed.first_seen_batch("s", &ids).await.unwrap().iter().all(|new| *new));
    assert_eq!(dbsize(&mut control).await, 1000);
    let plain = axum_idempotency::store::RecordKey::new("dedup:m", b"s", b"evt_0");
    let exists: i64 =
        ::redis::cmd("EXISTS").arg(plain.as_str()).query_async(&mut control).await.unwrap();
    assert_eq!(exists, 0, "a marker under the plain hash of evt_0");
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
        assert!(pttl > window * 9 / 4 && pttl <= window * 13 / 4, "{key}: {pttl} ms left");
        members += count;
    }
    assert_eq!(members, 1000);
    let () = ::redis::cmd("FLUSHALL").query_async(&mut control).await.unwrap();

    // Bloom: one filter string per shard, each no longer than its bits.
    let strategy = Strategy::bloom(WINDOW, 16_000, 0.01);
    let Strategy::Bloom { bits, .. } = strategy else { unreachable!() };
    let filters = Dedup::new(server.store(), strategy);
    let fresh = filters.first_seen_batch("s", &ids).await.unwrap();
    assert!(fresh.iter().filter(|new| **new).count() >= 995, "1,000 events in a filter for 16,000");
    assert!(filters.first_seen_batch("s", &ids).await.unwrap().iter().all(|new| !new));
    let keys: Vec<String> =
        ::redis::cmd("KEYS").arg("dedup:f:*").query_async(&mut control).await.unwrap();
    assert_eq!(keys.len(), 16, "one filter per shard of the bucket: {keys:?}");
    for key in &keys {
        let bytes: u64 = ::redis::cmd("STRLEN").arg(key).query_async(&mut control).await.unwrap();
        let ones: u64 = ::redis::cmd("BITCOUNT").arg(key).query_async(&mut control).await.unwrap();
        assert!(
            bytes <= bits.div_ceil(8) && bytes > bits / 16,
            "{key}: {bytes} bytes of {bits} bits"
        );
        assert!(ones > 0 && ones <= 7 * 100, "{key}: {ones} bits set");
        // Allocated whole: a filter grown bit by bit would take up to twice its bytes.
        let usage: u64 =
            ::redis::cmd("MEMORY").arg("USAGE").arg(key).query_async(&mut control).await.unwrap();
        assert!(usage < bytes * 5 / 4 + 100, "{key}: {usage} bytes for a filter of {bytes}");
        let pttl: i64 = ::redis::cmd("PTTL").arg(key).query_async(&mut control).await.unwrap();
        let window = WINDOW.as_millis() as i64;
        assert!(pttl > window * 9 / 4 && pttl <= window * 13 / 4, "{key}: {pttl} ms left");
    }
}

/// On a Cluster, one bucket's sets and filters are spread over every master: a hot bucket is
/// not one slot.
#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clusters_masters_each_hold_part_of_a_bucket() {
    let harness = <common::ClusterHarness as common::Harness>::start().await;
    let ids: Vec<String> = (0..1000).map(|i| format!("evt_{i}")).collect();
    for strategy in bucketed() {
        let door = Dedup::new(common::Harness::store(&harness), strategy);
        assert!(door.first_seen_batch("s", &ids).await.unwrap().iter().all(|new| *new));
        assert!(door.first_seen_batch("s", &ids).await.unwrap().iter().all(|new| !new));
        let per_master = harness.cluster().dbsize_per_master().await;
        assert_eq!(per_master.len(), 3);
        assert_eq!(per_master.iter().map(|(_, keys)| keys).sum::<usize>(), 16, "{per_master:?}");
        assert!(per_master.iter().all(|(_, keys)| *keys >= 2), "{strategy:?}: {per_master:?}");
        harness.cluster().flush().await;
    }
}

/// The rate a Bloom strategy gives at a load: its design rate at its design load (spread over
/// its shards), about sixteen times that at twice the load, none for the exact strategies.
#[test]
fn a_bloom_strategy_states_its_rate_at_any_load() {
    let bloom = Strategy::bloom(WINDOW, 1_600_000, 0.01);
    let at_design = bloom.false_positive_rate(1_600_000);
    assert!((at_design - 0.01).abs() < 0.0005, "{at_design}");
    let doubled = bloom.false_positive_rate(3_200_000);
    assert!((0.15..0.17).contains(&doubled), "{doubled}");
    assert!(bloom.false_positive_rate(0) < 1e-12);
    assert_eq!(Strategy::markers(WINDOW).false_positive_rate(1_600_000), 0.0);
    assert_eq!(Strategy::buckets(WINDOW).false_positive_rate(1_600_000), 0.0);
}
