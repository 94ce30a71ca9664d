//! [`ResponseFuture`]: what [`Idempotency`](super::Idempotency) answers with.

use std::{
    fmt,
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use axum::{
    body::Body,
    response::{IntoResponse, Response},
};
use bytes::Bytes;
use http::StatusCode;
use http_body::Body as HttpBody;

use super::BoxError;

pin_project_lite::pin_project! {
    /// The response future of [`Idempotency`](crate::layer::Idempotency).
    pub struct ResponseFuture<F, E> {
        #[pin]
        kind: Kind<F, E>,
    }
}

pin_project_lite::pin_project! {
    #[project = KindProj]
    enum Kind<F, E> {
        PassThrough { #[pin] future: F },
        Ready { response: Option<Response> },
        Handled { future: Pin<Box<dyn Future<Output = Result<Response, E>> + Send>> },
    }
}

impl<F, E> ResponseFuture<F, E> {
    pub(crate) fn pass_through(future: F) -> Self {
        Self { kind: Kind::PassThrough { future } }
    }

    pub(crate) fn ready(response: Response) -> Self {
        Self { kind: Kind::Ready { response: Some(response) } }
    }

    /// The answer of a handled request, `handling` in `span`. A span no subscriber records is
    /// not entered: entering and leaving it on every poll still cost each poll (with tracing's
    /// `log` feature, a look at `log`'s level each time), and its records go nowhere.
    pub(crate) fn handled(
        handling: impl Future<Output = Result<Response, E>> + Send + 'static,
        span: tracing::Span,
    ) -> Self {
        let future: Pin<Box<dyn Future<Output = _> + Send>> = if span.is_disabled() {
            Box::pin(handling)
        } else {
            Box::pin(tracing::Instrument::instrument(handling, span))
        };
        Self { kind: Kind::Handled { future } }
    }
}

impl<F, E> fmt::Debug for ResponseFuture<F, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<F, E, ResBody> Future for ResponseFuture<F, E>
where
    F: Future<Output = Result<Response<ResBody>, E>>,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Output = Result<Response, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::PassThrough { future } => {
                future.poll(cx).map(|result| result.map(|response| response.map(Body::new)))
            }
            KindProj::Ready { response } => Poll::Ready(Ok(response
                .take()
                .unwrap_or_else(|| StatusCode::INTERNAL_SERVER_ERROR.into_response()))),
            KindProj::Handled { future } => future.as_mut().poll(cx),
        }
    }
}
