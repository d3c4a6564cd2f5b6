//! What is kept of a conversation's last request ([`Record`]) and how the
//! next one is judged against it ([`judge`], then [`settle`] once the
//! provider's `usage` is known): the tokens the provider could read from
//! its cache, and, when it reads less, the one cause.

use super::anatomy::Anatomy;
use super::breakpoints::{LOOKBACK, Place};

/// Why a request's cached prefix is shorter than it could be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// The conversation's first request (or the first visor has seen).
    First,
    /// The client changed (or dropped) a message it had sent before.
    Client,
    /// visor sent an earlier message differently than before.
    Visor,
    /// Longer than the cache's lifetime since the previous request.
    Expired,
    /// The prefix was stable and in time, and the provider read less.
    Provider,
}

impl Cause {
    pub const ALL: [Cause; 5] = [
        Cause::First,
        Cause::Client,
        Cause::Visor,
        Cause::Expired,
        Cause::Provider,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Cause::First => "first",
            Cause::Client => "client",
            Cause::Visor => "visor",
            Cause::Expired => "expired",
            Cause::Provider => "provider",
        }
    }
}

/// A breakpoint of a request: in element `element`, the `ordinal`-th block
/// of the request, with `tokens` up to and including that block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Point {
    pub element: u32,
    pub ordinal: u32,
    pub tokens: u64,
}

/// One request, as the next one of its conversation is compared with it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Record {
    /// Milliseconds since the Unix epoch.
    pub at_ms: u64,
    /// A hash of the model asked for (another model: another cache).
    pub model: u64,
    /// The client's elements (the body as visor received it, with a
    /// session's history when it has one).
    pub client: Vec<u64>,
    /// The elements sent: hash and tokens.
    pub sent: Vec<(u64, u32)>,
    /// The breakpoints sent (the client's or visor's).
    pub points: Vec<Point>,
    /// visor could change the body (the client did not send
    /// `x-visor-transform: off`): a request that turns that on or off is
    /// the client's change, whatever visor then sends.
    pub transformed: bool,
}

/// The breakpoints of `sent`: the blocks it marks, and `placed`.
pub fn points(sent: &Anatomy, placed: &[Place]) -> Vec<Point> {
    let mut out = Vec::new();
    let (mut ordinal, mut tokens) = (0u32, 0u64);
    for (i, e) in sent.elements.iter().enumerate() {
        let mut within = 0u64;
        for (j, b) in e.blocks.iter().enumerate() {
            within += b.tokens;
            if b.marked || placed.iter().any(|p| p.element == i && p.block == j) {
                out.push(Point {
                    element: i as u32,
                    ordinal,
                    tokens: tokens + within.min(e.tokens),
                });
            }
            ordinal += 1;
        }
        tokens += e.tokens;
    }
    out
}

impl Record {
    pub fn new(
        at_ms: u64,
        model: &str,
        client: &Anatomy,
        sent: &Anatomy,
        placed: &[Place],
        transformed: bool,
    ) -> Self {
        Record {
            transformed,
            at_ms,
            model: xxhash_rust::xxh3::xxh3_64(model.as_bytes()),
            client: client.hashes(),
            sent: sent
                .elements
                .iter()
                .map(|e| (e.hash, e.tokens.min(u32::MAX as u64) as u32))
                .collect(),
            points: points(sent, placed),
        }
    }

    pub fn total_tokens(&self) -> u64 {
        self.sent.iter().map(|&(_, t)| t as u64).sum()
    }

