//! The setters of the engine's [`Settings`](super::Settings), written once for every front
//! door's builder (as tower-http's `macros.rs` writes shared accessors once). A builder that
//! invokes [`engine_setters!`] has a `fn settings(&mut self) -> &mut Settings`.

/// The setters both doors share: the lease and its keep-alive, the retention, waiting for an
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

        /// Releases the key of an outcome too large to keep (an HTTP response whose headers
        /// or body are over the stored limits, a stream whose copy went past them; a consumer
        /// result over its stored limit), as earlier versions did, so that a retry runs the
        /// operation again. **The risk:** a client whose answer was lost on the way retries,
        /// and the side effect happens twice. Defaults to `false`: the key keeps a small
        /// "completed, not replayable" record (the status and the reason, no body), and every
        /// retry is answered 500 problem+json `response-not-replayable` (the consumer door:
        /// `Error::ResultNotStored`), never by running the operation again.
        pub fn release_when_too_large(mut self, release: bool) -> Self {
            self.settings().release_too_large = release;
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
        /// (`tracker.close(); tracker.wait().await`). A claimed operation runs in its caller's
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

        /// Sets how long after its lease a lapsed claim is remembered, so that a duplicate in
        /// that window is a takeover and asks the recovery hook. After it the record is gone
        /// and a duplicate runs as new. Defaults to the [`retention`](Self::retention). Only
        /// used with a hook.
        pub fn recovery_window(mut self, window: std::time::Duration) -> Self {
            self.settings().recovery.window = Some(window);
            self
        }

        /// Asks the recovery hook on every claim, not only on a takeover: for a store that may
        /// lose records (Redis restarted without persistence, a failover that lost writes, a
        /// `MemoryStore` across a restart). Costs one hook lookup per new operation. Off by
        /// default.
        pub fn recover_every_claim(mut self, every: bool) -> Self {
            self.settings().recovery.every_claim = every;
            self
        }

        /// Sets the longest the recovery hook may take; past it, recovery has failed.
        /// Defaults to 5 seconds.
        pub fn recovery_timeout(mut self, timeout: std::time::Duration) -> Self {
            self.settings().recovery.timeout = timeout;
            self
        }

        /// When the recovery hook fails, runs the operation anyway (logged at error level and
        /// counted) instead of refusing it (HTTP: 503; consumer: `Error::Recovery`). Defaults
        /// to `false`: a payment is better refused than run twice.
        pub fn run_when_recovery_fails(mut self, run: bool) -> Self {
            self.settings().recovery.run_on_failure = run;
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
    };
}

pub(crate) use engine_setters;
