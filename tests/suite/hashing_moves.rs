//! A running service moving to keyed names (`Hashing::moving_to`), and what an operation's
//! context keeps through it: derived keys that never change, recovery hooks and the tables
//! beside the stores (`DurableOutcomes`, `Checkpoints`) that find what an instance of the
//! neighbouring deploy committed under the request's other names, a holder lapsed under both
//! names recovered once, and a caller gone during the look at the other names leaving nothing
//! held.

use crate::common;

use std::{
    collections::{HashMap, HashSet},
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::body::Bytes;
use axum_idempotency::{
    Fingerprint, IdempotencyContext, IdempotencyLayer, Idempotent, MemoryStore,
    consumer::Outcome,
    hashing::{Deploy, Hashing},
    recovery::{BoxError, Lookup, Recovered},
    settings::{Recovery, Waiting},
    store::{Claim, Fenced, Lease, OwnerToken, RecordKey, RecordStatus, Store, StoreError},
};
use common::*;

const SECRET: [u8; 32] = [0x5e; 32];
const NEXT: [u8; 32] = [0x77; 32];

fn plain_to_keyed() -> Hashing {
    Hashing::plain().moving_to(Hashing::keyed(SECRET), Deploy::First).unwrap()
}

fn keyed_from_plain() -> Hashing {
    Hashing::plain().moving_to(Hashing::keyed(SECRET), Deploy::Second).unwrap()
}

/// A payment provider that charges once per idempotency key it is given.
#[derive(Clone, Default)]
struct Provider(Arc<Mutex<HashSet<String>>>);

impl Provider {
    fn charge(&self, key: String) {
        self.0.lock().unwrap().insert(key);
    }

    fn charges(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

/// A delivery fails after charging (its answer from the provider timed out): its key is
/// released, and the redelivery reaches an instance of the neighbouring deploy, which passes
/// the provider the same derived key. So do the two sides of a rotation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_derived_key_is_the_same_on_every_deploy_of_a_move_and_a_rotation() {
    let moves = [
        (Hashing::plain(), plain_to_keyed()),
        (plain_to_keyed(), keyed_from_plain()),
        (keyed_from_plain(), Hashing::keyed(SECRET)),
        (
            Hashing::keyed(SECRET).moving_to(Hashing::keyed(NEXT), Deploy::First).unwrap(),
            Hashing::keyed(SECRET).moving_to(Hashing::keyed(NEXT), Deploy::Second).unwrap(),
        ),
    ];
    for (i, (first, then)) in moves.into_iter().enumerate() {
        let (store, provider) = (MemoryStore::new(), Provider::default());
        let key = format!("evt-{i}");
        let p = provider.clone();
        let failed = Idempotent::new(store.clone())
            .hashing(first)
            .run("payments", &key, b"charge 100", move |context| async move {
                p.charge(context.derived_key("stripe-charge").unwrap());
                Err::<u32, _>("timed out reading the provider's answer")
            })
            .await;
        assert!(failed.is_err());
        let p = provider.clone();
        let redelivered = Idempotent::new(store)
            .hashing(then)
            .run("payments", &key, b"charge 100", move |context| async move {
                p.charge(context.derived_key("stripe-charge").unwrap());
                Ok::<_, String>(7_u32)
            })
            .await;
        assert!(matches!(redelivered, Ok(Outcome::Ran(7))), "move {i}: {redelivered:?}");
        assert_eq!(provider.charges(), 1, "move {i}: the provider got two keys");
    }
}

type Outbox = Arc<Mutex<HashMap<String, u32>>>;

/// A recovery hook over an outbox keyed by key hash, as `docs/recovery.md` writes it: under
/// the context's key hash, and under its key hash alongside during a move.
fn outbox_hook(
    outbox: Outbox,
) -> impl Fn(Lookup<Bytes>) -> std::future::Ready<Result<Recovered<u32>, BoxError>> + Clone {
    move |lookup: Lookup<Bytes>| {
        let context = &lookup.context;
        let outbox = outbox.lock().unwrap();
        let found = std::iter::once(context.key_hash())
            .chain(context.key_hash_alongside())
            .find_map(|hash| outbox.get(hash).copied());
        std::future::ready(Ok(found.map_or(Recovered::Unknown, Recovered::Happened)))
    }
}

/// The operation: charges once per call, and writes its outbox row under its key hash.
fn charge(
    outbox: &Outbox,
    charges: &Arc<AtomicUsize>,
) -> impl FnOnce(IdempotencyContext) -> std::future::Ready<Result<u32, String>> + Send + 'static {
    let (outbox, charges) = (outbox.clone(), charges.clone());
    move |context| {
        let run = charges.fetch_add(1, Ordering::SeqCst) as u32 + 1;
        outbox.lock().unwrap().insert(context.key_hash().to_owned(), run);
        std::future::ready(Ok(run))
    }
}

/// The record store loses a record (a restart without persistence: what a hook asked on every
/// claim is for) that an instance of deploy 1 completed; the retry reaches deploy 2, whose
/// hook finds the outbox row under the key hash alongside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hook_asked_on_every_claim_finds_what_the_neighbouring_deploy_committed() {
    let (outbox, charges) = (Outbox::default(), Arc::new(AtomicUsize::new(0)));
    let every = Recovery::default().every_claim(true);
    for (i, (first, then)) in
        [(plain_to_keyed(), keyed_from_plain()), (keyed_from_plain(), plain_to_keyed())]
            .into_iter()
            .enumerate()
    {
        let key = format!("o-{i}");
        let door = |hashing| {
            Idempotent::new(MemoryStore::new())
                .hashing(hashing)
                .recovery(every)
                .recover(outbox_hook(outbox.clone()))
        };
        let ran = door(first).run("orders", &key, b"p", charge(&outbox, &charges)).await;
        assert!(matches!(ran, Ok(Outcome::Ran(_))), "{ran:?}");
        let retry = door(then).run("orders", &key, b"p", charge(&outbox, &charges)).await;
        assert!(matches!(retry, Ok(Outcome::Replayed(_))), "{retry:?}");
        assert_eq!(charges.load(Ordering::SeqCst), i + 1, "ran again");
    }
}

