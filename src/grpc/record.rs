//! The stored form of a gRPC response: its headers, its body (the framed message, as the
//! handler's server sent it) and its trailers; or the record of a call that completed without
//! a replayable response. And the response rebuilt from either.

use std::convert::Infallible;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Response};
use http_body::Frame;
use http_body_util::{BodyExt as _, StreamBody};
use tonic::{Code, body::Body};

use super::REPLAYED_METADATA;
use crate::{
    engine::{Label, envelope},
    recovery::BoxError,
};

/// Why a response was not kept for replay: its record would be over the stored limit.
pub(super) const OVER_STORED_LIMIT: &str = "the response is over the stored limit";

const RESPONSE: u8 = b'R';
const NOT_REPLAYABLE: u8 = b'N';

/// A whole gRPC response: its head, the bytes of its body, its trailers.
#[derive(Debug)]
pub(super) struct Collected {
    pub(super) head: http::response::Parts,
    pub(super) body: Bytes,
    pub(super) trailers: Option<HeaderMap>,
}

impl Collected {
    /// The call's status: the trailers' `grpc-status`, or the headers' in a trailers-only
    /// response; `UNKNOWN` when neither has one.
    pub(super) fn code(&self) -> Code {
        let code = |headers: &HeaderMap| {
            let value = headers.get("grpc-status")?.to_str().ok()?;
            value.parse::<i32>().ok().map(Code::from_i32)
        };
        let trailers = self.trailers.as_ref().and_then(code);
        trailers.or_else(|| code(&self.head.headers)).unwrap_or(Code::Unknown)
    }

    /// The response again, its body and trailers sent as they came.
    pub(super) fn into_response(self) -> Response<Body> {
        Response::from_parts(self.head, body(self.body, self.trailers))
    }

    /// How it is stored.
    pub(super) fn encode(&self) -> Bytes {
        encode(&self.head.headers, &self.body, self.trailers.as_ref())
    }
}

/// Reads a response whole, trailers included.
pub(super) async fn collect<B>(response: Response<B>) -> Result<Collected, BoxError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let (head, body) = response.into_parts();
    let collected = body.collect().await.map_err(Into::into)?;
    let trailers = collected.trailers().cloned();
    Ok(Collected { head, body: collected.to_bytes(), trailers })
}

/// A body of `data` then `trailers`.
fn body(data: Bytes, trailers: Option<HeaderMap>) -> Body {
    let mut frames = Vec::with_capacity(2);
    if !data.is_empty() {
        frames.push(Ok::<_, Infallible>(Frame::data(data)));
    }
    if let Some(trailers) = trailers {
        frames.push(Ok(Frame::trailers(trailers)));
    }
    Body::new(StreamBody::new(futures_util::stream::iter(frames)))
}

/// The headers a replay would get wrong if they were stored: the connection's, the time's,
/// and the replay marker (set on each replay).
fn kept(name: &HeaderName) -> bool {
    !matches!(name.as_str(), "date" | "content-length" | "transfer-encoding" | "connection")
        && name.as_str() != REPLAYED_METADATA
}

/// The record of a response with these headers, body and trailers.
pub(super) fn encode(headers: &HeaderMap, body: &[u8], trailers: Option<&HeaderMap>) -> Bytes {
    let mut out = envelope::begin(envelope::Format::Grpc, body.len() + 256);
    out.put_u8(RESPONSE);
    put_headers(&mut out, headers);
    put_bytes(&mut out, body);
    match trailers {
        Some(trailers) => {
            out.put_u8(1);
            put_headers(&mut out, trailers);
        }
        None => out.put_u8(0),
    }
    out.freeze()
}

/// The record of a call that completed, whose response is not kept (`why`): a retry is told
/// so, and the call does not run again.
pub(super) fn not_replayable(why: &str) -> Bytes {
    let mut out = envelope::begin(envelope::Format::Grpc, why.len() + 1);
    out.put_u8(NOT_REPLAYABLE);
    out.put_slice(why.as_bytes());
    out.freeze()
}

fn put_bytes(out: &mut BytesMut, bytes: &[u8]) {
    out.put_u32(u32::try_from(bytes.len()).unwrap_or(u32::MAX));
    out.put_slice(bytes);
}

fn put_headers(out: &mut BytesMut, headers: &HeaderMap) {
    let kept: Vec<_> = headers.iter().filter(|(name, _)| kept(name)).collect();
    out.put_u32(u32::try_from(kept.len()).unwrap_or(u32::MAX));
    for (name, value) in kept {
        put_bytes(out, name.as_str().as_bytes());
        put_bytes(out, value.as_bytes());
    }
}

