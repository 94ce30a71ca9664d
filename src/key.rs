//! The record key: where one scope's key lives in the store, without the key itself; and the
//! keyed hashes ([`HashSecret`], [`KeyedRollout`]) that name records and fingerprints under a
//! server secret.

use std::{fmt, sync::Arc};

use hmac::{Hmac, KeyInit as _};
use sha2::Sha256;

use crate::fingerprint::Fingerprint;

/// The store key of one record: `{prefix}:{<hash>}`.
///
/// The hash is SHA-256 over the length-prefixed prefix, scope and key, in hex, so that one
/// scope can never reach another's record, the raw key is never written to the store or the
/// logs, and two configurations that differ only by prefix never share a key hash (which
/// names a record in logs, outbox rows and derived keys).
/// The braces are a Redis Cluster hash tag: every key of one record lands in one slot.
///
/// Redis takes the *first* `{…}` of a key as its hash tag, so a brace in the prefix would
/// move the tag (or, with `{}`, make Redis hash the whole key, splitting a record from its
/// settle channel across slots). The prefix is written with `{`, `}` and `%` escaped as
/// `%7B`, `%7D` and `%25`: any prefix is safe, and two prefixes never share a key.
///
/// ```
/// use axum_idempotency::store::RecordKey;
///
/// let key = RecordKey::new("svc{}", b"", b"k");
/// assert!(key.as_str().starts_with("svc%7B%7D:{"));
/// ```
///
/// Cloning is cheap: clones share the text.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RecordKey {
    full: Arc<str>,
    hash_start: usize,
}

impl RecordKey {
    /// Derives the record key for `key` in `scope`, under `prefix`.
    ///
    /// ```
    /// use axum_idempotency::store::RecordKey;
    ///
    /// let a = RecordKey::new("idem", b"tenant-a", b"order-1");
    /// let b = RecordKey::new("idem", b"tenant-b", b"order-1");
    /// assert_ne!(a, b);
    /// assert!(a.as_str().starts_with("idem:{"));
    /// ```
    #[must_use]
    pub fn new(prefix: &str, scope: &[u8], key: &[u8]) -> Self {
        Self::named(prefix, &Fingerprint::of_fields(&[prefix.as_bytes(), scope, key]))
    }

    /// The record key for `key` in `scope`, under `prefix`, with its hash an HMAC-SHA256
    /// under `secret`: nobody without the secret can tell which key it names.
    pub(crate) fn keyed(secret: &HashSecret, prefix: &str, scope: &[u8], key: &[u8]) -> Self {
        let fields: [&[u8]; 4] = [b"record-key", prefix.as_bytes(), scope, key];
        Self::named(prefix, &Fingerprint::of_fields_keyed(secret, &fields))
    }

    /// `{prefix}:{<digest in hex>}`, the prefix escaped.
    fn named(prefix: &str, digest: &Fingerprint) -> Self {
        let digest = digest.as_bytes();
        let mut full = String::with_capacity(prefix.len() + 3 + 2 * digest.len());
        // Most prefixes need no escape: written whole, not a character at a time.
        if prefix.contains(['{', '}', '%']) {
            for c in prefix.chars() {
                match c {
                    '{' => full.push_str("%7B"),
                    '}' => full.push_str("%7D"),
                    '%' => full.push_str("%25"),
                    c => full.push(c),
                }
            }
        } else {
            full.push_str(prefix);
        }
        full.push_str(":{");
        let hash_start = full.len();
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut hex = [0u8; 64];
        for (pair, byte) in hex.chunks_exact_mut(2).zip(digest) {
            pair[0] = HEX[usize::from(byte >> 4)];
            pair[1] = HEX[usize::from(byte & 0x0f)];
        }
        full.push_str(std::str::from_utf8(&hex).unwrap_or_default());
        full.push('}');
        Self { full: full.into(), hash_start }
    }

    /// A key as a store holds it (`{prefix}:{<64 hex>}`), read back; `None` for any other
    /// text.
    pub(crate) fn from_stored(full: String) -> Option<Self> {
        let hash_start = full.len().checked_sub(65)?;
        let well_formed = full.ends_with('}')
            && full.as_bytes()[..hash_start].ends_with(b":{")
            && full.as_bytes()[hash_start..full.len() - 1]
                .iter()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b));
        well_formed.then(|| Self { full: full.into(), hash_start })
    }

    /// The whole key as written to the store.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.full
    }

    /// The hex hash alone: what logs show in place of the key.
    #[must_use]
    pub fn hash(&self) -> &str {
        &self.full[self.hash_start..self.full.len() - 1]
    }
}

