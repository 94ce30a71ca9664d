//! A payments consumer on Redis Streams consumer groups, made idempotent with [`Idempotent`].
//!
//! ```sh
//! cargo run --example consumer                                     # records in memory
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example consumer    # records in Redis
//! ```
//!
//! The broker is Redis either way (`REDIS_URL`, default `redis://127.0.0.1:6379`): a stream of
//! its own per run, deleted at the end; in Redis, the run's records (under a key prefix of its
//! own) expire 10 minutes later, so every run prints the same table. A producer publishes payment events, retrying some
//! (the same event twice). Worker A processes messages but "crashes" after the side effect of
//! every third one, before its XACK; worker B takes those over with XAUTOCLAIM. Every
//! delivery goes through `Idempotent::run`, keyed by the event id: the side effect happens
//! once per event. One event id is published again with another payload (a producer bug): that
//! delivery is a mismatch, moved to a dead-letter stream and acknowledged, never processed. A
//! store error leaves the message pending, for XAUTOCLAIM to deliver again.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use axum_idempotency::{
    Idempotent, MemoryStore, RedisStore,
    consumer::{Error, Outcome},
    store::{
        Store,
        deadpool_redis::redis::{
            self, AsyncCommands,
            aio::MultiplexedConnection,
            streams::{
                StreamAutoClaimOptions, StreamAutoClaimReply, StreamId, StreamReadOptions,
                StreamReadReply,
            },
        },
    },
};

const GROUP: &str = "payments";
const EVENTS: usize = 12;
/// Events the producer publishes twice, as a producer that retried after a lost answer does.
const RETRIED: [usize; 3] = [3, 7, 10];
/// An event id the producer publishes again with another payload.
const REUSED: usize = 5;

/// What a worker does with a message once `Idempotent::run` answered.
enum Disposition {
    /// Done (ran now, or before): acknowledge it.
    Ack,
    /// Not done here (another worker holds it, or the store failed): leave it pending.
    Retry,
    /// Never to be processed (a reused id, a record that cannot be read): dead-letter it.
    DeadLetter,
}

/// What happened to one event.
#[derive(Default)]
struct Row {
    deliveries: Vec<&'static str>,
    side_effects: usize,
}

#[derive(Clone)]
struct Worker<St: Store> {
    name: &'static str,
    stream: String,
    idem: Idempotent<St>,
    rows: Arc<Mutex<BTreeMap<usize, Row>>>,
}

impl<St: Store> Worker<St> {
    /// Charges the payment once per event id; says what to do with the message.
    async fn process(&self, message: &StreamId) -> Disposition {
        let (Some(number), Some(payload)) =
            (message.get::<usize>("event"), message.get::<String>("payload"))
        else {
            return Disposition::DeadLetter;
        };
        let rows = self.rows.clone();
        let outcome = self
            .idem
            .run(
                "payments-consumer",
                format!("evt_{number}"),
                &payload,
                move |_context| async move {
                    // The side effect: in a real consumer, the charge at the payment provider.
                    rows.lock().unwrap().entry(number).or_default().side_effects += 1;
                    Ok::<_, std::io::Error>(format!("ch_{number}"))
                },
            )
            .await;
        let (label, disposition) = match outcome {
            Ok(Outcome::Ran(_)) => ("ran", Disposition::Ack),
            Ok(Outcome::Replayed(_)) => ("replayed", Disposition::Ack),
            Ok(Outcome::InProgress { .. }) => ("in progress", Disposition::Retry),
            // The same id with another payload: not this event; never process it.
            Ok(Outcome::Mismatch) => ("mismatch", Disposition::DeadLetter),
            // Nothing ran: the message stays pending and is delivered again.
            Err(Error::Store(_) | Error::Operation(_) | Error::Recovery | Error::Cancelled) => {
                ("error", Disposition::Retry)
            }
            // It ran before; its result cannot be replayed, and it never runs again.
            Err(Error::ResultNotStored { .. }) => ("ran before", Disposition::Ack),
            Err(error) => {
                eprintln!("evt_{number}: {error}");
                ("unreadable", Disposition::DeadLetter)
            }
        };
        let delivery = if self.name == "A" { label } else { b_label(label) };
        self.rows.lock().unwrap().entry(number).or_default().deliveries.push(delivery);
        disposition
    }

