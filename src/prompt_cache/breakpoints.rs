//! Cache breakpoints for a Messages request that carries none: where they
//! go ([`place`]) and the body with them ([`mark`]). A pure function of the
//! request, so one conversation's requests get the same ones turn after
//! turn and each request's cached prefix is the one the previous request
//! wrote.
//!
//! At most three, of the provider's four:
//! 1. **head** — on the last block of the system prompt (else the last
//!    tool) when the tools and system prompt reach the model's minimum
//!    cacheable length;
//! 2. **end** — on the last block of the request when it continues a
//!    conversation (more than one message) or declares tools (an agent's
//!    first call), and the whole request reaches that minimum;
//! 3. **look-back** — on the last block before the newest assistant turn
//!    (where the previous request ended, and put its own end breakpoint)
//!    when more than [`LOOKBACK`] blocks follow it: the provider looks for
//!    a cached prefix at most that many blocks back from a breakpoint.
//!
//! A marker never goes on a thinking block or an empty text (the provider
//! refuses both): the one before it is taken.

use std::ops::Range;

use super::anatomy::{Anatomy, Block, Role};
use crate::config::CacheTtl;
use crate::transform::json::splice;

/// How many blocks before a breakpoint the provider looks for a prefix it
/// has cached.
pub const LOOKBACK: usize = 20;

/// Why a breakpoint is where it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    Head,
    End,
    LookBack,
}

impl Why {
    pub fn label(self) -> &'static str {
        match self {
            Why::Head => "head",
            Why::End => "end",
            Why::LookBack => "look-back",
        }
    }
}

/// A block to mark: element `element`, its block `block`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    pub element: usize,
    pub block: usize,
    pub why: Why,
}

/// Where visor's breakpoints go on `a` (a Messages request), for a model
/// that caches prefixes of at least `min_tokens`. Empty when the client set
/// its own, or nothing reaches the minimum.
pub fn place(a: &Anatomy, min_tokens: u64) -> Vec<Place> {
    if a.marked || a.elements.len() < 2 {
        return Vec::new();
    }
    let mut places = Vec::new();
    let head = &a.elements[0];
    if head.tokens >= min_tokens
        && let Some(block) = last_markable(&head.blocks)
    {
        places.push(Place {
            element: 0,
            block,
            why: Why::Head,
        });
    }
    let continues = a.elements.len() > 2 || a.tools > 0;
    if continues
        && let Some((element, block)) = last_markable_before(a, a.elements.len())
        && through(a, element, block) >= min_tokens
    {
        places.push(Place {
            element,
            block,
            why: Why::End,
        });
    }
    if let Some(p) = look_back(a, min_tokens) {
        places.push(p);
    }
    places.sort_by_key(|p| (p.element, p.block));
    places.dedup_by_key(|p| (p.element, p.block));
    places
}

/// The look-back breakpoint, when more than [`LOOKBACK`] blocks follow the
/// end of the previous request.
fn look_back(a: &Anatomy, min_tokens: u64) -> Option<Place> {
    let newest = (1..a.elements.len())
        .rev()
        .find(|&i| a.elements[i].role == Role::Assistant)?;
    let (element, block) = last_markable_before(a, newest)?;
    if element == 0 {
        return None;
    }
    let after = a.elements[element].blocks.len() - block - 1
        + a.elements[element + 1..]
            .iter()
            .map(|e| e.blocks.len())
            .sum::<usize>();
    (after > LOOKBACK && through(a, element, block) >= min_tokens).then_some(Place {
        element,
        block,
        why: Why::LookBack,
    })
}

/// The tokens of the prefix that ends with block `block` of element
/// `element`: what a marker there caches (the provider caches nothing
/// shorter than the minimum).
fn through(a: &Anatomy, element: usize, block: usize) -> u64 {
    let before: u64 = a.elements[..element].iter().map(|e| e.tokens).sum();
    let within: u64 = a.elements[element].blocks[..=block]
        .iter()
        .map(|b| b.tokens)
        .sum();
    before + within.min(a.elements[element].tokens)
}

fn last_markable(blocks: &[Block]) -> Option<usize> {
    blocks.iter().rposition(|b| b.kind.markable())
}

/// The last block that takes a marker in the messages before element
/// `end` (never in the head).
fn last_markable_before(a: &Anatomy, end: usize) -> Option<(usize, usize)> {
    (1..end)
        .rev()
        .find_map(|i| last_markable(&a.elements[i].blocks).map(|b| (i, b)))
}