/// A server secret under which record keys and fingerprints are keyed hashes (HMAC-SHA256),
/// not plain SHA-256: see [`keyed_hashes`](crate::IdempotencyLayer::keyed_hashes).
///
/// Someone who reads the store (a Redis dump, a replica, a backup) and knows no secret can
/// confirm a guess offline against a plain hash: whether a guessable key (an order id) was
/// used, and what a request held (an amount, an account), by hashing the guess and finding it.
/// Under a secret the store never sees, they cannot.
///
/// The secret is 32 bytes, random, kept where the service keeps its other secrets, and the
/// same on every instance that shares a store. The copy given to [`new`](Self::new) is
/// cleared, and so is the secret's own state when the last clone is dropped. Its `Debug`
/// output never shows it.
///
/// ```
/// use axum_idempotency::store::HashSecret;
///
/// let secret = HashSecret::new([7; 32]);
/// assert_eq!(format!("{secret:?}"), "HashSecret(..)");
/// ```
#[derive(Clone)]
pub struct HashSecret(Arc<Hmac<Sha256>>);

impl HashSecret {
    /// A secret of the 32 bytes `secret`; the copy passed here is cleared.
    #[must_use]
    pub fn new(mut secret: [u8; 32]) -> Self {
        // HMAC's keyed state, two SHA-256 states, is cleared on drop (sha2's `zeroize`).
        let mac = Hmac::<Sha256>::new_from_slice(&secret).expect("HMAC takes a key of any length");
        zeroize::Zeroize::zeroize(&mut secret);
        Self(Arc::new(mac))
    }

    /// A fresh HMAC-SHA256 under the secret.
    pub(crate) fn mac(&self) -> Hmac<Sha256> {
        (*self.0).clone()
    }
}

impl fmt::Debug for HashSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("HashSecret(..)")
    }
}

/// Where a service that turns keyed hashes on stands, so that a record stored under the names
/// of before (plain SHA-256) is still found: turning keyed hashes on renames every record, and a
/// retry that looked only under the new name would run its request again.
///
/// Every variant is a choice the operator makes: the doors' `keyed_hashes` takes one, so that
/// no service turns keyed hashes on without saying what becomes of the records stored before.
///
/// A running service turns keyed hashes on in three deploys:
///
/// 1. [`Prepare`](Self::Prepare) on every instance: records are still named and fingerprinted
///    as before, and a claim that finds nothing also looks under the keyed name. No record
///    changes yet; this step lets instances of step 2 and of step 1 run side by side.
/// 2. [`Migrate`](Self::Migrate) on every instance, once no instance runs without step 1:
///    records are keyed, and a claim that finds nothing also looks under the plain name, and
///    honours what it finds there (a completed outcome replayed, a running one answered in
///    progress, another request's answered as a mismatch).
/// 3. [`Done`](Self::Done), once every instance has run step 2 for the retention (and the
///    recovery window, if longer): every plain record has expired.
///
/// A service that stops every instance before it starts the new ones (or runs one instance)
/// skips step 1. A new deployment, over a store without records, starts at step 3.
///
/// Leaving out a step, or shortening step 2, reopens the gap: a retry whose record is under
/// the other name runs its request again. Steps 1 and 2 cost two store round trips more on
/// every new key (a claim under the other name and its release); replays, duplicates in
/// progress and mismatches found under the name a claim tries first cost nothing more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyedRollout {
    /// Step 1: plain names, and the keyed ones looked under too.
    Prepare,
    /// Step 2: keyed names, and the plain ones looked under too, for at least the retention.
    Migrate,
    /// Keyed names only: a new store, or step 3 of a rollout.
    Done,
}

/// How a door names its records and fingerprints: plain SHA-256, or keyed under a secret,
/// perhaps looking under the other names too while keyed hashes roll out.
#[derive(Debug, Clone, Default)]
pub(crate) struct Names {
    keyed: Option<(HashSecret, KeyedRollout)>,
}

/// The names one claim is made under: the record key and the fingerprint written, and those a
/// claim that finds nothing also looks under.
#[derive(Debug, Clone)]
pub(crate) struct Named {
    pub(crate) key: RecordKey,
    pub(crate) fingerprint: Fingerprint,
    /// The other names, while keyed hashes roll out.
    pub(crate) other: Option<(RecordKey, Fingerprint)>,
}

