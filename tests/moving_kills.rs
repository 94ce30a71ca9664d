//! A real `SIGKILL` of an instance of a move's deploy (`Hashing::moving_to`) in the middle of a
//! burst, on Redis and on PostgreSQL: the instance is this binary again, in a process of its
//! own, serving 300 keys at once when it is killed (some between their two claims, some
//! running, some between their two completes). Then every key is retried on its outer
//! neighbour (which reads one naming only), then on its own deploy: no key whose response was
//! stored (under either name) runs again, and every retry of one is its replay. What ran in the
//! killed process is read from a file it appended to, a line a step.
#![cfg(all(feature = "redis", feature = "postgres"))]

mod common;

use std::{
    collections::HashMap,
    io::Write as _,
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{Router, extract::Path, http::StatusCode, routing::post};
use axum_idempotency::{
    IdempotencyLayer,
    hashing::{Deploy, Hashing},
    store::{PostgresStore, RecordStatus, RedisStore, Store, sqlx::postgres::PgPoolOptions},
};
use common::{RedisServer, keyed, postgres::TestDatabase, send};

const KEYS: usize = 300;
const LEASE: Duration = Duration::from_millis(500);
const SECRET: [u8; 32] = [0x6b; 32];

fn build(deploy: usize) -> Hashing {
    let keyed = || Hashing::keyed(SECRET);
    match deploy {
        0 => Hashing::plain(),
        1 => Hashing::plain().moving_to(keyed(), Deploy::First).unwrap(),
        2 => Hashing::plain().moving_to(keyed(), Deploy::Second).unwrap(),
        _ => keyed(),
    }
}

/// The store the variables name: Redis at `MOVING_KILLS_REDIS`, or PostgreSQL at
/// `MOVING_KILLS_POSTGRES`.
enum Backend {
    Redis(RedisStore),
    Postgres(PostgresStore),
}

impl Backend {
    async fn from(kind: &str, url: &str) -> Self {
        if kind == "redis" {
            Self::Redis(RedisStore::from_url(url).unwrap())
        } else {
            // Connections enough for a burst's claims and completes to go on side by side.
            let pool =
                PgPoolOptions::new().max_connections(40).connect_lazy_with(url.parse().unwrap());
            let store = PostgresStore::new(pool).sweep_every(None);
            store.migrate().await.unwrap();
            Self::Postgres(store)
        }
    }

    fn router(&self, deploy: usize, handler: Router) -> Router {
        fn layer<S: Store>(store: S, deploy: usize) -> IdempotencyLayer<S> {
            IdempotencyLayer::new(store).key_prefix("killed").hashing(build(deploy)).lease(LEASE)
        }
        match self {
            Self::Redis(store) => handler.layer(layer(store.clone(), deploy)),
            Self::Postgres(store) => handler.layer(layer(store.clone(), deploy)),
        }
    }

    /// Whether a response is stored for `key`, under either naming.
    async fn stored(&self, key: &str) -> bool {
        let mut stored = false;
        for alone in [0, 3] {
            let report = match self {
                Self::Redis(store) => {
                    let operator = IdempotencyLayer::new(store.clone()).key_prefix("killed");
                    operator.hashing(build(alone)).operator().inspect(b"", key, false).await
                }
                Self::Postgres(store) => {
                    let operator = IdempotencyLayer::new(store.clone()).key_prefix("killed");
                    operator.hashing(build(alone)).operator().inspect(b"", key, false).await
                }
            };
            let state = report.unwrap().map(|report| report.record.state);
            stored |= matches!(state, Some(RecordStatus::Completed));
        }
        stored
    }
}

/// A handler that appends `start key` and `end key` to `log` around 30 ms of work.
fn handler(log: Arc<Mutex<std::fs::File>>) -> Router {
    Router::new().route(
        "/pay/{key}",
        post(move |Path(key): Path<String>| {
            let log = log.clone();
            async move {
                writeln!(log.lock().unwrap(), "start {key}").unwrap();
                tokio::time::sleep(Duration::from_millis(30)).await;
                writeln!(log.lock().unwrap(), "end {key}").unwrap();
                (StatusCode::CREATED, format!("paid {key}"))
            }
        }),
    )
}

/// This binary again, as the instance that is killed: deploy `MOVING_KILLS_DEPLOY` serving
/// every key at once, its steps appended to `MOVING_KILLS_LOG`.
#[test]
fn killed_instance() {
    let (Ok(kind), Ok(url), Ok(deploy), Ok(log)) = (
        std::env::var("MOVING_KILLS_BACKEND"),
        std::env::var("MOVING_KILLS_URL"),
        std::env::var("MOVING_KILLS_DEPLOY"),
        std::env::var("MOVING_KILLS_LOG"),
    ) else {
        return;
    };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let backend = Backend::from(&kind, &url).await;
        let log = std::fs::OpenOptions::new().append(true).create(true).open(log).unwrap();
        let router = backend.router(deploy.parse().unwrap(), handler(Arc::new(Mutex::new(log))));
        // The door announces itself first, with one request of its own.
        send(&router, keyed("POST", "/pay/warm", "warm", "{}")).await;
        println!("burst");
        // A key a millisecond, each running at once: a burst of about 300 ms.
        let mut burst = Vec::new();
        for i in 0..KEYS {
            let router = router.clone();
            burst.push(tokio::spawn(async move {
                let key = format!("k{i}");
                send(&router, keyed("POST", &format!("/pay/{key}"), &key, "{}")).await
            }));
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        for request in burst {
            drop(request.await);
        }
        panic!("the instance was to be killed before its burst ended");
    });
}

