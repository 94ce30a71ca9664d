//! A gRPC response read whole (its head, its body: the framed message, and its trailers),
//! stored as the HTTP layer stores a response, with its trailers
//! (`crate::layer::record::encode_with_trailers`); and the response rebuilt from its record.

use std::convert::Infallible;

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Response};
use http_body::Frame;
use http_body_util::{BodyExt as _, StreamBody};
use tonic::{Code, Status};

use super::{REPLAYED_METADATA, status::answer};
use crate::{
    engine::{
        Label,
        envelope::{self, Format},
    },
    layer::record::{self, HeaderFilter, StoredResponse},
    recovery::BoxError,
};

/// Why a response was not kept for replay: its record would be over the stored limit.
pub(super) const OVER_STORED_LIMIT: &str = "the response is over the stored limit";

/// A whole gRPC response: its head, the bytes of its body, its trailers.
#[derive(Debug)]
pub(super) struct Collected {
    pub(super) head: http::response::Parts,
    pub(super) body: Bytes,
    pub(super) trailers: HeaderMap,
}

impl Collected {
    /// An `OK` response with `metadata` and the `framed` message, as tonic sends it.
    pub(super) fn ok(mut metadata: HeaderMap, framed: Bytes) -> Self {
        metadata.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        let (mut head, ()) = Response::new(()).into_parts();
        head.headers = metadata;
        Self { head, body: framed, trailers }
    }

    /// The call's status: the trailers' `grpc-status`, or the headers' in a trailers-only
    /// response; `UNKNOWN` when neither has one.
    pub(super) fn code(&self) -> Code {
        let code = |headers: &HeaderMap| {
            let value = headers.get("grpc-status")?.to_str().ok()?;
            value.parse::<i32>().ok().map(Code::from_i32)
        };
        code(&self.trailers).or_else(|| code(&self.head.headers)).unwrap_or(Code::Unknown)
    }

    /// The bytes its message (without its frame's five-byte prefix, as the request's limit
    /// counts), and its headers and trailers, take in its record: what the stored limits count.
    pub(super) fn stored_sizes(&self, filter: &HeaderFilter) -> (usize, usize) {
        let metadata = record::stored_headers_len(&self.head.headers, filter)
            + record::stored_headers_len(&self.trailers, filter);
        (self.body.len().saturating_sub(5), metadata)
    }

    /// Whether it is a unary reply: one framed message, or none with an error.
    pub(super) fn is_unary(&self) -> bool {
        let empty_error = self.body.is_empty() && self.code() != Code::Ok;
        empty_error || framed_len(&self.body) == Some(self.body.len())
    }

    /// Its record.
    pub(super) fn encode(&self, filter: &HeaderFilter) -> Bytes {
        let (head, trailers) = (&self.head, &self.trailers);
        record::encode_with_trailers(head.status, &head.headers, trailers, filter, &self.body)
    }

    /// The response again, its body and trailers sent as they came.
    pub(super) fn into_response(self) -> Response<Body> {
        let mut frames = Vec::with_capacity(2);
        if !self.body.is_empty() {
            frames.push(Ok::<_, Infallible>(Frame::data(self.body)));
        }
        if !self.trailers.is_empty() {
            frames.push(Ok(Frame::trailers(self.trailers)));
        }
        // A trailers-only response (a status without a message) ends with its head: a body
        // that says it is empty, so that HTTP/2 sends one HEADERS frame with END_STREAM. A
        // stream of no frames would not say so, and its status would go in HEADERS followed by
        // an empty DATA frame, which gRPC's C core, Go and Java clients read as `UNKNOWN`.
        let body = if frames.is_empty() {
            Body::empty()
        } else {
            Body::new(StreamBody::new(futures_util::stream::iter(frames)))
        };
        Response::from_parts(self.head, body)
    }
}

/// `message`, framed as a gRPC body carries it: uncompressed, after its five-byte prefix.
pub(super) fn frame(message: &[u8]) -> Bytes {
    let mut framed = Vec::with_capacity(5 + message.len());
    framed.push(0);
    framed.extend_from_slice(&u32::try_from(message.len()).unwrap_or(u32::MAX).to_be_bytes());
    framed.extend_from_slice(message);
    Bytes::from(framed)
}

/// The length a frame's five-byte prefix gives it, prefix included.
pub(super) fn framed_len(framed: &[u8]) -> Option<usize> {
    let (&[_, a, b, c, d], _) = framed.split_first_chunk::<5>()?;
    usize::try_from(u32::from_be_bytes([a, b, c, d])).ok()?.checked_add(5)
}

/// Reads a response whole, trailers included.
pub(super) async fn collect<B>(response: Response<B>) -> Result<Collected, BoxError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let (head, body) = response.into_parts();
    let collected = body.collect().await.map_err(Into::into)?;
    let trailers = collected.trailers().cloned().unwrap_or_default();
    Ok(Collected { head, body: collected.to_bytes(), trailers })
}

