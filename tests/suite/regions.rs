//! `RegionalStore`: one store per region, every key decided by its home region. The kit over
//! memory stores and over private redis-servers per region; two regions' layers, each over its
//! own routing store, running a key's handler once (and, as the control, a store per region
//! running it once per region); the home region unreachable answering 503 and running nothing.

use crate::common;

use std::time::Duration;

use axum::{Router, http::StatusCode};
use axum_idempotency::{
    IdempotencyLayer, MemoryStore, RedisStore, conformance,
    store::{CachingStore, RegionalStore},
};
use common::{Calls, Held, RedisServer, app, delayed, global, send, send_in_background};

const NAMES: [&str; 3] = ["eu", "us", "ap"];

fn memory_regions() -> RegionalStore<MemoryStore> {
    RegionalStore::new(NAMES.map(|name| (name, MemoryStore::new())))
}

/// A region's own routing store over the three servers: its own pools and subscribers, as a
/// region's instances would have.
fn redis_regions(servers: &[RedisServer]) -> RegionalStore<RedisStore> {
    RegionalStore::new(NAMES.iter().zip(servers).map(|(name, server)| (*name, server.store())))
}

mod memory {
    async fn store() -> axum_idempotency::store::RegionalStore<axum_idempotency::MemoryStore> {
        super::memory_regions()
    }

    axum_idempotency::store_conformance_tests!(store);
}

#[tokio::test]
async fn memory_regions_pass_the_operators_check_and_the_kit_under_a_near_cache() {
    conformance::check_admin(&memory_regions()).await;
    conformance::check_all(&CachingStore::new(memory_regions())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_regions_pass_the_kit() {
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    conformance::check_all(&redis_regions(&servers)).await;
    conformance::check_admin(&redis_regions(&servers)).await;
    // A near cache per region, in front of the routing store.
    conformance::check_all(&CachingStore::new(redis_regions(&servers))).await;
}

/// The key's home server among `servers`, as `store` routes it.
fn home<'s>(
    store: &RegionalStore<RedisStore>,
    servers: &'s [RedisServer],
    key: &str,
) -> &'s RedisServer {
    let index = NAMES.iter().position(|name| *name == store.home_of(&global(key))).unwrap();
    &servers[index]
}

