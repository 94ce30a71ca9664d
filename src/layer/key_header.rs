//! The `Idempotency-Key` header: parsing and validation.

use http::{HeaderMap, HeaderName};

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
    /// The key has a character outside visible ASCII (outside printable ASCII in a quoted
    /// key), or a malformed quoted string.
    Malformed,
    /// A quoted key carries structured-field parameters (`"k";a=1`): the key is a bare
    /// string.
    Parameters,
}

impl KeyError {
    pub(crate) fn detail(self) -> &'static str {
        match self {
            Self::Multiple => "the Idempotency-Key header must appear exactly once, with one value",
            Self::Empty => "the Idempotency-Key header is empty",
            Self::TooLong => "the Idempotency-Key is longer than 255 characters",
            Self::Malformed => {
                "the Idempotency-Key must be 1 to 255 visible ASCII characters, or printable ASCII characters (spaces included) as a quoted string"
            }
            Self::Parameters => {
                "the Idempotency-Key must be a string without parameters: nothing may follow its closing quote"
            }
        }
    }
}

/// Parses the key from every value of the header `name`.
///
/// Accepts a bare token (`abc-123`) and the IETF structured-header string form (`"abc-123"`,
/// with `\"` and `\\` escapes). The key is 1..=255 characters: visible ASCII (`!` to `~`)
/// when bare; printable ASCII (space to `~`, what RFC 8941 allows in an sf-string) when quoted,
/// so `"order 1"` is the key `order 1`. A bare key may not contain `,` or `"`: a comma is how
/// proxies join repeated headers, so it is refused as [`KeyError::Multiple`]. Returns
/// `Ok(None)` when the header is absent.
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
    let (key, allowed): (Vec<u8>, fn(&u8) -> bool) = match raw {
        [b'"', inner @ ..] => (unquote(inner)?, |b| b.is_ascii_graphic() || *b == b' '),
        _ => {
            if raw.contains(&b',') {
                return Err(KeyError::Multiple);
            }
            if raw.contains(&b'"') {
                return Err(KeyError::Malformed);
            }
            (raw.to_vec(), u8::is_ascii_graphic)
        }
    };
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if !key.iter().all(allowed) {
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
            // Something after the closing quote: a list, parameters, or stray text.
            b'"' => {
                return Err(match bytes.as_slice().trim_ascii_start().first() {
                    Some(b',') => KeyError::Multiple,
                    Some(b';') => KeyError::Parameters,
                    _ => KeyError::Malformed,
                });
            }
            _ => key.push(b),
        }
    }
    // No closing quote.
    Err(KeyError::Malformed)
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
    fn a_quoted_key_may_hold_spaces_as_rfc_8941_allows() {
        assert_eq!(parse(&[b"\"order 1\""]), Ok(Some(b"order 1".to_vec())));
        assert_eq!(parse(&[b"\" \""]), Ok(Some(b" ".to_vec())));
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
    fn a_quoted_key_with_parameters_or_trailing_text_says_so() {
        assert_eq!(parse(&[b"\"k\";a=1"]), Err(KeyError::Parameters));
        assert_eq!(parse(&[b"\"k\" ;a"]), Err(KeyError::Parameters));
        assert_eq!(parse(&[b"\"k\"x"]), Err(KeyError::Malformed));
        assert!(KeyError::Parameters.detail().contains("without parameters"));
    }

    #[test]
    fn refuses_empty_long_and_invisible_keys() {
        assert_eq!(parse(&[b""]), Err(KeyError::Empty));
        assert_eq!(parse(&[b"\"\""]), Err(KeyError::Empty));
        assert_eq!(parse(&[&[b'k'; 255]]), Ok(Some(vec![b'k'; 255])));
        assert_eq!(parse(&[&[b'k'; 256]]), Err(KeyError::TooLong));
        assert_eq!(parse(&[b"a b"]), Err(KeyError::Malformed));
        assert_eq!(parse(&[b"\"a\tb\""]), Err(KeyError::Malformed));
        assert_eq!(parse(&[b"a\tb"]), Err(KeyError::Malformed));
        assert_eq!(parse(&["caf\u{e9}".as_bytes()]), Err(KeyError::Malformed));
        assert_eq!(parse(&[b"\"open"]), Err(KeyError::Malformed));
        assert_eq!(parse(&[b"a\"b"]), Err(KeyError::Malformed));
        assert_eq!(parse(&[br#""bad\escape""#]), Err(KeyError::Malformed));
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
                    prop_assert!(key.iter().all(|b| b.is_ascii_graphic() || *b == b' '));
                }
            }
        }

        /// Every valid key is accepted quoted, and bare when it has no comma, quote or space,
        /// as itself.
        #[test]
        fn valid_keys_round_trip(key in "[ -~]{1,255}") {
            let name = HeaderName::from_static("idempotency-key");
            let quoted = format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""));
            let mut headers = HeaderMap::new();
            headers.insert(&name, HeaderValue::from_str(&quoted).unwrap());
            prop_assert_eq!(parse_key(&headers, &name), Ok(Some(key.clone().into_bytes())));
            if !key.contains([',', '"', ' ']) {
                headers.insert(&name, HeaderValue::from_str(&key).unwrap());
                prop_assert_eq!(parse_key(&headers, &name), Ok(Some(key.into_bytes())));
            }
        }
    }
}
