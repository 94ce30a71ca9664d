//! What a unary call carries, read by gRPC's rules: its `idempotency-key` metadata entry, its
//! one message (unframed, and read uncompressed when gzip or deflate), and its deadline
//! (`grpc-timeout`).

use std::time::Duration;

use bytes::{Buf as _, Bytes};
use http::{HeaderMap, HeaderValue, request::Parts};
use http_body_util::BodyExt as _;
use tonic::{
    Code, Status,
    codec::{CompressionEncoding, DecodeBuf, Decoder, Streaming},
    metadata::MetadataValue,
};

use super::{KEY_METADATA, record::frame};
use crate::layer::MAX_KEY_LEN;

/// How long the call's own deadline (its `grpc-timeout`, as gRPC's HTTP/2 protocol writes it:
/// up to 8 digits and a unit) leaves: a retry waits for its original within it, and answers
/// `ABORTED` before the client gives up. `None` when there is none, or it is malformed.
pub(super) fn grpc_timeout(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = value.split_at_checked(value.len().checked_sub(1)?)?;
    let amount: u64 = digits.parse().ok().filter(|_| (1..=8).contains(&digits.len()))?;
    Some(match unit {
        "H" => Duration::from_secs(amount.checked_mul(3600)?),
        "M" => Duration::from_secs(amount.checked_mul(60)?),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    })
}

/// The call's one message, read by tonic (its frame, and its compression when gzip or
/// deflate), at most `limit` bytes (uncompressed, and compressed as it came): its payload, and
/// its frame, uncompressed, as the handler gets it.
pub(super) async fn read_message(
    parts: &mut Parts,
    body: tonic::body::Body,
    limit: usize,
) -> Result<(Bytes, Bytes), Status> {
    // Another encoding is refused before anything is read, as tonic's own server does.
    let encoding = match parts.headers.remove("grpc-encoding").as_ref().map(HeaderValue::as_bytes) {
        None | Some(b"identity") => None,
        Some(b"gzip") => Some(CompressionEncoding::Gzip),
        Some(b"deflate") => Some(CompressionEncoding::Deflate),
        Some(other) => {
            let other = String::from_utf8_lossy(other);
            let mut refused = Status::unimplemented(format!(
                "the request is compressed with {other}; the idempotency layer reads gzip, deflate or uncompressed messages"
            ));
            let accepted = MetadataValue::from_static("gzip, deflate, identity");
            refused.metadata_mut().insert("grpc-accept-encoding", accepted);
            return Err(refused);
        }
    };
    // A body that fails is no end of the call: tonic's decoder reads a client's reset
    // (`CANCELLED`) as one, and the message before it would run. Told to the decoder as
    // `UNKNOWN`, which it never answers itself, and answered `CANCELLED`, as tonic's server would.
    let body = body.map_err(|_| Status::unknown("the request's body failed"));
    let mut messages = Streaming::new_request(Payload, body, encoding, Some(limit));
    let one = match messages.message().await {
        Ok(Some(message)) => messages.message().await.map(|next| next.is_none().then_some(message)),
        read => read,
    };
    match one {
        Ok(Some(message)) => {
            let framed = frame(&message);
            Ok((framed.slice(5..), framed))
        }
        Ok(None) => Err(Status::invalid_argument(
            "a unary call carries exactly one message: this method's idempotency needs it",
        )),
        Err(failed) if failed.code() == Code::Unknown => Err(Status::cancelled(failed.message())),
        Err(over) if matches!(over.code(), Code::OutOfRange | Code::ResourceExhausted) => Err(
            Status::resource_exhausted("the request message is over the idempotency layer's limit"),
        ),
        // A frame cut short, an unknown flag, corrupt compression, a compressed message with no
        // encoding: `INTERNAL`, as tonic's server answers (gRPC's compression spec asks it for
        // the last).
        Err(unreadable) => Err(Status::new(
            unreadable.code(),
            format!("the request message cannot be read: {}", unreadable.message()),
        )),
    }
}

