//! Outcomes encrypted at rest: a [`Keyring`] of XChaCha20-Poly1305 keys, each with an id, so
//! that keys can rotate.
//!
//! With a keyring (`IdempotencyLayer::encrypt_at_rest`, `Idempotent::encrypt_at_rest`), every
//! outcome a front door stores (the HTTP response, the consumer's result; in the record store,
//! in a transaction's commit, in `DurableOutcomes`) is encrypted under the keyring's newest
//! key, and read back under whichever listed key its id names. What a store keeps in clear is
//! what it needs to decide without reading the outcome: the state, the owner token, the
//! fingerprint (a SHA-256, compared as it is), the expiry.
//!
//! The record's key is the AEAD's associated data: an outcome moved to another key fails
//! authentication. A record under a key id the keyring does not list, or that fails
//! authentication, is never replayed and never run again: the HTTP door answers 500
//! problem+json (`corrupt-record`) and logs the key hash; the consumer door returns the store
//! error.
//!
//! ```
//! use axum_idempotency::{IdempotencyLayer, MemoryStore, encryption::Keyring};
//!
//! # fn main() -> Result<(), axum_idempotency::encryption::KeyringError> {
//! // Encrypt with "2026-11", still read what "2026-05" encrypted.
//! let keys = Keyring::new("2026-11", [7; 32])?.decrypt_with("2026-05", [9; 32])?;
//! let layer = IdempotencyLayer::new(MemoryStore::new()).encrypt_at_rest(keys);
//! # Ok(()) }
//! ```
//!
//! Rotation: add the new key as the keyring's own and keep the old one with
//! [`decrypt_with`](Keyring::decrypt_with) until every record it sealed has expired (the
//! retention); then drop it. Records sealed under a dropped key answer 500 until they expire.

use std::fmt;

use chacha20poly1305::{KeyInit, XChaCha20Poly1305, aead::generic_array::GenericArray};

/// The longest key id, in bytes.
pub const MAX_KEY_ID: usize = 64;

/// The keys that encrypt stored outcomes: the newest encrypts, any listed decrypts.
///
/// Its `Debug` output names the key ids, never a key.
///
#[doc = include_str!("docs/encryption.md")]
#[derive(Clone)]
pub struct Keyring {
    /// The newest key first: it encrypts.
    keys: Vec<Key>,
    read_plaintext: bool,
}

#[derive(Clone)]
struct Key {
    id: Box<str>,
    cipher: XChaCha20Poly1305,
}

impl Keyring {
    /// A keyring that encrypts with `key`, named `id` in every record it seals.
    ///
    /// # Errors
    ///
    /// [`KeyringError::BadId`] when `id` is empty, longer than [`MAX_KEY_ID`] bytes, or not
    /// printable ASCII.
    pub fn new(id: &str, key: [u8; 32]) -> Result<Self, KeyringError> {
        Ok(Self { keys: vec![Key::new(id, key)?], read_plaintext: false })
    }

    /// Adds an older key, which decrypts the records it sealed and encrypts nothing.
    ///
    /// # Errors
    ///
    /// [`KeyringError::BadId`] as for [`new`](Self::new); [`KeyringError::DuplicateId`] when
    /// the keyring lists `id` already.
    pub fn decrypt_with(mut self, id: &str, key: [u8; 32]) -> Result<Self, KeyringError> {
        if self.keys.iter().any(|listed| &*listed.id == id) {
            return Err(KeyringError::DuplicateId(id.to_owned()));
        }
        self.keys.push(Key::new(id, key)?);
        Ok(self)
    }

    /// Also replays outcomes stored in clear, before encryption was turned on, until they
    /// expire. Off by default: a record in clear is then refused as one that fails
    /// authentication would be, so that nobody who can write to the store can have a
    /// response of their own replayed.
    #[must_use]
    pub fn read_plaintext(mut self, read: bool) -> Self {
        self.read_plaintext = read;
        self
    }

    /// The id of the key that encrypts.
    #[must_use]
    pub fn current_id(&self) -> &str {
        &self.keys[0].id
    }

    /// The key that encrypts: its id and its cipher.
    pub(crate) fn current(&self) -> (&str, &XChaCha20Poly1305) {
        (&self.keys[0].id, &self.keys[0].cipher)
    }

    /// The listed key named `id`, if any.
    pub(crate) fn find(&self, id: &[u8]) -> Option<&XChaCha20Poly1305> {
        self.keys.iter().find(|key| key.id.as_bytes() == id).map(|key| &key.cipher)
    }

    /// Whether outcomes stored in clear are read.
    pub(crate) fn reads_plaintext(&self) -> bool {
        self.read_plaintext
    }
}

impl Key {
    fn new(id: &str, mut key: [u8; 32]) -> Result<Self, KeyringError> {
        // The caller's copy is theirs to clear; this one is cleared here, and the cipher's own
        // when it is dropped (chacha20poly1305 zeroizes its key).
        let valid =
            !id.is_empty() && id.len() <= MAX_KEY_ID && id.bytes().all(|b| b.is_ascii_graphic());
        let cipher = valid.then(|| XChaCha20Poly1305::new(GenericArray::from_slice(&key)));
        zeroize::Zeroize::zeroize(&mut key);
        let cipher = cipher.ok_or_else(|| KeyringError::BadId(id.to_owned()))?;
        Ok(Self { id: id.into(), cipher })
    }
}

impl fmt::Debug for Keyring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ids: Vec<&str> = self.keys.iter().map(|key| &*key.id).collect();
        f.debug_struct("Keyring")
            .field("key_ids", &ids)
            .field("read_plaintext", &self.read_plaintext)
            .finish()
    }
}

/// Why a [`Keyring`] refused a key.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyringError {
    /// The id is empty, longer than [`MAX_KEY_ID`] bytes, or not printable ASCII.
    BadId(String),
    /// The keyring lists this id already.
    DuplicateId(String),
}

impl fmt::Display for KeyringError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BadId(id) => {
                write!(f, "a key id is 1 to {MAX_KEY_ID} printable ASCII characters, not {id:?}")
            }
            Self::DuplicateId(id) => write!(f, "the keyring lists the key id {id:?} already"),
        }
    }
}

impl std::error::Error for KeyringError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_checked_and_keys_never_printed() {
        assert!(matches!(Keyring::new("", [0; 32]), Err(KeyringError::BadId(_))));
        assert!(matches!(Keyring::new("a b", [0; 32]), Err(KeyringError::BadId(_))));
        assert!(Keyring::new(&"a".repeat(MAX_KEY_ID), [0; 32]).is_ok());
        assert!(Keyring::new(&"a".repeat(MAX_KEY_ID + 1), [0; 32]).is_err());
        let keys = Keyring::new("a", [0; 32]).unwrap();
        assert_eq!(
            keys.clone().decrypt_with("a", [1; 32]).unwrap_err(),
            KeyringError::DuplicateId("a".into())
        );
        let keys = keys.decrypt_with("b", [0xAB; 32]).unwrap();
        assert_eq!(keys.current_id(), "a");
        let printed = format!("{keys:?}");
        assert!(printed.contains("\"a\", \"b\"") && !printed.contains("171"), "{printed}");
    }
}
