//! `RegionalStore::moving_to`: a region added to a running service in three rolling deploys,
//! the move between namings' transition over two region lists. A list rolled out to one
//! instance first is refused and runs nothing; every key runs once across neighbouring
//! deploys, and a key whose home moved is replayed, not run again. Over memory stores and over
//! a private redis-server per region.

use crate::common;

use std::time::Duration;

use axum::Router;
use axum_idempotency::{
    IdempotencyLayer, MemoryStore, RedisStore,
    hashing::Deploy,
    store::{RegionalStore, RegionsMoveError, Store},
};
use common::{Calls, RedisServer, app, delayed, global, keyed, send, send_in_background};

const OLD: [&str; 2] = ["eu", "us"];
const ALL: [&str; 3] = ["eu", "us", "ap"];

/// The stores of three regions, `eu`, `us` and `ap`: each call gives an instance's own
/// handles on them (for Redis, its own pools).
trait Regions {
    type St: Store;
    fn stores(&self) -> Vec<(&'static str, Self::St)>;

    fn list(&self, names: &[&str]) -> RegionalStore<Self::St> {
        RegionalStore::new(self.stores().into_iter().filter(|(name, _)| names.contains(name)))
    }

    fn old(&self) -> RegionalStore<Self::St> {
        self.list(&OLD)
    }

    fn added(&self) -> RegionalStore<Self::St> {
        self.list(&ALL)
    }

    fn moving(&self, deploy: Deploy) -> RegionalStore<Self::St> {
        self.old().moving_to(self.added(), deploy).expect("a move between two lists")
    }
}

struct InMemory([MemoryStore; 3]);

impl Regions for InMemory {
    type St = MemoryStore;
    fn stores(&self) -> Vec<(&'static str, MemoryStore)> {
        ALL.iter().zip(&self.0).map(|(name, store)| (*name, store.clone())).collect()
    }
}

struct InRedis(Vec<RedisServer>);

impl Regions for InRedis {
    type St = RedisStore;
    fn stores(&self) -> Vec<(&'static str, RedisStore)> {
        ALL.iter().zip(&self.0).map(|(name, server)| (*name, server.store())).collect()
    }
}

/// An instance over `store`, with short leases and records, so that a test sees deploys
/// forgotten (three announcements, a second each) and records expire.
fn instance<St: Store>(store: St, calls: &Calls) -> Router {
    let layer = IdempotencyLayer::new(store)
        .lease(Duration::from_millis(300))
        .keep_alive(Some(Duration::from_millis(300)))
        .retention(Duration::from_secs(5));
    app(calls).layer(layer)
}

/// How many of `keys` change home when `ap` is added.
fn moving_home(keys: &[String]) -> usize {
    let (old, new) =
        (RegionalStore::new(OLD.map(|n| (n, ()))), RegionalStore::new(ALL.map(|n| (n, ()))));
    keys.iter().filter(|key| old.home_of(&global(key)) != new.home_of(&global(key))).count()
}

fn keys(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i}")).collect()
}

fn leak(key: &str) -> &'static str {
    Box::leak(key.to_owned().into_boxed_str())
}

/// Every key of `keys` sent to both instances at once (a slow handler): each runs once.
async fn to_both(a: &Router, b: &Router, keys: &[String], calls: &Calls) {
    let before = calls.get();
    let sent: Vec<_> = keys
        .iter()
        .flat_map(|key| {
            let key = leak(key);
            [a, b].map(|app| send_in_background(app, delayed("/slow", key, 50, "{}")))
        })
        .collect();
    for answer in sent {
        let seen = answer.await.unwrap();
        assert!(matches!(seen.status.as_u16(), 200..=202), "{seen:?}");
    }
    assert_eq!(calls.get() - before, keys.len(), "a key ran on both neighbours");
}

/// Every key of `keys`, retried on `app`: replayed with `bodies`' body, none run.
async fn replayed(app: &Router, keys: &[String], bodies: &[String], calls: &Calls) {
    let before = calls.get();
    for (key, body) in keys.iter().zip(bodies) {
        let seen = send(app, keyed("POST", "/payments", key, "{}")).await;
        assert!(seen.replayed(), "{key}: {seen:?}");
        assert_eq!(&seen.body, body, "{key}");
    }
    assert_eq!(calls.get(), before, "a key ran again");
}

async fn ran(app: &Router, keys: &[String]) -> Vec<String> {
    let mut bodies = Vec::new();
    for key in keys {
        let seen = send(app, keyed("POST", "/payments", key, "{}")).await;
        assert_eq!((seen.status.as_u16(), seen.replayed()), (201, false), "{key}: {seen:?}");
        bodies.push(seen.body);
    }
    bodies
}

