//! Outcomes encrypted at rest (`encrypt_at_rest`), on every store and both doors: what the
//! store holds has no plaintext; a record sealed with an old key replays while the keyring
//! lists it and is refused (500, never rerun) once it does not; a changed byte is refused the
//! same way. The stores' raw bytes are read as each backend holds them: Redis's value,
//! PostgreSQL's row (the record table, a transaction's commit, `DurableOutcomes`), and the
//! memory store's own copy.
#![cfg(feature = "encryption")]

use crate::common;

use std::time::Duration;

use axum::{Router, body::Bytes};
use axum_idempotency::{
    Fingerprint, IdempotencyLayer, Idempotent, MemoryStore,
    consumer::{Error, Outcome},
    encryption::Keyring,
    store::{Admin, Claim, Fenced, Lease, OwnerToken, RecordKey, Store, StoreError, Subscription},
};
use common::*;

every_store!(
    an_encrypted_response_replays_and_the_store_holds_no_plaintext,
    an_encrypted_result_replays_and_the_store_holds_no_plaintext,
    an_old_key_replays_while_listed_and_is_refused_once_dropped,
    a_changed_byte_is_refused_and_never_rerun,
    plaintext_is_refused_unless_the_keyring_reads_it,
    ; redis stores:
    a_byte_flipped_in_redis_is_refused,
    a_fingerprint_rewritten_in_redis_is_refused,
);

const CARD: &str = "4242424242424242";

fn keys(id: &str, byte: u8) -> Keyring {
    Keyring::new(id, [byte; 32]).unwrap()
}

/// The bytes a store holds for a record, as its backend keeps them.
trait AtRest: Harness {
    async fn stored_bytes(&self, key: &RecordKey) -> Vec<u8>;
}

impl AtRest for MemoryHarness {
    async fn stored_bytes(&self, key: &RecordKey) -> Vec<u8> {
        let record = self.store().inspect(key, true).await.unwrap().expect("a record");
        record.outcome.expect("a completed record").to_vec()
    }
}

#[cfg(feature = "redis")]
impl AtRest for RedisHarness {
    async fn stored_bytes(&self, key: &RecordKey) -> Vec<u8> {
        self.raw(key).await.expect("a value in Redis")
    }
}

#[cfg(feature = "redis")]
impl AtRest for CachedHarness {
    async fn stored_bytes(&self, key: &RecordKey) -> Vec<u8> {
        let mut connection = self.server.connection().await;
        ::redis::cmd("GET").arg(key.as_str()).query_async(&mut connection).await.unwrap()
    }
}

#[cfg(feature = "cluster")]
impl AtRest for ClusterHarness {
    async fn stored_bytes(&self, key: &RecordKey) -> Vec<u8> {
        self.raw(key).await.expect("a value in the cluster")
    }
}

#[cfg(feature = "postgres")]
impl AtRest for PostgresHarness {
    async fn stored_bytes(&self, key: &RecordKey) -> Vec<u8> {
        let sql = "SELECT response FROM idempotency_records WHERE key = $1";
        let client = self.database.client().await;
        client.query_one(sql, &[&key.as_str()]).await.unwrap().get(0)
    }
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack.windows(needle.len()).any(|window| window == needle.as_bytes())
}

fn card_request(key: &str) -> axum::http::Request<axum::body::Body> {
    let body: &'static str = Box::leak(format!(r#"{{"card":"{CARD}"}}"#).into_boxed_str());
    keyed("POST", "/payments", key, body)
}

async fn an_encrypted_response_replays_and_the_store_holds_no_plaintext<H: AtRest>(h: H)
where
    H::Store: Admin,
{
    let calls = Calls::default();
    let app: Router =
        app(&calls).layer(IdempotencyLayer::new(h.store()).encrypt_at_rest(keys("k1", 1)));
    let first = send(&app, card_request("k1")).await;
    assert_eq!(first.status, 201);
    assert!(first.body.contains(CARD), "{first:?}");
    let retry = send(&app, card_request("k1")).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!((retry.status, &retry.body), (first.status, &first.body));
    assert_eq!(retry.header("x-payment"), Some("pay_1"));
    assert_eq!(retry.header("content-type"), Some("application/json"));
    // The fingerprint is compared as it is stored, without decrypting: another payload is 409.
    send(&app, keyed("POST", "/payments", "k1", "{}")).await.assert_problem(409, "key-reused");
    assert_eq!(calls.get(), 1);

    let stored = h.stored_bytes(&global("k1")).await;
    for plaintext in [CARD, "pay_1", "application/json", "x-payment", "call"] {
        assert!(!contains(&stored, plaintext), "{plaintext:?} at rest: {stored:?}");
    }
    assert!(contains(&stored, "E\u{2}k1"), "sealed under the key id k1: {stored:?}");
}

