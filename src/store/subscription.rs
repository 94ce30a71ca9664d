//! Waiting for a key to settle without polling: [`Subscription`], and the registry of keys that
//! have waiters in this process.

use std::{
    collections::HashMap,
    fmt,
    sync::{Arc, Mutex, PoisonError},
};

use tokio::sync::watch;

/// A waiter's interest in one key: [`settled`](Self::settled) resolves once the key's record
/// is completed or released after the subscription was made.
///
/// Dropping it withdraws the interest; the store stops listening for the key when its last
/// waiter in this process leaves.
pub struct Subscription {
    settles: Option<watch::Receiver<u64>>,
    _registration: Option<Registration>,
}

impl fmt::Debug for Subscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscription").field("live", &self.settles.is_some()).finish()
    }
}

impl Subscription {
    /// A subscription that never hears of a settle: for a store that cannot notify. A waiter
    /// holding it waits out its deadline, then claims once more.
    #[must_use]
    pub fn unsupported() -> Self {
        Self { settles: None, _registration: None }
    }

    /// Whether a settle can wake it: false for [`unsupported`](Self::unsupported), whose
    /// waiters the engine polls instead.
    #[must_use]
    pub fn is_live(&self) -> bool {
        self.settles.is_some()
    }

    /// Resolves when the key settles. Never resolves when the store lost its way to tell
    /// (the deadline of the waiter decides then).
    pub async fn settled(&mut self) {
        if let Some(settles) = &mut self.settles
            && settles.changed().await.is_ok()
        {
            return;
        }
        std::future::pending::<()>().await;
    }
}

/// The keys with waiters in this process, each with a counter bumped on every settle: what a
/// [`Store`](super::Store) needs to implement [`subscribe`](super::Store::subscribe).
///
/// A store keeps one, shared by its clones. `subscribe` [`register`](Self::register)s the
/// waiter under a channel named after the key; whatever learns of a settle (the store's own
/// `complete` and `release`, or a message from its backend) [`notify`](Self::notify)s that
/// channel.
///
/// ```
/// use axum_idempotency::store::{RecordKey, Waiters};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let waiters = Waiters::default();
/// let key = RecordKey::new("idempotency", b"tenant", b"k1");
/// let (mut subscription, first) = waiters.register(key.as_str(), None);
/// assert!(first); // the first waiter of the key: start listening to the backend here
/// waiters.notify(key.as_str()); // in `complete` or `release` of the key
/// subscription.settled().await;
/// # }
/// ```
#[derive(Clone, Default)]
pub struct Waiters {
    keys: Arc<Mutex<HashMap<String, Waited>>>,
}

struct Waited {
    waiters: usize,
    settles: watch::Sender<u64>,
}

impl fmt::Debug for Waiters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Waiters").field("keys", &self.lock().len()).finish()
    }
}

/// Called with a channel when its last waiter left, so that a store can stop listening.
pub type OnLastLeave = Arc<dyn Fn(&str) + Send + Sync>;

struct Registration {
    waiters: Waiters,
    channel: String,
    on_last_leave: Option<OnLastLeave>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let last = {
            let mut keys = self.waiters.lock();
            match keys.get_mut(&self.channel) {
                Some(waited) if waited.waiters > 1 => {
                    waited.waiters -= 1;
                    false
                }
                Some(_) => {
                    keys.remove(&self.channel);
                    true
                }
                None => false,
            }
        };
        if let (true, Some(on_last_leave)) = (last, &self.on_last_leave) {
            on_last_leave(&self.channel);
        }
    }
}

impl Waiters {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Waited>> {
        // Every critical section leaves the map consistent.
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers a waiter for `channel`. The boolean is true for the first waiter of the
    /// channel: the store starts listening for it then. `on_last_leave` is called with the
    /// channel when its last waiter drops its [`Subscription`], so that the store can stop.
    #[must_use]
    pub fn register(
        &self,
        channel: &str,
        on_last_leave: Option<OnLastLeave>,
    ) -> (Subscription, bool) {
        let (settles, first) = {
            let mut keys = self.lock();
            match keys.get_mut(channel) {
                Some(waited) => {
                    waited.waiters += 1;
                    (waited.settles.subscribe(), false)
                }
                None => {
                    let (settles, receiver) = watch::channel(0);
                    keys.insert(channel.to_owned(), Waited { waiters: 1, settles });
                    (receiver, true)
                }
            }
        };
        let registration =
            Registration { waiters: self.clone(), channel: channel.to_owned(), on_last_leave };
        (Subscription { settles: Some(settles), _registration: Some(registration) }, first)
    }

    /// Wakes every waiter of `channel`.
    pub fn notify(&self, channel: &str) {
        if let Some(waited) = self.lock().get(channel) {
            waited.settles.send_modify(|settles| *settles += 1);
        }
    }

    /// Wakes every waiter of every channel: after a lost connection, a settle may have been
    /// missed, and a woken waiter claims once more to find out.
    pub fn notify_all(&self) {
        for waited in self.lock().values() {
            waited.settles.send_modify(|settles| *settles += 1);
        }
    }

    /// The channels with waiters now.
    #[must_use]
    pub fn channels(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    /// Whether `channel` has a waiter now.
    #[must_use]
    pub fn is_waited(&self, channel: &str) -> bool {
        self.lock().contains_key(channel)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::{sync::atomic::AtomicUsize, time::Duration};

    #[tokio::test]
    async fn a_settle_wakes_every_waiter_and_the_last_to_leave_is_reported() {
        let waiters = Waiters::default();
        let left = Arc::new(AtomicUsize::new(0));
        let on_leave: OnLastLeave = {
            let left = left.clone();
            Arc::new(move |_| {
                left.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            })
        };
        let (mut a, first_a) = waiters.register("k", Some(on_leave.clone()));
        let (mut b, first_b) = waiters.register("k", Some(on_leave));
        assert!(first_a && !first_b);
        waiters.notify("k");
        tokio::time::timeout(Duration::from_secs(1), a.settled()).await.unwrap();
        tokio::time::timeout(Duration::from_secs(1), b.settled()).await.unwrap();
        // Nothing more happened: a second wait does not resolve.
        assert!(tokio::time::timeout(Duration::from_millis(20), a.settled()).await.is_err());
        drop(a);
        assert_eq!(left.load(std::sync::atomic::Ordering::SeqCst), 0);
        assert!(waiters.is_waited("k"));
        drop(b);
        assert_eq!(left.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert!(!waiters.is_waited("k"));
    }
}
