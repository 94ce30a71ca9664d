//! How a record is named in the store: the record key's hash and the stored fingerprint, plain
//! SHA-256 or keyed with a secret ([`Hashing`]), and how a running service moves from one to
//! the other.
//!
//! A plain name is SHA-256 over the prefix, the scope and the key, and a plain fingerprint
//! SHA-256 over the request: anyone who can read the store (or the logs, which name the key
//! hash) can confirm a guessed key or body by hashing it. Keyed, each is HMAC-SHA256 under a
//! secret of the service's, over the plain digest: without the secret, what is stored confirms
//! nothing. So are the names the crate's tables beside the stores keep (`DurableOutcomes`,
//! `Checkpoints`): the operation's [`key_hash`](crate::IdempotencyContext::key_hash) is the
//! keyed name. Its [`derived_key`](crate::IdempotencyContext::derived_key)s are not: they are
//! derived from the plain digest whatever the naming, so that a provider gets the same key for
//! a retry on any instance, through a move and a rotation (and a completer, which reads a
//! keyed name back from the store without its plain digest, gives its hook none).
//!
//! ```
//! use axum_idempotency::{IdempotencyLayer, MemoryStore, hashing::Hashing};
//!
//! # let secret = [7; 32];
//! // `secret`: 32 random bytes, kept as the encryption keyring's keys are.
//! let layer = IdempotencyLayer::new(MemoryStore::new()).hashing(Hashing::keyed(secret));
//! ```
//!
//! # Turning it on, or rotating the secret, in a running service
//!
//! A request is one record only while every instance names it alike: an instance that names
//! keys anew beside one that names them as before would run a retry of the other's request
//! again. [`alongside`](Hashing::alongside) bridges the two, in three deploys, each a rolling
//! one:
//!
//! 1. `Hashing::plain().alongside(Hashing::keyed(secret))?`: keys are still claimed under their
//!    plain names; after each claim, the keyed name is looked at too.
//! 2. Once no instance of the previous version runs:
//!    `Hashing::keyed(secret).alongside(Hashing::plain())?`: keys are claimed under their keyed
//!    names, and the plain name is looked at after each claim.
//! 3. Once the retention, the recovery window, the keep-alive ceiling and a lease, added up,
//!    have passed since the last instance of deploy 1 stopped (every record under a plain name
//!    has expired by then, the completed and the lapsed): `Hashing::keyed(secret)`.
//!
//! **Only neighbours may run side by side.** An instance before deploy 1 beside one of deploy
//! 2 (a deploy skipped, or a binary rolled back past deploy 1) can run a request twice: roll
//! back one deploy at a time, as you rolled forward.
//!
//! After each claim won under one name, the other is claimed for a moment and let go, with
//! what it held deciding: a completed request there is replayed, one running there is answered
//! as in progress (below), another request there is a mismatch, and a holder there whose lease
//! lapsed is taken over under that name. Nothing is copied from one name to the other: deploy 3
//! waits until every record under a plain name has expired.
//!
//! Two instances of deploys 1 and 2 each hold the name they claim while they look at the
//! other's: one of the two sees the other, and both may. Were both to let go, duplicates
//! meeting so in a burst could all be answered 202, the request never run. So the request whose
//! own name sorts first (both see the same two) keeps its claim and waits on the other name,
//! within its wait and a quarter of its lease. When the other name is let go, or left to a
//! claim that lapsed (which it takes over), it renews its own claim, fenced, and runs: a wait
//! past its lease, which let another request take its claim over and run under it, runs
//! nothing; a renewal the store fails is a store error (503), as is one it does not answer
//! within a third of the lease after such a takeover. When the request there completes, it replays it; otherwise
//! it answers what it found when its wait ended (in progress, or a mismatch). The request on
//! the other side is answered as in progress at once, as is every request when waiting is off
//! ([`Waiting::off`](crate::settings::Waiting::off): the consumer door's default) or too many
//! wait already; their clients' retries find the request run. A caller that goes away during
//! the look leaves nothing held; a claim that took a lapsed one over is handed back with its
//! lapse, not released, whatever the look finds that lets it go. Between deploys, each claim
//! won costs a claim and a release more (and the request kept through a collision, its wait
//! and a renewal). The plain names and fingerprints
//! are written until deploy 3 (deploy 1 claims under them, deploy 2's look claims there for a
//! moment), and the logs name them meanwhile: what is stored confirms no guess from deploy 3
//! on, once the records under plain names have expired.
//!
//! Meanwhile an operation may have started under either name: its context names the other
//! ([`key_hash_alongside`](crate::IdempotencyContext::key_hash_alongside)), and what looks an
//! outcome up by key hash looks under both. `DurableOutcomes` and `Checkpoints` do; so must a
//! recovery hook of your own over an outbox keyed by key hash.
//!
//! A secret is rotated the same way: `Hashing::keyed(old).alongside(Hashing::keyed(new))?`,
//! then `Hashing::keyed(new).alongside(Hashing::keyed(old))?`, then `Hashing::keyed(new)`.