/// A holder of deploy 2 charged (its outbox row under the keyed names, the ones it completes
/// first) and died: both names hold its lapsed claim. The retry on either deploy of the move
/// takes both over and asks the hook, which finds the charge under either name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_lapsed_under_both_names_is_recovered_once() {
    for retry_on in [keyed_from_plain(), plain_to_keyed()] {
        let store = MemoryStore::new();
        let (outbox, charges) = (Outbox::default(), Arc::new(AtomicUsize::new(0)));
        let door = |hashing| {
            Idempotent::new(store.clone())
                .hashing(hashing)
                .lease(Duration::from_millis(200))
                .keep_alive(None)
                .recover(outbox_hook(outbox.clone()))
        };
        let (o, c) = (outbox.clone(), charges.clone());
        let dying = door(keyed_from_plain());
        let died = tokio::time::timeout(Duration::from_millis(150), async move {
            dying
                .run("pay", "k1", b"100", move |context| async move {
                    c.fetch_add(1, Ordering::SeqCst);
                    o.lock().unwrap().insert(context.key_hash().to_owned(), 7);
                    std::future::pending::<()>().await;
                    Ok::<_, String>(0_u32)
                })
                .await
        })
        .await;
        assert!(died.is_err(), "the holder \"died\" mid-operation");
        tokio::time::sleep(Duration::from_millis(400)).await;

        let retried = door(retry_on).run("pay", "k1", b"100", charge(&outbox, &charges)).await;
        assert!(matches!(retried, Ok(Outcome::Replayed(7))), "{retried:?}");
        assert_eq!(charges.load(Ordering::SeqCst), 1, "charged twice");
    }
}