/// What a record holds: a response to replay, or why the call's response was not kept.
pub(super) fn decode(stored: Bytes, route: &Label) -> Result<Collected, Status> {
    let opened = envelope::parse(stored, route);
    if let Some(opened) = opened.as_ref().filter(|opened| opened.format == Format::NotStored) {
        let why = String::from_utf8_lossy(&opened.payload);
        return Err(Status::internal(format!("the call completed; {why}")));
    }
    let unreadable = || Status::internal("the idempotency record cannot be read");
    let opened = opened.ok_or_else(unreadable)?;
    let stored = record::decode_with_trailers(opened).map_err(|_| unreadable())?;
    let StoredResponse { status, headers, body, trailers, .. } = stored;
    let (mut head, ()) = Response::new(()).into_parts();
    (head.status, head.headers) = (status, headers);
    let reply = Collected { head, body, trailers: trailers.unwrap_or_default() };
    // A record cut short inside its message, or before it, is refused, not replayed as a
    // shorter message.
    reply.is_unary().then_some(reply).ok_or_else(unreadable)
}

/// The record of a call whose response is not kept, because `why`: a retry is told so, and
/// the call does not run again.
pub(super) fn not_replayable(why: &str) -> Bytes {
    envelope::not_stored(&format!("its response cannot be replayed: {why}"))
}

/// The answer to a retry of a completed call: its stored response, marked as replayed.
pub(super) fn replay(stored: Bytes, route: &Label, hash: &str) -> Response<Body> {
    match decode(stored, route) {
        Ok(mut stored) => {
            let marker = HeaderValue::from_static("true");
            stored.head.headers.insert(REPLAYED_METADATA, marker);
            stored.into_response()
        }
        Err(status) => {
            tracing::error!(key_hash = hash, %status, "idempotency: no replayable response");
            answer(status)
        }
    }
}

#[cfg(test)]
mod tests {
    use http::StatusCode;

    use super::*;

    fn route() -> Label {
        Label::route("/s/M")
    }

    #[test]
    fn a_response_reads_back_as_it_was_stored_without_the_connection_headers() {
        let mut reply = Collected::ok(HeaderMap::new(), Bytes::from_static(b"\0\0\0\0\x02hi"));
        let headers = &mut reply.head.headers;
        headers.insert("date", HeaderValue::from_static("Thu, 01 Jan 1970 00:00:00 GMT"));
        headers.append("x-charge", HeaderValue::from_static("a"));
        headers.append("x-charge", HeaderValue::from_static("b"));
        let read = decode(reply.encode(&HeaderFilter::default()), &route()).expect("read back");
        assert_eq!(read.body, reply.body);
        assert_eq!(read.trailers, reply.trailers);
        assert_eq!(read.code(), Code::Ok);
        assert!(read.head.headers.get("date").is_none());
        let charges: Vec<_> = read.head.headers.get_all("x-charge").iter().collect();
        assert_eq!(charges, ["a", "b"]);
    }

    #[test]
    fn a_trailers_only_response_has_its_status_in_its_headers() {
        let mut reply = Collected::ok(HeaderMap::new(), Bytes::new());
        reply.trailers.clear();
        reply.head.headers.insert("grpc-status", HeaderValue::from_static("9"));
        let read = decode(reply.encode(&HeaderFilter::default()), &route()).expect("read back");
        assert_eq!(read.code(), Code::FailedPrecondition);
        assert!(read.trailers.is_empty());
    }

    /// A status without a message goes out as HTTP/2's trailers-only response: its head, and
    /// a body that says at once that it is empty (END_STREAM on the HEADERS frame).
    #[test]
    fn a_trailers_only_reply_ends_with_its_head() {
        use http_body::Body as _;
        let mut status = Collected::ok(HeaderMap::new(), Bytes::new());
        status.trailers.clear();
        status.head.headers.insert("grpc-status", HeaderValue::from_static("9"));
        let response = status.into_response();
        assert!(response.body().is_end_stream(), "HEADERS with END_STREAM");
        assert_eq!(response.body().size_hint().exact(), Some(0));
        let reply = Collected::ok(HeaderMap::new(), frame(b"m")).into_response();
        assert!(!reply.body().is_end_stream(), "a message and its trailers follow");
    }

    #[test]
    fn the_stored_limits_count_the_message_without_its_prefix_and_the_metadata() {
        let reply = Collected::ok(HeaderMap::new(), frame(b"12345"));
        let filter = HeaderFilter::default();
        let metadata = record::stored_headers_len(&reply.head.headers, &filter)
            + record::stored_headers_len(&reply.trailers, &filter);
        assert_eq!(reply.stored_sizes(&filter), (5, metadata));
    }

    #[test]
    fn other_records_and_truncated_ones_are_not_read() {
        let whole =
            Collected::ok(HeaderMap::new(), frame(b"body")).encode(&HeaderFilter::default());
        for cut in 0..whole.len() {
            assert!(decode(whole.slice(..cut), &route()).is_err(), "{cut}");
        }
        let http = record::encode(StatusCode::OK, &HeaderMap::new(), &HeaderFilter::default(), b"");
        assert!(decode(http, &route()).is_err(), "an HTTP record is not a gRPC response");
        let not_kept = decode(not_replayable("too big"), &route()).expect_err("not a response");
        assert_eq!(not_kept.code(), Code::Internal);
        assert!(not_kept.message().ends_with("too big"), "{}", not_kept.message());
    }
}
