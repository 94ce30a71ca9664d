//! The path of one call to a unary method the layer handles: the key, the message (read by
//! `request.rs`), the scope and the fingerprint; then the engine's claim, run and settle ([`Engine::operate`]), and the
//! answer to what it decided.

use std::{marker::PhantomData, sync::Arc, time::Duration};

use axum::body::Body;
use bytes::Bytes;
use http::{Request, Response, request::Parts};
use http_body_util::{BodyExt as _, Full, Limited};
use tonic::{Code, Status};
use tower::ServiceExt as _;
use tower_service::Service;

use super::{
    config::Config,
    door::GrpcDoor,
    record::replay,
    request::{grpc_timeout, metadata_key, read_message},
    status::{answer, retry_after},
};
use crate::{
    context::IdempotencyContext,
    engine::{Claiming, Decided, Ended, Engine, Label, Operated, Start},
    fingerprint::Fingerprint,
    key::RecordKey,
    layer::{MAX_KEY_LEN, scope::ScopeExtractor},
    recovery::{BoxError, Lookup},
    store::Store,
};

/// One call of a listed method, and what handles it.
pub(super) struct Call<S, St, Sc> {
    pub(super) inner: S,
    pub(super) engine: Engine<St>,
    pub(super) scope: Sc,
    pub(super) config: Arc<Config>,
}

impl<S, St, Sc, ResBody> Call<S, St, Sc>
where
    S: Service<Request<tonic::body::Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: Store,
    Sc: ScopeExtractor,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    pub(super) async fn handle(
        self,
        request: Request<tonic::body::Body>,
    ) -> Result<Response<Body>, S::Error> {
        let (mut parts, body) = request.into_parts();
        // A retry waits for its original within its deadline (its own, or the server's when
        // shorter), counted from its arrival, less a tenth of it (at least 50 ms) for the last
        // claim and the answer: its `ABORTED`, with when to retry, reaches the client before
        // the client or the server gives up.
        let deadline = match (grpc_timeout(&parts.headers), self.config.server_timeout) {
            (Some(own), Some(server)) => Some(own.min(server)),
            (own, server) => own.or(server),
        };
        let wait_until = deadline.and_then(|timeout| {
            let margin = (timeout / 10).max(Duration::from_millis(50));
            tokio::time::Instant::now().checked_add(timeout.saturating_sub(margin))
        });
        let (key, message, framed) = match read(&self.config, &mut parts, body).await {
            Ok(read) => read,
            Err(Early::Refused(status)) => return Ok(answer(status)),
            Err(Early::WithoutKey(body)) => return self.without_key(parts, body).await,
        };
        let scope = match self.scope.scope(&mut parts).await {
            Ok(scope) => scope,
            Err(refused) => return Ok(answer(scope_refused(refused).await)),
        };
        let (config, path) = (self.config.clone(), parts.uri.path().to_owned());

        // Claim, run, settle: the engine's.
        let fingerprint = Fingerprint::of_fields(&[path.as_bytes(), &message]);
        let named = self.engine.name(RecordKey::new(&config.prefix, &scope, &key), fingerprint);
        let hash = named.key.hash().to_owned();
        let span = tracing::Span::current();
        span.record("key_hash", hash.as_str());
        let route = Label::route(path.as_str());
        let door =
            GrpcDoor { config: config.clone(), route: route.clone(), span, body: PhantomData };
        let claiming = Claiming { named, route: route.clone(), scope, wait_until };
        let start =
            |(inner, mut parts, framed): (S, Parts, Bytes), context: IdempotencyContext, due| {
                // The recovery hook's question, with the message, when it is due.
                let lookup =
                    config.recover.as_ref().filter(|_| due).map(|hook| {
                        hook.ask(Lookup::new(context.clone(), Some(framed.slice(5..))))
                    });
                parts.extensions.insert(context);
                // The handler answers uncompressed: what is stored is replayed to every client,
                // whatever encodings each accepts (a gzip reply would be unreadable to one that
                // accepts none). Compression belongs to the connection, not to the outcome.
                parts.headers.remove("grpc-accept-encoding");
                let body = tonic::body::Body::new(Full::new(framed));
                Start { operation: inner.oneshot(Request::from_parts(parts, body)), lookup }
            };
        let operated = self.engine.operate(door, claiming, (self.inner, parts, framed), start);
        Ok(match operated.await {
            Operated::Ended(Ended::Answered(response)) => response,
            Operated::Ended(Ended::Failed(error)) => return Err(error),
            Operated::Ended(Ended::Mismatch) => answer(mismatch()),
            Operated::Ended(Ended::Refused | Ended::Cancelled) => {
                retry_after(Code::Unavailable, "the call did not run; retry", ONE_SECOND)
            }
            Operated::Decided(_, Decided::Replay(stored)) => replay(stored, &route, &hash),
            Operated::Decided(_, Decided::InProgress { retry_after: after }) => {
                tracing::debug!(key_hash = hash, ?after, "idempotency: in progress");
                let message = "a call with this idempotency key is in progress; retry later";
                retry_after(Code::Aborted, message, after)
            }
            Operated::Decided(
                _,
                Decided::Failed(error @ crate::store::StoreError::Misplaced(_)),
            ) => {
                tracing::error!(key_hash = hash, %error, "idempotency: refused beside its fleet");
                let message = "this instance cannot serve beside its fleet; the call did not run";
                retry_after(Code::Unavailable, message, ONE_SECOND)
            }
            Operated::Decided(_, Decided::Failed(error)) if error.is_unavailable() => {
                tracing::error!(key_hash = hash, %error, "idempotency: store unavailable");
                retry_after(Code::Unavailable, "the idempotency store is unavailable", ONE_SECOND)
            }
            Operated::Decided(_, Decided::Failed(error)) => {
                tracing::error!(key_hash = hash, %error, "idempotency: record not written by this layer");
                answer(Status::internal("the idempotency record cannot be read"))
            }
        })
    }

    /// A call without a key: refused when the layer requires one, passed through otherwise.
    async fn without_key(
        self,
        parts: Parts,
        body: tonic::body::Body,
    ) -> Result<Response<Body>, S::Error> {
        if self.config.require_key {
            return Ok(answer(Status::invalid_argument(
                "this method needs an idempotency key: the idempotency-key metadata entry, or the request's id",
            )));
        }
        let response = self.inner.oneshot(Request::from_parts(parts, body)).await?;
        Ok(response.map(Body::new))
    }
}