/// A store whose answers to claims of every key but `fast` come `delay` late (the look at the
/// other names on the wire).
#[derive(Clone)]
struct SlowOthers {
    inner: MemoryStore,
    fast: String,
    delay: Duration,
    /// Fail those claims instead (the store unreachable for them), writing nothing.
    fail: bool,
    /// Delay those releases and touches (an abandon is one) instead of claims' answers (a
    /// pool whose connections are busy).
    slow_releases: bool,
}

impl Store for SlowOthers {
    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Claim, StoreError> {
        if self.fail && key.as_str() != self.fast {
            return Err(StoreError::unavailable("the other names' shard is down"));
        }
        let claimed = self.inner.claim(key, fingerprint, owner, lease).await;
        if key.as_str() != self.fast && !self.slow_releases {
            tokio::time::sleep(self.delay).await;
        }
        claimed
    }

    async fn complete(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        fingerprint: &Fingerprint,
        response: Bytes,
        retention: Duration,
    ) -> Result<Fenced, StoreError> {
        self.inner.complete(key, owner, fingerprint, response, retention).await
    }

    async fn release(&self, key: &RecordKey, owner: &OwnerToken) -> Result<Fenced, StoreError> {
        if key.as_str() != self.fast && self.slow_releases {
            tokio::time::sleep(self.delay).await;
        }
        self.inner.release(key, owner).await
    }

    async fn touch(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Fenced, StoreError> {
        if key.as_str() != self.fast && self.slow_releases {
            tokio::time::sleep(self.delay).await;
        }
        self.inner.touch(key, owner, lease).await
    }
}

/// The client gives up while the look at the other names is on the wire: the claim won under
/// the names claimed with is abandoned, as one whose own answer was on the wire is, and the
/// retry runs at once (it found it held for a whole lease before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_gone_during_the_look_at_the_other_names_leaves_nothing_held() {
    let inner = MemoryStore::new();
    let slow = SlowOthers {
        inner: inner.clone(),
        fast: global("k1").as_str().to_owned(),
        delay: Duration::from_millis(500),
        fail: false,
        slow_releases: false,
    };
    let calls = Calls::default();
    let layer = IdempotencyLayer::new(slow).hashing(plain_to_keyed()).lease(Duration::from_secs(5));
    let deploy1 = app(&calls).layer(layer);
    let gone = tokio::time::timeout(
        Duration::from_millis(100),
        send(&deploy1, keyed("POST", "/payments", "k1", "{}")),
    )
    .await;
    assert!(gone.is_err());
    eventually("the plain claim is abandoned", async || inner.state(&global("k1")).is_none()).await;
    assert_eq!(calls.get(), 0);
    let deploy0 = app(&calls).layer(IdempotencyLayer::new(inner.clone()).waiting(Waiting::off()));
    let retry = send(&deploy0, keyed("POST", "/payments", "k1", "{}")).await;
    assert_eq!((retry.status.as_u16(), retry.replayed()), (201, false), "{retry:?}");
    assert_eq!(calls.get(), 1);
}

