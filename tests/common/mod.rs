//! Shared test harness: private Redis servers, the test app, and the store harnesses that the
//! behaviour suite runs against.
#![allow(dead_code, unreachable_pub)]

use std::{
    net::TcpListener,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{
    Router,
    body::{Body, Bytes},
    http::{HeaderMap, Request, Response, StatusCode},
    routing::{get, post},
};
use axum_idempotency::{
    MemoryStore,
    store::{RecordKey, RecordState, Store},
};
use http_body_util::BodyExt;
use tower::ServiceExt;

/// Runs each named test, a generic `async fn(H: Harness)`, once per store: `memory::*`,
/// `redis::*` (a private redis-server per test), `cached::*` (`CachingStore` in front of
/// such a server), with the `postgres` feature `postgres::*` (a database per test, dropped
/// at the end) and, with the `cluster` feature, `cluster::*`
/// (one 3-master cluster shared by the test binary). Tests listed after `redis stores:` take a
/// [`RawHarness`] and run on the Redis stores only.
#[macro_export]
macro_rules! every_store {
    ($($test:ident),* $(,)?) => {
        every_store!($($test),*; redis stores:);
    };
    ($($test:ident),* $(,)?; redis stores: $($raw:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test(<super::MemoryHarness as super::Harness>::start().await).await;
                }
            )*
        }
        #[cfg(feature = "redis")]
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test(<super::RedisHarness as super::Harness>::start().await).await;
                }
            )*
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $raw() {
                    super::$raw(<super::RedisHarness as super::Harness>::start().await).await;
                }
            )*
        }
        #[cfg(feature = "redis")]
        mod cached {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test(<super::CachedHarness as super::Harness>::start().await).await;
                }
            )*
        }
        #[cfg(feature = "postgres")]
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test(<super::PostgresHarness as super::Harness>::start().await).await;
                }
            )*
        }
        #[cfg(feature = "cluster")]
        mod cluster {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test(<super::ClusterHarness as super::Harness>::start().await).await;
                }
            )*
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $raw() {
                    super::$raw(<super::ClusterHarness as super::Harness>::start().await).await;
                }
            )*
        }
    };
}

/// A loopback port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// What a store holds under a key, read from the store itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held {
    InProgress,
    Completed,
    /// The marker an abandoned claim leaves on an absent key (Redis stores): no record.
    Abandoned,
}

/// One store under test, with a way to look inside it.
pub trait Harness: Sized {
    type Store: Store;
    async fn start() -> Self;
    fn store(&self) -> Self::Store;
    /// A second store over the same records, as a second instance of the service has.
    fn second_store(&self) -> Self::Store;
    /// A store to share between runtimes one after another (as tests with a static store do):
    /// [`store`](Self::store), but over a pool that checks a connection before lending it
    /// where the store takes the app's pool (a connection made on an ended runtime is dead).
    fn store_shared_by_runtimes(&self) -> Self::Store {
        self.store()
    }
    /// Whether that store's pool may still lend a connection an ended runtime made, whose
    /// statement then fails (the store answers 503 once for it): sqlx's can, its ping
    /// notwithstanding (a quick reply to the ping is read without the dead runtime's driver;
    /// the statement's is not).
    const LENDS_CONNECTIONS_OF_ENDED_RUNTIMES: bool = false;
    async fn held(&self, key: &RecordKey) -> Option<Held>;
    async fn record_count(&self) -> usize;
}

pub struct MemoryHarness(MemoryStore);

impl Harness for MemoryHarness {
    type Store = MemoryStore;

    async fn start() -> Self {
        Self(MemoryStore::new())
    }

    fn store(&self) -> MemoryStore {
        self.0.clone()
    }

    fn second_store(&self) -> MemoryStore {
        self.0.clone()
    }

    async fn held(&self, key: &RecordKey) -> Option<Held> {
        match self.0.state(key)? {
            RecordState::InProgress => Some(Held::InProgress),
            RecordState::Completed => Some(Held::Completed),
            other => panic!("unknown state {other:?}"),
        }
    }