const ONE_SECOND: Duration = Duration::from_secs(1);

/// The call's key, its message, and its frame as the handler gets it; or why it gets no
/// claim.
async fn read(
    config: &Config,
    parts: &mut Parts,
    body: tonic::body::Body,
) -> Result<(Vec<u8>, Bytes, Bytes), Early> {
    let from_metadata = metadata_key(&parts.headers)?;
    let from_message = config.key_from_message.as_ref();
    if from_metadata.is_none() && from_message.is_none() {
        return Err(Early::WithoutKey(body));
    }
    let (message, framed) = read_message(parts, body, config.limits.body).await?;
    let from_message = from_message.and_then(|find| find.key(parts.uri.path(), &message));
    let key = match (from_metadata, from_message) {
        // Two keys that differ would name two records: a retry that carries one of them
        // alone would run again.
        (Some(key), Some(id)) if key != id.as_bytes() => Err(Status::invalid_argument(
            "the idempotency-key metadata entry and the request's id differ: send one key",
        ))?,
        (Some(key), _) => key,
        (None, Some(id)) if id.len() > MAX_KEY_LEN => {
            Err(Status::invalid_argument("the request's idempotency key must be 1 to 255 bytes"))?
        }
        (None, Some(id)) => id.into_bytes(),
        (None, None) => return Err(Early::WithoutKey(tonic::body::Body::new(Full::new(framed)))),
    };
    Ok((key, message, framed))
}