/// A list rolled out to one instance first (`eu,us` serving, an instance given `eu,us,ap`):
/// the new one is refused, saying that a change of region list is a move, and runs nothing;
/// every key sent to both runs once.
async fn a_list_rolled_out_to_one_instance_first_is_refused<R: Regions>(regions: R) {
    let calls = Calls::default();
    let old = instance(regions.old(), &calls);
    let first = ran(&old, &keys("warm", 1)).await;
    assert_eq!(first.len(), 1);
    let half = instance(regions.added(), &calls);
    let refused = send(&half, keyed("POST", "/payments", "k", "{}")).await;
    refused.assert_problem(503, "fleet-disagrees");
    let sent = keys("k", 60);
    assert!(moving_home(&sent) >= 10, "too few keys change home to mean anything");
    let before = calls.get();
    let answers: Vec<_> = sent
        .iter()
        .flat_map(|key| {
            let key = leak(key);
            [&old, &half].map(|app| send_in_background(app, delayed("/slow", key, 20, "{}")))
        })
        .collect();
    for (i, answer) in answers.into_iter().enumerate() {
        let seen = answer.await.unwrap();
        if i % 2 == 1 {
            seen.assert_problem(503, "fleet-disagrees");
        }
    }
    assert_eq!(calls.get() - before, 60, "each key once, on the instance of the list serving");
}

