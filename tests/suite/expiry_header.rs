//! `Answers::advertise_expiry`: stored and replayed responses say when the key's record expires
//! (`Idempotency-Key-Expires`, an HTTP date: the completion plus the retention); responses that
//! are not stored, and every response without the option, do not. Run against every store.

use crate::common;

use std::time::{Duration, SystemTime};

use axum_idempotency::{IdempotencyLayer, layer::EXPIRES_HEADER};
use common::*;

every_store!(
    stored_and_replayed_responses_say_when_the_key_expires,
    responses_not_stored_and_layers_without_the_option_say_nothing,
);

const RETENTION: Duration = Duration::from_secs(3600);

fn expires(seen: &Seen) -> SystemTime {
    let value = seen.header(EXPIRES_HEADER).unwrap_or_else(|| panic!("no expiry: {seen:?}"));
    httpdate::parse_http_date(value).unwrap()
}

fn apart(a: SystemTime, b: SystemTime) -> Duration {
    a.duration_since(b).or_else(|e| Ok::<_, ()>(e.duration())).unwrap()
}

async fn stored_and_replayed_responses_say_when_the_key_expires<H: Harness>(h: H) {
    let calls = Calls::default();
    let layer = IdempotencyLayer::new(h.store())
        .retention(RETENTION)
        .answers(axum_idempotency::layer::Answers::default().advertise_expiry(true));
    let app = app(&calls).layer(layer);
    let first = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    assert_eq!(first.status, 201);
    // An HTTP date has whole seconds.
    let expected = SystemTime::now() + RETENTION;
    assert!(apart(expires(&first), expected) <= Duration::from_secs(2), "{first:?}");
    let replay = send(&app, keyed("POST", "/payments", "k1", "{}")).await;
    assert!(replay.replayed());
    // The replay's expiry is the record's: its completion plus the retention, as first said.
    assert!(apart(expires(&replay), expires(&first)) <= Duration::from_secs(1), "{replay:?}");
    // A streamed response says it too, from its head on.
    let streamed = send(&app, keyed("POST", "/streamed", "k2", "{}")).await;
    assert!(apart(expires(&streamed), expected) <= Duration::from_secs(2), "{streamed:?}");
    assert_eq!(calls.get(), 2);
}

async fn responses_not_stored_and_layers_without_the_option_say_nothing<H: Harness>(h: H) {
    let calls = Calls::default();
    let advertising = app(&calls).layer(
        IdempotencyLayer::new(h.store())
            .answers(axum_idempotency::layer::Answers::default().advertise_expiry(true)),
    );
    let failed = send(&advertising, keyed("POST", "/status/500", "k1", "{}")).await;
    assert_eq!((failed.status.as_u16(), failed.header(EXPIRES_HEADER)), (500, None));
    let stored = send(&advertising, keyed("POST", "/payments", "k2", "{}")).await;
    assert!(stored.header(EXPIRES_HEADER).is_some());
    let reused = send(&advertising, keyed("POST", "/payments", "k2", "{\"other\":1}")).await;
    assert_eq!((reused.status.as_u16(), reused.header(EXPIRES_HEADER)), (409, None));
    let quiet = app(&calls).layer(IdempotencyLayer::new(h.store()));
    for _ in 0..2 {
        let seen = send(&quiet, keyed("POST", "/payments", "k3", "{}")).await;
        assert_eq!((seen.status.as_u16(), seen.header(EXPIRES_HEADER)), (201, None));
    }
}
