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
//! A request is one record only while every instance names it alike. A move from one naming
//! to another is three rolling deploys, each beside its neighbours only:
//!
//! 1. `Hashing::plain().moving_to(Hashing::keyed(secret), Deploy::First)?`
//! 2. `Hashing::plain().moving_to(Hashing::keyed(secret), Deploy::Second)?`
//! 3. `Hashing::keyed(secret)`, once the retention, the recovery window, the keep-alive ceiling
//!    and a lease, added up, have passed since the last instance of deploy 1 stopped.
//!
//! Deploys 1 and 2 claim a request under the old names, then under the new ones, always in
//! that order, and hold both until the settle: a request running under either is seen by every
//! neighbour, and two instances never hold one name each (no tie to break). A response stored
//! under either is replayed (one found under the new names only is written under the old ones
//! too). The response is completed under both: under the old names first in deploy 1 (its
//! neighbour before it reads only those), under the new ones first in deploy 2. A crash
//! between two claims or two completes leaves a lapsed claim that the next claim takes over
//! under both names, not a name a neighbour takes over alone. A secret is rotated the same way,
//! `Hashing::keyed(old).moving_to(Hashing::keyed(new), ..)`.
//!
//! **Only neighbours may run side by side, and the store holds the fleet to it.** Each door
//! records in a registry beside its records (one key, or one row, per key prefix) the naming
//! it serves, and reads what the others record: when it first claims (or first claims after
//! an idle spell), then every third of a lease. It refuses its requests (503
//! `fleet-disagrees`, nothing run, whatever `fail_open` says;
//! [`StoreError::Misplaced`](crate::store::StoreError::Misplaced) from the consumer door;
//! the error log says which step is missing) when an instance runs beside it that cannot see
//! its records or whose records it cannot see: a deploy skipped, another secret mid-move, a
//! second move begun during the first's first deploy. It does not start while such records may
//! live, which makes a move's waits checked, not only written: deploy 3 starts once deploy 1's
//! records have expired (the retention, the recovery window, the keep-alive ceiling and a
//! lease after the last of its instances stopped); a rollback to the old naming alone, once
//! deploy 2's have. An instance that stopped is forgotten about a lease (three announcements)
//! after its last; start the next deploy after that. A door refused at start records nothing
//! lasting, and two that start at the same moment leave one serving. `check_fleet()` on a
//! door's operator asks the same at start, for a readiness check. Two services that share a
//! store and a key prefix are one fleet: give each door its own prefix. A store of your own
//! that keeps no registry ([`Store::announce`](crate::store::Store::announce) answers
//! `None`) is warned about once, and nothing is checked. An operator's `forget` through a door
//! that does not read every naming its fleet reads is refused: forget through a build of the
//! move, which forgets under both.
//!
//! Roll back one deploy at a time, as you rolled forward. Meanwhile a claim costs a claim and
//! a complete more, and an operation's context
//! names the request under the other naming too
//! ([`key_hash_alongside`](crate::IdempotencyContext::key_hash_alongside)): a recovery hook
//! of your own over an outbox keyed by key hash looks under both, as `DurableOutcomes` and
//! `Checkpoints` do.

use std::fmt;

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use crate::{fingerprint::Fingerprint, key::RecordKey};

/// How record keys and stored fingerprints are hashed: plain SHA-256 (the default) or
/// HMAC-SHA256 under a secret, or a deploy of a move from one to the other (see
/// [the module](self)).
///
/// Its `Debug` output never shows a secret.
#[derive(Clone, Default)]
pub struct Hashing {
    names: Names,
    /// During a move: the names moved to, and this build's deploy.
    next: Option<(Names, Deploy)>,
}

/// Which deploy of a move between two namings a build is ([`Hashing::moving_to`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Deploy {
    /// The first: runs beside instances of the old naming alone; completes under the old
    /// names first.
    First,
    /// The second: runs beside instances of the new naming alone; completes under the new
    /// names first.
    Second,
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
            Ok(mac) => Self { names: Names::Keyed(mac), next: None },
            // HMAC takes a key of any length: never reached.
            Err(_) => Self::default(),
        }
    }

    /// A deploy of the move from these names to `to`'s (see [the module](self)): a request
    /// is claimed under these names, then under `to`'s, and held and completed under both.
    ///
    /// # Errors
    ///
    /// [`HashingError::SameNames`] when `to` names records as `self` does (the same secret, or
    /// both plain); [`HashingError::Nested`] when `self` or `to` is a move already (a move is
    /// between two namings).
    pub fn moving_to(mut self, to: Hashing, deploy: Deploy) -> Result<Self, HashingError> {
        if to.next.is_some() || self.next.is_some() {
            return Err(HashingError::Nested);
        }
        let probe = Fingerprint::from_digest([0; 32]);
        if self.names.fingerprint(&probe) == to.names.fingerprint(&probe) {
            return Err(HashingError::SameNames);
        }
        self.next = Some((to.names, deploy));
        Ok(self)
    }

    /// Whether names are keyed with a secret.
    #[must_use]
    pub fn is_keyed(&self) -> bool {
        matches!(self.names, Names::Keyed(_))
    }

    /// The names a record is claimed and stored under, from the plain ones.
    pub(crate) fn name(&self, key: RecordKey, fingerprint: Fingerprint) -> Named {
        let next = self.next.as_ref().map(|(names, deploy)| Next {
            key: names.record_key(&key),
            fingerprint: names.fingerprint(&fingerprint),
            completed_first: *deploy == Deploy::Second,
        });
        let plain = Some(key.clone());
        let (key, fingerprint) = match &self.names {
            Names::Plain => (key, fingerprint),
            names => (names.record_key(&key), names.fingerprint(&fingerprint)),
        };
        Named { key, fingerprint, next, plain }
    }

    /// The deploy of a move this is, if it is one.
    pub(crate) fn deploy(&self) -> Option<Deploy> {
        self.next.as_ref().map(|(_, deploy)| *deploy)
    }

    /// The namings in use: the one moved from (or the only one), then the one moved to.
    pub(crate) fn namings(&self) -> impl Iterator<Item = &Names> {
        std::iter::once(&self.names).chain(self.next.as_ref().map(|(names, _)| names))
    }

    /// The record keys of a plain one: under the names claimed first, and under the names
    /// moved to.
    pub(crate) fn record_keys(&self, plain: &RecordKey) -> (RecordKey, Option<RecordKey>) {
        let next = self.next.as_ref().map(|(names, _)| names.record_key(plain));
        (self.names.record_key(plain), next)
    }
}

