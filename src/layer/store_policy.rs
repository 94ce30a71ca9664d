//! Which responses the layer stores for replay: the [`StorePolicy`] it asks, and the
//! [`ReleaseKey`] marker a handler (or an extractor's rejection) puts on a response that must not
//! be stored.

use std::{fmt, sync::Arc};

use axum::response::{IntoResponseParts, ResponseParts};
use http::{StatusCode, response::Parts};

/// Decides whether a handler's response is stored for replay (`true`), or its key released so
/// that a retry runs the handler again (`false`).
///
/// It sees the response's head (status, headers, extensions), so it can tell a response by
/// what the handler put on it. Implemented for every `Fn(&http::response::Parts) -> bool` (write
/// the argument's type on the closure, as below: Rust infers it through the trait only so);
/// [`DefaultStorePolicy`] is the default. Whatever the policy says, a response marked
/// [`ReleaseKey`] is never stored, nor is a 405.
///
/// ```
/// use axum_idempotency::{IdempotencyLayer, MemoryStore};
///
/// // Store successes only: every failure may be retried.
/// let layer = IdempotencyLayer::new(MemoryStore::new())
///     .store_policy(|response: &http::response::Parts| response.status.is_success());
/// ```
pub trait StorePolicy: Send + Sync + 'static {
    /// Whether the response with this head is stored.
    fn stores(&self, response: &Parts) -> bool;
}

impl<F> StorePolicy for F
where
    F: Fn(&Parts) -> bool + Send + Sync + 'static,
{
    fn stores(&self, response: &Parts) -> bool {
        self(response)
    }
}

/// The default [`StorePolicy`]: a response is stored once the handler acted on the request, as
/// Stripe's API saves results "once the endpoint started executing", so that a retry of a
/// request that failed for what it asked replays that failure.
///
/// Stored: 2xx, and the 4xx about what the request asked (400, 404, 409, 422, …). Released, so
/// that a retry runs again: 5xx; 408 and 429 (they ask for the retry); 401 and 403 (the
/// credentials, which a client fixes and retries with the same key and body); 406 and 415
/// (how the request was sent or what it accepts, fixed in the headers, which the fingerprint
/// does not cover); 1xx and 3xx.
///
/// ```
/// use axum_idempotency::layer::{DefaultStorePolicy, StorePolicy};
/// use http::{Response, StatusCode};
///
/// let head = |status: StatusCode| {
///     let mut response = Response::new(());
///     *response.status_mut() = status;
///     response.into_parts().0
/// };
/// assert!(DefaultStorePolicy.stores(&head(StatusCode::CREATED)));
/// assert!(DefaultStorePolicy.stores(&head(StatusCode::UNPROCESSABLE_ENTITY)));
/// assert!(!DefaultStorePolicy.stores(&head(StatusCode::UNAUTHORIZED)));
/// assert!(!DefaultStorePolicy.stores(&head(StatusCode::UNSUPPORTED_MEDIA_TYPE)));
/// assert!(!DefaultStorePolicy.stores(&head(StatusCode::TOO_MANY_REQUESTS)));
/// assert!(!DefaultStorePolicy.stores(&head(StatusCode::SERVICE_UNAVAILABLE)));
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct DefaultStorePolicy;

impl StorePolicy for DefaultStorePolicy {
    fn stores(&self, response: &Parts) -> bool {
        let status = response.status;
        status.is_success()
            || (status.is_client_error()
                && !matches!(
                    status,
                    StatusCode::UNAUTHORIZED
                        | StatusCode::FORBIDDEN
                        | StatusCode::NOT_ACCEPTABLE
                        | StatusCode::REQUEST_TIMEOUT
                        | StatusCode::UNSUPPORTED_MEDIA_TYPE
                        | StatusCode::TOO_MANY_REQUESTS
                ))
    }
}

/// A response marker: "do not store this response; release the key, so that a retry runs the
/// handler again". Honoured whatever the [`StorePolicy`] says.
///
/// For a failure the handler knows to be passing (a dependency down, a lock not taken), or an
/// extractor's rejection, which answered before the handler acted: put it in the response as one
/// of its parts. A response committed in a store's transaction (`PostgresStore::transaction`)
/// that carries it, or that the store policy does not keep, is refused, and the transaction
/// rolled back with its side effect (`TransactionError::NotStored`): a side effect committed
/// with its key released would run again on the retry.
///
/// ```
/// use axum::{http::StatusCode, response::IntoResponse};
/// use axum_idempotency::layer::ReleaseKey;
///
/// async fn create_payment() -> impl IntoResponse {
///     // The ledger is busy: a retry with the same key must run again.
///     (StatusCode::CONFLICT, ReleaseKey, "the ledger is busy; retry")
/// }
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReleaseKey;

impl IntoResponseParts for ReleaseKey {
    type Error = std::convert::Infallible;

    fn into_response_parts(self, mut parts: ResponseParts) -> Result<ResponseParts, Self::Error> {
        parts.extensions_mut().insert(self);
        Ok(parts)
    }
}

/// The layer's store policy, shared by its clones.
#[derive(Clone)]
pub(super) struct Policy(pub(super) Arc<dyn StorePolicy>);

impl Default for Policy {
    fn default() -> Self {
        Self(Arc::new(DefaultStorePolicy))
    }
}

impl fmt::Debug for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("StorePolicy(..)")
    }
}