/// A message's bytes as they are.
struct Payload;

impl Decoder for Payload {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(buf.copy_to_bytes(buf.remaining())))
    }
}

/// The `idempotency-key` metadata entry, by gRPC's rules for an ASCII metadata value: 1 to 255
/// printable ASCII characters (spaces included, not first or last), taken as they are (a key is
/// opaque: no quoting, no list). `None` when there is none; `INVALID_ARGUMENT` when it is empty,
/// too long, not printable ASCII, begins or ends with a space, given twice, or given in binary
/// (`idempotency-key-bin`), alone or beside it.
pub(super) fn metadata_key(headers: &HeaderMap) -> Result<Option<Vec<u8>>, Status> {
    // A binary entry is refused, beside an ASCII one too: the two could name two keys.
    if headers.contains_key("idempotency-key-bin") {
        return Err(Status::invalid_argument(
            "send the idempotency key as the ASCII `idempotency-key` metadata entry, not in binary",
        ));
    }
    let mut values = headers.get_all(KEY_METADATA).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(Status::invalid_argument("the idempotency-key metadata entry is given twice"));
    }
    let key = value.as_bytes();
    // No space first or last: HTTP/2 forbids it (RFC 9113 8.2.1), and a proxy may strip it,
    // which would make one key two.
    let printable = key.iter().all(|b| (b' '..=b'~').contains(b));
    let padded = key.first() == Some(&b' ') || key.last() == Some(&b' ');
    if key.is_empty() || key.len() > MAX_KEY_LEN || !printable || padded {
        return Err(Status::invalid_argument(
            "the idempotency-key metadata entry must be 1 to 255 printable ASCII characters, no space first or last",
        ));
    }
    Ok(Some(key.to_vec()))
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use http_body_util::Full;

    use super::*;
    use crate::grpc::status::answer;

    /// The message of a call with `encoding` and this body; checks that the handler's frame is
    /// it, uncompressed.
    async fn read(
        encoding: Option<&'static str>,
        body: &[u8],
        limit: usize,
    ) -> Result<Bytes, Status> {
        let mut request = http::Request::new(());
        if let Some(encoding) = encoding {
            request.headers_mut().insert("grpc-encoding", HeaderValue::from_static(encoding));
        }
        let (mut parts, ()) = request.into_parts();
        let body = tonic::body::Body::new(Full::new(Bytes::copy_from_slice(body)));
        let (message, handed) = read_message(&mut parts, body, limit).await?;
        assert_eq!(handed, frame(&message), "the handler gets the message uncompressed");
        assert!(parts.headers.get("grpc-encoding").is_none(), "nor told it is compressed");
        Ok(message)
    }

    fn gzip(payload: &[u8]) -> Vec<u8> {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        encoder.write_all(payload).unwrap();
        let body = encoder.finish().unwrap();
        let mut frame = vec![1];
        frame.extend_from_slice(&u32::try_from(body.len()).unwrap().to_be_bytes());
        frame.extend_from_slice(&body);
        frame
    }

    #[test]
    fn a_grpc_timeout_is_read_as_the_protocol_writes_it() {
        let timeout = |value: &'static str| {
            let mut headers = HeaderMap::new();
            headers.insert("grpc-timeout", HeaderValue::from_static(value));
            grpc_timeout(&headers)
        };
        assert_eq!(timeout("600m"), Some(Duration::from_millis(600)));
        assert_eq!(timeout("2S"), Some(Duration::from_secs(2)));
        assert_eq!(timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(timeout("3M"), Some(Duration::from_secs(180)));
        assert_eq!(timeout("250u"), Some(Duration::from_micros(250)));
        assert_eq!(timeout("70n"), Some(Duration::from_nanos(70)));
        assert_eq!(timeout("99999999H"), Some(Duration::from_secs(99_999_999 * 3600)));
        for bad in ["", "1", "abc", "5s", "-5S", "1.5S", "123456789S", " 5S"] {
            assert_eq!(timeout(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_metadata_key_is_one_to_255_printable_characters() {
        let key = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(KEY_METADATA, HeaderValue::from_str(value).unwrap());
            metadata_key(&headers)
        };
        for good in ["k", "a b,c", &"k".repeat(255)] {
            assert_eq!(key(good).unwrap(), Some(good.as_bytes().to_vec()), "{good}");
        }
        for bad in ["", " k", "k ", "k\t", &"k".repeat(256)] {
            assert_eq!(key(bad).unwrap_err().code(), Code::InvalidArgument, "{bad:?}");
        }
        assert_eq!(metadata_key(&HeaderMap::new()).unwrap(), None);
    }

    #[tokio::test]
    async fn one_message_is_read_and_anything_else_refused() {
        assert_eq!(read(None, b"\0\0\0\0\x03abc", 16).await.unwrap(), Bytes::from_static(b"abc"));
        assert_eq!(read(None, b"\0\0\0\0\0", 16).await.unwrap(), Bytes::new());
        assert_eq!(read(Some("identity"), b"\0\0\0\0\x01a", 16).await.unwrap(), "a");
        // None, or two: not a unary call.
        for bad in [&b""[..], b"\0\0\0\0\x01a\0\0\0\0\x01b"] {
            let refused = read(None, bad, 16).await.expect_err("not one message");
            assert_eq!(refused.code(), Code::InvalidArgument, "{bad:?}");
        }
        // Cut short, an unknown flag, compressed without saying how: `INTERNAL`, as tonic says.
        for bad in [&b"\0\0\0"[..], b"\0\0\0\0\x03ab", b"\x07\0\0\0\0", b"\x01\0\0\0\x01a"] {
            let refused = read(None, bad, 16).await.expect_err("not one message");
            assert_eq!(refused.code(), Code::Internal, "{bad:?}");
        }
        let over = read(None, b"\0\0\0\0\x03abc", 2).await.expect_err("over the limit");
        assert_eq!(over.code(), Code::ResourceExhausted);
        let refused = answer(read(Some("zstd"), b"\0\0\0\0\x01a", 16).await.expect_err("zstd"));
        assert_eq!(refused.headers()["grpc-status"], "12", "UNIMPLEMENTED");
        assert_eq!(refused.headers()["grpc-accept-encoding"], "gzip, deflate, identity");
    }

    #[tokio::test]
    async fn a_gzip_message_is_read_uncompressed_within_the_limit() {
        // The limit counts the message and, as tonic counts, its compressed form.
        assert_eq!(read(Some("gzip"), &gzip(b"hello"), 64).await.unwrap(), "hello");
        let bomb = read(Some("gzip"), &gzip(&[0; 1 << 20]), 1024).await.expect_err("a bomb");
        assert_eq!(bomb.code(), Code::ResourceExhausted);
        let mut corrupt = gzip(b"hello");
        let crc = corrupt.len() - 8;
        corrupt[crc] ^= 0xff;
        let refused = read(Some("gzip"), &corrupt, 64).await.expect_err("corrupt");
        assert_eq!(refused.code(), Code::Internal);
    }

    /// A client that sends its message and then resets the stream cancelled its call: the
    /// message is not read as a whole call (tonic's decoder would end the stream there).
    #[tokio::test]
    async fn a_body_that_fails_after_its_message_is_cancelled_not_read() {
        let frames: [Result<http_body::Frame<Bytes>, Status>; 2] = [
            Ok(http_body::Frame::data(frame(b"charge"))),
            Err(Status::cancelled("the client reset its stream")),
        ];
        let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
        let (mut parts, ()) = http::Request::new(()).into_parts();
        let read = read_message(&mut parts, tonic::body::Body::new(body), 64).await;
        assert_eq!(read.expect_err("cancelled").code(), Code::Cancelled);
    }
}
