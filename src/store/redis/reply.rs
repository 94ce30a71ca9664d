//! Replies read off a [`Direct`](super::direct::Direct) connection: RESP2, as redis-rs reads
//! it, into its [`Value`].
//!
//! The replies the scripts send on every request (integers, bulk strings, arrays of them, nil)
//! are read here in one pass over the buffer. Every other line (`+` status, `-` error) is rare
//! and goes to redis-rs's own parser, so that a status or an error (`NOSCRIPT`, `READONLY`)
//! reaches the store exactly as it would through a redis-rs connection.

use deadpool_redis::redis::{ErrorKind, RedisError, Value, parse_redis_value};

/// How deep arrays may nest: no command the store sends is answered deeper than 2.
const MAX_DEPTH: usize = 16;

/// Reads the first whole reply in `buffer`: the reply and how many bytes it took, or `None`
/// while it is incomplete. An error means the bytes are not RESP2: the connection is lost.
pub(super) fn read(buffer: &[u8]) -> Result<Option<(Value, usize)>, RedisError> {
    read_at(buffer, 0, 0)
}

fn read_at(buffer: &[u8], at: usize, depth: usize) -> Result<Option<(Value, usize)>, RedisError> {
    let Some((line, next)) = line(buffer, at)? else { return Ok(None) };
    let Some((&kind, body)) = line.split_first() else { return Err(malformed("an empty line")) };
    match kind {
        b':' => Ok(Some((Value::Int(number(body)?), next))),
        b'$' => match number(body)? {
            -1 => Ok(Some((Value::Nil, next))),
            length => {
                let length = usize::try_from(length).map_err(|_| malformed("a bulk length"))?;
                let end = next.checked_add(length).ok_or_else(|| malformed("a bulk length"))?;
                match buffer.get(end..end + 2) {
                    None => Ok(None),
                    Some(b"\r\n") => {
                        Ok(Some((Value::BulkString(buffer[next..end].to_vec()), end + 2)))
                    }
                    Some(_) => Err(malformed("a bulk string's end")),
                }
            }
        },
        b'*' => match number(body)? {
            -1 => Ok(Some((Value::Nil, next))),
            _ if depth == MAX_DEPTH => Err(malformed("arrays nested too deep")),
            count => {
                let count = usize::try_from(count).map_err(|_| malformed("an array length"))?;
                // Each element takes at least 3 bytes: no allocation beyond what arrived.
                let mut items = Vec::with_capacity(count.min((buffer.len() - next) / 3));
                let mut at = next;
                for _ in 0..count {
                    let Some((item, after)) = read_at(buffer, at, depth + 1)? else {
                        return Ok(None);
                    };
                    items.push(item);
                    at = after;
                }
                Ok(Some((Value::Array(items), at)))
            }
        },
        b'+' | b'-' => Ok(Some((parse_redis_value(&buffer[at..next])?, next))),
        _ => Err(malformed("a reply type")),
    }
}

/// The line starting at `at` (without its `\r\n`) and where the next one starts; `None`
/// while it is incomplete.
fn line(buffer: &[u8], at: usize) -> Result<Option<(&[u8], usize)>, RedisError> {
    let rest = buffer.get(at..).unwrap_or_default();
    let Some(end) = rest.iter().position(|&byte| byte == b'\n') else { return Ok(None) };
    match rest[..end].strip_suffix(b"\r") {
        Some(line) => Ok(Some((line, at + end + 1))),
        None => Err(malformed("a line ending without \\r")),
    }
}

/// A decimal integer, as Redis writes lengths and integer replies. By hand: `str::parse`
/// after a UTF-8 check cost a replay about 400 instructions for its three numbers.
fn number(text: &[u8]) -> Result<i64, RedisError> {
    let (negative, digits) = match text.split_first() {
        Some((b'-', digits)) => (true, digits),
        _ => (false, text),
    };
    if digits.is_empty() {
        return Err(malformed("a number"));
    }
    let mut value: i64 = 0;
    for &digit in digits {
        if !digit.is_ascii_digit() {
            return Err(malformed("a number"));
        }
        // Accumulated negative, so that i64::MIN fits.
        value = value
            .checked_mul(10)
            .and_then(|value| value.checked_sub(i64::from(digit - b'0')))
            .ok_or_else(|| malformed("a number"))?;
    }
    if negative { Ok(value) } else { value.checked_neg().ok_or_else(|| malformed("a number")) }
}