    /// Acknowledges the message, after copying it to the dead-letter stream when so decided.
    /// A broker error leaves it pending, for XAUTOCLAIM to deliver again.
    async fn settle(
        &self,
        broker: &mut MultiplexedConnection,
        message: &StreamId,
        disposition: Disposition,
    ) {
        if let Disposition::DeadLetter = disposition {
            let field = |name: &str| message.get::<String>(name).unwrap_or_default();
            let fields = [("event", field("event")), ("payload", field("payload"))];
            let copied: Result<String, _> =
                broker.xadd(dead_letters(&self.stream), "*", &fields).await;
            if let Err(error) = copied {
                return eprintln!("dead-letter of {} failed: {error}", message.id);
            }
        }
        if let Disposition::Retry = disposition {
            return;
        }
        let acked: Result<usize, _> = broker.xack(&self.stream, GROUP, &[&message.id]).await;
        if let Err(error) = acked {
            eprintln!("XACK of {} failed: {error}", message.id);
        }
    }
}

/// The dead-letter stream of `stream`.
fn dead_letters(stream: &str) -> String {
    format!("{stream}:dead-letters")
}

fn b_label(label: &'static str) -> &'static str {
    match label {
        "ran" => "ran (B)",
        "replayed" => "replayed (B)",
        "in progress" => "in progress (B)",
        "mismatch" => "mismatch (B)",
        _ => "error (B)",
    }
}

/// Worker A: reads new messages and "crashes" after the side effect of every third one,
/// before its ack: the message stays pending under A. It stops when the stream has no new
/// message for it.
async fn worker_a<St: Store>(worker: Worker<St>, mut broker: MultiplexedConnection) {
    let options = StreamReadOptions::default().group(GROUP, "A").count(4).block(20);
    let mut handled = 0usize;
    loop {
        let reply: Option<StreamReadReply> =
            broker.xread_options(&[&worker.stream], &[">"], &options).await.expect("XREADGROUP");
        let messages: Vec<StreamId> =
            reply.into_iter().flat_map(|r| r.keys).flat_map(|k| k.ids).collect();
        if messages.is_empty() {
            return;
        }
        for message in messages {
            let disposition = worker.process(&message).await;
            handled += 1;
            if !handled.is_multiple_of(3) {
                worker.settle(&mut broker, &message, disposition).await;
            }
        }
    }
}

/// Worker B: takes over messages idle for 100 ms (XAUTOCLAIM) and reads new ones.
async fn worker_b<St: Store>(worker: Worker<St>, mut broker: MultiplexedConnection) {
    let options = StreamReadOptions::default().group(GROUP, "B").count(4).block(20);
    let mut idle_rounds = 0;
    while idle_rounds < 20 {
        let claimed: StreamAutoClaimReply = broker
            .xautoclaim_options(
                &worker.stream,
                GROUP,
                "B",
                100,
                "0-0",
                StreamAutoClaimOptions::default().count(16),
            )
            .await
            .expect("XAUTOCLAIM");
        let reply: Option<StreamReadReply> =
            broker.xread_options(&[&worker.stream], &[">"], &options).await.expect("XREADGROUP");
        let read = reply.into_iter().flat_map(|r| r.keys).flat_map(|k| k.ids);
        let messages: Vec<StreamId> = claimed.claimed.into_iter().chain(read).collect();
        let pending: usize = pending(&mut broker, &worker.stream).await;
        idle_rounds = if messages.is_empty() && pending == 0 { idle_rounds + 1 } else { 0 };
        for message in messages {
            let disposition = worker.process(&message).await;
            worker.settle(&mut broker, &message, disposition).await;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn pending(broker: &mut MultiplexedConnection, stream: &str) -> usize {
    let summary: (usize, redis::Value, redis::Value, redis::Value) =
        redis::cmd("XPENDING").arg(stream).arg(GROUP).query_async(broker).await.expect("XPENDING");
    summary.0
}

async fn run<St: Store>(
    store: St,
    records: &str,
    broker_url: &str,
) -> Result<(), redis::RedisError> {
    let client = redis::Client::open(broker_url)?;
    let mut broker = client.get_multiplexed_async_connection().await?;
    // A stream and records of this run's own, so that a second run against the same Redis
    // starts clean: the streams are deleted at the end, the records expire after 10 minutes.
    let run_id = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos());
    let stream = format!("payments-example-{run_id}");
    let () = broker.xgroup_create_mkstream(&stream, GROUP, "0").await?;

    for number in 1..=EVENTS {
        let copies = if RETRIED.contains(&number) { 2 } else { 1 };
        for _ in 0..copies {
            let payload = format!(r#"{{"amount":{}}}"#, number * 100);
            let _: String = broker
                .xadd(&stream, "*", &[("event", number.to_string()), ("payload", payload)])
                .await?;
        }
    }
    let reused = format!(r#"{{"amount":{}}}"#, REUSED * 100 + 1);
    let _: String =
        broker.xadd(&stream, "*", &[("event", REUSED.to_string()), ("payload", reused)]).await?;

    let rows = Arc::new(Mutex::new(BTreeMap::new()));
    let idem = Idempotent::new(store)
        .key_prefix(stream.clone())
        .retention(Duration::from_secs(10 * 60))
        .lease(Duration::from_secs(5));
    let worker =
        |name| Worker { name, stream: stream.clone(), idem: idem.clone(), rows: rows.clone() };
    let a = tokio::spawn(worker_a(worker("A"), client.get_multiplexed_async_connection().await?));
    let b = tokio::spawn(worker_b(worker("B"), client.get_multiplexed_async_connection().await?));
    a.await.expect("worker A");
    b.await.expect("worker B");
    let dead_lettered: usize = broker.xlen(dead_letters(&stream)).await?;
    let _: usize = broker.del(&[stream.clone(), dead_letters(&stream)]).await?;

    println!("records: {records}; broker: Redis Streams at {broker_url}");
    println!();
    println!("| event  | published | deliveries                              | side effects |");
    println!("|--------|-----------|-----------------------------------------|--------------|");
    let rows = rows.lock().unwrap();
    for (number, row) in rows.iter() {
        let published = if RETRIED.contains(number) || *number == REUSED { 2 } else { 1 };
        println!(
            "| evt_{number:<2} | {published:>9} | {:<39} | {:>12} |",
            row.deliveries.join(", "),
            row.side_effects
        );
    }
    let deliveries: usize = rows.values().map(|row| row.deliveries.len()).sum();
    let side_effects: usize = rows.values().map(|row| row.side_effects).sum();
    println!("(B): delivered to worker B, which took over what A left pending; the rest: worker A");
    println!();
    println!(
        "events: {}, deliveries: {deliveries}, side effects: {side_effects}, dead-lettered: {dead_lettered}",
        rows.len()
    );
    Ok(())
}

#[tokio::main]
async fn main() {
    let url = std::env::var("REDIS_URL").ok();
    let broker_url = url.clone().unwrap_or_else(|| "redis://127.0.0.1:6379".to_owned());
    let result = match &url {
        Some(url) => {
            let store = RedisStore::from_url(url).expect("REDIS_URL is a Redis URL");
            run(store, &format!("RedisStore at {url}"), &broker_url).await
        }
        None => run(MemoryStore::new(), "MemoryStore", &broker_url).await,
    };
    if let Err(error) = result {
        eprintln!(
            "cannot use Redis at {broker_url}: {error}\nthis example's broker is Redis Streams: start redis-server, or set REDIS_URL"
        );
        std::process::exit(1);
    }
}