    async fn record_count(&self) -> usize {
        self.0.len()
    }
}

/// A store whose records can be read and written as raw Redis values: the stores backed by
/// Redis, standalone or Cluster.
pub trait RawHarness: Harness {
    /// The value under `key`, byte for byte.
    async fn raw(&self, key: &RecordKey) -> Option<Vec<u8>>;
    /// The key's time to live in milliseconds, as `PTTL` answers (-2 absent, -1 no expiry).
    async fn pttl(&self, key: &RecordKey) -> i64;
    /// Writes a value under `key` that the layer did not write, with no expiry.
    async fn plant(&self, key: &RecordKey, value: RawValue);
    /// The type and contents of whatever is under `key`, string or not.
    async fn describe(&self, key: &RecordKey) -> String;
    /// How many connections are subscribed to the settle channel of `key`, plain or sharded.
    async fn subscribers(&self, key: &RecordKey) -> usize;
}

/// The settle channel of a record (see `src/store/redis/mod.rs`).
pub fn settle_channel(key: &RecordKey) -> String {
    format!("{}:settled", key.as_str())
}

/// A value planted under a record key.
#[derive(Debug, Clone)]
pub enum RawValue {
    String(Vec<u8>),
    Hash,
}

/// Counts how many times the test app's handlers ran.
#[derive(Clone, Default)]
pub struct Calls(Arc<AtomicUsize>);

impl Calls {
    pub fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }

    /// Counts one more call and returns its number, from 1.
    pub fn next_call(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }
}

