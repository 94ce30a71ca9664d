//! `load`: every target, scenario, concurrency and body size, side by side in one run; the
//! throughput, latency, Redis commands and CPU time per request of each cell; the ratios; and
//! Redis memory per record.
//!
//! Servers and Redis share core 0 (`taskset`), the load runs on core 1: so the CPU each
//! request costs, server and Redis, is read from `/proc/<pid>/stat` and `INFO cpu` deltas over
//! a cell, a figure that holds when throughput itself is noisy.

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    time::Duration,
};

use axum::{body::Body, http::Request};
use axum_idempotency::{
    Fingerprint, RedisStore,
    store::{OwnerToken, RecordKey, Store},
};

use crate::{
    ChildGuard, Error, REQUEST_BODY, SCENARIOS, SIZES, TARGETS, app, free_port, request_body,
    tower_service_shim::oneshot,
};

/// One cell: a body size, a concurrency, a scenario, a target.
type CellKey = (usize, usize, &'static str, &'static str);

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
    /// CPU time of the server process per request sent, in µs.
    server_us: f64,
    /// CPU time of redis-server per request sent, in µs.
    redis_us: f64,
}

/// Whether `taskset` pins processes to cores here; `BENCH_PIN=0` turns pinning off.
fn pinning() -> bool {
    std::env::var("BENCH_PIN").as_deref() != Ok("0")
        && Command::new("taskset").arg("-V").output().is_ok_and(|o| o.status.success())
}

/// `program args` as a command, on `core` when pinning.
fn on_core(pin: bool, core: usize, program: &std::path::Path) -> Command {
    if pin {
        let mut command = Command::new("taskset");
        command.args(["-c", &core.to_string()]).arg(program);
        command
    } else {
        Command::new(program)
    }
}

/// User + system CPU time of process `pid`, from `/proc/<pid>/stat`, in seconds.
fn process_cpu(pid: u32) -> Result<f64, Error> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let fields: Vec<&str> = stat.rsplit_once(')').ok_or("bad stat")?.1.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>()? + fields[12].parse::<f64>()?;
    // USER_HZ is 100 on Linux.
    Ok(ticks / 100.0)
}

/// `used_cpu_user + used_cpu_sys` of redis-server, in seconds.
async fn redis_cpu(control: &mut redis::aio::MultiplexedConnection) -> Result<f64, Error> {
    let info: String = redis::cmd("INFO").arg("cpu").query_async(control).await?;
    let field = |name: &str| -> Result<f64, Error> {
        let line = info.lines().find_map(|l| l.strip_prefix(name)).ok_or("no cpu field")?;
        Ok(line.trim().parse()?)
    };
    Ok(field("used_cpu_user:")? + field("used_cpu_sys:")?)
}

