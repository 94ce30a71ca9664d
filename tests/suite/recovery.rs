//! Recovery from the system of record, end to end: `examples/outbox.rs` runs as child
//! processes over a private redis-server and a PostgreSQL database of each test's own (dropped
//! at the end), and is killed with SIGKILL, or paused with SIGSTOP, at the point each failure
//! window names. What a client sees, what Redis holds and how many payment rows exist are
//! asserted from outside the processes.
//!
//! Needs PostgreSQL at `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`,
//! a role that may create databases) and `redis-server` on PATH; fails when either is missing.
//! The service binary is the `outbox` example, built for these tests' features.

use crate::common;

use std::time::Duration;

use axum_idempotency::store::{RecordKey, deadpool_redis::redis::AsyncCommands};
use common::{RedisServer, postgres::TestDatabase as Database};
use serde_json::Value;

/// The services' lease: short, so that a test waits past it.
const LEASE_MS: u64 = 1000;
const PAST_LEASE: Duration = Duration::from_millis(LEASE_MS + 400);

/// What the outbox example wrote in a test's database.
trait Outbox {
    async fn payments(&self, key_hash: &str) -> i64;
    async fn outbox(&self, key_hash: &str) -> Option<Value>;
}

impl Outbox for Database {
    /// The payment rows made for `key_hash`.
    async fn payments(&self, key_hash: &str) -> i64 {
        let sql = "SELECT count(*) FROM payments WHERE key_hash = $1";
        self.client().await.query_one(sql, &[&key_hash]).await.unwrap().get(0)
    }

    /// The outbox row's body for `key_hash`, as JSON.
    async fn outbox(&self, key_hash: &str) -> Option<Value> {
        let sql = "SELECT body FROM idempotency_outbox WHERE key_hash = $1";
        let row = self.client().await.query_opt(sql, &[&key_hash]).await.unwrap()?;
        Some(serde_json::from_slice(&row.get::<_, Vec<u8>>(0)).unwrap())
    }
}

/// One process of the service (`outbox serve`), or of one delivery (`outbox consume`).
struct Process {
    child: common::example::Child,
    port: u16,
}

impl Process {
    fn spawn(args: &[&str], db: &Database, redis: &RedisServer, env: &[(&str, &str)]) -> Self {
        let port = common::free_port();
        let (url, redis_url, lease) = (db.url(), redis.url(), LEASE_MS.to_string());
        let mut vars = vec![
            ("DATABASE_URL", url.as_str()),
            ("REDIS_URL", redis_url.as_str()),
            ("OUTBOX_LEASE_MS", lease.as_str()),
        ];
        vars.extend_from_slice(env);
        let port_text = port.to_string();
        let mut args = args.to_vec();
        if args.first() == Some(&"serve") {
            args.extend(["--port", &port_text]);
        }
        Self { child: common::example::Child::spawn("outbox", &args, &vars), port }
    }

    async fn serve(db: &Database, redis: &RedisServer, env: &[(&str, &str)]) -> Self {
        let mut process = Self::spawn(&["serve"], db, redis, env);
        process.line_starting("listening").await;
        process
    }

    async fn line_starting(&mut self, prefix: &str) -> String {
        self.child.line_starting(prefix).await
    }

    async fn sigkill(&mut self) {
        self.child.sigkill().await;
    }

    fn signal(&self, signal: &str) {
        self.child.signal(signal);
    }
}

use common::example::Answer;

async fn pay(port: u16, key: &str) -> Result<Answer, hyper_util::client::legacy::Error> {
    common::example::post(port, "/payments", key).await
}

fn hash(key: &str) -> String {
    RecordKey::new("idempotency", b"", key.as_bytes()).hash().to_owned()
}

/// The idempotency record in Redis for `key`: its state byte, and the whole value.
async fn record(redis: &RedisServer, key: &str) -> Option<(char, Vec<u8>)> {
    let key = RecordKey::new("idempotency", b"", key.as_bytes());
    let value: Option<Vec<u8>> = redis.connection().await.get(key.as_str()).await.unwrap();
    value.map(|value| (char::from(value[1]), value))
}

