//! Coalescing: the step between the upstream's body and the client's that
//! merges data frames which are already there into one frame, up to
//! [`COALESCE_MAX`] bytes, so a burst of SSE events read at once becomes
//! one write to the client. It never waits for more: a frame that is ready
//! alone goes out alone, at once.
//!
//! Order is kept: trailers or an error that come after merged data go out
//! after it, on the next poll (the data first, so hyper flushes it before a
//! body error closes the connection).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};

use crate::upstream::BoxError;

/// Chunks that are already there are merged up to this size per write.
pub const COALESCE_MAX: usize = 64 * 1024;

/// What came after merged data, held for the next poll.
enum Held {
    Trailers(Frame<Bytes>),
    Error(BoxError),
    End,
}

/// A body whose ready data frames are merged (see the module).
pub struct Coalesced<B> {
    inner: B,
    held: Option<Held>,
    /// The data before a held error was given to hyper and one poll passed.
    yielded: bool,
}

impl<B> Coalesced<B> {
    pub fn new(inner: B) -> Self {
        Self {
            inner,
            held: None,
            yielded: false,
        }
    }

    pub fn get_ref(&self) -> &B {
        &self.inner
    }
}

impl<B> Body for Coalesced<B>
where
    B: Body<Data = Bytes, Error = BoxError> + Unpin,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        match this.held.take() {
            Some(Held::Error(e)) if !this.yielded => {
                // Let hyper flush the data merged before the error first: on
                // a body error it closes the connection without flushing.
                this.yielded = true;
                this.held = Some(Held::Error(e));
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            Some(Held::Error(e)) => return Poll::Ready(Some(Err(e))),
            Some(Held::Trailers(t)) => return Poll::Ready(Some(Ok(t))),
            Some(Held::End) => return Poll::Ready(None),
            None => {}
        }
        let mut first: Option<Bytes> = None;
        let mut merged: Option<BytesMut> = None;
        loop {
            let have =
                first.as_ref().map_or(0, Bytes::len) + merged.as_ref().map_or(0, |m| m.len());
            let frame = match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => frame,
                Poll::Ready(Some(Err(e))) if have > 0 => {
                    this.held = Some(Held::Error(e));
                    break;
                }
                Poll::Ready(None) if have > 0 => {
                    this.held = Some(Held::End);
                    break;
                }
                Poll::Pending if have > 0 => break,
                other => return other,
            };
            let data = match frame.into_data() {
                Ok(data) => data,
                Err(trailers) if have == 0 => return Poll::Ready(Some(Ok(trailers))),
                Err(trailers) => {
                    this.held = Some(Held::Trailers(trailers));
                    break;
                }
            };
            let total = have + data.len();
            match (merged.as_mut(), first.take()) {
                (Some(m), _) => m.extend_from_slice(&data),
                (None, Some(f)) => {
                    let mut m = BytesMut::with_capacity(total + 1024);
                    m.extend_from_slice(&f);
                    m.extend_from_slice(&data);
                    merged = Some(m);
                }
                (None, None) => first = Some(data),
            }
            // hyper may not poll a finished body again.
            if total >= COALESCE_MAX || this.inner.is_end_stream() {
                break;
            }
        }
        let data = match merged {
            Some(m) => m.freeze(),
            None => first.unwrap_or_default(),
        };
        Poll::Ready(Some(Ok(Frame::data(data))))
    }

    fn is_end_stream(&self) -> bool {
        match &self.held {
            None => self.inner.is_end_stream(),
            Some(Held::End) => true,
            Some(_) => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.held {
            None => self.inner.size_hint(),
            Some(Held::End) => SizeHint::with_exact(0),
            Some(_) => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]
    use std::collections::VecDeque;

    use http::HeaderMap;
    use http_body_util::BodyExt;

    use super::*;

    /// A body whose frames are all ready, then ends (or fails).
    struct Ready(VecDeque<Result<Frame<Bytes>, BoxError>>);

    impl Body for Ready {
        type Data = Bytes;
        type Error = BoxError;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            Poll::Ready(self.0.pop_front())
        }
    }

    fn data(s: &'static str) -> Result<Frame<Bytes>, BoxError> {
        Ok(Frame::data(Bytes::from_static(s.as_bytes())))
    }

    async fn frames(body: Ready) -> Vec<String> {
        let mut c = Coalesced::new(body);
        let mut out = Vec::new();
        while let Some(f) = c.frame().await {
            out.push(match f {
                Ok(f) if f.is_data() => String::from_utf8(f.into_data().unwrap().to_vec()).unwrap(),
                Ok(_) => "<trailers>".to_owned(),
                Err(e) => format!("<error {e}>"),
            });
        }
        out
    }

    #[tokio::test]
    async fn ready_frames_merge_and_what_follows_keeps_its_place() {
        let events = [
            data("data: 1\n\n"),
            data("data: 2\n\n"),
            data("data: 3\n\n"),
        ];
        assert_eq!(
            frames(Ready(events.into_iter().collect())).await,
            ["data: 1\n\ndata: 2\n\ndata: 3\n\n"]
        );
        let trailers = Ok(Frame::trailers(HeaderMap::new()));
        assert_eq!(
            frames(Ready(
                [data("a"), data("b"), trailers].into_iter().collect()
            ))
            .await,
            ["ab", "<trailers>"],
            "trailers after merged data are kept, after it"
        );
        let cut: Result<Frame<Bytes>, BoxError> = Err("upstream reset".into());
        assert_eq!(
            frames(Ready([data("a"), data("b"), cut].into_iter().collect())).await,
            ["ab", "<error upstream reset>"]
        );
    }

    #[tokio::test]
    async fn merging_stops_at_the_cap() {
        let big = "x".repeat(COALESCE_MAX / 2 + 1).leak();
        let body = Ready([data(big), data(big), data(big)].into_iter().collect());
        let sizes: Vec<usize> = frames(body).await.iter().map(String::len).collect();
        assert_eq!(sizes, [2 * big.len(), big.len()]);
    }
}
