//! The clients: HTTP clients that create payments and retry with the same key as Stripe's SDKs
//! do (on a timeout, a dropped connection, a 5xx, a 202 or a 409), and a broker that delivers
//! events to the workers at least once (again on a timeout, an error or "in progress"). Now and
//! then a request is doubled at once (a double click, a redelivery racing the first), or sent
//! again after its answer (a late retry). Every attempt and its answer goes into the history.

use std::{
    sync::{
        Arc, Mutex, OnceLock,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use axum::body::Body;
use http_body_util::BodyExt as _;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use serde::{Deserialize, Serialize};

use crate::service::{Payment, now_ms};

/// How long a client waits for one answer before it gives up on it and retries.
pub(crate) const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(3);
/// Out of 256: how often an attempt is doubled at once. A quarter: the negative control finds
/// a missing fence where a double click meets a claim whose answer was lost, and at one in
/// thirteen it missed it in one 60-second run of two.
const DOUBLE_CLICK: u8 = 64;

/// How long a client keeps retrying one key, at least: a key whose budget ran out while the
/// faults went on is retried until the faults have been healed for [`AFTER_HEAL`]. The
/// promise checked is liveness once the system is whole again; while a nemesis breaks it
/// without pause, a key unlucky enough to have every attempt fall in a fault gets no answer,
/// and no store could give it one.
pub(crate) const BUDGET: Duration = Duration::from_secs(60);

/// How long after the faults heal a key still unanswered is retried: the slowest recovery the
/// run allows (a lease and a recovery window lapsing, a pool reconnecting), and then some.
pub(crate) const AFTER_HEAL: Duration = Duration::from_secs(20);

/// Whether `status` is a final answer: a 2xx other than 202, which both doors give while the
/// original still runs (the client retries it, as it does a 409 or a 5xx).
pub(crate) fn is_answer(status: u16) -> bool {
    (200..300).contains(&status) && status != 202
}

/// One attempt and what came of it.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub(crate) struct Attempt {
    pub(crate) door: String,
    pub(crate) key: String,
    pub(crate) attempt: u32,
    pub(crate) target: String,
    pub(crate) start_ms: i64,
    pub(crate) end_ms: i64,
    /// The status, or none when no answer came (timeout, refused, reset).
    pub(crate) status: Option<u16>,
    pub(crate) error: Option<String>,
    pub(crate) replayed: bool,
    /// The answer's body, for 2xx answers: the receipt.
    pub(crate) body: Option<String>,
}

/// How one key ended for its client.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub(crate) struct KeyEnd {
    pub(crate) door: String,
    pub(crate) key: String,
    pub(crate) attempts: u32,
    /// A 2xx came (the client stops at the first).
    pub(crate) answered: bool,
    /// The client stopped on an answer it must not retry (4xx other than 409, a 500).
    pub(crate) refused: Option<u16>,
}

#[derive(Default)]
pub(crate) struct History {
    pub(crate) attempts: Mutex<Vec<Attempt>>,
    pub(crate) ends: Mutex<Vec<KeyEnd>>,
    /// When the last fault healed: a key's budget does not run out before [`AFTER_HEAL`] past it.
    pub(crate) healed: OnceLock<Instant>,
}

/// Where a door's requests go.
#[derive(Clone)]
pub(crate) struct Targets {
    pub(crate) door: &'static str,
    pub(crate) path: &'static str,
    pub(crate) ports: Vec<u16>,
}

/// Runs one client: a new key each time, until `stop`; then finishes the key it holds.
pub(crate) async fn client(
    id: usize,
    targets: Targets,
    history: Arc<History>,
    stop: Arc<AtomicBool>,
) {
    let http = Client::builder(TokioExecutor::new()).build_http::<Body>();
    let mut n = 0;
    while !stop.load(Ordering::SeqCst) {
        n += 1;
        let key = format!("{}-{id}-{n}", targets.door);
        let payment = Payment { key: key.clone(), amount: 100 + i64::from(rand::random::<u16>()) };
        let body = serde_json::to_vec(&payment).expect("a payment serializes");
        one_key(&http, &targets, &key, &body, &history).await;
    }
}

