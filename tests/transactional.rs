//! The consumer door's outcome written in the store's own PostgreSQL transaction with the
//! operation's side effect (`PostgresStore::transaction`): it commits with the side effect, or
//! neither does; a holder whose lease was taken over cannot commit one; and a worker killed
//! with SIGKILL (a real process: this test binary, run again as a worker) at each point of
//! its operation leaves either the committed outcome, which the redelivery replays, or
//! nothing, which the redelivery runs once. Each test has a database of its own, dropped at
//! the end.

mod common;

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::Json;
use axum_idempotency::{
    Idempotent,
    consumer::{Error, Outcome},
    store::{
        PostgresStore, StoreError, TransactionError,
        sqlx::{self, PgPool, postgres::PgConnectOptions, postgres::PgPoolOptions},
    },
};
use common::postgres::TestDatabase;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The side effect: a payment row per run of the operation, with no unique constraint, so
/// that a second run shows as a second row.
const PAYMENTS: &str = "CREATE TABLE payments (id BIGSERIAL PRIMARY KEY, event TEXT NOT NULL)";

fn pool(options: PgConnectOptions) -> PgPool {
    PgPoolOptions::new().test_before_acquire(false).connect_lazy_with(options)
}

fn pool_of(d: &TestDatabase) -> PgPool {
    pool(d.options())
}

async fn setup(d: &TestDatabase) -> (PgPool, PostgresStore) {
    let pool = pool_of(d);
    let store = PostgresStore::new(pool.clone()).sweep_every(None);
    store.migrate().await.unwrap();
    sqlx::raw_sql(PAYMENTS).execute(&pool).await.unwrap();
    (pool, store)
}

async fn payments(pool: &PgPool, event: &str) -> i64 {
    let sql = "SELECT count(*) FROM payments WHERE event = $1";
    sqlx::query_scalar(sql).bind(event).fetch_one(pool).await.unwrap()
}

/// The record's state: `Some('P')` in progress, `Some('C')` completed, `None` absent.
async fn record_state(pool: &PgPool) -> Option<String> {
    let sql = "SELECT state::text FROM idempotency_records WHERE state <> 'F'";
    sqlx::query_scalar(sql).fetch_optional(pool).await.unwrap()
}

/// Where the operation stops, for a test to look or to kill.
#[derive(Clone, Copy, PartialEq)]
enum Stop {
    Nowhere,
    /// After the payment row and the sealed outcome, before the commit that writes both.
    BeforeCommit,
    /// After the commit, before the operation returns to the door.
    AfterCommit,
}

/// The operation: a payment row and its outcome in one transaction; `Err` to roll back.
async fn pay(
    _pool: PgPool,
    store: PostgresStore,
    event: &'static str,
    context: axum_idempotency::IdempotencyContext,
    stop: Stop,
    roll_back: bool,
) -> Result<i64, BoxError> {
    let paid = store.transaction(&context, move |tx| {
        Box::pin(async move {
            let sql = "INSERT INTO payments (event) VALUES ($1) RETURNING id";
            let id: i64 = sqlx::query_scalar(sql).bind(event).fetch_one(&mut *tx).await?;
            if stop == Stop::BeforeCommit {
                println!("stopped before-commit");
                std::future::pending::<()>().await;
            }
            if roll_back {
                return Err::<Json<i64>, BoxError>("rolled back".into());
            }
            Ok(Json(id))
        })
    });
    let Json(id) = paid.await?;
    if stop == Stop::AfterCommit {
        println!("stopped after-commit");
        std::future::pending::<()>().await;
    }
    Ok(id)
}