fn malformed(what: &'static str) -> RedisError {
    RedisError::from((ErrorKind::Parse, "malformed reply from Redis", what.to_owned()))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// A reply as Redis writes it.
    fn encoded(value: &Value, out: &mut Vec<u8>) {
        match value {
            Value::Nil => out.extend_from_slice(b"$-1\r\n"),
            Value::Int(n) => out.extend_from_slice(format!(":{n}\r\n").as_bytes()),
            Value::BulkString(bytes) => {
                out.extend_from_slice(format!("${}\r\n", bytes.len()).as_bytes());
                out.extend_from_slice(bytes);
                out.extend_from_slice(b"\r\n");
            }
            Value::Array(items) => {
                out.extend_from_slice(format!("*{}\r\n", items.len()).as_bytes());
                items.iter().for_each(|item| encoded(item, out));
            }
            Value::Okay => out.extend_from_slice(b"+OK\r\n"),
            Value::SimpleString(text) => out.extend_from_slice(format!("+{text}\r\n").as_bytes()),
            other => unreachable!("not generated: {other:?}"),
        }
    }

    fn value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Nil),
            any::<i64>().prop_map(Value::Int),
            proptest::collection::vec(any::<u8>(), 0..40).prop_map(Value::BulkString),
            Just(Value::Okay),
            "[a-zA-Z0-9 ]{1,12}".prop_map(Value::SimpleString),
        ];
        leaf.prop_recursive(3, 24, 5, |inner| {
            proptest::collection::vec(inner, 0..5).prop_map(Value::Array)
        })
    }

    proptest! {
        /// Whatever the reply, it reads as redis-rs reads it, and not before its last byte.
        #[test]
        fn a_reply_reads_as_redis_rs_reads_it(value in value(), tail in proptest::collection::vec(any::<u8>(), 0..8)) {
            let mut bytes = Vec::new();
            encoded(&value, &mut bytes);
            let whole = bytes.len();
            prop_assert_eq!(&read(&bytes).unwrap(), &Some((parse_redis_value(&bytes).unwrap(), whole)));
            for cut in 0..whole {
                prop_assert_eq!(read(&bytes[..cut]).unwrap(), None, "cut at {}", cut);
            }
            bytes.extend_from_slice(&tail);
            prop_assert_eq!(read(&bytes).unwrap().map(|(_, used)| used), Some(whole));
        }
    }

    #[test]
    fn an_error_reads_as_redis_rs_reads_it() {
        let bytes = b"-NOSCRIPT No matching script. Please use EVAL.\r\n:1\r\n";
        let (value, used) = read(bytes).unwrap().unwrap();
        assert_eq!(used, bytes.len() - 4);
        let error = value.extract_error().unwrap_err();
        assert_eq!(
            error.kind(),
            ErrorKind::Server(deadpool_redis::redis::ServerErrorKind::NoScript)
        );
        let nested = read(b"*2\r\n:1\r\n-ERR inner\r\n").unwrap().unwrap().0;
        assert!(nested.extract_error().is_err());
    }

    #[test]
    fn bytes_that_are_not_resp2_are_refused() {
        let refused =
            [&b"?\r\n"[..], b"\r\n", b":x\r\n", b"$3\r\nabcd\r\n", b"$-2\r\n", b"*-5\r\n", b":1\n"];
        for bytes in refused {
            assert!(read(bytes).is_err(), "{:?}", String::from_utf8_lossy(bytes));
        }
        let deep = "*1\r\n".repeat(MAX_DEPTH + 1) + ":1\r\n";
        assert!(read(deep.as_bytes()).is_err());
        let deep_enough = "*1\r\n".repeat(MAX_DEPTH) + ":1\r\n";
        assert!(read(deep_enough.as_bytes()).unwrap().is_some());
    }

    #[test]
    fn a_nil_array_reads_as_redis_rs_reads_it() {
        let nil = b"*-1\r\n";
        assert_eq!(read(nil).unwrap(), Some((parse_redis_value(nil).unwrap(), nil.len())));
        assert_eq!(read(nil).unwrap(), Some((Value::Nil, nil.len())));
    }

    #[test]
    fn numbers_read_as_rust_reads_them() {
        for text in ["0", "7", "-1", "1234567890", "9223372036854775807", "-9223372036854775808"] {
            assert_eq!(number(text.as_bytes()).unwrap(), text.parse::<i64>().unwrap(), "{text}");
        }
        for text in
            ["", "-", "+1", "1a", " 1", "9223372036854775808", "-9223372036854775809", "--1"]
        {
            assert!(number(text.as_bytes()).is_err(), "{text:?}");
        }
    }

    #[test]
    fn a_huge_announced_array_allocates_no_more_than_arrived() {
        assert_eq!(read(b"*4000000000\r\n:1\r\n").unwrap(), None);
        assert!(read(b"$9223372036854775807\r\nab").unwrap().is_none());
    }
}
