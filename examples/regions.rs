//! Three regions on one machine, and what each way of keeping idempotency records across them
//! costs: duplicates, latency, and what a partition fails.
//!
//! ```sh
//! cargo run --release --example regions                       # 40 ms one way between regions
//! cargo run --release --example regions -- --latency-ms 80 --clients 8 --keys 40
//! ```
//!
//! Each region is an app (`IdempotencyLayer` over an axum `Router`, in this process) and a
//! private `redis-server` on a free loopback port. A region reaches another region's Redis
//! through a link: a TCP proxy that delays every byte by the one-way latency, either way,
//! and that a partition cuts (connections closed, new ones refused). Every region has
//! retrying clients: a client sends each request to its own region; when an attempt times out
//! (a slow payment) or answers 5xx, its retry goes to the next region, as a global load
//! balancer sends it. One request in five is slow (400 ms), past the client's first timeout
//! (250 ms). The handler counts its runs per key: a run beyond one per key is a duplicate.
//!
//! Three runs: a store per region (each region's layer over its own Redis), home-region
//! routing (`RegionalStore` over the three Redis servers), and home-region routing with one
//! region (`ap`) cut off from the others. One table at the end. Every server and proxy is
//! stopped at the end (servers by pid, also on Ctrl-C).

use std::{
    collections::HashMap,
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use axum::{
    Router,
    body::Body,
    extract::State,
    http::{HeaderMap, Request, StatusCode},
    routing::post,
};
use axum_idempotency::{IdempotencyLayer, RedisStore, store::RegionalStore};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::{mpsc, watch},
};
use tower::ServiceExt;

const REGIONS: [&str; 3] = ["eu", "us", "ap"];
/// The region the third run cuts off.
const PARTITIONED: usize = 2;
/// How long each attempt of a client waits before its retry goes to the next region.
const ATTEMPT_TIMEOUTS: [Duration; 3] =
    [Duration::from_millis(250), Duration::from_secs(1), Duration::from_secs(5)];
const FAST: Duration = Duration::from_millis(10);
const SLOW: Duration = Duration::from_millis(400);

/// The pids of the servers this run started, for a Ctrl-C to stop them too.
static PIDS: Mutex<Vec<u32>> = Mutex::new(Vec::new());

struct Options {
    latency: Duration,
    clients: usize,
    keys: usize,
}

fn options() -> Options {
    let mut options = Options { latency: Duration::from_millis(40), clients: 8, keys: 40 };
    let args: Vec<String> = std::env::args().skip(1).collect();
    for pair in args.chunks(2) {
        let value = || pair.get(1).and_then(|v| v.parse::<u64>().ok()).expect("a number");
        match pair[0].as_str() {
            "--latency-ms" => options.latency = Duration::from_millis(value()),
            "--clients" => options.clients = usize::try_from(value()).unwrap(),
            "--keys" => options.keys = usize::try_from(value()).unwrap(),
            other => panic!("unknown option {other}: --latency-ms N, --clients N, --keys N"),
        }
    }
    options
}

/// A private redis-server on a free loopback port, killed by pid when dropped.
struct Redis {
    child: Child,
    port: u16,
}

impl Redis {
    fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
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
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server on PATH (apt-get install redis-server)");
        PIDS.lock().unwrap().push(child.id());
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server on {port} did not come up");
            std::thread::sleep(Duration::from_millis(20));
        }
        Self { child, port }
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        PIDS.lock().unwrap().retain(|pid| *pid != self.child.id());
    }
}

/// A link from one region to another region's Redis: every chunk waits the one-way latency,
/// either way, without holding up the chunks behind it; `cut` closes its connections and
/// refuses new ones until it heals.
#[derive(Clone)]
struct Link {
    port: u16,
    cut: watch::Sender<bool>,
}

impl Link {
    async fn start(upstream: u16, latency: Duration) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (cut, _) = watch::channel(false);
        let link = Self { port, cut };
        let accepting = link.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if *accepting.cut.borrow() {
                    continue; // dropped: refused
                }
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                    continue;
                };
                let _ = (client.set_nodelay(true), server.set_nodelay(true));
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                let mut cut = accepting.cut.subscribe();
                tokio::spawn(async move {
                    tokio::select! {
                        () = delayed(client_read, server_write, latency) => {}
                        () = delayed(server_read, client_write, latency) => {}
                        _ = cut.wait_for(|cut| *cut) => {}
                    }
                });
            }
        });
        link
    }

    fn set_cut(&self, cut: bool) {
        self.cut.send_replace(cut);
    }
}

