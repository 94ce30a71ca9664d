//! One `LISTEN` connection per store, shared by every waiter of the process: the settle of a
//! record someone waits for sends a `NOTIFY` on the store's channel with the record's key, and
//! the listener wakes that key's waiters. After a lost connection every waiter is woken (a
//! settle may have been missed, and a woken waiter claims again to find out), and the listener
//! connects again.

use std::{
    sync::{Mutex, PoisonError},
    time::Duration,
};

use sqlx::{PgPool, postgres::PgListener};
use tokio::sync::watch;

use crate::store::{Subscription, Waiters};

/// How long to wait before connecting again after a lost or refused connection.
const RECONNECT_DELAY: Duration = Duration::from_millis(100);

pub(super) struct Listener {
    pool: PgPool,
    channel: String,
    waiters: Waiters,
    /// Whether the connection is listening now. The task is started on the first subscription,
    /// inside its runtime, and again on the next subscription after that runtime shut down
    /// (the task went with it): a store shared by runtimes one after another still wakes its
    /// waiters.
    listening: Mutex<Option<watch::Receiver<bool>>>,
}

impl Listener {
    pub(super) fn new(pool: PgPool, channel: String) -> Self {
        Self { pool, channel, waiters: Waiters::default(), listening: Mutex::new(None) }
    }

    /// Registers a waiter for `key`, and returns once the connection listens, or after
    /// `timeout` (the waiter's deadline then decides).
    pub(super) async fn subscribe(&self, key: &str, timeout: Duration) -> Subscription {
        let (subscription, _) = self.waiters.register(key, None);
        let mut listening = {
            let mut listening = self.listening.lock().unwrap_or_else(PoisonError::into_inner);
            match listening.as_ref().filter(|running| running.has_changed().is_ok()) {
                Some(running) => running.clone(),
                None => listening.insert(self.start()).clone(),
            }
        };
        if tokio::time::timeout(timeout, listening.wait_for(|listening| *listening)).await.is_err()
        {
            tracing::warn!(
                "idempotency: the settle listener is not connected; waiting on the deadline"
            );
        }
        subscription
    }

    fn start(&self) -> watch::Receiver<bool> {
        let (listening, receiver) = watch::channel(false);
        let (pool, channel, waiters) =
            (self.pool.clone(), self.channel.clone(), self.waiters.clone());
        drop(tokio::spawn(async move {
            // The task ends when the store is gone: nobody holds a receiver any more.
            while !listening.is_closed() {
                let mut listener = match PgListener::connect_with(&pool).await {
                    Ok(listener) => listener,
                    Err(error) => {
                        tracing::warn!(%error, "idempotency: the settle listener cannot connect; retrying");
                        tokio::time::sleep(RECONNECT_DELAY).await;
                        continue;
                    }
                };
                if let Err(error) = listener.listen(&channel).await {
                    tracing::warn!(%error, "idempotency: LISTEN failed; retrying");
                    tokio::time::sleep(RECONNECT_DELAY).await;
                    continue;
                }
                listening.send_replace(true);
                // A settle may have come while no connection listened.
                waiters.notify_all();
                loop {
                    tokio::select! {
                        received = listener.try_recv() => match received {
                            Ok(Some(notification)) => waiters.notify(notification.payload()),
                            // The connection was lost.
                            Ok(None) | Err(_) => break,
                        },
                        () = listening.closed() => return,
                    }
                }
                listening.send_replace(false);
                waiters.notify_all();
                tokio::time::sleep(RECONNECT_DELAY).await;
            }
        }));
        receiver
    }
}