/// Kills deploy `dying` mid-burst on `kind` at `url`, then retries every key on `outer`, then
/// on `dying`: the keys whose response was stored run no more, and replay it.
async fn killed_mid_burst(kind: &str, url: &str, dying: usize, outer: usize) {
    let dir =
        std::env::temp_dir().join(format!("moving-kills-{}-{kind}-{dying}", std::process::id()));
    let _ = std::fs::remove_file(&dir);
    let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args(["killed_instance", "--exact", "--nocapture", "--test-threads=1"])
        .env("MOVING_KILLS_BACKEND", kind)
        .env("MOVING_KILLS_URL", url)
        .env("MOVING_KILLS_DEPLOY", dying.to_string())
        .env("MOVING_KILLS_LOG", &dir)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
    let burst = async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if line.contains("burst") {
                return;
            }
        }
        panic!("the instance exited before its burst");
    };
    tokio::time::timeout(Duration::from_secs(60), burst).await.expect("the burst");
    // Killed with some keys between their claims, some running, some completing.
    let ran_by_then = || std::fs::read_to_string(&dir).unwrap_or_default().matches("end ").count();
    let started = tokio::time::Instant::now();
    while ran_by_then() < KEYS / 3 && started.elapsed() < Duration::from_secs(20) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    child.kill().await.unwrap();
    let killed_log = std::fs::read_to_string(&dir).unwrap();
    let ended = killed_log.matches("end ").count();
    assert!(ended < KEYS, "killed after {ended} of {KEYS} ended: not mid-burst");

    // Its claims lapse; what it stored is read before any retry.
    tokio::time::sleep(LEASE * 3).await;
    let backend = Backend::from(kind, url).await;
    let mut stored = HashMap::new();
    for i in 0..KEYS {
        let key = format!("k{i}");
        stored.insert(key.clone(), backend.stored(&key).await);
    }
    let retry_log = dir.with_extension("retries");
    let log = std::fs::File::create(&retry_log).unwrap();
    let log = Arc::new(Mutex::new(log));
    let mut replays_run = Vec::new();
    for deploy in [outer, dying] {
        let router = backend.router(deploy, handler(log.clone()));
        for i in 0..KEYS {
            let key = format!("k{i}");
            let seen = send(&router, keyed("POST", &format!("/pay/{key}"), &key, "{}")).await;
            assert_eq!(
                seen.status, 201,
                "{kind}, deploy {dying} killed, retry on {deploy}: {seen:?}"
            );
            assert_eq!(seen.body, format!("paid {key}"));
            if stored[&key] && !seen.replayed() {
                replays_run.push(key);
            }
        }
    }
    let retries = std::fs::read_to_string(&retry_log).unwrap();
    let ran_again: Vec<&str> = retries
        .lines()
        .filter_map(|line| line.strip_prefix("start "))
        .filter(|key| stored[*key])
        .collect();
    let stored_count = stored.values().filter(|stored| **stored).count();
    println!(
        "{kind}: deploy {dying} killed after {ended} of {KEYS} ended, {stored_count} stored; \
         retries on {outer} then {dying} ran {} keys",
        retries.matches("start ").count()
    );
    assert!(stored_count > 0, "nothing was stored before the kill: proves nothing");
    assert_eq!(ran_again, Vec::<&str>::new(), "{kind}: run again after their response was stored");
    assert_eq!(replays_run, Vec::<String>::new(), "{kind}: stored, but not replayed");
    // Each key ran at most once in the retries (the second retry replays the first's).
    let mut runs: HashMap<&str, usize> = HashMap::new();
    for key in retries.lines().filter_map(|line| line.strip_prefix("start ")) {
        *runs.entry(key).or_default() += 1;
    }
    assert!(runs.values().all(|runs| *runs == 1), "{kind}: a key ran twice in the retries");
    let _ = std::fs::remove_file(&dir);
    let _ = std::fs::remove_file(&retry_log);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_deploy_killed_mid_burst_runs_no_stored_request_again_on_redis() {
    for (dying, outer) in [(1, 0), (2, 3)] {
        let server = RedisServer::start();
        killed_mid_burst("redis", &server.url(), dying, outer).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_deploy_killed_mid_burst_runs_no_stored_request_again_on_postgres() {
    for (dying, outer) in [(1, 0), (2, 3)] {
        let d = TestDatabase::create("kills").await;
        killed_mid_burst("postgres", &d.uri(), dying, outer).await;
    }
}
