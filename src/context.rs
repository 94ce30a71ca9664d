//! [`IdempotencyContext`]: who a claimed operation is, as its handler, its consumer operation
//! and its recovery hook see it.

use std::{fmt, sync::Arc, time::Duration};

use axum::response::Response;
use bytes::Bytes;
use futures_util::future::BoxFuture;

use crate::{
    at_rest::AtRest,
    fingerprint::Fingerprint,
    hashing::Named,
    key::RecordKey,
    store::{CommitSlot, EncodeError, EncodedOutcome, Lease, OwnerToken},
};

/// How a front door stores an outcome an operation commits in a store's transaction
/// ([`Committable`](crate::store::Committable)): each door's own encoding, so that the context
/// depends on no door.
///
/// Each kind of outcome is refused by default: a door encodes the kinds it stores.
pub(crate) trait Encoding: Send + Sync {
    /// `response` as the door stores it, and the response to answer (the same one).
    fn response(
        &self,
        _response: Response,
    ) -> BoxFuture<'static, Result<(Bytes, Response), EncodeError>> {
        Box::pin(async {
            Err(EncodeError::NotStored(
                "this door stores no HTTP responses: commit the outcome its door stores \
                 (the consumer door: axum::Json; the gRPC door: tonic::Response)",
            ))
        })
    }

    /// A value, serialized as `json`, as the door stores it.
    fn json(&self, _json: Bytes) -> Result<Bytes, EncodeError> {
        Err(EncodeError::NotStored(
            "this door stores no values (axum::Json): commit the outcome its door stores",
        ))
    }

    /// An outcome the door stored, read back as the HTTP response it answers; why not, for a
    /// record it cannot read or a door that stores no responses.
    #[allow(dead_code, reason = "read by the tables beside the stores (`durable`)")]
    fn read_response(&self, _stored: Bytes) -> Result<http::Response<Bytes>, String> {
        Err("this door stores no HTTP responses".to_owned())
    }

    /// An outcome the door stored, read back as the JSON of the value it answers; why not,
    /// for a record it cannot read or a door that stores no values.
    #[allow(dead_code, reason = "read by the tables beside the stores (`durable`)")]
    fn read_json(&self, _stored: Bytes) -> Result<Bytes, String> {
        Err("this door stores no values".to_owned())
    }

    /// A gRPC response, its `metadata` and its framed `message`, as the door stores it: the
    /// gRPC door's; every other door refuses it.
    #[cfg_attr(not(feature = "tonic"), allow(dead_code, reason = "the gRPC door's (`tonic`)"))]
    fn grpc(&self, _metadata: http::HeaderMap, _message: Bytes) -> Result<Bytes, EncodeError> {
        Err(EncodeError::NotStored("this door stores no gRPC responses"))
    }
}

/// Who a claimed operation is, for the operation itself and for its recovery: the scope, the
/// record key's hash and the fingerprint.
///
/// The HTTP layer puts it in the request's extensions before the handler runs (it is an axum
/// extractor too); the consumer door passes it to the operation. Write the key hash into the
/// row that records the outcome (an outbox row, in the same transaction as the side effect),
/// so that a [`Recover`](crate::recovery::Recover) hook can find it; pass a [`derived_key`](Self::derived_key) to a
/// downstream provider as its own idempotency key.
///
/// Cloning is cheap. Over a store that commits outcomes in its transactions
/// ([`PostgresStore`](crate::store::PostgresStore), or a door that answers from
/// [`DurableOutcomes`](crate::durable::DurableOutcomes)), the door waits, once the operation
/// returned, for a transaction of its claim that runs (until it ends), and for a clone of its
/// context still alive (250 ms at most, the lease if shorter: a task spawned with it begins
/// its transaction at once); a transaction that begins later is refused. To keep something of
/// the context past the operation, keep that (the key hash, a derived key), not the context.
#[derive(Clone)]
pub struct IdempotencyContext {
    inner: Arc<Context>,
}