    /// The bytes kept in the store (little-endian, versioned: 2 ends with
    /// [`Record::transformed`]; 1, an earlier visor's, has it set).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(
            1 + 16 + 12 + self.client.len() * 8 + self.sent.len() * 12 + self.points.len() * 16 + 1,
        );
        b.push(2u8);
        b.extend_from_slice(&self.at_ms.to_le_bytes());
        b.extend_from_slice(&self.model.to_le_bytes());
        b.extend_from_slice(&(self.client.len() as u32).to_le_bytes());
        for h in &self.client {
            b.extend_from_slice(&h.to_le_bytes());
        }
        b.extend_from_slice(&(self.sent.len() as u32).to_le_bytes());
        for (h, t) in &self.sent {
            b.extend_from_slice(&h.to_le_bytes());
            b.extend_from_slice(&t.to_le_bytes());
        }
        b.extend_from_slice(&(self.points.len() as u32).to_le_bytes());
        for p in &self.points {
            b.extend_from_slice(&p.element.to_le_bytes());
            b.extend_from_slice(&p.ordinal.to_le_bytes());
            b.extend_from_slice(&p.tokens.to_le_bytes());
        }
        b.push(u8::from(self.transformed));
        b
    }

    /// `None` for bytes [`Record::encode`] did not write.
    pub fn decode(b: &[u8]) -> Option<Record> {
        let mut r = Reader(b);
        let version = r.take(1)?[0];
        if !matches!(version, 1 | 2) {
            return None;
        }
        let at_ms = r.u64()?;
        let model = r.u64()?;
        let n = r.count(8)?;
        let client = (0..n).map(|_| r.u64()).collect::<Option<_>>()?;
        let n = r.count(12)?;
        let sent = (0..n)
            .map(|_| Some((r.u64()?, r.u32()?)))
            .collect::<Option<_>>()?;
        let n = r.count(16)?;
        let points = (0..n)
            .map(|_| {
                Some(Point {
                    element: r.u32()?,
                    ordinal: r.u32()?,
                    tokens: r.u64()?,
                })
            })
            .collect::<Option<_>>()?;
        let transformed = match version {
            1 => true,
            _ => r.take(1)? != [0],
        };
        r.0.is_empty().then_some(Record {
            transformed,
            at_ms,
            model,
            client,
            sent,
            points,
        })
    }

    /// Bytes it holds in memory, about.
    pub fn weight(&self) -> usize {
        64 + self.client.len() * 8 + self.sent.len() * 16 + self.points.len() * 16
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(head)
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    /// A count of items of `size` bytes, no more than the bytes left hold.
    fn count(&mut self, size: usize) -> Option<usize> {
        let n = self.u32()? as usize;
        (n.checked_mul(size)? <= self.0.len()).then_some(n)
    }
}

/// How a provider reads its cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reads {
    /// Up to a breakpoint whose prefix an earlier request wrote, looked for
    /// at most [`LOOKBACK`] blocks back from each breakpoint (Anthropic).
    AtBreakpoints,
    /// Any prefix it saw, in steps of 128 tokens (OpenAI kind).
    Automatically,
}

/// What the judging knows besides the two requests.
#[derive(Debug, Clone, Copy)]
pub struct Judging {
    pub reads: Reads,
    /// The shortest prefix the provider caches.
    pub min_tokens: u64,
    /// How long a prefix stays cached after a request.
    pub expire_after_ms: u64,
}

/// What is known before the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Verdict {
    /// Tokens the provider could read (estimated).
    pub readable: u64,
    pub cause: Option<Cause>,
    /// For `client` and `visor`: the first element that differs.
    pub at: Option<usize>,
}

/// `now` against the previous request of its conversation.
pub fn judge(prev: Option<&Record>, now: &Record, j: Judging) -> Verdict {
    let Some(prev) = prev else {
        return Verdict {
            readable: 0,
            cause: Some(Cause::First),
            at: None,
        };
    };
    let client = match prev.model == now.model {
        true => common(&prev.client, &now.client),
        false => 0,
    };
    let sent = match prev.model == now.model {
        true => common_by(&prev.sent, &now.sent, |a, b| a.0 == b.0),
        false => 0,
    };
    let readable = readable(prev, now, sent, j);
    let (cause, at) = if sent < client.min(prev.sent.len()) {
        // Another body for the same messages: visor's doing, unless the
        // client turned visor's changes on or off between the two.
        match prev.transformed == now.transformed {
            true => (Some(Cause::Visor), Some(sent)),
            false => (Some(Cause::Client), Some(sent)),
        }
    } else if client < prev.client.len() {
        (Some(Cause::Client), Some(client))
    } else if now.at_ms.saturating_sub(prev.at_ms) > j.expire_after_ms {
        (Some(Cause::Expired), None)
    } else {
        (None, None)
    };
    Verdict {
        readable,
        cause,
        at,
    }
}

fn common(a: &[u64], b: &[u64]) -> usize {
    common_by(a, b, |x, y| x == y)
}

fn common_by<T>(a: &[T], b: &[T], eq: impl Fn(&T, &T) -> bool) -> usize {
    a.iter().zip(b).take_while(|(x, y)| eq(x, y)).count()
}

