//! What only Redis can show: the record layout, several app instances on one Redis, script
//! reloading, and an unreachable or foreign Redis.

use crate::common;

use std::time::Duration;

use axum::{Router, body::Body, http::Request};
use axum_idempotency::{
    IdempotencyLayer, RedisStore,
    store::deadpool_redis::redis::{self, AsyncCommands},
};
use common::*;

fn redis_app(server: &RedisServer, calls: &Calls) -> Router {
    app(calls).layer(IdempotencyLayer::new(RedisStore::new(server.pool())))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_are_compact_strings_that_never_hold_the_raw_key() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let app = app(&calls).layer(
        IdempotencyLayer::new(RedisStore::new(server.pool()))
            .lease(Duration::from_secs(7))
            .retention(Duration::from_secs(60)),
    );
    let mut redis = server.connection().await;
    let key = global("order-secret-42");

    let running = send_in_background(&app, delayed("/slow", "order-secret-42", 300, "{}"));
    eventually("the claim is written", async || {
        redis.clone().exists::<_, bool>(key.as_str()).await.unwrap()
    })
    .await;
    // In progress: version, state, fingerprint, owner token, lease deadline (13 decimal
    // digits of milliseconds since the Unix epoch, by the server's clock).
    let claimed: Vec<u8> = redis.get(key.as_str()).await.unwrap();
    assert_eq!(claimed.len(), 1 + 1 + 32 + 16 + 13);
    assert_eq!(&claimed[..2], b"1P");
    let deadline: u64 = std::str::from_utf8(&claimed[50..]).unwrap().parse().unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    let deadline_in = deadline - now.as_millis() as u64;
    assert!((6_000..=7_000).contains(&deadline_in), "lease deadline in {deadline_in} ms");
    // Kept past its lease for the recovery window (the retention, 60 s), so that a claim after
    // a lapse is a takeover.
    let lease_left: i64 = redis.pttl(key.as_str()).await.unwrap();
    assert!((66_000..=67_000).contains(&lease_left), "lease PTTL {lease_left}");

    let first = running.await.unwrap();
    assert_eq!(first.status, 201);
    // Completed: version, state, the same fingerprint, then the encoded response.
    let completed: Vec<u8> = redis.get(key.as_str()).await.unwrap();
    assert_eq!(&completed[..2], b"1C");
    assert_eq!(completed[2..34], claimed[2..34]);
    let response = &completed[34..];
    // Format 2: the completion time (ms since the Unix epoch), then the status.
    assert_eq!(response[0], 2, "response format");
    let stored_at = u64::from_be_bytes(response[1..9].try_into().unwrap());
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    assert!(now.as_millis() as u64 - stored_at < 5_000, "stored at {stored_at}");
    assert_eq!(u16::from_be_bytes([response[9], response[10]]), 201);
    assert!(response.ends_with(first.body.as_bytes()));
    let stored = String::from_utf8_lossy(response);
    assert!(stored.contains("x-payment") && !stored.contains("set-cookie"), "{stored}");
    let retention_left: i64 = redis.pttl(key.as_str()).await.unwrap();
    assert!((55_000..=60_000).contains(&retention_left), "retention PTTL {retention_left}");

    // The record, and the fleet's registry beside it (a sorted set of what instances serve),
    // neither holding the raw key.
    let mut keys: Vec<String> = redis.keys("*").await.unwrap();
    keys.sort();
    let registry = keys.remove(0);
    assert!(registry.starts_with("idempotency-fleet:{"), "{registry}");
    assert_eq!(keys, [key.as_str()]);
    assert!(keys[0].starts_with("idempotency:{") && !keys[0].contains("secret"));
    // By the time each lasts until: starting (an announcement), running (three), its records.
    let entries: Vec<String> = redis.zrange(&registry, 0, -1).await.unwrap();
    assert_eq!(entries, ["starting:names=plain", "running:names=plain", "wrote:names=plain"]);
    assert_eq!(calls.get(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_app_instances_on_one_redis_run_the_handler_once() {
    let server = RedisServer::start();
    let calls = Calls::default();
    // Two separately built layers and pools: two instances of the service.
    let instances = [redis_app(&server, &calls), redis_app(&server, &calls)];
    fifty_duplicates_at_once(&instances).await;
    assert_eq!(calls.get(), 1);
    assert_eq!(server.held(&global("k1")).await, Some(Held::Completed));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripts_are_reloaded_after_script_flush() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let app = redis_app(&server, &calls);
    assert_eq!(send(&app, keyed("POST", "/payments", "k1", "{}")).await.status, 201);
    let mut redis = server.connection().await;
    let () = redis::cmd("SCRIPT").arg("FLUSH").query_async(&mut redis).await.unwrap();
    assert!(send(&app, keyed("POST", "/payments", "k1", "{}")).await.replayed());
    assert_eq!(send(&app, keyed("POST", "/payments", "k2", "{}")).await.status, 201);
    let () = redis::cmd("SCRIPT").arg("FLUSH").query_async(&mut redis).await.unwrap();
    assert!(send(&app, keyed("POST", "/payments", "k2", "{}")).await.replayed());
    assert_eq!(calls.get(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_redis_is_503_and_the_handler_does_not_run() {
    let calls = Calls::default();
    let store = RedisStore::from_url(&format!("redis://127.0.0.1:{}", free_port())).unwrap();
    let app = app(&calls).layer(IdempotencyLayer::new(store));
    let seen = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    seen.assert_problem(503, "store-unavailable");
    assert_eq!(seen.header("retry-after"), Some("1"));
    // Requests without a key never touch the store.
    let plain = send(&app, Request::post("/payments").body(Body::from("{}")).unwrap()).await;
    assert_eq!(plain.status, 201);
    assert_eq!(calls.get(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_runs_the_handler_when_redis_is_unreachable() {
    let calls = Calls::default();
    let store = RedisStore::from_url(&format!("redis://127.0.0.1:{}", free_port())).unwrap();
    let app = app(&calls).layer(IdempotencyLayer::new(store).fail_open(true));
    for call in 1..=2 {
        let seen = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
        assert_eq!(seen.status, 201);
        assert!(!seen.replayed());
        assert_eq!(seen.header("x-payment"), Some(format!("pay_{call}").as_str()));
    }
    assert_eq!(calls.get(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_succeed_again_after_redis_restarts() {
    let mut server = RedisServer::start();
    let calls = Calls::default();
    let app = redis_app(&server, &calls);
    assert_eq!(send(&app, keyed("POST", "/payments", "k1", "{}")).await.status, 201);
    server.restart();
    // The shared connection died with the server; at most one request sees that.
    let mut statuses = Vec::new();
    for i in 0..3 {
        statuses
            .push(send(&app, keyed("POST", "/payments", &format!("after-{i}"), "{}")).await.status);
    }
    assert!(statuses[1..].iter().all(|s| *s == 201), "statuses after restart: {statuses:?}");
    assert!(matches!(statuses[0].as_u16(), 201 | 503), "statuses after restart: {statuses:?}");
}

/// A store from a URL shares one of its pool's connections: one that Redis closed while it
/// idled (`CLIENT KILL`, a restart, Redis's `timeout`) is replaced before anything is sent on
/// it, so no request fails for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_redis_closed_while_idle_is_replaced_before_a_request_fails() {
    let mut server = RedisServer::start();
    let calls = Calls::default();
    let app = app(&calls).layer(IdempotencyLayer::new(server.store()));
    assert_eq!(send(&app, keyed("POST", "/payments", "k0", "{}")).await.status, 201);
    let mut redis = server.connection().await;
    let killed: u64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("normal")
        .arg("SKIPME")
        .arg("yes")
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(killed, 1, "the store's one connection");
    // The close reaches the store's connection over loopback well within this.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let seen = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    assert_eq!(seen.status, 201, "after CLIENT KILL: {seen:?}");
    server.restart();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let seen = send(&app, keyed("POST", "/payments", "k2", "{}")).await;
    assert_eq!(seen.status, 201, "after a restart: {seen:?}");
    assert_eq!(calls.get(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_value_under_the_key_is_500_and_left_alone() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let app = redis_app(&server, &calls);
    let mut redis = server.connection().await;

    let foreign: [(&str, &[u8]); 4] = [
        ("string", b"not ours"),
        ("version", b"9C0123456789abcdef0123456789abcdef"),
        ("truncated", b"1C0123"),
        ("state", b"1X0123456789abcdef0123456789abcdef"),
    ];
    for (key, value) in foreign {
        let () = redis.set(global(key).as_str(), value).await.unwrap();
    }
    let () = redis.hset(global("hash").as_str(), "v", "1").await.unwrap();
    for key in ["string", "version", "truncated", "state", "hash"] {
        let seen = send(&app, keyed("POST", "/payments", key, "{}")).await;
        seen.assert_problem(500, "corrupt-record");
    }
    assert_eq!(calls.get(), 0);
    for (key, value) in foreign {
        let kept: Vec<u8> = redis.get(global(key).as_str()).await.unwrap();
        assert_eq!(kept, value, "{key} was changed");
    }
    let kept: String = redis.hget(global("hash").as_str(), "v").await.unwrap();
    assert_eq!(kept, "1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_stored_response_is_500_not_a_rerun() {
    let server = RedisServer::start();
    let calls = Calls::default();
    let app = redis_app(&server, &calls);
    assert_eq!(send(&app, keyed("POST", "/payments", "k1", "{}")).await.status, 201);
    let mut redis = server.connection().await;
    let key = global("k1");
    let record: Vec<u8> = redis.get(key.as_str()).await.unwrap();
    // Cut inside the response's first header.
    let () = redis.set(key.as_str(), &record[..34 + 7]).await.unwrap();
    send(&app, keyed("POST", "/payments", "k1", "{}")).await.assert_problem(500, "corrupt-record");
    assert_eq!(calls.get(), 1);
}

/// The operations of a `RedisStore::from_url` share one connection, and the commands of those
/// that run together go out as one batch (`src/store/redis/batch.rs`, a redis-rs pipeline):
/// under a burst of concurrent operations each still gets its own answer, and after `SCRIPT
/// FLUSH` each command of a batch that met `NOSCRIPT` loads its script and is sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_operations_each_get_their_own_answer() {
    use axum_idempotency::{
        Fingerprint,
        store::{Claim, Lease, OwnerToken, RecordKey, Store},
    };
    let server = RedisServer::start();
    let store = server.store();
    let lease = Lease::new(Duration::from_secs(30));
    let key =
        |round: usize, n: usize| RecordKey::new("batch", b"", format!("{round}-{n}").as_bytes());
    let fingerprint = |n: usize| Fingerprint::of_payload(format!("payload {n}").as_bytes());
    // Keys 0..30 completed, each with a response of its own; keys 30..60 absent.
    for n in 0..30 {
        let owner = OwnerToken::random();
        let claim = store.claim(&key(0, n), &fingerprint(n), &owner, lease).await.unwrap();
        assert!(matches!(claim, Claim::Claimed), "{claim:?}");
        let response = bytes::Bytes::from(format!("response {n}"));
        let retention = Duration::from_secs(60);
        store.complete(&key(0, n), &owner, &fingerprint(n), response, retention).await.unwrap();
    }
    let mut redis = server.connection().await;
    for round in 0..2 {
        if round == 1 {
            let () = redis::cmd("SCRIPT").arg("FLUSH").query_async(&mut redis).await.unwrap();
        }
        // Three claims of each key at once, every one its own task.
        let claims = (0..60).flat_map(|n| [n; 3]).map(|n| {
            let store = store.clone();
            let key = if n < 30 { key(0, n) } else { key(round, n) };
            tokio::spawn(async move {
                (n, store.claim(&key, &fingerprint(n), &OwnerToken::random(), lease).await)
            })
        });
        let mut claimed = [0; 60];
        for claim in futures_util::future::join_all(claims).await {
            let (n, claim) = claim.unwrap();
            match claim.unwrap() {
                Claim::Replay { response, .. } if n < 30 => {
                    assert_eq!(response, format!("response {n}"), "key {n} got another's record");
                }
                Claim::Claimed if n >= 30 => claimed[n] += 1,
                Claim::InProgress { .. } if n >= 30 => {}
                other => panic!("round {round}, key {n}: {other:?}"),
            }
        }
        assert_eq!(claimed[30..], [1; 30], "round {round}: one claim of each absent key wins");
    }
}

#[test]
fn each_runtime_keeps_its_connection_however_often_runtimes_take_turns() {
    // Two runtimes, both alive, take turns on one store: each gets a connection once, and no
    // turn drops the other's. The pool checks a connection it lends again with a `PING`: the
    // second runtime's first turn, once (the first runtime's connection had just been made);
    // one connection in all. A store that dropped the other runtime's connection on each turn
    // would check one out, or connect, on every turn after.
    for built in ["from_url", "app-pool"] {
        let server = RedisServer::start();
        let store = match built {
            "from_url" => server.store(),
            _ => RedisStore::new(server.pool()),
        };
        let calls = Calls::default();
        let app = app(&calls).layer(IdempotencyLayer::new(store));
        let runtime = || tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
        let (a, b) = (runtime(), runtime());
        let before = a.block_on(connections_received(&server));
        for turn in 0..3 {
            for (name, runtime) in [("a", &a), ("b", &b)] {
                let key = format!("{name}{turn}");
                let seen = runtime.block_on(send(&app, keyed("POST", "/payments", &key, "{}")));
                assert_eq!(seen.status, 201, "{built}, {key}: {seen:?}");
            }
        }
        // Less the second look's own.
        let made = a.block_on(connections_received(&server)) - before - 1;
        assert_eq!(made, 1, "{built}");
        let commands = a.block_on(command_calls(&server));
        assert_eq!(commands.get("ping"), Some(&1), "{built}: {commands:?}");
        assert_eq!(calls.get(), 6, "{built}");
    }
}

/// A record larger than the socket takes at once goes out over several writes of the shared
/// connection, and the commands other tasks send meanwhile, queued behind it, each get their
/// own reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_larger_than_the_socket_takes_leaves_each_reply_to_its_own_command() {
    use axum_idempotency::{
        Fingerprint,
        store::{Claim, Lease, OwnerToken, RecordKey, Store},
    };
    let server = RedisServer::start();
    let store = server.store().command_timeout(Duration::from_secs(10));
    let lease = Lease::new(Duration::from_secs(30));
    let key = |n: usize| RecordKey::new("large", b"", format!("{n}").as_bytes());
    let fingerprint = |n: usize| Fingerprint::of_payload(format!("payload {n}").as_bytes());
    let owner = OwnerToken::random();
    let claim = store.claim(&key(0), &fingerprint(0), &owner, lease).await.unwrap();
    assert!(matches!(claim, Claim::Claimed), "{claim:?}");
    let large = bytes::Bytes::from(
        (0..8 << 20).map(|n: u32| n.to_le_bytes()[0] ^ 0x5a).collect::<Vec<u8>>(),
    );
    let completing = {
        let (store, large, owner) = (store.clone(), large.clone(), owner.clone());
        let retention = Duration::from_secs(60);
        tokio::spawn(async move {
            store.complete(&key(0), &owner, &fingerprint(0), large, retention).await
        })
    };
    let claims = (1..=50).map(|n| {
        let store = store.clone();
        tokio::spawn(async move {
            (n, store.claim(&key(n), &fingerprint(n), &OwnerToken::random(), lease).await)
        })
    });
    for claim in futures_util::future::join_all(claims).await {
        let (n, claim) = claim.unwrap();
        assert!(matches!(claim, Ok(Claim::Claimed)), "key {n}: {claim:?}");
    }
    completing.await.unwrap().unwrap();
    let replay = store.claim(&key(0), &fingerprint(0), &OwnerToken::random(), lease).await;
    let Ok(Claim::Replay { response, .. }) = replay else { panic!("{replay:?}") };
    assert!(response == large, "the replay is not the record written ({} bytes)", response.len());
    let mut redis = server.connection().await;
    let claimed: Vec<Vec<u8>> = redis.keys("large:*").await.unwrap();
    assert_eq!(claimed.len(), 51);
}

/// A store from a URL authenticates its connections and selects the URL's database, as
/// redis-rs reads them from the URL: a password, a user of an ACL, a database number. A wrong
/// password is 503, and nothing runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_from_a_url_authenticates_and_selects_the_urls_database() {
    let server = RedisServer::start();
    let mut admin = server.connection().await;
    let () = redis::cmd("ACL")
        .arg(&["SETUSER", "payments", "on", ">s3cret", "~*", "&*", "+@all"][..])
        .query_async(&mut admin)
        .await
        .unwrap();
    // The connection that set it stays signed in.
    let () = redis::cmd("CONFIG")
        .arg(&["SET", "requirepass", "topsecret"][..])
        .query_async(&mut admin)
        .await
        .unwrap();
    let port = server.port;
    let signed_in = [
        (format!("redis://:topsecret@127.0.0.1:{port}/3"), 3),
        (format!("redis://payments:s3cret@127.0.0.1:{port}/5"), 5),
    ];
    for (url, db) in signed_in {
        let calls = Calls::default();
        let app = app(&calls).layer(IdempotencyLayer::new(RedisStore::from_url(&url).unwrap()));
        let key = format!("k{db}");
        let seen = send(&app, keyed("POST", "/payments", &key, "{}")).await;
        assert_eq!(seen.status, 201, "{url}: {seen:?}");
        assert!(send(&app, keyed("POST", "/payments", &key, "{}")).await.replayed(), "{url}");
        assert_eq!(calls.get(), 1, "{url}");
        for (looked_in, found) in [(db, true), (0, false)] {
            let () = redis::cmd("SELECT").arg(looked_in).query_async(&mut admin).await.unwrap();
            let exists: bool = admin.exists(global(&key).as_str()).await.unwrap();
            assert_eq!(exists, found, "{url}: the record in database {looked_in}");
        }
    }
    let calls = Calls::default();
    let wrong = format!("redis://:wrong@127.0.0.1:{port}/3");
    let app = app(&calls).layer(IdempotencyLayer::new(RedisStore::from_url(&wrong).unwrap()));
    send(&app, keyed("POST", "/payments", "k", "{}"))
        .await
        .assert_problem(503, "store-unavailable");
    assert_eq!(calls.get(), 0);
}
