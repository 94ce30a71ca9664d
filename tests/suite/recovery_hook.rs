//! The recovery hook, in process, against every store: what a takeover asks before it runs
//! again, and what each answer (happened, unknown, failed, too slow, panicked) leads to. A
//! dead holder is a claim nobody settles: planted in the store with a short lease.
//! `tests/suite/recovery.rs` kills real processes.

use crate::common;

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{Router, routing::post};
use axum_idempotency::{
    Fingerprint, IdempotencyContext, IdempotencyLayer, Idempotent,
    consumer::{Error, Outcome},
    recovery::{Lookup, Recovered},
    store::{Claim, Lease, OwnerToken, RecordKey, Store},
};
use bytes::Bytes;
use common::*;
use http::{Request, Response};

every_store!(
    a_takeover_whose_hook_knows_the_outcome_replays_it_and_runs_nothing,
    a_takeover_whose_hook_knows_nothing_runs_the_handler_once,
    a_hook_that_fails_answers_503_runs_nothing_and_is_asked_again,
    a_hook_that_does_not_answer_in_time_answers_503,
    a_hook_that_panics_answers_503,
    run_when_recovery_fails_runs_the_handler,
    a_fresh_claim_asks_the_hook_only_when_every_claim_is_on,
    the_handler_finds_its_context_in_the_request,
    a_lapsed_claim_without_a_hook_is_kept_and_taken_over,
    a_takeover_on_the_consumer_door_asks_the_hook_and_replays_what_it_knows,
    a_failed_hook_on_the_consumer_door_runs_nothing,
);

const LAPSE: Duration = Duration::from_millis(100);
const PAST_LAPSE: Duration = Duration::from_millis(250);

/// One question to the hook: the key hash, whether a takeover, the URI, the body.
type Asking = (String, bool, String, Bytes);

/// What a hook answers in these tests.
type Answer = std::future::Ready<Result<Recovered<Response<Bytes>>, std::io::Error>>;

/// What the hook saw and how often it was asked.
#[derive(Clone, Default)]
struct Asked {
    count: Arc<AtomicUsize>,
    seen: Arc<std::sync::Mutex<Vec<Asking>>>,
}

impl Asked {
    fn count(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }

    fn record(&self, lookup: &Lookup<Request<Bytes>>) {
        self.count.fetch_add(1, Ordering::SeqCst);
        let request = lookup.request.as_ref().expect("a door's lookup carries its request");
        self.seen.lock().unwrap().push((
            lookup.context.key_hash().to_owned(),
            lookup.context.is_takeover(),
            request.uri().to_string(),
            request.body().clone(),
        ));
    }
}

/// A hook that finds the outbox row of every request it is asked about.
fn knows(
    asked: &Asked,
) -> impl Fn(Lookup<Request<Bytes>>) -> Answer + Clone + Send + Sync + 'static {
    let asked = asked.clone();
    move |lookup| {
        asked.record(&lookup);
        let response = Response::builder()
            .status(201)
            .header("x-payment", "pay_from_outbox")
            .body(Bytes::from_static(br#"{"from":"outbox"}"#))
            .unwrap();
        std::future::ready(Ok(Recovered::Happened(response)))
    }
}

/// A hook that finds nothing.
fn knows_nothing(
    asked: &Asked,
) -> impl Fn(Lookup<Request<Bytes>>) -> Answer + Send + Sync + 'static {
    let asked = asked.clone();
    move |lookup| {
        asked.record(&lookup);
        std::future::ready(Ok(Recovered::Unknown))
    }
}

/// A hook whose database is down.
fn fails(asked: &Asked) -> impl Fn(Lookup<Request<Bytes>>) -> Answer + Send + Sync + 'static {
    let asked = asked.clone();
    move |lookup| {
        asked.record(&lookup);
        std::future::ready(Err(std::io::Error::other("database unreachable")))
    }
}

/// A claim on `POST /payments` with body `{}` and `key` whose holder died: nobody settles it,
/// and its lease lapses after [`LAPSE`].
async fn dead_holder<S: Store>(store: &S, key: &str) {
    let fingerprint = Fingerprint::new("POST", "/payments", "", b"{}");
    let lease = Lease::new(LAPSE).recovery_window(Duration::from_secs(3600));
    let claim = store.claim(&global(key), &fingerprint, &OwnerToken::random(), lease).await;
    assert_eq!(claim.unwrap(), Claim::Claimed);
    tokio::time::sleep(PAST_LAPSE).await;
}