/// Sends `key` to `first` (a handler of 300 ms), and once its claim is in the store the
/// retry to `second`, as a global load balancer sends a retry to another region; returns the
/// two answers.
async fn first_then_retry(
    first: &Router,
    second: &Router,
    holds: &RedisServer,
    key: &'static str,
) -> (common::Seen, common::Seen) {
    let original = send_in_background(first, delayed("/slow", key, 300, "{}"));
    common::eventually("the first attempt holds the key", async || {
        holds.held(&global(key)).await == Some(Held::InProgress)
    })
    .await;
    let retry = send(second, delayed("/slow", key, 300, "{}")).await;
    (original.await.unwrap(), retry)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_regions_given_the_same_key_run_the_handler_once() {
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let calls = Calls::default();
    let (eu, us) = (redis_regions(&servers), redis_regions(&servers));
    let eu_app = app(&calls).layer(IdempotencyLayer::new(eu.clone()));
    let us_app = app(&calls).layer(IdempotencyLayer::new(us));
    let keys = ["order-1", "order-2", "order-3", "order-4", "order-5", "order-6"];
    for (i, key) in keys.into_iter().enumerate() {
        let (first, retry) =
            first_then_retry(&eu_app, &us_app, home(&eu, &servers, key), key).await;
        assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
        assert!(!first.replayed());
        // The retry waited for the original in its home, and got its response.
        assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
        assert!(retry.replayed(), "{retry:?}");
        assert_eq!(retry.header("x-payment"), first.header("x-payment"));
        assert_eq!(calls.get(), i + 1, "{key} ran more than once");
    }
    // The keys are spread over the regions: each record is in its home's server alone.
    let mut homes = std::collections::HashSet::new();
    for key in keys {
        let home_name = eu.home_of(&global(key));
        homes.insert(home_name.to_owned());
        for (name, server) in NAMES.iter().zip(&servers) {
            let held = server.held(&global(key)).await;
            let expected = (*name == home_name).then_some(Held::Completed);
            assert_eq!(held, expected, "{key} in {name}, homed in {home_name}");
        }
    }
    assert!(homes.len() > 1, "six keys all homed in one region: {homes:?}");

    // Both at once, from either side, 20 keys: each runs once.
    let before = calls.get();
    let mut answers = Vec::new();
    for i in 0..20 {
        let key: &'static str = format!("at-once-{i}").leak();
        answers.push(send_in_background(&eu_app, delayed("/slow", key, 50, "{}")));
        answers.push(send_in_background(&us_app, delayed("/slow", key, 50, "{}")));
    }
    for answer in answers {
        let answer = answer.await.unwrap();
        assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
    }
    assert_eq!(calls.get() - before, 20, "20 keys, each sent to two regions at once");
}

/// The control: a store per region (today's only way without routing) runs a key once per
/// region it reaches, which the routing store above does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_per_region_runs_a_retried_key_once_per_region() {
    let (eu_server, us_server) = (RedisServer::start(), RedisServer::start());
    let calls = Calls::default();
    let eu_app = app(&calls).layer(IdempotencyLayer::new(eu_server.store()));
    let us_app = app(&calls).layer(IdempotencyLayer::new(us_server.store()));
    let (first, retry) = first_then_retry(&eu_app, &us_app, &eu_server, "order-1").await;
    assert_eq!((first.status, retry.status), (StatusCode::CREATED, StatusCode::CREATED));
    assert!(!retry.replayed(), "{retry:?}");
    assert_ne!(retry.header("x-payment"), first.header("x-payment"));
    assert_eq!(calls.get(), 2, "the retry in another region ran the handler again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_home_region_unreachable_answers_503_and_runs_nothing() {
    let eu_server = RedisServer::start();
    // `us`: a server that was there and is gone (killed): its port refuses connections.
    let mut us_server = RedisServer::start();
    let timeout = Duration::from_millis(300);
    let store = RegionalStore::new([
        ("eu", eu_server.store().command_timeout(timeout)),
        ("us", us_server.store().command_timeout(timeout)),
    ]);
    us_server.kill();
    let calls = Calls::default();
    let layer = app(&calls).layer(IdempotencyLayer::new(store.clone()));
    let homed_in = |region: &str| {
        (0..).map(|i| format!("k{i}")).find(|k| store.home_of(&global(k)) == region).unwrap()
    };
    let (abroad, local) = (homed_in("us").leak(), homed_in("eu").leak());

    for _ in 0..3 {
        let answer = send(&layer, delayed("/payments", abroad, 0, "{}")).await;
        assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE, "{answer:?}");
        let retry_after: u64 = answer.header("retry-after").expect("Retry-After").parse().unwrap();
        assert!(retry_after >= 1, "{answer:?}");
    }
    assert_eq!(calls.get(), 0, "a key whose home is unreachable ran its handler");
    assert_eq!(eu_server.held(&global(abroad)).await, None, "claimed outside its home");
    // The keys homed in the region still reachable are served as ever.
    let answer = send(&layer, delayed("/payments", local, 0, "{}")).await;
    assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
    assert_eq!(calls.get(), 1);
}

/// Downstream provider idempotency, the app's: with a store per region the handler runs again
/// in the second region, but a provider keyed by `IdempotencyContext::derived_key` charges
/// once, and both answers name the one charge (the derived key depends on the prefix, scope
/// and key, never on the store or the region).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_keyed_by_the_derived_key_charges_once_across_stores_per_region() {
    use std::{
        collections::HashMap,
        sync::{Arc, Mutex},
    };

    use axum::routing::post;
    use axum_idempotency::IdempotencyContext;

    // The provider: one charge per idempotency key it is given, as a payment provider keeps.
    let charges: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let runs = Calls::default();
    let region = |store: RedisStore| {
        let (charges, runs) = (charges.clone(), runs.clone());
        let charge = move |context: IdempotencyContext| async move {
            runs.next_call();
            tokio::time::sleep(Duration::from_millis(300)).await;
            let mut charges = charges.lock().unwrap();
            let count = charges.len();
            let id = *charges.entry(context.derived_key("psp").unwrap()).or_insert(count + 1);
            (StatusCode::CREATED, format!("charge {id}"))
        };
        Router::new().route("/slow", post(charge)).layer(IdempotencyLayer::new(store))
    };
    let (eu_server, us_server) = (RedisServer::start(), RedisServer::start());
    let (eu, us) = (region(eu_server.store()), region(us_server.store()));
    let (first, retry) = first_then_retry(&eu, &us, &eu_server, "order-1").await;
    assert_eq!(runs.get(), 2, "a store per region: the retry elsewhere ran the handler again");
    assert_eq!(charges.lock().unwrap().len(), 1, "the provider charged twice");
    assert_eq!((first.body.as_str(), retry.body.as_str()), ("charge 1", "charge 1"));
}

