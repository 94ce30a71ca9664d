//! The `Idempotency-Key` header: parsing, validation, and the record key derived from it.

use http::{HeaderMap, HeaderName};
use sha2::{Digest, Sha256};

/// Longest key accepted, in characters.
pub const MAX_KEY_LEN: usize = 255;

/// Why an `Idempotency-Key` header was refused. Each is answered with 400 problem+json.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyError {
    /// The header appeared more than once, or its value is a list.
    Multiple,
    /// The key is empty.
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`] characters.
    TooLong,
    /// The key has a character outside visible ASCII, or a malformed quoted string.
    Malformed,
}

impl KeyError {
    pub(crate) fn detail(self) -> &'static str {
        match self {
            Self::Multiple => "the Idempotency-Key header must appear exactly once, with one value",
            Self::Empty => "the Idempotency-Key header is empty",
            Self::TooLong => "the Idempotency-Key is longer than 255 characters",
            Self::Malformed => {
                "the Idempotency-Key must be 1 to 255 visible ASCII characters, bare or as a quoted string"
            }
        }
    }
}

/// Parses the key from every value of the header `name`.
///
/// Accepts a bare token (`abc-123`) and the IETF structured-header string form (`"abc-123"`,
/// with `\"` and `\\` escapes). The key is 1..=255 visible ASCII characters (`!` to `~`).
/// A bare key may not contain `,` or `"`: a comma is how proxies join repeated headers, so it
/// is refused as [`KeyError::Multiple`]. Returns `Ok(None)` when the header is absent.
pub fn parse_key(headers: &HeaderMap, name: &HeaderName) -> Result<Option<Vec<u8>>, KeyError> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::Multiple);
    }
    parse_value(value.as_bytes()).map(Some)
}

fn parse_value(raw: &[u8]) -> Result<Vec<u8>, KeyError> {
    let raw = raw.trim_ascii();
    let key = match raw {
        [b'"', inner @ ..] => unquote(inner)?,
        _ => {
            if raw.contains(&b',') {
                return Err(KeyError::Multiple);
            }
            if raw.contains(&b'"') {
                return Err(KeyError::Malformed);
            }
            raw.to_vec()
        }
    };
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if !key.iter().all(u8::is_ascii_graphic) {
        return Err(KeyError::Malformed);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong);
    }
    Ok(key)
}

/// Reads an sf-string after its opening quote: up to the closing quote, which must end the value.
fn unquote(inner: &[u8]) -> Result<Vec<u8>, KeyError> {
    let mut key = Vec::with_capacity(inner.len());
    let mut bytes = inner.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&escaped @ (b'"' | b'\\')) => key.push(escaped),
                _ => return Err(KeyError::Malformed),
            },
            b'"' if bytes.as_slice().is_empty() => return Ok(key),
            b'"' => return Err(KeyError::Multiple),
            _ => key.push(b),
        }
    }
    // No closing quote.
    Err(KeyError::Malformed)
}

/// The store key of one record: `{prefix}:{<hash>}`.
///
/// The hash is SHA-256 over the length-prefixed scope and key, in hex, so that one scope can
/// never reach another's record and the raw key is never written to the store or the logs.
/// The braces are a Redis Cluster hash tag: every key of one record lands in one slot.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RecordKey {
    full: String,
    hash_start: usize,
}

