//! Load benchmark: bare axum, axum-idempotency over `MemoryStore` and `RedisStore`, and the
//! peer crate `idempotent` 2.0 over its `ValkeyStore`, side by side in one run, on one private
//! Redis. See BENCHMARKS.md for the command and the last figures.
//!
//! `load` runs everything. Each server runs in a process of its own (`load serve`), and so does
//! each load (`load drive`): a bounded HTTP/1.1 client over loopback.

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader},
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
use axum_idempotency::{IdempotencyLayer, MemoryStore, RecordKey, RedisStore, Store};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tower_service_shim::oneshot;

const TARGETS: [&str; 5] = ["bare", "floor", "memory", "redis", "peer"];
const SCENARIOS: [&str; 3] = ["pass-through", "fresh", "replay"];
const REQUEST_BODY: &str = r#"{"amount":100,"currency":"EUR"}"#;
/// Most requests one load may send, whatever its duration.
const MAX_REQUESTS_PER_LOAD: usize = 5_000_000;

mod storm;

type Error = Box<dyn std::error::Error + Send + Sync>;

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let runtime = tokio::runtime::Runtime::new()?;
    match args.as_slice() {
        ["serve", target, port, redis_url] => runtime.block_on(serve(target, port.parse()?, redis_url)),
        ["drive", port, scenario, connections, millis, warmup] => runtime.block_on(drive(
            port.parse()?,
            scenario,
            connections.parse()?,
            Duration::from_millis(millis.parse()?),
            Duration::from_millis(warmup.parse()?),
        )),
        ["inproc", target, scenario, requests, redis_url] => {
            // Single-threaded, in-process: for instruction counts under callgrind.
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            runtime.block_on(inproc(target, scenario, requests.parse()?, redis_url))
        }
        ["storm"] => runtime.block_on(storm::storm()),
        [] => runtime.block_on(run()),
        _ => Err("usage: load | load storm | load serve TARGET PORT REDIS_URL | load drive PORT SCENARIO CONNECTIONS MILLIS WARMUP_MILLIS".into()),
    }
}

