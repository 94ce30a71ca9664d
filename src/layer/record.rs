//! The stored response: a compact, versioned, binary-safe blob of the headers a
//! [`HeaderFilter`] lets through.
//!
//! Layout (all integers big-endian), after the engine's envelope (format `Http`, 2, and the
//! completion time; see `crate::engine::envelope`):
//!
//! ```text
//! u8 format (2) | u64 completed at (ms since the Unix epoch) | u16 status | u16 header count
//!   | { u16 name len, name, u32 value len, value }* | body
//! ```
//!
//! A response with trailers (format `HttpWithTrailers`, 4: the gRPC door's) has them after its
//! headers, in the same form: `| u16 trailer count | { ... }* | body`.
//!
//! One blob in one hash field keeps a completed record small (see `BENCHMARKS.md`).

use std::time::{Duration, SystemTime};

use bytes::{Buf, BufMut, Bytes};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};

pub(crate) use super::header_filter::HeaderFilter;
use crate::engine::{
    Label,
    envelope::{self, Format, Parsed},
};

/// A response as stored for replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoredResponse {
    /// When the response was stored, by the clock of the instance that stored it.
    pub(crate) completed_at: SystemTime,
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    /// The body; a minimal record's value ([`super::Minimal`]) when `minimal`.
    pub(crate) body: Bytes,
    /// Stored minimally: `body` is the handler's value, and a hook rebuilds the replay.
    pub(crate) minimal: bool,
    /// Its trailers, when it was stored with them (format `HttpWithTrailers`).
    pub(crate) trailers: Option<HeaderMap>,
}

/// Why a stored blob could not be read back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DecodeError(pub(crate) &'static str);

/// Encodes `status`, the headers that `filter` lets through, and `body`.
pub(crate) fn encode(
    status: StatusCode,
    headers: &HeaderMap,
    filter: &HeaderFilter,
    body: &[u8],
) -> Bytes {
    encode_as(Format::Http, status, headers, None, filter, body)
}

#[cfg(feature = "tonic")]
/// Encodes a response with its trailers (a gRPC response): the headers and the trailers that
/// `filter` lets through, and `body`.
pub(crate) fn encode_with_trailers(
    status: StatusCode,
    headers: &HeaderMap,
    trailers: &HeaderMap,
    filter: &HeaderFilter,
    body: &[u8],
) -> Bytes {
    encode_as(Format::HttpWithTrailers, status, headers, Some(trailers), filter, body)
}

/// Encodes a response as the layer stores it: whole, or minimally when the handler put a
/// [`Minimal`](super::Minimal) in it (its value in place of `body`).
pub(crate) fn encode_response(
    head: &http::response::Parts,
    filter: &HeaderFilter,
    body: &[u8],
) -> Bytes {
    encode_head(head.status, &head.headers, &head.extensions, filter, body)
}

/// Encodes a whole response (one the recovery hook found) as [`encode_response`] does.
pub(crate) fn encode_whole(response: &http::Response<Bytes>, filter: &HeaderFilter) -> Bytes {
    let (status, headers, extensions) =
        (response.status(), response.headers(), response.extensions());
    encode_head(status, headers, extensions, filter, response.body())
}

fn encode_head(
    status: StatusCode,
    headers: &HeaderMap,
    extensions: &http::Extensions,
    filter: &HeaderFilter,
    body: &[u8],
) -> Bytes {
    match extensions.get::<super::Minimal>() {
        Some(minimal) => encode_as(Format::HttpMinimal, status, headers, None, filter, &minimal.0),
        None => encode(status, headers, filter, body),
    }
}