/// The client gives up while the look lets go of what it claimed under the other names (a
/// slow release), or of ours after it took a lapsed holder over under them: nothing stays held,
/// and the next retry on either deploy runs (or replays what ran) rather than waiting out a
/// lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_gone_while_the_look_lets_go_leaves_nothing_held() {
    for lapsed_under_plain in [false, true] {
        let inner = MemoryStore::new();
        if lapsed_under_plain {
            let plain = Fingerprint::new("POST", "/payments", "", b"{}");
            let lapse =
                Lease::new(Duration::from_millis(100)).recovery_window(Duration::from_secs(60));
            inner.claim(&global("k1"), &plain, &OwnerToken::random(), lapse).await.unwrap();
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let slow = SlowOthers {
            inner: inner.clone(),
            fast: global("k1").as_str().to_owned(),
            delay: Duration::from_millis(500),
            fail: false,
            slow_releases: true,
        };
        let calls = Calls::default();
        let layer = |hashing| {
            IdempotencyLayer::new(inner.clone())
                .lease(Duration::from_secs(5))
                .waiting(Waiting::off())
                .hashing(hashing)
        };
        let (first, looks_at_plain) = match lapsed_under_plain {
            false => (plain_to_keyed(), keyed_from_plain()),
            true => (keyed_from_plain(), plain_to_keyed()),
        };
        let slow_layer =
            IdempotencyLayer::new(slow).lease(Duration::from_secs(5)).hashing(first.clone());
        let gone = tokio::time::timeout(
            Duration::from_millis(100),
            send(&app(&calls).layer(slow_layer), keyed("POST", "/payments", "k1", "{}")),
        )
        .await;
        let ran = calls.get();
        assert!(ran <= 1, "{gone:?}");
        for hashing in [first, looks_at_plain] {
            let instance = app(&calls).layer(layer(hashing));
            let mut retry = send(&instance, keyed("POST", "/payments", "k1", "{}")).await;
            for _ in 0..20 {
                if retry.status != 202 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                retry = send(&instance, keyed("POST", "/payments", "k1", "{}")).await;
            }
            assert_eq!(retry.status, 201, "held by nobody for a lease: {retry:?}");
        }
        assert_eq!(calls.get(), 1, "run once in all");
    }
}

/// A holder under the plain names that died on `path`: its claim of `k1` lapsed 100 ms after
/// it, kept for its window.
async fn lapsed_under_plain(store: &MemoryStore, path: &str) {
    let plain = Fingerprint::new("POST", path, "", b"{}");
    let lapse = Lease::new(Duration::from_millis(100)).recovery_window(Duration::from_secs(60));
    store.claim(&global("k1"), &plain, &OwnerToken::random(), lapse).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
}

impl SlowOthers {
    /// Releases and touches of every key but the plain `k1` answered `delay` late.
    fn letting_go_late(inner: &MemoryStore, delay: Duration) -> Self {
        let fast = global("k1").as_str().to_owned();
        Self { inner: inner.clone(), fast, delay, fail: false, slow_releases: true }
    }
}

/// A request that took a lapsed holder over under the other names is answered after the claim
/// under its own names is let go (a slow release: a busy pool): a retry right after the answer
/// gets the replay, never the 202 of a claim that nobody holds any more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_under_the_other_names_is_answered_after_ours_is_let_go() {
    let inner = MemoryStore::new();
    lapsed_under_plain(&inner, "/payments").await;
    let slow = SlowOthers::letting_go_late(&inner, Duration::from_millis(300));
    let calls = Calls::default();
    let layer = IdempotencyLayer::new(slow).waiting(Waiting::off()).hashing(keyed_from_plain());
    let instance = app(&calls).layer(layer);
    let ran = send(&instance, keyed("POST", "/payments", "k1", "{}")).await;
    assert_eq!((ran.status.as_u16(), ran.replayed()), (201, false), "{ran:?}");
    let retry = send(&instance, keyed("POST", "/payments", "k1", "{}")).await;
    assert_eq!((retry.status.as_u16(), retry.replayed()), (201, true), "{retry:?}");
    assert_eq!(calls.get(), 1);
}

