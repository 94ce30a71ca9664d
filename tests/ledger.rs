//! The outcome committed with the side effect (`examples/ledger.rs`, the README's way), both
//! doors, in both set-ups: PostgreSQL alone (`PostgresStore`), and Redis in front with
//! PostgreSQL the authority (`DurableOutcomes`, a private redis-server per test). The service
//! (and a consumer's delivery) runs as child processes over a database of each test's own
//! (dropped at the end) and is killed with SIGKILL at each window of a payment; each test runs
//! its window in both set-ups. The payment provider runs in the test, outside the killed process, and counts
//! its calls and charges per idempotency key. What a client sees, what the database holds and
//! what the provider charged are asserted from outside the processes: the retry gets the
//! committed response replayed, or runs the payment once; never twice, never an answer the
//! database does not hold.
//!
//! Needs PostgreSQL at `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`,
//! a role that may create databases) and `redis-server` on PATH; fails when either is missing.
#![cfg(all(feature = "postgres", feature = "redis"))]

mod common;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{Json, Router, body::Body, http::HeaderMap, routing::post};
use axum_idempotency::store::deadpool_redis::redis::AsyncCommands;
use common::{RedisServer, example::Child, postgres::TestDatabase};
use http::Request;
use http_body_util::BodyExt;
use serde_json::{Value, json};

/// The services' lease: short, so that a test waits past it.
const LEASE_MS: u64 = 1000;
const PAST_LEASE: Duration = Duration::from_millis(LEASE_MS + 400);

/// A payment provider that charges once per idempotency key, and counts every call.
#[derive(Clone, Default)]
struct Provider {
    /// Per key: the charge made, and how many calls asked for it.
    charges: Arc<Mutex<HashMap<String, (String, usize)>>>,
}

impl Provider {
    async fn start(&self) -> String {
        let charges = self.charges.clone();
        let app = Router::new().route(
            "/charges",
            post(move |headers: HeaderMap| async move {
                let key = headers.get("idempotency-key").expect("a key").to_str().unwrap();
                let mut charges = charges.lock().unwrap();
                let next = format!("ch_{}", charges.len() + 1);
                let entry = charges.entry(key.to_owned()).or_insert((next, 0));
                entry.1 += 1;
                Json(json!({ "charge": entry.0 }))
            }),
        );
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        url
    }

    /// (charges made, calls made), over every key.
    fn counts(&self) -> (usize, usize) {
        let charges = self.charges.lock().unwrap();
        (charges.len(), charges.values().map(|(_, calls)| calls).sum())
    }
}

/// A test's world: its database, the provider, Redis when in front, and the processes.
struct World {
    db: TestDatabase,
    provider: Provider,
    provider_url: String,
    /// Redis in front, PostgreSQL the authority; `None`: PostgreSQL alone.
    redis: Option<RedisServer>,
}

/// Runs `test` in a world of each set-up: PostgreSQL alone, then Redis in front
/// (`LEDGER_SET_UP=postgres` or `redis`: that one alone, to look at one).
async fn in_both_set_ups<F: AsyncFn(&World)>(test: F) {
    let only = std::env::var("LEDGER_SET_UP").ok();
    for redis in [false, true] {
        if only.as_deref().is_some_and(|only| only != if redis { "redis" } else { "postgres" }) {
            continue;
        }
        let (db, provider) = (TestDatabase::create("ledger").await, Provider::default());
        let provider_url = provider.start().await;
        let redis = redis.then(RedisServer::start);
        test(&World { db, provider, provider_url, redis }).await;
    }
}

impl World {
    /// The variables of a process of this world.
    fn env(&self) -> Vec<(&'static str, String)> {
        let mut env = vec![
            ("DATABASE_URL", self.db.uri()),
            ("PROVIDER_URL", self.provider_url.clone()),
            ("LEDGER_LEASE_MS", LEASE_MS.to_string()),
        ];
        env.extend(self.redis.as_ref().map(|redis| ("REDIS_URL", redis.url())));
        env
    }

    fn spawn(&self, args: &[&str], pause: Option<&str>) -> Child {
        let env = self.env();
        let mut vars: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        vars.extend(pause.map(|point| ("LEDGER_PAUSE", point)));
        Child::spawn("ledger", args, &vars)
    }

    /// A process of the service, stopping at `pause` when given.
    async fn serve(&self, pause: Option<&str>) -> Service {
        let port = common::free_port().to_string();
        let mut child = self.spawn(&["serve", "--port", &port], pause);
        child.line_starting("listening").await;
        Service { child, port: port.parse().unwrap() }
    }