/// Sends a payment to `process` and waits until its handler stops at `point`.
async fn send_until_paused(
    process: &mut Process,
    key: &str,
    point: &str,
) -> tokio::task::JoinHandle<Result<Answer, hyper_util::client::legacy::Error>> {
    let port = process.port;
    let key = key.to_owned();
    let request = tokio::spawn(async move { pay(port, &key).await });
    let line = process.line_starting("paused").await;
    assert!(line.starts_with(&format!("paused {point} ")), "{line}");
    request
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_commit_before_complete_is_answered_from_the_outbox() {
    let (redis, db) = (RedisServer::start(), Database::create("recovery").await);
    let mut first = Process::serve(&db, &redis, &[("OUTBOX_PAUSE", "after-commit")]).await;
    let second = Process::serve(&db, &redis, &[]).await;
    let request = send_until_paused(&mut first, "pay-1", "after-commit").await;
    first.sigkill().await;
    assert!(request.await.unwrap().is_err(), "the killed instance answered");
    // The payment committed; Redis still holds the dead claim, in progress.
    assert_eq!(db.payments(&hash("pay-1")).await, 1);
    let original = db.outbox(&hash("pay-1")).await.expect("the outbox row committed");
    assert_eq!(record(&redis, "pay-1").await.map(|r| r.0), Some('P'));

    tokio::time::sleep(PAST_LEASE).await;
    let retry = pay(second.port, "pay-1").await.unwrap();
    assert_eq!((retry.status, retry.replayed), (201, true), "{retry:?}");
    assert_eq!(retry.body, original);
    // The handler did not run again: one row, and the record holds the recovered outcome.
    assert_eq!(db.payments(&hash("pay-1")).await, 1);
    assert_eq!(record(&redis, "pay-1").await.map(|r| r.0), Some('C'));
    let again = pay(second.port, "pay-1").await.unwrap();
    assert_eq!((again.status, again.replayed, &again.body), (201, true, &original));
    assert_eq!(db.payments(&hash("pay-1")).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_complete_before_the_response_is_a_replay_without_asking() {
    let (redis, db) = (RedisServer::start(), Database::create("recovery").await);
    let mut first = Process::serve(&db, &redis, &[("OUTBOX_PAUSE", "after-complete")]).await;
    // Recovery times out at once on the second instance: were it asked, the answer would be
    // 503. It is not asked: the record is completed, and the retry is its replay.
    let second = Process::serve(&db, &redis, &[("OUTBOX_RECOVERY_TIMEOUT_MS", "0")]).await;
    let request = send_until_paused(&mut first, "pay-1", "after-complete").await;
    first.sigkill().await;
    assert!(request.await.unwrap().is_err(), "the killed instance answered");
    assert_eq!(record(&redis, "pay-1").await.map(|r| r.0), Some('C'));
    let original = db.outbox(&hash("pay-1")).await.unwrap();

    let retry = pay(second.port, "pay-1").await.unwrap();
    assert_eq!((retry.status, retry.replayed, &retry.body), (201, true, &original), "{retry:?}");
    assert_eq!(db.payments(&hash("pay-1")).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_before_commit_leaves_nothing_and_the_retry_runs_once() {
    let (redis, db) = (RedisServer::start(), Database::create("recovery").await);
    let mut first = Process::serve(&db, &redis, &[("OUTBOX_PAUSE", "before-commit")]).await;
    let second = Process::serve(&db, &redis, &[]).await;
    let request = send_until_paused(&mut first, "pay-1", "before-commit").await;
    first.sigkill().await;
    assert!(request.await.unwrap().is_err());
    assert_eq!(db.payments(&hash("pay-1")).await, 0, "an uncommitted payment is visible");
    assert_eq!(record(&redis, "pay-1").await.map(|r| r.0), Some('P'));

    tokio::time::sleep(PAST_LEASE).await;
    let retry = pay(second.port, "pay-1").await.unwrap();
    assert_eq!((retry.status, retry.replayed), (201, false), "{retry:?}");
    assert_eq!(db.payments(&hash("pay-1")).await, 1);
    assert_eq!(Some(retry.body.clone()), db.outbox(&hash("pay-1")).await);
    let again = pay(second.port, "pay-1").await.unwrap();
    assert_eq!((again.status, again.replayed, &again.body), (201, true, &retry.body));
    assert_eq!(db.payments(&hash("pay-1")).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_losing_the_record_is_answered_from_the_outbox_with_recovery_on_every_claim() {
    let (redis, db) = (RedisServer::start(), Database::create("recovery").await);
    let service = Process::serve(&db, &redis, &[("OUTBOX_EVERY_CLAIM", "1")]).await;
    let first = pay(service.port, "pay-1").await.unwrap();
    assert_eq!((first.status, first.replayed), (201, false));
    assert_eq!(record(&redis, "pay-1").await.map(|r| r.0), Some('C'));
    let () = axum_idempotency::store::deadpool_redis::redis::cmd("FLUSHALL")
        .query_async(&mut redis.connection().await)
        .await
        .unwrap();
    assert_eq!(record(&redis, "pay-1").await, None);

    let retry = pay(service.port, "pay-1").await.unwrap();
    assert_eq!((retry.status, retry.replayed), (201, true), "{retry:?}");
    assert_eq!(retry.body, first.body);
    assert_eq!(db.payments(&hash("pay-1")).await, 1);
    assert_eq!(record(&redis, "pay-1").await.map(|r| r.0), Some('C'));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_paused_past_its_lease_is_fenced_out_and_the_database_keeps_one_payment() {
    let (redis, db) = (RedisServer::start(), Database::create("recovery").await);
    // The first instance stops before its insert for 2.5 s of its own time; SIGSTOP freezes it
    // there, past its lease.
    let pause = [("OUTBOX_PAUSE", "before-insert"), ("OUTBOX_PAUSE_MS", "2500")];
    let mut slow = Process::serve(&db, &redis, &pause).await;
    let second = Process::serve(&db, &redis, &[]).await;
    let slow_request = send_until_paused(&mut slow, "pay-1", "before-insert").await;
    slow.signal("-STOP");

    tokio::time::sleep(PAST_LEASE).await;
    // The retry takes over; the outbox knows nothing (nothing committed): the handler runs.
    let retry = pay(second.port, "pay-1").await.unwrap();
    assert_eq!((retry.status, retry.replayed), (201, false), "{retry:?}");
    assert_eq!(db.payments(&hash("pay-1")).await, 1);
    let (state, stored) = record(&redis, "pay-1").await.unwrap();
    assert_eq!(state, 'C');

    // The first holder wakes, runs its insert, and meets the unique key hash: its handler
    // answers with the outcome that committed, and its complete is fenced out.
    slow.signal("-CONT");
    let late = tokio::time::timeout(Duration::from_secs(10), slow_request)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!((late.status, late.replayed), (201, false), "{late:?}");
    assert_eq!(late.body, retry.body, "the slow holder's client sees the payment that was made");
    assert_eq!(db.payments(&hash("pay-1")).await, 1);
    assert_eq!(record(&redis, "pay-1").await, Some(('C', stored)), "the record changed");
    let again = pay(second.port, "pay-1").await.unwrap();
    assert_eq!((again.status, again.replayed, &again.body), (201, true, &retry.body));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_on_the_consumer_door_is_recovered_without_running_again() {
    let (redis, db) = (RedisServer::start(), Database::create("recovery").await);
    let consume = ["consume", "--event", "evt_1", "--amount", "100"];
    let mut worker = Process::spawn(&consume, &db, &redis, &[("OUTBOX_PAUSE", "after-commit")]);
    worker.line_starting("paused after-commit").await;
    worker.sigkill().await;
    let key_hash =
        RecordKey::new("idempotency-consumer", b"payments-consumer", b"evt_1").hash().to_owned();
    assert_eq!(db.payments(&key_hash).await, 1);
    let original = db.outbox(&key_hash).await.unwrap();

    tokio::time::sleep(PAST_LEASE).await;
    let mut redelivery = Process::spawn(&consume, &db, &redis, &[]);
    let line: Value = serde_json::from_str(&redelivery.line_starting("{").await).unwrap();
    assert_eq!(line["outcome"], "replayed", "{line}");
    assert_eq!(line["receipt"], original);
    assert_eq!(db.payments(&key_hash).await, 1);
    let mut again = Process::spawn(&consume, &db, &redis, &[]);
    let line: Value = serde_json::from_str(&again.line_starting("{").await).unwrap();
    assert_eq!((&line["outcome"], &line["receipt"]), (&Value::from("replayed"), &original));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_worker_taken_over_on_the_consumer_door_leaves_the_event_done() {
    // The slow worker holds its transaction open before its commit, frozen past its lease; the
    // redelivery takes over, the outbox knows nothing yet, and its insert waits on the slow
    // worker's row. The slow worker commits (its complete is fenced out: the key is the
    // redelivery's now), and the redelivery's insert meets the unique key hash.
    let (redis, db) = (RedisServer::start(), Database::create("recovery").await);
    let consume = ["consume", "--event", "evt_1", "--amount", "100"];
    let pause = [("OUTBOX_PAUSE", "before-commit"), ("OUTBOX_PAUSE_MS", "1500")];
    let mut slow = Process::spawn(&consume, &db, &redis, &pause);
    slow.line_starting("paused before-commit").await;
    slow.signal("-STOP");
    tokio::time::sleep(PAST_LEASE).await;
    let mut redelivery = Process::spawn(&consume, &db, &redis, &[]);
    // The redelivery has taken over and waits on the slow worker's row (however long its
    // start took): only then may the slow worker go on.
    waits_on_a_row_lock(&db).await;
    slow.signal("-CONT");
    let key_hash =
        RecordKey::new("idempotency-consumer", b"payments-consumer", b"evt_1").hash().to_owned();
    let slow_line: Value = serde_json::from_str(&slow.line_starting("{").await).unwrap();
    assert_eq!(slow_line["outcome"], "ran", "{slow_line}");
    // The redelivery answers with the payment that was made, and the event is done: stored,
    // so every later delivery is a replay, never a failure on the unique key.
    let line: Value = serde_json::from_str(&redelivery.line_starting("{").await).unwrap();
    let original = db.outbox(&key_hash).await.unwrap();
    assert_eq!((&line["outcome"], &line["receipt"]), (&Value::from("ran"), &original), "{line}");
    assert_eq!(db.payments(&key_hash).await, 1);
    for _ in 0..2 {
        let mut again = Process::spawn(&consume, &db, &redis, &[]);
        let line: Value = serde_json::from_str(&again.line_starting("{").await).unwrap();
        assert_eq!((&line["outcome"], &line["receipt"]), (&Value::from("replayed"), &original));
    }
    assert_eq!(db.payments(&key_hash).await, 1);
}

/// Returns once a session of `db` waits on a lock (a row another transaction wrote); panics
/// after 30 seconds.
async fn waits_on_a_row_lock(db: &Database) {
    let client = db.client().await;
    for _ in 0..600 {
        let row = client
            .query_one(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE datname = current_database() AND wait_event_type = 'Lock'",
                &[],
            )
            .await
            .unwrap();
        if row.get::<_, i64>(0) > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no session waited on a lock within 30 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovery_hook_that_fails_or_times_out_answers_503_and_runs_nothing() {
    let (redis, db) = (RedisServer::start(), Database::create("recovery").await);
    let mut first = Process::serve(&db, &redis, &[("OUTBOX_PAUSE", "before-commit")]).await;
    let second = Process::serve(&db, &redis, &[("OUTBOX_RECOVERY_TIMEOUT_MS", "500")]).await;
    let request = send_until_paused(&mut first, "pay-1", "before-commit").await;
    first.sigkill().await;
    assert!(request.await.unwrap().is_err());
    tokio::time::sleep(PAST_LEASE).await;

    // Times out: the outbox is locked by a transaction that does not end.
    let mut locker = db.client().await;
    let lock = locker.transaction().await.unwrap();
    lock.batch_execute("LOCK TABLE idempotency_outbox IN ACCESS EXCLUSIVE MODE").await.unwrap();
    let refused = pay(second.port, "pay-1").await.unwrap();
    assert_eq!(refused.status, 503, "{refused:?}");
    assert!(refused.body["type"].as_str().unwrap().ends_with("recovery-failed"), "{refused:?}");
    lock.rollback().await.unwrap();
    assert_eq!(db.payments(&hash("pay-1")).await, 0);

    // Fails: the outbox is gone.
    let client = db.client().await;
    client.batch_execute("ALTER TABLE idempotency_outbox RENAME TO outbox_away").await.unwrap();
    let refused = pay(second.port, "pay-1").await.unwrap();
    assert_eq!(refused.status, 503, "{refused:?}");
    assert_eq!(db.payments(&hash("pay-1")).await, 0);
    // Still a takeover for the next retry: with the outbox back, it asks and runs once.
    assert_eq!(record(&redis, "pay-1").await.map(|r| r.0), Some('P'));
    client.batch_execute("ALTER TABLE outbox_away RENAME TO idempotency_outbox").await.unwrap();
    let ran = pay(second.port, "pay-1").await.unwrap();
    assert_eq!((ran.status, ran.replayed), (201, false), "{ran:?}");
    assert_eq!(db.payments(&hash("pay-1")).await, 1);
}
