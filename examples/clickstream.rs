//! A click-stream consumer on Redis Streams that drops duplicate clicks with the `dedup` door's
//! Bloom strategy, and counts its false positives against a ground truth it keeps.
//!
//! ```sh
//! cargo run --example clickstream                 # Redis at redis://127.0.0.1:6379
//! REDIS_URL=redis://10.0.0.5:6379 cargo run --example clickstream -- 50000 10000
//! ```
//!
//! A producer adds `CLICKS` distinct clicks (default 20,000) and `REDELIVERED` copies of
//! earlier ones (default 4,000: a producer's retries) to a stream; a consumer group reads it in
//! pages of 500, asks the door which clicks are new (one script per shard and page), counts
//! those and acknowledges the page. The filter is sized for the distinct clicks at 1 %: the
//! false positives it prints (new clicks dropped) are measured against the set of ids the
//! consumer keeps beside it, and a duplicate never passes. The stream is deleted at the end;
//! the filters expire within three minutes.
//!
//! What a crash costs, before you copy this: the door remembers a page's clicks when it
//! answers. A consumer that dies after asking and before it counts and acknowledges has the
//! page delivered again (to another consumer by `XAUTOCLAIM`, or to itself as its pending
//! entries, read with the id `0` when it starts again), and the door then answers "seen": those
//! clicks are never counted. That is at most once for the page a crash interrupts, which a
//! click count can take. Where an event lost costs more than one counted twice, use the consumer
//! door (`Idempotent::run`, `examples/consumer.rs`): it stores each operation's outcome with its
//! claim, so a redelivery after a crash runs or replays it, never drops it.

use std::{collections::HashSet, time::Duration};

use axum_idempotency::{
    RedisStore,
    dedup::{Dedup, Strategy},
};
use redis::{
    AsyncCommands,
    streams::{StreamReadOptions, StreamReadReply},
};

type Error = Box<dyn std::error::Error + Send + Sync>;

const GROUP: &str = "counters";
const PAGE: usize = 500;
/// The buckets' length: this run's clicks fall in one or two buckets.
const WINDOW: Duration = Duration::from_secs(60);

#[tokio::main]
async fn main() -> Result<(), Error> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let mut args = std::env::args().skip(1).map(|arg| arg.parse::<usize>());
    let clicks = args.next().transpose()?.unwrap_or(20_000).max(1);
    let redelivered = args.next().transpose()?.unwrap_or(4_000);
    let mut redis = redis::Client::open(url.as_str())?.get_multiplexed_async_connection().await?;
    // A stream and a scope of this run's own, so that runs on one Redis do not meet.
    let run = std::process::id();
    let stream = format!("clickstream:{run}");

    // The producer: every click once, then copies of earlier ones, in pipelines.
    let event = |i: usize| format!("click_{run}_{i}");
    let copies = (0..redelivered).map(|n| (n * 7_919) % clicks);
    let sent: Vec<String> = (0..clicks).chain(copies).map(event).collect();
    for page in sent.chunks(PAGE) {
        let mut pipe = redis::pipe();
        for id in page {
            pipe.xadd(&stream, "*", &[("event_id", id.as_str()), ("url", "/pricing")]).ignore();
        }
        let () = pipe.query_async(&mut redis).await?;
    }
    let () = redis.xgroup_create(&stream, GROUP, "0").await?;
    println!("produced {} clicks: {clicks} distinct, {redelivered} redelivered", sent.len());

    // The consumer.
    let strategy = Strategy::bloom(WINDOW, clicks as u64, 0.01);
    let door = Dedup::new(RedisStore::from_url(&url)?, strategy);
    let scope = format!("clicks-{run}");
    let options = StreamReadOptions::default().group(GROUP, "consumer-1").count(PAGE);
    let mut truth: HashSet<String> = HashSet::new();
    let (mut counted, mut dropped, mut false_positives, mut false_negatives) = (0, 0, 0, 0);
    loop {
        let reply: Option<StreamReadReply> =
            redis.xread_options(&[&stream], &[">"], &options).await?;
        let Some(entries) = reply.and_then(|reply| reply.keys.into_iter().next()) else { break };
        if entries.ids.is_empty() {
            break;
        }
        let ids: Vec<String> = entries
            .ids
            .iter()
            .map(|entry| entry.get::<String>("event_id").unwrap_or_default())
            .collect();
        let fresh = door.first_seen_batch(&scope, &ids).await?;
        for (id, new) in ids.iter().zip(fresh) {
            let truly_new = truth.insert(id.clone());
            match (new, truly_new) {
                (true, true) => counted += 1,
                (false, false) => dropped += 1,
                (false, true) => false_positives += 1,
                (true, false) => false_negatives += 1,
            }
        }
        let acked: Vec<&str> = entries.ids.iter().map(|entry| entry.id.as_str()).collect();
        let _: usize = redis.xack(&stream, GROUP, &acked).await?;
    }
    let () = redis.del(&stream).await?;

    // The filter's rate while it fills from empty to its design load, averaged: what the
    // clicks met on their way in.
    let steps = 100;
    let expected = (0..steps)
        .map(|step| strategy.false_positive_rate((clicks * step / steps) as u64))
        .sum::<f64>()
        / steps as f64;
    println!("counted {counted} clicks, dropped {dropped} redelivered ones");
    println!(
        "false positives: {false_positives} of {clicks} new clicks dropped ({:.3} %; \
         expected while the filter fills to its design load: {:.3} %)",
        100.0 * false_positives as f64 / clicks as f64,
        100.0 * expected,
    );
    println!("false negatives: {false_negatives} (a duplicate counted)");
    Ok(())
}