/// The trivial JSON handler: a 256-byte body, with three headers.
async fn handler(body: Bytes) -> Response {
    let mut json = format!(
        r#"{{"id":"pay_0000000001","received":{},"status":"succeeded","note":""#,
        body.len()
    );
    json.push_str(&"x".repeat(256 - json.len() - 2));
    json.push_str("\"}");
    debug_assert_eq!(json.len(), 256);
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
        // Any `.layer()` on a router costs a boxed service and future of its own: this is that
        // cost alone, with a layer that does nothing.
        "identity" => bare().layer(tower::layer::util::Identity::new()),
        "memory" => bare().layer(IdempotencyLayer::new(MemoryStore::new())),
        "redis" => bare().layer(IdempotencyLayer::new(RedisStore::from_url(redis_url)?)),
        "peer" => {
            let store =
                idempotent::store::valkey::ValkeyStore::with_url(redis_url).try_build().await?;
            bare().layer(idempotent::middleware::IdempotencyLayer::new(store))
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
            Some(b"replay-key") => 1,
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

/// One load: `connections` HTTP/1.1 connections sending back to back for `duration` after
/// `warmup`. Prints `requests errors p50_us p99_us seconds`.
async fn drive(
    port: u16,
    scenario: &str,
    connections: usize,
    duration: Duration,
    warmup: Duration,
) -> Result<(), Error> {
    let scenario = scenario.to_owned();
    if scenario == "replay" {
        // The one completed key every request replays.
        let mut sender = connect(port).await?;
        let status = send(&mut sender, Some("replay-key".to_owned())).await?;
        assert!(status.is_success(), "priming the replay key answered {status}");
    }
    let start = Instant::now();
    let measure_from = start + warmup;
    let stop_at = measure_from + duration;
    let tasks: Vec<_> = (0..connections)
        .map(|connection| {
            let scenario = scenario.clone();
            tokio::spawn(async move {
                let mut sender = connect(port).await?;
                let (mut latencies, mut errors, mut n) = (Vec::new(), BTreeMap::new(), 0usize);
                while Instant::now() < stop_at && n < MAX_REQUESTS_PER_LOAD / connections {
                    n += 1;
                    let key = match scenario.as_str() {
                        "fresh" => Some(format!("{}-{connection}-{n}", std::process::id())),
                        "replay" => Some("replay-key".to_owned()),
                        _ => None,
                    };
                    let sent = Instant::now();
                    let status = send(&mut sender, key).await?;
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

async fn send(sender: &mut Sender, key: Option<String>) -> Result<StatusCode, Error> {
    sender.ready().await?;
    let mut request = Request::post("/pay")
        .header("host", "127.0.0.1")
        .header("content-type", "application/json");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let response = sender
        .send_request(request.body(Full::new(Bytes::from_static(REQUEST_BODY.as_bytes())))?)
        .await?;
    let status = response.status();
    response.into_body().collect().await?;
    Ok(status)
}

struct Cell {
    /// (max − min) / median of 2xx/s over the rounds, filled in for the median cell.
    spread: f64,
    rps: f64,
    /// 2xx answers per second: what a client can use.
    ok_rps: f64,
    p50_us: u64,
    p99_us: u64,
    errors: u64,
    evalsha_per_request: f64,
    checkout_per_request: f64,
}

/// Runs every target, scenario and concurrency, then the memory measurement, and prints the
/// tables.
async fn run() -> Result<(), Error> {
    let seconds: u64 =
        std::env::var("BENCH_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(2);
    let rounds: usize =
        std::env::var("BENCH_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(3);
    let concurrencies: Vec<usize> = std::env::var("BENCH_CONNECTIONS")
        .unwrap_or_else(|_| "16,64".to_owned())
        .split(',')
        .map(|c| c.trim().parse())
        .collect::<Result<_, _>>()?;
    let redis = ChildGuard::redis_server()?;
    let redis_url = format!("redis://127.0.0.1:{}", redis.port);
    let mut control =
        redis::Client::open(redis_url.as_str())?.get_multiplexed_async_connection().await?;
    let exe = std::env::current_exe()?;
    let mut servers = BTreeMap::new();
    for target in TARGETS {
        let port = free_port();
        let mut child = Command::new(&exe)
            .args(["serve", target, &port.to_string(), &redis_url])
            .stdout(Stdio::piped())
            .spawn()?;
        let mut ready = String::new();
        BufReader::new(child.stdout.take().expect("piped")).read_line(&mut ready)?;
        if ready.trim() != "ready" {
            return Err(format!("server {target} did not start").into());
        }
        servers.insert(target, (port, ChildGuard { child, port }));
    }
    println!(
        "load: {rounds} rounds of {seconds} s per cell after 0.5 s warm-up, the median shown; {} cores; one private redis-server; client and servers are separate processes\n",
        std::thread::available_parallelism().map_or(0, usize::from)
    );

    let mut runs: BTreeMap<(usize, &str, &str), Vec<Cell>> = BTreeMap::new();
    for round in 1..=rounds {
        eprintln!("round {round} of {rounds}");
        for &connections in &concurrencies {
            for scenario in SCENARIOS {
                for target in TARGETS {
                    let port = servers[target].0;
                    let () = redis::cmd("FLUSHALL").query_async(&mut control).await?;
                    let () =
                        redis::cmd("CONFIG").arg("RESETSTAT").query_async(&mut control).await?;
                    let output = Command::new(&exe)
                        .args([
                            "drive",
                            &port.to_string(),
                            scenario,
                            &connections.to_string(),
                            &(seconds * 1000).to_string(),
                            "500",
                        ])
                        .output()?;
                    let stderr = String::from_utf8_lossy(&output.stderr);
                    if !stderr.is_empty() {
                        eprintln!("  {target} {scenario}: {}", stderr.trim());
                    }
                    if !output.status.success() {
                        return Err(format!(
                            "drive {target} {scenario}: {}",
                            String::from_utf8_lossy(&output.stderr)
                        )
                        .into());
                    }
                    let line = String::from_utf8(output.stdout)?;
                    let fields: Vec<f64> =
                        line.split_whitespace().map(str::parse).collect::<Result<_, _>>()?;
                    let [requests, errors, p50, p99, secs, sent] = fields[..] else {
                        return Err(format!("unexpected drive output {line:?}").into());
                    };
                    let stats = commandstats(&mut control).await?;
                    // Every request sent in the cell, warm-up included, over the commands Redis saw.
                    let per = |names: &[&str]| {
                        names.iter().map(|n| stats.get(*n).copied().unwrap_or(0)).sum::<u64>()
                            as f64
                            / sent
                    };
                    runs.entry((connections, scenario, target)).or_default().push(Cell {
                        spread: 0.0,
                        rps: requests / secs,
                        ok_rps: (requests - errors) / secs,
                        p50_us: p50 as u64,
                        p99_us: p99 as u64,
                        errors: errors as u64,
                        evalsha_per_request: per(&["evalsha", "eval"]),
                        checkout_per_request: per(&["ping", "unwatch"]),
                    });
                    eprintln!(
                        "  {connections:>2} conns {scenario:<12} {target:<6} {:>8.0} req/s",
                        requests / secs
                    );
                }
            }
        }
    }
    // The median round of each cell, by 2xx answers per second.
    let cells: BTreeMap<_, Cell> = runs
        .into_iter()
        .map(|(key, mut cells)| {
            cells.sort_by(|a, b| a.ok_rps.total_cmp(&b.ok_rps));
            let (min, max) = (cells[0].ok_rps, cells[cells.len() - 1].ok_rps);
            let mut median = cells.swap_remove(cells.len() / 2);
            median.spread = (max - min) / median.ok_rps;
            (key, median)
        })
        .collect();
    print_tables(&concurrencies, &cells);
    memory_per_record(&redis_url, &mut control).await?;
    drop(servers);
    drop(redis);
    Ok(())
}

fn print_tables(concurrencies: &[usize], cells: &BTreeMap<(usize, &str, &str), Cell>) {
    println!(
        "| conns | scenario | target | req/s | 2xx/s | spread | p50 µs | p99 µs | non-2xx | EVALSHA/req | PING+UNWATCH/req |"
    );
    println!("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for &connections in concurrencies {
        for scenario in SCENARIOS {
            for target in TARGETS {
                let c = &cells[&(connections, scenario, target)];
                println!(
                    "| {connections} | {scenario} | {target} | {:.0} | {:.0} | {:.0}% | {} | {} | {} | {:.2} | {:.2} |",
                    c.rps,
                    c.ok_rps,
                    100.0 * c.spread,
                    c.p50_us,
                    c.p99_us,
                    c.errors,
                    c.evalsha_per_request,
                    c.checkout_per_request
                );
            }
        }
    }
    println!("\nRatios of 2xx answers per second, measured side by side in this run:\n");
    println!("| conns | scenario | redis/bare | redis/floor | memory/bare | redis/peer | target |");
    println!("|---:|---|---:|---:|---:|---:|---|");
    for &connections in concurrencies {
        for scenario in SCENARIOS {
            let rps = |target| cells[&(connections, scenario, target)].ok_rps;
            let target = match scenario {
                "pass-through" => "redis/bare ≥ 0.95",
                "fresh" => "redis/peer ≥ 1.5",
                _ => "redis/peer ≥ 1.3",
            };
            println!(
                "| {connections} | {scenario} | {:.2} | {:.2} | {:.2} | {:.2} | {target} |",
                rps("redis") / rps("bare"),
                rps("redis") / rps("floor"),
                rps("memory") / rps("bare"),
                rps("redis") / rps("peer"),
            );
        }
    }
}

async fn commandstats(
    control: &mut redis::aio::MultiplexedConnection,
) -> Result<BTreeMap<String, u64>, Error> {
    let info: String = redis::cmd("INFO").arg("commandstats").query_async(control).await?;
    Ok(info
        .lines()
        .filter_map(|line| line.strip_prefix("cmdstat_"))
        .filter_map(|line| {
            let (command, stats) = line.split_once(':')?;
            let calls = stats.split(',').find_map(|stat| stat.strip_prefix("calls="))?;
            Some((command.to_owned(), calls.parse().ok()?))
        })
        .collect())
}

/// `used_memory` per record over 10,000 records: completed (256-byte body, three headers)
/// and in progress, for ours and the peer.
async fn memory_per_record(
    redis_url: &str,
    control: &mut redis::aio::MultiplexedConnection,
) -> Result<(), Error> {
    const RECORDS: usize = 10_000;
    async fn used_memory(control: &mut redis::aio::MultiplexedConnection) -> Result<i64, Error> {
        let info: String = redis::cmd("INFO").arg("memory").query_async(control).await?;
        let used =
            info.lines().find_map(|l| l.strip_prefix("used_memory:")).ok_or("no used_memory")?;
        Ok(used.trim().parse()?)
    }
    println!("\n| records ({RECORDS}) | bytes per record |");
    println!("|---|---:|");
    for target in ["redis", "peer"] {
        let app = app(target, redis_url).await?;
        let () = redis::cmd("FLUSHALL").query_async(control).await?;
        let before = used_memory(control).await?;
        for i in 0..RECORDS {
            let request = Request::post("/pay")
                .header("content-type", "application/json")
                .header("idempotency-key", format!("memory-{i:08}"))
                .body(Body::from(REQUEST_BODY))?;
            let response = oneshot(app.clone(), request).await?;
            assert!(response.status().is_success());
        }
        let after = used_memory(control).await?;
        let name = if target == "redis" { "ours" } else { "peer" };
        println!("| {name}, completed | {} |", (after - before) / RECORDS as i64);
    }
    let store = RedisStore::from_url(redis_url)?;
    let () = redis::cmd("FLUSHALL").query_async(control).await?;
    let before = used_memory(control).await?;
    let fingerprint =
        axum_idempotency::Fingerprint::new("POST", "/pay", "", REQUEST_BODY.as_bytes());
    for i in 0..RECORDS {
        let key = RecordKey::new("idempotency", b"", format!("claim-{i:08}").as_bytes());
        store
            .claim(
                &key,
                &fingerprint,
                &axum_idempotency::OwnerToken::random(),
                Duration::from_secs(60),
            )
            .await?;
    }
    let after = used_memory(control).await?;
    println!("| ours, in progress | {} |", (after - before) / RECORDS as i64);
    Ok(())
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
    fn redis_server() -> Result<Self, Error> {
        let port = free_port();
        let child = Command::new("redis-server")
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