/// The claim under the request's own names, let go in a task of its own after a takeover under
/// the other names, is counted on the layer's task tracker: a service that shuts down (here
/// without keep-alive, so that nothing waits for the let-go before the answer) waits for it,
/// and the next instance's retry finds the request done, not the claim still held (202).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_let_go_after_a_takeover_under_the_other_names_is_waited_for_at_shutdown() {
    let inner = MemoryStore::new();
    lapsed_under_plain(&inner, "/payments").await;
    let slow = SlowOthers::letting_go_late(&inner, Duration::from_millis(500));
    let (calls, tasks) = (Calls::default(), tokio_util::task::TaskTracker::new());
    let layer = IdempotencyLayer::new(slow)
        .waiting(Waiting::off())
        .keep_alive(None)
        .task_tracker(tasks.clone())
        .hashing(keyed_from_plain());
    let ran = send(&app(&calls).layer(layer), keyed("POST", "/payments", "k1", "{}")).await;
    assert_eq!((ran.status.as_u16(), ran.replayed()), (201, false), "{ran:?}");
    // The service shuts down, and the next instance takes the retry.
    tasks.close();
    tasks.wait().await;
    let next = IdempotencyLayer::new(inner).waiting(Waiting::off()).hashing(keyed_from_plain());
    let retry = send(&app(&calls).layer(next), keyed("POST", "/payments", "k1", "{}")).await;
    assert_eq!((retry.status.as_u16(), retry.replayed()), (201, true), "{retry:?}");
    assert_eq!(calls.get(), 1);
}

/// A request lapsed under both names (a holder of each naming died) is taken over under both
/// by deploy 2, whose store answers renewals and releases late (a busy pool): the operation
/// does not wait for them, with keep-alive or without: a retry after the lease finds the
/// operation done (the replay), never a lapsed claim to take over and run a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_let_go_after_a_takeover_under_the_other_names_never_lets_the_claim_lapse() {
    for keep_alive in [Some(Duration::from_secs(60)), None] {
        let inner = MemoryStore::new();
        // A holder under the keyed names (deploy 3) died: its claim lapsed, kept for its window.
        let died = Calls::default();
        let keyed_only = IdempotencyLayer::new(inner.clone())
            .hashing(Hashing::keyed(SECRET))
            .lease(Duration::from_millis(100))
            .keep_alive(None);
        let dying = app(&died).layer(keyed_only);
        let gone = tokio::time::timeout(
            Duration::from_millis(50),
            send(&dying, delayed("/slow", "k1", 60_000, "{}")),
        );
        assert!(gone.await.is_err());
        // And one under the plain names.
        lapsed_under_plain(&inner, "/slow").await;

        // Deploy 2 takes both over, its renewals and releases answered 1.5 s late, five of its
        // 300 ms leases.
        let slow = SlowOthers::letting_go_late(&inner, Duration::from_millis(1500));
        let calls = Calls::default();
        let deploy2 = IdempotencyLayer::new(slow)
            .hashing(keyed_from_plain())
            .lease(Duration::from_millis(300))
            .keep_alive(keep_alive)
            .waiting(Waiting::off());
        let deploy2 = app(&calls).layer(deploy2);
        let first = send_in_background(&deploy2, delayed("/slow", "k1", 0, "{}"));
        // Past the lease of the claims the first took over, while its renewals are still on
        // the wire: another deploy-2 instance's retry.
        tokio::time::sleep(Duration::from_millis(800)).await;
        let other = IdempotencyLayer::new(inner.clone())
            .hashing(keyed_from_plain())
            .waiting(Waiting::off());
        let retry = send(&app(&calls).layer(other), delayed("/slow", "k1", 0, "{}")).await;
        assert_eq!((retry.status.as_u16(), retry.replayed()), (201, true), "{retry:?}");
        let first = first.await.unwrap();
        assert_eq!((first.status.as_u16(), first.replayed()), (201, false), "{first:?}");
        assert_eq!(calls.get(), 1, "run twice (keep-alive {keep_alive:?})");
    }
}

