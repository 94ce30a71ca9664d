//! `rediss://`: a private `redis-server` that speaks TLS only, with a certificate authority
//! and a server certificate this test makes with `openssl`. (Built with the `tls-rustls`
//! feature: `cargo test --all-features`.)

use crate::common;

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use axum_idempotency::settings::Waiting;
use axum_idempotency::{
    IdempotencyLayer, RedisStore,
    store::deadpool_redis::redis::{self, AsyncCommands, TlsCertificates},
};
use common::*;

/// A TLS-only redis-server on a free loopback port, stopped by pid when dropped, with its
/// certificate authority.
struct TlsRedis {
    child: Child,
    port: u16,
    dir: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) {
    let status = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap_or_else(|error| {
            panic!("this test needs `openssl` on PATH (apt-get install openssl): {error}")
        });
    assert!(status.success(), "openssl {args:?} failed");
}

impl TlsRedis {
    fn start() -> Self {
        let port = free_port();
        let dir = std::env::temp_dir()
            .join(format!("axum-idempotency-tls-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        openssl(
            &dir,
            &[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                "ca.key",
                "-out",
                "ca.crt",
                "-days",
                "1",
                "-subj",
                "/CN=axum-idempotency test CA",
            ],
        );
        openssl(
            &dir,
            &[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                "server.key",
                "-out",
                "server.csr",
                "-subj",
                "/CN=127.0.0.1",
            ],
        );
        std::fs::write(dir.join("san.ext"), "subjectAltName=IP:127.0.0.1\n").unwrap();
        openssl(
            &dir,
            &[
                "x509",
                "-req",
                "-in",
                "server.csr",
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                "server.crt",
                "-days",
                "1",
                "-extfile",
                "san.ext",
            ],
        );
        let child = Command::new("redis-server")
            .args(["--port", "0", "--tls-port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--tls-cert-file", "server.crt", "--tls-key-file", "server.key"])
            .args(["--tls-ca-cert-file", "ca.crt", "--tls-auth-clients", "no"])
            .args(["--save", "", "--appendonly", "no"])
            .current_dir(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|error| panic!("this test needs `redis-server` on PATH: {error}"));
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "the TLS redis-server did not come up");
            std::thread::sleep(Duration::from_millis(20));
        }
        Self { child, port, dir }
    }

    fn url(&self) -> String {
        format!("rediss://127.0.0.1:{}", self.port)
    }

    /// A client that trusts the test's certificate authority.
    fn client(&self) -> redis::Client {
        let root_cert = Some(std::fs::read(self.dir.join("ca.crt")).unwrap());
        redis::Client::build_with_tls(self.url(), TlsCertificates { client_tls: None, root_cert })
            .expect("a TLS client")
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_and_waiting_work_over_tls_with_the_apps_own_root() {
    let server = TlsRedis::start();
    let calls = Calls::default();
    let store = RedisStore::from_client(server.client()).unwrap();
    let app = app(&calls)
        .layer(IdempotencyLayer::new(store).waiting(Waiting::up_to(Duration::from_secs(3))));
    assert_eq!(send(&app, keyed("POST", "/payments", "k1", "{}")).await.status, 201);
    assert!(send(&app, keyed("POST", "/payments", "k1", "{}")).await.replayed());
    // The record is in the TLS server.
    let mut look = server.client().get_multiplexed_async_connection().await.unwrap();
    let record: Vec<u8> = look.get(global("k1").as_str()).await.unwrap();
    assert_eq!(&record[..2], b"1C");
    // The subscriber speaks TLS too: a waiter is woken by the settle, not its deadline.
    let original = send_in_background(&app, delayed("/slow", "k2", 500, "{}"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    let waiter = send(&app, delayed("/slow", "k2", 500, "{}")).await;
    assert!(waiter.replayed(), "{waiter:?}");
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    assert_eq!(original.await.unwrap().status, 201);
    assert_eq!(calls.get(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_certificate_or_plain_text_is_503_and_nothing_runs() {
    let server = TlsRedis::start();
    let calls = Calls::default();
    // The system's roots do not know the test's authority: the handshake is refused.
    let untrusted =
        RedisStore::from_url(&server.url()).unwrap().command_timeout(Duration::from_millis(500));
    // Plain text to a TLS-only port.
    let plain = RedisStore::from_url(&format!("redis://127.0.0.1:{}", server.port))
        .unwrap()
        .command_timeout(Duration::from_millis(500));
    for store in [untrusted, plain] {
        let app = app(&calls).layer(IdempotencyLayer::new(store));
        send(&app, keyed("POST", "/payments", "k1", "{}"))
            .await
            .assert_problem(503, "store-unavailable");
    }
    assert_eq!(calls.get(), 0);
}