/// What a record holds.
#[derive(Debug)]
pub(super) enum Stored {
    /// A response, to replay.
    Response(Box<Collected>),
    /// A call that completed without a replayable response: why.
    NotReplayable(String),
}

/// Reads a record this door wrote; `None` for anything else.
pub(super) fn decode(record: Bytes, route: &Label) -> Option<Stored> {
    let opened = envelope::parse(record, route)?;
    if opened.format != envelope::Format::Grpc {
        return None;
    }
    let mut payload = opened.payload;
    if !payload.has_remaining() {
        return None;
    }
    match payload.get_u8() {
        NOT_REPLAYABLE => {
            Some(Stored::NotReplayable(String::from_utf8_lossy(&payload).into_owned()))
        }
        RESPONSE => {
            let headers = get_headers(&mut payload)?;
            let body = get_bytes(&mut payload)?;
            let trailers = match payload.has_remaining().then(|| payload.get_u8())? {
                0 => None,
                _ => Some(get_headers(&mut payload)?),
            };
            let mut response = Response::new(());
            *response.headers_mut() = headers;
            let (head, ()) = response.into_parts();
            Some(Stored::Response(Box::new(Collected { head, body, trailers })))
        }
        _ => None,
    }
}

fn get_bytes(payload: &mut Bytes) -> Option<Bytes> {
    if payload.remaining() < 4 {
        return None;
    }
    let len = payload.get_u32() as usize;
    (payload.remaining() >= len).then(|| payload.split_to(len))
}

fn get_headers(payload: &mut Bytes) -> Option<HeaderMap> {
    if payload.remaining() < 4 {
        return None;
    }
    let count = payload.get_u32();
    let mut headers = HeaderMap::new();
    for _ in 0..count {
        let name = HeaderName::from_bytes(&get_bytes(payload)?).ok()?;
        let value = HeaderValue::from_maybe_shared(get_bytes(payload)?).ok()?;
        headers.append(name, value);
    }
    Some(headers)
}

/// A stored response, replayed: marked with `idempotency-replayed: true`.
pub(super) fn replayed(mut stored: Box<Collected>) -> Response<Body> {
    let marker = HeaderValue::from_static("true");
    stored.head.headers.insert(HeaderName::from_static(REPLAYED_METADATA), marker);
    stored.into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_response_reads_back_as_it_was_stored_without_the_connection_headers() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/grpc"));
        headers.insert("date", HeaderValue::from_static("Thu, 01 Jan 1970 00:00:00 GMT"));
        headers.append("x-charge", HeaderValue::from_static("a"));
        headers.append("x-charge", HeaderValue::from_static("b"));
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        let record = encode(&headers, b"\0\0\0\0\x02hi", Some(&trailers));
        let Some(Stored::Response(read)) = decode(record, &Label::route("/s/M")) else {
            panic!("not read back");
        };
        assert_eq!(read.body, Bytes::from_static(b"\0\0\0\0\x02hi"));
        assert_eq!(read.trailers, Some(trailers));
        assert_eq!(read.code(), Code::Ok);
        assert!(read.head.headers.get("date").is_none());
        let charges: Vec<_> = read.head.headers.get_all("x-charge").iter().collect();
        assert_eq!(charges, ["a", "b"]);
    }

    #[test]
    fn a_trailers_only_response_has_its_status_in_its_headers() {
        let mut headers = HeaderMap::new();
        headers.insert("grpc-status", HeaderValue::from_static("9"));
        let Some(Stored::Response(read)) = decode(encode(&headers, b"", None), &Label::route("r"))
        else {
            panic!("not read back");
        };
        assert_eq!(read.code(), Code::FailedPrecondition);
        assert!(read.trailers.is_none());
    }

    #[test]
    fn other_records_and_truncated_ones_are_not_read() {
        let route = Label::route("r");
        let whole = encode(&HeaderMap::new(), b"body", None);
        for cut in 0..whole.len() {
            assert!(
                !matches!(decode(whole.slice(..cut), &route), Some(Stored::Response(_))),
                "{cut}"
            );
        }
        let Some(Stored::NotReplayable(why)) = decode(not_replayable("too big"), &route) else {
            panic!("not read back");
        };
        assert_eq!(why, "too big");
    }
}