fn encode_as(
    format: Format,
    status: StatusCode,
    headers: &HeaderMap,
    trailers: Option<&HeaderMap>,
    filter: &HeaderFilter,
    body: &[u8],
) -> Bytes {
    type Kept<'a> = Vec<(&'a HeaderName, &'a HeaderValue)>;
    let headers: Kept<'_> = filter.kept(headers).collect();
    let trailers: Option<Kept<'_>> = trailers.map(|trailers| filter.kept(trailers).collect());
    let size = |kept: &Kept<'_>| {
        2 + kept.iter().map(|(n, v)| 6 + n.as_str().len() + v.len()).sum::<usize>()
    };
    let size = 2 + size(&headers) + trailers.as_ref().map_or(0, size);
    let mut out = envelope::begin(format, size + body.len());
    out.put_u16(status.as_u16());
    for kept in std::iter::once(headers).chain(trailers) {
        // HeaderMap caps itself far below u16::MAX entries and u32::MAX bytes per value; the
        // casts cannot truncate.
        out.put_u16(kept.len() as u16);
        for (name, value) in kept {
            out.put_u16(name.as_str().len() as u16);
            out.put_slice(name.as_str().as_bytes());
            out.put_u32(value.len() as u32);
            out.put_slice(value.as_bytes());
        }
    }
    out.put_slice(body);
    out.freeze()
}

/// The bytes the headers that `filter` lets through take in a stored record.
pub(crate) fn stored_headers_len(headers: &HeaderMap, filter: &HeaderFilter) -> usize {
    filter.kept(headers).map(|(name, value)| 6 + name.as_str().len() + value.len()).sum()
}

/// Whether a stored response may be replayed to a request with these headers: a body stored
/// with a `Content-Encoding` (a compression layer sat inside this one) only to a request whose
/// `Accept-Encoding` accepts that coding (RFC 9110 12.5.3: no header accepts any coding; a
/// coding, or `*`, with `q=0` is refused).
pub(crate) fn encoding_acceptable(stored: &HeaderMap, request: &HeaderMap) -> bool {
    let Some(coding) = stored.get(header::CONTENT_ENCODING).and_then(|v| v.to_str().ok()) else {
        return true;
    };
    let coding = coding.trim();
    if coding.eq_ignore_ascii_case("identity") {
        return true;
    }
    let mut offers = request.get_all(header::ACCEPT_ENCODING).iter().peekable();
    if offers.peek().is_none() {
        return true;
    }
    let (mut named, mut star) = (None, None);
    for offer in offers.filter_map(|v| v.to_str().ok()).flat_map(|v| v.split(',')) {
        let mut fields = offer.split(';');
        let name = fields.next().unwrap_or("").trim();
        let refused = fields.any(|param| {
            let param = param.trim().to_ascii_lowercase();
            param.strip_prefix("q=").is_some_and(|q| q.parse::<f32>().is_ok_and(|q| q <= 0.0))
        });
        if name.eq_ignore_ascii_case(coding) {
            named = Some(!refused);
        } else if name == "*" {
            star = Some(!refused);
        }
    }
    named.or(star).unwrap_or(false)
}

/// The record of a response that ran but is too large to keep: its status and why, no
/// headers, no body. Every retry is answered that it ran (`response-not-replayable`).
pub(crate) fn not_replayable(status: StatusCode, why: &str) -> Bytes {
    envelope::not_stored(&format!("the request ran (status {}) but {why}", status.as_u16()))
}

/// Decodes a blob written by [`encode`], observing its age for `route`. Never panics; the body
/// shares `blob`'s memory.
pub(crate) fn decode(blob: Bytes, route: &Label) -> Result<StoredResponse, DecodeError> {
    let Some(opened) = envelope::parse(blob, route) else {
        return Err(DecodeError("unknown response format, or a truncated header"));
    };
    decode_parsed(opened)
}

/// Decodes a record whose envelope was read: a response without trailers (the HTTP layer's).
pub(crate) fn decode_parsed(opened: Parsed) -> Result<StoredResponse, DecodeError> {
    decode_as(opened, false)
}

/// Decodes a record of a response with trailers (the gRPC door's) whose envelope was read.
#[cfg(feature = "tonic")]
pub(crate) fn decode_with_trailers(opened: Parsed) -> Result<StoredResponse, DecodeError> {
    decode_as(opened, true)
}

fn decode_as(opened: Parsed, with_trailers: bool) -> Result<StoredResponse, DecodeError> {
    let (completed_at, mut blob) = match (opened.format, with_trailers) {
        (Format::Http | Format::HttpMinimal, false) | (Format::HttpWithTrailers, true) => {
            (opened.completed_at, opened.payload)
        }
        _ => return Err(DecodeError("unknown response format")),
    };
    let minimal = opened.format == Format::HttpMinimal;
    if blob.remaining() < 2 {
        return Err(DecodeError("truncated header"));
    }
    let status = StatusCode::from_u16(blob.get_u16()).map_err(|_| DecodeError("invalid status"))?;
    let headers = get_headers(&mut blob)?;
    let trailers = if with_trailers { Some(get_headers(&mut blob)?) } else { None };
    Ok(StoredResponse { completed_at, status, headers, body: blob, minimal, trailers })
}

