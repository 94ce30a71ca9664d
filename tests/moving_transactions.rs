//! `PostgresStore::transaction` while a service moves between namings (`Hashing::moving_to`):
//! the transaction holds both of the request's names by their key locks while it runs, longer
//! than its lease, and commits its outcome under both in its one commit, so that the
//! neighbours on either side (each reading one name, or both) wait for it and then replay it.
//! Each test has a database of its own, dropped at the end.
#![cfg(feature = "postgres")]

mod common;

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use axum::Json;
use axum_idempotency::{
    Idempotent,
    consumer::Outcome,
    hashing::{Deploy, Hashing},
    store::{
        PostgresStore, RecordStatus, TransactionError,
        sqlx::{self, PgPool, postgres::PgPoolOptions},
    },
};
use common::postgres::TestDatabase;

const SECRET: [u8; 32] = [0x42; 32];

fn build(deploy: usize) -> Hashing {
    let keyed = || Hashing::keyed(SECRET);
    match deploy {
        0 => Hashing::plain(),
        1 => Hashing::plain().moving_to(keyed(), Deploy::First).unwrap(),
        2 => Hashing::plain().moving_to(keyed(), Deploy::Second).unwrap(),
        _ => keyed(),
    }
}

async fn payments(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM payments").fetch_one(pool).await.unwrap()
}

/// One event on `deploy` (in the fleet of the key prefix `fleet`), its transaction 2.5 s long
/// with a lease of a second: `runs` counts the operation's runs.
async fn pay(
    (store, fleet): (&PostgresStore, &str),
    deploy: usize,
    event: &str,
    runs: Arc<AtomicUsize>,
) -> Result<Outcome<i64>, axum_idempotency::consumer::Error<TransactionError<sqlx::Error>>> {
    let door = Idempotent::new(store.clone())
        .key_prefix(fleet)
        .hashing(build(deploy))
        .lease(Duration::from_secs(1));
    let store = store.clone();
    door.run("payments", event, b"{}", move |context| async move {
        runs.fetch_add(1, Ordering::SeqCst);
        let paid = store.transaction(&context, |tx| {
            Box::pin(async move {
                let sql = "INSERT INTO payments (code) VALUES ('evt') RETURNING id";
                let id: i64 = sqlx::query_scalar(sql).fetch_one(&mut *tx).await?;
                tokio::time::sleep(Duration::from_millis(2500)).await;
                Ok::<_, sqlx::Error>(Json(id))
            })
        });
        paid.await.map(|Json(id)| id)
    })
    .await
}

/// Each deploy of the move runs an event whose transaction outlives its lease, redelivered
/// every 200 ms meanwhile to a neighbour and to its own deploy: one run, one payment, every
/// redelivery answered "in progress" and then the replay, and the outcome stored under both
/// names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_during_a_move_holds_and_commits_both_names() {
    let d = TestDatabase::create("moving").await;
    let pool = PgPoolOptions::new().connect_lazy_with(d.options());
    let store = PostgresStore::new(pool.clone()).sweep_every(None);
    store.migrate().await.unwrap();
    let table = "CREATE TABLE payments (id BIGSERIAL PRIMARY KEY, code TEXT NOT NULL)";
    sqlx::raw_sql(table).execute(&pool).await.unwrap();
    // A fleet (a key prefix) each: only neighbours run side by side.
    for (deploy, neighbour) in [(1, 0), (1, 2), (2, 1), (2, 3)] {
        sqlx::query("TRUNCATE payments").execute(&pool).await.unwrap();
        let fleet = format!("moving-{deploy}-{neighbour}");
        let event = format!("evt-{deploy}");
        let runs = Arc::new(AtomicUsize::new(0));
        let first = tokio::spawn({
            let (store, fleet, event, runs) =
                (store.clone(), fleet.clone(), event.clone(), runs.clone());
            async move { pay((&store, &fleet), deploy, &event, runs).await }
        });
        let started = Instant::now();
        let mut turn = 0;
        while started.elapsed() < Duration::from_millis(3500) {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let redelivered_to = [neighbour, deploy][turn % 2];
            turn += 1;
            match pay((&store, &fleet), redelivered_to, &event, runs.clone()).await {
                Ok(Outcome::InProgress { .. }) => {}
                Ok(Outcome::Replayed(_)) if started.elapsed() > Duration::from_millis(2400) => {}
                other => panic!("deploy {deploy}, redelivered to {redelivered_to}: {other:?}"),
            }
        }
        let ran = first.await.unwrap().unwrap();
        let Outcome::Ran(id) = ran else { panic!("deploy {deploy}: {ran:?}") };
        for redelivered_to in [neighbour, deploy] {
            let replayed = pay((&store, &fleet), redelivered_to, &event, runs.clone()).await;
            let replayed = replayed.unwrap();
            assert!(matches!(replayed, Outcome::Replayed(again) if again == id), "{replayed:?}");
        }
        let paid = (runs.load(Ordering::SeqCst), payments(&pool).await);
        assert_eq!(paid, (1, 1), "deploy {deploy} beside {neighbour}");
        // Completed under the old name and the new one, each as the build reading only it
        // sees.
        for alone in [0, 3] {
            let operator =
                Idempotent::new(store.clone()).key_prefix(&fleet).hashing(build(alone)).operator();
            let report = operator.inspect("payments", &event, false).await.unwrap();
            let state = report.map(|report| report.record.state);
            assert!(matches!(state, Some(RecordStatus::Completed)), "{deploy} {alone}: {state:?}");
        }
    }
    drop(store);
    pool.close().await;
}