impl RecordKey {
    /// Derives the record key for `key` in `scope`, under `prefix`.
    ///
    /// ```
    /// use axum_idempotency::RecordKey;
    ///
    /// let a = RecordKey::new("idem", b"tenant-a", b"order-1");
    /// let b = RecordKey::new("idem", b"tenant-b", b"order-1");
    /// assert_ne!(a, b);
    /// assert!(a.as_str().starts_with("idem:{"));
    /// ```
    #[must_use]
    pub fn new(prefix: &str, scope: &[u8], key: &[u8]) -> Self {
        let mut hasher = Sha256::new();
        for field in [scope, key] {
            hasher.update((field.len() as u64).to_be_bytes());
            hasher.update(field);
        }
        let digest = hasher.finalize();
        let mut full = String::with_capacity(prefix.len() + 3 + 2 * digest.len());
        full.push_str(prefix);
        full.push_str(":{");
        let hash_start = full.len();
        const HEX: &[u8; 16] = b"0123456789abcdef";
        for byte in digest {
            full.push(char::from(HEX[usize::from(byte >> 4)]));
            full.push(char::from(HEX[usize::from(byte & 0x0f)]));
        }
        full.push('}');
        Self { full, hash_start }
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

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn parse(values: &[&[u8]]) -> Result<Option<Vec<u8>>, KeyError> {
        let mut headers = HeaderMap::new();
        for v in values {
            headers.append("idempotency-key", HeaderValue::from_bytes(v).unwrap());
        }
        parse_key(&headers, &HeaderName::from_static("idempotency-key"))
    }

    #[test]
    fn absent_header_is_none() {
        assert_eq!(parse(&[]), Ok(None));
    }

    #[test]
    fn bare_and_quoted_forms_give_the_same_key() {
        assert_eq!(parse(&[b"abc-123"]), Ok(Some(b"abc-123".to_vec())));
        assert_eq!(parse(&[b"\"abc-123\""]), Ok(Some(b"abc-123".to_vec())));
    }

    #[test]
    fn quoted_form_unescapes_and_may_hold_commas() {
        assert_eq!(parse(&[br#""a\"b\\c,d""#]), Ok(Some(br#"a"b\c,d"#.to_vec())));
    }

    #[test]
    fn refuses_more_than_one_value() {
        assert_eq!(parse(&[b"a", b"b"]), Err(KeyError::Multiple));
        assert_eq!(parse(&[b"a, b"]), Err(KeyError::Multiple));
        assert_eq!(parse(&[b"\"a\", \"b\""]), Err(KeyError::Multiple));
    }

    #[test]
    fn refuses_empty_long_and_invisible_keys() {
        assert_eq!(parse(&[b""]), Err(KeyError::Empty));
        assert_eq!(parse(&[b"\"\""]), Err(KeyError::Empty));
        assert_eq!(parse(&[&[b'k'; 255]]), Ok(Some(vec![b'k'; 255])));
        assert_eq!(parse(&[&[b'k'; 256]]), Err(KeyError::TooLong));
        assert_eq!(parse(&[b"a b"]), Err(KeyError::Malformed));
        assert_eq!(parse(&[b"a\tb"]), Err(KeyError::Malformed));
        assert_eq!(parse(&["caf\u{e9}".as_bytes()]), Err(KeyError::Malformed));
        assert_eq!(parse(&[b"\"open"]), Err(KeyError::Malformed));
        assert_eq!(parse(&[b"a\"b"]), Err(KeyError::Malformed));
        assert_eq!(parse(&[br#""bad\escape""#]), Err(KeyError::Malformed));
    }

    #[test]
    fn record_key_separates_scopes_and_hides_the_key() {
        let a = RecordKey::new("idem", b"t1", b"secret-key");
        assert_ne!(a, RecordKey::new("idem", b"t2", b"secret-key"));
        // Length prefixes keep ("ab", "c") and ("a", "bc") apart.
        assert_ne!(RecordKey::new("p", b"ab", b"c"), RecordKey::new("p", b"a", b"bc"));
        assert!(!a.as_str().contains("secret"));
        assert_eq!(a.hash().len(), 64);
        assert_eq!(a.as_str(), format!("idem:{{{}}}", a.hash()));
    }
}

#[cfg(test)]
mod properties {
    use super::*;
    use http::HeaderValue;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 4096, failure_persistence: None, ..ProptestConfig::default() })]

        /// Any header value: no panic, and whatever is accepted is a valid key.
        #[test]
        fn parser_accepts_only_valid_keys(raw in proptest::collection::vec(any::<u8>(), 0..300)) {
            if let Ok(value) = HeaderValue::from_bytes(&raw) {
                let mut headers = HeaderMap::new();
                headers.insert("idempotency-key", value);
                if let Ok(Some(key)) = parse_key(&headers, &HeaderName::from_static("idempotency-key")) {
                    prop_assert!((1..=MAX_KEY_LEN).contains(&key.len()));
                    prop_assert!(key.iter().all(u8::is_ascii_graphic));
                }
            }
        }

        /// Every valid key is accepted bare (when it has no comma or quote) and quoted, as itself.
        #[test]
        fn valid_keys_round_trip(key in "[!-~]{1,255}") {
            let name = HeaderName::from_static("idempotency-key");
            let quoted = format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""));
            let mut headers = HeaderMap::new();
            headers.insert(&name, HeaderValue::from_str(&quoted).unwrap());
            prop_assert_eq!(parse_key(&headers, &name), Ok(Some(key.clone().into_bytes())));
            if !key.contains([',', '"']) {
                headers.insert(&name, HeaderValue::from_str(&key).unwrap());
                prop_assert_eq!(parse_key(&headers, &name), Ok(Some(key.into_bytes())));
            }
        }
    }
}