/// The routes the suite drives. Each response body names the call that made it, so a replay
/// shows whose response it is.
///
/// - `POST|PATCH|PUT|GET /payments`: 201 with `content-type`, `x-payment`, `set-cookie`; the body
///   echoes the request body.
/// - `POST /orders/{id}/capture`: answers like `/payments`.
/// - `POST /slow`: waits `x-delay-ms` milliseconds, then answers like `/payments`.
/// - `POST /first-slow`: the first call waits `x-delay-ms`, later calls answer at once.
/// - `POST /flaky`: 500 on the first call, 201 afterwards.
/// - `POST /slow-flaky`: the first call waits `x-delay-ms` and answers 503; later calls 201.
/// - `POST /status/{code}`: answers with that status.
/// - `POST /big`: a 4 KiB body.
/// - `POST|PUT /unavailable`: 503 with `set-cookie` and `x-payment`.
/// - `POST /streamed`: 4 KiB in four chunks, with no length known in advance.
/// - `POST /broken-body`: a body that fails after its first chunk.
/// - `POST /panic`: panics.
pub fn app(calls: &Calls) -> Router {
    let payment = |calls: Calls| {
        move |headers: HeaderMap, body: Bytes| async move {
            let call = calls.next_call();
            if let Some(delay) = headers.get("x-delay-ms") {
                let ms: u64 = delay.to_str().unwrap().parse().unwrap();
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            created(call, &body)
        }
    };
    let first_slow = {
        let calls = calls.clone();
        move |headers: HeaderMap, body: Bytes| async move {
            let call = calls.next_call();
            if call == 1 {
                let ms: u64 = headers["x-delay-ms"].to_str().unwrap().parse().unwrap();
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            created(call, &body)
        }
    };
    let slow_flaky = {
        let calls = calls.clone();
        move |headers: HeaderMap, body: Bytes| async move {
            let call = calls.next_call();
            if call == 1 {
                let ms: u64 = headers["x-delay-ms"].to_str().unwrap().parse().unwrap();
                tokio::time::sleep(Duration::from_millis(ms)).await;
                return Response::builder().status(503).body(Body::from("try again")).unwrap();
            }
            created(call, &body)
        }
    };
    let flaky = {
        let calls = calls.clone();
        move |body: Bytes| async move {
            let call = calls.next_call();
            if call == 1 {
                return Response::builder().status(500).body(Body::from("boom")).unwrap();
            }
            created(call, &body)
        }
    };
    let status = {
        let calls = calls.clone();
        move |axum::extract::Path(code): axum::extract::Path<u16>| async move {
            let call = calls.next_call();
            Response::builder().status(code).body(Body::from(format!("call {call}"))).unwrap()
        }
    };
    let streamed = {
        let calls = calls.clone();
        move || async move {
            calls.next_call();
            // Four 1 KiB chunks with no length known in advance.
            let chunks = (b'a'..=b'd').map(|c| Ok::<_, std::io::Error>(Bytes::from(vec![c; 1024])));
            Body::from_stream(futures_util::stream::iter(chunks))
        }
    };
    let broken = {
        let calls = calls.clone();
        move || async move {
            calls.next_call();
            let chunks = [
                Ok(Bytes::from_static(b"partial")),
                Err(std::io::Error::new(std::io::ErrorKind::BrokenPipe, "upstream went away")),
            ];
            Body::from_stream(futures_util::stream::iter(chunks))
        }
    };
    let unavailable = {
        let calls = calls.clone();
        move || async move {
            let call = calls.next_call();
            Response::builder()
                .status(StatusCode::SERVICE_UNAVAILABLE)
                .header("set-cookie", "session=secret")
                .header("x-payment", format!("pay_{call}"))
                .body(Body::from(format!("call {call}")))
                .unwrap()
        }
    };
    let big = {
        let calls = calls.clone();
        move || async move {
            calls.next_call();
            vec![b'x'; 4096]
        }
    };
    let panics = {
        let calls = calls.clone();
        move || async move {
            if calls.next_call() > 0 {
                panic!("handler panicked on purpose");
            }
            "unreachable"
        }
    };
    Router::new()
        .route(
            "/payments",
            post(payment(calls.clone()))
                .patch(payment(calls.clone()))
                .put(payment(calls.clone()))
                .get(payment(calls.clone())),
        )
        .route("/slow", post(payment(calls.clone())))
        .route("/orders/{id}/capture", post(payment(calls.clone())))
        .route("/first-slow", post(first_slow))
        .route("/flaky", post(flaky))
        .route("/slow-flaky", post(slow_flaky))
        .route("/status/{code}", post(status))
        .route("/big", post(big))
        .route("/streamed", post(streamed))
        .route("/unavailable", post(unavailable.clone()).put(unavailable))
        .route("/broken-body", post(broken))
        .route("/panic", post(panics))
        .route("/health", get(|| async { "ok" }))
}

fn created(call: usize, body: &[u8]) -> Response<Body> {
    Response::builder()
        .status(StatusCode::CREATED)
        .header("content-type", "application/json")
        .header("x-payment", format!("pay_{call}"))
        .header("set-cookie", "session=secret")
        .body(Body::from(format!(
            r#"{{"call":{call},"request":{}}}"#,
            String::from_utf8_lossy(body)
        )))
        .unwrap()
}

/// The record key of `key` in the global scope, under the default prefix.
pub fn global(key: &str) -> RecordKey {
    RecordKey::new("idempotency", b"", key.as_bytes())
}

/// A POST to `uri` with `key`, whose handler (`/slow`, `/first-slow`) waits `delay_ms`.
pub fn delayed(uri: &str, key: &str, delay_ms: u64, body: &'static str) -> Request<Body> {
    Request::post(uri)
        .header("idempotency-key", key)
        .header("x-delay-ms", delay_ms.to_string())
        .body(Body::from(body))
        .unwrap()
}

/// Sends `request` from a task of its own; the handle yields what its client saw.
pub fn send_in_background(app: &Router, request: Request<Body>) -> tokio::task::JoinHandle<Seen> {
    let app = app.clone();
    tokio::spawn(async move { send(&app, request).await })
}

/// Sends `request` (for `key`) from a task of its own and returns once the store shows its
/// claim; the handle yields what its client saw.
pub async fn send_until_claimed<H: Harness>(
    h: &H,
    app: &Router,
    request: Request<Body>,
    key: &str,
) -> tokio::task::JoinHandle<Seen> {
    let handle = send_in_background(app, request);
    eventually("the first request holds the key", async || {
        h.held(&global(key)).await == Some(Held::InProgress)
    })
    .await;
    handle
}

/// Sends 50 requests for one key at once, spread over `instances` of the app, and asserts
/// what their clients see: one original answer, every other one 202 or its replay.
pub async fn fifty_duplicates_at_once(instances: &[Router]) -> Vec<Seen> {
    let requests: Vec<_> = (0..50)
        .map(|i| {
            send_in_background(&instances[i % instances.len()], delayed("/slow", "k1", 50, "{}"))
        })
        .collect();
    let mut answers = Vec::new();
    for request in requests {
        answers.push(request.await.expect("request task"));
    }
    let originals = answers.iter().filter(|a| a.status == 201 && !a.replayed()).count();
    assert_eq!(originals, 1, "{answers:?}");
    for answer in &answers {
        match answer.status.as_u16() {
            201 => assert_eq!(answer.header("x-payment"), Some("pay_1")),
            202 => answer.assert_problem(202, "in-progress"),
            other => panic!("unexpected status {other}: {answer:?}"),
        }
    }
    answers
}

/// A request builder with the key header already set.
pub fn keyed(method: &str, uri: &str, key: &str, body: &'static str) -> Request<Body> {
    Request::builder()
        .method(method)
        .uri(uri)
        .header("idempotency-key", key)
        .body(Body::from(body))
        .unwrap()
}

/// What a client sees of one response.
#[derive(Debug, Clone)]
pub struct Seen {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: String,
}

impl Seen {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    pub fn replayed(&self) -> bool {
        self.header("idempotency-replayed") == Some("true")
    }

    /// The problem's `detail`.
    pub fn problem_detail(&self) -> String {
        let json: serde_json::Value =
            serde_json::from_str(&self.body).expect("problem body is JSON");
        json["detail"].as_str().expect("detail").to_owned()
    }

    /// Asserts a problem+json answer with `status` and the given `type` suffix.
    pub fn assert_problem(&self, status: u16, type_suffix: &str) {
        assert_eq!(self.status.as_u16(), status, "{self:?}");
        assert_eq!(self.header("content-type"), Some("application/problem+json"), "{self:?}");
        let json: serde_json::Value =
            serde_json::from_str(&self.body).expect("problem body is JSON");
        assert_eq!(json["status"], status, "{self:?}");
        let kind = json["type"].as_str().expect("type");
        assert!(kind.ends_with(type_suffix), "type {kind} does not end with {type_suffix}");
        assert!(json["title"].is_string(), "{self:?}");
    }
}

pub async fn send(app: &Router, request: Request<Body>) -> Seen {
    let response = app.clone().oneshot(request).await.expect("infallible");
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("body").to_bytes();
    Seen {
        status: parts.status,
        headers: parts.headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

/// Waits until `check` holds, for at most two seconds.
pub async fn eventually<F: AsyncFn() -> bool>(what: &str, check: F) {
    eventually_within(Duration::from_secs(2), what, check).await;
}

/// Waits until `check` holds, for at most `limit`.
pub async fn eventually_within<F: AsyncFn() -> bool>(limit: Duration, what: &str, check: F) {
    let deadline = Instant::now() + limit;
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

pub mod example;
#[cfg(all(feature = "postgres", feature = "redis"))]
pub mod ledger;
pub mod load;
#[allow(dead_code)]
pub mod outage;
pub mod postgres;
#[cfg(feature = "postgres")]
#[allow(unused_imports)]
pub use self::postgres::PostgresHarness;
#[cfg(feature = "redis")]
mod redis;
#[cfg(feature = "redis")]
#[allow(unused_imports)]
pub use self::redis::*;
#[cfg(feature = "cluster")]
pub mod cluster;
#[cfg(feature = "cluster")]
#[allow(unused_imports)]
pub use cluster::ClusterHarness;
