//! The image rules: what becomes of each image ([`decide`]) — kept, or
//! replaced because the model cannot see, it aged out, it is over the
//! request's cap, or a later copy refers to it — and, for a model with a
//! prompt cache, whether rewriting an earlier message pays at all.

use std::collections::HashMap;

use super::placeholder::Reason;
use super::walk::{self, Medium, Role};
use super::{Plan, Shape};

/// What becomes of one image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    Kept,
    Replaced(Reason),
}

/// Estimated tokens of an image a vision model is sent, and of the text
/// that replaces one; text is counted at 4 bytes a token. Only used to
/// decide whether rewriting an earlier message pays.
const IMAGE_TOKENS: usize = 765;
const REPLACED_TOKENS: usize = 40;
const BYTES_PER_TOKEN: usize = 4;
/// Cached input costs a tenth of fresh input.
const CACHED_DIVISOR: usize = 10;
/// Requests replayed × (images + messages) beyond which only the last
/// request is replayed.
const REPLAY_BUDGET: usize = 1 << 24;

/// What becomes of each image. The request is read as the conversation
/// that produced it: each prefix that ends where an assistant turn starts
/// is a request the client sent before. Replaying them in order, at each
/// one, in the SPEC's order: (1) a tool-result image with more than
/// `keep_turns` assistant turns after it is due to age out; (2) a new copy
/// of a kept image becomes a reference to it; (3) only the newest
/// `max_images` kept images should stay (older tool images go first, then
/// older user images).
///
/// An image that arrives in this step is replaced at once (it was never
/// sent, so nothing cached changes). An image an earlier request already
/// sent is replaced only when that pays now: when the messages from it to
/// the end of the previous request, rewritten, cost less at full price
/// than they cost unchanged and cached (a tenth). Then every image due is
/// replaced in that one step, and every later request is cheaper too, so
/// billed cost never goes up. The model's own `max_images` is a hard limit
/// (a provider refuses more): when an earlier image must go for it, the
/// oldest go until half of it are left, so the next break comes
/// `max_images / 2` images later. For a model that cannot see, every image
/// still kept is then replaced (its text never changes afterwards).
pub fn decide(scan: &walk::Scan, body: &[u8], plan: &Plan) -> Vec<Fate> {
    let mut replay = Replay::new(scan, body, plan);
    let mut ends = request_ends(&scan.items, plan.shape);
    // A conversation of thousands of turns and thousands of images would
    // make the replay quadratic: past a budget only the last request is
    // replayed (the rules still apply; only the prefix guarantee is given
    // up, for such requests).
    let mut prev_end = 0;
    if ends
        .len()
        .saturating_mul(scan.images.len() + scan.items.len())
        > REPLAY_BUDGET
    {
        // Everything before the last request counts as sent before.
        prev_end = ends
            .len()
            .checked_sub(2)
            .and_then(|k| ends.get(k))
            .copied()
            .unwrap_or(0);
        ends = vec![scan.items.len()];
    }
    for end in ends {
        replay.step(prev_end, end);
        prev_end = end;
    }
    let mut fates = replay.fates;
    if !plan.vision {
        for (fate, f) in fates.iter_mut().zip(&scan.images) {
            if *fate == Fate::Kept && f.medium == Medium::Image {
                *fate = Fate::Replaced(Reason::NonVision);
            }
        }
    }
    media_fates(scan, body, plan, &mut fates);
    fates
}

/// Documents and audio the model does not take are replaced; a later copy
/// of one becomes a reference to the first (its text is long). The image
/// rules (ageing, the cap) never touch them.
fn media_fates(scan: &walk::Scan, body: &[u8], plan: &Plan, fates: &mut [Fate]) {
    let mut seen: Vec<usize> = Vec::new();
    for (i, f) in scan.images.iter().enumerate() {
        if f.medium == Medium::Image || plan.takes.medium(&f.medium) {
            continue;
        }
        let id = scan.identity(i, body);
        let first = id.and_then(|id| {
            seen.iter()
                .copied()
                // The same bytes under another file name are the same
                // document.
                .find(|&j| {
                    std::mem::discriminant(&scan.images[j].medium)
                        == std::mem::discriminant(&f.medium)
                        && scan.identity(j, body) == Some(id)
                })
        });
        fates[i] = match first {
            Some(_) => Fate::Replaced(Reason::Deduped),
            None => {
                seen.push(i);
                Fate::Replaced(Reason::CannotTake)
            }
        };
    }
}

