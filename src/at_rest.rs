//! [`AtRest`]: how a front door's outcomes are kept in the store, in clear or encrypted under a
//! [`Keyring`](crate::encryption::Keyring), in the one place every door's writes and reads
//! pass: the holder's complete, a sealed outcome, a replay, a durable outcome read back.
//!
//! An encrypted outcome is [`ENCRYPTED`] (a byte no door's format takes), the key id's length (one byte) and
//! the id, a 24-byte random nonce, then the door's whole record (its envelope included)
//! encrypted with XChaCha20-Poly1305 and its 16-byte tag. The associated data is every clear
//! field a replay decision reads: the record key, the state (completed) and the fingerprint of
//! the request the outcome answers, so that a store writer who rewrites the clear fingerprint
//! (to have another request's body replayed) or moves the outcome to another key fails the
//! tag. 42 bytes and the id over the record in clear.

#[cfg(feature = "encryption")]
use std::{fmt, sync::Arc};

use bytes::Bytes;
#[cfg(feature = "encryption")]
use bytes::{BufMut, BytesMut};
#[cfg(feature = "encryption")]
use chacha20poly1305::{AeadInPlace, Tag, XNonce};

#[cfg(feature = "encryption")]
use crate::encryption::Keyring;
use crate::{fingerprint::Fingerprint, key::RecordKey, store::StoreError};

/// The first byte of an encrypted outcome: `engine::envelope::Format::Encrypted`, so that no
/// door's format can take it.
pub(crate) const ENCRYPTED: u8 = b'E';
#[cfg(feature = "encryption")]
const NONCE: usize = 24;
#[cfg(feature = "encryption")]
const TAG: usize = 16;

/// Whether outcomes are encrypted at rest, and under which keys. Cloning is cheap.
#[derive(Debug, Clone, Default)]
pub(crate) struct AtRest {
    #[cfg(feature = "encryption")]
    keyring: Option<Arc<Keyring>>,
}

impl AtRest {
    #[cfg(feature = "encryption")]
    pub(crate) fn encrypted(keyring: Keyring) -> Self {
        Self { keyring: Some(Arc::new(keyring)) }
    }

    /// `outcome`, the answer to the request of `fingerprint`, as the store keeps it under `key`.
    pub(crate) fn seal(&self, key: &RecordKey, fingerprint: &Fingerprint, outcome: Bytes) -> Bytes {
        #[cfg(feature = "encryption")]
        if let Some(keyring) = &self.keyring {
            return seal(keyring, &associated(key, fingerprint), &outcome);
        }
        let _ = (key, fingerprint);
        outcome
    }

    /// The outcome the store kept under `key` for the request of `fingerprint`, as its door
    /// wrote it; an error naming why when it cannot be read (logged with the key's hash): never
    /// garbage.
    pub(crate) fn open(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        stored: Bytes,
    ) -> Result<Bytes, StoreError> {
        #[cfg(feature = "encryption")]
        if let Some(keyring) = &self.keyring {
            return open(keyring, &associated(key, fingerprint), stored).map_err(|why| {
                tracing::error!(key_hash = key.hash(), %why, "idempotency: the stored outcome cannot be decrypted");
                StoreError::CorruptRecord(format!("the outcome is {why}"))
            });
        }
        let _ = fingerprint;
        if stored.first() == Some(&(ENCRYPTED)) {
            tracing::error!(
                key_hash = key.hash(),
                "idempotency: the stored outcome is encrypted, and no keyring is set"
            );
            return Err(StoreError::CorruptRecord(
                "the outcome is encrypted, and no keyring is set".to_owned(),
            ));
        }
        Ok(stored)
    }
}

/// The associated data of an outcome: the record key, the completed state and the fingerprint,
/// each of a fixed or prefixed length, so that no two triples read the same.
#[cfg(feature = "encryption")]
fn associated(key: &RecordKey, fingerprint: &Fingerprint) -> Vec<u8> {
    let key = key.as_str().as_bytes();
    let mut data = Vec::with_capacity(4 + key.len() + 1 + 32);
    data.extend_from_slice(&u32::try_from(key.len()).unwrap_or(u32::MAX).to_be_bytes());
    data.extend_from_slice(key);
    data.push(b'C');
    data.extend_from_slice(fingerprint.as_bytes());
    data
}

