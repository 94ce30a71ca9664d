//! Scopes: whose keys are whose.
//!
//! A record lives under `hash(scope, key)`, so the same `Idempotency-Key` sent by two tenants
//! names two records, and one tenant can never be replayed another's response. A scope is
//! only as trustworthy as its source: each extractor below says what it trusts.

use std::{fmt, future::Future, marker::PhantomData};

use axum::{
    body::Body,
    extract::FromRequestParts,
    response::{IntoResponse, Response},
};
use http::{HeaderName, StatusCode, header::InvalidHeaderName, request::Parts};

use super::problem::{ProblemType, problem};

/// Finds the scope of a request from its parts.
///
/// Return the scope's bytes, or the response to send instead (the request is then not handled
/// and no record is touched). Implemented by [`GlobalScope`], [`HeaderScope`],
/// [`ExtractorScope`], and by closures `Fn(&Parts) -> Option<String>`, whose `None` is
/// answered with 400 problem+json:
///
/// ```
/// use axum_idempotency::{IdempotencyLayer, MemoryStore};
/// use http::request::Parts;
///
/// // Scope by the tenant that an authentication middleware put in the extensions.
/// #[derive(Clone)]
/// struct Tenant(String);
///
/// let layer = IdempotencyLayer::new(MemoryStore::new())
///     .scope(|parts: &Parts| parts.extensions.get::<Tenant>().map(|t| t.0.clone()));
/// ```
pub trait ScopeExtractor: Clone + Send + Sync + 'static {
    /// The scope of the request with these parts.
    fn scope(&self, parts: &mut Parts) -> impl Future<Output = Result<Vec<u8>, Response>> + Send;
}

/// One scope for every request: keys are shared by all clients. The default.
///
/// Trusts every client with every key: use it only where the service has one client, or keys
/// are unguessable and clients don't share them.
#[derive(Debug, Clone, Copy, Default)]
pub struct GlobalScope;

impl ScopeExtractor for GlobalScope {
    async fn scope(&self, _parts: &mut Parts) -> Result<Vec<u8>, Response> {
        Ok(Vec::new())
    }
}

/// The scope is the value of a request header, such as `X-Tenant-Id`. A request without it,
/// or with more than one, gets 400 problem+json (`scope-missing`) whose `detail` names the
/// header. (The gRPC door takes it too: a metadata entry, and `INVALID_ARGUMENT`.)
///
/// Trusts the header, which any client can set: use it only behind a gateway that sets or
/// verifies the header. To scope by an authenticated identity, use [`ExtractorScope`].
#[derive(Debug, Clone)]
pub struct HeaderScope {
    pub(crate) name: HeaderName,
}

impl HeaderScope {
    /// Scopes by the header `name`, in any case (`X-Tenant-Id` and `x-tenant-id` are one).
    ///
    /// ```
    /// use axum_idempotency::HeaderScope;
    ///
    /// let scope = HeaderScope::new("X-Tenant-Id").unwrap();
    /// assert!(HeaderScope::new("not a header").is_err());
    /// ```
    ///
    /// # Errors
    ///
    /// When `name` is not a valid header name.
    pub fn new(name: &str) -> Result<Self, InvalidHeaderName> {
        Ok(Self { name: HeaderName::try_from(name)? })
    }
}

/// Scopes by a header name already checked.
impl From<HeaderName> for HeaderScope {
    fn from(name: HeaderName) -> Self {
        Self { name }
    }
}

impl ScopeExtractor for HeaderScope {
    async fn scope(&self, parts: &mut Parts) -> Result<Vec<u8>, Response> {
        let mut values = parts.headers.get_all(&self.name).iter();
        match (values.next(), values.next()) {
            (Some(value), None) => Ok(value.as_bytes().to_vec()),
            (None, _) => Err(scope_missing(&format!(
                "the request has no `{}` header, which names its idempotency scope",
                self.name
            ))),
            (Some(_), Some(_)) => Err(scope_missing(&format!(
                "the `{}` header, which names the request's idempotency scope, is repeated",
                self.name
            ))),
        }
    }
}

impl<F> ScopeExtractor for F
where
    F: Fn(&Parts) -> Option<String> + Clone + Send + Sync + 'static,
{
    async fn scope(&self, parts: &mut Parts) -> Result<Vec<u8>, Response> {
        self(parts).map(String::into_bytes).ok_or_else(|| {
            scope_missing("the scope extractor found no idempotency scope for the request")
        })
    }
}

/// Any axum extractor as the scope: the app's own authenticated-user extractor, say, mapped
/// to the identity that owns the keys. Its rejection is the response.
///
/// Trusts the extractor. The extractor runs with `()` state, so it reads the request parts
/// (headers, extensions set by authentication middleware), not the router's state.
///
/// ```
/// use axum::{extract::FromRequestParts, http::{StatusCode, request::Parts}};
/// use axum_idempotency::{IdempotencyLayer, MemoryStore, layer::scope::ExtractorScope};
///
/// struct User { id: u64 }
///
/// impl<S: Send + Sync> FromRequestParts<S> for User {
///     type Rejection = StatusCode;
///     async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
///         let id = parts.headers.get("x-user").and_then(|v| v.to_str().ok());
///         id.and_then(|id| id.parse().ok()).map(|id| User { id }).ok_or(StatusCode::UNAUTHORIZED)
///     }
/// }
///
/// let layer = IdempotencyLayer::new(MemoryStore::new())
///     .scope(ExtractorScope::new(|user: User| user.id.to_string()));
/// ```
pub struct ExtractorScope<E, F> {
    to_scope: F,
    extractor: PhantomData<fn() -> E>,
}

impl<E, F> ExtractorScope<E, F>
where
    E: FromRequestParts<()> + Send + 'static,
    E::Rejection: IntoResponse,
    F: Fn(E) -> String + Clone + Send + Sync + 'static,
{
    /// Scopes by what `to_scope` makes of the extracted `E`.
    #[must_use]
    pub fn new(to_scope: F) -> Self {
        Self { to_scope, extractor: PhantomData }
    }
}

impl<E, F: Clone> Clone for ExtractorScope<E, F> {
    fn clone(&self) -> Self {
        Self { to_scope: self.to_scope.clone(), extractor: PhantomData }
    }
}

impl<E, F> fmt::Debug for ExtractorScope<E, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExtractorScope")
            .field("extractor", &std::any::type_name::<E>())
            .finish_non_exhaustive()
    }
}

impl<E, F> ScopeExtractor for ExtractorScope<E, F>
where
    E: FromRequestParts<()> + Send + 'static,
    E::Rejection: IntoResponse,
    F: Fn(E) -> String + Clone + Send + Sync + 'static,
{
    async fn scope(&self, parts: &mut Parts) -> Result<Vec<u8>, Response> {
        match E::from_request_parts(parts, &()).await {
            Ok(extracted) => Ok((self.to_scope)(extracted).into_bytes()),
            Err(rejection) => Err(rejection.into_response()),
        }
    }
}

/// 400 `scope-missing`, with a `detail` saying what was expected.
fn scope_missing(detail: &str) -> Response<Body> {
    problem(StatusCode::BAD_REQUEST, ProblemType::ScopeMissing, Some(detail))
}
