//! The world of the tests that run `examples/ledger.rs` as processes: a database of the
//! test's own, a payment provider in the test (outside the killed processes) that charges once
//! per idempotency key and counts its calls, Redis in front when the set-up says so.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{Json, Router, http::HeaderMap, routing};
use axum_idempotency::store::deadpool_redis::redis::AsyncCommands;
use serde_json::{Value, json};

pub use super::example::{Answer, post};
use super::{RedisServer, example::Child, postgres::TestDatabase};

/// The services' lease: short, so that a test waits past it.
pub const LEASE_MS: u64 = 1000;
pub const PAST_LEASE: Duration = Duration::from_millis(LEASE_MS + 400);

/// A payment provider that charges once per idempotency key, and counts every call.
#[derive(Clone, Default)]
pub struct Provider {
    /// Per key: the charge made, and how many calls asked for it.
    charges: Arc<Mutex<HashMap<String, (String, usize)>>>,
}

impl Provider {
    pub async fn start(&self) -> String {
        let charges = self.charges.clone();
        let app = Router::new().route(
            "/charges",
            routing::post(move |headers: HeaderMap| async move {
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
    pub fn counts(&self) -> (usize, usize) {
        let charges = self.charges.lock().unwrap();
        (charges.len(), charges.values().map(|(_, calls)| calls).sum())
    }
}

/// A test's world: its database, the provider, Redis when in front, and the processes.
pub struct World {
    pub db: TestDatabase,
    pub provider: Provider,
    pub provider_url: String,
    /// Redis in front, PostgreSQL the authority; `None`: PostgreSQL alone.
    pub redis: Option<RedisServer>,
}

/// Runs `test` in a world of each set-up: PostgreSQL alone, then Redis in front
/// (`LEDGER_SET_UP=postgres` or `redis`: that one alone, to look at one).
pub async fn in_both_set_ups<F: AsyncFn(&World)>(test: F) {
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
    pub fn env(&self) -> Vec<(&'static str, String)> {
        let mut env = vec![
            ("DATABASE_URL", self.db.uri()),
            ("PROVIDER_URL", self.provider_url.clone()),
            ("LEDGER_LEASE_MS", LEASE_MS.to_string()),
        ];
        env.extend(self.redis.as_ref().map(|redis| ("REDIS_URL", redis.url())));
        env
    }

    pub fn spawn(&self, args: &[&str], pause: Option<&str>) -> Child {
        let env = self.env();
        let mut vars: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        vars.extend(pause.map(|point| ("LEDGER_PAUSE", point)));
        Child::spawn("ledger", args, &vars)
    }

    /// A process of the service, stopping at `pause` when given.
    pub async fn serve(&self, pause: Option<&str>) -> Service {
        let port = super::free_port().to_string();
        let mut child = self.spawn(&["serve", "--port", &port], pause);
        child.line_starting("listening").await;
        Service { child, port: port.parse().unwrap() }
    }

    pub async fn payments(&self) -> i64 {
        let sql = "SELECT count(*) FROM ledger_payments";
        self.db.client().await.query_one(sql, &[]).await.unwrap().get(0)
    }

    /// The record's state, in the record store: `Some('P')` in progress, `Some('C')`
    /// completed, `None` absent.
    pub async fn record(&self) -> Option<String> {
        if let Some(redis) = &self.redis {
            let mut keys: Vec<String> = redis.connection().await.keys("*").await.unwrap();
            keys.retain(|key| {
                !key.contains(":sub:") && !key.contains("-fleet:") && key.ends_with('}')
            });
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
        let sql = "SELECT state::text FROM idempotency_records WHERE state <> 'F'";
        let row = self.db.client().await.query_opt(sql, &[]).await;
        // Before the first service ran, the table does not exist: no record.
        row.ok().flatten().map(|row| row.get(0))
    }

    /// Whether the durable table holds an outcome (Redis in front only).
    pub async fn durable_outcome(&self) -> bool {
        let sql = "SELECT count(*) FROM idempotency_outcomes";
        let row = self.db.client().await.query_one(sql, &[]).await;
        row.is_ok_and(|row| row.get::<_, i64>(0) == 1)
    }

    /// The committed payment, as the client was to be answered: its id and charge.
    pub async fn committed(&self) -> Option<(i64, String)> {
        let sql = "SELECT id, charge FROM ledger_payments";
        let row = self.db.client().await.query_opt(sql, &[]).await.unwrap()?;
        Some((row.get(0), row.get(1)))
    }
}

pub struct Service {
    pub child: Child,
    pub port: u16,
}

pub async fn pay(port: u16, key: &str) -> Result<Answer, hyper_util::client::legacy::Error> {
    post(port, "/payments", key).await
}

/// Sends `pay-1` to a service that stops at `point`, and kills it there with SIGKILL.
pub async fn killed_at(world: &World, point: &str) {
    killed_at_path(world, "/payments", point).await;
}

/// Sends `pay-1` to `path` of a service that stops at `point`, and kills it there.
pub async fn killed_at_path(world: &World, path: &'static str, point: &str) {
    let mut doomed = world.serve(Some(point)).await;
    let port = doomed.port;
    let request = tokio::spawn(async move { post(port, path, "pay-1").await });
    assert_eq!(doomed.child.line_starting("paused").await, format!("paused {point}"));
    doomed.child.sigkill().await;
    assert!(request.await.unwrap().is_err(), "the killed service answered");
}

/// The retry runs the payment once: a fresh 201 with the committed payment, replayed after.
pub async fn the_retry_runs_once(world: &World, service: &Service) {
    let retry = pay(service.port, "pay-1").await.unwrap();
    assert_eq!((retry.status, retry.replayed), (201, false), "{retry:?}");
    the_answer_is_what_the_database_holds(world, &retry).await;
    let again = pay(service.port, "pay-1").await.unwrap();
    assert_eq!((again.status, again.replayed, &again.body), (201, true, &retry.body));
    assert_eq!(world.payments().await, 1);
    assert_eq!(world.provider.counts().0, 1, "the provider charged twice");
}

pub async fn the_answer_is_what_the_database_holds(world: &World, answer: &Answer) {
    let (id, charge) = world.committed().await.expect("a committed payment");
    let expected = json!({ "payment": id, "charge": charge, "amount": 100 });
    assert_eq!(answer.body, expected);
    assert_eq!(world.record().await.as_deref(), Some("C"));
}

// The consumer door: `ledger consume`, one delivery of `evt_1` a process.

/// A delivery of `evt_1`, stopping at `pause` when given.
pub fn deliver(world: &World, pause: Option<&str>) -> Child {
    world.spawn(&["consume", "--event", "evt_1", "--amount", "100"], pause)
}

/// What a delivery printed: `ran {…}`, `replayed {…}`, or the outcome's debug form.
pub async fn delivered(world: &World) -> (String, Value) {
    let line = deliver(world, None).line_starting("").await;
    let (what, body) = line.split_once(' ').unwrap_or((&line, "null"));
    (what.to_owned(), serde_json::from_str(body).unwrap_or(Value::String(body.to_owned())))
}