/// Forwards `from` to `to`, each chunk `latency` after it was read.
async fn delayed(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    latency: Duration,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let reader = async move {
        let mut buffer = vec![0u8; 16 * 1024];
        while let Ok(n @ 1..) = from.read(&mut buffer).await {
            if tx.send((Instant::now() + latency, buffer[..n].to_vec())).is_err() {
                break;
            }
        }
    };
    let writer = async move {
        while let Some((at, chunk)) = rx.recv().await {
            tokio::time::sleep_until(at.into()).await;
            if to.write_all(&chunk).await.is_err() {
                break;
            }
        }
    };
    tokio::join!(reader, writer);
}

/// The handler's side effect: runs per idempotency key.
#[derive(Clone, Default)]
struct Runs(Arc<Mutex<HashMap<String, usize>>>);

async fn pay(State(runs): State<Runs>, headers: HeaderMap) -> (StatusCode, &'static str) {
    let key = headers["idempotency-key"].to_str().unwrap().to_owned();
    *runs.0.lock().unwrap().entry(key).or_default() += 1;
    let ms: u64 = headers["x-work-ms"].to_str().unwrap().parse().unwrap();
    tokio::time::sleep(Duration::from_millis(ms)).await;
    (StatusCode::CREATED, "paid")
}

fn region_app(runs: &Runs, layer: IdempotencyLayer<impl axum_idempotency::store::Store>) -> Router {
    Router::new().route("/payments", post(pay)).with_state(runs.clone()).layer(layer)
}

/// What one run saw.
#[derive(Default)]
struct Tally {
    keys: usize,
    /// The latency of each first attempt of a fast request that was answered.
    fast: Vec<Duration>,
    /// Every attempt's answer: a status, or `timeout`.
    attempts: HashMap<String, usize>,
    /// Each key's last answer.
    finals: HashMap<String, usize>,
}

/// Clients in every region, each sending `keys` requests one after another, retrying in the
/// next region.
async fn drive(apps: &[Router], options: &Options, run: &str) -> Tally {
    let tally = Arc::new(Mutex::new(Tally::default()));
    let mut clients = Vec::new();
    for (region, client) in (0..apps.len()).flat_map(|r| (0..options.clients).map(move |c| (r, c)))
    {
        let (apps, tally, keys, run) = (apps.to_vec(), tally.clone(), options.keys, run.to_owned());
        clients.push(tokio::spawn(async move {
            for n in 0..keys {
                let key = format!("{run}-{region}-{client}-{n}");
                // One request in five is slow: its first attempt times out.
                let slow = (region * 7 + client * 13 + n) % 5 == 0;
                let work = if slow { SLOW } else { FAST };
                let mut last = String::new();
                for (attempt, timeout) in ATTEMPT_TIMEOUTS.iter().enumerate() {
                    let app = apps[(region + attempt) % apps.len()].clone();
                    let request = Request::post("/payments")
                        .header("idempotency-key", &key)
                        .header("x-work-ms", work.as_millis().to_string())
                        .body(Body::from("{\"amount\":100}"))
                        .unwrap();
                    let started = Instant::now();
                    let answer = tokio::time::timeout(*timeout, app.oneshot(request)).await;
                    let took = started.elapsed();
                    last = match &answer {
                        Ok(Ok(response)) => response.status().as_u16().to_string(),
                        _ => "timeout".to_owned(),
                    };
                    let mut tally = tally.lock().unwrap();
                    *tally.attempts.entry(last.clone()).or_default() += 1;
                    if attempt == 0 && !slow && last.starts_with('2') {
                        tally.fast.push(took);
                    }
                    if last.starts_with('2') {
                        break;
                    }
                }
                let mut tally = tally.lock().unwrap();
                tally.keys += 1;
                *tally.finals.entry(last).or_default() += 1;
            }
        }));
    }
    for client in clients {
        client.await.unwrap();
    }
    // A slow original a client gave up on finishes in its own task: let the last settle.
    tokio::time::sleep(SLOW + Duration::from_millis(500)).await;
    Arc::try_unwrap(tally).ok().unwrap().into_inner().unwrap()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
    let at = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[at]
}

