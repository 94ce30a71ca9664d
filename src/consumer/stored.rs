//! How the consumer door stores a result: a format byte, the completion time, then JSON.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{BufMut, Bytes, BytesMut};
use serde::{Serialize, de::DeserializeOwned};

use super::Error;
use crate::engine::observe;

/// The first byte of a stored result: `J`, then when it was stored (u64 ms since the Unix
/// epoch), then JSON. `j`, written before, is JSON alone and is still read. An HTTP record
/// starts with 1 or 2, so neither door can mistake the other's record for its own.
const RESULT_FORMAT: u8 = b'J';
const RESULT_FORMAT_UNTIMED: u8 = b'j';

/// The stored form of a result: [`RESULT_FORMAT`], then JSON. JSON rather than a denser binary
/// form because it describes itself: a result type that changed between deploys is an
/// [`Error::Corrupt`], never another value read from the same bytes.
pub(super) fn encode<T: Serialize>(value: &T, limit: usize) -> Result<Bytes, &'static str> {
    let mut out = BytesMut::with_capacity(64).writer();
    out.get_mut().put_u8(RESULT_FORMAT);
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    out.get_mut().put_u64(u64::try_from(now.as_millis()).unwrap_or(u64::MAX));
    serde_json::to_writer(&mut out, value).map_err(|_| "the result could not be encoded")?;
    let out = out.into_inner();
    if out.len() - 9 > limit {
        return Err("the result is over the stored limit");
    }
    Ok(out.freeze())
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
        _ => return Err(corrupt("not a result stored by the consumer door".to_owned())),
    };
    serde_json::from_slice(json).map_err(|error| corrupt(error.to_string()))
}
