//! The answers actix-http writes by itself, before any route sees the
//! request: a head that does not arrive within the client timeout (408), a
//! head it cannot parse (400), a head too large to read (431). It writes
//! them with an empty body and no hook, as the last bytes of the
//! connection. [`ProblemStream`] wraps every accepted connection and gives
//! those answers the problem+json body every other refusal has.
//!
//! Such an answer is recognised at the end of what actix writes: a status
//! line of one of those three codes, headers with `content-length: 0` and
//! no `content-type`, ending exactly at the end of the buffer. Every answer
//! of the routes with these codes carries a problem+json body, and no body
//! the service sends contains a CR LF (JSON has none outside white space,
//! which canonical text drops; Prometheus text uses LF), so nothing else
//! matches.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use actix_web::ResponseError;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::problem::ApiError;

/// A connection whose actix-own error answers are rewritten as problem+json.
pub struct ProblemStream<T> {
    inner: T,
    client_timeout_ms: u128,
    /// A rewritten answer being written, how much of it is out, and the
    /// length of actix's own answer it stands for: that write is answered
    /// (with that length) only once all of it is out, so actix keeps
    /// flushing until then.
    owed: Vec<u8>,
    owed_from: usize,
    stands_for: usize,
}

impl<T> ProblemStream<T> {
    pub fn new(inner: T, client_timeout_ms: u128) -> Self {
        Self {
            inner,
            client_timeout_ms,
            owed: Vec::new(),
            owed_from: 0,
            stands_for: 0,
        }
    }

    pub fn get_ref(&self) -> &T {
        &self.inner
    }
}

