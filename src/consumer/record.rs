//! How the consumer door stores a result: the engine's envelope (format `J` and the completion
//! time; see `crate::engine::envelope`), then JSON. `j`, written before, is JSON alone and is
//! still read. `U`, then the time, then a reason: a result that ran but has no faithful stored
//! form.

use bytes::{BufMut, Bytes};
use serde::{Serialize, de::DeserializeOwned};

use super::{Error, finite};
use crate::engine::{
    Label,
    envelope::{self, Format},
};

/// Why a result has no stored form.
pub(super) enum Unstorable {
    /// Larger than the stored limit: its key is released (documented on `stored_limit`).
    OverLimit,
    /// serde could not encode it, or it holds a float JSON cannot (NaN, ±inf): the operation
    /// ran, so its key is completed with `envelope::not_stored`, never released.
    Unencodable(String),
}

/// The stored form of a result: the envelope of [`Format::Json`], then JSON. JSON rather than a denser binary
/// form because it describes itself: a result type that changed between deploys is an
/// [`Error::Corrupt`], never another value read from the same bytes.
pub(super) fn encode<T: Serialize>(value: &T, limit: usize) -> Result<Bytes, Unstorable> {
    finite::check(value).map_err(|error| Unstorable::Unencodable(error.to_string()))?;
    let started = envelope::begin(Format::Json, 64);
    let header = started.len();
    let mut out = started.writer();
    serde_json::to_writer(&mut out, value)
        .map_err(|error| Unstorable::Unencodable(error.to_string()))?;
    let out = out.into_inner();
    if out.len() - header > limit {
        return Err(Unstorable::OverLimit);
    }
    Ok(out.freeze())
}

/// A value already serialized as `json`, in the stored form [`encode`] gives it.
pub(super) fn encode_json(json: &[u8]) -> Bytes {
    let mut out = envelope::begin(Format::Json, json.len());
    out.put_slice(json);
    out.freeze()
}

/// The result stored in `stored`, observing its age under `label`.
pub(super) fn decode<T: DeserializeOwned, E>(
    stored: Bytes,
    hash: &str,
    label: &Label,
) -> Result<T, Error<E>> {
    let corrupt = |reason: String| {
        tracing::error!(key_hash = hash, reason, "idempotency: stored result is unreadable");
        Error::Corrupt { key_hash: hash.to_owned(), reason }
    };
    let opened = envelope::parse(stored, label);
    let json = match opened {
        Some(opened) if opened.format == Format::Json => opened.payload,
        Some(opened) if opened.format == Format::NotStored => {
            let reason = String::from_utf8_lossy(&opened.payload).into_owned();
            tracing::warn!(
                key_hash = hash,
                reason,
                "idempotency: the operation ran before, but its result could not be stored"
            );
            return Err(Error::ResultNotStored { key_hash: hash.to_owned(), reason });
        }
        _ => return Err(corrupt("not a result stored by the consumer door".to_owned())),
    };
    serde_json::from_slice(&json).map_err(|error| corrupt(error.to_string()))
}