/// Reads a count of headers, then each name and value, as [`encode_as`] writes them.
fn get_headers(blob: &mut Bytes) -> Result<HeaderMap, DecodeError> {
    if blob.remaining() < 2 {
        return Err(DecodeError("truncated header"));
    }
    let count = blob.get_u16();
    // Each header takes at least 6 bytes: a count the blob cannot hold is not trusted for the
    // allocation. A large blob can seem to hold more headers than `HeaderMap` takes, whose
    // `with_capacity` panics past its maximum: ask with `try_with_capacity`.
    if usize::from(count) > blob.remaining() / 6 {
        return Err(DecodeError("header count larger than the record"));
    }
    let mut headers = HeaderMap::try_with_capacity(usize::from(count))
        .map_err(|_| DecodeError("header count larger than a header map holds"))?;
    for _ in 0..count {
        let name = take(blob, 2)?;
        let name = HeaderName::from_bytes(&name).map_err(|_| DecodeError("invalid header name"))?;
        let value = take(blob, 4)?;
        let value = HeaderValue::from_maybe_shared(value)
            .map_err(|_| DecodeError("invalid header value"))?;
        headers.try_append(name, value).map_err(|_| DecodeError("too many headers"))?;
    }
    Ok(headers)
}

/// Takes one length-prefixed field whose length is `width` bytes wide.
fn take(blob: &mut Bytes, width: usize) -> Result<Bytes, DecodeError> {
    if blob.remaining() < width {
        return Err(DecodeError("truncated length"));
    }
    let len = if width == 2 { usize::from(blob.get_u16()) } else { blob.get_u32() as usize };
    if blob.remaining() < len {
        return Err(DecodeError("truncated field"));
    }
    Ok(blob.split_to(len))
}

