//! Checkpoints (`Checkpoints`): `POST /orders` of `examples/ledger.rs` makes an order row
//! (a step), calls the payment provider (a step), then records the charge on the order with the
//! response, and is killed with SIGKILL after each step committed. The takeover resumes after
//! the last step that committed: the steps before it do not run again (one order row, one call
//! to the provider), in both set-ups (PostgreSQL alone; Redis in front).
//!
//! Needs PostgreSQL at `DATABASE_URL` and `redis-server` on PATH; fails when either is missing.
#![cfg(all(feature = "postgres", feature = "redis"))]

use crate::common;

use common::ledger::*;
use serde_json::json;

/// The order rows, and the charge recorded on the one there should be.
async fn orders(world: &World) -> (i64, Option<(i64, Option<String>)>) {
    let client = world.db.client().await;
    let count = client.query_one("SELECT count(*) FROM ledger_orders", &[]).await.unwrap().get(0);
    let row = client.query_opt("SELECT id, charge FROM ledger_orders LIMIT 1", &[]).await.unwrap();
    (count, row.map(|row| (row.get(0), row.get(1))))
}

/// Killed after `point`'s step committed; the retry (the layer waits out the dead holder's
/// lease, then takes it over) resumes after it, and every later retry replays the order.
async fn resumes_after(point: &str) {
    in_both_set_ups(async |world| {
        let service = world.serve(None).await;
        killed_at_path(world, "/orders", point).await;
        let (calls_before, orders_before) = (world.provider.counts().1, orders(world).await.0);
        assert_eq!(orders_before, 1, "the order step committed");
        let retry = post(service.port, "/orders", "pay-1").await.unwrap();
        assert_eq!((retry.status, retry.replayed), (201, false), "{retry:?}");
        let (count, order) = orders(world).await;
        let (id, charge) = order.unwrap();
        assert_eq!(count, 1, "the order step ran again");
        assert_eq!(retry.body, json!({ "order": id, "charge": charge.unwrap(), "amount": 100 }));
        // The charge step ran once: once before the crash, or once in the takeover.
        assert_eq!(world.provider.counts(), (1, 1), "calls before the crash: {calls_before}");
        let again = post(service.port, "/orders", "pay-1").await.unwrap();
        assert_eq!((again.status, again.replayed, &again.body), (201, true, &retry.body));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_after_the_order_step_makes_no_second_order() {
    resumes_after("after-order").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_after_the_charge_step_calls_the_provider_no_more() {
    resumes_after("after-charge").await;
}

/// In process: a handler with checkpoints on `PostgresStore`, whose provider can be down.
mod bound_to_the_request {
    use std::{
        sync::{
            Arc,
            atomic::{AtomicBool, Ordering},
        },
        time::Duration,
    };

    use axum::{
        Json, Router,
        extract::State,
        http::StatusCode,
        response::{IntoResponse, Response},
        routing::post,
    };
    use axum_idempotency::{
        IdempotencyContext, IdempotencyLayer,
        durable::Checkpoints,
        layer::KeyReused,
        store::{
            PostgresStore, StoreError,
            sqlx::{self, PgPool},
        },
    };
    use serde_json::{Value, json};

    use crate::common::{keyed, postgres::TestDatabase, postgres::pool_for, send};

    #[derive(Clone)]
    struct App {
        pool: PgPool,
        store: PostgresStore,
        steps: Checkpoints,
        provider_up: Arc<AtomicBool>,
    }

    /// The order row (a step), then the provider (down: 500), then the response committed.
    async fn order(
        State(app): State<App>,
        context: IdempotencyContext,
        body: axum::body::Bytes,
    ) -> Response {
        let body: Value = serde_json::from_slice(&body).unwrap();
        let amount = body["amount"].as_i64().unwrap();
        let order: i64 = match app.steps.done(&context, "order").await {
            Ok(Some(order)) => order,
            Ok(None) => {
                let mut tx = app.pool.begin().await.unwrap();
                let sql = "INSERT INTO orders (amount) VALUES ($1) RETURNING id";
                let order: i64 =
                    sqlx::query_scalar(sql).bind(amount).fetch_one(&mut *tx).await.unwrap();
                app.steps.mark(&mut tx, &context, "order", &order).await.unwrap();
                tx.commit().await.unwrap();
                order
            }
            Err(StoreError::KeyReused) => return KeyReused.into_response(),
            Err(error) => panic!("{error}"),
        };
        if !app.provider_up.load(Ordering::SeqCst) {
            return (StatusCode::INTERNAL_SERVER_ERROR, "the provider is down").into_response();
        }
        let committed = app.store.transaction(&context, move |_| {
            Box::pin(async move {
                let body = json!({ "order": order, "amount": amount });
                Ok::<_, sqlx::Error>((StatusCode::CREATED, Json(body)).into_response())
            })
        });
        committed.await.into_response()
    }

    async fn setup(d: &TestDatabase, retention: Duration) -> (App, Router) {
        let pool = pool_for(d);
        let store = PostgresStore::new(pool.clone()).sweep_every(None);
        store.migrate().await.unwrap();
        let steps = Checkpoints::new(pool.clone());
        steps.migrate().await.unwrap();
        let orders = "CREATE TABLE orders (id BIGSERIAL PRIMARY KEY, amount BIGINT NOT NULL)";
        sqlx::raw_sql(orders).execute(&pool).await.unwrap();
        let provider_up = Arc::new(AtomicBool::new(true));
        let app = App { pool, store: store.clone(), steps, provider_up };
        let layer = IdempotencyLayer::new(store).retention(retention);
        let router = Router::new().route("/orders", post(order)).with_state(app.clone());
        (app, router.layer(layer))
    }

    async fn orders(app: &App) -> Vec<(i64, i64)> {
        let sql = "SELECT id, amount FROM orders ORDER BY id";
        sqlx::query_as(sql).fetch_all(&app.pool).await.unwrap()
    }

    fn amount(amount: i64) -> &'static str {
        match amount {
            100 => r#"{"amount":100}"#,
            _ => r#"{"amount":250}"#,
        }
    }

    /// The first attempt fails after its order step (500: the key is released). The same key
    /// with another amount is a key reused (409), never the first request's order charged at
    /// the new amount; the same request resumes after its step, and the key is replayed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn another_payload_never_resumes_a_requests_steps() {
        let d = TestDatabase::create("steps").await;
        let (app, router) = setup(&d, Duration::from_secs(3600)).await;
        app.provider_up.store(false, Ordering::SeqCst);
        let failed = send(&router, keyed("POST", "/orders", "k1", amount(100))).await;
        assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR, "{failed:?}");
        app.provider_up.store(true, Ordering::SeqCst);
        let other = send(&router, keyed("POST", "/orders", "k1", amount(250))).await;
        other.assert_problem(409, "key-reused");
        assert_eq!(orders(&app).await.len(), 1, "{:?}", orders(&app).await);
        let resumed = send(&router, keyed("POST", "/orders", "k1", amount(100))).await;
        assert_eq!(resumed.status, StatusCode::CREATED, "{resumed:?}");
        let rows = orders(&app).await;
        assert_eq!(rows.len(), 1, "the order step ran again: {rows:?}");
        assert_eq!(resumed.body, json!({ "order": rows[0].0, "amount": 100 }).to_string());
        let replay = send(&router, keyed("POST", "/orders", "k1", amount(100))).await;
        assert_eq!(
            (replay.status, replay.replayed(), &replay.body),
            (StatusCode::CREATED, true, &resumed.body)
        );
    }

    /// Steps live as long as the key's outcome: once the record expired, the key starts afresh
    /// for any request, its old steps gone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_key_whose_record_expired_starts_afresh() {
        let d = TestDatabase::create("steps").await;
        let (app, router) = setup(&d, Duration::from_secs(1)).await;
        let first = send(&router, keyed("POST", "/orders", "k1", amount(100))).await;
        assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let again = send(&router, keyed("POST", "/orders", "k1", amount(250))).await;
        assert_eq!(again.status, StatusCode::CREATED, "{again:?}");
        assert!(!again.replayed());
        let rows = orders(&app).await;
        assert_eq!(rows.iter().map(|row| row.1).collect::<Vec<_>>(), [100, 250]);
        assert_eq!(again.body, json!({ "order": rows[1].0, "amount": 250 }).to_string());
    }
}
