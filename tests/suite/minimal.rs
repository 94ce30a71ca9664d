//! Minimal records (`layer::Minimal`, `IdempotencyLayer::rebuild`) on every store: the store
//! keeps the status, the kept headers and the handler's small value, never the body; a retry
//! gets the response the hook rebuilds from the system of record; a hook that fails is a 503
//! and never a rerun.

use crate::common;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use axum::{
    Json, Router,
    body::Bytes,
    extract::State,
    http::{Response, StatusCode, header::LOCATION},
    response::IntoResponse,
    routing::post,
};
use axum_idempotency::{
    IdempotencyLayer,
    layer::{Minimal, Rebuild},
    recovery::{BoxError, Lookup, Recovered},
    store::Admin,
};
use common::*;

every_store!(
    a_minimal_record_keeps_no_body_and_replays_what_the_hook_rebuilds,
    a_failing_rebuild_is_a_503_and_never_a_rerun,
    a_minimal_record_without_a_hook_is_a_500_and_never_a_rerun,
    a_body_over_the_stored_limit_is_kept_minimally,
);

/// The system of record: orders by id, and how often the handler and the hook ran.
#[derive(Clone, Default)]
struct Orders {
    rows: Arc<Mutex<HashMap<String, serde_json::Value>>>,
    created: Calls,
    rebuilt: Calls,
    /// The hook fails while set.
    down: Arc<Mutex<bool>>,
}

const CARD: &str = "4242424242424242";

/// Creates an order with a large body (`size` bytes of notes) and stores it minimally.
async fn create(State(orders): State<Orders>, body: String) -> impl IntoResponse {
    let id = orders.created.next_call().to_string();
    let size: usize = body.parse().unwrap_or(1000);
    let order = serde_json::json!({"id": id, "card": CARD, "notes": "n".repeat(size)});
    orders.rows.lock().unwrap().insert(id.clone(), order.clone());
    let location = format!("/orders/{id}");
    (StatusCode::CREATED, [(LOCATION, location)], Minimal::new(id), Json(order))
}

/// The hook: the order, read again by its id.
async fn rebuild(
    orders: Orders,
    lookup: Lookup<Rebuild>,
) -> Result<Recovered<Response<Bytes>>, BoxError> {
    let stored = lookup.request.ok_or("a replay asks with its record")?;
    orders.rebuilt.next_call();
    if *orders.down.lock().unwrap() {
        return Err("the orders database is unreachable".into());
    }
    let id = String::from_utf8(stored.value.to_vec())?;
    let order = orders.rows.lock().unwrap().get(&id).cloned().ok_or("no such order")?;
    let mut response = Response::new(Bytes::from(serde_json::to_vec(&order)?));
    *response.status_mut() = stored.status;
    *response.headers_mut() = stored.headers;
    Ok(Recovered::Happened(response))
}

fn service<H: Harness>(h: &H, orders: &Orders, with_hook: bool) -> Router {
    let mut layer = IdempotencyLayer::new(h.store())
        .limits(axum_idempotency::layer::Limits::default().stored_body(4096));
    if with_hook {
        let hooked = orders.clone();
        layer = layer.rebuild(move |lookup| rebuild(hooked.clone(), lookup));
    }
    Router::new().route("/orders", post(create)).with_state(orders.clone()).layer(layer)
}

async fn a_minimal_record_keeps_no_body_and_replays_what_the_hook_rebuilds<H: Harness>(h: H)
where
    H::Store: Admin,
{
    let orders = Orders::default();
    let app = service(&h, &orders, true);
    let first = send(&app, keyed("POST", "/orders", "k1", "2000")).await;
    assert_eq!((first.status.as_u16(), first.header("location")), (201, Some("/orders/1")));
    assert!(first.body.contains(CARD) && first.body.len() > 2000, "the client gets it whole");

    let stored = h.store().inspect(&global("k1"), true).await.unwrap().expect("completed");
    let outcome = stored.outcome.expect("asked for");
    assert!(stored.size < 120, "{} bytes stored", stored.size);
    assert!(!String::from_utf8_lossy(&outcome).contains(CARD));
    assert!(String::from_utf8_lossy(&outcome).contains("/orders/1"), "the kept header");

    let retry = send(&app, keyed("POST", "/orders", "k1", "2000")).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!((retry.status, &retry.body), (first.status, &first.body));
    assert_eq!(retry.header("location"), Some("/orders/1"));
    assert_eq!(retry.header("content-type"), Some("application/json"));
    assert_eq!((orders.created.get(), orders.rebuilt.get()), (1, 1));
    // Another payload under the key is still a mismatch: the fingerprint is kept whole.
    send(&app, keyed("POST", "/orders", "k1", "10")).await.assert_problem(409, "key-reused");
}

