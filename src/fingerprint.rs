//! The request fingerprint: what makes a retry "the same request".

use std::fmt;

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
}

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
