//! Bodies: the request body buffered once, with a limit; the response body collected for the
//! store without losing what was read when it is over the limit.

use std::{
    collections::VecDeque,
    pin::Pin,
    task::{Context, Poll},
};

use axum::{body::Body, response::Response};
use bytes::{Bytes, BytesMut};
use http::{StatusCode, header, request::Parts};
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tokio::sync::mpsc;

use super::{
    BoxError,
    problem::{ProblemType, problem},
};

/// Buffers the request body, answering 413 for one over `limit` (before reading a byte when
/// `Content-Length` says so).
pub(super) async fn read_body<B>(parts: &Parts, body: B, limit: usize) -> Result<Bytes, Response>
where
    B: HttpBody<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let too_large = || {
        problem(
            StatusCode::PAYLOAD_TOO_LARGE,
            ProblemType::BodyTooLarge,
            Some(&format!("the limit is {limit} bytes")),
        )
    };
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64)
        || body.size_hint().lower() > limit as u64
    {
        return Err(too_large());
    }
    // Not `collect()`: its queue of frames is an allocation a request, for the one frame most
    // bodies come in.
    let mut body = std::pin::pin!(Limited::new(body, limit));
    let mut chunks = Chunks::default();
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(frame) => {
                if let Ok(data) = frame.into_data() {
                    chunks.push(data);
                }
            }
            Err(error) if error.is::<LengthLimitError>() => return Err(too_large()),
            Err(_) => {
                return Err(problem(StatusCode::BAD_REQUEST, ProblemType::BodyUnreadable, None));
            }
        }
    }
    Ok(chunks.into_bytes())
}

/// The chunks of a body read so far: the first alone (most bodies are one), the rest in a
/// vector only once there is a second.
#[derive(Default)]
struct Chunks {
    first: Option<Bytes>,
    more: Vec<Bytes>,
    read: usize,
}

impl Chunks {
    fn push(&mut self, chunk: Bytes) {
        self.read += chunk.len();
        match self.first {
            None => self.first = Some(chunk),
            Some(_) => self.more.push(chunk),
        }
    }

    /// The chunks as one buffer, copied only when there are several.
    fn into_bytes(self) -> Bytes {
        let Some(first) = self.first else { return Bytes::new() };
        if self.more.is_empty() {
            return first;
        }
        let mut whole = BytesMut::with_capacity(self.read);
        whole.extend_from_slice(&first);
        for chunk in self.more {
            whole.extend_from_slice(&chunk);
        }
        whole.freeze()
    }

    /// The chunks in order, to be sent on.
    fn into_queue(self) -> VecDeque<Bytes> {
        self.first.into_iter().chain(self.more).collect()
    }
}

pub(super) enum CollectedBody {
    Whole(Bytes),
    /// Over the limit: what was read, followed by the rest, unread.
    TooLarge(Body),
    Failed(BoxError),
}

/// Reads a response body up to `limit` bytes without losing what is read when it is larger.
pub(super) async fn collect_response<B>(body: B, limit: usize) -> CollectedBody
where
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let mut body = Body::new(body);
    if body.size_hint().lower() > limit as u64 {
        return CollectedBody::TooLarge(body);
    }
    let mut chunks = Chunks::default();
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(error) => return CollectedBody::Failed(error.into()),
        };
        // Trailers are not stored: a replay has none.
        let Ok(data) = frame.into_data() else { continue };
        chunks.push(data);
        if chunks.read > limit {
            return CollectedBody::TooLarge(Body::new(Prefixed {
                read: chunks.into_queue(),
                rest: body,
            }));
        }
    }
    CollectedBody::Whole(chunks.into_bytes())
}

/// A body that yields chunks already read, then the rest of the original body.
struct Prefixed {
    read: VecDeque<Bytes>,
    rest: Body,
}

impl HttpBody for Prefixed {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Some(chunk) = self.read.pop_front() {
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }

    fn size_hint(&self) -> SizeHint {
        let read: u64 = self.read.iter().map(|chunk| chunk.len() as u64).sum();
        let rest = self.rest.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower() + read);
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper + read);
        }
        hint
    }
}

/// Frames on their way to the client, from the claimed request's task.
pub(super) type FrameSender = mpsc::Sender<Result<Frame<Bytes>, axum::Error>>;

/// A response body fed frame by frame by the claimed request's task: the client reads the
/// handler's frames as they come, while the task keeps its copy for the store.
pub(super) struct Streamed {
    frames: mpsc::Receiver<Result<Frame<Bytes>, axum::Error>>,
}

impl Streamed {
    /// A body, and the sender that feeds it. A few frames are buffered, so that a slow client
    /// holds the handler back only as much as a direct connection would.
    pub(super) fn channel() -> (FrameSender, Self) {
        let (sender, frames) = mpsc::channel(8);
        (sender, Self { frames })
    }
}

impl HttpBody for Streamed {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.frames.poll_recv(cx)
    }
}

/// How a streamed response body ended.
pub(super) enum Teed {
    /// Read to its end; the data, for the store.
    Whole(Bytes),
    /// Over the limit: the rest, still to be sent on, is not copied.
    OverLimit(Body),
    /// The body failed; the client got the error where it happened.
    Failed(axum::Error),
    /// The body panicked (never returned by [`tee`]: its caller catches the panic).
    Panicked,
}

/// Reads `body` to its end, sending every frame on to `client` as it comes and keeping a copy
/// of the data, up to `limit` bytes, for the store. A client that goes away does not stop
/// the reading: the response is still stored, as for a client that leaves while its handler
/// runs; the copy's limit bounds what an endless stream costs then.
pub(super) async fn tee(mut body: Body, client: &FrameSender, limit: usize) -> Teed {
    let mut copy = BytesMut::new();
    let mut client_here = true;
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(error) => {
                if client_here {
                    let _ = client.send(Err(axum::Error::new(error.to_string()))).await;
                }
                return Teed::Failed(error);
            }
        };
        // Trailers go to the client but are not stored: a replay has none.
        let over = frame.data_ref().is_some_and(|data| {
            copy.extend_from_slice(data);
            copy.len() > limit
        });
        if client_here && client.send(Ok(frame)).await.is_err() {
            client_here = false;
        }
        if over {
            return Teed::OverLimit(body);
        }
    }
    Teed::Whole(copy.freeze())
}

/// Sends the rest of `body` on to `client`, until either ends.
pub(super) async fn forward(mut body: Body, client: &FrameSender) {
    while let Some(frame) = body.frame().await {
        if client.send(frame).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use super::*;

    /// A body of `chunks` with no length known ahead: only reading it finds its size.
    fn streamed(chunks: &[&'static [u8]]) -> Body {
        let chunks: Vec<Result<Bytes, Infallible>> =
            chunks.iter().map(|chunk| Ok(Bytes::from_static(chunk))).collect();
        Body::from_stream(futures_util::stream::iter(chunks))
    }

    #[tokio::test]
    async fn a_streamed_response_is_collected_whole_within_the_limit_and_whole_past_it() {
        let CollectedBody::Whole(whole) =
            collect_response(streamed(&[b"ab", b"cd", b"e"]), 5).await
        else {
            panic!("five bytes are within a limit of five")
        };
        assert_eq!(&whole[..], b"abcde");
        // One byte over: what was read is not lost, and the client gets every byte in order.
        let over = collect_response(streamed(&[b"ab", b"cd", b"ef", b"g"]), 5).await;
        let CollectedBody::TooLarge(rest) = over else { panic!("six bytes are over five") };
        assert_eq!(&rest.collect().await.unwrap().to_bytes()[..], b"abcdefg");
    }
}