/// `plain` encrypted under the keyring's newest key, bound to `associated`.
#[cfg(feature = "encryption")]
fn seal(keyring: &Keyring, associated: &[u8], plain: &[u8]) -> Bytes {
    let (id, cipher) = keyring.current();
    let nonce: [u8; NONCE] = rand::random();
    let mut out = BytesMut::with_capacity(2 + id.len() + NONCE + plain.len() + TAG);
    out.put_u8(ENCRYPTED);
    // At most `MAX_KEY_ID` (64): the keyring checked it.
    out.put_u8(u8::try_from(id.len()).unwrap_or(u8::MAX));
    out.put_slice(id.as_bytes());
    out.put_slice(&nonce);
    let start = out.len();
    out.put_slice(plain);
    let nonce = XNonce::from_slice(&nonce);
    // Fails only past the cipher's 256 GiB message limit, which no stored limit allows.
    let tag = cipher
        .encrypt_in_place_detached(nonce, associated, &mut out[start..])
        .expect("an outcome under XChaCha20-Poly1305's message limit");
    out.put_slice(&tag);
    out.freeze()
}

/// The outcome `stored`, sealed bound to `associated`, decrypted; one in clear as it is when
/// the keyring reads those.
#[cfg(feature = "encryption")]
fn open(keyring: &Keyring, associated: &[u8], stored: Bytes) -> Result<Bytes, Unreadable> {
    if stored.first() != Some(&(ENCRYPTED)) {
        return match keyring.reads_plaintext() {
            true => Ok(stored),
            false => Err(Unreadable::Plaintext),
        };
    }
    let id_len = usize::from(*stored.get(1).ok_or(Unreadable::Truncated)?);
    let id = stored.get(2..2 + id_len).ok_or(Unreadable::Truncated)?;
    let nonce = stored.get(2 + id_len..2 + id_len + NONCE).ok_or(Unreadable::Truncated)?;
    let sealed = &stored[2 + id_len + NONCE..];
    let tag_at = sealed.len().checked_sub(TAG).ok_or(Unreadable::Truncated)?;
    let named = || String::from_utf8_lossy(id).into_owned();
    let cipher = keyring.find(id).ok_or_else(|| Unreadable::UnknownKey(named()))?;
    let (ciphertext, tag) = sealed.split_at(tag_at);
    let mut plain = ciphertext.to_vec();
    let (nonce, tag) = (XNonce::from_slice(nonce), Tag::from_slice(tag));
    cipher
        .decrypt_in_place_detached(nonce, associated, &mut plain, tag)
        .map_err(|_| Unreadable::Forged(named()))?;
    Ok(Bytes::from(plain))
}

/// Why a stored outcome could not be decrypted.
#[cfg(feature = "encryption")]
#[derive(Debug, Clone, PartialEq, Eq)]
enum Unreadable {
    /// Sealed under a key id the keyring does not list.
    UnknownKey(String),
    /// The outcome, its id or its nonce was changed, or it was moved from another key.
    Forged(String),
    /// Too short to be an encrypted outcome.
    Truncated,
    /// Stored in clear, and the keyring does not read those.
    Plaintext,
}

