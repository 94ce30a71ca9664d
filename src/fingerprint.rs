//! The request fingerprint: what makes a retry "the same request", and the payload rules
//! every front door applies before hashing (canonical JSON, members left out).

use std::{borrow::Cow, fmt};

use sha2::{Digest, Sha256};

/// SHA-256 over the length-prefixed method, path, query and body of a request.
///
/// The layer passes the request's full original path (`/orders/7/capture`, before any `nest`
/// stripped a prefix) and its query, so that one key sent to two resources of one route is two
/// requests. Each field is length-prefixed, so no field can bleed into the next.
#[derive(Clone, PartialEq, Eq)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Fingerprints one request from its parts.
    ///
    /// ```
    /// use axum_idempotency::Fingerprint;
    ///
    /// let a = Fingerprint::new("POST", "/payments", "", br#"{"amount":100}"#);
    /// let b = Fingerprint::new("POST", "/payments", "", br#"{"amount":101}"#);
    /// assert_ne!(a, b);
    /// ```
    #[must_use]
    pub fn new(method: &str, path: &str, query: &str, body: &[u8]) -> Self {
        Self::of_fields(&[method.as_bytes(), path.as_bytes(), query.as_bytes(), body])
    }

    /// SHA-256 over each field, length-prefixed: the one digest of the crate (request
    /// fingerprints, record keys, derived keys), so that no two field lists collide.
    pub(crate) fn of_fields(fields: &[&[u8]]) -> Self {
        let mut hasher = Sha256::new();
        for field in fields {
            hasher.update((field.len() as u64).to_be_bytes());
            hasher.update(field);
        }
        Self(hasher.finalize().into())
    }

    /// Fingerprints an opaque payload, such as an event's canonical bytes: what the consumer
    /// door ([`Idempotent`](crate::Idempotent)) compares a redelivery by.
    ///
    /// ```
    /// use axum_idempotency::Fingerprint;
    ///
    /// assert_eq!(Fingerprint::of_payload(b"charge 100"), Fingerprint::of_payload(b"charge 100"));
    /// assert_ne!(Fingerprint::of_payload(b"charge 100"), Fingerprint::of_payload(b"charge 101"));
    /// ```
    #[must_use]
    pub fn of_payload(payload: &[u8]) -> Self {
        // Tagged, so that no payload fingerprints like an HTTP request.
        Self::new("", "payload", "", payload)
    }

    /// The 32 digest bytes, as written to the store.
    #[must_use]
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The fingerprint whose digest is `digest`.
    pub(crate) const fn from_digest(digest: [u8; 32]) -> Self {
        Self(digest)
    }

    /// A fingerprint as a store holds it, read back; `None` unless it is 32 bytes.
    #[cfg_attr(not(any(feature = "postgres", feature = "redis")), allow(dead_code))]
    pub(crate) fn from_stored(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Self)
    }
}

/// What a payload's fingerprint covers: its bytes as sent, or its JSON in RFC 8785 canonical
/// form without some members. The HTTP door applies it to a request body, the consumer door to
/// an event's payload.
#[derive(Debug, Clone, Default)]
pub(crate) struct PayloadRules {
    /// Canonicalize a JSON payload (RFC 8785) before hashing it.
    pub(crate) canonical_json: bool,
    /// JSON Pointers (RFC 6901) of members left out of a canonical JSON payload.
    pub(crate) ignored_members: Vec<String>,
}

impl PayloadRules {
    /// The bytes to hash: the payload in RFC 8785 form, without the ignored members, when
    /// canonical JSON is on and it is JSON; the bytes as they are otherwise.
    pub(crate) fn apply<'a>(&self, payload: &'a [u8]) -> Cow<'a, [u8]> {
        if !self.canonical_json {
            return Cow::Borrowed(payload);
        }
        let Ok(mut json) = serde_json::from_slice::<serde_json::Value>(payload) else {
            return Cow::Borrowed(payload);
        };
        for pointer in &self.ignored_members {
            remove(&mut json, pointer);
        }
        match serde_json_canonicalizer::to_vec(&json) {
            Ok(canonical) => Cow::Owned(canonical),
            Err(_) => Cow::Borrowed(payload),
        }
    }
}