pub(crate) async fn commandstats(
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

/// The cells of one run: the whole matrix at 256-byte bodies, and the sweep of larger bodies
/// for fresh keys and replays at the first concurrency.
fn cells(concurrencies: &[usize]) -> Vec<CellKey> {
    let mut cells = Vec::new();
    for &connections in concurrencies {
        for scenario in SCENARIOS {
            for target in TARGETS {
                cells.push((SIZES[0], connections, scenario, target));
            }
        }
    }
    for size in &SIZES[1..] {
        for scenario in ["fresh", "replay"] {
            for target in TARGETS {
                cells.push((*size, concurrencies[0], scenario, target));
            }
        }
    }
    cells
}

/// Runs every cell, then the memory measurement, and prints the tables.
pub(crate) async fn run() -> Result<(), Error> {
    let seconds: u64 =
        std::env::var("BENCH_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(2);
    let rounds: usize =
        std::env::var("BENCH_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(3);
    let concurrencies: Vec<usize> = std::env::var("BENCH_CONNECTIONS")
        .unwrap_or_else(|_| "16,64".to_owned())
        .split(',')
        .map(|c| c.trim().parse())
        .collect::<Result<_, _>>()?;
    let pin = pinning();
    let redis = ChildGuard::redis_server(pin)?;
    let redis_url = format!("redis://127.0.0.1:{}", redis.port);
    let mut control =
        redis::Client::open(redis_url.as_str())?.get_multiplexed_async_connection().await?;
    let exe = std::env::current_exe()?;
    let mut servers = BTreeMap::new();
    for target in TARGETS {
        let port = free_port();
        let mut child = on_core(pin, 0, &exe)
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
        "load: {rounds} rounds of {seconds} s per cell after 0.5 s warm-up, the median shown; {} cores; {}; one private redis-server; client and servers are separate processes\n",
        std::thread::available_parallelism().map_or(0, usize::from),
        if pin {
            "servers and Redis pinned to core 0, the load to core 1"
        } else {
            "not pinned (no taskset, or BENCH_PIN=0)"
        },
    );

    let cells_to_run = cells(&concurrencies);
    let mut runs: BTreeMap<CellKey, Vec<Cell>> = BTreeMap::new();
    for round in 1..=rounds {
        eprintln!("round {round} of {rounds}");
        for &(size, connections, scenario, target) in &cells_to_run {
            let (port, server) = &servers[target];
            let () = redis::cmd("FLUSHALL").query_async(&mut control).await?;
            let () = redis::cmd("CONFIG").arg("RESETSTAT").query_async(&mut control).await?;
            let server_before = process_cpu(server.child.id())?;
            let redis_before = redis_cpu(&mut control).await?;
            let output = on_core(pin, 1, &exe)
                .args([
                    "drive",
                    &port.to_string(),
                    scenario,
                    &connections.to_string(),
                    &(seconds * 1000).to_string(),
                    "500",
                    &size.to_string(),
                ])
                .output()?;
            let server_cpu = process_cpu(server.child.id())? - server_before;
            let redis_cpu = redis_cpu(&mut control).await? - redis_before;
            let stderr = String::from_utf8_lossy(&output.stderr);
            if !stderr.is_empty() {
                eprintln!("  {target} {scenario} {size}: {}", stderr.trim());
            }
            if !output.status.success() {
                return Err(format!("drive {target} {scenario}: {stderr}").into());
            }
            let line = String::from_utf8(output.stdout)?;
            let fields: Vec<f64> =
                line.split_whitespace().map(str::parse).collect::<Result<_, _>>()?;
            let [requests, errors, p50, p99, secs, sent] = fields[..] else {
                return Err(format!("unexpected drive output {line:?}").into());
            };
            let stats = commandstats(&mut control).await?;
            // Every request sent in the cell, warm-up included, over what Redis saw and what
            // the CPU clocks counted over the same span.
            let per = |names: &[&str]| {
                names.iter().map(|n| stats.get(*n).copied().unwrap_or(0)).sum::<u64>() as f64 / sent
            };
            runs.entry((size, connections, scenario, target)).or_default().push(Cell {
                spread: 0.0,
                rps: requests / secs,
                ok_rps: (requests - errors) / secs,
                p50_us: p50 as u64,
                p99_us: p99 as u64,
                errors: errors as u64,
                evalsha_per_request: per(&["evalsha", "eval"]),
                checkout_per_request: per(&["ping", "unwatch"]),
                server_us: 1e6 * server_cpu / sent,
                // INFO cpu counts the commands of this cell and of the control connection.
                redis_us: 1e6 * redis_cpu / sent,
            });
            eprintln!(
                "  {size:>6} B {connections:>2} conns {scenario:<12} {target:<6} {:>8.0} req/s {:>6.1} + {:>5.1} µs",
                requests / secs,
                1e6 * server_cpu / sent,
                1e6 * redis_cpu / sent,
            );
        }
    }
    // The median round of each cell, by 2xx answers per second; CPU by its own median.
    let cells: BTreeMap<CellKey, Cell> = runs
        .into_iter()
        .map(|(key, mut cells)| {
            let median_of = |values: &mut Vec<f64>| {
                values.sort_by(f64::total_cmp);
                values[values.len() / 2]
            };
            let mut server: Vec<f64> = cells.iter().map(|c| c.server_us).collect();
            let mut redis: Vec<f64> = cells.iter().map(|c| c.redis_us).collect();
            let (server, redis) = (median_of(&mut server), median_of(&mut redis));
            cells.sort_by(|a, b| a.ok_rps.total_cmp(&b.ok_rps));
            let (min, max) = (cells[0].ok_rps, cells[cells.len() - 1].ok_rps);
            let mut median = cells.swap_remove(cells.len() / 2);
            median.spread = (max - min) / median.ok_rps;
            median.server_us = server;
            median.redis_us = redis;
            (key, median)
        })
        .collect();
    print_tables(&concurrencies, &cells);
    memory_per_record(&redis_url, &mut control).await?;
    drop(servers);
    drop(redis);
    Ok(())
}

fn print_tables(concurrencies: &[usize], cells: &BTreeMap<CellKey, Cell>) {
    let small = SIZES[0];
    println!(
        "| conns | scenario | target | req/s | 2xx/s | spread | p50 µs | p99 µs | non-2xx | EVALSHA/req | PING+UNWATCH/req | server CPU µs/req | Redis CPU µs/req |"
    );
    println!("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for &connections in concurrencies {
        for scenario in SCENARIOS {
            for target in TARGETS {
                let c = &cells[&(small, connections, scenario, target)];
                println!(
                    "| {connections} | {scenario} | {target} | {:.0} | {:.0} | {:.0}% | {} | {} | {} | {:.2} | {:.2} | {:.1} | {:.1} |",
                    c.rps,
                    c.ok_rps,
                    100.0 * c.spread,
                    c.p50_us,
                    c.p99_us,
                    c.errors,
                    c.evalsha_per_request,
                    c.checkout_per_request,
                    c.server_us,
                    c.redis_us,
                );
            }
        }
    }

    println!(
        "\nCPU time per request, server + Redis (µs), {small}-byte bodies, {} connections:\n",
        concurrencies[0]
    );
    println!("| scenario | {} |", TARGETS.join(" | "));
    println!("|---|{}", "---:|".repeat(TARGETS.len()));
    for scenario in SCENARIOS {
        let row: Vec<String> = TARGETS
            .iter()
            .map(|target| {
                let c = &cells[&(small, concurrencies[0], scenario, *target)];
                if c.redis_us < 0.5 {
                    format!("{:.1}", c.server_us)
                } else {
                    format!(
                        "{:.1} + {:.1} = {:.1}",
                        c.server_us,
                        c.redis_us,
                        c.server_us + c.redis_us
                    )
                }
            })
            .collect();
        println!("| {scenario} | {} |", row.join(" | "));
    }

    println!("\nRatios, measured side by side in this run (2xx/s; CPU: the floor's over ours):\n");
    println!(
        "| conns | scenario | redis/bare | redis/floor | cached/bare | memory/bare | redis/peer | floor CPU / redis CPU |"
    );
    println!("|---:|---|---:|---:|---:|---:|---:|---:|");
    for &connections in concurrencies {
        for scenario in SCENARIOS {
            let c = |target| &cells[&(small, connections, scenario, target)];
            let cpu = |target| c(target).server_us + c(target).redis_us;
            println!(
                "| {connections} | {scenario} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
                c("redis").ok_rps / c("bare").ok_rps,
                c("redis").ok_rps / c("floor").ok_rps,
                c("cached").ok_rps / c("bare").ok_rps,
                c("memory").ok_rps / c("bare").ok_rps,
                c("redis").ok_rps / c("peer").ok_rps,
                cpu("floor") / cpu("redis"),
            );
        }
    }

    println!(
        "\nBody sizes (request and response alike), {} connections: 2xx/s, and CPU µs per request server + Redis:\n",
        concurrencies[0]
    );
    println!("| size | scenario | {} |", TARGETS.join(" | "));
    println!("|---:|---|{}", "---:|".repeat(TARGETS.len()));
    for size in SIZES {
        for scenario in ["fresh", "replay"] {
            let row: Vec<String> = TARGETS
                .iter()
                .map(|target| {
                    let c = &cells[&(size, concurrencies[0], scenario, *target)];
                    format!("{:.0} ({:.0} + {:.0})", c.ok_rps, c.server_us, c.redis_us)
                })
                .collect();
            println!("| {size} | {scenario} | {} |", row.join(" | "));
        }
    }
}

/// `used_memory` per record over 10,000 records: completed (256-byte and 16 KiB bodies, three
/// headers) and in progress, for ours and the peer.
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
    println!("\n| records ({RECORDS}) | body | bytes per record |");
    println!("|---|---:|---:|");
    for size in [SIZES[0], SIZES[1]] {
        for target in ["redis", "peer"] {
            let app = app(target, redis_url).await?;
            let () = redis::cmd("FLUSHALL").query_async(control).await?;
            let before = used_memory(control).await?;
            let body = request_body(size);
            for i in 0..RECORDS {
                let request = Request::post("/pay")
                    .header("content-type", "application/json")
                    .header("idempotency-key", format!("memory-{i:08}"))
                    .body(Body::from(body.clone()))?;
                let response = oneshot(app.clone(), request).await?;
                assert!(response.status().is_success());
            }
            let after = used_memory(control).await?;
            let name = if target == "redis" { "ours" } else { "peer" };
            println!("| {name}, completed | {size} | {} |", (after - before) / RECORDS as i64);
        }
    }
    let store = RedisStore::from_url(redis_url)?;
    let () = redis::cmd("FLUSHALL").query_async(control).await?;
    let before = used_memory(control).await?;
    let fingerprint = Fingerprint::new("POST", "/pay", "", REQUEST_BODY.as_bytes());
    for i in 0..RECORDS {
        let key = RecordKey::new("idempotency", b"", format!("claim-{i:08}").as_bytes());
        let lease = Duration::from_secs(60).into();
        store.claim(&key, &fingerprint, &OwnerToken::random(), lease).await?;
    }
    let after = used_memory(control).await?;
    println!("| ours, in progress | - | {} |", (after - before) / RECORDS as i64);
    Ok(())
}