async fn an_encrypted_result_replays_and_the_store_holds_no_plaintext<H: AtRest>(h: H)
where
    H::Store: Admin,
{
    let idem = Idempotent::new(h.store()).encrypt_at_rest(keys("k1", 1));
    let runs = Calls::default();
    let deliver = || {
        let runs = runs.clone();
        idem.run("billing", "evt_1", b"{}", move |_| async move {
            runs.next_call();
            Ok::<_, std::io::Error>(serde_json::json!({"card": CARD}))
        })
    };
    assert!(matches!(deliver().await.unwrap(), Outcome::Ran(_)));
    let replayed = deliver().await.unwrap();
    assert!(matches!(&replayed, Outcome::Replayed(v) if v["card"] == CARD), "{replayed:?}");
    assert_eq!(runs.get(), 1);
    let stored =
        h.stored_bytes(&RecordKey::new("idempotency-consumer", b"billing", b"evt_1")).await;
    assert!(!contains(&stored, CARD) && !contains(&stored, "card"), "{stored:?}");
    // The door's operator call decrypts.
    let report = idem.operator().inspect("billing", "evt_1", true).await.unwrap().unwrap();
    assert_eq!(report.outcome, Some(serde_json::json!({"card": CARD})));
}

async fn an_old_key_replays_while_listed_and_is_refused_once_dropped<H: AtRest>(h: H)
where
    H::Store: Admin,
{
    let calls = Calls::default();
    let layered = |keyring: Keyring| -> Router {
        app(&calls).layer(IdempotencyLayer::new(h.store()).encrypt_at_rest(keyring))
    };
    let old = layered(keys("2026-05", 1));
    assert_eq!(send(&old, card_request("sealed-old")).await.status, 201);

    let rotated = layered(keys("2026-11", 2).decrypt_with("2026-05", [1; 32]).unwrap());
    let replay = send(&rotated, card_request("sealed-old")).await;
    assert!(replay.replayed() && replay.body.contains(CARD), "{replay:?}");
    assert_eq!(send(&rotated, card_request("sealed-new")).await.status, 201);
    assert!(contains(&h.stored_bytes(&global("sealed-new")).await, "E\u{7}2026-11"));
    assert_eq!(calls.get(), 2);

    let dropped = layered(keys("2026-11", 2));
    send(&dropped, card_request("sealed-old")).await.assert_problem(500, "corrupt-record");
    assert!(send(&dropped, card_request("sealed-new")).await.replayed());
    // Without any keyring, an encrypted record is refused too: never run again.
    let clear: Router = app(&calls).layer(IdempotencyLayer::new(h.store()));
    send(&clear, card_request("sealed-new")).await.assert_problem(500, "corrupt-record");
    assert_eq!(calls.get(), 2, "no refused record ran again");
}

/// A store that flips one byte of every outcome it is given to keep, `at` bytes from its end:
/// what the store then holds is a forged record.
#[derive(Clone)]
struct Flipping<St> {
    inner: St,
    at: usize,
}

impl<St: Store> Store for Flipping<St> {
    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Claim, StoreError> {
        self.inner.claim(key, fingerprint, owner, lease).await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        fingerprint: &Fingerprint,
        response: Bytes,
        retention: Duration,
    ) -> Result<Fenced, StoreError> {
        let mut forged = response.to_vec();
        let at = forged.len() - 1 - self.at;
        forged[at] ^= 0x01;
        self.inner.complete(key, owner, fingerprint, forged.into(), retention).await
    }

    async fn release(&self, key: &RecordKey, owner: &OwnerToken) -> Result<Fenced, StoreError> {
        self.inner.release(key, owner).await
    }

    async fn subscribe(&self, key: &RecordKey) -> Subscription {
        self.inner.subscribe(key).await
    }

