//! What a request's fingerprint covers, so that a retry that means the same thing is the same
//! request: canonical JSON, JSON members left out, selected headers, or the app's own function.

use std::{fmt, sync::Arc};

use http::{HeaderName, request::Parts};

use crate::fingerprint::{Fingerprint, PayloadRules, payload_rule_setters};

/// A fingerprint function of the app's own: given the request parts and body, the fingerprint
/// that decides whether a retry is the same request.
///
/// Implemented for closures `Fn(&Parts, &[u8]) -> Fingerprint`:
///
/// ```
/// use axum_idempotency::{Fingerprint, IdempotencyLayer, MemoryStore, layer::Fingerprinting};
///
/// // Only the path and the `amount` member: everything else may change between retries.
/// let layer = IdempotencyLayer::new(MemoryStore::new()).fingerprinting(Fingerprinting::custom(
///     |parts: &http::request::Parts, body: &[u8]| {
///         let json: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
///         Fingerprint::new("", parts.uri.path(), "", json["amount"].to_string().as_bytes())
///     },
/// ));
/// ```
pub trait MakeFingerprint: Send + Sync + 'static {
    /// The fingerprint of one request.
    fn fingerprint(&self, parts: &Parts, body: &[u8]) -> Fingerprint;
}

impl<F> MakeFingerprint for F
where
    F: Fn(&Parts, &[u8]) -> Fingerprint + Send + Sync + 'static,
{
    fn fingerprint(&self, parts: &Parts, body: &[u8]) -> Fingerprint {
        self(parts, body)
    }
}

/// What a request's fingerprint covers
/// ([`IdempotencyLayer::fingerprinting`](super::IdempotencyLayer::fingerprinting)): by
/// default its method, path, query and body as sent; the body as canonical JSON, some of its
/// members left out, some request headers, or the app's own function instead.
///
/// ```
/// use axum_idempotency::{IdempotencyLayer, MemoryStore, layer::Fingerprinting};
/// use http::HeaderName;
///
/// let layer = IdempotencyLayer::new(MemoryStore::new()).fingerprinting(
///     Fingerprinting::default()
///         .ignore_json_member("/client_sent_at")
///         .header(HeaderName::from_static("x-api-version")),
/// );
/// ```
#[derive(Clone, Default)]
#[must_use]
pub struct Fingerprinting {
    /// Canonical JSON and the members left out of it.
    pub(super) payload: PayloadRules,
    /// Request headers whose values are part of the fingerprint.
    pub(super) headers: Vec<HeaderName>,
    pub(super) custom: Option<Arc<dyn MakeFingerprint>>,
}

impl Fingerprinting {
    /// Fingerprints requests with the app's own function (see [`MakeFingerprint`]); the other
    /// options do not apply.
    pub fn custom(make: impl MakeFingerprint) -> Self {
        Self { custom: Some(Arc::new(make)), ..Self::default() }
    }

    fn payload_rules(&mut self) -> &mut PayloadRules {
        &mut self.payload
    }

    payload_rule_setters!();

    /// Makes a request header part of the fingerprint (an API version, `Content-Type`): a
    /// retry with another value, or without the header, is another request.
    pub fn header(mut self, name: HeaderName) -> Self {
        self.headers.push(name);
        self
    }
}

impl fmt::Debug for Fingerprinting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fingerprinting")
            .field("payload", &self.payload)
            .field("headers", &self.headers)
            .field("custom", &self.custom.is_some())
            .finish()
    }
}

