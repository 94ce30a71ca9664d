//! The record key: where one scope's key lives in the store, without the key itself.

use std::sync::Arc;

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
    /// The text; its hash is its last 65 characters but the closing brace.
    full: Arc<str>,
    /// The same text, in the placement its store moves to (a `RegionalStore` moving between
    /// region lists routes it by the list moved to): the second claim of a move.
    placed_next: bool,
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
        let digest = Fingerprint::of_fields(&[prefix.as_bytes(), scope, key]);
        // Most prefixes need no escape: written whole, not a character at a time.
        if !prefix.contains(['{', '}', '%']) {
            return Self::with_digest(prefix, digest.as_bytes());
        }
        let mut escaped = String::with_capacity(prefix.len() + 8);
        for c in prefix.chars() {
            match c {
                '{' => escaped.push_str("%7B"),
                '}' => escaped.push_str("%7D"),
                '%' => escaped.push_str("%25"),
                c => escaped.push(c),
            }
        }
        Self::with_digest(&escaped, digest.as_bytes())
    }

    /// The key `{escaped}:{<digest in hex>}`: `escaped` is a prefix as [`new`](Self::new)
    /// writes it, or as [`prefix`](Self::prefix) reads it back.
    pub(crate) fn with_digest(escaped: &str, digest: &[u8; 32]) -> Self {
        let mut full = String::with_capacity(escaped.len() + 3 + 2 * digest.len());
        full.push_str(escaped);
        full.push_str(":{");
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut hex = [0u8; 64];
        for (pair, byte) in hex.chunks_exact_mut(2).zip(digest) {
            pair[0] = HEX[usize::from(byte >> 4)];
            pair[1] = HEX[usize::from(byte & 0x0f)];
        }
        full.push_str(std::str::from_utf8(&hex).unwrap_or_default());
        full.push('}');
        Self { full: full.into(), placed_next: false }
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
        well_formed.then(|| Self { full: full.into(), placed_next: false })
    }

    /// The same record key in the placement its store moves to, while it moves (the key's
    /// home under the region list a `RegionalStore` moves to): its text unchanged.
    pub(crate) fn in_next_placement(&self) -> Self {
        Self { placed_next: true, ..self.clone() }
    }

    /// Whether it names the record in the placement its store moves to.
    pub(crate) fn is_placed_next(&self) -> bool {
        self.placed_next
    }

    /// The same record key in its store's own placement.
    pub(crate) fn in_own_placement(&self) -> Self {
        Self { placed_next: false, ..self.clone() }
    }

    /// Where the hash begins: 64 hex digits and the closing brace before the end.
    fn hash_start(&self) -> usize {
        self.full.len() - 65
    }

    /// The whole key as written to the store.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.full
    }

    /// The key's prefix, as written to the store (escaped).
    pub(crate) fn prefix(&self) -> &str {
        &self.full[..self.hash_start() - 2]
    }

    /// The hex hash alone: what logs show in place of the key.
    #[must_use]
    pub fn hash(&self) -> &str {
        &self.full[self.hash_start()..self.full.len() - 1]
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
}
