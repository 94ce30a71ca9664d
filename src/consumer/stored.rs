//! How the consumer door stores a result: a format byte, the completion time, then JSON.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{BufMut, Bytes, BytesMut};
use serde::{Serialize, de::DeserializeOwned};

use super::{Error, finite};
use crate::engine::observe;

/// The first byte of a stored result: `J`, then when it was stored (u64 ms since the Unix
/// epoch), then JSON. `j`, written before, is JSON alone and is still read. `U`, then the
/// time, then a reason: a result that ran but has no faithful stored form. An HTTP record
/// starts with 1 or 2, so neither door can mistake the other's record for its own.
const RESULT_FORMAT: u8 = b'J';
const RESULT_FORMAT_UNTIMED: u8 = b'j';
const RESULT_NOT_STORED: u8 = b'U';

/// Why a result has no stored form.
pub(super) enum Unstorable {
    /// Larger than the stored limit: its key is released (documented on `stored_limit`).
    OverLimit,
    /// serde could not encode it, or it holds a float JSON cannot (NaN, ±inf): the operation
    /// ran, so its key is completed with [`not_stored`], never released.
    Unencodable(String),
}

/// The stored form of a result: [`RESULT_FORMAT`], then JSON. JSON rather than a denser binary
/// form because it describes itself: a result type that changed between deploys is an
/// [`Error::Corrupt`], never another value read from the same bytes.
pub(super) fn encode<T: Serialize>(value: &T, limit: usize) -> Result<Bytes, Unstorable> {
    finite::check(value).map_err(|error| Unstorable::Unencodable(error.to_string()))?;
    let mut out = timed(RESULT_FORMAT).writer();
    serde_json::to_writer(&mut out, value)
        .map_err(|error| Unstorable::Unencodable(error.to_string()))?;
    let out = out.into_inner();
    if out.len() - 9 > limit {
        return Err(Unstorable::OverLimit);
    }
    Ok(out.freeze())
}

/// The record of a result that ran but could not be encoded: every redelivery is answered
/// [`Error::ResultNotStored`] with `reason`, and the operation does not run again.
pub(super) fn not_stored(reason: &str) -> Bytes {
    let mut out = timed(RESULT_NOT_STORED);
    out.put_slice(reason.as_bytes());
    out.freeze()
}

/// A format byte and the time now (u64 ms since the Unix epoch).
fn timed(format: u8) -> BytesMut {
    let mut out = BytesMut::with_capacity(64);
    out.put_u8(format);
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    out.put_u64(u64::try_from(now.as_millis()).unwrap_or(u64::MAX));
    out
}

pub(super) fn decode<T: DeserializeOwned, E>(
    stored: &[u8],
    hash: &str,
    scope: &str,
) -> Result<T, Error<E>> {
    let corrupt = |reason: String| {
        tracing::error!(key_hash = hash, reason, "idempotency: stored result is unreadable");
        Error::Corrupt { key_hash: hash.to_owned(), reason }
    };
    let json = match stored.split_first() {
        Some((&RESULT_FORMAT, timed)) if timed.len() >= 8 => {
            let (at, json) = timed.split_at(8);
            let at = UNIX_EPOCH
                + Duration::from_millis(u64::from_be_bytes(at.try_into().unwrap_or_default()));
            observe::replayed_age(scope, SystemTime::now().duration_since(at).unwrap_or_default());
            json
        }
        Some((&RESULT_FORMAT_UNTIMED, json)) => json,
        Some((&RESULT_NOT_STORED, timed)) if timed.len() >= 8 => {
            let reason = String::from_utf8_lossy(&timed[8..]).into_owned();
            tracing::warn!(
                key_hash = hash,
                reason,
                "idempotency: the operation ran before, but its result could not be stored"
            );
            return Err(Error::ResultNotStored { key_hash: hash.to_owned(), reason });
        }
        _ => return Err(corrupt("not a result stored by the consumer door".to_owned())),
    };
    serde_json::from_slice(json).map_err(|error| corrupt(error.to_string()))
}
