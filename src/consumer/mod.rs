//! The consumer front door: [`Idempotent`], for code that is not behind HTTP.
//!
//! A queue consumer, a webhook receiver or a job runner gets the same claim, fencing,
//! keep-alive and replay as [`IdempotencyLayer`](crate::IdempotencyLayer), over the same
//! stores: the operation runs once per key and scope, and every redelivery gets its stored
//! result back through serde.
//!
//! ```
//! use std::time::Duration;
//! use axum_idempotency::{Idempotent, MemoryStore, consumer::Outcome};
//!
//! #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
//! struct Receipt { charge: String }
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let idem = Idempotent::new(MemoryStore::new()).retention(Duration::from_secs(7 * 24 * 3600));
//! let event_id = "evt_1";
//! let payload = br#"{"amount":100}"#;
//! for delivery in 0..2 {
//!     let outcome = idem
//!         .run("payments-consumer", event_id, payload, |_context| async {
//!             Ok::<_, std::io::Error>(Receipt { charge: "ch_1".into() }) // the side effect
//!         })
//!         .await?;
//!     match outcome {
//!         Outcome::Ran(receipt) => assert_eq!(delivery, 0),
//!         Outcome::Replayed(receipt) => assert_eq!(receipt.charge, "ch_1"),
//!         Outcome::InProgress { .. } => { /* another worker holds it: requeue later */ }
//!         Outcome::Mismatch => { /* same id, other payload: dead-letter */ }
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! - **key and scope** are the caller's: the event id, and the consumer's name, so that two
//!   consumers of one topic each process an event once.
//! - **the fingerprint** is SHA-256 of the payload bytes the caller passes, or of its RFC 8785
//!   canonical JSON ([`canonical_json`](Idempotent::canonical_json), with members left out by
//!   [`ignore_json_member`](Idempotent::ignore_json_member)), or the app's own
//!   ([`fingerprint_with`](Idempotent::fingerprint_with)): the same id with another payload is
//!   [`Outcome::Mismatch`].
//! - **the operation** runs with its lease renewed, and runs on if the caller goes away. `Ok`
//!   is stored (as JSON) and replayed. `Err` releases the key, so a redelivery runs it again,
//!   and comes back as [`Error::Operation`]. A failure that must not be retried (a declined
//!   card) is a result: return it inside `Ok` (`T = Result<Receipt, Declined>`), and it is
//!   stored and replayed like any other. A panic releases the key and is resumed in the caller.
//! - **store errors** are errors ([`Error::Store`]): nothing runs without its claim.
//! - **the context** ([`IdempotencyContext`]) is the operation's argument: write its key hash
//!   with the outcome, in the transaction of the side effect, so that a
//!   [`recover`](Idempotent::recover) hook can find the outcome when a worker died before its
//!   result was stored.
//!
//! [`IdempotencyContext`]: crate::IdempotencyContext

mod commit;
mod door;
mod finite;
mod operate;
mod outcome;
mod record;

use std::{fmt, future::Future, marker::PhantomData, sync::Arc};

use bytes::Bytes;
use serde::{Serialize, de::DeserializeOwned};

use self::door::ConsumerDoor;
pub use self::operate::Operator;
pub use self::outcome::{Error, Outcome};
use self::record::decode;
use crate::{
    context::IdempotencyContext,
    engine::{
        Claiming, Decided, Ended, Engine, Label, Operated, RenewalsCell, Settings, Start,
        engine_setters,
    },
    fingerprint::{Fingerprint, PayloadRules, payload_rule_setters},
    recovery::{Lookup, NoRecovery, Recover},
    store::{Store, StoreError},
};

/// Runs operations once per key and scope, and replays their results: the consumer door.
///
/// Cloning is cheap; clones share the store and the recovery hook. The [module](self) has a
/// shorter walk through the same.
///
#[doc = include_str!("../docs/consumer.md")]
#[must_use]
pub struct Idempotent<St, H = NoRecovery> {
    store: St,
    settings: Arc<Settings>,
    fingerprint: PayloadFingerprint,
    prefix: String,
    stored_limit: usize,
    hook: Option<Arc<H>>,
    /// Where the leases of this door's running operations are renewed.
    renewals: RenewalsCell<St>,
}

impl<St: Clone, H> Clone for Idempotent<St, H> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            settings: self.settings.clone(),
            fingerprint: self.fingerprint.clone(),
            prefix: self.prefix.clone(),
            stored_limit: self.stored_limit,
            hook: self.hook.clone(),
            renewals: self.renewals.clone(),
        }
    }
}

impl<St: fmt::Debug, H> fmt::Debug for Idempotent<St, H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotent")
            .field("store", &self.store)
            .field("settings", &self.settings)
            .field("payload_rules", &self.fingerprint.rules)
            .field("fingerprint_with", &self.fingerprint.custom.is_some())
            .field("prefix", &self.prefix)
            .field("stored_limit", &self.stored_limit)
            .field("recovers", &self.hook.is_some())
            .finish()
    }
}

