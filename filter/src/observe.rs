//! Finding the Responses API response id in an upstream answer, looking only
//! at a bounded prefix of the body.
//!
//! - Non-streaming JSON: vLLM serializes `id` first, so the id is read from
//!   the first chunk (`{"id":"resp_…"`); otherwise the whole body is parsed
//!   if it ends within the bound.
//! - Server-sent events: the `response.created` event (the first one) carries
//!   `response.id`.

use serde_json::Value;

/// What a scan found so far.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Scan {
    /// The response id.
    Found(String),
    /// Not yet: feed the next chunk.
    NeedMore,
    /// Not within the bound, or the body has no id.
    GiveUp,
}

/// Scans response chunks for the response id.
#[derive(Clone, Debug)]
pub struct IdScanner {
    buf: Vec<u8>,
    cap: usize,
    sse: bool,
    /// SSE: bytes of `buf` already split into complete events.
    consumed: usize,
    /// SSE: bytes of `buf` known to hold no event separator that ends
    /// after `consumed` (a separator may still begin in its last 3 bytes):
    /// each byte is searched a bounded number of times, however the body is
    /// chunked.
    searched: usize,
}

impl IdScanner {
    /// A scanner over at most `cap` bytes of an SSE (`sse`) or JSON body.
    pub fn new(cap: usize, sse: bool) -> Self {
        Self {
            buf: Vec::new(),
            cap,
            sse,
            consumed: 0,
            searched: 0,
        }
    }

    /// Feeds one chunk; `end` when it is the body's last.
    pub fn push(&mut self, chunk: &[u8], end: bool) -> Scan {
        let room = self.cap.saturating_sub(self.buf.len());
        let truncated = chunk.len() > room;
        self.buf
            .extend_from_slice(chunk.get(..room.min(chunk.len())).unwrap_or_default());
        let scan = if self.sse {
            self.scan_sse(end && !truncated)
        } else {
            self.scan_json(end && !truncated)
        };
        match scan {
            Scan::NeedMore if end || truncated || self.buf.len() >= self.cap => Scan::GiveUp,
            other => other,
        }
    }

    fn scan_json(&self, complete: bool) -> Scan {
        if let Some(id) = leading_id(&self.buf) {
            return Scan::Found(id);
        }
        if !complete {
            return Scan::NeedMore;
        }
        match serde_json::from_slice::<Value>(&self.buf) {
            Ok(Value::Object(map)) => match map.get("id") {
                Some(Value::String(id)) if !id.is_empty() => Scan::Found(id.clone()),
                _ => Scan::GiveUp,
            },
            _ => Scan::GiveUp,
        }
    }

    fn scan_sse(&mut self, complete: bool) -> Scan {
        loop {
            let rest = self.buf.get(self.consumed..).unwrap_or_default();
            // Resume the search where the last one stopped, backing up over
            // a separator that may have been cut by the chunk boundary.
            let from = self
                .searched
                .saturating_sub(3)
                .max(self.consumed)
                .saturating_sub(self.consumed);
            let found = event_end(rest.get(from..).unwrap_or_default())
                .map(|(len, sep)| (len.saturating_add(from), sep));
            let (event, used) = match found {
                Some((len, sep)) => (rest.get(..len).unwrap_or_default(), len.saturating_add(sep)),
                None if complete && !rest.is_empty() => (rest, rest.len()),
                None => {
                    self.searched = self.buf.len();
                    return Scan::NeedMore;
                }
            };
            let found = created_id(event);
            self.consumed = self.consumed.saturating_add(used);
            if let Some(id) = found {
                return Scan::Found(id);
            }
            if self.consumed >= self.buf.len() {
                return Scan::NeedMore;
            }
        }
    }
}

/// The length of the first complete SSE event in `buf` and of its separator.
fn event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = find(buf, b"\n\n").map(|i| (i, 2));
    let crlf = find(buf, b"\r\n\r\n").map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// `response.id` of a `response.created` event.
fn created_id(event: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(event).ok()?;
    let data: String = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.strip_prefix(' ').unwrap_or(d))
        .collect::<Vec<_>>()
        .join("\n");
    let value: Value = serde_json::from_str(&data).ok()?;
    if value.get("type").and_then(Value::as_str) != Some("response.created") {
        return None;
    }
    let id = value.get("response")?.get("id")?.as_str()?;
    (!id.is_empty()).then(|| id.to_owned())
}

