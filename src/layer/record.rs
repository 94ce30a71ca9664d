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
mod tests;

#[cfg(test)]
mod properties;