/// How the consumer door fingerprints a payload: through the payload rules, or with the app's
/// own function.
#[derive(Clone, Default)]
struct PayloadFingerprint {
    rules: PayloadRules,
    custom: Option<Arc<MakePayloadFingerprint>>,
}

/// The app's own fingerprint function ([`Idempotent::fingerprint_with`]).
type MakePayloadFingerprint = dyn Fn(&[u8]) -> Fingerprint + Send + Sync;

impl PayloadFingerprint {
    fn of(&self, payload: &[u8]) -> Fingerprint {
        match &self.custom {
            Some(custom) => custom(payload),
            None => Fingerprint::of_payload(&self.rules.apply(payload)),
        }
    }
}

impl<St: Store> Idempotent<St> {
    /// Records in `store`, with the default settings.
    pub fn new(store: St) -> Self {
        Self {
            store,
            settings: Arc::new(Settings::default()),
            fingerprint: PayloadFingerprint::default(),
            prefix: "idempotency-consumer".to_owned(),
            stored_limit: 1024 * 1024,
            hook: None,
            renewals: RenewalsCell::default(),
        }
    }
}

impl<St: Store, H> Idempotent<St, H> {
    /// Asks `hook` before an operation runs again after a takeover: when a delivery finds the
    /// same event's lease lapsed (its worker died, perhaps after its side effect committed),
    /// the hook looks it up in the system of record, given the [`IdempotencyContext`] and the
    /// payload. [`Recovered::Happened`] is stored and returned as [`Outcome::Replayed`]
    /// without running the operation; [`Recovered::Unknown`] runs it; a failed hook is
    /// [`Error::Recovery`] and runs nothing.
    ///
    /// The hook answers for one result type: `run` then takes operations of that type.
    ///
    /// [`Recovered::Happened`]: crate::recovery::Recovered::Happened
    /// [`Recovered::Unknown`]: crate::recovery::Recovered::Unknown
    ///
    /// `DurableOutcomes` is such a hook (feature `postgres`): `.recover(outcomes)` answers a
    /// takeover, a lapsed lease or a record the record store lost from the outcomes the
    /// operations committed to it, asked on every claim.
    pub fn recover<H2>(self, hook: H2) -> Idempotent<St, H2> {
        let Self { store, mut settings, fingerprint, prefix, stored_limit, .. } = self;
        Arc::make_mut(&mut settings).recovering = true;
        let (hook, renewals) = (Some(Arc::new(hook)), RenewalsCell::default());
        Idempotent { store, settings, fingerprint, prefix, stored_limit, hook, renewals }
    }

    fn settings(&mut self) -> &mut Settings {
        // New settings, new renewals: a lease changed after an operation ran is renewed as set.
        self.renewals = RenewalsCell::default();
        // And a fleet of their own: what the door announces changes with them.
        let settings = Arc::make_mut(&mut self.settings);
        settings.fleet = Arc::default();
        settings
    }

    fn payload_rules(&mut self) -> &mut PayloadRules {
        &mut self.fingerprint.rules
    }

    engine_setters!();

    payload_rule_setters!();

    /// Fingerprints payloads with the app's own function instead: a redelivery whose
    /// fingerprint differs is [`Outcome::Mismatch`]. The payload rules
    /// ([`canonical_json`](Self::canonical_json),
    /// [`ignore_json_member`](Self::ignore_json_member)) no longer apply.
    ///
    /// ```
    /// use axum_idempotency::{Fingerprint, Idempotent, MemoryStore};
    ///
    /// // Only the event's `amount`: a broker's envelope may change between deliveries.
    /// let idem = Idempotent::new(MemoryStore::new()).fingerprint_with(|payload: &[u8]| {
    ///     let json: serde_json::Value = serde_json::from_slice(payload).unwrap_or_default();
    ///     Fingerprint::of_payload(json["amount"].to_string().as_bytes())
    /// });
    /// ```
    pub fn fingerprint_with(
        mut self,
        make: impl Fn(&[u8]) -> Fingerprint + Send + Sync + 'static,
    ) -> Self {
        self.fingerprint.custom = Some(Arc::new(make));
        self
    }

    /// Sets the prefix of every record key in the store. Defaults to `idempotency-consumer`.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Sets the largest encoded result stored, in bytes. A larger one is returned to the
    /// caller, and its key keeps a record that the operation ran: every redelivery gets
    /// [`Error::ResultNotStored`], and the operation does not run again
    /// ([`release_when_too_large`](Self::release_when_too_large) releases the key instead).
    /// Defaults to 1 MiB.
    pub fn stored_limit(mut self, bytes: usize) -> Self {
        self.stored_limit = bytes;
        self
    }