/// The marker visor writes.
pub fn marker(ttl: CacheTtl) -> &'static str {
    match ttl {
        CacheTtl::FiveMinutes => r#""cache_control":{"type":"ephemeral"}"#,
        CacheTtl::OneHour => r#""cache_control":{"type":"ephemeral","ttl":"1h"}"#,
    }
}

/// `body` with a marker on each of `places` (every other byte as it
/// came): a block object gets the field before its closing brace; a string
/// standing for one text block becomes that block, marked.
pub fn mark(body: &[u8], a: &Anatomy, places: &[Place], ttl: CacheTtl) -> Vec<u8> {
    let marker = marker(ttl);
    let mut edits: Vec<(Range<usize>, Vec<u8>)> = places
        .iter()
        .filter_map(|p| {
            let b = &a.elements[p.element].blocks[p.block];
            let raw = &body[b.range.clone()];
            // Only an object or a string takes a marker (`place` chooses
            // no other).
            let fits = match b.string {
                true => raw.len() >= 2 && raw[0] == b'"',
                false => raw.len() >= 2 && raw[0] == b'{' && raw[raw.len() - 1] == b'}',
            };
            if !fits {
                return None;
            }
            Some(match b.string {
                true => {
                    let mut s = Vec::with_capacity(raw.len() + 64);
                    s.extend_from_slice(br#"[{"type":"text","text":"#);
                    s.extend_from_slice(raw);
                    s.push(b',');
                    s.extend_from_slice(marker.as_bytes());
                    s.extend_from_slice(b"}]");
                    (b.range.clone(), s)
                }
                false => {
                    let close = b.range.end - 1;
                    let empty = raw[1..raw.len() - 1]
                        .iter()
                        .all(|c| c.is_ascii_whitespace());
                    let mut s = Vec::with_capacity(marker.len() + 1);
                    if !empty {
                        s.push(b',');
                    }
                    s.extend_from_slice(marker.as_bytes());
                    (close..close, s)
                }
            })
        })
        .collect();
    edits.sort_by_key(|(r, _)| r.start);
    splice(body, &edits)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::Shape;

    fn anatomy(body: &str) -> Anatomy {
        Anatomy::of(Shape::Messages, body.as_bytes()).unwrap()
    }

    fn long(n: usize) -> String {
        "word ".repeat(n)
    }

    /// A tool loop: `turns` assistant tool calls answered by tool results,
    /// each result `result_words` words.
    fn tool_loop(turns: usize, result_words: usize) -> String {
        let mut msgs = vec![r#"{"role":"user","content":"fix the bug"}"#.to_owned()];
        for i in 0..turns {
            msgs.push(format!(
                r#"{{"role":"assistant","content":[{{"type":"text","text":"step {i}"}},{{"type":"tool_use","id":"t{i}","name":"sh","input":{{}}}}]}}"#
            ));
            msgs.push(format!(
                r#"{{"role":"user","content":[{{"type":"tool_result","tool_use_id":"t{i}","content":"{}"}}]}}"#,
                long(result_words)
            ));
        }
        format!(
            r#"{{"model":"claude","system":"{}","tools":[{{"name":"sh","input_schema":{{}}}}],"messages":[{}]}}"#,
            long(1000),
            msgs.join(",")
        )
    }

    #[test]
    fn a_tool_loop_gets_head_and_end() {
        let body = tool_loop(3, 300);
        let a = anatomy(&body);
        let p = place(&a, 1024);
        let whys: Vec<_> = p.iter().map(|p| p.why).collect();
        assert_eq!(whys, [Why::Head, Why::End]);
        assert_eq!(p[0].element, 0);
        assert_eq!(p[1].element, a.elements.len() - 1);
        let marked = mark(body.as_bytes(), &a, &p, CacheTtl::FiveMinutes);
        let v: serde_json::Value = serde_json::from_slice(&marked).expect("valid JSON");
        assert_eq!(v["system"][0]["type"], "text");
        assert_eq!(v["system"][0]["cache_control"]["type"], "ephemeral");
        let last = v["messages"].as_array().unwrap().last().unwrap();
        assert_eq!(last["content"][0]["cache_control"]["type"], "ephemeral");
        // Nothing else changed: the markers taken away, the messages are the
        // same (the system string became a block).
        let again = anatomy(std::str::from_utf8(&marked).unwrap());
        assert!(again.marked);
        assert_eq!(again.hashes()[1..], a.hashes()[1..]);
    }

    #[test]
    fn the_next_turn_keeps_the_prefix_and_its_breakpoint_is_where_the_last_ended() {
        let (a3, a4) = (anatomy(&tool_loop(3, 300)), anatomy(&tool_loop(4, 300)));
        let (p3, p4) = (place(&a3, 1024), place(&a4, 1024));
        assert_eq!(a4.hashes()[..a3.elements.len()], a3.hashes()[..]);
        // Turn 4 ends two messages later; its head is the same block.
        assert_eq!(p3[0], p4[0]);
        assert_eq!(p4[1].element, p3[1].element + 2);
    }

    #[test]
    fn a_short_request_gets_none() {
        let body = r#"{"system":"hi","tools":[{"name":"t"}],"messages":[{"role":"user","content":"hello"}]}"#;
        assert!(place(&anatomy(body), 1024).is_empty());
    }

    #[test]
    fn a_first_question_without_tools_is_not_marked_at_its_end() {
        let body = format!(
            r#"{{"system":"{}","messages":[{{"role":"user","content":"{}"}}]}}"#,
            long(1500),
            long(1500)
        );
        let p = place(&anatomy(&body), 1024);
        assert_eq!(p.iter().map(|p| p.why).collect::<Vec<_>>(), [Why::Head]);
    }

    #[test]
    fn the_clients_own_markers_leave_it_alone() {
        let body = tool_loop(3, 300).replacen(
            r#""name":"sh","input_schema":{}"#,
            r#""name":"sh","input_schema":{},"cache_control":{"type":"ephemeral"}"#,
            1,
        );
        assert!(place(&anatomy(&body), 1024).is_empty());
    }

    #[test]
    fn many_blocks_since_the_last_request_get_a_look_back() {
        // The previous request ended with the user's question; the newest
        // assistant turn called 25 tools at once.
        let calls: Vec<String> = (0..25)
            .map(|i| format!(r#"{{"type":"tool_use","id":"c{i}","name":"sh","input":{{}}}}"#))
            .collect();
        let results: Vec<String> = (0..25)
            .map(|i| format!(r#"{{"type":"tool_result","tool_use_id":"c{i}","content":"ok"}}"#))
            .collect();
        let body = format!(
            r#"{{"system":"{}","tools":[{{"name":"sh"}}],"messages":[{{"role":"user","content":"{}"}},{{"role":"assistant","content":[{}]}},{{"role":"user","content":[{}]}}]}}"#,
            long(1000),
            long(400),
            calls.join(","),
            results.join(",")
        );
        let a = anatomy(&body);
        let p = place(&a, 1024);
        let whys: Vec<_> = p.iter().map(|p| p.why).collect();
        assert_eq!(whys, [Why::Head, Why::LookBack, Why::End]);
        assert_eq!((p[1].element, p[1].block), (1, 0));
        let marked = mark(body.as_bytes(), &a, &p, CacheTtl::OneHour);
        let v: serde_json::Value = serde_json::from_slice(&marked).unwrap();
        assert_eq!(v["messages"][0]["content"][0]["cache_control"]["ttl"], "1h");
        assert_eq!(
            v["messages"][2]["content"][24]["cache_control"]["ttl"],
            "1h"
        );
        // Under the look-back, only head and end.
        let few = body.replace(&results[24], r#"{"type":"text","text":"x"}"#);
        assert!(place(&anatomy(&few), 1024).len() <= 3);
    }

    #[test]
    fn the_end_is_marked_only_where_the_prefix_it_ends_reaches_the_minimum() {
        // The request reaches 1024 tokens only with its last block, which
        // is a thinking block: the block before it ends a shorter prefix.
        let body = format!(
            r#"{{"tools":[{{"name":"t"}}],"messages":[{{"role":"user","content":"{}"}},{{"role":"assistant","content":[{{"type":"text","text":"a"}},{{"type":"thinking","thinking":"{}","signature":"s"}}]}}]}}"#,
            long(700),
            long(200)
        );
        let a = anatomy(&body);
        assert!(a.total_tokens() >= 1024);
        assert!(place(&a, 1024).is_empty());
        assert_eq!(place(&a, 512).len(), 1);
    }

    #[test]
    fn thinking_and_empty_text_are_passed_over() {
        let body = format!(
            r#"{{"system":"{}","tools":[{{"name":"t"}}],"messages":[{{"role":"user","content":"q"}},{{"role":"assistant","content":[{{"type":"text","text":"a"}},{{"type":"thinking","thinking":"x","signature":"s"}}]}},{{"role":"user","content":[{{"type":"text","text":"b"}},{{"type":"text","text":""}}]}}]}}"#,
            long(1200)
        );
        let a = anatomy(&body);
        let p = place(&a, 1024);
        let end = p.iter().find(|p| p.why == Why::End).unwrap();
        assert_eq!((end.element, end.block), (3, 0));
    }
}