    async fn touch(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Fenced, StoreError> {
        self.inner.touch(key, owner, lease).await
    }
}

async fn a_changed_byte_is_refused_and_never_rerun<H: AtRest>(h: H)
where
    H::Store: Admin,
{
    let calls = Calls::default();
    // The tag's last byte, then one of the ciphertext's.
    for (at, key) in [(0, "tag"), (20, "ciphertext")] {
        let flipping = Flipping { inner: h.store(), at };
        let writer: Router =
            app(&calls).layer(IdempotencyLayer::new(flipping).encrypt_at_rest(keys("k1", 1)));
        assert_eq!(send(&writer, card_request(key)).await.status, 201);
        let reader: Router =
            app(&calls).layer(IdempotencyLayer::new(h.store()).encrypt_at_rest(keys("k1", 1)));
        let answer = send(&reader, card_request(key)).await;
        answer.assert_problem(500, "corrupt-record");
        assert!(!answer.body.contains(CARD), "{answer:?}");
        assert!(!contains(&h.stored_bytes(&global(key)).await, CARD));
    }
    assert_eq!(calls.get(), 2, "each ran once; the forged records were never run again");

    // The consumer door: its own error for a record it cannot read (not a store error, which a
    // consumer would redeliver forever), never a rerun.
    let idem = Idempotent::new(Flipping { inner: h.store(), at: 3 }).encrypt_at_rest(keys("k1", 1));
    let run = || {
        idem.run("billing", "evt_1", b"{}", |_| async {
            Ok::<_, std::io::Error>(serde_json::json!({"card": CARD}))
        })
    };
    assert!(matches!(run().await.unwrap(), Outcome::Ran(_)));
    let refused = run().await.unwrap_err();
    assert!(matches!(refused, Error::Corrupt { .. }), "{refused:?}");
    assert!(refused.to_string().contains("failing authentication"), "{refused}");
}

async fn plaintext_is_refused_unless_the_keyring_reads_it<H: AtRest>(h: H)
where
    H::Store: Admin,
{
    let calls = Calls::default();
    let clear: Router = app(&calls).layer(IdempotencyLayer::new(h.store()));
    assert_eq!(send(&clear, card_request("k1")).await.status, 201);
    let strict: Router =
        app(&calls).layer(IdempotencyLayer::new(h.store()).encrypt_at_rest(keys("k1", 1)));
    send(&strict, card_request("k1")).await.assert_problem(500, "corrupt-record");
    let migrating =
        IdempotencyLayer::new(h.store()).encrypt_at_rest(keys("k1", 1).read_plaintext(true));
    let migrating: Router = app(&calls).layer(migrating);
    let replay = send(&migrating, card_request("k1")).await;
    assert!(replay.replayed() && replay.body.contains(CARD), "{replay:?}");
    // What it stores, it stores encrypted.
    assert_eq!(send(&migrating, card_request("k2")).await.status, 201);
    assert!(!contains(&h.stored_bytes(&global("k2")).await, CARD));
    assert_eq!(calls.get(), 2);
}

async fn a_byte_flipped_in_redis_is_refused<H: RawHarness + AtRest>(h: H)
where
    H::Store: Admin,
{
    let calls = Calls::default();
    let app: Router =
        app(&calls).layer(IdempotencyLayer::new(h.store()).encrypt_at_rest(keys("k1", 1)));
    assert_eq!(send(&app, card_request("k1")).await.status, 201);
    let mut raw = h.stored_bytes(&global("k1")).await;
    let middle = raw.len() - 30;
    raw[middle] ^= 0x80;
    h.plant(&global("k1"), RawValue::String(raw)).await;
    send(&app, card_request("k1")).await.assert_problem(500, "corrupt-record");
    assert_eq!(calls.get(), 1);
}

/// Someone who can write to Redis rewrites a record's clear fingerprint to another request's
/// (here, copied from a record of that request): the fingerprint is in the outcome's associated
/// data, so that request gets 500 `corrupt-record`, never the first request's response.
async fn a_fingerprint_rewritten_in_redis_is_refused<H: RawHarness + AtRest>(h: H)
where
    H::Store: Admin,
{
    let calls = Calls::default();
    let app: Router =
        app(&calls).layer(IdempotencyLayer::new(h.store()).encrypt_at_rest(keys("k1", 1)));
    assert_eq!(send(&app, card_request("k1")).await.status, 201);
    assert_eq!(send(&app, keyed("POST", "/payments", "k2", "{}")).await.status, 201);
    // A record: version, state, the fingerprint (32 bytes), the outcome.
    let other = h.stored_bytes(&global("k2")).await;
    let mut raw = h.stored_bytes(&global("k1")).await;
    raw[2..34].copy_from_slice(&other[2..34]);
    h.plant(&global("k1"), RawValue::String(raw)).await;
    let forged = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    forged.assert_problem(500, "corrupt-record");
    assert!(!forged.body.contains(CARD), "{forged:?}");
    assert_eq!(calls.get(), 2);
}

/// The memory store gets no plaintext either: its copy is what `Admin::inspect` reads.
#[tokio::test]
async fn the_memory_store_keeps_the_sealed_bytes_it_was_given() {
    let store = MemoryStore::new();
    let idem = Idempotent::new(store.clone()).encrypt_at_rest(keys("k1", 1));
    idem.run("s", "k", b"{}", |_| async { Ok::<_, std::io::Error>(CARD.to_owned()) })
        .await
        .unwrap();
    let key = RecordKey::new("idempotency-consumer", b"s", b"k");
    let held = store.inspect(&key, true).await.unwrap().unwrap();
    assert!(!contains(&held.outcome.unwrap(), CARD));
}

#[cfg(feature = "postgres")]
mod postgres_raw {
    //! The rows PostgreSQL holds: the record table after a tampered byte, a transaction's
    //! commit (`PostgresStore::transaction`), and `DurableOutcomes` beside Redis.
    use super::*;
    use axum::{extract::State, http::StatusCode, response::IntoResponse, routing::post};
    use axum_idempotency::{
        IdempotencyContext, RedisStore, durable::DurableOutcomes, store::PostgresStore,
    };
    use common::postgres::{TestDatabase, pool_for};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_byte_flipped_in_the_row_is_refused() {
        let h = PostgresHarness::start().await;
        let calls = Calls::default();
        let app: Router =
            app(&calls).layer(IdempotencyLayer::new(h.store()).encrypt_at_rest(keys("k1", 1)));
        assert_eq!(send(&app, card_request("k1")).await.status, 201);
        let flip = "UPDATE idempotency_records \
                    SET response = set_byte(response, 40, get_byte(response, 40) # 1) WHERE key = $1";
        let client = h.database.client().await;
        assert_eq!(client.execute(flip, &[&global("k1").as_str()]).await.unwrap(), 1);
        send(&app, card_request("k1")).await.assert_problem(500, "corrupt-record");
        assert_eq!(calls.get(), 1);
    }