struct Context {
    scope: Vec<u8>,
    /// The record key the claim holds; its hash is the context's `key_hash`.
    key: RecordKey,
    fingerprint: Fingerprint,
    /// The same request's names under the naming a move goes to, while a service moves.
    alongside: Option<(RecordKey, Fingerprint)>,
    /// The plain record key, which no naming changes: what derived keys are derived from;
    /// unknown in a completer's context under keyed names.
    plain: Option<RecordKey>,
    taken_over: bool,
    /// What an outcome committed in a store's transaction needs (every door gives it to the
    /// operations they run; see `PostgresStore::transaction`).
    completion: Option<Completion>,
}

/// The claim an outcome committed in the operation's transaction settles.
pub(crate) struct Completion {
    pub(crate) owner: OwnerToken,
    /// During a move between namings: the owner token of the claim under the other names
    /// (the context's [`key_hash_alongside`](IdempotencyContext::key_hash_alongside)), which
    /// a store's transaction holds and completes too.
    #[allow(dead_code, reason = "read by the stores that run an operation's transaction")]
    pub(crate) other_owner: Option<OwnerToken>,
    pub(crate) retention: Duration,
    /// The claim's lease: a store that holds the key while the operation's transaction runs
    /// renews it before and after.
    #[allow(dead_code, reason = "read by the stores that run an operation's transaction")]
    pub(crate) lease: Lease,
    /// What became of the claim's transaction, once a store ran one.
    #[allow(dead_code, reason = "read by the stores that run an operation's transaction")]
    pub(crate) commit: Arc<CommitSlot>,
    /// How the door keeps outcomes in the store: a committed outcome is written so, and a
    /// durable outcome read back so.
    pub(crate) at_rest: AtRest,
    /// How the door encodes an outcome.
    pub(crate) encoding: Arc<dyn Encoding>,
    /// The door's recovery hook answers takeovers and lost records from the outcomes
    /// committed beside the record store ([`Recover::durable`](crate::recovery::Recover::durable)).
    #[allow(dead_code, reason = "read by the stores that run an operation's transaction")]
    pub(crate) durable: Option<DurableTable>,
}

impl Completion {
    /// The completion of a claim, sharing the holder's commit slot.
    pub(crate) fn new(
        (owner, other_owner): (OwnerToken, Option<OwnerToken>),
        (retention, lease): (Duration, Lease),
        commit: Arc<CommitSlot>,
        at_rest: AtRest,
        encoding: Arc<dyn Encoding>,
        durable: Option<DurableTable>,
    ) -> Self {
        commit.context_alive(true);
        Self { owner, other_owner, retention, lease, commit, at_rest, encoding, durable }
    }
}

/// Dropped with the last clone of the operation's context: the door's settle, which waits for
/// a transaction that may still begin on it, goes on.
impl Drop for Completion {
    fn drop(&mut self) {
        self.commit.context_alive(false);
    }
}

impl IdempotencyContext {
    pub(crate) fn new(
        scope: Vec<u8>,
        named: Named,
        taken_over: bool,
        completion: Option<Completion>,
    ) -> Self {
        let Named { key, fingerprint, next, plain } = named;
        let alongside = next.map(|next| (next.key, next.fingerprint));
        let context = Context { scope, key, fingerprint, alongside, plain, taken_over, completion };
        Self { inner: Arc::new(context) }
    }