use std::fmt;

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use crate::{fingerprint::Fingerprint, key::RecordKey};

/// How record keys and stored fingerprints are hashed: plain SHA-256 (the default) or
/// HMAC-SHA256 under a secret, and optionally the other names looked at after each claim while
/// a running service moves from one to the other (see [the module](self)).
///
/// Its `Debug` output never shows a secret.
#[derive(Clone, Default)]
pub struct Hashing {
    names: Names,
    alongside: Option<Names>,
}

/// One way of naming records.
#[derive(Clone, Default)]
pub(crate) enum Names {
    /// The plain digests.
    #[default]
    Plain,
    /// HMAC-SHA256 under a secret, keyed once; its state is cleared from memory when dropped.
    Keyed(Hmac<Sha256>),
}

impl Hashing {
    /// Plain SHA-256 names: the default, and the names records had before keyed hashing.
    #[must_use]
    pub fn plain() -> Self {
        Self::default()
    }

    /// Names keyed with `secret` (HMAC-SHA256): 32 random bytes, kept secret and kept for as
    /// long as the records they name. This copy of `secret` is cleared here.
    #[must_use]
    pub fn keyed(mut secret: [u8; 32]) -> Self {
        let mac = Hmac::<Sha256>::new_from_slice(&secret);
        zeroize_secret(&mut secret);
        match mac {
            Ok(mac) => Self { names: Names::Keyed(mac), alongside: None },
            // HMAC takes a key of any length: never reached.
            Err(_) => Self::default(),
        }
    }

    /// Also looks at `other`'s names after each claim: for the deploys that move a running
    /// service from one naming to another (see [the module](self)).
    ///
    /// # Errors
    ///
    /// [`HashingError::SameNames`] when `other` names records as `self` does (the same secret,
    /// or both plain); [`HashingError::Nested`] when `self` or `other` has names alongside
    /// already (a move is between two namings).
    pub fn alongside(mut self, other: Hashing) -> Result<Self, HashingError> {
        if other.alongside.is_some() || self.alongside.is_some() {
            return Err(HashingError::Nested);
        }
        let probe = Fingerprint::from_digest([0; 32]);
        if self.names.fingerprint(&probe) == other.names.fingerprint(&probe) {
            return Err(HashingError::SameNames);
        }
        self.alongside = Some(other.names);
        Ok(self)
    }

    /// Whether names are keyed with a secret.
    #[must_use]
    pub fn is_keyed(&self) -> bool {
        matches!(self.names, Names::Keyed(_))
    }

    /// The names a record is claimed and stored under, from the plain ones.
    pub(crate) fn name(&self, key: RecordKey, fingerprint: Fingerprint) -> Named {
        let alongside = self
            .alongside
            .as_ref()
            .map(|other| (other.record_key(&key), other.fingerprint(&fingerprint)));
        let plain = Some(key.clone());
        let (key, fingerprint) = match &self.names {
            Names::Plain => (key, fingerprint),
            names => (names.record_key(&key), names.fingerprint(&fingerprint)),
        };
        Named { key, fingerprint, alongside, plain }
    }