fn counts(map: &HashMap<String, usize>) -> String {
    let mut pairs: Vec<_> = map.iter().collect();
    pairs.sort();
    pairs.iter().map(|(k, v)| format!("{k}: {v}")).collect::<Vec<_>>().join(", ")
}

struct Row {
    run: &'static str,
    tally: Tally,
    runs: usize,
    duplicates: usize,
}

fn row(run: &'static str, tally: Tally, runs: &Runs) -> Row {
    let runs = runs.0.lock().unwrap();
    let duplicates = runs.values().map(|n| n - 1).sum();
    Row { run, tally, runs: runs.values().sum(), duplicates }
}

#[tokio::main]
async fn main() {
    let options = options();
    tokio::spawn(async {
        if tokio::signal::ctrl_c().await.is_ok() {
            for pid in PIDS.lock().unwrap().iter() {
                let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
            }
            std::process::exit(130);
        }
    });
    let servers: Vec<Redis> = REGIONS.iter().map(|_| Redis::start()).collect();
    // links[from][to]: region `from`'s way to region `to`'s Redis (none to its own).
    let mut links: Vec<Vec<Option<Link>>> = Vec::new();
    for from in 0..REGIONS.len() {
        let mut row = Vec::new();
        for (to, server) in servers.iter().enumerate() {
            row.push(if from == to {
                None
            } else {
                Some(Link::start(server.port, options.latency).await)
            });
        }
        links.push(row);
    }
    let url = |from: usize, to: usize| {
        let port = links[from][to].as_ref().map_or(servers[to].port, |link| link.port);
        format!("redis://127.0.0.1:{port}")
    };
    let routing = |from: usize| {
        RegionalStore::new(
            REGIONS
                .iter()
                .enumerate()
                .map(|(to, name)| (*name, RedisStore::from_url(&url(from, to)).unwrap())),
        )
    };
    println!(
        "3 regions, {} ms one way between them, {} clients a region, {} keys a client, 1 in 5 slow ({} ms; first attempt times out at {} ms)",
        options.latency.as_millis(),
        options.clients,
        options.keys,
        SLOW.as_millis(),
        ATTEMPT_TIMEOUTS[0].as_millis(),
    );

    let mut rows = Vec::new();
    let runs = Runs::default();
    let apps: Vec<Router> = (0..REGIONS.len())
        .map(|r| {
            region_app(&runs, IdempotencyLayer::new(RedisStore::from_url(&url(r, r)).unwrap()))
        })
        .collect();
    rows.push(row("a store per region", drive(&apps, &options, "own").await, &runs));

    let runs = Runs::default();
    let apps: Vec<Router> =
        (0..REGIONS.len()).map(|r| region_app(&runs, IdempotencyLayer::new(routing(r)))).collect();
    rows.push(row("home-region routing", drive(&apps, &options, "home").await, &runs));

    let runs = Runs::default();
    let apps: Vec<Router> =
        (0..REGIONS.len()).map(|r| region_app(&runs, IdempotencyLayer::new(routing(r)))).collect();
    for (from, row) in links.iter().enumerate() {
        for (to, link) in row.iter().enumerate() {
            if let Some(link) = link {
                link.set_cut(from == PARTITIONED || to == PARTITIONED);
            }
        }
    }
    let partitioned: &'static str =
        format!("home routing, {} cut off", REGIONS[PARTITIONED]).leak();
    rows.push(row(partitioned, drive(&apps, &options, "cut").await, &runs));

    println!();
    println!(
        "| run | keys | handler runs | duplicates | fast first attempt p50 / p99 | attempts answered | keys' last answer |"
    );
    println!("|---|---|---|---|---|---|---|");
    for Row { run, mut tally, runs, duplicates } in rows {
        tally.fast.sort();
        println!(
            "| {run} | {} | {runs} | {duplicates} | {:.1} / {:.1} ms | {} | {} |",
            tally.keys,
            percentile(&tally.fast, 0.5).as_secs_f64() * 1e3,
            percentile(&tally.fast, 0.99).as_secs_f64() * 1e3,
            counts(&tally.attempts),
            counts(&tally.finals),
        );
    }
    drop(servers);
}