/// Removes the member or element that the JSON Pointer `pointer` names, if there is one.
fn remove(json: &mut serde_json::Value, pointer: &str) {
    let Some((parent, last)) = pointer.rsplit_once('/') else { return };
    let last = last.replace("~1", "/").replace("~0", "~");
    match json.pointer_mut(parent) {
        Some(serde_json::Value::Object(members)) => {
            members.remove(&last);
        }
        Some(serde_json::Value::Array(elements)) => {
            if let Ok(index) = last.parse::<usize>()
                && index < elements.len()
            {
                elements.remove(index);
            }
        }
        _ => {}
    }
}

/// The payload-rule setters every door's builder shares, written once. A builder that invokes
/// it has a `fn payload_rules(&mut self) -> &mut PayloadRules`.
macro_rules! payload_rule_setters {
    () => {
        /// Fingerprints a JSON payload (the HTTP door's request body, the consumer door's
        /// payload) in its RFC 8785 canonical form (JCS, by `serde_json_canonicalizer`): member
        /// order, whitespace and number form do not make a retry another request. A payload
        /// that is not JSON is fingerprinted as its bytes. Numbers are IEEE 754 doubles, as RFC
        /// 8785 says: integers beyond 2^53 that differ only past a double's precision
        /// fingerprint alike; send such values as strings. Defaults to `false` (the bytes as
        /// sent).
        pub fn canonical_json(mut self, canonical: bool) -> Self {
            self.payload_rules().canonical_json = canonical;
            self
        }

        /// Leaves the JSON member that `pointer` (RFC 6901, such as `/client_sent_at`) names out
        /// of the fingerprint, so that a volatile field (a send time, a delivery attempt) does
        /// not make every retry a mismatch. Turns [`canonical_json`](Self::canonical_json) on.
        pub fn ignore_json_member(mut self, pointer: impl Into<String>) -> Self {
            let rules = self.payload_rules();
            rules.canonical_json = true;
            rules.ignored_members.push(pointer.into());
            self
        }
    };
}

pub(crate) use payload_rule_setters;

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Fingerprint(")?;
        for byte in &self.0[..8] {
            write!(f, "{byte:02x}")?;
        }
        f.write_str("..)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_field_changes_the_fingerprint() {
        let base = Fingerprint::new("POST", "/a", "x=1", b"body");
        assert_eq!(base, Fingerprint::new("POST", "/a", "x=1", b"body"));
        assert_ne!(base, Fingerprint::new("PATCH", "/a", "x=1", b"body"));
        assert_ne!(base, Fingerprint::new("POST", "/b", "x=1", b"body"));
        assert_ne!(base, Fingerprint::new("POST", "/a", "x=2", b"body"));
        assert_ne!(base, Fingerprint::new("POST", "/a", "x=1", b"bodY"));
    }

    #[test]
    fn debug_shows_the_first_eight_bytes_in_hex() {
        let fingerprint = Fingerprint::new("POST", "/a", "", b"");
        let hex: String = fingerprint.as_bytes()[..8].iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(format!("{fingerprint:?}"), format!("Fingerprint({hex}..)"));
    }

    #[test]
    fn a_payload_never_fingerprints_like_a_request() {
        assert_eq!(Fingerprint::of_payload(b"x"), Fingerprint::of_payload(b"x"));
        assert_ne!(Fingerprint::of_payload(b"x"), Fingerprint::of_payload(b"y"));
        assert_ne!(Fingerprint::of_payload(b"x"), Fingerprint::new("", "", "", b"x"));
    }

    #[test]
    fn fields_cannot_bleed_into_each_other() {
        assert_ne!(
            Fingerprint::new("POST", "/a", "b", b""),
            Fingerprint::new("POST", "/ab", "", b"")
        );
    }
}