    /// Releases the key of a result over the [`stored_limit`](Self::stored_limit), so that a
    /// redelivery runs the operation again. **The risk:** a worker whose answer was lost
    /// redelivers, and the side effect happens twice. Defaults to `false`: the key keeps a
    /// record that the operation ran, and every redelivery gets [`Error::ResultNotStored`],
    /// never a second run.
    pub fn release_when_too_large(mut self, release: bool) -> Self {
        self.settings().release_too_large = release;
        self
    }

    /// Runs `operation` once for `key` in `scope`, or answers with what holds the key.
    ///
    /// `payload` is fingerprinted: a redelivery must carry the same bytes.
    ///
    /// # Errors
    ///
    /// [`Error::Operation`] when the operation failed (its key is released);
    /// [`Error::Store`] when the store could not be reached or holds a value this crate did not
    /// write (nothing ran); [`Error::Corrupt`] when the stored result does not deserialize into
    /// `T`; [`Error::ResultNotStored`] when the operation ran before but its result had no
    /// stored form; [`Error::EmptyKey`] for an empty key.
    ///
    /// A result that cannot be stored faithfully (serde fails on it, or it holds NaN or an
    /// infinity, which JSON would turn into `null`) is returned to this caller as
    /// [`Outcome::Ran`], and its key is completed with a record of that failure: the operation
    /// never runs again for the key, and every redelivery gets [`Error::ResultNotStored`]. A
    /// result over the [`stored_limit`](Self::stored_limit) is returned too, and its key
    /// completed the same way ([`release_when_too_large`](Self::release_when_too_large)
    /// releases it instead).
    ///
    /// # Panics
    ///
    /// When `operation` panics (when called, or in its future), or the result's `Serialize`
    /// does: the key is released and the panic resumed here.
    pub async fn run<T, E, F, Fut>(
        &self,
        scope: &str,
        key: impl AsRef<[u8]>,
        payload: impl AsRef<[u8]>,
        operation: F,
    ) -> Result<Outcome<T>, Error<E>>
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Send + 'static,
        F: FnOnce(IdempotencyContext) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        H: Recover<Bytes, T>,
    {
        if key.as_ref().is_empty() {
            return Err(Error::EmptyKey);
        }
        let engine = Engine::new(self.store.clone(), self.settings.clone(), &self.renewals);
        let named = engine
            .name(self.record_key(scope, key.as_ref()), self.fingerprint.of(payload.as_ref()));
        let hash = named.key.hash().to_owned();
        // The metrics' label, and the name a record this door cannot read is logged under.
        let label = Label::scope(scope);
        let door = ConsumerDoor {
            stored_limit: self.stored_limit,
            label: label.clone(),
            durable: self.hook.as_ref().and_then(|hook| hook.durable()),
            result: PhantomData,
        };
        let (route, scope_bytes) = (label.clone(), scope.as_bytes().to_vec());
        let claiming = Claiming { named, route, scope: scope_bytes, wait_until: None };
        let start = |operation: F, context: IdempotencyContext, due: bool| {
            let lookup = self.hook.as_ref().filter(|_| due).map(|hook| {
                let (hook, payload) = (hook.clone(), Bytes::copy_from_slice(payload.as_ref()));
                let lookup = Lookup::new(context.clone(), Some(payload));
                // Called inside the hook's future, so that a hook that panics when called is
                // caught like one that panics later.
                async move { hook.recover(lookup).await }
            });
            // Called inside the guarded future: a closure that panics before it returns its
            // future releases the key like any other panic of the operation.
            Start { operation: async move { operation(context).await }, lookup }
        };
        match engine.operate(door, claiming, operation, start).await {
            Operated::Decided(_, Decided::Replay(stored)) => {
                decode(stored, &hash, &label).map(Outcome::Replayed)
            }
            Operated::Decided(_, Decided::InProgress { retry_after }) => {
                Ok(Outcome::InProgress { retry_after })
            }
            // A record this door cannot read (tampered with, sealed under a key the keyring no
            // longer lists): its own error, so that a consumer that redelivers on store errors
            // does not redeliver it forever.
            Operated::Decided(_, Decided::Failed(StoreError::CorruptRecord(reason))) => {
                Err(Error::Corrupt { key_hash: hash, reason })
            }
            Operated::Decided(_, Decided::Failed(error)) => Err(Error::Store(error)),
            Operated::Ended(Ended::Answered(outcome)) => Ok(outcome),
            Operated::Ended(Ended::Failed(error)) => Err(Error::Operation(error)),
            Operated::Ended(Ended::Refused) => Err(Error::Recovery),
            Operated::Ended(Ended::Mismatch) => Ok(Outcome::Mismatch),
            Operated::Ended(Ended::Cancelled) => Err(Error::Cancelled),
        }
    }
}
