//! An example of this crate run as a child process of a test: built for the test binary's
//! features and profile, read line by line from its stdout, killed by pid; and a client of
//! its payments route.

use std::{
    collections::HashMap,
    path::PathBuf,
    process::Stdio,
    sync::{Mutex, OnceLock},
    time::Duration,
};

use axum::body::Body;
use http::Request;
use http_body_util::BodyExt;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};

/// The example `name`, built for this test binary's features and profile. `cargo test`
/// builds examples too, but not with `--test NAME` alone: a stale binary would test old code,
/// so the build is asked for here (a no-op when it is fresh), once per example and binary.
pub fn binary(name: &str) -> PathBuf {
    static BUILT: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    // A build that failed panics below, holding the lock: the next test builds again, and says
    // why, rather than failing on the poisoned lock.
    let mut built =
        BUILT.get_or_init(Mutex::default).lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(path) = built.get(name) {
        return path.clone();
    }
    let features: Vec<&str> = [
        ("cluster", cfg!(feature = "cluster")),
        ("metrics", cfg!(feature = "metrics")),
        ("postgres", cfg!(feature = "postgres")),
        ("tls-rustls", cfg!(feature = "tls-rustls")),
        ("tls-native-tls", cfg!(feature = "tls-native-tls")),
        ("sentinel", cfg!(feature = "sentinel")),
    ]
    .into_iter()
    .filter_map(|(name, on)| on.then_some(name))
    .collect();
    let mut cargo = std::process::Command::new(env!("CARGO"));
    cargo.current_dir(env!("CARGO_MANIFEST_DIR")).args([
        "build",
        "--quiet",
        "--example",
        name,
        "--features",
        &features.join(","),
    ]);
    if !cfg!(debug_assertions) {
        cargo.arg("--release");
    }
    // The variables cargo sets for a test describe this package to it; passed on, they would
    // make cargo see changed build inputs and rebuild dependencies each time.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        let keep = ["CARGO_HOME", "CARGO_TARGET_DIR"].contains(&name.as_ref())
            || name.starts_with("CARGO_BUILD_");
        if (name.starts_with("CARGO_") && !keep) || name == "OUT_DIR" {
            cargo.env_remove(name.as_ref());
        }
    }
    let status = cargo.status().expect("cargo runs");
    assert!(status.success(), "cargo build --example {name} failed: {status}");
    let deps = std::env::current_exe().unwrap();
    let path = deps.parent().unwrap().parent().unwrap().join("examples").join(name);
    built.insert(name.to_owned(), path.clone());
    path
}

/// A running example, its stdout read line by line; killed when dropped.
pub struct Child {
    child: tokio::process::Child,
    lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
}

impl Child {
    /// Starts the example `name` with `args` and `env`.
    pub fn spawn(name: &str, args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut child = tokio::process::Command::new(binary(name))
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|error| panic!("the {name} example does not start: {error}"));
        let stdout = child.stdout.take().unwrap();
        Self { child, lines: BufReader::new(stdout).lines() }
    }

    /// Waits (at most 30 s) for a line of stdout that starts with `prefix`, and returns it.
    pub async fn line_starting(&mut self, prefix: &str) -> String {
        let found = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(line) = self.lines.next_line().await.unwrap() {
                if line.starts_with(prefix) {
                    return line;
                }
            }
            panic!("the process exited before it printed {prefix:?}");
        });
        found.await.unwrap_or_else(|_| panic!("no {prefix:?} within 30 s"))
    }

    /// SIGKILL, and waits for the process to be gone.
    pub async fn sigkill(&mut self) {
        self.child.kill().await.unwrap();
    }

    /// Sends `signal` (`-STOP`, `-CONT`) with kill(1).
    pub fn signal(&self, signal: &str) {
        let pid = self.child.id().unwrap().to_string();
        let status = std::process::Command::new("kill").args([signal, &pid]).status().unwrap();
        assert!(status.success(), "kill {signal} {pid}");
    }
}

/// What a client saw.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub replayed: bool,
    pub body: Value,
}

/// `{"amount":100}` POSTed to `path` of the service on `port`, with `key`; bounded: a
/// handler blocked on a lock it should never have reached fails the test.
pub async fn post(
    port: u16,
    path: &str,
    key: &str,
) -> Result<Answer, hyper_util::client::legacy::Error> {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Body>();
    let request = Request::post(format!("http://127.0.0.1:{port}{path}"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(r#"{"amount":100}"#))
        .unwrap();
    let response = tokio::time::timeout(Duration::from_secs(15), client.request(request))
        .await
        .expect("an answer within 15 s")?;
    let status = response.status().as_u16();
    let replayed = response.headers().get("idempotency-replayed").is_some_and(|v| v == "true");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let body = serde_json::from_slice(&body)
        .unwrap_or(Value::String(String::from_utf8_lossy(&body).into()));
    Ok(Answer { status, replayed, body })
}
