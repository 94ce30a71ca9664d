//! Load benchmark: bare axum, axum-idempotency over `MemoryStore` and `RedisStore`, and the
//! peer crate `idempotent` 2.0 over its `ValkeyStore`, side by side in one run, on one private
//! Redis. See BENCHMARKS.md for the command and the last figures.
//!
//! `load` runs everything. Each server runs in a process of its own (`load serve`), and so does
//! each load (`load drive`): a bounded HTTP/1.1 client over loopback.

use std::{
    collections::BTreeMap,
    net::TcpListener,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use axum::{
    Router,
    body::Body,
    http::{HeaderValue, Request, StatusCode},
    response::{IntoResponse, Response},
    routing::post,
};
use axum_idempotency::{IdempotencyLayer, MemoryStore, RedisStore, store::CachingStore};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tower_service_shim::oneshot;

const TARGETS: [&str; 6] = ["bare", "floor", "memory", "redis", "cached", "peer"];
const SCENARIOS: [&str; 3] = ["pass-through", "fresh", "replay"];
const REQUEST_BODY: &str = r#"{"amount":100,"currency":"EUR"}"#;
/// The body sizes of the sweep: request and response alike.
const SIZES: [usize; 3] = [256, 16 * 1024, 256 * 1024];
/// Most requests one load may send, whatever its duration.
const MAX_REQUESTS_PER_LOAD: usize = 5_000_000;

mod at_rest;
mod dedup;
mod matrix;
mod postgres;
mod renewals;
mod storm;

type Error = Box<dyn std::error::Error + Send + Sync>;

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let runtime = tokio::runtime::Runtime::new()?;
    match args.as_slice() {
        ["serve", target, port, redis_url] => runtime.block_on(serve(target, port.parse()?, redis_url)),
        ["drive", port, scenario, connections, millis, warmup, size] => runtime.block_on(drive(
            port.parse()?,
            scenario,
            connections.parse()?,
            Duration::from_millis(millis.parse()?),
            Duration::from_millis(warmup.parse()?),
            size.parse()?,
        )),
        ["inproc", target, scenario, requests, redis_url] => {
            // Single-threaded, in-process: for instruction counts under callgrind.
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            runtime.block_on(inproc(target, scenario, requests.parse()?, redis_url))
        }
        ["storm"] => runtime.block_on(storm::storm()),
        ["renewals", redis_url] => runtime.block_on(renewals::run(redis_url)),
        ["dedup"] => runtime.block_on(dedup::run(1_000_000, true)),
        ["dedup", events] => runtime.block_on(dedup::run(events.parse()?, false)),
        ["at-rest"] => {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            runtime.block_on(at_rest::run())
        }
        ["postgres"] => runtime.block_on(postgres::run(true)),
        ["postgres", "ratios"] => runtime.block_on(postgres::run(false)),
        ["postgres", "transactional"] => runtime.block_on(postgres::transactional()),
        [] => runtime.block_on(matrix::run()),
        _ => Err("usage: load | load storm | load at-rest | load dedup [EVENTS] | load postgres [ratios | transactional] | load renewals REDIS_URL | load serve TARGET PORT REDIS_OR_DATABASE_URL | load drive PORT SCENARIO CONNECTIONS MILLIS WARMUP_MILLIS SIZE".into()),
    }
}

/// The trivial JSON handler: a body as large as the request's (at least 256 bytes), with
/// three headers.
async fn handler(body: Bytes) -> Response {
    let size = body.len().max(256);
    let mut json = format!(
        r#"{{"id":"pay_0000000001","received":{},"status":"succeeded","note":""#,
        body.len()
    );
    json.push_str(&"x".repeat(size - json.len() - 2));
    json.push_str("\"}");
    debug_assert_eq!(json.len(), size);
    let mut response = json.into_response();
    let headers = response.headers_mut();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    headers.insert("x-request-id", HeaderValue::from_static("req_8f14e45fceea167a"));
    // Not `Cache-Control: no-store`: the peer declines to store such a response.
    headers.insert("x-ratelimit-remaining", HeaderValue::from_static("99"));
    response
}

fn bare() -> Router {
    Router::new().route("/pay", post(handler))
}