impl Names {
    pub(crate) fn keyed(secret: HashSecret, rollout: KeyedRollout) -> Self {
        Self { keyed: Some((secret, rollout)) }
    }

    /// The names of `key` in `scope` under `prefix`, for a request fingerprinted as
    /// `fingerprint` (the door's plain fingerprint).
    pub(crate) fn name(
        &self,
        prefix: &str,
        scope: &[u8],
        key: &[u8],
        fingerprint: Fingerprint,
    ) -> Named {
        let plain = || RecordKey::new(prefix, scope, key);
        let Some((secret, rollout)) = &self.keyed else {
            return Named { key: plain(), fingerprint, other: None };
        };
        let keyed = (RecordKey::keyed(secret, prefix, scope, key), fingerprint.keyed(secret));
        match rollout {
            KeyedRollout::Prepare => Named { key: plain(), fingerprint, other: Some(keyed) },
            KeyedRollout::Migrate => {
                let (key, keyed_fingerprint) = keyed;
                Named { key, fingerprint: keyed_fingerprint, other: Some((plain(), fingerprint)) }
            }
            KeyedRollout::Done => Named { key: keyed.0, fingerprint: keyed.1, other: None },
        }
    }

    /// The record key claims write for `key` in `scope` under `prefix`: what the operator
    /// calls (`inspect`, `forget`) read.
    pub(crate) fn record_key(&self, prefix: &str, scope: &[u8], key: &[u8]) -> RecordKey {
        match &self.keyed {
            Some((secret, KeyedRollout::Migrate | KeyedRollout::Done)) => {
                RecordKey::keyed(secret, prefix, scope, key)
            }
            _ => RecordKey::new(prefix, scope, key),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_stored_key_reads_back_and_nothing_else_does() {
        let key = super::RecordKey::new("p{x}", b"tenant", b"k1");
        assert_eq!(super::RecordKey::from_stored(key.as_str().to_owned()), Some(key.clone()));
        let read = super::RecordKey::from_stored(key.as_str().to_owned()).unwrap();
        assert_eq!(read.hash(), key.hash());
        let text = key.as_str();
        for bad in [&text[1..text.len() - 1], "", "p:{}", &text.replace(":{", "::")] {
            assert_eq!(super::RecordKey::from_stored(bad.to_owned()), None, "{bad}");
        }
        // A prefix of multi-byte characters: no byte index of it panics.
        assert_eq!(super::RecordKey::from_stored("é".repeat(40)), None);
        let upper = format!("{}}}", &text[..text.len() - 1].to_uppercase());
        assert_eq!(super::RecordKey::from_stored(upper), None);
    }

    use super::*;

    #[test]
    fn the_hash_is_sha256_of_the_length_prefixed_prefix_scope_and_key() {
        // Pinned: records written by earlier builds must keep their keys. Computed apart from
        // the crate: SHA-256 over (u64 big-endian length, bytes) of "idem", "tenant-a", "order-1".
        let key = RecordKey::new("idem", b"tenant-a", b"order-1");
        let hash = "7d9b4e55cc36a05e9419f2aa66902a57d66132c986261d14f57d54980160941e";
        assert_eq!(key.as_str(), format!("idem:{{{hash}}}"));
        assert_eq!(key.hash(), hash);
    }

    #[test]
    fn record_key_separates_scopes_and_hides_the_key() {
        let a = RecordKey::new("idem", b"t1", b"secret-key");
        assert_ne!(a, RecordKey::new("idem", b"t2", b"secret-key"));
        // Length prefixes keep ("ab", "c") and ("a", "bc") apart.
        assert_ne!(RecordKey::new("p", b"ab", b"c"), RecordKey::new("p", b"a", b"bc"));
        assert_ne!(
            RecordKey::new("pa", b"b", b"c").hash(),
            RecordKey::new("p", b"ab", b"c").hash()
        );
        // The prefix is in the hash too: two prefixes never share a key hash.
        assert_ne!(RecordKey::new("a", b"t", b"k").hash(), RecordKey::new("b", b"t", b"k").hash());
        assert!(!a.as_str().contains("secret"));
        assert_eq!(a.hash().len(), 64);
        assert_eq!(a.as_str(), format!("idem:{{{}}}", a.hash()));
    }

    #[test]
    fn braces_in_the_prefix_never_move_the_hash_tag() {
        for prefix in ["{}", "svc{}", "{payments}", "a}b{", "%7B"] {
            let key = RecordKey::new(prefix, b"t", b"k");
            let tag_start = key.as_str().find('{').unwrap();
            assert_eq!(
                &key.as_str()[tag_start + 1..key.as_str().len() - 1],
                key.hash(),
                "{prefix}"
            );
        }
        // Escaping keeps prefixes apart: `{` and a literal `%7B` are two prefixes.
        assert_ne!(RecordKey::new("{", b"", b"k"), RecordKey::new("%7B", b"", b"k"));
        assert_eq!(
            RecordKey::new("{x}%", b"", b"k").as_str().split(':').next(),
            Some("%7Bx%7D%25")
        );
    }

    #[test]
    fn a_keyed_name_depends_on_the_secret_and_is_no_plain_hash() {
        let secret = HashSecret::new([7; 32]);
        let keyed = RecordKey::keyed(&secret, "idem", b"tenant-a", b"order-1");
        let plain = RecordKey::new("idem", b"tenant-a", b"order-1");
        assert_ne!(keyed, plain);
        assert_eq!(
            keyed,
            RecordKey::keyed(&HashSecret::new([7; 32]), "idem", b"tenant-a", b"order-1")
        );
        assert_ne!(
            keyed,
            RecordKey::keyed(&HashSecret::new([8; 32]), "idem", b"tenant-a", b"order-1")
        );
        assert_ne!(keyed, RecordKey::keyed(&secret, "idem", b"tenant-b", b"order-1"));
        assert_eq!(keyed.as_str(), format!("idem:{{{}}}", keyed.hash()));
        assert_eq!(RecordKey::from_stored(keyed.as_str().to_owned()), Some(keyed.clone()));
        assert!(RecordKey::keyed(&secret, "a{b}", b"", b"k").as_str().starts_with("a%7Bb%7D:{"));
        let fingerprint = Fingerprint::of_payload(b"{}");
        assert_ne!(fingerprint.keyed(&secret), fingerprint);
        assert_ne!(fingerprint.keyed(&secret), fingerprint.keyed(&HashSecret::new([8; 32])));
        // The two MACs are apart: a fingerprint never names a record.
        assert_ne!(fingerprint.keyed(&secret).as_bytes(), keyed.hash().as_bytes());
    }

    #[test]
    fn each_step_of_the_rollout_claims_one_name_and_looks_under_the_other() {
        let secret = HashSecret::new([7; 32]);
        let fingerprint = Fingerprint::of_payload(b"{}");
        let plain = (RecordKey::new("p", b"s", b"k"), fingerprint.clone());
        let keyed = (RecordKey::keyed(&secret, "p", b"s", b"k"), fingerprint.keyed(&secret));
        let named = |names: Names| {
            let named = names.name("p", b"s", b"k", fingerprint.clone());
            ((named.key, named.fingerprint), named.other)
        };
        assert_eq!(named(Names::default()), (plain.clone(), None));
        let rollout = |step| Names::keyed(secret.clone(), step);
        assert_eq!(named(rollout(KeyedRollout::Prepare)), (plain.clone(), Some(keyed.clone())));
        assert_eq!(named(rollout(KeyedRollout::Migrate)), (keyed.clone(), Some(plain.clone())));
        assert_eq!(named(rollout(KeyedRollout::Done)), (keyed.clone(), None));
        // The operator's calls read where claims write.
        for (step, key) in [
            (KeyedRollout::Prepare, &plain.0),
            (KeyedRollout::Migrate, &keyed.0),
            (KeyedRollout::Done, &keyed.0),
        ] {
            assert_eq!(&rollout(step).record_key("p", b"s", b"k"), key, "{step:?}");
        }
    }

    #[test]
    fn a_secret_is_never_printed_and_cleared_when_dropped() {
        fn cleared_on_drop<T: zeroize::ZeroizeOnDrop>() {}
        // HMAC-SHA256's keyed state is two SHA-256 states: each cleared when dropped.
        cleared_on_drop::<sha2::block_api::Sha256VarCore>();
        let secret = HashSecret::new([0xAB; 32]);
        assert_eq!(format!("{secret:?}"), "HashSecret(..)");
        let names = format!("{:?}", Names::keyed(secret, KeyedRollout::Migrate));
        assert!(!names.contains("171") && !names.contains("ab"), "{names}");
    }
}
