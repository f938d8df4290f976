//! The one body type the gateway sends either way: boxed, so that a buffered body, a streamed
//! one and a buffered start followed by the rest of a stream all fit.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use idempotency_client::BoxError;

pub type Body = UnsyncBoxBody<Bytes, BoxError>;

/// A body of bytes already in memory.
pub fn full(bytes: Bytes) -> Body {
    Full::new(bytes)
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// Any body, boxed.
pub fn boxed<B>(body: B) -> Body
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    body.map_err(Into::into).boxed_unsync()
}

/// The chunks already read from a body, then the rest of it: how a response too large to store
/// still reaches its caller whole.
pub fn chained(read: VecDeque<Bytes>, rest: Body) -> Body {
    Chained { read, rest }.boxed_unsync()
}

struct Chained {
    read: VecDeque<Bytes>,
    rest: Body,
}

impl http_body::Body for Chained {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(chunk) = self.read.pop_front() {
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.read.is_empty() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let read: usize = self.read.iter().map(Bytes::len).sum();
        let read = u64::try_from(read).unwrap_or(u64::MAX);
        let rest = self.rest.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower().saturating_add(read));
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper.saturating_add(read));
        }
        hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_chained_body_yields_what_was_read_then_the_rest() {
        let read = VecDeque::from([Bytes::from_static(b"ab"), Bytes::from_static(b"cd")]);
        let body = chained(read, full(Bytes::from_static(b"ef")));
        assert_eq!(http_body::Body::size_hint(&body).exact(), Some(6));
        let all = body.collect().await.expect("collects").to_bytes();
        assert_eq!(&all[..], b"abcdef");
    }
}