    /// The row's clear fingerprint rewritten to another request's: that request gets 500
    /// `corrupt-record`, never the first request's response.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_fingerprint_rewritten_in_the_row_is_refused() {
        let h = PostgresHarness::start().await;
        let calls = Calls::default();
        let app: Router =
            app(&calls).layer(IdempotencyLayer::new(h.store()).encrypt_at_rest(keys("k1", 1)));
        assert_eq!(send(&app, card_request("k1")).await.status, 201);
        assert_eq!(send(&app, keyed("POST", "/payments", "k2", "{}")).await.status, 201);
        let rewrite = "UPDATE idempotency_records SET fingerprint = \
                       (SELECT fingerprint FROM idempotency_records WHERE key = $2) WHERE key = $1";
        let client = h.database.client().await;
        let keys = [global("k1").as_str().to_owned(), global("k2").as_str().to_owned()];
        assert_eq!(client.execute(rewrite, &[&keys[0], &keys[1]]).await.unwrap(), 1);
        let forged = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
        forged.assert_problem(500, "corrupt-record");
        assert_eq!(calls.get(), 2);
    }

    #[derive(Clone)]
    struct Ledger {
        store: PostgresStore,
        outcomes: DurableOutcomes,
    }

    async fn pay_committed(
        State(app): State<Ledger>,
        context: IdempotencyContext,
    ) -> impl IntoResponse {
        let response = (StatusCode::CREATED, format!("card {CARD}")).into_response();
        let committed = app.store.transaction(&context, |_| {
            Box::pin(async move { Ok::<_, std::convert::Infallible>(response) })
        });
        committed.await.unwrap()
    }