    async fn payments(&self) -> i64 {
        let sql = "SELECT count(*) FROM ledger_payments";
        self.db.client().await.query_one(sql, &[]).await.unwrap().get(0)
    }

    /// The record's state, in the record store: `Some('P')` in progress, `Some('C')`
    /// completed, `None` absent.
    async fn record(&self) -> Option<String> {
        if let Some(redis) = &self.redis {
            let mut keys: Vec<String> = redis.connection().await.keys("*").await.unwrap();
            keys.retain(|key| !key.contains(":sub:") && key.ends_with('}'));
            assert!(keys.len() <= 1, "{keys:?}");
            let value: Option<Vec<u8>> = match keys.first() {
                Some(key) => redis.connection().await.get(key).await.unwrap(),
                None => None,
            };
            // 'W': in progress, with a waiter.
            return value.map(|value| {
                if value[1] == b'W' { "P".into() } else { char::from(value[1]).to_string() }
            });
        }
        let sql = "SELECT state::text FROM idempotency_records";
        let row = self.db.client().await.query_opt(sql, &[]).await;
        // Before the first service ran, the table does not exist: no record.
        row.ok().flatten().map(|row| row.get(0))
    }

    /// Whether the durable table holds an outcome (Redis in front only).
    async fn durable_outcome(&self) -> bool {
        let sql = "SELECT count(*) FROM idempotency_outcomes";
        let row = self.db.client().await.query_one(sql, &[]).await;
        row.is_ok_and(|row| row.get::<_, i64>(0) == 1)
    }

    /// The committed payment, as the client was to be answered: its id and charge.
    async fn committed(&self) -> Option<(i64, String)> {
        let sql = "SELECT id, charge FROM ledger_payments";
        let row = self.db.client().await.query_opt(sql, &[]).await.unwrap()?;
        Some((row.get(0), row.get(1)))
    }
}

struct Service {
    child: Child,
    port: u16,
}

/// What a client saw.
#[derive(Debug)]
struct Answer {
    status: u16,
    replayed: bool,
    body: Value,
}