/// A request's names in the store: the ones it is claimed under first, and during a move the
/// names moved to, claimed second; and its plain record key, which no naming changes (the
/// derived keys' source), when it is known.
#[derive(Debug, Clone)]
pub(crate) struct Named {
    pub(crate) key: RecordKey,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) next: Option<Next>,
    pub(crate) plain: Option<RecordKey>,
}

/// A request's names under the naming a move goes to.
#[derive(Debug, Clone)]
pub(crate) struct Next {
    pub(crate) key: RecordKey,
    pub(crate) fingerprint: Fingerprint,
    /// Completed before the names claimed first ([`Deploy::Second`]).
    pub(crate) completed_first: bool,
}

impl Named {
    /// The names of a record read back from the store (an abandoned claim): its own, the only
    /// ones known; its plain key only when `hashing` names nothing keyed (the store keeps no
    /// plain digest of a keyed name, and a listed name may be either during a move).
    pub(crate) fn stored(key: RecordKey, fingerprint: Fingerprint, hashing: &Hashing) -> Self {
        let all_plain = hashing.namings().all(|names| matches!(names, Names::Plain));
        Self { plain: all_plain.then(|| key.clone()), key, fingerprint, next: None }
    }

    /// The names moved to, as a request's own (held by a claim of their own).
    pub(crate) fn next_names(&self) -> Option<Self> {
        let next = self.next.as_ref()?;
        let (key, fingerprint) = (next.key.clone(), next.fingerprint.clone());
        Some(Self { key, fingerprint, next: None, plain: self.plain.clone() })
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
            .field("moving_to", &self.next.as_ref().map(|(names, deploy)| (name(names), deploy)))
            .finish()
    }
}

/// Why [`Hashing::moving_to`] refused a move.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum HashingError {
    /// The names moved to are the names moved from: the second claim would find the first,
    /// and answer every request as in progress.
    SameNames,
    /// One of the two is a move already: a move is between two namings.
    Nested,
}

impl fmt::Display for HashingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::SameNames => "a move to the names moved from (the same secret, or both plain)",
            Self::Nested => "a move is between two namings: one of them is a move already",
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
        assert!(keyed.next.is_none());
    }

    #[test]
    fn a_move_names_the_new_way_second_and_refuses_the_same_or_nested() {
        let (key, fingerprint) = plain();
        let keyed = Hashing::keyed([1; 32]).name(key.clone(), fingerprint.clone());
        for (deploy, completed_first) in [(Deploy::First, false), (Deploy::Second, true)] {
            let moving = Hashing::plain().moving_to(Hashing::keyed([1; 32]), deploy).unwrap();
            let named = moving.name(key.clone(), fingerprint.clone());
            assert_eq!((&named.key, &named.fingerprint), (&key, &fingerprint));
            let next = named.next.as_ref().unwrap();
            assert_eq!((&next.key, &next.fingerprint), (&keyed.key, &keyed.fingerprint));
            assert_eq!(next.completed_first, completed_first);
            let own = named.next_names().unwrap();
            assert_eq!((own.key, own.plain), (keyed.key.clone(), Some(key.clone())));
        }
        let same = Hashing::keyed([1; 32]).moving_to(Hashing::keyed([1; 32]), Deploy::First);
        assert_eq!(same.unwrap_err(), HashingError::SameNames);
        let both_plain = Hashing::plain().moving_to(Hashing::plain(), Deploy::Second);
        assert_eq!(both_plain.unwrap_err(), HashingError::SameNames);
        let moving = Hashing::plain().moving_to(Hashing::keyed([1; 32]), Deploy::First).unwrap();
        let nested = Hashing::keyed([3; 32]).moving_to(moving.clone(), Deploy::First).unwrap_err();
        assert_eq!(nested, HashingError::Nested);
        assert_eq!(
            moving.moving_to(Hashing::keyed([4; 32]), Deploy::Second).unwrap_err(),
            HashingError::Nested
        );
        assert!(HashingError::SameNames.to_string().contains("the same secret, or both plain"));
        assert!(nested.to_string().contains("a move is between two namings"));
        assert!(Hashing::keyed([3; 32]).moving_to(Hashing::keyed([4; 32]), Deploy::First).is_ok());
    }

    #[test]
    fn a_secret_is_never_printed() {
        let moving =
            Hashing::keyed([0xAB; 32]).moving_to(Hashing::keyed([0xCD; 32]), Deploy::First);
        let printed = format!("{:?}", moving.unwrap());
        assert_eq!(printed, r#"Hashing { names: "keyed", moving_to: Some(("keyed", First)) }"#);
    }
}
