use std::{
    io::Write,
    sync::{Arc, Mutex},
    time::Duration,
};

use bytes::Bytes;

use crate::{
    engine::{Claimed, Engine, Settings},
    fingerprint::Fingerprint,
    key::RecordKey,
    store::{MemoryStore, Store},
};

/// Where the test's log lines go.
#[derive(Clone, Default)]
struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What a holder's renewal logs when it finds its record completed with the holder's own
/// token (the holder's own complete under way, `committing`, or not): on a current-thread
/// runtime, whose tasks log to this thread's subscriber.
fn renewal_logs(committing: bool) -> String {
    let sink = Sink::default();
    let writer = sink.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::DEBUG)
        .finish();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    tracing::subscriber::with_default(subscriber, || {
        runtime.block_on(async {
            let store = MemoryStore::new();
            let settings = Settings {
                lease: Duration::from_millis(30),
                keep_alive: Some(Duration::from_secs(5)),
                ..Settings::default()
            };
            let engine = Engine::new(store.clone(), Arc::new(settings), &Default::default());
            let (key, fingerprint) =
                (RecordKey::new("p", b"", b"k"), Fingerprint::of_payload(b"{}"));
            let Ok(Claimed::Run(holder)) = engine
                .claim(
                    engine.name(key.clone(), fingerprint.clone()),
                    crate::engine::Label::route("r"),
                    None,
                )
                .await
            else {
                panic!("not claimed")
            };
            if committing {
                holder.commit_slot().completing();
            }
            // The record is completed with the holder's token while the renewal runs (the
            // holder's own complete, whose answer is not back yet).
            let (owner, response) = (holder.owner.clone(), Bytes::from_static(b"r"));
            let retention = Duration::from_secs(60);
            store.complete(&key, &owner, &fingerprint, response, retention).await.unwrap();
            tokio::time::sleep(Duration::from_millis(60)).await;
            drop(holder);
        });
    });
    String::from_utf8(sink.0.lock().unwrap().clone()).unwrap()
}

#[test]
fn a_renewal_that_finds_its_own_commit_is_quiet_and_a_lost_lease_warns() {
    // Once each: a renewal rejected ends the claim's renewals.
    let quiet = renewal_logs(true);
    assert!(!quiet.contains("lease lost"), "{quiet}");
    assert_eq!(quiet.matches("settled by its holder").count(), 1, "{quiet}");
    let lost = renewal_logs(false);
    assert!(lost.contains("WARN"), "{lost}");
    assert_eq!(lost.matches("lease lost").count(), 1, "{lost}");
}