/// One delivery of `evt_1` whose operation pays, to the end.
async fn deliver_payment(
    idem: &Idempotent<PostgresStore>,
    pool: &PgPool,
    store: &PostgresStore,
) -> Result<Outcome<i64>, Error<BoxError>> {
    let (pool, store) = (pool.clone(), store.clone());
    idem.run("payments", "evt_1", b"{}", move |context| async move {
        pay(pool, store, "evt_1", context, Stop::Nowhere, false).await
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outcome_commits_with_the_side_effect_and_every_redelivery_replays_it() {
    let d = TestDatabase::create("txn").await;
    let (pool, store) = setup(&d).await;
    let idem = Idempotent::new(store.clone());
    let runs = Arc::new(AtomicUsize::new(0));
    let deliver = || {
        let (pool, store, runs) = (pool.clone(), store.clone(), runs.clone());
        idem.run("payments", "evt_1", b"{}", move |context| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            pay(pool, store, "evt_1", context, Stop::Nowhere, false).await
        })
    };
    let Ok(Outcome::Ran(id)) = deliver().await else { panic!("the first delivery did not run") };
    assert_eq!(record_state(&pool).await.as_deref(), Some("C"));
    for _ in 0..3 {
        assert!(matches!(deliver().await, Ok(Outcome::Replayed(again)) if again == id));
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(payments(&pool, "evt_1").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_transaction_stores_nothing_and_the_redelivery_runs_once() {
    let d = TestDatabase::create("txn").await;
    let (pool, store) = setup(&d).await;
    let idem = Idempotent::new(store.clone());
    let deliver = |roll_back: bool| {
        let (pool, store) = (pool.clone(), store.clone());
        idem.run("payments", "evt_1", b"{}", move |context| async move {
            pay(pool, store, "evt_1", context, Stop::Nowhere, roll_back).await
        })
    };
    assert!(matches!(deliver(true).await, Err(Error::Operation(_))));
    assert_eq!(record_state(&pool).await, None, "the failed run's key is released");
    assert_eq!(payments(&pool, "evt_1").await, 0);
    let Ok(Outcome::Ran(id)) = deliver(false).await else { panic!("the redelivery did not run") };
    assert!(matches!(deliver(false).await, Ok(Outcome::Replayed(again)) if again == id));
    assert_eq!(payments(&pool, "evt_1").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_lease_was_taken_over_cannot_commit_its_outcome() {
    let d = TestDatabase::create("txn").await;
    let (pool, store) = setup(&d).await;
    // No renewal: the first holder's lease lapses while it is held up.
    let idem = Idempotent::new(store.clone()).lease(Duration::from_millis(300)).keep_alive(None);
    let (first_pool, first_store) = (pool.clone(), store.clone());
    let first_idem = idem.clone();
    // The first holder goes on only once the second has run, however slow the machine.
    let (go_on, resumed) = tokio::sync::oneshot::channel::<()>();
    let (running, started) = tokio::sync::oneshot::channel::<()>();
    let first = tokio::spawn(async move {
        let operation = move |context| async move {
            let _ = running.send(());
            let _ = resumed.await;
            pay(first_pool, first_store, "evt_1", context, Stop::Nowhere, false).await
        };
        first_idem.run("payments", "evt_1", b"{}", operation).await
    });
    // Past the first holder's lease, counted from when it holds the key.
    started.await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let second = deliver_payment(&idem, &pool, &store).await;
    let Ok(Outcome::Ran(id)) = second else { panic!("the takeover did not run: {second:?}") };
    go_on.send(()).unwrap();
    // The first holder wrote its payment, then was fenced out of the outcome: its whole
    // transaction rolled back (and the door released nothing of the new holder's).
    let Err(Error::Operation(error)) = first.await.unwrap() else { panic!("the first committed") };
    let fenced = error.downcast_ref::<TransactionError<BoxError>>();
    assert!(matches!(fenced, Some(TransactionError::Store(StoreError::FencedOut))), "{error}");
    assert_eq!(payments(&pool, "evt_1").await, 1);
    let replay = idem.run("payments", "evt_1", b"{}", |_| async { Ok::<i64, BoxError>(0) }).await;
    assert!(matches!(replay, Ok(Outcome::Replayed(again)) if again == id), "{replay:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_that_returns_another_value_than_it_committed_gets_the_committed_one() {
    let d = TestDatabase::create("txn").await;
    let (pool, store) = setup(&d).await;
    let idem = Idempotent::new(store.clone());
    let deliver = || {
        let (pool, store) = (pool.clone(), store.clone());
        idem.run("payments", "evt_1", b"{}", move |context| async move {
            let id = pay(pool, store, "evt_1", context, Stop::Nowhere, false).await?;
            Ok::<i64, BoxError>(id + 1000)
        })
    };
    let first = deliver().await;
    let Ok(Outcome::Ran(id)) = first else { panic!("the first delivery did not run: {first:?}") };
    assert!(id < 1000, "the returned value was answered, not the committed one: {id}");
    assert!(matches!(deliver().await, Ok(Outcome::Replayed(again)) if again == id));
    assert_eq!(payments(&pool, "evt_1").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_fails_stores_nothing_even_when_the_operation_returns_ok() {
    let d = TestDatabase::create("txn").await;
    let (pool, store) = setup(&d).await;
    // A constraint checked only at commit: a second `evt_1` row passes its insert, and the
    // commit refuses it.
    let deferred = "ALTER TABLE payments ADD CONSTRAINT one_event UNIQUE (event)
        DEFERRABLE INITIALLY DEFERRED";
    sqlx::raw_sql(deferred).execute(&pool).await.unwrap();
    sqlx::query("INSERT INTO payments (event) VALUES ('evt_1')").execute(&pool).await.unwrap();
    let idem = Idempotent::new(store.clone());
    let runs = Arc::new(AtomicUsize::new(0));
    let deliver = || {
        let (pool, store, runs) = (pool.clone(), store.clone(), runs.clone());
        idem.run("payments", "evt_1", b"{}", move |context| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            // The misuse the door must survive: `Ok` after a commit that failed.
            let paid = pay(pool, store, "evt_1", context, Stop::Nowhere, false).await;
            Ok::<i64, BoxError>(paid.unwrap_or(-1))
        })
    };
    assert!(matches!(deliver().await, Ok(Outcome::Ran(-1))));
    assert_eq!(record_state(&pool).await, None, "the key of a failed commit is released");
    assert!(matches!(deliver().await, Ok(Outcome::Ran(-1))), "the redelivery runs");
    assert_eq!((runs.load(Ordering::SeqCst), payments(&pool, "evt_1").await), (2, 1));
}

/// After a sealed outcome the door writes nothing: the settle is counted as
/// `stored_in_transaction`, never as a write of its own fenced out by the committed record.
#[cfg(feature = "metrics")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_door_writes_nothing_after_a_sealed_outcome() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install().expect("the only recorder of this test binary");
    let d = TestDatabase::create("txn").await;
    let (pool, store) = setup(&d).await;
    let idem = Idempotent::new(store.clone());
    let (run_pool, run_store) = (pool.clone(), store.clone());
    let ran = idem
        .run("metered", "evt_1", b"{}", move |context| async move {
            pay(run_pool, run_store, "evt_1", context, Stop::Nowhere, false).await
        })
        .await;
    assert!(matches!(ran, Ok(Outcome::Ran(_))), "{ran:?}");
    // Other tests of this binary count too: only this test's scope is read.
    let settles: Vec<(String, u64)> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter_map(|(key, .., value)| {
            let key = key.key();
            let label =
                |name: &str| key.labels().find(|l| l.key() == name).map(|l| l.value().to_owned());
            let DebugValue::Counter(count) = value else { return None };
            if key.name() != "idempotency_settles_total" || label("scope")? != "metered" {
                return None;
            }
            Some((label("result")?, count))
        })
        .collect();
    assert_eq!(settles, [("stored_in_transaction".to_owned(), 1)]);
}

/// This test binary, run again as a worker: one delivery of `evt_1` that stops at `stop` and
/// says so on stdout, for the test to kill it there.
struct Worker(tokio::process::Child);

impl Worker {
    async fn start(d: &TestDatabase, stop: &str) -> Self {
        let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
            .args(["worker_process", "--exact", "--nocapture", "--test-threads=1"])
            .env("TRANSACTIONAL_WORKER", stop)
            .env("TRANSACTIONAL_URL", d.uri())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
        let wanted = format!("stopped {stop}");
        let seen = tokio::time::timeout(Duration::from_secs(60), async {
            while let Some(line) = lines.next_line().await.unwrap() {
                if line.contains(&wanted) {
                    return;
                }
            }
            panic!("the worker exited before it said {wanted:?}");
        });
        seen.await.unwrap_or_else(|_| panic!("no {wanted:?} from the worker within 60 s"));
        Self(child)
    }

    async fn sigkill(mut self) {
        self.0.kill().await.unwrap();
    }
}

/// The worker's side of [`Worker`]: does nothing unless this process is one.
#[test]
fn worker_process() {
    let Ok(stop) = std::env::var("TRANSACTIONAL_WORKER") else { return };
    let stop = match stop.as_str() {
        "before-commit" => Stop::BeforeCommit,
        "after-commit" => Stop::AfterCommit,
        other => panic!("unknown stop {other}"),
    };
    let var = |name: &str| std::env::var(name).unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let pool = pool(var("TRANSACTIONAL_URL").parse().unwrap());
        let store = PostgresStore::new(pool.clone()).sweep_every(None);
        let idem = Idempotent::new(store.clone()).lease(LEASE).keep_alive(None);
        let outcome = idem
            .run("payments", "evt_1", b"{}", move |context| async move {
                pay(pool, store, "evt_1", context, stop, false).await
            })
            .await;
        panic!("the worker was not killed: {outcome:?}");
    });
}

/// The workers' lease: a redelivery after a killed worker waits past it.
const LEASE: Duration = Duration::from_millis(1000);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_after_its_commit_is_replayed_without_a_hook_or_a_wait() {
    let d = TestDatabase::create("txn").await;
    let (pool, store) = setup(&d).await;
    Worker::start(&d, "after-commit").await.sigkill().await;
    // The outcome committed with the payment: the redelivery is answered from it at once,
    // within the dead worker's lease, and the operation does not run again.
    let idem = Idempotent::new(store).lease(LEASE);
    let again = idem.run("payments", "evt_1", b"{}", |_| async { Ok::<i64, BoxError>(-1) }).await;
    let Ok(Outcome::Replayed(id)) = again else { panic!("not a replay: {again:?}") };
    assert!(id > 0, "{id}");
    assert_eq!(payments(&pool, "evt_1").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_before_its_commit_leaves_nothing_and_the_redelivery_runs_once() {
    let d = TestDatabase::create("txn").await;
    let (pool, store) = setup(&d).await;
    Worker::start(&d, "before-commit").await.sigkill().await;
    // The payment row and the outcome went with the transaction; the claim stays until its
    // lease lapses, then the redelivery takes it over and runs once.
    assert_eq!(payments(&pool, "evt_1").await, 0);
    assert_eq!(record_state(&pool).await.as_deref(), Some("P"));
    tokio::time::sleep(LEASE + Duration::from_millis(300)).await;
    let idem = Idempotent::new(store.clone()).lease(LEASE);
    let again = deliver_payment(&idem, &pool, &store).await;
    let Ok(Outcome::Ran(id)) = again else { panic!("the redelivery did not run: {again:?}") };
    let replay = idem.run("payments", "evt_1", b"{}", |_| async { Ok::<i64, BoxError>(-1) }).await;
    assert!(matches!(replay, Ok(Outcome::Replayed(again)) if again == id), "{replay:?}");
    assert_eq!(payments(&pool, "evt_1").await, 1);
}

/// A holder whose lease lapsed and was taken over commits while the new holder still runs:
/// its transaction is fenced out by the owner token (not only by a completed record) and rolled
/// back, payment and all; the new holder's commit stands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_taken_over_cannot_commit_while_the_new_holder_runs() {
    let d = TestDatabase::create("txn").await;
    let (pool, store) = setup(&d).await;
    let idem = Idempotent::new(store.clone()).lease(Duration::from_millis(300)).keep_alive(None);
    let (first_store, first_pool) = (store.clone(), pool.clone());
    let (go_on, resumed) = tokio::sync::oneshot::channel::<()>();
    let first_idem = idem.clone();
    let first = tokio::spawn(async move {
        let operation = move |context| async move {
            let _ = resumed.await;
            pay(first_pool, first_store, "evt_1", context, Stop::Nowhere, false).await
        };
        first_idem.run("payments", "evt_1", b"{}", operation).await
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    // The second holder takes over and holds its claim, running, while the first commits.
    let (taken, holding) = tokio::sync::oneshot::channel::<()>();
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let (second_store, second_pool, second_idem) = (store.clone(), pool.clone(), idem.clone());
    let second = tokio::spawn(async move {
        let operation = move |context| async move {
            taken.send(()).unwrap();
            let _ = released.await;
            pay(second_pool, second_store, "evt_1", context, Stop::Nowhere, false).await
        };
        second_idem.run("payments", "evt_1", b"{}", operation).await
    });
    holding.await.unwrap();
    go_on.send(()).unwrap();
    let Err(Error::Operation(error)) = first.await.unwrap() else { panic!("the first committed") };
    let fenced = error.downcast_ref::<TransactionError<BoxError>>();
    assert!(matches!(fenced, Some(TransactionError::Store(StoreError::FencedOut))), "{error}");
    assert_eq!(payments(&pool, "evt_1").await, 0, "the fenced-out payment committed");
    release.send(()).unwrap();
    let Ok(Outcome::Ran(id)) = second.await.unwrap() else { panic!("the takeover did not run") };
    assert_eq!(payments(&pool, "evt_1").await, 1);
    let replay = idem.run("payments", "evt_1", b"{}", |_| async { Ok::<i64, BoxError>(0) }).await;
    assert!(matches!(replay, Ok(Outcome::Replayed(again)) if again == id), "{replay:?}");
}

/// A TCP proxy to the database that can hold the server's replies (a network that delays one
/// direction): bytes the server sends wait in the proxy until it lets them go.
#[derive(Clone)]
struct HoldingProxy {
    port: u16,
    held: Arc<tokio::sync::watch::Sender<bool>>,
}

impl HoldingProxy {
    async fn start(target: u16) -> Self {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let held = Arc::new(tokio::sync::watch::Sender::new(false));
        let watched = held.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let server = tokio::net::TcpStream::connect(("127.0.0.1", target)).await.unwrap();
                let mut held = watched.subscribe();
                tokio::spawn(async move {
                    let (mut client_read, mut client_write) = client.into_split();
                    let (mut server_read, mut server_write) = server.into_split();
                    let up = tokio::io::copy(&mut client_read, &mut server_write);
                    let down = async {
                        let mut buffer = vec![0; 16 * 1024];
                        while let Ok(n @ 1..) = server_read.read(&mut buffer).await {
                            let _ = held.wait_for(|held| !*held).await;
                            if client_write.write_all(&buffer[..n]).await.is_err() {
                                break;
                            }
                        }
                    };
                    tokio::select! {
                        _ = up => {}
                        () = down => {}
                    }
                });
            }
        });
        Self { port, held }
    }

    fn hold(&self, held: bool) {
        self.held.send_replace(held);
    }
}

/// A `BEGIN` whose answer comes later than the store's command timeout: the transaction fails
/// (`TransactionError::Store`), and the connection it began on is closed, not handed back to
/// the pool inside a transaction that nothing would end (sqlx counts a transaction only once
/// `BEGIN`'s answer is read, launchbadge/sqlx#4393). Were it handed back, the next operations
/// on it would run inside that transaction: a completed record never committed, and another
/// instance's delivery of that event answered "in progress", or an error, never its replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_begin_answered_after_the_timeout_leaves_no_transaction_open() {
    let d = TestDatabase::create("txn").await;
    let (direct_pool, _) = setup(&d).await;
    let proxy = HoldingProxy::start(d.port()).await;
    // One connection, so that every operation after the timeout is on the one it began on.
    let proxied = PgPoolOptions::new()
        .max_connections(1)
        .test_before_acquire(false)
        .connect_lazy_with(d.options().host("127.0.0.1").port(proxy.port));
    let store =
        PostgresStore::new(proxied).sweep_every(None).command_timeout(Duration::from_millis(300));
    let idem = Idempotent::new(store.clone());

    let (slow, slow_proxy) = (store.clone(), proxy.clone());
    let timed_out = idem
        .run("payments", "evt_1", b"{}", move |context| async move {
            slow_proxy.hold(true);
            let began = slow
                .transaction(&context, |_| Box::pin(async { Ok::<_, sqlx::Error>(Json(1_i64)) }));
            let began = began.await;
            slow_proxy.hold(false);
            began.map(|Json(id)| id).map_err(BoxError::from)
        })
        .await;
    let Err(Error::Operation(error)) = timed_out else { panic!("ran: {timed_out:?}") };
    let timeout = error.downcast_ref::<TransactionError<sqlx::Error>>();
    assert!(matches!(timeout, Some(TransactionError::Store(StoreError::Timeout(_)))), "{error}");

    // The next event completes on this instance (its record written outside any transaction),
    // and another instance's delivery of it is a replay.
    let ran = idem.run("payments", "evt_2", b"{}", |_| async { Ok::<i64, BoxError>(2) }).await;
    assert!(matches!(ran, Ok(Outcome::Ran(2))), "{ran:?}");
    let other = Idempotent::new(PostgresStore::new(direct_pool.clone()).sweep_every(None));
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let redelivered = other
        .run("payments", "evt_2", b"{}", move |_| async move {
            counted.fetch_add(1, Ordering::SeqCst);
            Ok::<i64, BoxError>(3)
        })
        .await;
    assert!(matches!(redelivered, Ok(Outcome::Replayed(2))), "{redelivered:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    let open = "SELECT count(*) FROM pg_stat_activity \
                WHERE datname = current_database() AND state LIKE 'idle in transaction%'";
    let open: i64 = sqlx::query_scalar(open).fetch_one(&direct_pool).await.unwrap();
    assert_eq!(open, 0, "a session left inside a transaction");
}
