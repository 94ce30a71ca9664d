//! Keyed hashes (`keyed_hashes`), on every store and both doors: under a secret, the record's
//! name and its fingerprint are HMAC-SHA256 (computed here apart from the crate), never the
//! plain SHA-256 a reader of the store could test a guess against; doors with one secret share
//! records, doors with two do not; and while keyed hashes roll out, a request completed under
//! the names of before is replayed (or answered in progress, or a mismatch), never run again.

#[macro_use]
mod common;

use axum::Router;
use axum_idempotency::settings::Waiting;
use axum_idempotency::{
    Fingerprint, IdempotencyLayer, Idempotent,
    consumer::Outcome,
    store::{Admin, HashSecret, KeyedRollout, RecordKey},
};
use common::*;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

every_store!(
    with_a_secret_the_stored_name_and_fingerprint_are_keyed,
    doors_with_one_secret_share_records_and_with_two_do_not,
    a_request_completed_before_the_secret_replays_while_migrating,
    a_request_running_before_the_secret_is_waited_for_while_migrating,
    without_migrating_a_request_completed_before_the_secret_runs_again,
    two_instances_a_step_apart_share_records,
    the_consumer_door_keys_its_names_and_migrates_the_same,
);

const SECRET: [u8; 32] = [7; 32];
const BODY: &str = r#"{"amount":100}"#;