/// Where each assistant turn starts (assistant messages; for Responses a
/// run of items the model produced is one turn), then the end.
fn turn_starts(items: &[walk::Item], shape: Shape) -> Vec<usize> {
    let assistant = |k: usize| items.get(k).is_some_and(|it| it.role == Role::Assistant);
    (0..items.len())
        .filter(|&i| assistant(i) && (shape != Shape::Responses || i == 0 || !assistant(i - 1)))
        .collect()
}

/// The ends of the requests the conversation sent, this one last.
fn request_ends(items: &[walk::Item], shape: Shape) -> Vec<usize> {
    let mut ends: Vec<usize> = turn_starts(items, shape)
        .into_iter()
        .filter(|&i| i > 0)
        .collect();
    ends.push(items.len());
    ends
}

struct Replay<'a> {
    scan: &'a walk::Scan,
    body: &'a [u8],
    plan: &'a Plan,
    fates: Vec<Fate>,
    /// `starts_before[k]`: assistant turns starting before message `k`.
    starts_before: Vec<usize>,
    /// Tokens of each message's text (its images aside).
    text_tokens: Vec<usize>,
    /// The images of each message.
    images_of: Vec<Vec<usize>>,
    /// Images seen so far, kept or not, by the length of their identity.
    by_len: HashMap<usize, Vec<usize>>,
    /// The images a step wants to replace (cleared at its end).
    marked: Vec<bool>,
    /// Images a later copy refers to: they never age out.
    pinned: Vec<bool>,
}

impl<'a> Replay<'a> {
    fn new(scan: &'a walk::Scan, body: &'a [u8], plan: &'a Plan) -> Self {
        let n = scan.items.len();
        let mut starts_before = vec![0; n + 1];
        let starts = turn_starts(&scan.items, plan.shape);
        for k in 0..n {
            starts_before[k + 1] = starts_before[k] + usize::from(starts.binary_search(&k).is_ok());
        }
        let mut images_of = vec![Vec::new(); n];
        let mut image_bytes = vec![0; n];
        for (i, f) in scan.images.iter().enumerate() {
            if let Some(list) = images_of.get_mut(f.message) {
                // Documents and audio are replaced the turn they arrive:
                // their bytes count for nothing here.
                if f.medium == Medium::Image {
                    list.push(i);
                }
                image_bytes[f.message] += scan.image_len(i);
            }
        }
        let text_tokens = scan
            .items
            .iter()
            .zip(&image_bytes)
            .map(|(it, img)| it.bytes.saturating_sub(*img) / BYTES_PER_TOKEN)
            .collect();
        Replay {
            scan,
            body,
            plan,
            fates: vec![Fate::Kept; scan.images.len()],
            starts_before,
            text_tokens,
            images_of,
            by_len: HashMap::new(),
            marked: vec![false; scan.images.len()],
            pinned: vec![false; scan.images.len()],
        }
    }