    /// The request's record key and fingerprint as the claim holds them, then under the other
    /// naming while a service moves between two ([`crate::hashing`]): where a table beside the
    /// store looks for what the request committed.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn names(&self) -> impl Iterator<Item = (&RecordKey, &Fingerprint)> {
        let held = (&self.inner.key, &self.inner.fingerprint);
        std::iter::once(held).chain(self.inner.alongside.as_ref().map(|(key, fp)| (key, fp)))
    }

    pub(crate) fn key(&self) -> &RecordKey {
        &self.inner.key
    }

    pub(crate) fn completion(&self) -> Option<&Completion> {
        self.inner.completion.as_ref()
    }

    /// `outcome`, encoded by the operation's front door, for a store to commit in the
    /// operation's transaction: the claim's key, owner token, fingerprint and retention with it.
    #[allow(dead_code, reason = "read by the stores that run an operation's transaction")]
    pub(crate) fn encoded(&self, outcome: Bytes) -> Result<EncodedOutcome, EncodeError> {
        let completion = self.completion().ok_or(EncodeError::NotClaimed)?;
        Ok(EncodedOutcome {
            key: self.key().clone(),
            owner: completion.owner.clone(),
            fingerprint: self.fingerprint().clone(),
            stored: completion.at_rest.seal(self.key(), self.fingerprint(), outcome.clone()),
            outcome,
            retention: completion.retention,
        })
    }

    /// During a move between namings, `outcome` encoded for the claim under the other names
    /// (see [`encoded`](Self::encoded)): a store's transaction commits both.
    #[allow(dead_code, reason = "read by the stores that run an operation's transaction")]
    pub(crate) fn encoded_other(
        &self,
        outcome: Bytes,
    ) -> Result<Option<EncodedOutcome>, EncodeError> {
        let completion = self.completion().ok_or(EncodeError::NotClaimed)?;
        let (Some((key, fingerprint)), Some(owner)) =
            (&self.inner.alongside, &completion.other_owner)
        else {
            return Ok(None);
        };
        Ok(Some(EncodedOutcome {
            key: key.clone(),
            owner: owner.clone(),
            fingerprint: fingerprint.clone(),
            stored: completion.at_rest.seal(key, fingerprint, outcome.clone()),
            outcome,
            retention: completion.retention,
        }))
    }

    /// The record key of the claim under the other names, during a move between namings.
    #[allow(dead_code, reason = "read by the stores that run an operation's transaction")]
    pub(crate) fn other_key(&self) -> Option<&RecordKey> {
        self.inner.alongside.as_ref().map(|(key, _)| key)
    }

    /// The claim's lease; ten seconds (the doors' default) for a context no door gave.
    #[allow(dead_code, reason = "read by the tables beside the stores (`durable`)")]
    pub(crate) fn lease(&self) -> Duration {
        self.completion().map_or(Duration::from_secs(10), |c| c.lease.duration)
    }

    /// How long the door keeps the claim's outcome; a day for a context no door gave.
    #[allow(dead_code, reason = "read by the tables beside the stores (`durable`)")]
    pub(crate) fn retention(&self) -> Duration {
        self.completion().map_or(Duration::from_secs(24 * 3600), |c| c.retention)
    }

    /// The scope the key was claimed in (a tenant, a user, a consumer's name); empty for the
    /// global scope.
    #[must_use]
    pub fn scope(&self) -> &[u8] {
        &self.inner.scope
    }

    /// The record's name in the store, in hex: unique per scope and key, never the raw key;
    /// the SHA-256 of the prefix, the scope and the key, or its HMAC under the door's secret
    /// with keyed names ([`crate::hashing`]). Store it with the outcome.
    ///
    /// While a service moves from one naming to another, it is the name the deploy completes
    /// first (the old one in the move's first deploy, the new one in its second: the one its
    /// outer neighbour reads), and the same request may have run under its other name on an
    /// instance of the neighbouring deploy: a hook that looks an outcome up by key hash looks
    /// under [`key_hash_alongside`](Self::key_hash_alongside) too (the crate's
    /// `DurableOutcomes` and `Checkpoints` do).
    #[must_use]
    pub fn key_hash(&self) -> &str {
        self.inner.key.hash()
    }

    /// The request's key hash under the other naming, while a service moves from one naming
    /// to another ([`Hashing::moving_to`](crate::hashing::Hashing::moving_to)); `None`
    /// otherwise.
    #[must_use]
    pub fn key_hash_alongside(&self) -> Option<&str> {
        self.inner.alongside.as_ref().map(|(key, _)| key.hash())
    }

    /// The request's fingerprint.
    #[must_use]
    pub fn fingerprint(&self) -> &Fingerprint {
        &self.inner.fingerprint
    }

    /// Whether this claim took over from a holder whose lease lapsed: the operation may have
    /// happened before, and the recovery hook (if any) did not know its outcome.
    #[must_use]
    pub fn is_takeover(&self) -> bool {
        self.inner.taken_over
    }

    /// A key for a downstream call made on this request's behalf (a payment provider's own
    /// idempotency key): 64 hex characters, the same for every retry of this request, and
    /// different for each `purpose`.
    ///
    /// It is derived from the key's plain SHA-256 (its prefix, scope and key), whatever the
    /// naming ([`crate::hashing`]): a provider must get the same key for a retry on any
    /// instance, through a move to keyed names and through a rotation of their secret. A
    /// provider can therefore confirm a guessed idempotency key against it.
    ///
    /// `Some` in every context a door gives an operation or its recovery hook. `None` only in
    /// the context a [`Completer`](crate::completer::Completer) gives its hook for a claim under
    /// keyed names: the store keeps no plain digest of a keyed name, and a key derived from
    /// anything else would not be the one the operation passed its provider (a hook that
    /// re-sent the call under it would run it again). Answer such a claim from your own records,
    /// by [`key_hash`](Self::key_hash), or leave it `Unknown`.
    ///
    /// ```
    /// use axum_idempotency::{Idempotent, MemoryStore};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let idem = Idempotent::new(MemoryStore::new());
    /// let outcome = idem
    ///     .run("payments", "evt_1", b"{}", |context| async move {
    ///         // Pass this to the payment provider as its own idempotency key.
    ///         Ok::<_, std::io::Error>(context.derived_key("stripe-charge"))
    ///     })
    ///     .await
    ///     .unwrap();
    /// let charge_key = outcome.into_result().unwrap().expect("an operation's context derives keys");
    /// assert_eq!(charge_key.len(), 64);
    /// # }
    /// ```
    #[must_use]
    pub fn derived_key(&self, purpose: &str) -> Option<String> {
        let plain = self.inner.plain.as_ref()?.hash();
        let digest = Fingerprint::of_fields(&[plain.as_bytes(), purpose.as_bytes()]);
        Some(digest.as_bytes().iter().map(|byte| format!("{byte:02x}")).collect())
    }
}