/// HMAC-SHA256 under `secret` over each field, length-prefixed (u64 big-endian).
fn hmac(secret: [u8; 32], fields: &[&[u8]]) -> [u8; 32] {
    let mut mac = Hmac::<Sha256>::new_from_slice(&secret).unwrap();
    for field in fields {
        mac.update(&(field.len() as u64).to_be_bytes());
        mac.update(field);
    }
    mac.finalize().into_bytes().into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The keyed record key of `key` in `scope` under `prefix`, as a reader with the secret
/// names it.
fn keyed_name(prefix: &str, scope: &[u8], key: &str) -> String {
    let mac = hmac(SECRET, &[b"record-key", prefix.as_bytes(), scope, key.as_bytes()]);
    format!("{prefix}:{{{}}}", hex(&mac))
}

/// The keyed fingerprint of a request whose plain fingerprint is `plain`.
fn keyed_fingerprint(plain: &Fingerprint) -> [u8; 32] {
    hmac(SECRET, &[b"fingerprint", plain.as_bytes()])
}

fn secret() -> HashSecret {
    HashSecret::new(SECRET)
}

fn layer<H: Harness>(h: &H, calls: &Calls, rollout: Option<KeyedRollout>) -> Router {
    let layer = IdempotencyLayer::new(h.store());
    let layer = match rollout {
        Some(rollout) => layer.keyed_hashes(secret(), rollout),
        None => layer,
    };
    app(calls).layer(layer)
}

fn payment(key: &str) -> axum::http::Request<axum::body::Body> {
    keyed("POST", "/payments", key, BODY)
}

async fn with_a_secret_the_stored_name_and_fingerprint_are_keyed<H: Harness>(h: H)
where
    H::Store: Admin,
{
    let calls = Calls::default();
    let keyed = layer(&h, &calls, Some(KeyedRollout::Done));
    assert_eq!(send(&keyed, payment("order-1")).await.status, 201);
    assert!(send(&keyed, payment("order-1")).await.replayed());
    send(&keyed, keyed_request_of_another_body("order-1")).await.assert_problem(409, "key-reused");
    assert_eq!(calls.get(), 1);

    // One record, and not under the plain name a guess of the key would find.
    assert_eq!(h.record_count().await, 1);
    assert_eq!(h.held(&global("order-1")).await, None);
    let door = IdempotencyLayer::new(h.store()).keyed_hashes(secret(), KeyedRollout::Done);
    let report =
        door.operator().inspect(b"", "order-1", false).await.unwrap().expect("the keyed record");
    let expected = keyed_name("idempotency", b"", "order-1");
    assert_eq!(format!("idempotency:{{{}}}", report.key_hash), expected);
    assert_ne!(report.key_hash, global("order-1").hash());
    // The stored fingerprint is the HMAC of the plain one, never the plain SHA-256 of a
    // guessed body.
    let plain = Fingerprint::new("POST", "/payments", "", BODY.as_bytes());
    assert_ne!(report.record.fingerprint, plain);
    assert_eq!(report.record.fingerprint.as_bytes(), &keyed_fingerprint(&plain));
}

fn keyed_request_of_another_body(key: &str) -> axum::http::Request<axum::body::Body> {
    keyed("POST", "/payments", key, r#"{"amount":101}"#)
}

async fn doors_with_one_secret_share_records_and_with_two_do_not<H: Harness>(h: H) {
    let calls = Calls::default();
    let first = layer(&h, &calls, Some(KeyedRollout::Done));
    let second = app(&calls)
        .layer(IdempotencyLayer::new(h.second_store()).keyed_hashes(secret(), KeyedRollout::Done));
    let original = send(&first, payment("k1")).await;
    assert_eq!(original.status, 201);
    let replay = send(&second, payment("k1")).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, original.body);
    assert_eq!(calls.get(), 1);

    let other = app(&calls).layer(
        IdempotencyLayer::new(h.store()).keyed_hashes(HashSecret::new([8; 32]), KeyedRollout::Done),
    );
    let ran = send(&other, payment("k1")).await;
    assert_eq!((ran.status.as_u16(), ran.replayed()), (201, false), "{ran:?}");
    assert_eq!(calls.get(), 2);
    assert_eq!(h.record_count().await, 2);
}

async fn a_request_completed_before_the_secret_replays_while_migrating<H: Harness>(h: H) {
    let calls = Calls::default();
    let plain = layer(&h, &calls, None);
    let original = send(&plain, payment("k1")).await;
    assert_eq!(original.status, 201);
    assert_eq!(h.held(&global("k1")).await, Some(Held::Completed));

    let migrating = layer(&h, &calls, Some(KeyedRollout::Migrate));
    let replay = send(&migrating, payment("k1")).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!((replay.status, &replay.body), (original.status, &original.body));
    // Another request under the key of before is the mismatch it was.
    send(&migrating, keyed_request_of_another_body("k1")).await.assert_problem(409, "key-reused");
    assert_eq!(calls.get(), 1, "the handler ran once");
    // The lookup left nothing under the keyed name, and the plain record as it was.
    assert_eq!(h.record_count().await, 1);

    // A new key is stored under its keyed name only: the plain name's claim was released.
    assert_eq!(send(&migrating, payment("k2")).await.status, 201);
    assert_eq!(h.held(&global("k2")).await, None);
    assert_eq!(h.record_count().await, 2);
    assert!(send(&migrating, payment("k2")).await.replayed());
    assert_eq!(calls.get(), 2);
}

async fn a_request_running_before_the_secret_is_waited_for_while_migrating<H: Harness>(h: H) {
    let calls = Calls::default();
    let plain = layer(&h, &calls, None);
    let running = send_until_claimed(&h, &plain, delayed("/slow", "k1", 1500, "{}"), "k1").await;

    // Not waiting: answered in progress, and nothing runs.
    let impatient = app(&calls).layer(
        IdempotencyLayer::new(h.store())
            .keyed_hashes(secret(), KeyedRollout::Migrate)
            .waiting(Waiting::off()),
    );
    send(&impatient, delayed("/slow", "k1", 0, "{}")).await.assert_problem(202, "in-progress");
    // Waiting (the default): the original's answer, replayed.
    let migrating = layer(&h, &calls, Some(KeyedRollout::Migrate));
    let retry = send(&migrating, delayed("/slow", "k1", 0, "{}")).await;
    let original = running.await.unwrap();
    assert_eq!(original.status, 201);
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, original.body);
    assert_eq!(calls.get(), 1, "the handler ran once");
}

async fn without_migrating_a_request_completed_before_the_secret_runs_again<H: Harness>(h: H) {
    // `Done` is the operator's word that no record of before is left: one that is, is not
    // looked for. This is the gap the rollout's steps close.
    let calls = Calls::default();
    assert_eq!(send(&layer(&h, &calls, None), payment("k1")).await.status, 201);
    let keyed = layer(&h, &calls, Some(KeyedRollout::Done));
    let again = send(&keyed, payment("k1")).await;
    assert_eq!((again.status.as_u16(), again.replayed()), (201, false), "{again:?}");
    assert_eq!(calls.get(), 2);
}