/// A claim that took a lapsed one over, whose look at the other names fails, hands the key
/// back with its lapse: the next claim is a takeover again, and asks the recovery hook (the
/// operation may have happened under it), rather than running as new.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_whose_look_fails_keeps_the_lapse() {
    let inner = MemoryStore::new();
    let named = keyed_from_plain();
    let ours = Idempotent::new(inner.clone()).hashing(named.clone()).operator();
    // A holder of deploy 2 died: its claim under the keyed name lapsed, kept for its window.
    let dying = Idempotent::new(inner.clone())
        .hashing(named.clone())
        .lease(Duration::from_millis(100))
        .keep_alive(None)
        .recover(|_: Lookup<Bytes>| async { Ok::<_, BoxError>(Recovered::<u32>::Unknown) });
    let died = tokio::time::timeout(Duration::from_millis(50), async move {
        dying
            .run("pay", "k1", b"100", |_| async {
                std::future::pending::<()>().await;
                Ok::<_, String>(0_u32)
            })
            .await
    })
    .await;
    assert!(died.is_err());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let plain = RecordKey::new("idempotency-consumer", b"pay", b"k1");
    // The retry's claim of the keyed name, after it took the plain one over, fails: nothing
    // runs, and the plain one keeps its lapse (abandoned, not released).
    let failing = SlowOthers {
        inner: inner.clone(),
        fast: String::new(),
        delay: Duration::ZERO,
        fail: true,
        slow_releases: false,
    };
    let failing = SlowOthers { fast: plain.as_str().to_owned(), ..failing };
    let asked = Arc::new(AtomicUsize::new(0));
    let hook = {
        let asked = asked.clone();
        move |lookup: Lookup<Bytes>| {
            assert!(lookup.context.is_takeover());
            asked.fetch_add(1, Ordering::SeqCst);
            std::future::ready(Ok::<_, BoxError>(Recovered::<u32>::Happened(7)))
        }
    };
    let failing = Idempotent::new(failing).hashing(named.clone()).recover(hook.clone());
    let refused = failing.run("pay", "k1", b"100", |_| async { Ok::<_, String>(8_u32) }).await;
    assert!(refused.is_err(), "{refused:?}");
    let lapsed = ours.inspect("pay", "k1", false).await.unwrap().expect("the lapsed claim");
    assert!(matches!(lapsed.record.state, RecordStatus::Lapsed { .. }), "{lapsed:?}");
    assert_eq!(asked.load(Ordering::SeqCst), 0, "the hook is asked once both are held");
    // The next retry takes the lapsed claim over again and asks the hook, which knows it.
    let door = Idempotent::new(inner.clone()).hashing(named).recover(hook);
    let retried = door.run("pay", "k1", b"100", |_| async { Ok::<_, String>(8_u32) }).await;
    assert!(matches!(retried, Ok(Outcome::Replayed(7))), "{retried:?}");
    assert_eq!(asked.load(Ordering::SeqCst), 1);
}

/// The tables beside the stores, over real Redis and PostgreSQL: what a request committed on
/// one deploy is found by its retry on the neighbouring one.
#[cfg(all(feature = "postgres", feature = "redis"))]
mod tables {
    use axum::{
        Router,
        extract::State,
        http::StatusCode,
        response::{IntoResponse, Response},
        routing::post,
    };
    use axum_idempotency::{
        RedisStore,
        durable::{Checkpoints, DurableOutcomes},
        store::sqlx::{self, postgres::PgPoolOptions},
    };
    use tokio::sync::oneshot;

    use super::*;
    use crate::common::postgres::TestDatabase;

    #[derive(Clone)]
    struct Payments {
        outcomes: DurableOutcomes,
        runs: Arc<AtomicUsize>,
    }

    async fn pay(
        State(app): State<Payments>,
        context: IdempotencyContext,
        body: String,
    ) -> Response {
        let run = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
        let paid = app.outcomes.transaction(&context, move |tx| {
            Box::pin(async move {
                sqlx::query("INSERT INTO payments (run) VALUES ($1)")
                    .bind(i64::try_from(run).unwrap())
                    .execute(&mut *tx)
                    .await?;
                let response = (StatusCode::CREATED, format!("run {run}: {body}"));
                Ok::<_, sqlx::Error>(response.into_response())
            })
        });
        match paid.await {
            Ok(response) => response,
            Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
        }
    }