    async fn pay_beside(
        State(app): State<Ledger>,
        context: IdempotencyContext,
    ) -> impl IntoResponse {
        let response = (StatusCode::CREATED, format!("card {CARD}")).into_response();
        let committed = app.outcomes.transaction(&context, |_| {
            Box::pin(async move { Ok::<_, std::convert::Infallible>(response) })
        });
        committed.await.unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_committed_outcome_is_encrypted_in_its_row_and_replays() {
        let d = TestDatabase::create("encryption").await;
        let pool = pool_for(&d);
        let store = PostgresStore::new(pool.clone());
        store.migrate().await.unwrap();
        let outcomes = DurableOutcomes::new(pool.clone());
        outcomes.migrate().await.unwrap();
        let ledger = Ledger { store: store.clone(), outcomes: outcomes.clone() };
        let app = Router::new()
            .route("/pay", post(pay_committed))
            .with_state(ledger.clone())
            .layer(IdempotencyLayer::new(store).encrypt_at_rest(keys("k1", 1)));
        let first = send(&app, keyed("POST", "/pay", "k1", "{}")).await;
        assert_eq!((first.status.as_u16(), first.body.as_str()), (201, "card 4242424242424242"));
        let replay = send(&app, keyed("POST", "/pay", "k1", "{}")).await;
        assert!(replay.replayed() && replay.body.contains(CARD), "{replay:?}");
        let client = d.client().await;
        let sql = "SELECT response FROM idempotency_records WHERE key = $1";
        let row: Vec<u8> = client.query_one(sql, &[&global("k1").as_str()]).await.unwrap().get(0);
        assert!(!contains(&row, CARD) && contains(&row, "E\u{2}k1"), "{row:?}");

        // Beside Redis: the table's row is encrypted, and a record Redis lost is answered
        // from it, decrypted.
        let redis = RedisServer::start();
        let layer = IdempotencyLayer::new(RedisStore::from_url(&redis.url()).unwrap())
            .encrypt_at_rest(keys("k1", 1))
            .recover(outcomes);
        let app = Router::new().route("/pay", post(pay_beside)).with_state(ledger).layer(layer);
        assert_eq!(send(&app, keyed("POST", "/pay", "k2", "{}")).await.status, 201);
        let sql = "SELECT outcome FROM idempotency_outcomes WHERE key = $1";
        let row: Vec<u8> = client.query_one(sql, &[&global("k2").as_str()]).await.unwrap().get(0);
        assert!(!contains(&row, CARD) && contains(&row, "E\u{2}k1"), "{row:?}");
        let () = ::redis::cmd("FLUSHALL").query_async(&mut redis.connection().await).await.unwrap();
        let recovered = send(&app, keyed("POST", "/pay", "k2", "{}")).await;
        assert_eq!((recovered.status.as_u16(), recovered.body.contains(CARD)), (201, true));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_completer_stores_what_it_settles_encrypted() {
        use axum_idempotency::recovery::{Lookup, Recovered};
        let h = PostgresHarness::start().await;
        let store = h.store();
        let fingerprint = Fingerprint::new("POST", "/payments", "", b"{}");
        let lease = Lease::new(Duration::from_millis(50)).recovery_window(Duration::from_secs(60));
        let (key, owner) = (global("k1"), OwnerToken::random());
        let claim = store.claim(&key, &fingerprint, &owner, lease).await;
        assert_eq!(claim.unwrap(), Claim::Claimed);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let resolve = |_: Lookup<axum::http::Request<Bytes>>| async {
            let response = axum::http::Response::builder()
                .status(201)
                .body(Bytes::from(format!("card {CARD}")))
                .unwrap();
            Ok::<_, axum_idempotency::recovery::BoxError>(Recovered::Happened(response))
        };
        let layer = IdempotencyLayer::new(store.clone()).encrypt_at_rest(keys("k1", 1));
        let completer = layer.operator().completer(resolve).lapsed_for(Duration::ZERO);
        assert_eq!(completer.complete_abandoned().await.unwrap().settled, 1);
        let row = h.stored_bytes(&global("k1")).await;
        assert!(!contains(&row, CARD) && contains(&row, "E\u{2}k1"), "{row:?}");
        let calls = Calls::default();
        let app: Router =
            app(&calls).layer(IdempotencyLayer::new(store).encrypt_at_rest(keys("k1", 1)));
        let replay = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
        assert_eq!((replay.replayed(), replay.body.as_str()), (true, "card 4242424242424242"));
        assert_eq!(calls.get(), 0);
    }
}
