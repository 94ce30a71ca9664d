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
        encode(StatusCode::NO_CONTENT, &HeaderMap::new(), &HeaderFilter::default(), b"").to_vec();
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
    let blob = encode_with_trailers(StatusCode::OK, &sample_headers(), &trailers, &filter, b"m");
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
    assert!(decode(Bytes::from_static(&[1, 0, 200, 0xff, 0xff, 0, 0, 0, 0, 0, 0]), &r()).is_err());
}