async fn two_instances_a_step_apart_share_records<H: Harness>(h: H) {
    // A rolling deploy of step 2: instances of step 1 (plain names, keyed looked under) and of
    // step 2 (keyed names, plain looked under) answer each other's retries.
    let calls = Calls::default();
    let prepared = layer(&h, &calls, Some(KeyedRollout::Prepare));
    let migrating = layer(&h, &calls, Some(KeyedRollout::Migrate));
    assert_eq!(send(&prepared, payment("by-step-1")).await.status, 201);
    assert_eq!(h.held(&global("by-step-1")).await, Some(Held::Completed));
    assert!(send(&migrating, payment("by-step-1")).await.replayed());
    assert_eq!(send(&migrating, payment("by-step-2")).await.status, 201);
    assert_eq!(h.held(&global("by-step-2")).await, None);
    assert!(send(&prepared, payment("by-step-2")).await.replayed());
    send(&prepared, keyed_request_of_another_body("by-step-2"))
        .await
        .assert_problem(409, "key-reused");
    assert_eq!(calls.get(), 2);
    assert_eq!(h.record_count().await, 2);
    // Step 1 alone changes no name: a service without the secret still finds its records.
    assert!(send(&layer(&h, &calls, None), payment("by-step-1")).await.replayed());
}

async fn the_consumer_door_keys_its_names_and_migrates_the_same<H: Harness>(h: H)
where
    H::Store: Admin,
{
    let runs = Calls::default();
    let deliver = |idem: Idempotent<H::Store>, event: &'static str| {
        let runs = runs.clone();
        async move {
            idem.run("billing", event, BODY, move |_| async move {
                Ok::<_, std::io::Error>(runs.next_call())
            })
            .await
            .unwrap()
        }
    };
    let plain = Idempotent::new(h.store());
    let migrating = Idempotent::new(h.store()).keyed_hashes(secret(), KeyedRollout::Migrate);
    let done = Idempotent::new(h.store()).keyed_hashes(secret(), KeyedRollout::Done);

    assert!(matches!(deliver(plain, "evt_1").await, Outcome::Ran(1)));
    let redelivered = deliver(migrating.clone(), "evt_1").await;
    assert!(matches!(redelivered, Outcome::Replayed(1)), "{redelivered:?}");
    let other = migrating
        .run("billing", "evt_1", b"{}", |_| async { Ok::<_, std::io::Error>(0) })
        .await
        .unwrap();
    assert!(matches!(other, Outcome::Mismatch), "{other:?}");
    assert_eq!(runs.get(), 1);

    // A new event: under its keyed name only, with its keyed fingerprint.
    assert!(matches!(deliver(migrating.clone(), "evt_2").await, Outcome::Ran(2)));
    let plain_name = RecordKey::new("idempotency-consumer", b"billing", b"evt_2");
    assert_eq!(h.held(&plain_name).await, None);
    let report =
        done.operator().inspect("billing", "evt_2", false).await.unwrap().expect("keyed record");
    let expected = keyed_name("idempotency-consumer", b"billing", "evt_2");
    assert_eq!(format!("idempotency-consumer:{{{}}}", report.key_hash), expected);
    let plain_fingerprint = Fingerprint::of_payload(BODY.as_bytes());
    assert_eq!(report.record.fingerprint.as_bytes(), &keyed_fingerprint(&plain_fingerprint));
    assert!(matches!(deliver(done.clone(), "evt_2").await, Outcome::Replayed(2)));

    // Without migrating, the event of before runs again: `Done` says none is left.
    assert!(matches!(deliver(done, "evt_1").await, Outcome::Ran(3)));
    assert_eq!(runs.get(), 3);
}

/// Read from Redis itself, by the name computed here: the value under the keyed name holds the
/// keyed fingerprint, and no key in the server carries the plain hash of the key or the plain
/// fingerprint of the body.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_holds_the_keyed_name_and_fingerprint_only() {
    let h = <RedisHarness as Harness>::start().await;
    let calls = Calls::default();
    let keyed = layer(&h, &calls, Some(KeyedRollout::Done));
    assert_eq!(send(&keyed, payment("order-1")).await.status, 201);
    let mut connection = h.server.connection().await;
    let names: Vec<String> =
        ::redis::cmd("KEYS").arg("*").query_async(&mut connection).await.unwrap();
    assert_eq!(names, vec![keyed_name("idempotency", b"", "order-1")]);
    let raw: Vec<u8> =
        ::redis::cmd("GET").arg(&names[0]).query_async(&mut connection).await.unwrap();
    let plain = Fingerprint::new("POST", "/payments", "", BODY.as_bytes());
    // A record: version, state, the fingerprint (32 bytes), the outcome.
    assert_eq!(&raw[2..34], &keyed_fingerprint(&plain));
    assert!(!raw.windows(32).any(|window| window == plain.as_bytes()));
    assert!(!names[0].contains(global("order-1").hash()));
}