    /// The request that ends at message `end`, after the one that ended at
    /// `prev_end`.
    fn step(&mut self, prev_end: usize, end: usize) {
        let rules = self.plan.rules;
        let in_scope: Vec<usize> = (0..self.scan.images.len())
            .filter(|&i| {
                let f = &self.scan.images[i];
                f.message < end && f.medium == Medium::Image
            })
            .collect();
        let is_new = |i: usize, s: &Self| s.scan.images[i].message >= prev_end;
        if rules.dedupe {
            for &i in &in_scope {
                if is_new(i, self) && self.fates[i] == Fate::Kept {
                    self.dedupe(i);
                }
            }
        }
        let mut wanted: Vec<(usize, Reason)> = Vec::new();
        for &i in &in_scope {
            let f = &self.scan.images[i];
            let after = self.starts_before[end] - self.starts_before[f.message + 1];
            // An image a later copy refers to stays (the copy's text says
            // "the same image as earlier").
            if self.fates[i] == Fate::Kept
                && f.in_tool_result
                && after > rules.keep_turns
                && !self.pinned[i]
            {
                wanted.push((i, Reason::AgedOut));
            }
        }
        // `marked[i]`: image i is wanted (reset before returning).
        for &(i, _) in &wanted {
            self.marked[i] = true;
        }
        let kept = |s: &Self, skip_marked: bool| -> Vec<usize> {
            in_scope
                .iter()
                .copied()
                .filter(|&i| s.fates[i] == Fate::Kept && !(skip_marked && s.marked[i]))
                .collect()
        };
        let order = |s: &Self, ks: Vec<usize>| -> Vec<usize> {
            let tool = ks
                .iter()
                .copied()
                .filter(|&i| s.scan.images[i].in_tool_result);
            let user = ks
                .iter()
                .copied()
                .filter(|&i| !s.scan.images[i].in_tool_result);
            tool.chain(user).collect()
        };
        let remaining = kept(self, true);
        let excess = remaining.len().saturating_sub(rules.max_images);
        for i in order(self, remaining).into_iter().take(excess) {
            wanted.push((i, Reason::Capped));
            self.marked[i] = true;
        }
        // New images go at once; earlier ones only when it pays, or for the
        // model's hard limit.
        let (fresh, earlier): (Vec<_>, Vec<_>) =
            wanted.into_iter().partition(|w| is_new(w.0, self));
        for &(i, reason) in &fresh {
            self.fates[i] = Fate::Replaced(reason);
            self.marked[i] = false;
        }
        let vision = self.plan.vision;
        let over_hard = rules
            .hard_max_images
            .filter(|_| vision && !earlier.is_empty())
            .filter(|&hard| kept(self, false).len() > hard);
        if let Some(hard) = over_hard {
            let target = (hard / 2).max(1);
            let remaining = kept(self, true);
            for &(i, reason) in &earlier {
                self.fates[i] = Fate::Replaced(reason);
            }
            // Down to half the limit, taking only images already sent: the
            // new ones are the ones the model needs.
            let excess = remaining.len().saturating_sub(target);
            let sent: Vec<usize> = remaining
                .into_iter()
                .filter(|&i| !is_new(i, self))
                .collect();
            for i in order(self, sent).into_iter().take(excess) {
                self.fates[i] = Fate::Replaced(Reason::Capped);
            }
        } else if !earlier.is_empty() && self.pays(&earlier, prev_end) {
            for &(i, reason) in &earlier {
                self.fates[i] = Fate::Replaced(reason);
            }
        }
        for &(i, _) in &earlier {
            self.marked[i] = false;
        }
    }

    /// Image `i`, new in this step, against the kept images before it.
    fn dedupe(&mut self, i: usize) {
        let Some(id) = self.scan.identity(i, self.body) else {
            return;
        };
        let same = self.by_len.entry(id.len()).or_default();
        let first = same
            .iter()
            .copied()
            .find(|&j| self.fates[j] == Fate::Kept && self.scan.identity(j, self.body) == Some(id));
        if let Some(j) = first {
            self.fates[i] = Fate::Replaced(Reason::Deduped);
            self.pinned[j] = true;
        } else {
            same.push(i);
        }
    }

    /// Whether replacing `earlier` (images the previous request sent) makes
    /// this request cheaper: the messages from the first of them to the
    /// previous request's end, rewritten at full price, against the same
    /// messages unchanged at the cached price.
    fn pays(&self, earlier: &[(usize, Reason)], prev_end: usize) -> bool {
        let Some(first) = earlier.iter().map(|w| self.scan.images[w.0].message).min() else {
            return false;
        };
        let image_tokens = |replaced: bool| match (replaced, self.plan.vision) {
            (false, true) => IMAGE_TOKENS,
            _ => REPLACED_TOKENS,
        };
        let (mut before, mut after) = (0, 0);
        for m in first..prev_end.min(self.text_tokens.len()) {
            before += self.text_tokens[m];
            after += self.text_tokens[m];
            for &i in &self.images_of[m] {
                let replaced = self.fates[i] != Fate::Kept;
                before += image_tokens(replaced);
                after += image_tokens(replaced || self.marked[i]);
            }
        }
        match self.plan.rules.prompt_cache {
            true => after * CACHED_DIVISOR < before,
            false => after < before,
        }
    }
}