async fn app(target: &str, redis_url: &str) -> Result<Router, Error> {
    Ok(match target {
        "bare" => bare(),
        "floor" => floor(redis_url).await?,
        "floor-write" => floor_write(redis_url).await?,
        // Any `.layer()` on a router costs a boxed service and future of its own: this is that
        // cost alone, with a layer that does nothing.
        "identity" => bare().layer(tower::layer::util::Identity::new()),
        // Room for every fresh key of a run: the default capacity (100,000 live records)
        // refuses claims with 503 once a few cells have filled it.
        "memory" => bare().layer(IdempotencyLayer::new(MemoryStore::with_capacity(5_000_000))),
        "redis" => bare().layer(IdempotencyLayer::new(RedisStore::from_url(redis_url)?)),
        "cached" => {
            bare().layer(IdempotencyLayer::new(CachingStore::new(RedisStore::from_url(redis_url)?)))
        }
        "peer" => {
            let store =
                idempotent::store::valkey::ValkeyStore::with_url(redis_url).try_build().await?;
            bare().layer(idempotent::middleware::IdempotencyLayer::new(store))
        }
        "postgres" | "pg-floor" | "pg-row" | "pg-txn" | "pg-split" => {
            postgres::app(target, redis_url).await?
        }
        other => return Err(format!("unknown target {other}").into()),
    })
}

/// The floor of any idempotency layer over Redis with redis-rs: the bare handler plus the
/// round trips the scenario needs at the least (a trivial script over one shared multiplexed
/// connection): two for a fresh key (claim, complete), one for a replay, none without a key.
async fn floor(redis_url: &str) -> Result<Router, Error> {
    use axum::{extract::State, http::HeaderMap};
    static TRIVIAL: std::sync::LazyLock<redis::Script> =
        std::sync::LazyLock::new(|| redis::Script::new("return 1"));
    async fn round_trip(connection: &mut redis::aio::MultiplexedConnection) {
        let _: i64 = TRIVIAL.key("floor").invoke_async(connection).await.expect("trivial script");
    }
    async fn floor_handler(
        State(mut connection): State<redis::aio::MultiplexedConnection>,
        headers: HeaderMap,
        body: Bytes,
    ) -> Response {
        let round_trips = match headers.get("idempotency-key").map(|k| k.as_bytes()) {
            None => 0,
            Some(key) if key.starts_with(b"replay-key") => 1,
            Some(_) => 2,
        };
        for _ in 0..round_trips {
            round_trip(&mut connection).await;
        }
        handler(body).await
    }
    let connection = redis::Client::open(redis_url)?.get_multiplexed_async_connection().await?;
    Ok(Router::new().route("/pay", post(floor_handler)).with_state(connection))
}

/// The floor of any layer that keeps its records in Redis: the same round trips as
/// [`floor`], each the least a store must ask of Redis, as plain commands with no script:
/// a fresh key is written (`SET NX PX`, the claim) and written again (`SET XX PX`, the
/// response), a replay read (`GET`). Neither fence nor check: not a layer, the cost of a key.
async fn floor_write(redis_url: &str) -> Result<Router, Error> {
    use axum::{extract::State, http::HeaderMap};
    async fn floor_write_handler(
        State(mut connection): State<redis::aio::MultiplexedConnection>,
        headers: HeaderMap,
        body: Bytes,
    ) -> Response {
        if let Some(key) = headers.get("idempotency-key").map(|k| k.as_bytes().to_vec()) {
            if key.starts_with(b"replay-key") {
                let _: Option<Vec<u8>> =
                    redis::cmd("GET").arg(&key).query_async(&mut connection).await.expect("GET");
            } else {
                for (exists, ttl) in [("NX", 60_000), ("XX", 86_400_000)] {
                    let _: Option<String> = redis::cmd("SET")
                        .arg(&key)
                        .arg(&body[..])
                        .arg(exists)
                        .arg("PX")
                        .arg(ttl)
                        .query_async(&mut connection)
                        .await
                        .expect("SET");
                }
            }
        }
        handler(body).await
    }
    let connection = redis::Client::open(redis_url)?.get_multiplexed_async_connection().await?;
    Ok(Router::new().route("/pay", post(floor_write_handler)).with_state(connection))
}

async fn serve(target: &str, port: u16, redis_url: &str) -> Result<(), Error> {
    let app = app(target, redis_url).await?;
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    println!("ready");
    axum::serve(listener, app).await?;
    Ok(())
}

/// Sends `requests` requests through the target's router in this process, with no network:
/// what `valgrind --tool=callgrind` counts is the router and the layer alone.
async fn inproc(
    target: &str,
    scenario: &str,
    requests: usize,
    redis_url: &str,
) -> Result<(), Error> {
    let app = app(target, redis_url).await?;
    for n in 0..requests {
        let mut request = Request::post("/pay").header("content-type", "application/json");
        match scenario {
            "fresh" => request = request.header("idempotency-key", format!("key-{n}")),
            "replay" => request = request.header("idempotency-key", "replay-key"),
            _ => {}
        }
        let response = oneshot(app.clone(), request.body(Body::from(REQUEST_BODY))?).await?;
        assert!(response.status().is_success());
        response.into_body().collect().await?;
    }
    Ok(())
}

