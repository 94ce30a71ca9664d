//! Any key prefix is safe: braces in it never move a record's Redis Cluster hash tag, so a
//! record and its settle channel stay in one slot (a prefix like `{}` once made every complete
//! and release fail with `CROSSSLOT`, and each retry then ran the handler again).

use crate::common;

use std::time::Duration;

use axum_idempotency::settings::Waiting;
use axum_idempotency::{
    IdempotencyContext, IdempotencyLayer, Idempotent, consumer::Outcome, store::RecordKey,
};
use common::*;

every_store!(any_prefix_completes_replays_and_wakes_waiters);

const PREFIXES: [&str; 6] = ["{}", "svc{}", "{payments}", "a}b{", "%7B", ""];

async fn any_prefix_completes_replays_and_wakes_waiters<H: Harness>(h: H) {
    for prefix in PREFIXES {
        let calls = Calls::default();
        let layer = IdempotencyLayer::new(h.store())
            .key_prefix(prefix)
            .waiting(Waiting::up_to(Duration::from_secs(5)));
        let app = app(&calls).layer(layer);
        // The duplicate waits on the record's settle channel: the settle publishes there.
        let first = send_in_background(&app, delayed("/slow", "k1", 300, "{}"));
        tokio::time::sleep(Duration::from_millis(100)).await;
        let waited = send(&app, delayed("/slow", "k1", 300, "{}")).await;
        let first = first.await.unwrap();
        assert_eq!(first.status, 201, "prefix {prefix:?}: {first:?}");
        assert!(waited.replayed(), "prefix {prefix:?}: {waited:?}");
        let retry = send(&app, delayed("/slow", "k1", 300, "{}")).await;
        assert!(retry.replayed(), "prefix {prefix:?}: {retry:?}");
        assert_eq!(retry.body, first.body);
        assert_eq!(calls.get(), 1, "prefix {prefix:?}: the handler ran again");
        let key = RecordKey::new(prefix, b"", b"k1");
        assert_eq!(h.held(&key).await, Some(Held::Completed), "prefix {prefix:?}");
        // A released key (the handler failed) is free again under any prefix.
        for _ in 0..2 {
            assert_eq!(send(&app, keyed("POST", "/status/503", "k2", "{}")).await.status, 503);
        }
        assert_eq!(calls.get(), 3, "prefix {prefix:?}: a released key was not free again");
        // The consumer door shares the key format.
        let idem = Idempotent::new(h.store()).key_prefix(prefix);
        for expected in [Outcome::Ran(7), Outcome::Replayed(7)] {
            let outcome = idem
                .run("scope", "evt", b"{}", |_context: IdempotencyContext| async {
                    Ok::<_, std::io::Error>(7_u8)
                })
                .await
                .unwrap();
            assert_eq!(outcome, expected, "prefix {prefix:?}");
        }
    }
}
