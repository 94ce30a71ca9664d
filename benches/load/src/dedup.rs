//! `load dedup`: the dedup door's strategies on a private Redis, side by side in one run:
//! memory per event (`used_memory` after a million events, less before), and events per second
//! single (64 concurrent callers) and batched (pages of 1,000), against a floor: raw pipelined
//! `SET NX PX` on one multiplexed connection.

use std::time::{Duration, Instant};

use axum_idempotency::{
    RedisStore,
    dedup::{Dedup, Strategy},
};

use super::{ChildGuard, Error};

const EVENTS: usize = 1_000_000;
const PAGE: usize = 1_000;
const SINGLE: usize = 100_000;
const WINDOW: Duration = Duration::from_secs(3600);

async fn used_memory(control: &mut redis::aio::MultiplexedConnection) -> Result<i64, Error> {
    let info: String = redis::cmd("INFO").arg("memory").query_async(control).await?;
    let line = info.lines().find_map(|l| l.strip_prefix("used_memory:")).ok_or("no used_memory")?;
    Ok(line.trim().parse()?)
}

fn ids(from: usize, count: usize) -> Vec<String> {
    (from..from + count).map(|i| format!("evt_{i:012}")).collect()
}

pub(crate) async fn run() -> Result<(), Error> {
    let redis = ChildGuard::redis_server(false)?;
    let url = format!("redis://127.0.0.1:{}", redis.port);
    let mut control = redis::Client::open(url.as_str())?.get_multiplexed_async_connection().await?;
    println!(
        "load dedup: {EVENTS} events in pages of {PAGE}, then {SINGLE} single calls from 64 tasks; one private redis-server\n"
    );
    println!("| strategy | bytes per event | batched events/s | single events/s | keys |");
    println!("|---|---:|---:|---:|---:|");
    for name in ["floor", "markers", "buckets"] {
        let () = redis::cmd("FLUSHALL").query_async(&mut control).await?;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let before = used_memory(&mut control).await?;
        let store = RedisStore::from_url(&url)?;
        let door = match name {
            "buckets" => Dedup::new(store, Strategy::buckets(WINDOW)),
            _ => Dedup::new(store, Strategy::markers(WINDOW)),
        };
        let mut floor =
            redis::Client::open(url.as_str())?.get_multiplexed_async_connection().await?;
        let started = Instant::now();
        for page in 0..EVENTS / PAGE {
            let ids = ids(page * PAGE, PAGE);
            if name == "floor" {
                let mut pipe = redis::pipe();
                for id in &ids {
                    pipe.cmd("SET").arg(id).arg(1).arg("NX").arg("PX").arg(3_600_000).ignore();
                }
                let () = pipe.query_async(&mut floor).await?;
            } else {
                door.first_seen_batch("clicks", &ids).await?;
            }
        }
        let batched = EVENTS as f64 / started.elapsed().as_secs_f64();
        let after = used_memory(&mut control).await?;
        let keys: i64 = redis::cmd("DBSIZE").query_async(&mut control).await?;
        let started = Instant::now();
        let tasks: Vec<_> = (0..64)
            .map(|task| {
                let (door, mut floor, name) = (door.clone(), floor.clone(), name);
                tokio::spawn(async move {
                    for id in ids(EVENTS + task * (SINGLE / 64), SINGLE / 64) {
                        if name == "floor" {
                            let _: Option<String> = redis::cmd("SET")
                                .arg(&id)
                                .arg(1)
                                .arg("NX")
                                .arg("PX")
                                .arg(3_600_000)
                                .query_async(&mut floor)
                                .await?;
                        } else {
                            door.first_seen("clicks", &id).await?;
                        }
                    }
                    Ok::<_, Error>(())
                })
            })
            .collect();
        for task in tasks {
            task.await??;
        }
        let single = (SINGLE / 64 * 64) as f64 / started.elapsed().as_secs_f64();
        println!(
            "| {name} | {:.0} | {batched:.0} | {single:.0} | {keys} |",
            (after - before) as f64 / EVENTS as f64
        );
    }
    drop(redis);
    Ok(())
}