/// The request body of `size` bytes: the small JSON body, padded.
fn request_body(size: usize) -> Bytes {
    if size <= REQUEST_BODY.len() {
        return Bytes::from_static(REQUEST_BODY.as_bytes());
    }
    let mut body = String::from(r#"{"amount":100,"currency":"EUR","pad":""#);
    body.push_str(&"p".repeat(size - body.len() - 2));
    body.push_str("\"}");
    Bytes::from(body)
}

/// One load: `connections` HTTP/1.1 connections sending back to back for `duration` after
/// `warmup`, with request bodies of `size` bytes. Prints `requests errors p50_us p99_us
/// seconds sent`.
async fn drive(
    port: u16,
    scenario: &str,
    connections: usize,
    duration: Duration,
    warmup: Duration,
    size: usize,
) -> Result<(), Error> {
    let scenario = scenario.to_owned();
    let body = request_body(size);
    // The one completed key every request replays: one per body size, since the stores of the
    // servers (memory, the near cache) outlive a cell.
    let replay_key = format!("replay-key-{size}");
    if scenario == "replay" {
        let mut sender = connect(port).await?;
        let status = send(&mut sender, Some(replay_key.clone()), body.clone()).await?;
        assert!(status.is_success(), "priming the replay key answered {status}");
    }
    let start = Instant::now();
    let measure_from = start + warmup;
    let stop_at = measure_from + duration;
    let tasks: Vec<_> = (0..connections)
        .map(|connection| {
            let (scenario, body, replay_key) = (scenario.clone(), body.clone(), replay_key.clone());
            tokio::spawn(async move {
                let mut sender = connect(port).await?;
                let (mut latencies, mut errors, mut n) = (Vec::new(), BTreeMap::new(), 0usize);
                while Instant::now() < stop_at && n < MAX_REQUESTS_PER_LOAD / connections {
                    n += 1;
                    let key = match scenario.as_str() {
                        "fresh" => Some(format!("{}-{connection}-{n}", std::process::id())),
                        "replay" => Some(replay_key.clone()),
                        _ => None,
                    };
                    let sent = Instant::now();
                    let status = send(&mut sender, key, body.clone()).await?;
                    if sent >= measure_from {
                        latencies.push(sent.elapsed().as_micros() as u32);
                        if !status.is_success() {
                            *errors.entry(status.as_u16()).or_insert(0usize) += 1;
                        }
                    }
                }
                Ok::<_, Error>((latencies, errors, n))
            })
        })
        .collect();
    let (mut latencies, mut errors, mut sent) = (Vec::new(), BTreeMap::new(), 0);
    for task in tasks {
        let (mut some, statuses, n) = task.await??;
        latencies.append(&mut some);
        sent += n;
        for (status, count) in statuses {
            *errors.entry(status).or_insert(0) += count;
        }
    }
    if !errors.is_empty() {
        eprintln!("non-2xx answers by status: {errors:?}");
    }
    let errors: usize = errors.values().sum();
    // The priming request of the replay scenario was sent too.
    let sent = sent + usize::from(scenario == "replay");
    let seconds = duration.as_secs_f64();
    latencies.sort_unstable();
    let at = |q: f64| {
        latencies
            .get(((latencies.len() as f64 * q) as usize).min(latencies.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    println!("{} {errors} {} {} {seconds} {sent}", latencies.len(), at(0.50), at(0.99));
    Ok(())
}

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

async fn connect(port: u16) -> Result<Sender, Error> {
    let stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    stream.set_nodelay(true)?;
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    Ok(sender)
}

async fn send(sender: &mut Sender, key: Option<String>, body: Bytes) -> Result<StatusCode, Error> {
    sender.ready().await?;
    let mut request = Request::post("/pay")
        .header("host", "127.0.0.1")
        .header("content-type", "application/json");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let response = sender.send_request(request.body(Full::new(body))?).await?;
    let status = response.status();
    response.into_body().collect().await?;
    Ok(status)
}

/// Sends one request through a router in this process.
mod tower_service_shim {
    use axum::{Router, body::Body, http::Request, response::Response};
    use std::convert::Infallible;

    pub(crate) async fn oneshot(
        router: Router,
        request: Request<Body>,
    ) -> Result<Response, Infallible> {
        use tower::ServiceExt;
        router.oneshot(request).await
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// A child process killed when dropped.
struct ChildGuard {
    child: Child,
    port: u16,
}

impl ChildGuard {
    /// A private redis-server; on core 0 when `pin` (with the servers under test).
    fn redis_server(pin: bool) -> Result<Self, Error> {
        let port = free_port();
        let mut command = Command::new(if pin { "taskset" } else { "redis-server" });
        if pin {
            command.args(["-c", "0", "redis-server"]);
        }
        let child = command
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| format!("the benchmark needs redis-server on PATH: {e}"))?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline {
                return Err("redis-server did not start".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(Self { child, port })
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[allow(dead_code)]
fn _unused(_: Response<Body>) {}
