//! The door's own answers, in gRPC's terms: a trailers-only response with `grpc-status`, and,
//! for a call to retry later, `google.rpc.RetryInfo` in `grpc-status-details-bin` and the
//! `grpc-retry-pushback-ms` a gRPC client's retry policy honours.

use std::time::Duration;

use axum::body::Body;
use http::Response;
use tonic::{
    Code, Status,
    metadata::{MetadataMap, MetadataValue},
};
use tonic_types::{ErrorDetails, StatusExt as _};

use crate::store::{TransactionError, transaction::Failure};

/// A status as a trailers-only response.
pub(super) fn answer(status: Status) -> Response<Body> {
    status.into_http()
}

/// `code` with `message`, and a hint to retry after `retry_after`: `google.rpc.RetryInfo`,
/// and the `grpc-retry-pushback-ms` a gRPC client's retry policy honours.
pub(super) fn retry_after(code: Code, message: &str, retry_after: Duration) -> Response<Body> {
    let millis = u64::try_from(retry_after.as_millis()).unwrap_or(u64::MAX).max(1);
    let mut metadata = MetadataMap::new();
    metadata.insert("grpc-retry-pushback-ms", MetadataValue::from(millis));
    let details = ErrorDetails::with_retry_info(Some(retry_after));
    answer(Status::with_error_details_and_metadata(code, message, details, metadata))
}

/// A transaction that did not commit, as a status, so that a handler answers it with `?`:
/// the operation's error `INTERNAL` (logged, never shown); a store error, or a commit whose
/// answer was lost, `UNAVAILABLE` (the retry learns what committed); an outcome the door does
/// not store and a misuse `INTERNAL`, with the reason.
impl<E: std::fmt::Display> From<TransactionError<E>> for Status {
    fn from(error: TransactionError<E>) -> Self {
        match error.failure() {
            Failure::Handler(None) => Status::internal("the call's transaction failed"),
            Failure::Handler(Some(reason)) => Status::internal(reason),
            Failure::Store(detail) => Status::unavailable(detail),
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
        let info = status.get_details_retry_info().expect("RetryInfo");
        assert_eq!(info.retry_delay, Some(Duration::from_millis(1500)));
    }

    #[test]
    fn a_transaction_error_is_the_status_a_client_can_act_on() {
        let not_stored = "the outcome is not stored: the store policy does not keep OK";
        let status = Status::from(TransactionError::<String>::NotStored(not_stored.into()));
        assert_eq!((status.code(), status.message()), (Code::Internal, not_stored));
        let failed = Status::from(TransactionError::Operation("card declined: 4242".to_owned()));
        assert_eq!(failed.code(), Code::Internal);
        assert!(!failed.message().contains("4242"), "the operation's error is never shown");
        let lost = Status::from(TransactionError::<String>::CommitUnknown(
            crate::store::StoreError::FencedOut,
        ));
        assert_eq!(lost.code(), Code::Unavailable);
    }
}