    /// Redis loses both records; each retry reaches the other deploy, which replays the
    /// outcome the table holds under the request's other names.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn durable_outcomes_are_found_across_neighbouring_deploys() {
        let (database, redis) = (TestDatabase::create("hashing").await, RedisServer::start());
        let pool = PgPoolOptions::new().connect_lazy_with(database.options());
        sqlx::raw_sql("CREATE TABLE payments (run BIGINT NOT NULL)").execute(&pool).await.unwrap();
        let outcomes = DurableOutcomes::new(pool.clone());
        outcomes.migrate().await.unwrap();
        let app = Payments { outcomes: outcomes.clone(), runs: Arc::default() };
        let deploy = |hashing: Hashing| {
            let store = RedisStore::from_url(&redis.url()).unwrap();
            let layer = IdempotencyLayer::new(store).recover(outcomes.clone()).hashing(hashing);
            Router::new().route("/pay", post(pay)).with_state(app.clone()).layer(layer)
        };
        let (first, second) = (deploy(plain_to_keyed()), deploy(keyed_from_plain()));
        assert_eq!(send(&first, keyed("POST", "/pay", "k1", "a")).await.body, "run 1: a");
        assert_eq!(send(&second, keyed("POST", "/pay", "k2", "b")).await.body, "run 2: b");
        let () = ::redis::cmd("FLUSHALL").query_async(&mut redis.connection().await).await.unwrap();
        for (instance, key, body) in [(&second, "k1", "run 1: a"), (&first, "k2", "run 2: b")] {
            let request_body = if key == "k1" { "a" } else { "b" };
            let retry = send(instance, keyed("POST", "/pay", key, request_body)).await;
            assert_eq!((retry.body.as_str(), retry.replayed()), (body, true), "{retry:?}");
        }
        let count: i64 =
            sqlx::query_scalar("SELECT count(*) FROM payments").fetch_one(&pool).await.unwrap();
        assert_eq!(count, 2, "a payment was made again");
    }

    /// The context a door with `hashing` gives an operation run for `key` with `payload`.
    async fn context_of(hashing: Hashing, key: &str, payload: &[u8]) -> IdempotencyContext {
        let door = Idempotent::new(MemoryStore::new()).hashing(hashing);
        let (sender, context) = oneshot::channel();
        door.run("steps", key, payload, |context| async move {
            sender.send(context).unwrap();
            Ok::<_, std::convert::Infallible>(())
        })
        .await
        .unwrap();
        context.await.unwrap()
    }

    /// A step marked by a run on one deploy is found by the retry on the neighbouring one, and
    /// another request under the key is still refused it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn checkpoints_are_resumed_across_neighbouring_deploys() {
        let database = TestDatabase::create("hashing").await;
        let pool = PgPoolOptions::new().connect_lazy_with(database.options());
        let steps = Checkpoints::new(pool.clone());
        steps.migrate().await.unwrap();
        for (i, (first, then)) in
            [(plain_to_keyed(), keyed_from_plain()), (keyed_from_plain(), plain_to_keyed())]
                .into_iter()
                .enumerate()
        {
            let key = format!("k{i}");
            let marked = context_of(first, &key, b"a").await;
            let mut tx = pool.begin().await.unwrap();
            steps.mark(&mut tx, &marked, "charge", &"ch_1").await.unwrap();
            tx.commit().await.unwrap();
            let retry = context_of(then.clone(), &key, b"a").await;
            let found = steps.done::<String>(&retry, "charge").await.unwrap();
            assert_eq!(found.as_deref(), Some("ch_1"), "the charge step would run again");
            let another = context_of(then, &key, b"b").await;
            let refused = steps.done::<String>(&another, "charge").await;
            assert!(matches!(refused, Err(StoreError::KeyReused)), "{refused:?}");
        }
    }
}
