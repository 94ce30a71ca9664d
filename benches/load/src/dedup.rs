//! `load dedup [EVENTS]`: the dedup door's strategies on a private Redis, side by side in one
//! run: memory per event (`used_memory` after EVENTS events in one bucket, less before). With
//! no EVENTS given (a million), then events per second batched (pages of 1,000) and single (64
//! concurrent callers) against a floor, raw pipelined `SET NX PX` on one multiplexed
//! connection; and the Bloom filters' false-positive rates measured against the theory, at
//! their design load and at twice it, with their false negatives.

use std::time::{Duration, Instant, SystemTime};

use axum_idempotency::{
    RedisStore,
    dedup::{Dedup, Strategy},
};

use super::{ChildGuard, Error};

const PAGE: usize = 1_000;
const WINDOW: Duration = Duration::from_secs(3600);
/// The worked example: 50,000 events a second over a one-hour window.
const EXAMPLE_EVENTS: f64 = 50_000.0 * 3600.0;

async fn used_memory(control: &mut redis::aio::MultiplexedConnection) -> Result<i64, Error> {
    let info: String = redis::cmd("INFO").arg("memory").query_async(control).await?;
    let line = info.lines().find_map(|l| l.strip_prefix("used_memory:")).ok_or("no used_memory")?;
    Ok(line.trim().parse()?)
}

fn ids(kind: &str, from: usize, count: usize) -> Vec<String> {
    (from..from + count).map(|i| format!("{kind}_{i:012}")).collect()
}

/// Asks `count` ids in pages at `at`: how many were new.
async fn ask(
    door: &Dedup<RedisStore>,
    scope: &str,
    kind: &str,
    count: usize,
    at: SystemTime,
) -> Result<usize, Error> {
    let mut new = 0;
    for page in 0..count.div_ceil(PAGE) {
        let ids = ids(kind, page * PAGE, PAGE.min(count - page * PAGE));
        new += door.first_seen_at(scope, &ids, at).await?.iter().filter(|n| **n).count();
    }
    Ok(new)
}