impl<T: AsyncWrite + Unpin> ProblemStream<T> {
    /// Writes what is owed; ready once all of it is out.
    fn poll_pay(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.owed_from < self.owed.len() {
            let written =
                ready!(Pin::new(&mut self.inner).poll_write(cx, &self.owed[self.owed_from..]))?;
            if written == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.owed_from += written;
        }
        self.owed.clear();
        self.owed_from = 0;
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for ProblemStream<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for ProblemStream<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.owed.is_empty() {
            match own_answer_at(buf) {
                // Earlier answers go out untouched first; the next write
                // starts with actix's own.
                Some(start) if start > 0 => {
                    return Pin::new(&mut this.inner).poll_write(cx, &buf[..start]);
                }
                Some(_) => match rewrite(buf, this.client_timeout_ms) {
                    Some(rewritten) => {
                        this.owed = rewritten;
                        this.stands_for = buf.len();
                    }
                    None => return Pin::new(&mut this.inner).poll_write(cx, buf),
                },
                None => return Pin::new(&mut this.inner).poll_write(cx, buf),
            }
        }
        // actix offers the same bytes again until told they are written.
        ready!(this.poll_pay(cx))?;
        Poll::Ready(Ok(std::mem::take(&mut this.stands_for)))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// Where the actix-own answer that ends `buf` starts, if it ends with one.
fn own_answer_at(buf: &[u8]) -> Option<usize> {
    const END: &[u8] = b"\r\n\r\n";
    if !buf.ends_with(END) {
        return None;
    }
    // The head starts at the last status line before the end.
    let start = buf
        .windows(9)
        .rposition(|w| w == b"HTTP/1.1 " || w == b"HTTP/1.0 ")?;
    rewrite(&buf[start..], 0).map(|_| start)
}

/// `buf`, which is one actix-own answer and nothing else, given its
/// problem+json body; `None` when it is something else.
fn rewrite(buf: &[u8], client_timeout_ms: u128) -> Option<Vec<u8>> {
    let head = std::str::from_utf8(buf.strip_suffix(b"\r\n\r\n")?).ok()?;
    if head.contains("\r\n\r\n") {
        return None;
    }
    let mut lines = head.split("\r\n");
    let status_line = lines.next()?;
    let error = match status_line.get(9..12)? {
        "400" => ApiError::MalformedHead,
        "408" => ApiError::SlowHead(client_timeout_ms),
        "431" => ApiError::HeadTooLarge,
        _ => return None,
    };
    let mut kept = Vec::new();
    let mut empty = false;
    for line in lines {
        let (name, value) = line.split_once(':')?;
        if name.eq_ignore_ascii_case("content-type") {
            return None;
        }
        if name.eq_ignore_ascii_case("content-length") {
            if value.trim() != "0" {
                return None;
            }
            empty = true;
        } else {
            kept.push(line);
        }
    }
    if !empty {
        return None;
    }
    let body = serde_json::to_vec(&error.problem(error.status_code())).ok()?;
    let mut out = Vec::with_capacity(head.len() + body.len() + 128);
    out.extend_from_slice(status_line.as_bytes());
    out.extend_from_slice(b"\r\n");
    for line in kept {
        out.extend_from_slice(line.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"content-type: application/problem+json\r\n");
    out.extend_from_slice(format!("content-length: {}\r\n\r\n", body.len()).as_bytes());
    out.extend_from_slice(&body);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::{own_answer_at, rewrite};

    fn body_of(answer: &[u8]) -> serde_json::Value {
        let text = std::str::from_utf8(answer).unwrap();
        let (_, body) = text.split_once("\r\n\r\n").unwrap();
        serde_json::from_str(body).unwrap()
    }

    #[test]
    fn each_own_answer_gets_its_problem() {
        for (code, slug) in [
            ("400 Bad Request", "malformed-request"),
            ("408 Request Timeout", "request-timeout"),
            (
                "431 Request Header Fields Too Large",
                "request-header-fields-too-large",
            ),
        ] {
            let head = format!(
                "HTTP/1.1 {code}\r\ncontent-length: 0\r\nconnection: close\r\ndate: Wed, 02 Dec 2026 05:00:00 GMT\r\n\r\n"
            );
            let out = rewrite(head.as_bytes(), 5000).unwrap();
            let text = String::from_utf8(out.clone()).unwrap();
            assert!(text.starts_with(&format!("HTTP/1.1 {code}\r\n")), "{text}");
            assert!(text.contains("connection: close\r\n"), "{text}");
            assert!(text.contains("content-type: application/problem+json\r\n"));
            let problem = body_of(&out);
            assert_eq!(
                problem["type"],
                format!("https://plan-intake.dev/problems/{slug}")
            );
            assert_eq!(problem["status"].as_u64(), code[..3].parse::<u64>().ok());
            let (_, body) = text.split_once("\r\n\r\n").unwrap();
            assert!(text.contains(&format!("content-length: {}\r\n", body.len())));
        }
    }

    #[test]
    fn earlier_bytes_go_first_and_routes_answers_are_untouched() {
        let earlier = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}";
        let own = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n";
        let both = [&earlier[..], &own[..]].concat();
        assert_eq!(own_answer_at(&both), Some(earlier.len()));
        assert_eq!(own_answer_at(own), Some(0));
        assert!(
            rewrite(&both, 5000).is_none(),
            "only an answer alone is rewritten"
        );
        // A route's own 400 has a body and a type: not ours to touch.
        let route = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/problem+json\r\ncontent-length: 0\r\n\r\n";
        assert!(rewrite(route, 5000).is_none());
        let ok = b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n";
        assert!(rewrite(ok, 5000).is_none());
        assert!(
            rewrite(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\n",
                5000
            )
            .is_none()
        );
    }

    /// A socket that takes at most 7 bytes a call and is full every other
    /// call, driven as actix's dispatcher drives its writes.
    #[test]
    fn a_slow_socket_gets_every_byte_in_order() {
        use std::pin::Pin;
        use std::task::{Context, Poll};
        use tokio::io::AsyncWrite;

        #[derive(Default)]
        struct Trickle {
            out: Vec<u8>,
            calls: usize,
        }
        impl AsyncWrite for Trickle {
            fn poll_write(
                mut self: Pin<&mut Self>,
                _: &mut Context<'_>,
                buf: &[u8],
            ) -> Poll<std::io::Result<usize>> {
                self.calls += 1;
                if self.calls.is_multiple_of(2) {
                    return Poll::Pending;
                }
                let n = buf.len().min(7);
                self.out.extend_from_slice(&buf[..n]);
                Poll::Ready(Ok(n))
            }
            fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
                Poll::Ready(Ok(()))
            }
            fn poll_shutdown(
                self: Pin<&mut Self>,
                _: &mut Context<'_>,
            ) -> Poll<std::io::Result<()>> {
                Poll::Ready(Ok(()))
            }
        }

        let earlier = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}";
        let own = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";
        let buffer = [&earlier[..], &own[..]].concat();
        let mut stream = super::ProblemStream::new(Trickle::default(), 5000);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut written = 0;
        let mut polls = 0;
        while written < buffer.len() {
            polls += 1;
            assert!(polls < 10_000, "no progress");
            if let Poll::Ready(n) = Pin::new(&mut stream).poll_write(&mut cx, &buffer[written..]) {
                written += n.expect("written");
            }
        }
        let out = &stream.get_ref().out;
        assert!(
            out.starts_with(earlier),
            "the earlier answer first, untouched"
        );
        let expected = rewrite(own, 5000).expect("rewritten");
        assert_eq!(&out[earlier.len()..], &expected[..]);
        assert_eq!(body_of(&out[earlier.len()..])["status"], 431);
    }
}