async fn a_failing_rebuild_is_a_503_and_never_a_rerun<H: Harness>(h: H) {
    let orders = Orders::default();
    let app = service(&h, &orders, true);
    assert_eq!(send(&app, keyed("POST", "/orders", "k1", "10")).await.status, 201);
    *orders.down.lock().unwrap() = true;
    let refused = send(&app, keyed("POST", "/orders", "k1", "10")).await;
    refused.assert_problem(503, "rebuild-failed");
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert!(!refused.body.contains(CARD));
    *orders.down.lock().unwrap() = false;
    let replay = send(&app, keyed("POST", "/orders", "k1", "10")).await;
    assert!(replay.replayed() && replay.body.contains(CARD), "{replay:?}");
    assert_eq!((orders.created.get(), orders.rebuilt.get()), (1, 2));
}

async fn a_minimal_record_without_a_hook_is_a_500_and_never_a_rerun<H: Harness>(h: H) {
    let orders = Orders::default();
    let app = service(&h, &orders, false);
    assert_eq!(send(&app, keyed("POST", "/orders", "k1", "10")).await.status, 201);
    send(&app, keyed("POST", "/orders", "k1", "10")).await.assert_problem(500, "rebuild-failed");
    assert_eq!(orders.created.get(), 1);
}

async fn a_body_over_the_stored_limit_is_kept_minimally<H: Harness>(h: H) {
    let orders = Orders::default();
    let app = service(&h, &orders, true);
    // 20 KB of notes, five times the stored body limit: a whole record would be released.
    let first = send(&app, keyed("POST", "/orders", "big", "20000")).await;
    assert_eq!(first.status, 201);
    assert_eq!(h.held(&global("big")).await, Some(Held::Completed));
    let retry = send(&app, keyed("POST", "/orders", "big", "20000")).await;
    assert!(retry.replayed() && retry.body == first.body, "{retry:?}");
    assert_eq!(orders.created.get(), 1);
}

/// How many bytes a response of `notes` bytes costs the store, kept whole and kept minimally.
#[tokio::test]
async fn a_minimal_record_is_a_few_bytes_whatever_the_body() {
    use axum_idempotency::MemoryStore;
    let store = MemoryStore::new();
    let orders = Orders::default();
    let whole = Router::new()
        .route(
            "/orders",
            post(|body: String| async move {
                let order = serde_json::json!({"id": "1", "card": CARD, "notes": "n".repeat(body.parse().unwrap())});
                (StatusCode::CREATED, [(LOCATION, "/orders/1")], Json(order))
            }),
        )
        .layer(IdempotencyLayer::new(store.clone()));
    let minimal = Router::new()
        .route("/orders", post(create))
        .with_state(orders)
        .layer(IdempotencyLayer::new(store.clone()));
    for (notes, key) in [("200", "256"), ("16300", "16k")] {
        send(&whole, keyed("POST", "/orders", &format!("whole-{key}"), notes)).await;
        send(&minimal, keyed("POST", "/orders", &format!("minimal-{key}"), notes)).await;
        let size = |name: String| {
            let store = store.clone();
            async move { store.inspect(&global(&name), false).await.unwrap().unwrap().size }
        };
        let (w, m) = (size(format!("whole-{key}")).await, size(format!("minimal-{key}")).await);
        println!("stored outcome, body of ~{key} B: whole {w} B, minimal {m} B");
        assert!(m < 100 && w > m + notes.parse::<usize>().unwrap(), "whole {w}, minimal {m}");
    }
}

/// A minimal response committed in the store's transaction (`PostgresStore::transaction`): the row keeps the minimal record, and the retry is rebuilt.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_minimal_response_commits_in_the_handlers_transaction() {
    use axum::response::IntoResponse;
    use axum_idempotency::{IdempotencyContext, store::PostgresStore};
    let h = PostgresHarness::start().await;
    let store = h.store();
    let orders = Orders::default();
    let handler = {
        let (orders, store) = (orders.clone(), store.clone());
        move |context: IdempotencyContext| async move {
            let id = orders.created.next_call().to_string();
            let order = serde_json::json!({"id": id, "card": CARD});
            orders.rows.lock().unwrap().insert(id.clone(), order.clone());
            let response = (StatusCode::CREATED, Minimal::new(id), Json(order)).into_response();
            let committed = store.transaction(&context, |_| {
                Box::pin(async move { Ok::<_, std::convert::Infallible>(response) })
            });
            committed.await.unwrap()
        }
    };
    let hooked = orders.clone();
    let layer: IdempotencyLayer<PostgresStore> =
        IdempotencyLayer::new(store.clone()).rebuild(move |lookup| rebuild(hooked.clone(), lookup));
    let app = Router::new().route("/orders", post(handler)).layer(layer);
    let first = send(&app, keyed("POST", "/orders", "k1", "{}")).await;
    assert_eq!(first.status, 201);
    assert!(first.body.contains(CARD));
    let row = h.database.client().await;
    let sql = "SELECT response FROM idempotency_records WHERE key = $1";
    let stored: Vec<u8> = row.query_one(sql, &[&global("k1").as_str()]).await.unwrap().get(0);
    assert!(stored.len() < 100 && !String::from_utf8_lossy(&stored).contains(CARD));
    let retry = send(&app, keyed("POST", "/orders", "k1", "{}")).await;
    assert!(retry.replayed() && retry.body == first.body, "{retry:?}");
    assert_eq!((orders.created.get(), orders.rebuilt.get()), (1, 1));
}