impl fmt::Debug for IdempotencyContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyContext")
            .field("scope", &String::from_utf8_lossy(&self.inner.scope))
            .field("key_hash", &self.key_hash())
            .field("taken_over", &self.inner.taken_over)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_keys_are_stable_per_request_and_differ_per_purpose() {
        let key = RecordKey::new("p", b"tenant", b"k1");
        let fingerprint = Fingerprint::of_payload(b"{}");
        let named = Named::stored(key.clone(), fingerprint.clone(), &Default::default());
        let context = IdempotencyContext::new(b"tenant".to_vec(), named.clone(), false, None);
        let again = IdempotencyContext::new(b"tenant".to_vec(), named, true, None);
        assert_eq!(context.derived_key("charge"), again.derived_key("charge"));
        assert_ne!(context.derived_key("charge"), context.derived_key("refund"));
        let charge = context.derived_key("charge").unwrap();
        assert_eq!(charge.len(), 64);
        assert!(charge.bytes().all(|b| b.is_ascii_hexdigit()));
        let keyed = crate::hashing::Hashing::keyed([1; 32]);
        let listed = Named::stored(key.clone(), Fingerprint::of_payload(b"{}"), &keyed);
        let listed = IdempotencyContext::new(b"tenant".to_vec(), listed, true, None);
        assert_eq!(listed.derived_key("charge"), None, "no plain digest under keyed names");
        let other = RecordKey::new("p", b"tenant", b"k2");
        let other = Named::stored(other, fingerprint, &Default::default());
        let other = IdempotencyContext::new(b"tenant".to_vec(), other, false, None);
        assert_ne!(context.derived_key("charge"), other.derived_key("charge"));
        assert_eq!(context.key_hash(), key.hash());
        assert_eq!(context.scope(), b"tenant");
        assert!(!context.is_takeover() && again.is_takeover());
        let debug = format!("{context:?}");
        assert!(debug.contains(key.hash()) && debug.contains("tenant"), "{debug}");
    }
}

/// Which table beside the record store a durable hook answers from ([`Recover::durable`](crate::recovery::Recover::durable)): its
/// database (host, port, name) and its name. Made only by the crate's tables
/// (`DurableOutcomes`), so that an operation's commit into a table its door does not answer
/// from is refused, never accepted and lost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DurableTable(
    #[allow(dead_code, reason = "compared, and shown by Debug")] pub(crate) std::sync::Arc<str>,
);
