//! The door's own answers, in gRPC's terms: a trailers-only response with `grpc-status`, and,
//! for a call to retry later, `google.rpc.RetryInfo` in `grpc-status-details-bin` and the
//! `grpc-retry-pushback-ms` a gRPC client's retry policy honours.

use std::time::Duration;

use bytes::Bytes;
use http::Response;
use prost::Message as _;
use tonic::{Code, Status, body::Body, metadata::MetadataValue};

use crate::store::TransactionError;

/// A status as a trailers-only response.
pub(super) fn answer(status: Status) -> Response<Body> {
    status.into_http()
}

/// `code` with `message`, and a hint to retry after `retry_after`.
pub(super) fn retry_after(code: Code, message: &str, retry_after: Duration) -> Response<Body> {
    let seconds = i64::try_from(retry_after.as_secs()).unwrap_or(i64::MAX);
    let delay =
        ProtoDuration { seconds, nanos: i32::try_from(retry_after.subsec_nanos()).unwrap_or(0) };
    let retry_info = RetryInfo { retry_delay: Some(delay) };
    let details = RpcStatus {
        code: code as i32,
        message: message.to_owned(),
        details: vec![Any {
            type_url: "type.googleapis.com/google.rpc.RetryInfo".to_owned(),
            value: retry_info.encode_to_vec(),
        }],
    };
    let mut status = Status::with_details(code, message, Bytes::from(details.encode_to_vec()));
    let millis = u64::try_from(retry_after.as_millis()).unwrap_or(u64::MAX).max(1);
    status.metadata_mut().insert("grpc-retry-pushback-ms", MetadataValue::from(millis));
    answer(status)
}

/// `google.rpc.Status`, the `grpc-status-details-bin` payload.
#[derive(Clone, PartialEq, prost::Message)]
struct RpcStatus {
    #[prost(int32, tag = "1")]
    code: i32,
    #[prost(string, tag = "2")]
    message: String,
    #[prost(message, repeated, tag = "3")]
    details: Vec<Any>,
}

/// `google.protobuf.Any`.
#[derive(Clone, PartialEq, prost::Message)]
struct Any {
    #[prost(string, tag = "1")]
    type_url: String,
    #[prost(bytes = "vec", tag = "2")]
    value: Vec<u8>,
}

/// `google.rpc.RetryInfo`.
#[derive(Clone, PartialEq, prost::Message)]
struct RetryInfo {
    #[prost(message, optional, tag = "1")]
    retry_delay: Option<ProtoDuration>,
}

/// `google.protobuf.Duration`.
#[derive(Clone, PartialEq, prost::Message)]
struct ProtoDuration {
    #[prost(int64, tag = "1")]
    seconds: i64,
    #[prost(int32, tag = "2")]
    nanos: i32,
}

/// A transaction that did not commit, as a status, so that a handler answers it with `?`:
/// the operation's error `INTERNAL` (logged, never shown); a store error, or a commit whose
/// answer was lost, `UNAVAILABLE` (the retry learns what committed); an outcome the door does
/// not store and a misuse `INTERNAL`, with the reason.
impl<E: std::fmt::Display> From<TransactionError<E>> for Status {
    fn from(error: TransactionError<E>) -> Self {
        match error {
            TransactionError::Operation(error) => {
                tracing::error!(%error, "idempotency: the handler's transaction failed");
                Status::internal("the call's transaction failed")
            }
            TransactionError::Store(error) => {
                tracing::error!(%error, "idempotency: the handler's transaction was rolled back");
                Status::unavailable(format!("rolled back: {error}"))
            }
            TransactionError::CommitUnknown(error) => {
                tracing::error!(%error, "idempotency: the commit's answer was lost");
                Status::unavailable("the commit's answer was lost: retry to learn its outcome")
            }
            TransactionError::NotStored(reason) => {
                tracing::error!(reason, "idempotency: the handler's outcome is not stored");
                Status::internal(format!("the outcome is not stored: {reason}"))
            }
            TransactionError::Misuse(reason) => {
                tracing::error!(reason, "idempotency: the handler's transaction was refused");
                Status::internal(reason)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retry_hint_carries_retry_info_and_the_pushback() {
        let response = retry_after(Code::Aborted, "in progress", Duration::from_millis(1500));
        let status = Status::from_header_map(response.headers()).expect("a status");
        assert_eq!(status.code(), Code::Aborted);
        assert_eq!(response.headers()["grpc-retry-pushback-ms"], "1500");
        let details = RpcStatus::decode(status.details()).expect("google.rpc.Status");
        assert_eq!(details.details[0].type_url, "type.googleapis.com/google.rpc.RetryInfo");
        let info = RetryInfo::decode(&details.details[0].value[..]).expect("RetryInfo");
        assert_eq!(info.retry_delay, Some(ProtoDuration { seconds: 1, nanos: 500_000_000 }));
    }
}
