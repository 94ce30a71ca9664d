//! What a unary call carries, read by gRPC's rules: its `idempotency-key` metadata entry, its
//! one message (unframed, and read uncompressed when gzip), and its deadline (`grpc-timeout`).

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, request::Parts};
use http_body_util::{BodyExt as _, LengthLimitError, Limited};
use tonic::{Status, metadata::MetadataValue};

use super::{
    KEY_METADATA,
    record::{frame, framed_len},
};
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

/// The call's one message, read whole (at most `limit` bytes, as tonic counts: its frame has
/// a five-byte prefix more): its payload, and its frame as the handler gets it.
pub(super) async fn read_message(
    parts: &mut Parts,
    body: tonic::body::Body,
    limit: usize,
) -> Result<(Bytes, Bytes), Status> {
    match Limited::new(body, limit.saturating_add(5)).collect().await {
        Ok(collected) => unary_message(&mut parts.headers, collected.to_bytes(), limit),
        Err(error) if error.is::<LengthLimitError>() => Err(Status::resource_exhausted(
            "the request message is over the idempotency layer's limit",
        )),
        Err(_) => Err(Status::cancelled("the request's body failed")),
    }
}

/// The `idempotency-key` metadata entry, by gRPC's rules for an ASCII metadata value: 1 to 255
/// printable ASCII characters (spaces included, not first or last), taken as they are (a key is
/// opaque: no quoting, no list). `None` when there is none; `INVALID_ARGUMENT` when it is empty,
/// too long, not printable ASCII, begins or ends with a space, given twice, or given in binary
/// (`idempotency-key-bin`) only.
pub(super) fn metadata_key(headers: &HeaderMap) -> Result<Option<Vec<u8>>, Status> {
    let mut values = headers.get_all(KEY_METADATA).iter();
    let Some(value) = values.next() else {
        if headers.contains_key("idempotency-key-bin") {
            return Err(Status::invalid_argument(
                "send the idempotency key as the ASCII `idempotency-key` metadata entry, not in binary",
            ));
        }
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

/// The one message of a unary call's body, and its frame as the handler gets it: its payload,
/// after its five-byte prefix; a gzip one decompressed (at most `limit` bytes, and its frame
/// and `grpc-encoding` with it), so that the fingerprint is the message's, not its
/// compression's, and the handler gets the same bytes. A call that is not one message is
/// `INVALID_ARGUMENT`; another encoding `UNIMPLEMENTED` with `grpc-accept-encoding: gzip,
/// identity`, as gRPC answers an encoding the server does not read.
fn unary_message(
    headers: &mut HeaderMap,
    framed: Bytes,
    limit: usize,
) -> Result<(Bytes, Bytes), Status> {
    let not_one = || {
        Status::invalid_argument(
            "a unary call carries exactly one message: this method's idempotency needs it",
        )
    };
    if framed_len(&framed) != Some(framed.len()) {
        return Err(not_one());
    }
    match (framed[0], headers.get("grpc-encoding").and_then(|v| v.to_str().ok())) {
        (0, _) => Ok((framed.slice(5..), framed)),
        (1, Some("gzip")) => {
            let message = gunzip(&framed[5..], limit)?;
            headers.remove("grpc-encoding");
            Ok((message.clone(), frame(&message)))
        }
        (1, encoding) => {
            let mut refused = Status::unimplemented(format!(
                "the request is compressed ({}); the idempotency layer reads gzip or uncompressed messages",
                encoding.unwrap_or("no grpc-encoding")
            ));
            let accepted = MetadataValue::from_static("gzip, identity");
            refused.metadata_mut().insert("grpc-accept-encoding", accepted);
            Err(refused)
        }
        _ => Err(not_one()),
    }
}

/// A gzip message decompressed, at most `limit` bytes of it (a small message may inflate to
/// any size).
fn gunzip(compressed: &[u8], limit: usize) -> Result<Bytes, Status> {
    use std::io::Read as _;
    let mut message = Vec::new();
    let read = flate2::read::GzDecoder::new(compressed)
        .take(u64::try_from(limit).unwrap_or(u64::MAX).saturating_add(1))
        .read_to_end(&mut message);
    match read {
        Err(_) => Err(Status::invalid_argument("the gzip request message is corrupt")),
        Ok(_) if message.len() > limit => Err(Status::resource_exhausted(
            "the request message is over the idempotency layer's limit",
        )),
        Ok(_) => Ok(Bytes::from(message)),
    }
}

#[cfg(test)]
mod tests {
    use tonic::Code;

    use super::*;
    use crate::grpc::status::answer;

    /// The message of a call with `headers` and this body, read uncompressed as it came.
    fn plain(headers: &HeaderMap, framed: &[u8], limit: usize) -> Result<Bytes, Status> {
        let mut headers = headers.clone();
        let framed = Bytes::copy_from_slice(framed);
        let (message, handed) = unary_message(&mut headers, framed.clone(), limit)?;
        assert_eq!(handed, framed, "the handler gets the frame as it came");
        Ok(message)
    }

    #[test]
    fn a_grpc_timeout_is_read_as_the_protocol_writes_it() {
        let timeout = |value: &'static str| {
            let mut headers = HeaderMap::new();
            headers.insert("grpc-timeout", http::HeaderValue::from_static(value));
            grpc_timeout(&headers)
        };
        assert_eq!(timeout("600m"), Some(Duration::from_millis(600)));
        assert_eq!(timeout("2S"), Some(Duration::from_secs(2)));
        assert_eq!(timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(timeout("99999999H"), Some(Duration::from_secs(99_999_999 * 3600)));
        for bad in ["", "1", "abc", "5s", "-5S", "1.5S", "123456789S", " 5S"] {
            assert_eq!(timeout(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn one_uncompressed_message_is_read_and_anything_else_refused() {
        let headers = HeaderMap::new();
        assert_eq!(plain(&headers, b"\0\0\0\0\x03abc", 16).unwrap(), Bytes::from_static(b"abc"));
        assert_eq!(plain(&headers, b"\0\0\0\0\0", 16).unwrap(), Bytes::new());
        for bad in
            [&b""[..], b"\0\0\0", b"\0\0\0\0\x03ab", b"\0\0\0\0\x01a\0\0\0\0\x01b", b"\x07\0\0\0\0"]
        {
            let refused = plain(&headers, bad, 16).expect_err("not one message");
            assert_eq!(refused.code(), Code::InvalidArgument, "{bad:?}");
        }
        let refused = answer(plain(&headers, b"\x01\0\0\0\x03abc", 16).expect_err("compressed"));
        assert_eq!(refused.headers()["grpc-status"], "12", "UNIMPLEMENTED");
        assert_eq!(refused.headers()["grpc-accept-encoding"], "gzip, identity");
    }

    #[test]
    fn a_gzip_message_is_read_uncompressed_within_the_limit() {
        use std::io::Write as _;
        let gzip = |payload: &[u8]| {
            let mut encoder =
                flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
            encoder.write_all(payload).unwrap();
            let body = encoder.finish().unwrap();
            let mut frame = vec![1];
            frame.extend_from_slice(&u32::try_from(body.len()).unwrap().to_be_bytes());
            frame.extend_from_slice(&body);
            Bytes::from(frame)
        };
        let mut headers = HeaderMap::new();
        headers.insert("grpc-encoding", http::HeaderValue::from_static("gzip"));
        let read = |headers: &mut HeaderMap, framed, limit| unary_message(headers, framed, limit);
        let (message, handed) = read(&mut headers.clone(), gzip(b"hello"), 16).unwrap();
        assert_eq!((message, handed), (Bytes::from_static(b"hello"), frame(b"hello")));
        let mut decoded = headers.clone();
        read(&mut decoded, gzip(b"hello"), 16).unwrap();
        assert!(decoded.get("grpc-encoding").is_none(), "the handler's message is not compressed");
        // A small frame that inflates past the limit: refused, never read whole.
        let bomb = read(&mut headers.clone(), gzip(&[0; 1 << 20]), 1024).expect_err("a bomb");
        assert_eq!(bomb.code(), Code::ResourceExhausted);
        // Its checksum (the trailer's first four bytes) changed: the message is not what was sent.
        let mut corrupt = gzip(b"hello").to_vec();
        let crc = corrupt.len() - 8;
        corrupt[crc] ^= 0xff;
        let refused = read(&mut headers, Bytes::from(corrupt), 16).expect_err("corrupt");
        assert_eq!(refused.code(), Code::InvalidArgument);
    }
}
