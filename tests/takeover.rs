//! A holder killed with SIGKILL while its handler runs, under the default configuration: the
//! retry on a second process waits (the layer's default wait), takes the dead holder's key over
//! when its lease lapses (the default lease is no longer than the wait), and runs the handler
//! once: never a 202. The takeover is counted (`outcome="taken_over"`) and traced (the span's
//! `outcome`) as one, with no recovery hook. The first process is this test binary run again.

mod common;

use std::{
    io::Write,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use axum::{Router, http::StatusCode, routing::post};
use axum_idempotency::{IdempotencyLayer, RedisStore};
use common::{Calls, RedisServer, keyed, send};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};

/// The service both processes run: the crate's defaults, a handler that takes `hold`.
fn service(url: &str, calls: &Calls, hold: Duration) -> Router {
    let calls = calls.clone();
    let handler = move || async move {
        let call = calls.next_call();
        println!("running");
        let _ = std::io::stdout().flush();
        tokio::time::sleep(hold).await;
        (StatusCode::CREATED, format!("payment {call}"))
    };
    let store = RedisStore::from_url(url).unwrap();
    Router::new().route("/pay", post(handler)).layer(IdempotencyLayer::new(store))
}

/// The holder's side: serves the service, whose handler never ends, until killed.
#[test]
fn holder_process() {
    let Ok(url) = std::env::var("TAKEOVER_REDIS") else { return };
    let port: u16 = std::env::var("TAKEOVER_PORT").unwrap().parse().unwrap();
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let app = service(&url, &Calls::default(), Duration::from_secs(3600));
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await.unwrap();
        axum::serve(listener, app).await.unwrap();
    });
}

/// Where the test's log lines and span closings go.
#[derive(Clone, Default)]
struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holders_retry_runs_once_within_the_wait_counted_as_a_takeover() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install().expect("the only recorder of this test binary");
    let sink = Sink::default();
    let writer = sink.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_max_level(tracing::Level::INFO)
        .finish();
    let _traced = tracing::subscriber::set_default(subscriber);

    let redis = RedisServer::start();
    let port = common::free_port();
    let mut holder = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args(["holder_process", "--exact", "--nocapture", "--test-threads=1"])
        .env("TAKEOVER_REDIS", redis.url())
        .env("TAKEOVER_PORT", port.to_string())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stdout = holder.stdout.take().unwrap();
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
    // The first attempt, on the holder: its answer never comes.
    for _ in 0..600 {
        if tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<axum::body::Body>();
    let request = keyed("POST", &format!("http://127.0.0.1:{port}/pay"), "k1", "{}");
    let first = tokio::spawn(client.request(request));
    let running = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if line.ends_with(" running") || line == "running" {
                return;
            }
        }
        panic!("the holder exited before its handler ran");
    });
    if running.await.is_err() {
        panic!("the holder's handler did not start within 30 s: {:?}", first.await);
    }
    holder.kill().await.unwrap();

    // The client's retry, on this process, under the same defaults.
    let calls = Calls::default();
    let app = service(&redis.url(), &calls, Duration::ZERO);
    let started = Instant::now();
    let retry = send(&app, keyed("POST", "/pay", "k1", "{}")).await;
    assert_eq!(
        (retry.status, retry.body.as_str()),
        (StatusCode::CREATED, "payment 1"),
        "{retry:?}"
    );
    assert!(!retry.replayed());
    assert!(
        started.elapsed() < Duration::from_secs(11),
        "not within the wait: {:?}",
        started.elapsed()
    );
    assert_eq!(calls.get(), 1);
    let again = send(&app, keyed("POST", "/pay", "k1", "{}")).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(calls.get(), 1);

    let claims: Vec<(String, u64)> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter_map(|(key, .., value)| {
            let key = key.key();
            let DebugValue::Counter(count) = value else { return None };
            if key.name() != "idempotency_claims_total" {
                return None;
            }
            let outcome = key.labels().find(|l| l.key() == "outcome")?.value().to_owned();
            Some((outcome, count))
        })
        .filter(|(_, count)| *count > 0)
        .collect();
    assert!(claims.contains(&("taken_over".to_owned(), 1)), "{claims:?}");
    let logs = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
    assert!(
        logs.contains("outcome=\"taken_over\"") || logs.contains("outcome=taken_over"),
        "{logs}"
    );
}
