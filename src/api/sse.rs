//! The one SSE line framer: the lines of an event stream as they complete,
//! across the chunks they arrive in. A line is passed to the caller without
//! its `\n` (and `\r`); only the unfinished last line of a chunk is copied,
//! to wait for the next one.

/// Lines of an event stream, framed across chunks.
#[derive(Debug, Default)]
pub struct Lines {
    /// The unfinished last line so far.
    partial: Vec<u8>,
    /// A line longer than this is dropped (its start, and what of it had
    /// come); `None`: no bound.
    max_line: Option<usize>,
}

impl Lines {
    /// A framer that holds an unfinished line of any length.
    pub fn new() -> Self {
        Self::default()
    }

    /// A framer that drops a line longer than `max_line` bytes.
    pub fn bounded(max_line: usize) -> Self {
        Lines {
            partial: Vec::new(),
            max_line: Some(max_line),
        }
    }

    /// Calls `line` with each line `chunk` completes, in order.
    #[inline]
    pub fn feed(&mut self, chunk: &[u8], mut line: impl FnMut(&[u8])) {
        let mut rest = chunk;
        while let Some(nl) = memchr::memchr(b'\n', rest) {
            if self.partial.is_empty() {
                line(without_cr(&rest[..nl]));
            } else {
                self.partial.extend_from_slice(&rest[..nl]);
                line(without_cr(&self.partial));
                self.partial.clear();
            }
            rest = &rest[nl + 1..];
        }
        if rest.is_empty() {
            return;
        }
        match self.max_line {
            Some(max) if self.partial.len() + rest.len() > max => self.partial.clear(),
            _ => self.partial.extend_from_slice(rest),
        }
    }

    /// The unfinished last line, at the end of the stream (empty when the
    /// stream ended with a newline).
    pub fn finish(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.partial)
    }
}

/// The payload of a `data:` line (as sent: the space after the colon kept);
/// `None` for any other line.
pub fn data(line: &[u8]) -> Option<&[u8]> {
    line.strip_prefix(b"data:")
}

#[inline]
fn without_cr(line: &[u8]) -> &[u8] {
    line.strip_suffix(b"\r").unwrap_or(line)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn framed(lines: &mut Lines, chunks: &[&[u8]]) -> Vec<String> {
        let mut out = Vec::new();
        for c in chunks {
            lines.feed(c, |l| out.push(String::from_utf8_lossy(l).into_owned()));
        }
        out
    }

    #[test]
    fn a_line_split_anywhere_is_one_line() {
        let stream = b"event: x\r\ndata: {\"a\":1}\n\ndata: [DONE]\n";
        let whole = framed(&mut Lines::new(), &[stream]);
        assert_eq!(whole, ["event: x", "data: {\"a\":1}", "", "data: [DONE]"]);
        for at in 0..stream.len() {
            let (a, b) = stream.split_at(at);
            assert_eq!(framed(&mut Lines::new(), &[a, b]), whole, "split at {at}");
        }
        let bytes: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(framed(&mut Lines::new(), &bytes), whole);
    }

    #[test]
    fn the_unfinished_last_line_waits_for_the_end() {
        let mut lines = Lines::new();
        assert_eq!(framed(&mut lines, &[b"data: 1\ndata: 2"]), ["data: 1"]);
        assert_eq!(lines.finish(), b"data: 2");
        assert!(lines.finish().is_empty());
    }

    #[test]
    fn a_bounded_framer_drops_a_line_too_long() {
        let mut lines = Lines::bounded(8);
        let got = framed(&mut lines, &[b"data: 0123456789", b"abc\ndata: ok\n"]);
        // The long line's start is dropped; its tail is a line of its own,
        // which no reader takes for data.
        assert_eq!(got, ["abc", "data: ok"]);
        assert_eq!(data(b"data: ok"), Some(&b" ok"[..]));
        assert_eq!(data(b"abc"), None);
    }
}
