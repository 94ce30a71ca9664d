//! A real at-least-once broker: Redis Streams consumer groups on a private redis-server. One
//! worker never acknowledges some messages after their side effect (as if it crashed between
//! the two); the other takes them over with XAUTOCLAIM. The side effect happens once per event
//! id, whatever the number of deliveries.

use crate::common;

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use axum_idempotency::{
    Idempotent, RedisStore,
    consumer::Outcome,
    store::deadpool_redis::redis::{
        self, AsyncCommands,
        aio::MultiplexedConnection,
        streams::{
            StreamAutoClaimOptions, StreamAutoClaimReply, StreamId, StreamReadOptions,
            StreamReadReply,
        },
    },
};
use common::RedisServer;

const STREAM: &str = "payments";
const GROUP: &str = "ledger";
const EVENTS: usize = 1_000;

/// What the workers share: the records, the side effects per event id, and counts.
#[derive(Clone)]
struct Shared {
    idem: Idempotent<RedisStore>,
    side_effects: Arc<Mutex<HashMap<String, usize>>>,
    deliveries: Arc<AtomicUsize>,
    acked: Arc<AtomicUsize>,
}

impl Shared {
    /// Processes one delivery; true when it may be acknowledged.
    async fn process(&self, message: &StreamId) -> bool {
        self.deliveries.fetch_add(1, Ordering::SeqCst);
        let event: String = message.get("event_id").expect("event_id");
        let payload: Vec<u8> = message.get("payload").expect("payload");
        let side_effects = self.side_effects.clone();
        let id = event.clone();
        let outcome = self
            .idem
            .run("ledger-consumer", &event, payload, move |_context| async move {
                *side_effects.lock().unwrap().entry(id).or_default() += 1;
                Ok::<_, std::io::Error>(())
            })
            .await
            .expect("the store answers");
        match outcome {
            Outcome::Ran(()) | Outcome::Replayed(()) => true,
            // Another worker is running it right now: leave it pending, it comes back.
            Outcome::InProgress { .. } => false,
            Outcome::Mismatch => panic!("event {event} redelivered with another payload"),
        }
    }

    async fn ack(&self, broker: &mut MultiplexedConnection, message: &StreamId) {
        let acked: usize = broker.xack(STREAM, GROUP, &[&message.id]).await.expect("XACK");
        self.acked.fetch_add(acked, Ordering::SeqCst);
    }
}

/// Reads new messages; leaves every third one unacknowledged after processing it.
async fn crashing_worker(shared: Shared, mut broker: MultiplexedConnection, entries: usize) {
    let options = StreamReadOptions::default().group(GROUP, "worker-a").count(20).block(20);
    let mut handled = 0usize;
    while shared.acked.load(Ordering::SeqCst) < entries {
        let reply: Option<StreamReadReply> =
            broker.xread_options(&[STREAM], &[">"], &options).await.expect("XREADGROUP");
        for message in reply.into_iter().flat_map(|r| r.keys).flat_map(|k| k.ids) {
            let ackable = shared.process(&message).await;
            handled += 1;
            if ackable && !handled.is_multiple_of(3) {
                shared.ack(&mut broker, &message).await;
            }
        }
    }
}

/// Takes over messages idle for 50 ms (XAUTOCLAIM), and reads new ones; acknowledges both.
async fn rescuing_worker(shared: Shared, mut broker: MultiplexedConnection, entries: usize) {
    let options = StreamReadOptions::default().group(GROUP, "worker-b").count(20).block(20);
    while shared.acked.load(Ordering::SeqCst) < entries {
        let claimed: StreamAutoClaimReply = broker
            .xautoclaim_options(
                STREAM,
                GROUP,
                "worker-b",
                50,
                "0-0",
                StreamAutoClaimOptions::default().count(100),
            )
            .await
            .expect("XAUTOCLAIM");
        let reply: Option<StreamReadReply> =
            broker.xread_options(&[STREAM], &[">"], &options).await.expect("XREADGROUP");
        let read = reply.into_iter().flat_map(|r| r.keys).flat_map(|k| k.ids);
        for message in claimed.claimed.into_iter().chain(read) {
            if shared.process(&message).await {
                shared.ack(&mut broker, &message).await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redeliveries_and_producer_retries_run_each_side_effect_once() {
    let server = RedisServer::start();
    let mut broker = server.connection().await;
    let () = broker.xgroup_create_mkstream(STREAM, GROUP, "0").await.expect("XGROUP CREATE");
    // Every tenth event is published twice: a producer that retried after a lost answer.
    let mut entries = 0;
    for i in 0..EVENTS {
        let copies = if i % 10 == 0 { 2 } else { 1 };
        for _ in 0..copies {
            let payload = format!(r#"{{"amount":{i}}}"#);
            let _: String = broker
                .xadd(STREAM, "*", &[("event_id", format!("evt_{i}")), ("payload", payload)])
                .await
                .expect("XADD");
            entries += 1;
        }
    }
    let shared = Shared {
        idem: Idempotent::new(RedisStore::new(server.pool())),
        side_effects: Arc::default(),
        deliveries: Arc::default(),
        acked: Arc::default(),
    };
    let started = Instant::now();
    let a = tokio::spawn(crashing_worker(shared.clone(), server.connection().await, entries));
    let b = tokio::spawn(rescuing_worker(shared.clone(), server.connection().await, entries));
    tokio::time::timeout(Duration::from_secs(120), async {
        a.await.unwrap();
        b.await.unwrap();
    })
    .await
    .unwrap_or_else(|_| {
        panic!(
            "not every entry was acknowledged in 120 s: {} of {entries}",
            shared.acked.load(Ordering::SeqCst)
        )
    });

    let side_effects = shared.side_effects.lock().unwrap().clone();
    assert_eq!(side_effects.len(), EVENTS, "every event had its side effect");
    let repeated: Vec<_> = side_effects.iter().filter(|(_, n)| **n != 1).collect();
    assert!(repeated.is_empty(), "side effects repeated: {repeated:?}");
    let deliveries = shared.deliveries.load(Ordering::SeqCst);
    assert!(deliveries > entries, "no redelivery happened: {deliveries} deliveries of {entries}");
    let pending: (usize, redis::Value, redis::Value, redis::Value) = redis::cmd("XPENDING")
        .arg(STREAM)
        .arg(GROUP)
        .query_async(&mut broker)
        .await
        .expect("XPENDING");
    assert_eq!(pending.0, 0, "messages left pending");
    eprintln!(
        "events: {EVENTS}, entries: {entries}, deliveries: {deliveries}, side effects: {}, in {:?}",
        side_effects.values().sum::<usize>(),
        started.elapsed()
    );
}