/// The strategies side by side, the floor first (`None`), Bloom filters sized for `events`.
fn strategies(events: usize) -> [(&'static str, Option<Strategy>); 5] {
    [
        ("floor (SET NX PX)", None),
        ("markers", Some(Strategy::markers(WINDOW))),
        ("buckets", Some(Strategy::buckets(WINDOW))),
        ("bloom 1 %", Some(Strategy::bloom(WINDOW, events as u64, 0.01))),
        ("bloom 0.1 %", Some(Strategy::bloom(WINDOW, events as u64, 0.001))),
    ]
}

/// Adds `count` ids of `kind` in pages at `at`, through `door` or, with none, as the floor's
/// pipelined `SET NX PX`.
async fn fill(
    url: &str,
    door: Option<&Dedup<RedisStore>>,
    kind: &str,
    count: usize,
    at: SystemTime,
) -> Result<(), Error> {
    match door {
        Some(door) => {
            ask(door, "clicks", kind, count, at).await?;
        }
        None => {
            let mut floor = redis::Client::open(url)?.get_multiplexed_async_connection().await?;
            for page in 0..count.div_ceil(PAGE) {
                let mut pipe = redis::pipe();
                for id in ids(kind, page * PAGE, PAGE.min(count - page * PAGE)) {
                    pipe.cmd("SET").arg(id).arg(1).arg("NX").arg("PX").arg(3_600_000).ignore();
                }
                let () = pipe.query_async(&mut floor).await?;
            }
        }
    }
    Ok(())
}

/// `count` single calls of ids of `kind` from 64 tasks, through `door` or as the floor's
/// `SET NX PX` on one multiplexed connection.
async fn singles(
    url: &str,
    door: Option<&Dedup<RedisStore>>,
    kind: &'static str,
    count: usize,
) -> Result<(), Error> {
    let floor = redis::Client::open(url)?.get_multiplexed_async_connection().await?;
    let tasks: Vec<_> = (0..64)
        .map(|task| {
            let (door, mut floor) = (door.cloned(), floor.clone());
            tokio::spawn(async move {
                for id in ids(kind, task * (count / 64), count / 64) {
                    match &door {
                        Some(door) => {
                            door.first_seen("clicks", &id).await?;
                        }
                        None => {
                            let _: Option<String> = redis::cmd("SET")
                                .arg(&id)
                                .arg(1)
                                .arg("NX")
                                .arg("PX")
                                .arg(3_600_000)
                                .query_async(&mut floor)
                                .await?;
                        }
                    }
                }
                Ok::<_, Error>(())
            })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
    Ok(())
}

pub(crate) async fn run(events: usize, everything: bool) -> Result<(), Error> {
    let redis = ChildGuard::redis_server(false)?;
    let url = format!("redis://127.0.0.1:{}", redis.port);
    let mut control = redis::Client::open(url.as_str())?.get_multiplexed_async_connection().await?;
    // A FLUSHALL of ten million keys takes seconds, past redis-rs's default 500 ms.
    control.set_response_timeout(Duration::from_secs(120));
    println!("load dedup: one private redis-server\n");
    println!(
        "Memory: {events} events added in one bucket in pages of {PAGE}; `used_memory` after, less before.\n"
    );
    println!("| strategy | bytes per event | keys | 50k/s over 1 h: peak memory |");
    println!("|---|---:|---:|---:|");
    let at = SystemTime::now();
    for (name, strategy) in strategies(events) {
        let () = redis::cmd("FLUSHALL").query_async(&mut control).await?;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let before = used_memory(&mut control).await?;
        let door =
            strategy.map(|strategy| Dedup::new(RedisStore::from_url(&url).unwrap(), strategy));
        fill(&url, door.as_ref(), "evt", events, at).await?;
        let after = used_memory(&mut control).await?;
        let keys: i64 = redis::cmd("DBSIZE").query_async(&mut control).await?;
        let per_event = (after - before) as f64 / events as f64;
        // What is kept at the peak: markers one window of events; bucket sets two windows and
        // the quarter of a third; filters are whole from their first event, three of them
        // during a quarter window.
        let peak = match strategy {
            None | Some(Strategy::Markers { .. }) => per_event * EXAMPLE_EVENTS,
            Some(Strategy::Buckets { .. }) => 2.25 * per_event * EXAMPLE_EVENTS,
            Some(Strategy::Bloom { .. }) | Some(_) => 3.0 * per_event * EXAMPLE_EVENTS,
        };
        println!("| {name} | {per_event:.1} | {keys} | {:.2} GB |", peak / 1e9);
    }
    if everything {
        throughput(&url, &mut control, events).await?;
        false_positives(&url, &mut control, events, at).await?;
    }
    drop(redis);
    Ok(())
}

/// Events per second, batched and single, each strategy against the floor: the median of
/// three rounds, the strategies interleaved in each, each on an empty server.
async fn throughput(
    url: &str,
    control: &mut redis::aio::MultiplexedConnection,
    events: usize,
) -> Result<(), Error> {
    const ROUNDS: usize = 3;
    const BATCHED: usize = 200_000;
    const SINGLE: usize = 64 * 800;
    println!(
        "\nEvents per second: {BATCHED} in pages of {PAGE}, then {SINGLE} single calls from 64 tasks; median of {ROUNDS} rounds, interleaved.\n"
    );
    let mut figures = vec![(Vec::new(), Vec::new()); 5];
    let at = SystemTime::now();
    for _ in 0..ROUNDS {
        for (i, (_, strategy)) in strategies(events).into_iter().enumerate() {
            let () = redis::cmd("FLUSHALL").query_async(control).await?;
            let door =
                strategy.map(|strategy| Dedup::new(RedisStore::from_url(url).unwrap(), strategy));
            let started = Instant::now();
            fill(url, door.as_ref(), "evt", BATCHED, at).await?;
            figures[i].0.push(BATCHED as f64 / started.elapsed().as_secs_f64());
            let started = Instant::now();
            singles(url, door.as_ref(), "single", SINGLE).await?;
            figures[i].1.push(SINGLE as f64 / started.elapsed().as_secs_f64());
        }
    }
    let median = |values: &mut Vec<f64>| {
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    let floor = (median(&mut figures[0].0), median(&mut figures[0].1));
    println!("| strategy | batched events/s | × floor | single events/s | × floor |");
    println!("|---|---:|---:|---:|---:|");
    for ((name, _), (batched, single)) in strategies(events).iter().zip(&mut figures) {
        let (batched, single) = (median(batched), median(single));
        println!(
            "| {name} | {batched:.0} | {:.2} | {single:.0} | {:.2} |",
            batched / floor.0,
            single / floor.1
        );
    }
    Ok(())
}

/// The Bloom filters' false-positive rates at their design load and twice it: `events` (or
/// twice as many) added in one bucket, then fresh ids asked in the next, where the full
/// filter is the one before (their own filter's rate, filling with them, is printed beside);
/// and the added ids asked again there, each of which must be a duplicate.
async fn false_positives(
    url: &str,
    control: &mut redis::aio::MultiplexedConnection,
    events: usize,
    at: SystemTime,
) -> Result<(), Error> {
    println!(
        "\n| filter | load | fresh ids asked | taken for seen | measured rate | theory | own filter's rate at the end | false negatives |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for (rate, asked) in [(0.01, 100_000), (0.001, 400_000)] {
        for load in [1, 2] {
            let () = redis::cmd("FLUSHALL").query_async(control).await?;
            let strategy = Strategy::bloom(WINDOW, events as u64, rate);
            let door = Dedup::new(RedisStore::from_url(url)?, strategy);
            ask(&door, "clicks", "evt", load * events, at).await?;
            let new = ask(&door, "clicks", "fresh", asked, at + WINDOW).await?;
            let again = ask(&door, "clicks", "evt", load * events, at + WINDOW).await?;
            let measured = (asked - new) as f64 / asked as f64;
            println!(
                "| {rate} | {load}× ({}) | {asked} | {} | {:.4} % | {:.4} % | {:.6} % | {again} |",
                load * events,
                asked - new,
                100.0 * measured,
                100.0 * strategy.false_positive_rate((load * events) as u64),
                100.0 * strategy.false_positive_rate(asked as u64),
            );
        }
    }
    Ok(())
}