    /// The namings in use: the one claimed under, then the one alongside.
    pub(crate) fn namings(&self) -> impl Iterator<Item = &Names> {
        std::iter::once(&self.names).chain(&self.alongside)
    }

    /// The record keys of a plain one: the key claimed under, and the key alongside.
    pub(crate) fn record_keys(&self, plain: &RecordKey) -> (RecordKey, Option<RecordKey>) {
        (self.names.record_key(plain), self.alongside.as_ref().map(|other| other.record_key(plain)))
    }
}

/// A request's names in the store: the ones it is claimed under, and the ones looked at after
/// a claim while a service moves between namings; and its plain record key, which no naming
/// changes (the derived keys' source), when it is known.
#[derive(Debug, Clone)]
pub(crate) struct Named {
    pub(crate) key: RecordKey,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) alongside: Option<(RecordKey, Fingerprint)>,
    pub(crate) plain: Option<RecordKey>,
}

impl Named {
    /// The names of a record read back from the store (an abandoned claim): its own, the only
    /// ones known; its plain key only when `hashing` names nothing keyed (the store keeps no
    /// plain digest of a keyed name, and a listed name may be either during a move).
    pub(crate) fn stored(key: RecordKey, fingerprint: Fingerprint, hashing: &Hashing) -> Self {
        let all_plain = hashing.namings().all(|names| matches!(names, Names::Plain));
        Self { plain: all_plain.then(|| key.clone()), key, fingerprint, alongside: None }
    }

    /// The same request held under its names alongside: those become the names claimed under,
    /// and these the names alongside.
    pub(crate) fn swapped(self) -> Self {
        let Self { key, fingerprint, alongside, plain } = self;
        match alongside {
            Some((other_key, other_fingerprint)) => Self {
                key: other_key,
                fingerprint: other_fingerprint,
                alongside: Some((key, fingerprint)),
                plain,
            },
            None => Self { key, fingerprint, alongside: None, plain },
        }
    }
}

impl Names {
    /// The record key this naming gives a plain one.
    pub(crate) fn record_key(&self, plain: &RecordKey) -> RecordKey {
        match self {
            Self::Plain => plain.clone(),
            Self::Keyed(_) => {
                RecordKey::with_digest(plain.prefix(), &self.mac(b'K', plain.hash().as_bytes()))
            }
        }
    }

    /// The fingerprint this naming stores for a plain one.
    pub(crate) fn fingerprint(&self, plain: &Fingerprint) -> Fingerprint {
        match self {
            Self::Plain => plain.clone(),
            Self::Keyed(_) => Fingerprint::from_digest(self.mac(b'F', plain.as_bytes())),
        }
    }

    /// HMAC over `digest`, after a byte that tells a key's name from a fingerprint.
    fn mac(&self, kind: u8, digest: &[u8]) -> [u8; 32] {
        let Self::Keyed(keyed) = self else { return [0; 32] };
        let mut mac = keyed.clone();
        mac.update(&[kind]);
        mac.update(digest);
        mac.finalize().into_bytes().into()
    }
}

fn zeroize_secret(secret: &mut [u8; 32]) {
    use hmac::digest::zeroize::Zeroize;
    secret.zeroize();
}

impl fmt::Debug for Hashing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = |names: &Names| match names {
            Names::Plain => "plain",
            Names::Keyed(_) => "keyed",
        };
        f.debug_struct("Hashing")
            .field("names", &name(&self.names))
            .field("alongside", &self.alongside.as_ref().map(name))
            .finish()
    }
}

/// Why [`Hashing::alongside`] refused its names.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum HashingError {
    /// The names alongside are the names themselves: the look after each claim would find the
    /// claim itself, and answer every request as in progress.
    SameNames,
    /// The names or the names alongside have names alongside of their own: a move is between
    /// two namings.
    Nested,
}