/// Tokens of the prefix `now` shares with `prev` (its first `stable`
/// elements) that the provider could read.
fn readable(prev: &Record, now: &Record, stable: usize, j: Judging) -> u64 {
    match j.reads {
        Reads::AtBreakpoints => prev
            .points
            .iter()
            .filter(|p| (p.element as usize) < stable && p.tokens >= j.min_tokens)
            .filter(|p| {
                now.points
                    .iter()
                    .any(|b| b.ordinal >= p.ordinal && b.ordinal - p.ordinal <= LOOKBACK as u32)
            })
            .map(|p| p.tokens)
            .max()
            .unwrap_or(0),
        Reads::Automatically => {
            let t: u64 = now.sent[..stable].iter().map(|&(_, t)| t as u64).sum();
            match t >= j.min_tokens {
                true => j.min_tokens + (t - j.min_tokens) / 128 * 128,
                false => 0,
            }
        }
    }
}

/// What the provider's `usage` said of a request's prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Said {
    /// Prompt tokens in all (read, written and the rest).
    pub prompt: u64,
    pub read: u64,
    pub written: u64,
}

/// The end of the judging, once the provider said what it read: the
/// readable tokens scaled by the provider's own count of the prompt
/// against visor's estimate (`estimated`), and the `provider` cause when
/// it read less than four fifths of them with no other cause (an
/// `expired` it did not fall short of is no miss: the cache lived
/// longer).
pub fn settle(v: Verdict, estimated: u64, said: Said) -> (u64, Option<Cause>) {
    let scale = match (estimated, said.prompt) {
        (0, _) | (_, 0) => 1.0,
        (e, p) => (p as f64 / e as f64).clamp(0.25, 4.0),
    };
    let readable = ((v.readable as f64 * scale).round() as u64).min(said.prompt.max(v.readable));
    let short = readable > 0 && said.read * 5 < readable * 4;
    let cause = match v.cause {
        // The cache outlived the lifetime visor took it to have.
        Some(Cause::Expired) if !short => None,
        Some(c) => Some(c),
        None if short => Some(Cause::Provider),
        None => None,
    };
    (readable, cause)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(at_ms: u64, client: &[u64], sent: &[(u64, u32)], points: &[(u32, u32, u64)]) -> Record {
        Record {
            transformed: true,
            at_ms,
            model: 7,
            client: client.to_vec(),
            sent: sent.to_vec(),
            points: points
                .iter()
                .map(|&(element, ordinal, tokens)| Point {
                    element,
                    ordinal,
                    tokens,
                })
                .collect(),
        }
    }

    const AT: Judging = Judging {
        reads: Reads::AtBreakpoints,
        min_tokens: 1024,
        expire_after_ms: 300_000,
    };

    #[test]
    fn the_first_request_is_first() {
        let now = rec(0, &[1, 2], &[(1, 2000), (2, 10)], &[]);
        let v = judge(None, &now, AT);
        assert_eq!((v.readable, v.cause), (0, Some(Cause::First)));
    }

    #[test]
    fn an_appended_turn_reads_up_to_the_previous_breakpoint() {
        let prev = rec(
            0,
            &[1, 2],
            &[(1, 2000), (2, 500)],
            &[(0, 0, 2000), (1, 1, 2500)],
        );
        let now = rec(
            1000,
            &[1, 2, 3, 4],
            &[(1, 2000), (2, 500), (3, 50), (4, 50)],
            &[(0, 0, 2000), (3, 3, 2600)],
        );
        let v = judge(Some(&prev), &now, AT);
        assert_eq!(
            v,
            Verdict {
                readable: 2500,
                cause: None,
                at: None
            }
        );
        // Past the look-back window, only the head is found.
        let far = rec(
            1000,
            &[1, 2, 3, 4],
            &[(1, 2000), (2, 500), (3, 50), (4, 50)],
            &[(0, 0, 2000), (3, 30, 2600)],
        );
        assert_eq!(judge(Some(&prev), &far, AT).readable, 2000);
        // Read automatically: the stable prefix in steps of 128.
        let auto = Judging {
            reads: Reads::Automatically,
            ..AT
        };
        assert_eq!(judge(Some(&prev), &now, auto).readable, 1024 + 1408);
    }

    #[test]
    fn a_change_is_the_clients_or_visors_whichever_came_first() {
        let prev = rec(
            0,
            &[1, 2, 3],
            &[(1, 2000), (2, 10), (3, 10)],
            &[(0, 0, 2000)],
        );
        let client = rec(
            1,
            &[9, 2, 3, 4],
            &[(9, 2000), (2, 10), (3, 10), (4, 1)],
            &[(0, 0, 2000)],
        );
        let v = judge(Some(&prev), &client, AT);
        assert_eq!(
            (v.cause, v.at, v.readable),
            (Some(Cause::Client), Some(0), 0)
        );
        let visor = rec(
            1,
            &[1, 2, 3, 4],
            &[(1, 2000), (8, 10), (3, 10), (4, 1)],
            &[(0, 0, 2000)],
        );
        let v = judge(Some(&prev), &visor, AT);
        assert_eq!(
            (v.cause, v.at, v.readable),
            (Some(Cause::Visor), Some(1), 2000)
        );
        // visor rewriting what the client changed anyway is the client's.
        let both = rec(
            1,
            &[1, 7, 3, 4],
            &[(1, 2000), (8, 10), (3, 10), (4, 1)],
            &[(0, 0, 2000)],
        );
        assert_eq!(judge(Some(&prev), &both, AT).cause, Some(Cause::Client));
        // The client turning visor's changes off (or on again) between
        // the two: its own change, where the bodies part.
        let mut toggled = visor.clone();
        toggled.transformed = false;
        let v = judge(Some(&prev), &toggled, AT);
        assert_eq!((v.cause, v.at), (Some(Cause::Client), Some(1)));
        let mut off_before = prev.clone();
        off_before.transformed = false;
        assert_eq!(
            judge(Some(&off_before), &visor, AT).cause,
            Some(Cause::Client)
        );
        // The same bodies either way: no miss at all.
        assert_eq!(judge(Some(&toggled), &visor, AT).cause, None);
        let mut other_model = client.clone();
        other_model.client = prev.client.clone();
        other_model.model = 8;
        assert_eq!(judge(Some(&prev), &other_model, AT).at, Some(0));
    }

    #[test]
    fn late_is_expired_and_a_short_read_is_the_providers() {
        let prev = rec(0, &[1], &[(1, 4000)], &[(0, 0, 4000)]);
        let now = rec(300_001, &[1, 2], &[(1, 4000), (2, 10)], &[(0, 0, 4000)]);
        assert_eq!(judge(Some(&prev), &now, AT).cause, Some(Cause::Expired));
        let soon = rec(1000, &[1, 2], &[(1, 4000), (2, 10)], &[(0, 0, 4000)]);
        let v = judge(Some(&prev), &soon, AT);
        assert_eq!(v.cause, None);
        // The provider counts the prompt 10 % higher than visor's estimate.
        let said = |read| Said {
            prompt: 4411,
            read,
            written: 0,
        };
        assert_eq!(settle(v, 4010, said(4400)), (4400, None));
        assert_eq!(settle(v, 4010, said(0)), (4400, Some(Cause::Provider)));
        // A cause known before the answer stays the cause, but `expired`
        // only when the provider did read less.
        let late = judge(Some(&prev), &now, AT);
        assert_eq!(settle(late, 4010, said(0)).1, Some(Cause::Expired));
        assert_eq!(settle(late, 4010, said(4400)).1, None);
    }

    #[test]
    fn a_record_survives_the_store_and_bad_bytes_do_not() {
        let r = rec(42, &[1, 2], &[(1, 2000), (2, 3)], &[(0, 0, 2000)]);
        let bytes = r.encode();
        assert_eq!(Record::decode(&bytes), Some(r.clone()));
        assert_eq!(Record::decode(&bytes[..bytes.len() - 1]), None);
        let off = Record {
            transformed: false,
            ..r.clone()
        };
        assert_eq!(Record::decode(&off.encode()), Some(off));
        // An earlier visor's record (version 1, no flag): visor could
        // change its body.
        let mut v1 = bytes[..bytes.len() - 1].to_vec();
        v1[0] = 1;
        assert_eq!(Record::decode(&v1), Some(r));
        let mut v3 = bytes.clone();
        v3[0] = 3;
        assert_eq!(Record::decode(&v3), None);
        assert_eq!(Record::decode(b""), None);
        let mut huge = vec![1u8];
        huge.extend_from_slice(&[0; 16]);
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(Record::decode(&huge), None);
    }
}