#[cfg(feature = "encryption")]
impl fmt::Display for Unreadable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UnknownKey(id) => {
                write!(f, "encrypted under the key id {id:?}, which the keyring does not list")
            }
            Self::Forged(id) => write!(f, "failing authentication under the key id {id:?}"),
            Self::Truncated => f.write_str("too short to be an encrypted outcome"),
            Self::Plaintext => {
                f.write_str("stored in clear, and the keyring reads only encrypted outcomes")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_clear_an_outcome_is_kept_as_it_is_and_an_encrypted_one_refused() {
        let (key, fp) = (RecordKey::new("t", b"", b"k"), Fingerprint::of_payload(b"{}"));
        let clear = AtRest::default();
        let outcome = Bytes::from_static(b"\x02response");
        assert_eq!(clear.seal(&key, &fp, outcome.clone()), outcome);
        assert_eq!(clear.open(&key, &fp, outcome.clone()).unwrap(), outcome);
        let encrypted = Bytes::from_static(b"E\x01kxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx");
        assert!(matches!(clear.open(&key, &fp, encrypted), Err(StoreError::CorruptRecord(_))));
    }

    #[cfg(feature = "encryption")]
    mod encrypted {
        use super::super::*;

        const RECORD: &[u8] = b"idem:abc";

        fn keys(id: &str, byte: u8) -> Keyring {
            Keyring::new(id, [byte; 32]).unwrap()
        }

        #[test]
        fn an_outcome_round_trips_and_holds_no_plaintext() {
            let keys = keys("k1", 1);
            let plain = b"card 4242 4242 4242 4242, the whole response";
            let sealed = seal(&keys, RECORD, plain);
            assert_eq!(sealed[0], b'E');
            assert_eq!(&sealed[1..4], b"\x02k1");
            assert_eq!(sealed.len(), 2 + 2 + NONCE + plain.len() + TAG);
            assert!(!sealed.windows(4).any(|w| w == b"4242"));
            assert_eq!(open(&keys, RECORD, sealed.clone()).unwrap(), &plain[..]);
            // A fresh nonce each time: the same outcome never seals to the same bytes.
            assert_ne!(seal(&keys, RECORD, plain), sealed);
        }

        #[test]
        fn an_older_key_decrypts_and_a_dropped_one_is_named() {
            let sealed = seal(&keys("old", 1), RECORD, b"{}");
            let rotated = keys("new", 2).decrypt_with("old", [1; 32]).unwrap();
            assert_eq!(open(&rotated, RECORD, sealed.clone()).unwrap(), &b"{}"[..]);
            assert_eq!(seal(&rotated, RECORD, b"{}")[2..5], *b"new");
            let dropped = keys("new", 2);
            assert_eq!(open(&dropped, RECORD, sealed), Err(Unreadable::UnknownKey("old".into())));
        }

        #[test]
        fn every_changed_byte_fails_authentication_or_the_lookup() {
            let ring = keys("k1", 1);
            let sealed = seal(&ring, RECORD, b"{\"id\":42}");
            for at in 1..sealed.len() {
                let mut forged = sealed.to_vec();
                forged[at] ^= 0x01;
                assert!(open(&ring, RECORD, Bytes::from(forged)).is_err(), "byte {at}");
            }
            let moved = open(&ring, b"idem:other", sealed.clone());
            assert_eq!(moved, Err(Unreadable::Forged("k1".into())));
            let impostor = open(&keys("k1", 3), RECORD, sealed.clone());
            assert_eq!(impostor, Err(Unreadable::Forged("k1".into())));
            for len in 0..sealed.len() {
                assert!(open(&ring, RECORD, sealed.slice(..len)).is_err(), "{len} bytes");
            }
        }

        #[test]
        fn plaintext_is_refused_unless_asked_for() {
            let keys = keys("k1", 1);
            let clear = Bytes::from_static(b"\x02clear");
            assert_eq!(open(&keys, RECORD, clear.clone()), Err(Unreadable::Plaintext));
            let reading = keys.read_plaintext(true);
            assert_eq!(open(&reading, RECORD, clear.clone()).unwrap(), clear);
        }

        #[test]
        fn with_a_keyring_an_outcome_is_sealed_for_its_key() {
            let (key, fp) = (RecordKey::new("t", b"", b"k"), Fingerprint::of_payload(b"{}"));
            let at_rest = AtRest::encrypted(keys("k1", 5));
            let outcome = Bytes::from_static(b"\x02response");
            let stored = at_rest.seal(&key, &fp, outcome.clone());
            assert_eq!(stored[0], b'E');
            assert_eq!(at_rest.open(&key, &fp, stored.clone()).unwrap(), outcome);
            let other = RecordKey::new("t", b"", b"other");
            let moved = at_rest.open(&other, &fp, stored.clone()).unwrap_err().to_string();
            assert!(moved.ends_with("failing authentication under the key id \"k1\""), "{moved}");
            // The record's clear fingerprint rewritten to another request's: the tag fails.
            let another_request = Fingerprint::of_payload(b"{\"amount\":1}");
            let rewritten = at_rest.open(&key, &another_request, stored.clone()).unwrap_err();
            assert!(rewritten.to_string().contains("failing authentication"), "{rewritten}");
            let dropped = AtRest::encrypted(keys("k2", 5)).open(&key, &fp, stored).unwrap_err();
            let dropped = dropped.to_string();
            assert!(
                dropped.contains("the key id \"k1\", which the keyring does not list"),
                "{dropped}"
            );
            let clear = at_rest.open(&key, &fp, outcome).unwrap_err().to_string();
            assert!(clear.contains("stored in clear"), "{clear}");
        }
    }
}