async fn a_takeover_whose_hook_knows_the_outcome_replays_it_and_runs_nothing<H: Harness>(h: H) {
    let (calls, asked) = (Calls::default(), Asked::default());
    let app = app(&calls).layer(IdempotencyLayer::new(h.store()).recover(knows(&asked)));
    dead_holder(&h.store(), "k1").await;
    let retry = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(retry.replayed());
    assert_eq!(retry.body, r#"{"from":"outbox"}"#);
    assert_eq!(retry.header("x-payment"), Some("pay_from_outbox"));
    assert_eq!(calls.get(), 0, "the handler ran");
    // The hook was asked about this request: its key hash, a takeover, the request itself.
    let seen = asked.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].0, global("k1").hash());
    assert!(seen[0].1, "not reported as a takeover");
    assert_eq!((seen[0].2.as_str(), &seen[0].3[..]), ("/payments", &b"{}"[..]));
    // Stored: the next retry is a replay from the store; the hook is not asked again.
    assert_eq!(h.held(&global("k1")).await, Some(Held::Completed));
    let again = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    assert_eq!((again.status.as_u16(), again.body.as_str()), (201, r#"{"from":"outbox"}"#));
    assert!(again.replayed());
    assert_eq!((asked.count(), calls.get()), (1, 0));
}

async fn a_takeover_whose_hook_knows_nothing_runs_the_handler_once<H: Harness>(h: H) {
    let (calls, asked) = (Calls::default(), Asked::default());
    let app = app(&calls).layer(IdempotencyLayer::new(h.store()).recover(knows_nothing(&asked)));
    dead_holder(&h.store(), "k1").await;
    let retry = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed());
    assert!(retry.body.starts_with(r#"{"call":1,"#), "{}", retry.body);
    assert_eq!((asked.count(), calls.get()), (1, 1));
    let again = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    assert!(again.replayed());
    assert_eq!(again.body, retry.body);
    assert_eq!((asked.count(), calls.get()), (1, 1));
}

async fn a_hook_that_fails_answers_503_runs_nothing_and_is_asked_again<H: Harness>(h: H) {
    let (calls, asked) = (Calls::default(), Asked::default());
    let down = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let hook = {
        let (fails, knows) = (fails(&asked), knows(&asked));
        let down = down.clone();
        move |lookup| {
            if down.load(Ordering::SeqCst) { fails(lookup) } else { knows(lookup) }
        }
    };
    let app = app(&calls).layer(IdempotencyLayer::new(h.store()).recover(hook));
    dead_holder(&h.store(), "k1").await;
    let refused = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    refused.assert_problem(503, "recovery-failed");
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert_eq!(calls.get(), 0);
    // The key is handed back, not released: the next retry takes over again and asks again,
    // never running blind.
    assert_eq!(h.held(&global("k1")).await, Some(Held::InProgress));
    send(&app, keyed("POST", "/payments", "k1", "{}")).await.assert_problem(503, "recovery-failed");
    down.store(false, Ordering::SeqCst);
    let recovered = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    assert_eq!((recovered.status.as_u16(), recovered.body.as_str()), (201, r#"{"from":"outbox"}"#));
    assert_eq!((asked.count(), calls.get()), (3, 0));
}

async fn a_hook_that_does_not_answer_in_time_answers_503<H: Harness>(h: H) {
    let calls = Calls::default();
    let hook = |_lookup: Lookup<Request<Bytes>>| async {
        tokio::time::sleep(Duration::from_secs(30)).await;
        Ok::<_, std::io::Error>(Recovered::<Response<Bytes>>::Unknown)
    };
    let layer = IdempotencyLayer::new(h.store()).recover(hook).recovery(
        axum_idempotency::settings::Recovery::default().timeout(Duration::from_millis(200)),
    );
    let app = app(&calls).layer(layer);
    dead_holder(&h.store(), "k1").await;
    let started = std::time::Instant::now();
    send(&app, keyed("POST", "/payments", "k1", "{}")).await.assert_problem(503, "recovery-failed");
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    assert_eq!(calls.get(), 0);
}

async fn a_hook_that_panics_answers_503<H: Harness>(h: H) {
    let calls = Calls::default();
    let hook = |_lookup: Lookup<Request<Bytes>>| async {
        if true {
            panic!("the hook's own bug");
        }
        Ok::<_, std::io::Error>(Recovered::<Response<Bytes>>::Unknown)
    };
    let app = app(&calls).layer(IdempotencyLayer::new(h.store()).recover(hook));
    dead_holder(&h.store(), "k1").await;
    send(&app, keyed("POST", "/payments", "k1", "{}")).await.assert_problem(503, "recovery-failed");
    assert_eq!(calls.get(), 0);
    assert_eq!(h.held(&global("k1")).await, Some(Held::InProgress));
}

async fn run_when_recovery_fails_runs_the_handler<H: Harness>(h: H) {
    let (calls, asked) = (Calls::default(), Asked::default());
    let layer = IdempotencyLayer::new(h.store())
        .recover(fails(&asked))
        .recovery(axum_idempotency::settings::Recovery::default().run_when_failed(true));
    let app = app(&calls).layer(layer);
    dead_holder(&h.store(), "k1").await;
    let ran = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    assert_eq!(ran.status, 201);
    assert!(!ran.replayed());
    assert_eq!((asked.count(), calls.get()), (1, 1));
}

async fn a_fresh_claim_asks_the_hook_only_when_every_claim_is_on<H: Harness>(h: H) {
    let (calls, asked) = (Calls::default(), Asked::default());
    let plain = app(&calls).layer(IdempotencyLayer::new(h.store()).recover(knows(&asked)));
    let fresh = send(&plain, keyed("POST", "/payments", "k1", "{}")).await;
    assert!(!fresh.replayed());
    assert_eq!((asked.count(), calls.get()), (0, 1));

    // A store that lost its records (a restart, a failover): every claim asks first.
    let (calls, asked) = (Calls::default(), Asked::default());
    let layer = IdempotencyLayer::new(h.store())
        .recover(knows(&asked))
        .recovery(axum_idempotency::settings::Recovery::default().every_claim(true));
    let app = app(&calls).layer(layer);
    let answered = send(&app, keyed("POST", "/payments", "k2", "{}")).await;
    assert_eq!((answered.status.as_u16(), answered.body.as_str()), (201, r#"{"from":"outbox"}"#));
    assert!(answered.replayed());
    assert!(!asked.seen.lock().unwrap()[0].1, "a fresh claim is not a takeover");
    assert_eq!((asked.count(), calls.get()), (1, 0));
    // Requests without a key are not asked about.
    let keyless = Request::post("/payments").body(axum::body::Body::from("{}")).unwrap();
    assert_eq!(send(&app, keyless).await.status, 201);
    assert_eq!((asked.count(), calls.get()), (1, 1));
}

async fn the_handler_finds_its_context_in_the_request<H: Harness>(h: H) {
    let handler = |context: IdempotencyContext| async move {
        format!(
            "{} {} {}",
            context.key_hash(),
            String::from_utf8_lossy(context.scope()),
            context.derived_key("psp").unwrap()
        )
    };
    let optional = |context: Option<IdempotencyContext>| async move {
        context.map_or("none".to_owned(), |c| c.key_hash().to_owned())
    };
    let app = Router::new()
        .route("/needs", post(handler))
        .route("/optional", post(optional))
        .layer(IdempotencyLayer::new(h.store()));
    let seen = send(&app, keyed("POST", "/needs", "k1", "{}")).await;
    assert_eq!(seen.status, 200);
    let fields: Vec<&str> = seen.body.split(' ').collect();
    assert_eq!(fields[0], global("k1").hash());
    assert_eq!(fields[1], "");
    assert_eq!(fields[2].len(), 64);
    assert_ne!(fields[2], fields[0]);
    // The replay carries the same derived key: it is the same request.
    assert_eq!(send(&app, keyed("POST", "/needs", "k1", "{}")).await.body, seen.body);
    // Without a key: 400 problem+json where the context is required, `None` where optional.
    let keyless = || Request::post("/needs").body(axum::body::Body::from("{}")).unwrap();
    send(&app, keyless()).await.assert_problem(400, "key-missing");
    let keyless = Request::post("/optional").body(axum::body::Body::from("{}")).unwrap();
    assert_eq!(send(&app, keyless).await.body, "none");
    assert_eq!(send(&app, keyed("POST", "/optional", "k2", "{}")).await.body, global("k2").hash());
}

async fn a_lapsed_claim_without_a_hook_is_kept_and_taken_over<H: Harness>(h: H) {
    // No hook: the lapsed claim is still kept for the window, so that the next claim is a
    // takeover (counted and traced as one), and it runs.
    let calls = Calls::default();
    let layer = IdempotencyLayer::new(h.store()).lease(LAPSE).keep_alive(None);
    let app = app(&calls).layer(layer);
    let first = send_until_claimed(&h, &app, delayed("/slow", "k1", 2000, "{}"), "k1").await;
    tokio::time::sleep(PAST_LAPSE).await;
    assert_eq!(h.held(&global("k1")).await, Some(Held::InProgress));
    let retry = send(&app, delayed("/slow", "k1", 0, "{}")).await;
    assert_eq!((retry.status.as_u16(), retry.replayed()), (201, false), "{retry:?}");
    assert_eq!(calls.get(), 2);
    first.abort();
}

#[derive(serde::Serialize, serde::Deserialize, Debug, Clone, PartialEq)]
struct Receipt {
    charge: String,
}

/// A claim on the consumer door whose worker died, as `dead_holder`.
async fn dead_worker<S: Store>(store: &S, event: &str, payload: &[u8]) {
    let key = RecordKey::new("idempotency-consumer", b"payments", event.as_bytes());
    let lease = Lease::new(LAPSE).recovery_window(Duration::from_secs(3600));
    let fingerprint = Fingerprint::of_payload(payload);
    let claim = store.claim(&key, &fingerprint, &OwnerToken::random(), lease).await;
    assert_eq!(claim.unwrap(), Claim::Claimed);
    tokio::time::sleep(PAST_LAPSE).await;
}

async fn a_takeover_on_the_consumer_door_asks_the_hook_and_replays_what_it_knows<H: Harness>(h: H) {
    let asked = Arc::new(AtomicUsize::new(0));
    let hook = {
        let asked = asked.clone();
        move |lookup: Lookup<Bytes>| {
            asked.fetch_add(1, Ordering::SeqCst);
            let known = lookup.request.as_deref() == Some(&b"amount=100"[..])
                && lookup.context.is_takeover();
            async move {
                Ok::<_, std::io::Error>(match known {
                    true => Recovered::Happened(Receipt { charge: "ch_outbox".into() }),
                    false => Recovered::Unknown,
                })
            }
        }
    };
    let idem = Idempotent::new(h.store()).recover(hook);
    let ran = Arc::new(AtomicUsize::new(0));
    let operation = || {
        let ran = ran.clone();
        move |_context: IdempotencyContext| async move {
            ran.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::io::Error>(Receipt { charge: "ch_new".into() })
        }
    };
    dead_worker(&h.store(), "evt_1", b"amount=100").await;
    let outcome = idem.run("payments", "evt_1", b"amount=100", operation()).await.unwrap();
    assert_eq!(outcome, Outcome::Replayed(Receipt { charge: "ch_outbox".into() }));
    assert_eq!((asked.load(Ordering::SeqCst), ran.load(Ordering::SeqCst)), (1, 0));
    let again = idem.run("payments", "evt_1", b"amount=100", operation()).await.unwrap();
    assert_eq!(again, Outcome::Replayed(Receipt { charge: "ch_outbox".into() }));
    assert_eq!((asked.load(Ordering::SeqCst), ran.load(Ordering::SeqCst)), (1, 0));
    // A fresh event is not asked about, and runs.
    let fresh = idem.run("payments", "evt_2", b"amount=100", operation()).await.unwrap();
    assert_eq!(fresh, Outcome::Ran(Receipt { charge: "ch_new".into() }));
    assert_eq!((asked.load(Ordering::SeqCst), ran.load(Ordering::SeqCst)), (1, 1));
}

async fn a_failed_hook_on_the_consumer_door_runs_nothing<H: Harness>(h: H) {
    let hook = |_lookup: Lookup<Bytes>| async {
        Err::<Recovered<Receipt>, _>(std::io::Error::other("database unreachable"))
    };
    let idem = Idempotent::new(h.store()).recover(hook);
    let ran = Arc::new(AtomicUsize::new(0));
    dead_worker(&h.store(), "evt_1", b"amount=100").await;
    let counter = ran.clone();
    let outcome = idem
        .run("payments", "evt_1", b"amount=100", move |_context| async move {
            counter.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::io::Error>(Receipt { charge: "ch_new".into() })
        })
        .await;
    assert!(matches!(outcome, Err(Error::Recovery)), "{outcome:?}");
    assert_eq!(
        outcome.unwrap_err().to_string(),
        "the recovery hook failed; the operation did not run"
    );
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    let key = RecordKey::new("idempotency-consumer", b"payments", b"evt_1");
    assert_eq!(h.held(&key).await, Some(Held::InProgress));
}