/// Says on `headers` when a record completed at `completed_at` expires, when `retention` is
/// given (the layer advertises expiry): [`EXPIRES_HEADER`](super::EXPIRES_HEADER).
pub(crate) fn advertise_expiry(
    headers: &mut HeaderMap,
    completed_at: SystemTime,
    retention: Option<Duration>,
) {
    let Some(expires) = retention.and_then(|retention| completed_at.checked_add(retention)) else {
        return;
    };
    // An HTTP date is ASCII: the value is always valid.
    if let Ok(value) = HeaderValue::from_str(&httpdate::fmt_http_date(expires)) {
        headers.insert(super::EXPIRES_HEADER, value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The metrics label the tests open records under.
    fn r() -> Label {
        Label::route("r")
    }
    use std::time::Duration;

    fn sample_headers() -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.append("x-multi", HeaderValue::from_static("one"));
        headers.append("x-multi", HeaderValue::from_static("two"));
        headers.insert(header::SET_COOKIE, HeaderValue::from_static("session=1"));
        headers.insert(header::DATE, HeaderValue::from_static("Sun, 22 Nov 2026 00:00:00 GMT"));
        headers.insert(header::CONNECTION, HeaderValue::from_static("x-private"));
        headers.insert("x-private", HeaderValue::from_static("hop"));
        headers
    }

    #[test]
    fn round_trip_keeps_status_body_and_end_to_end_headers() {
        let blob =
            encode(StatusCode::CREATED, &sample_headers(), &HeaderFilter::default(), b"{\"id\":7}");
        let stored = decode(blob, &r()).unwrap();
        assert_eq!(stored.status, StatusCode::CREATED);
        assert_eq!(stored.body, Bytes::from_static(b"{\"id\":7}"));
        assert_eq!(stored.headers.get(header::CONTENT_TYPE).unwrap(), "application/json");
        let multi: Vec<_> = stored.headers.get_all("x-multi").iter().collect();
        assert_eq!(multi, ["one", "two"]);
        for gone in ["set-cookie", "date", "connection", "x-private"] {
            assert!(stored.headers.get(gone).is_none(), "{gone} was stored");
        }
    }

    #[test]
    fn a_last_header_with_an_empty_value_and_no_body_decodes() {
        let mut headers = HeaderMap::new();
        headers.insert("x-empty", HeaderValue::from_static(""));
        let stored =
            decode(encode(StatusCode::OK, &headers, &HeaderFilter::default(), b""), &r()).unwrap();
        assert_eq!(stored.headers, headers);
        assert!(stored.body.is_empty());
    }

    #[test]
    fn an_encoded_body_is_replayed_only_where_its_coding_is_accepted() {
        let mut stored = HeaderMap::new();
        let ask = |accept: Option<&'static str>, stored: &HeaderMap| {
            let mut request = HeaderMap::new();
            if let Some(accept) = accept {
                request.insert(header::ACCEPT_ENCODING, HeaderValue::from_static(accept));
            }
            encoding_acceptable(stored, &request)
        };
        // Not encoded: any request.
        assert!(ask(Some("identity"), &stored));
        stored.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        assert!(ask(None, &stored));
        assert!(ask(Some("gzip"), &stored));
        assert!(ask(Some("br, GZIP;q=0.5"), &stored));
        assert!(ask(Some("*"), &stored));
        assert!(!ask(Some("identity"), &stored));
        assert!(!ask(Some("br"), &stored));
        assert!(!ask(Some("gzip;q=0"), &stored));
        assert!(!ask(Some("*;q=0"), &stored));
        assert!(!ask(Some("*, gzip;q=0"), &stored));
    }

    #[test]
    fn stored_headers_len_counts_what_the_record_holds() {
        let headers = sample_headers();
        let filter = HeaderFilter::default();
        // Kept: content-type (12 + 16) and x-multi twice (7 + 3, 7 + 3), 6 bytes of lengths each.
        assert_eq!(stored_headers_len(&headers, &filter), (6 + 12 + 16) + 2 * (6 + 7 + 3));
        let blob = encode(StatusCode::OK, &headers, &filter, b"");
        assert_eq!(blob.len(), 13 + stored_headers_len(&headers, &filter));
    }

    #[test]
    fn a_record_carries_when_it_was_stored_and_format_1_is_not_read() {
        let before = SystemTime::now() - Duration::from_millis(1);
        let stored =
            decode(encode(StatusCode::OK, &HeaderMap::new(), &HeaderFilter::default(), b"x"), &r())
                .unwrap();
        let at = stored.completed_at;
        assert!(at >= before && at <= SystemTime::now() + Duration::from_millis(1), "{at:?}");
        // Format 1 (no time), which no released version wrote: not a record of this layer.
        assert!(decode(Bytes::from_static(&[1, 0, 201, 0, 0, b'o', b'k']), &r()).is_err());
        // The shortest record of all: its envelope, a status, no header, no body.
        let mut shortest =
            encode(StatusCode::NO_CONTENT, &HeaderMap::new(), &HeaderFilter::default(), b"")
                .to_vec();
        shortest.truncate(13);
        let shortest = decode(Bytes::from(shortest), &r()).unwrap();
        assert_eq!((shortest.status, shortest.body.len()), (StatusCode::NO_CONTENT, 0));
    }

    #[test]
    fn exclusions_are_configurable() {
        let mut filter = HeaderFilter::default();
        filter.include(&header::SET_COOKIE);
        filter.exclude(header::CONTENT_TYPE);
        let stored = decode(encode(StatusCode::OK, &sample_headers(), &filter, b""), &r()).unwrap();
        assert!(stored.headers.get(header::SET_COOKIE).is_some());
        assert!(stored.headers.get(header::CONTENT_TYPE).is_none());
    }

    #[cfg(feature = "tonic")]
    #[test]
    fn trailers_read_back_only_as_a_response_with_trailers() {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        trailers.insert("date", HeaderValue::from_static("Sun, 22 Nov 2026 00:00:00 GMT"));
        let filter = HeaderFilter::default();
        let blob =
            encode_with_trailers(StatusCode::OK, &sample_headers(), &trailers, &filter, b"m");
        let opened = || envelope::parse(blob.clone(), &r()).unwrap();
        let stored = decode_with_trailers(opened()).unwrap();
        let kept = stored.trailers.expect("its trailers");
        assert_eq!(kept.len(), 1, "the filter applies to them: {kept:?}");
        assert_eq!(kept["grpc-status"], "0");
        assert_eq!(stored.headers.get(header::CONTENT_TYPE).unwrap(), "application/json");
        assert_eq!(stored.body, Bytes::from_static(b"m"));
        assert!(decode_parsed(opened()).is_err(), "the HTTP layer does not replay it");
        let http = encode(StatusCode::OK, &HeaderMap::new(), &filter, b"m");
        assert!(decode_with_trailers(envelope::parse(http, &r()).unwrap()).is_err());
        for len in 9..blob.len() - 1 {
            let cut = envelope::parse(blob.slice(..len), &r()).unwrap();
            let read = decode_with_trailers(cut);
            assert!(read.is_err() || read.unwrap().body.is_empty(), "prefix of {len} bytes");
        }
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let blob = encode(StatusCode::OK, &sample_headers(), &HeaderFilter::default(), b"");
        // The body may be empty, so the full blob decodes; every shorter prefix that cuts a
        // header must fail.
        for len in 0..blob.len() {
            assert!(decode(blob.slice(..len), &r()).is_err(), "prefix of {len} bytes decoded");
        }
        assert!(decode(Bytes::from_static(&[2, 0, 200, 0, 0]), &r()).is_err());
        assert!(decode(Bytes::from_static(&[1, 0, 5, 0, 0]), &r()).is_err());
        // A header count past HeaderMap's maximum once panicked the allocation (found by
        // `decoder_survives_bit_flips`).
        assert!(
            decode(Bytes::from_static(&[1, 0, 200, 0xff, 0xff, 0, 0, 0, 0, 0, 0]), &r()).is_err()
        );
    }
}

