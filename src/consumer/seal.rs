//! [`seal`]: a result encoded as the consumer door stores it, for the operation to write in
//! its own transaction.

use std::fmt;

use serde::Serialize;

use super::record::{Unstorable, encode};
use crate::{context::IdempotencyContext, store::SealedOutcome};

/// `value` as the consumer door stores it, for the operation to write in its own transaction,
/// beside its side effect, so that both commit or neither does: with `PostgresStore`,
/// [`complete_in`](crate::store::PostgresStore::complete_in) the operation's transaction,
/// then commit, then return `Ok(value)`.
///
/// The door then writes nothing more: the committed row is the record, and every redelivery
/// is answered from it, even when the process dies between the commit and the door's answer.
/// Return what you sealed: a redelivery gets the sealed value, whatever the first caller got.
/// If the transaction rolls back, return `Err` (the key is released, and the redelivery runs
/// the operation); an `Ok` after a rollback leaves the key to lapse with its lease, and the
/// delivery after it runs the operation again.
///
/// # Errors
///
/// [`SealError::Unencodable`] when serde cannot encode `value`, or it holds NaN or an infinity;
/// [`SealError::NotClaimed`] for a context the consumer door did not give.
pub fn seal<T: Serialize>(
    context: &IdempotencyContext,
    value: &T,
) -> Result<SealedOutcome, SealError> {
    let completion = context.completion().ok_or(SealError::NotClaimed)?;
    let outcome = match encode(value, usize::MAX) {
        Ok(outcome) => outcome,
        Err(Unstorable::Unencodable(reason)) => return Err(SealError::Unencodable(reason)),
        // No result is over a limit of usize::MAX.
        Err(Unstorable::OverLimit) => return Err(SealError::Unencodable("too large".into())),
    };
    Ok(SealedOutcome {
        key: completion.key.clone(),
        owner: completion.owner.clone(),
        fingerprint: context.fingerprint().clone(),
        outcome,
        retention: completion.retention,
        written: completion.written.clone(),
    })
}

/// Why [`seal`] made no outcome.
#[derive(Debug)]
#[non_exhaustive]
pub enum SealError {
    /// serde could not encode the value, or it holds NaN or an infinity (which JSON would
    /// store as `null`): the reason.
    Unencodable(String),
    /// The context is not one the consumer door gave to an operation it runs.
    NotClaimed,
}

impl fmt::Display for SealError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unencodable(reason) => write!(f, "the result cannot be stored: {reason}"),
            Self::NotClaimed => f.write_str("the context is not one of the consumer door's"),
        }
    }
}

impl std::error::Error for SealError {}
