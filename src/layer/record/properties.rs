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