/// A region added in three deploys, each beside its neighbours: what deploy 0 completed is
/// replayed by deploys 1 and 2 (the keys whose home moved among them), keys sent to two
/// neighbours run once, a deploy skipped is refused, and deploy 3 starts once deploy 1's
/// records expired, replaying what deploy 2 completed.
async fn a_region_added_in_three_deploys_runs_every_key_once<R: Regions>(regions: R) {
    let calls = Calls::default();
    let deploy0 = instance(regions.old(), &calls);
    let done = keys("done", 60);
    let bodies = ran(&deploy0, &done).await;
    assert!(moving_home(&done) >= 10, "too few keys change home to mean anything");

    let deploy1 = instance(regions.moving(Deploy::First), &calls);
    replayed(&deploy1, &done, &bodies, &calls).await;
    to_both(&deploy0, &deploy1, &keys("one", 20), &calls).await;
    // Deploy 2 while deploy 0 runs (a deploy skipped): refused.
    let early = instance(regions.moving(Deploy::Second), &calls);
    send(&early, keyed("POST", "/payments", "x", "{}"))
        .await
        .assert_problem(503, "fleet-disagrees");

    // Deploy 0 stopped, and forgotten (three announcements, a second each).
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let deploy2 = instance(regions.moving(Deploy::Second), &calls);
    replayed(&deploy2, &done, &bodies, &calls).await;
    to_both(&deploy1, &deploy2, &keys("two", 20), &calls).await;
    // Deploy 3 while deploy 1's records may live: refused.
    let early = instance(regions.added(), &calls);
    send(&early, keyed("POST", "/payments", "y", "{}"))
        .await
        .assert_problem(503, "fleet-disagrees");

    // Deploy 1 stopped, and its records expired (a lease, the keep-alive ceiling, the
    // retention and its recovery window, 10.6 s, after it last announced itself): deploy 3
    // serves beside deploy 2, and replays what deploy 2 completed.
    tokio::time::sleep(Duration::from_millis(11_000)).await;
    let late = keys("three", 30);
    let bodies = ran(&deploy2, &late).await;
    assert!(moving_home(&late) >= 5, "too few keys change home to mean anything");
    let deploy3 = instance(regions.added(), &calls);
    replayed(&deploy3, &late, &bodies, &calls).await;
    to_both(&deploy2, &deploy3, &keys("four", 20), &calls).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_a_list_rolled_out_to_one_instance_first_is_refused() {
    a_list_rolled_out_to_one_instance_first_is_refused(InMemory(Default::default())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_list_rolled_out_to_one_instance_first_is_refused() {
    let servers = (0..3).map(|_| RedisServer::start()).collect();
    a_list_rolled_out_to_one_instance_first_is_refused(InRedis(servers)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_a_region_added_in_three_deploys_runs_every_key_once() {
    a_region_added_in_three_deploys_runs_every_key_once(InMemory(Default::default())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_region_added_in_three_deploys_runs_every_key_once() {
    let servers = (0..3).map(|_| RedisServer::start()).collect();
    a_region_added_in_three_deploys_runs_every_key_once(InRedis(servers)).await;
}

#[test]
fn a_move_to_the_same_regions_or_from_a_move_is_refused() {
    let regions = InMemory(Default::default());
    let same = regions.old().moving_to(regions.list(&["us", "eu"]), Deploy::First);
    assert_eq!(same.unwrap_err(), RegionsMoveError::SameRegions);
    let nested = regions.moving(Deploy::First).moving_to(regions.added(), Deploy::Second);
    assert_eq!(nested.unwrap_err(), RegionsMoveError::Nested);
    let falls_back = regions.old().fall_back_to("eu").moving_to(regions.added(), Deploy::First);
    assert_eq!(falls_back.unwrap_err(), RegionsMoveError::Fallback);
    assert!(
        RegionsMoveError::Nested.to_string().contains("one move at a time")
            || RegionsMoveError::Nested.to_string().contains("finish one move")
    );
}

/// A `PostgresStore::transaction` during a move of regions: a key whose home moves has two
/// homes, two databases, which one commit cannot write; the transaction is refused before it
/// writes anything, saying why, on either deploy of the move, and a key whose home stays
/// commits as ever. `DurableOutcomes::transaction`, which writes beside the store, commits
/// every key.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_of_a_key_changing_home_is_refused_before_it_writes() {
    use axum_idempotency::{
        Idempotent,
        durable::DurableOutcomes,
        store::{PostgresStore, sqlx},
    };
    use common::{Harness, postgres::PostgresHarness};

    let (eu, us) = (PostgresHarness::start().await, PostgresHarness::start().await);
    let pool = eu.pool();
    sqlx::query("CREATE TABLE payments (id BIGSERIAL PRIMARY KEY, code TEXT)")
        .execute(&pool)
        .await
        .unwrap();
    let outcomes = DurableOutcomes::new(pool.clone());
    outcomes.migrate().await.unwrap();
    // One payment through `door`, committed in `committer`'s transaction (a `PostgresStore`,
    // or `DurableOutcomes`: two types, one shape).
    macro_rules! pay {
        ($door:expr, $committer:expr, $code:expr) => {{
            let (committer, code) = ($committer.clone(), $code);
            let insert = "INSERT INTO payments (code) VALUES ($1)";
            $door
                .run("payments", &code.clone(), b"{}", move |context| async move {
                    committer
                        .transaction(&context, |tx| {
                            Box::pin(async move {
                                sqlx::query(insert).bind(code).execute(&mut *tx).await?;
                                Ok::<_, sqlx::Error>(axum::Json(1_u32))
                            })
                        })
                        .await
                        .map(|axum::Json(paid)| paid)
                })
                .await
        }};
    }
    let count = async || -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM payments").fetch_one(&pool).await.unwrap()
    };
    for (round, deploy) in [Deploy::First, Deploy::Second].into_iter().enumerate() {
        let old = RegionalStore::new([("eu", eu.store())]);
        let new = RegionalStore::new([("eu", eu.store()), ("us", us.store())]);
        let store = old.moving_to(new, deploy).unwrap();
        let (door, ledger): (_, PostgresStore) = (Idempotent::new(store.clone()), eu.store());
        let (mut refused, mut committed) = (0, 0);
        let before = count().await;
        for i in 0..20 {
            let paid = pay!(door, ledger, format!("evt{round}-{i}"));
            match paid {
                Ok(_) => committed += 1,
                Err(error) => {
                    assert!(error.to_string().contains("moves between region lists"), "{error}");
                    refused += 1;
                }
            }
        }
        assert!(
            refused > 0 && committed > 0,
            "{deploy:?}: refused {refused}, committed {committed}"
        );
        assert_eq!(count().await - before, committed, "{deploy:?}: a refused transaction wrote");

        // Beside the store: every key commits, on either deploy.
        let door = Idempotent::new(store).recover(outcomes.clone());
        for i in 0..20 {
            let paid = pay!(door, outcomes, format!("beside{round}-{i}"));
            assert!(paid.is_ok(), "{deploy:?} {i}: {paid:?}");
        }
    }
}

/// A store in the middle of a move keeps the store contract for every key its doors give it.
#[tokio::test]
async fn a_moving_regional_store_passes_the_kit() {
    let regions = InMemory(Default::default());
    for deploy in [Deploy::First, Deploy::Second] {
        axum_idempotency::conformance::check_all(&regions.moving(deploy)).await;
        axum_idempotency::conformance::check_admin(&regions.moving(deploy)).await;
    }
}

/// A region kept in both lists whose store differs in the list moved to (its URL changed in
/// the same deploy): refused, and nothing runs; its records in the old store would be
/// stranded at deploy 3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_region_given_another_store_is_refused() {
    let calls = Calls::default();
    let [eu, us, ap, other] = std::array::from_fn(|_| MemoryStore::new());
    let old = RegionalStore::new([("eu", eu.clone()), ("us", us.clone())]);
    let new = RegionalStore::new([("eu", eu.clone()), ("us", other), ("ap", ap.clone())]);
    let moved = instance(old.moving_to(new, Deploy::First).unwrap(), &calls);
    send(&moved, keyed("POST", "/payments", "k", "{}"))
        .await
        .assert_problem(503, "fleet-disagrees");
    // The same stores under the same names: served.
    let old = RegionalStore::new([("eu", eu.clone()), ("us", us.clone())]);
    let new = RegionalStore::new([("eu", eu), ("us", us), ("ap", ap)]);
    let moved = instance(old.moving_to(new, Deploy::First).unwrap(), &calls);
    let ran = send(&moved, keyed("POST", "/payments", "k", "{}")).await;
    assert_eq!(ran.status.as_u16(), 201, "{ran:?}");
    assert_eq!(calls.get(), 1);
}