#[cfg(test)]
mod properties {
    use super::*;
    use proptest::prelude::*;

    fn r() -> Label {
        Label::route("r")
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 4096, failure_persistence: None, ..ProptestConfig::default() })]

        /// Arbitrary bytes never panic the decoder.
        #[test]
        fn decoder_never_panics(blob in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode(Bytes::from(blob), &r());
        }

        /// A stored blob with one byte flipped either decodes or is refused; never a panic.
        #[test]
        fn decoder_survives_bit_flips(body in proptest::collection::vec(any::<u8>(), 0..64), at in any::<usize>(), bit in 0u8..8) {
            let mut headers = HeaderMap::new();
            headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
            let mut blob = encode(StatusCode::OK, &headers, &HeaderFilter::default(), &body).to_vec();
            let at = at % blob.len();
            blob[at] ^= 1 << bit;
            let _ = decode(Bytes::from(blob), &r());
        }

        /// What is encoded is decoded as it was.
        #[test]
        fn round_trip(status in 200u16..600, body in proptest::collection::vec(any::<u8>(), 0..256),
                      values in proptest::collection::vec("[ -~]{0,40}", 0..4)) {
            let mut headers = HeaderMap::new();
            for value in &values {
                headers.append("x-value", HeaderValue::from_str(value).unwrap());
            }
            let status = StatusCode::from_u16(status).unwrap();
            let stored = decode(encode(status, &headers, &HeaderFilter::default(), &body), &r()).unwrap();
            prop_assert_eq!(stored.status, status);
            prop_assert_eq!(stored.headers, headers);
            prop_assert_eq!(stored.body, Bytes::from(body));
        }
    }

    proptest! {
        // Large blobs cost more per case: fewer cases, each up to 600 KB.
        #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

        /// A large blob (up to 600 KB, past `HeaderMap`'s 32,768-entry maximum at 6 bytes a
        /// header) with any header count never panics the decoder.
        #[test]
        fn decoder_never_panics_on_large_blobs(len in 5usize..600_000, count in any::<u16>(), fill in proptest::collection::vec(any::<u8>(), 1..16)) {
            let mut blob: Vec<u8> = fill.iter().copied().cycle().take(len).collect();
            blob[..5].copy_from_slice(&[Format::Http as u8, 0, 200, (count >> 8) as u8, count as u8]);
            let _ = decode(Bytes::from(blob), &r());
        }
    }
}