impl fmt::Display for HashingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::SameNames => {
                "the names alongside are the names themselves (the same secret, or both plain)"
            }
            Self::Nested => {
                "a move is between two namings: one of them has names alongside already"
            }
        })
    }
}

impl std::error::Error for HashingError {}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain() -> (RecordKey, Fingerprint) {
        (RecordKey::new("p{x}", b"tenant", b"k1"), Fingerprint::new("POST", "/pay", "", b"{}"))
    }

    #[test]
    fn keyed_names_hide_the_plain_digests_and_depend_on_the_secret() {
        let (key, fingerprint) = plain();
        assert!(Hashing::keyed([1; 32]).is_keyed() && !Hashing::plain().is_keyed());
        let same = Hashing::plain().name(key.clone(), fingerprint.clone());
        assert_eq!((&same.key, &same.fingerprint), (&key, &fingerprint));
        let keyed = Hashing::keyed([1; 32]).name(key.clone(), fingerprint.clone());
        assert_ne!(keyed.key.hash(), key.hash());
        assert_eq!(keyed.key.prefix(), key.prefix(), "the prefix and its escapes are kept");
        assert!(keyed.key.as_str().starts_with("p%7Bx%7D:{"), "{}", keyed.key.as_str());
        assert_eq!(RecordKey::from_stored(keyed.key.as_str().to_owned()), Some(keyed.key.clone()));
        assert_ne!(keyed.fingerprint, fingerprint);
        let again = Hashing::keyed([1; 32]).name(key.clone(), fingerprint.clone());
        assert_eq!((&again.key, &again.fingerprint), (&keyed.key, &keyed.fingerprint));
        let other = Hashing::keyed([2; 32]).name(key, fingerprint);
        assert_ne!(other.key, keyed.key);
        assert_ne!(other.fingerprint, keyed.fingerprint);
        assert!(keyed.alongside.is_none());
    }

    #[test]
    fn alongside_names_the_other_way_and_refuses_the_same_or_nested() {
        let (key, fingerprint) = plain();
        let moving = Hashing::keyed([1; 32]).alongside(Hashing::plain()).unwrap();
        let named = moving.name(key.clone(), fingerprint.clone());
        assert_eq!(named.alongside, Some((key.clone(), fingerprint.clone())));
        let keyed = Hashing::keyed([1; 32]).name(key.clone(), fingerprint.clone());
        let back = Hashing::plain().alongside(Hashing::keyed([1; 32])).unwrap();
        assert_eq!(back.name(key, fingerprint).alongside, Some((keyed.key, keyed.fingerprint)));

        let same = Hashing::keyed([1; 32]).alongside(Hashing::keyed([1; 32]));
        assert_eq!(same.unwrap_err(), HashingError::SameNames);
        assert_eq!(
            Hashing::plain().alongside(Hashing::plain()).unwrap_err(),
            HashingError::SameNames
        );
        let nested = Hashing::keyed([1; 32]).alongside(moving).unwrap_err();
        assert_eq!(nested, HashingError::Nested);
        assert!(HashingError::SameNames.to_string().contains("the same secret, or both plain"));
        assert!(nested.to_string().contains("a move is between two namings"));
        let twice = Hashing::keyed([3; 32]).alongside(Hashing::plain()).unwrap();
        assert_eq!(twice.alongside(Hashing::keyed([4; 32])).unwrap_err(), HashingError::Nested);
        assert!(Hashing::keyed([3; 32]).alongside(Hashing::keyed([4; 32])).is_ok());
    }

    #[test]
    fn a_secret_is_never_printed() {
        let printed =
            format!("{:?}", Hashing::keyed([0xAB; 32]).alongside(Hashing::plain()).unwrap());
        assert_eq!(printed, r#"Hashing { names: "keyed", alongside: Some("plain") }"#);
    }
}
