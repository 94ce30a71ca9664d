//! The setters of the engine's [`Settings`](super::Settings), written once for every front
//! door's builder (as tower-http's `macros.rs` writes shared accessors once). A builder that
//! invokes [`engine_setters!`] has a `fn settings(&mut self) -> &mut Settings`.

/// The setters every door shares: the lease and its keep-alive, the retention, waiting for an
/// in-progress original, the task tracker, and the recovery hook's policy. "An operation" is
/// the HTTP door's handler or the consumer door's operation; "a duplicate" is a retried
/// request or a redelivered event.
macro_rules! engine_setters {
    () => {
        /// Sets how long a claim holds its key without renewal. Keep-alive renews it from the
        /// claim to the settle (see [`keep_alive`](Self::keep_alive)); a holder that stops
        /// renewing, because its process died, frees the key within one lease. Defaults to 10
        /// seconds for the HTTP layer (no longer than its wait, so that a waiting retry takes
        /// a dead holder's key over within the wait) and 30 seconds for the consumer door. A
        /// claim whose lease lapsed is kept for the recovery window, so that the next claim is
        /// a takeover, counted and traced as one. A duration too long for the clock saturates.
        pub fn lease(mut self, lease: std::time::Duration) -> Self {
            self.settings().lease = lease;
            self
        }

        /// Sets how long a completed outcome is kept for replay. Defaults to 24 hours; set it
        /// to at least how long your clients retry, or your broker redelivers.
        pub fn retention(mut self, retention: std::time::Duration) -> Self {
            self.settings().retention = retention;
            self
        }

        /// Renews the lease every third of a lease (every second at most) from the claim to the settle (the recovery
        /// hook, the operation, an HTTP response body), for at most `ceiling` from the claim;
        /// `None` turns renewal off. Past the ceiling, or without renewal, an operation that
        /// outlives its lease can be taken over by a duplicate, which then runs it again (the
        /// first holder's outcome is fenced out). Defaults to 5 minutes.
        pub fn keep_alive(mut self, ceiling: Option<std::time::Duration>) -> Self {
            self.settings().keep_alive = ceiling;
            self
        }

        /// Counts every claimed operation on `tracker` until it ends, so that a service
        /// shutting down can wait for the operations still running and the outcomes they store
        /// (`tracker.close(); tracker.wait().await`), and for what a claim leaves to finish
        /// in the background, so that no key stays held for a lease after the shutdown: a
        /// release the store failed, tried again for about a second; the abandon of a claim
        /// whose answer its caller never saw (its caller gone, or the store's timeout), tried
        /// for up to a lease while the store is down; and, while a service moves between
        /// namings, the let-go of the names a request does not run under. Close the tracker
        /// once the server has stopped taking requests and answered those it took (axum's
        /// graceful shutdown): a request still claiming holds no place on it until its claim
        /// is won. A claimed operation runs in its caller's
        /// task, and in a task of its own once the caller goes away, with a tracker or without:
        /// a caller that goes away does not cancel it.
        pub fn task_tracker(mut self, tracker: tokio_util::task::TaskTracker) -> Self {
            self.settings().tasks = Some(tracker);
            self
        }

        /// Sets how a duplicate whose original is still running waits for it: see
        /// [`Waiting`](crate::settings::Waiting). The HTTP layer waits up to 10 seconds by
        /// default; the consumer door does not wait by default.
        pub fn waiting(mut self, waiting: crate::settings::Waiting) -> Self {
            let settings = self.settings();
            settings.wait = waiting.wait;
            settings.waiters =
                std::sync::Arc::new(tokio::sync::Semaphore::new(waiting.max_waiters));
            settings.retry_after = waiting.retry_after;
            self
        }

        /// Sets when and how the recovery hook is asked: its window, on every claim or only
        /// on a takeover, its timeout, what a failure does. See
        /// [`Recovery`](crate::settings::Recovery). It sets the whole group: what the value
        /// leaves out is back to its default (a `DurableOutcomes` hook is asked on every claim
        /// whatever it says).
        pub fn recovery(mut self, recovery: crate::settings::Recovery) -> Self {
            self.settings().recovery = recovery;
            self
        }

        /// Encrypts every outcome this door stores, at rest, under `keyring`'s newest key:
        /// in the record store, in a commit of the operation's own transaction, in
        /// `DurableOutcomes`; and reads each back under the key its id names. A record under
        /// a key id the keyring does not list, or that fails authentication, is never replayed
        /// and never run again (HTTP: 500 `corrupt-record`; consumer: the store error), and
        /// the error log names its key hash. See [`encryption`](crate::encryption).
        #[cfg(feature = "encryption")]
        pub fn encrypt_at_rest(mut self, keyring: crate::encryption::Keyring) -> Self {
            self.settings().at_rest = crate::at_rest::AtRest::encrypted(keyring);
            self
        }

        /// Names records in the store with keyed hashes (HMAC-SHA256 under a secret), so that
        /// what is stored cannot confirm a guessed key or request, or moves a running service
        /// from one naming to another. Plain SHA-256 by default. See
        /// [`hashing`](crate::hashing): turning it on in a running service takes three deploys.
        pub fn hashing(mut self, hashing: crate::hashing::Hashing) -> Self {
            self.settings().hashing = hashing;
            self
        }
    };
}

pub(crate) use engine_setters;

/// A middleware's accessors to the service it wraps (as tower-http's
/// `define_inner_service_accessors!`), for a service struct with an `inner` field.
macro_rules! inner_service_accessors {
    () => {
        /// The wrapped service.
        pub fn get_ref(&self) -> &S {
            &self.inner
        }

        /// The wrapped service, mutably.
        pub fn get_mut(&mut self) -> &mut S {
            &mut self.inner
        }

        /// The wrapped service, unwrapped.
        pub fn into_inner(self) -> S {
            self.inner
        }
    };
}

pub(crate) use inner_service_accessors;