/// The opt-in fallback: a key whose home is unreachable is claimed, completed and replayed in
/// the fallback region; what it gives up shows once the home is back: the key runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_opt_in_fallback_serves_a_cut_off_home_here_and_gives_up_uniqueness() {
    let eu_server = RedisServer::start();
    let mut us_server = RedisServer::start();
    let timeout = Duration::from_millis(300);
    let store = RegionalStore::new([
        ("eu", eu_server.store().command_timeout(timeout)),
        ("us", us_server.store().command_timeout(timeout)),
    ])
    .fall_back_to("eu");
    us_server.kill();
    let calls = Calls::default();
    let layer = app(&calls).layer(IdempotencyLayer::new(store.clone()));
    let key: &'static str =
        (0..).map(|i| format!("k{i}")).find(|k| store.home_of(&global(k)) == "us").unwrap().leak();

    let first = send(&layer, delayed("/payments", key, 0, "{}")).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    // The complete followed the claim to the fallback: the retry is its replay.
    assert_eq!(eu_server.held(&global(key)).await, Some(Held::Completed));
    let retry = send(&layer, delayed("/payments", key, 0, "{}")).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(calls.get(), 1);

    // The home is back (empty, as a home that never saw the claim): the key runs again.
    us_server.restart();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let answer = send(&layer, delayed("/payments", key, 0, "{}")).await;
        assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
        if !answer.replayed() {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the home never came back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(calls.get(), 2, "what the fallback gives up: the key ran once per side");
}

/// The fallback takes over only from a home that cannot be reached: any other answer of the
/// home's stands. A home that holds a value this crate did not write answers 500
/// `corrupt-record`, and nothing is claimed or run in the fallback region.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fallback_leaves_a_home_that_answered_alone() {
    let (eu_server, us_server) = (RedisServer::start(), RedisServer::start());
    let store = RegionalStore::new([("eu", eu_server.store()), ("us", us_server.store())])
        .fall_back_to("eu");
    let calls = Calls::default();
    let layer = app(&calls).layer(IdempotencyLayer::new(store.clone()));
    let key: &'static str =
        (0..).map(|i| format!("k{i}")).find(|k| store.home_of(&global(k)) == "us").unwrap().leak();
    let mut home = us_server.connection().await;
    let _: () = axum_idempotency::store::deadpool_redis::redis::cmd("SET")
        .arg(global(key).as_str())
        .arg("not a record of this crate")
        .query_async(&mut home)
        .await
        .unwrap();
    let answer = send(&layer, delayed("/payments", key, 0, "{}")).await;
    answer.assert_problem(500, "corrupt-record");
    assert_eq!(calls.get(), 0);
    assert_eq!(eu_server.held(&global(key)).await, None, "claimed in the fallback region");
}

/// Each region's store records its region's name: an instance whose region list names a store
/// by another region's name (URLs swapped, one store under two names) is refused before it
/// runs anything (503 `fleet-disagrees`), while the instances that name the stores as they
/// record themselves serve on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_named_for_another_region_is_refused() {
    let (eu, us) = (MemoryStore::new(), MemoryStore::new());
    let calls = Calls::default();
    let right = RegionalStore::new([("eu", eu.clone()), ("us", us.clone())]);
    let right = app(&calls).layer(IdempotencyLayer::new(right));
    assert_eq!(send(&right, delayed("/payments", "k1", 0, "{}")).await.status, StatusCode::CREATED);
    let swapped = RegionalStore::new([("eu", us.clone()), ("us", eu.clone())]);
    let twice = RegionalStore::new([("eu", eu.clone()), ("us", eu.clone())]);
    for wrong in [swapped, twice] {
        let wrong = app(&calls).layer(IdempotencyLayer::new(wrong));
        for key in ["k1", "k2"] {
            let refused = send(&wrong, delayed("/payments", key, 0, "{}")).await;
            refused.assert_problem(503, "fleet-disagrees");
        }
    }
    assert_eq!(calls.get(), 1, "run by an instance whose regions name the wrong stores");
    let again = send(&right, delayed("/payments", "k3", 0, "{}")).await;
    assert_eq!(again.status, StatusCode::CREATED);
}