/// Why a call gets no claim: refused, or without a key (its body, to pass it through).
enum Early {
    Refused(Status),
    WithoutKey(tonic::body::Body),
}

impl From<Status> for Early {
    fn from(status: Status) -> Self {
        Self::Refused(status)
    }
}

/// Another message under a key already used: `FAILED_PRECONDITION`, as for a state the
/// caller must change (a fresh key) before the call can succeed, not an argument wrong in
/// itself.
fn mismatch() -> Status {
    Status::failed_precondition(
        "the idempotency key was used with another method or request message; use a new key for a new request",
    )
}

/// A scope extractor's refusal, in gRPC's terms: its 401 `UNAUTHENTICATED`, its 403
/// `PERMISSION_DENIED`, its 429, 502, 503 and 504 `UNAVAILABLE` and any other 5xx `UNKNOWN`
/// (as gRPC maps HTTP statuses), anything else `INVALID_ARGUMENT`; the message its problem's
/// `detail` (or its text).
async fn scope_refused(refused: Response<Body>) -> Status {
    let code = match refused.status().as_u16() {
        401 => Code::Unauthenticated,
        403 => Code::PermissionDenied,
        // An extractor that could not ask (its backend down, busy): gRPC's own mapping.
        429 | 502..=504 => Code::Unavailable,
        500.. => Code::Unknown,
        _ => Code::InvalidArgument,
    };
    let text = Limited::new(refused.into_body(), 64 * 1024).collect().await;
    let too_long = |_| Bytes::from_static(b"(an answer too long to show)");
    let text = text.map_or_else(too_long, http_body_util::Collected::to_bytes);
    let detail = serde_json::from_slice::<serde_json::Value>(&text).ok().and_then(|problem| {
        problem.get("detail").and_then(serde_json::Value::as_str).map(str::to_owned)
    });
    let mut detail = detail.unwrap_or_else(|| String::from_utf8_lossy(&text).into_owned());
    // `grpc-message` goes in a header block, percent-encoded (up to three bytes a byte), which
    // clients cap at 8 to 16 KiB: past it a client drops the call, or its whole connection.
    if detail.len() > DETAIL_MAX {
        let end = (0..=DETAIL_MAX).rev().find(|&end| detail.is_char_boundary(end)).unwrap_or(0);
        detail.truncate(end);
        detail.push('…');
    }
    Status::new(code, format!("the call's idempotency scope: {detail}"))
}

/// The longest detail of a scope refusal told to the client, in bytes.
const DETAIL_MAX: usize = 1024;

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_scope_refusal_is_told_in_grpc_terms_with_its_detail() {
        let refusal = |status: u16| {
            let problem = r#"{"type":"x","detail":"the tenant service is down"}"#;
            let mut response = Response::new(Body::from(problem));
            *response.status_mut() = http::StatusCode::from_u16(status).unwrap();
            response
        };
        for (status, code) in [
            (400, Code::InvalidArgument),
            (401, Code::Unauthenticated),
            (403, Code::PermissionDenied),
            (429, Code::Unavailable),
            (503, Code::Unavailable),
            (500, Code::Unknown),
        ] {
            let refused = scope_refused(refusal(status)).await;
            assert_eq!(refused.code(), code, "{status}");
            assert!(refused.message().ends_with("the tenant service is down"), "{refused:?}");
        }
        let long = Response::new(Body::from(vec![b'x'; 100 * 1024]));
        assert!(scope_refused(long).await.message().contains("too long"));
        // A long detail is cut, at a character's boundary, to fit any client's header limit.
        let detail = format!(r#"{{"detail":"{}"}}"#, "é".repeat(20_000));
        let cut = scope_refused(Response::new(Body::from(detail))).await;
        assert!(
            cut.message().len() < 1100 && cut.message().ends_with("é…"),
            "{}",
            cut.message().len()
        );
    }
}