impl Fingerprinting {
    /// The fingerprint of a request whose full original path and query are `path`, `query`.
    pub(super) fn fingerprint(
        &self,
        parts: &Parts,
        path: &str,
        query: &str,
        body: &[u8],
    ) -> Fingerprint {
        if let Some(custom) = &self.custom {
            return custom.fingerprint(parts, body);
        }
        let body = self.payload.apply(body);
        let request = [parts.method.as_str().as_bytes(), path.as_bytes(), query.as_bytes(), &body];
        if self.headers.is_empty() {
            // No list to build: most layers fingerprint no header.
            return Fingerprint::of_fields(&request);
        }
        let mut fields: Vec<&[u8]> = request.to_vec();
        // Each selected header: its name, then whether it is there, then its values.
        let values: Vec<Vec<u8>> = self
            .headers
            .iter()
            .map(|name| {
                let mut joined = Vec::new();
                for value in parts.headers.get_all(name) {
                    joined.extend_from_slice(&(value.len() as u64).to_be_bytes());
                    joined.extend_from_slice(value.as_bytes());
                }
                joined
            })
            .collect();
        for (name, value) in self.headers.iter().zip(&values) {
            fields.push(name.as_str().as_bytes());
            fields.push(value);
        }
        Fingerprint::of_fields(&fields)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(headers: &[(&str, &str)]) -> Parts {
        let mut request = http::Request::post("/p");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request.body(()).unwrap().into_parts().0
    }

    fn json_intent(ignored: &[&str]) -> Fingerprinting {
        let payload = PayloadRules {
            canonical_json: true,
            ignored_members: ignored.iter().map(|p| (*p).to_owned()).collect(),
        };
        Fingerprinting { payload, ..Fingerprinting::default() }
    }

    #[test]
    fn canonical_json_ignores_order_whitespace_and_number_form() {
        let intent = json_intent(&[]);
        let p = parts(&[]);
        let a = intent.fingerprint(&p, "/p", "", br#"{"b":1,"a":[1.0,2]}"#);
        let b = intent.fingerprint(&p, "/p", "", b"{ \"a\" : [1, 2e0],\n \"b\": 1 }");
        assert_eq!(a, b);
        assert_ne!(a, intent.fingerprint(&p, "/p", "", br#"{"b":2,"a":[1,2]}"#));
    }

    #[test]
    fn ignored_members_are_left_out_wherever_they_are() {
        let intent = json_intent(&["/client_sent_at", "/meta/trace~1id", "/items/0"]);
        let p = parts(&[]);
        let a = intent.fingerprint(
            &p,
            "/p",
            "",
            br#"{"amount":1,"client_sent_at":1,"meta":{"trace/id":"x"},"items":[9,8]}"#,
        );
        let b = intent.fingerprint(
            &p,
            "/p",
            "",
            br#"{"amount":1,"client_sent_at":2,"meta":{"trace/id":"y"},"items":[7,8]}"#,
        );
        assert_eq!(a, b);
        let c = intent.fingerprint(
            &p,
            "/p",
            "",
            br#"{"amount":2,"client_sent_at":1,"meta":{},"items":[0,8]}"#,
        );
        assert_ne!(a, c);
    }

    #[test]
    fn a_pointer_to_nothing_removes_nothing_and_never_panics() {
        let intent = json_intent(&["/items/2", "/items/x", "/missing/a", "no-slash", ""]);
        let p = parts(&[]);
        let a = intent.fingerprint(&p, "/p", "", br#"{"items":[1,2]}"#);
        assert_eq!(a, json_intent(&[]).fingerprint(&p, "/p", "", br#"{"items":[1,2]}"#));
        assert_ne!(a, intent.fingerprint(&p, "/p", "", br#"{"items":[1]}"#));
    }

    #[test]
    fn a_body_that_is_not_json_is_fingerprinted_as_bytes() {
        let intent = json_intent(&[]);
        let p = parts(&[]);
        assert_eq!(
            intent.fingerprint(&p, "/p", "", b"not json"),
            intent.fingerprint(&p, "/p", "", b"not json")
        );
        assert_ne!(
            intent.fingerprint(&p, "/p", "", b"not json"),
            intent.fingerprint(&p, "/p", "", b"not  json")
        );
        // Without the option, JSON is bytes too.
        let plain = Fingerprinting::default();
        assert_ne!(
            plain.fingerprint(&p, "/p", "", br#"{"a":1}"#),
            plain.fingerprint(&p, "/p", "", br#"{ "a":1}"#)
        );
    }

    #[test]
    fn selected_headers_are_part_of_the_request() {
        let intent = Fingerprinting {
            headers: vec![HeaderName::from_static("x-api-version")],
            ..Fingerprinting::default()
        };
        let v1 = intent.fingerprint(&parts(&[("x-api-version", "1")]), "/p", "", b"");
        assert_eq!(
            v1,
            intent.fingerprint(&parts(&[("x-api-version", "1"), ("x-other", "z")]), "/p", "", b"")
        );
        assert_ne!(v1, intent.fingerprint(&parts(&[("x-api-version", "2")]), "/p", "", b""));
        assert_ne!(v1, intent.fingerprint(&parts(&[]), "/p", "", b""));
        // With no header selected, the default is the method, path, query and body alone.
        assert_eq!(
            Fingerprinting::default().fingerprint(&parts(&[]), "/p", "q", b"b"),
            Fingerprint::new("POST", "/p", "q", b"b")
        );
    }
}