/// `{"id":"…"` at the very start of a JSON body (whitespace allowed).
fn leading_id(buf: &[u8]) -> Option<String> {
    let text = skip_ws(buf);
    let text = skip_ws(text.strip_prefix(b"{")?);
    let text = skip_ws(text.strip_prefix(b"\"id\"")?);
    let text = skip_ws(text.strip_prefix(b":")?);
    let text = text.strip_prefix(b"\"")?;
    let end = text.iter().position(|b| *b == b'"')?;
    let id = text.get(..end)?;
    if id.is_empty() || id.contains(&b'\\') {
        return None;
    }
    String::from_utf8(id.to_vec()).ok()
}

fn skip_ws(bytes: &[u8]) -> &[u8] {
    let start = bytes
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(bytes.len());
    bytes.get(start..).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_id_from_first_chunk() {
        let mut s = IdScanner::new(1024, false);
        assert_eq!(s.push(b"{\"id\":\"resp_", false), Scan::NeedMore);
        assert_eq!(
            s.push(b"abc\",\"object\":\"response\"", false),
            Scan::Found("resp_abc".into())
        );
    }

    #[test]
    fn json_id_not_first_needs_whole_body() {
        let body = br#"{"object":"response","output":[{"id":"msg_1"}],"id":"resp_9"}"#;
        let mut s = IdScanner::new(1024, false);
        assert_eq!(s.push(&body[..20], false), Scan::NeedMore);
        assert_eq!(s.push(&body[20..], true), Scan::Found("resp_9".into()));
        let mut small = IdScanner::new(10, false);
        assert_eq!(small.push(body, true), Scan::GiveUp);
        let mut bad = IdScanner::new(1024, false);
        assert_eq!(bad.push(b"\xff\xfe not json", true), Scan::GiveUp);
        let mut err = IdScanner::new(1024, false);
        assert_eq!(
            err.push(br#"{"error":{"message":"x"}}"#, true),
            Scan::GiveUp
        );
    }

    #[test]
    fn sse_created_event_split_across_chunks() {
        let stream = "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_s\",\"status\":\"in_progress\"}}\n\nevent: response.in_progress\ndata: {}\n\n";
        for cut in 1..stream.len() {
            let mut s = IdScanner::new(4096, true);
            let (a, b) = stream.as_bytes().split_at(cut);
            let first = s.push(a, false);
            let result = if first == Scan::NeedMore {
                s.push(b, false)
            } else {
                first
            };
            assert_eq!(result, Scan::Found("resp_s".into()), "cut at {cut}");
        }
    }

    #[test]
    fn sse_fed_byte_by_byte_with_either_separator() {
        for sep in ["\n\n", "\r\n\r\n"] {
            let filler = "x".repeat(3000);
            let stream = format!(
                "event: ping{sep}data: {filler}{sep}event: response.created{sep_line}data: {{\"type\":\"response.created\",\"response\":{{\"id\":\"resp_b\"}}}}{sep}",
                sep_line = &sep[..sep.len() / 2],
            );
            let mut s = IdScanner::new(64 * 1024, true);
            let mut found = None;
            for (i, b) in stream.as_bytes().iter().enumerate() {
                match s.push(&[*b], i + 1 == stream.len()) {
                    Scan::NeedMore => {}
                    other => {
                        found = Some(other);
                        break;
                    }
                }
                // Every byte already searched stays searched.
                assert!(s.searched >= s.buf.len().saturating_sub(1) || s.consumed == s.buf.len());
            }
            assert_eq!(found, Some(Scan::Found("resp_b".into())), "{sep:?}");
        }
    }

    #[test]
    fn sse_without_created_gives_up_at_end_or_bound() {
        let mut s = IdScanner::new(4096, true);
        assert_eq!(
            s.push(b"data: {\"type\":\"other\"}\n\n", false),
            Scan::NeedMore
        );
        assert_eq!(s.push(b"data: [DONE]\n\n", true), Scan::GiveUp);
        let mut bounded = IdScanner::new(8, true);
        assert_eq!(
            bounded.push(b"data: {\"type\":\"response.created\"}", false),
            Scan::GiveUp
        );
        let mut crlf = IdScanner::new(4096, true);
        assert_eq!(
            crlf.push(
                b"data: {\"type\":\"response.created\",\"response\":{\"id\":\"r\"}}\r\n\r\n",
                false
            ),
            Scan::Found("r".into())
        );
    }
}