async fn pay(port: u16, key: &str) -> Result<Answer, hyper_util::client::legacy::Error> {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Body>();
    let request = Request::post(format!("http://127.0.0.1:{port}/payments"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(r#"{"amount":100}"#))
        .unwrap();
    let response = tokio::time::timeout(Duration::from_secs(15), client.request(request))
        .await
        .expect("an answer within 15 s")?;
    let status = response.status().as_u16();
    let replayed = response.headers().get("idempotency-replayed").is_some_and(|v| v == "true");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let body = serde_json::from_slice(&body)
        .unwrap_or(Value::String(String::from_utf8_lossy(&body).into()));
    Ok(Answer { status, replayed, body })
}

/// Sends `pay-1` to a service that stops at `point`, and kills it there with SIGKILL.
async fn killed_at(world: &World, point: &str) {
    let mut doomed = world.serve(Some(point)).await;
    let port = doomed.port;
    let request = tokio::spawn(async move { pay(port, "pay-1").await });
    assert_eq!(doomed.child.line_starting("paused").await, format!("paused {point}"));
    doomed.child.sigkill().await;
    assert!(request.await.unwrap().is_err(), "the killed service answered");
}

/// The retry runs the payment once: a fresh 201 with the committed payment, replayed after.
async fn the_retry_runs_once(world: &World, service: &Service) {
    let retry = pay(service.port, "pay-1").await.unwrap();
    assert_eq!((retry.status, retry.replayed), (201, false), "{retry:?}");
    the_answer_is_what_the_database_holds(world, &retry).await;
    let again = pay(service.port, "pay-1").await.unwrap();
    assert_eq!((again.status, again.replayed, &again.body), (201, true, &retry.body));
    assert_eq!(world.payments().await, 1);
    assert_eq!(world.provider.counts().0, 1, "the provider charged twice");
}

async fn the_answer_is_what_the_database_holds(world: &World, answer: &Answer) {
    let (id, charge) = world.committed().await.expect("a committed payment");
    let expected = json!({ "payment": id, "charge": charge, "amount": 100 });
    assert_eq!(answer.body, expected);
    assert_eq!(world.record().await.as_deref(), Some("C"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_before_the_claim_the_retry_runs_once() {
    in_both_set_ups(async |world| {
        let service = world.serve(None).await;
        killed_at(world, "before-claim").await;
        assert_eq!((world.record().await, world.payments().await), (None, 0));
        assert_eq!(world.provider.counts(), (0, 0));
        the_retry_runs_once(world, &service).await;
        assert_eq!(world.provider.counts(), (1, 1));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_right_after_the_claim_the_retry_waits_out_the_lease_and_runs_once() {
    in_both_set_ups(async |world| {
        // Started first: the retry comes within the dead holder's lease.
        let service = world.serve(None).await;
        killed_at(world, "after-claim").await;
        assert_eq!((world.record().await.as_deref(), world.payments().await), (Some("P"), 0));
        // At once, within the dead holder's lease: the layer waits (its default) until the
        // lease lapses, takes the key over, and runs the payment once.
        the_retry_runs_once(world, &service).await;
        assert_eq!(world.provider.counts(), (1, 1));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_external_call_before_its_row_the_retry_charges_nothing_more() {
    in_both_set_ups(async |world| {
        let service = world.serve(None).await;
        killed_at(world, "after-call").await;
        assert_eq!(world.provider.counts(), (1, 1));
        assert_eq!((world.record().await.as_deref(), world.payments().await), (Some("P"), 0));
        tokio::time::sleep(PAST_LEASE).await;
        // The handler runs again and calls the provider again, with the same derived key:
        // the provider answers its first charge, and charges nothing more.
        the_retry_runs_once(world, &service).await;
        assert_eq!(world.provider.counts(), (1, 2));
        assert_eq!(world.committed().await.unwrap().1, "ch_1");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_row_before_the_commit_the_retry_runs_once() {
    in_both_set_ups(async |world| {
        let service = world.serve(None).await;
        killed_at(world, "before-commit").await;
        // The row went with the transaction.
        assert_eq!((world.record().await.as_deref(), world.payments().await), (Some("P"), 0));
        tokio::time::sleep(PAST_LEASE).await;
        the_retry_runs_once(world, &service).await;
        assert_eq!(world.provider.counts(), (1, 2));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_commit_before_the_layer_stored_anything_the_retry_is_a_replay() {
    in_both_set_ups(async |world| {
        let service = world.serve(None).await;
        killed_at(world, "after-commit").await;
        assert_eq!(world.payments().await, 1);
        if world.redis.is_some() {
            // Redis still holds the dead claim; the outcome is in PostgreSQL. The retry waits
            // out the lease, takes the claim over, and the table answers it.
            assert_eq!(world.record().await.as_deref(), Some("P"));
            assert!(world.durable_outcome().await);
        } else {
            // The committed row is the record: the retry is a replay at once, within the
            // dead holder's lease, with no hook.
            assert_eq!(world.record().await.as_deref(), Some("C"));
        }
        the_retry_is_a_replay(world, &service).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_store_before_the_response_was_sent_the_retry_is_a_replay() {
    in_both_set_ups(async |world| {
        let service = world.serve(None).await;
        killed_at(world, "after-store").await;
        assert_eq!((world.record().await.as_deref(), world.payments().await), (Some("C"), 1));
        the_retry_is_a_replay(world, &service).await;
    })
    .await;
}

/// The retry is the committed payment, replayed; nothing ran again.
async fn the_retry_is_a_replay(world: &World, service: &Service) {
    let retry = pay(service.port, "pay-1").await.unwrap();
    assert_eq!((retry.status, retry.replayed), (201, true), "{retry:?}");
    the_answer_is_what_the_database_holds(world, &retry).await;
    assert_eq!((world.payments().await, world.provider.counts()), (1, (1, 1)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_losing_its_records_is_answered_from_postgresql_on_both_doors() {
    in_both_set_ups(async |world| {
        let Some(redis) = &world.redis else { return };
        let service = world.serve(None).await;
        let first = pay(service.port, "pay-1").await.unwrap();
        assert_eq!((first.status, first.replayed), (201, false), "{first:?}");
        let (what, delivered_first) = delivered(world).await;
        assert_eq!(what, "ran");
        let () = axum_idempotency::store::deadpool_redis::redis::cmd("FLUSHALL")
            .query_async(&mut redis.connection().await)
            .await
            .unwrap();
        let retry = pay(service.port, "pay-1").await.unwrap();
        assert_eq!((retry.status, retry.replayed, &retry.body), (201, true, &first.body));
        assert_eq!(delivered(world).await, ("replayed".to_owned(), delivered_first));
        // Two payments (one a door), two charges: nothing ran again.
        let sql = "SELECT count(*) FROM ledger_payments";
        let payments: i64 = world.db.client().await.query_one(sql, &[]).await.unwrap().get(0);
        assert_eq!((payments, world.provider.counts().0), (2, 2));
    })
    .await;
}

// The consumer door: `ledger consume`, one delivery of `evt_1` a process.

/// A delivery of `evt_1`, stopping at `pause` when given.
fn deliver(world: &World, pause: Option<&str>) -> Child {
    world.spawn(&["consume", "--event", "evt_1", "--amount", "100"], pause)
}

/// What a delivery printed: `ran {…}`, `replayed {…}`, or the outcome's debug form.
async fn delivered(world: &World) -> (String, Value) {
    let line = deliver(world, None).line_starting("").await;
    let (what, body) = line.split_once(' ').unwrap_or((&line, "null"));
    (what.to_owned(), serde_json::from_str(body).unwrap_or(Value::String(body.to_owned())))
}

async fn worker_killed_at(world: &World, point: &str) {
    let mut doomed = deliver(world, Some(point));
    assert_eq!(doomed.line_starting("paused").await, format!("paused {point}"));
    doomed.sigkill().await;
}

/// The redelivery runs the payment once, and the one after it replays it.
async fn the_redelivery_runs_once(world: &World) {
    let (what, body) = delivered(world).await;
    assert_eq!(what, "ran", "{body}");
    let answer = Answer { status: 0, replayed: false, body: body.clone() };
    the_answer_is_what_the_database_holds(world, &answer).await;
    assert_eq!(delivered(world).await, ("replayed".to_owned(), body));
    assert_eq!(world.payments().await, 1);
    assert_eq!(world.provider.counts().0, 1, "the provider charged twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_before_the_claim_leaves_nothing_and_the_redelivery_runs_once() {
    in_both_set_ups(async |world| {
        worker_killed_at(world, "before-claim").await;
        assert_eq!((world.record().await, world.payments().await), (None, 0));
        the_redelivery_runs_once(world).await;
        assert_eq!(world.provider.counts(), (1, 1));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_right_after_the_claim_is_in_progress_then_runs_once_after_the_lease() {
    in_both_set_ups(async |world| {
        worker_killed_at(world, "after-claim").await;
        assert_eq!((world.record().await.as_deref(), world.payments().await), (Some("P"), 0));
        // The consumer door does not wait: within the lease, the redelivery is told to come
        // back.
        let (what, _) = delivered(world).await;
        assert!(what.starts_with("InProgress"), "{what}");
        tokio::time::sleep(PAST_LEASE).await;
        the_redelivery_runs_once(world).await;
        assert_eq!(world.provider.counts(), (1, 1));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_after_the_external_call_is_charged_once() {
    in_both_set_ups(async |world| {
        worker_killed_at(world, "after-call").await;
        assert_eq!(world.provider.counts(), (1, 1));
        assert_eq!((world.record().await.as_deref(), world.payments().await), (Some("P"), 0));
        tokio::time::sleep(PAST_LEASE).await;
        the_redelivery_runs_once(world).await;
        assert_eq!(world.provider.counts(), (1, 2));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_after_its_row_before_the_commit_runs_once_after_the_lease() {
    in_both_set_ups(async |world| {
        worker_killed_at(world, "before-commit").await;
        assert_eq!((world.record().await.as_deref(), world.payments().await), (Some("P"), 0));
        tokio::time::sleep(PAST_LEASE).await;
        the_redelivery_runs_once(world).await;
        assert_eq!(world.provider.counts(), (1, 2));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_after_its_commit_before_the_door_heard_of_it_is_replayed() {
    in_both_set_ups(async |world| {
        worker_killed_at(world, "after-commit").await;
        assert_eq!(world.payments().await, 1);
        if world.redis.is_some() {
            // Redis holds the dead claim until its lease lapses; then the table answers.
            assert_eq!(world.record().await.as_deref(), Some("P"));
            assert!(world.durable_outcome().await);
            tokio::time::sleep(PAST_LEASE).await;
        } else {
            assert_eq!(world.record().await.as_deref(), Some("C"));
        }
        the_redelivery_is_a_replay(world).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_after_the_door_settled_before_its_caller_heard_is_replayed() {
    in_both_set_ups(async |world| {
        worker_killed_at(world, "after-store").await;
        assert_eq!((world.record().await.as_deref(), world.payments().await), (Some("C"), 1));
        the_redelivery_is_a_replay(world).await;
    })
    .await;
}

async fn the_redelivery_is_a_replay(world: &World) {
    let (what, body) = delivered(world).await;
    assert_eq!(what, "replayed", "{body}");
    the_answer_is_what_the_database_holds(world, &Answer { status: 0, replayed: true, body }).await;
    assert_eq!((world.payments().await, world.provider.counts()), (1, (1, 1)));
}