/// Sends `body` under `key` until a 2xx, a final refusal, or the budget runs out (never before
/// the faults have been healed for [`AFTER_HEAL`]).
async fn one_key(
    http: &Client<hyper_util::client::legacy::connect::HttpConnector, Body>,
    targets: &Targets,
    key: &str,
    body: &[u8],
    history: &Arc<History>,
) {
    let started = Instant::now();
    let mut attempt = 0;
    let mut backoff = Duration::from_millis(100);
    let end = loop {
        attempt += 1;
        // A double click, or a redelivery racing the first: the same request, at once, to
        // another target.
        if rand::random::<u8>() < DOUBLE_CLICK {
            let (http, targets, key, body, history) =
                (http.clone(), targets.clone(), key.to_owned(), body.to_vec(), history.clone());
            tokio::spawn(async move {
                let done = send(&http, &targets, &key, &body, 0).await;
                history.attempts.lock().unwrap().push(done);
            });
        }
        let done = send(http, targets, key, body, attempt).await;
        let status = done.status;
        history.attempts.lock().unwrap().push(done);
        match status {
            Some(status) if is_answer(status) => break (true, None),
            Some(202 | 409 | 500..=599) | None => {}
            Some(other) => break (false, Some(other)),
        }
        let healed = history.healed.get().is_some_and(|at| at.elapsed() > AFTER_HEAL);
        if started.elapsed() > BUDGET && healed {
            break (false, None);
        }
        let jitter = Duration::from_millis(u64::from(rand::random::<u8>()));
        tokio::time::sleep(backoff + jitter).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    };
    let (answered, refused) = end;
    // Now and then the same request comes again after its answer (an app restarted before it
    // saw the answer, a job retried): it must be a replay of that answer, byte for byte.
    if answered && rand::random::<u8>() < 26 {
        tokio::time::sleep(Duration::from_millis(u64::from(rand::random::<u16>() % 2000))).await;
        let late = Instant::now();
        while late.elapsed() < BUDGET {
            attempt += 1;
            let done = send(http, targets, key, body, attempt).await;
            let status = done.status;
            history.attempts.lock().unwrap().push(done);
            if status.is_some_and(is_answer)
                || status.is_some_and(|s| s < 500 && !matches!(s, 202 | 409))
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    history.ends.lock().unwrap().push(KeyEnd {
        door: targets.door.to_owned(),
        key: key.to_owned(),
        attempts: attempt,
        answered,
        refused,
    });
}

async fn send(
    http: &Client<hyper_util::client::legacy::connect::HttpConnector, Body>,
    targets: &Targets,
    key: &str,
    body: &[u8],
    attempt: u32,
) -> Attempt {
    let port = targets.ports[usize::from(rand::random::<u16>()) % targets.ports.len()];
    let request = http::Request::post(format!("http://127.0.0.1:{port}{}", targets.path))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(body.to_vec()))
        .expect("a request");
    let start_ms = now_ms();
    let answer = tokio::time::timeout(ATTEMPT_TIMEOUT, async {
        let response = http.request(request).await.map_err(|e| format!("{e:?}"))?;
        let status = response.status().as_u16();
        let replayed = response.headers().contains_key("idempotency-replayed");
        let body = response.into_body().collect().await.map_err(|e| format!("{e:?}"))?;
        Ok::<_, String>((status, replayed, body.to_bytes()))
    })
    .await;
    let mut done = Attempt {
        door: targets.door.to_owned(),
        key: key.to_owned(),
        attempt,
        target: port.to_string(),
        start_ms,
        end_ms: now_ms(),
        status: None,
        error: None,
        replayed: false,
        body: None,
    };
    match answer {
        Ok(Ok((status, replayed, body))) => {
            done.status = Some(status);
            done.replayed = replayed;
            if is_answer(status) {
                done.body = Some(String::from_utf8_lossy(&body).into_owned());
            }
        }
        Ok(Err(error)) => done.error = Some(short(&error)),
        Err(_) => done.error = Some("timeout".to_owned()),
    }
    done
}

/// The first words of a client error: refused, reset, closed.
fn short(error: &str) -> String {
    error.chars().take(120).collect()
}
