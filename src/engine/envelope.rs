//! The stored-outcome envelope every door's record starts with: a format byte, then when the
//! outcome was stored. The doors' formats are one enum, so that two
//! doors can never write the same first byte: a clash is a duplicate discriminant, a compile
//! error.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::observe::{self, Label};

/// What a stored outcome is, by its first byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Format {
    /// An HTTP response (`crate::layer::record`).
    Http = 2,
    /// An HTTP response stored minimally: its status, its headers and the handler's small
    /// value in place of its body (`crate::layer::Minimal`); a hook rebuilds the replay.
    HttpMinimal = 3,
    /// A consumer result: JSON (`crate::consumer::stored`).
    Json = b'J',
    /// A consumer result that ran but has no faithful stored form: the reason, as text.
    NotStored = b'U',
    /// An HTTP response with trailers: the HTTP record, and its trailers after its headers
    /// (`crate::layer::record`; the gRPC door's responses).
    HttpWithTrailers = 4,
    /// Any door's record, encrypted at rest (`crate::at_rest`): never parsed as a door's own.
    /// Never constructed: the variant reserves the byte, so that no door's format takes it.
    #[allow(dead_code)]
    Encrypted = crate::at_rest::ENCRYPTED,
}

impl Format {
    /// The formats a door parses: every one but [`Encrypted`](Self::Encrypted).
    const ALL: [Self; 5] =
        [Self::Http, Self::HttpMinimal, Self::HttpWithTrailers, Self::Json, Self::NotStored];
}

/// A stored outcome, its envelope read.
#[derive(Debug)]
pub(crate) struct Parsed {
    pub(crate) format: Format,
    /// When it was stored, by the clock of the instance that stored it.
    pub(crate) completed_at: SystemTime,
    /// What the door wrote after the envelope; shares the record's memory.
    pub(crate) payload: Bytes,
}

/// A new record of `format`, stamped with the time now, with room for `capacity` bytes of
/// payload.
pub(crate) fn begin(format: Format, capacity: usize) -> BytesMut {
    let mut out = BytesMut::with_capacity(9 + capacity);
    out.put_u8(format as u8);
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    out.put_u64(u64::try_from(now.as_millis()).unwrap_or(u64::MAX));
    out
}

/// The record of an outcome that happened but is not kept (`reason`, as text): every door
/// answers a retry that it happened, and does not run it again.
pub(crate) fn not_stored(reason: &str) -> Bytes {
    let mut out = begin(Format::NotStored, reason.len());
    out.put_slice(reason.as_bytes());
    out.freeze()
}

/// Reads the envelope of a stored record and observes its age for `route`'s replayed-age
/// histogram. `None` when the first byte is no door's format, or the record is too short to
/// hold its time. Never panics.
pub(crate) fn parse(record: Bytes, route: &Label) -> Option<Parsed> {
    let opened = read(record)?;
    let age = SystemTime::now().duration_since(opened.completed_at).unwrap_or_default();
    observe::replayed_age(route, age);
    Some(opened)
}

/// Reads the envelope of a stored record, as [`parse`] does, without observing its age: for
/// an operator's look at it.
pub(crate) fn read(mut record: Bytes) -> Option<Parsed> {
    let first = *record.first()?;
    let format = Format::ALL.into_iter().find(|format| *format as u8 == first)?;
    record.advance(1);
    if record.remaining() < 8 {
        return None;
    }
    let completed_at = UNIX_EPOCH + Duration::from_millis(record.get_u64());
    Some(Parsed { format, completed_at, payload: record })
}

/// Whether two stored records carry the same payload after their envelopes (whenever each
/// was stamped), without observing an age: for a door that compares what it would store with
/// what was committed.
pub(crate) fn same_payload(a: &[u8], b: &[u8]) -> bool {
    fn payload(record: &[u8]) -> Option<(Format, &[u8])> {
        let first = *record.first()?;
        let format = Format::ALL.into_iter().find(|format| *format as u8 == first)?;
        record.get(9..).map(|payload| (format, payload))
    }
    matches!((payload(a), payload(b)), (Some(a), Some(b)) if a == b)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The metrics label the tests open records under.
    fn r() -> Label {
        Label::route("r")
    }

    #[test]
    fn a_timed_record_carries_when_it_was_stored() {
        let before = SystemTime::now() - Duration::from_millis(1);
        let mut record = begin(Format::Json, 4);
        record.put_slice(b"{}");
        let opened = parse(record.freeze(), &r()).unwrap();
        assert_eq!(opened.format, Format::Json);
        let at = opened.completed_at;
        assert!(at >= before && at <= SystemTime::now() + Duration::from_millis(1), "{at:?}");
        assert_eq!(&opened.payload[..], b"{}");
    }

    #[test]
    fn payloads_compare_whatever_the_time_and_never_across_formats() {
        let record = |format, payload: &[u8]| {
            let mut record = begin(format, payload.len());
            record.put_slice(payload);
            record.freeze()
        };
        let a = record(Format::Json, b"{}");
        std::thread::sleep(Duration::from_millis(2));
        assert!(same_payload(&a, &record(Format::Json, b"{}")));
        assert!(!same_payload(&a, &record(Format::Json, b"[]")));
        assert!(!same_payload(&a, &record(Format::Http, b"{}")));
        assert!(!same_payload(&a, &[]) && !same_payload(&[], &[]));
        assert!(!same_payload(&[2, 0], &[2, 0]), "too short for its time");
    }

    #[test]
    fn every_format_byte_is_its_own_and_nothing_else_opens() {
        for format in Format::ALL {
            let record = begin(format, 0).freeze();
            assert_eq!(record[0], format as u8);
            assert_eq!(record.len(), 9);
            assert_eq!(parse(record, &r()).unwrap().format, format);
        }
        for byte in (0..=u8::MAX).filter(|b| !Format::ALL.iter().any(|f| *f as u8 == *b)) {
            assert!(parse(Bytes::from(vec![byte; 16]), &r()).is_none(), "{byte}");
        }
        // A record too short for its time, the formats earlier versions wrote (1, `j`: no
        // time), and an empty record.
        assert!(parse(Bytes::from_static(&[2, 0, 0]), &r()).is_none());
        assert!(parse(Bytes::from_static(&[1, 0, 201, 0, 0, b'o', b'k']), &r()).is_none());
        assert!(parse(Bytes::from_static(b"j{\"a\":1}"), &r()).is_none());
        assert!(parse(Bytes::new(), &r()).is_none());
    }
}
