//! The five behaviours of the layer, over real HTTP, in one table.
//!
//! ```sh
//! cargo run --example demo                                   # in-memory store
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example demo  # Redis
//! ```
//!
//! It serves a payments route behind `IdempotencyLayer` on a loopback port and sends: a first
//! request and its retry, 20 concurrent duplicates, a reused key with another payload, and a
//! malformed key.

use std::{
    collections::BTreeMap,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{Json, Router, body::Body, extract::State, http::StatusCode, routing::post};
use axum_idempotency::{IdempotencyLayer, MemoryStore, RedisStore, store::Store};
use http_body_util::BodyExt;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use serde_json::{Value, json};

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Body>;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    match std::env::var("REDIS_URL") {
        Ok(url) => {
            println!("store: Redis at {url}\n");
            run(RedisStore::from_url(&url)?).await
        }
        Err(_) => {
            println!("store: in memory (set REDIS_URL to use Redis)\n");
            run(MemoryStore::new()).await
        }
    }
}

async fn create_payment(
    State(executions): State<Arc<AtomicUsize>>,
    Json(payment): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let n = executions.fetch_add(1, Ordering::SeqCst) + 1;
    // Long enough for concurrent duplicates to find the first one still running.
    tokio::time::sleep(Duration::from_millis(300)).await;
    (
        StatusCode::CREATED,
        Json(json!({ "payment": format!("pay_{n}"), "amount": payment["amount"] })),
    )
}

async fn run<St: Store>(store: St) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let executions = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route("/payments", post(create_payment))
        .with_state(executions.clone())
        .layer(IdempotencyLayer::new(store));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client = new_client();

    // A fresh key per run, so a demo against a shared Redis starts clean.
    let run_id: u64 =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_nanos() as u64;
    let key = |name: &str| format!("demo-{run_id}-{name}");
    let mut rows = Vec::new();
    let row = |scenario: &str, sent: &str, answer: &Answer, expected: &str| {
        vec![scenario.to_owned(), sent.to_owned(), answer.summary(), expected.to_owned()]
    };

    let first = post_payment(&client, &base, Some(&key("a")), 100).await?;
    rows.push(row("1. first request", "key a, amount 100", &first, "201, handler runs"));
    let retry = post_payment(&client, &base, Some(&key("a")), 100).await?;
    rows.push(row("1. retry", "key a, amount 100", &retry, "201 replayed, same body"));

    let before = executions.load(Ordering::SeqCst);
    let duplicates: Vec<_> = (0..20)
        .map(|_| {
            let (client, base, key) = (client.clone(), base.clone(), key("b"));
            tokio::spawn(async move { post_payment(&client, &base, Some(&key), 250).await })
        })
        .collect();
    let mut tally = BTreeMap::new();
    for duplicate in duplicates {
        let answer = duplicate.await??;
        let label = match (answer.status, answer.replayed) {
            (201, false) => "201 original",
            (201, true) => "201 replayed",
            (202, _) => "202 in progress",
            _ => "other",
        };
        *tally.entry(label).or_insert(0) += 1;
    }
    let ran = executions.load(Ordering::SeqCst) - before;
    let tally: Vec<String> = tally.iter().map(|(label, n)| format!("{n}x {label}")).collect();
    rows.push(vec![
        "2. 20 concurrent duplicates".to_owned(),
        "key b, amount 250".to_owned(),
        format!("{}; handler ran {ran}x", tally.join(", ")),
        "handler runs once".to_owned(),
    ]);

    let mismatch = post_payment(&client, &base, Some(&key("a")), 999).await?;
    rows.push(row(
        "3. same key, other payload",
        "key a, amount 999",
        &mismatch,
        "409 problem+json",
    ));
    let malformed = post_payment(&client, &base, Some("bad key with spaces"), 100).await?;
    rows.push(row("4. malformed key", "unquoted, with spaces", &malformed, "400 problem+json"));
    let keyless = post_payment(&client, &base, None, 100).await?;
    rows.push(row("5. no key", "no header", &keyless, "201, passes through"));

    print_table(&["scenario", "sent", "answer", "expected"], &rows);
    println!("\nhandler executions in all: {}", executions.load(Ordering::SeqCst));
    println!("replayed body:  {}", retry.body);
    println!("409 body:       {}", mismatch.body);
    Ok(())
}

fn new_client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

struct Answer {
    status: u16,
    replayed: bool,
    body: String,
}

impl Answer {
    fn summary(&self) -> String {
        let body: Value = serde_json::from_str(&self.body).unwrap_or(Value::Null);
        let what = body["payment"].as_str().or(body["title"].as_str()).unwrap_or("");
        let replayed = if self.replayed { " replayed" } else { "" };
        format!("{}{replayed}: {what}", self.status)
    }
}

async fn post_payment(
    client: &HttpClient,
    base: &str,
    key: Option<&str>,
    amount: u64,
) -> Result<Answer, Box<dyn std::error::Error + Send + Sync>> {
    let mut request = axum::http::Request::post(format!("{base}/payments"))
        .header("content-type", "application/json");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let response =
        client.request(request.body(Body::from(json!({ "amount": amount }).to_string()))?).await?;
    let status = response.status().as_u16();
    let replayed = response.headers().get("idempotency-replayed").is_some_and(|v| v == "true");
    let body = response.into_body().collect().await?.to_bytes();
    Ok(Answer { status, replayed, body: String::from_utf8_lossy(&body).into_owned() })
}

fn print_table(header: &[&str], rows: &[Vec<String>]) {
    let widths: Vec<usize> = (0..header.len())
        .map(|i| rows.iter().map(|r| r[i].len()).chain([header[i].len()]).max().unwrap_or(0))
        .collect();
    let line = |cells: Vec<&str>| {
        let cells: Vec<String> =
            cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        println!("| {} |", cells.join(" | "));
    };
    line(header.to_vec());
    println!("|{}|", widths.iter().map(|w| "-".repeat(w + 2)).collect::<Vec<_>>().join("|"));
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
}
