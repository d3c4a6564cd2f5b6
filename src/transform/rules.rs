//! The image rules: what becomes of each image ([`decide`]) — kept, or
//! replaced because the model cannot see, it aged out, it is over the
//! request's cap, or a later copy refers to it — and, for a model with a
//! prompt cache, when rewriting an earlier message to age images has paid
//! for itself (a break-even rule, see [`decide`]).

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
/// decide when ageing images already sent has paid for itself, and how
/// near a request is to the model's context window.
const IMAGE_TOKENS: usize = 765;
const REPLACED_TOKENS: usize = 40;
const BYTES_PER_TOKEN: usize = 4;
/// Cached input costs a tenth of fresh input. Costs below are counted in
/// tenths of a token, so a cached token is 1 and a fresh one this.
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
/// sent, so nothing cached changes). Images an earlier request already
/// sent are replaced all together, in one rewrite, at the first step where
/// that is due (see [`Replay::ages_now`]): at once without a prompt cache;
/// with one, when what keeping them has cost since they became due reaches
/// what the rewrite costs now (the break-even, or ski-rental, rule), or
/// when the request nears the model's context window. The model's own
/// `max_images` is a hard limit (a provider refuses more): when an earlier
/// image must go for it, the oldest go until half of it are left, so the
/// next break comes `max_images / 2` images later. For a model that cannot
/// see, every image still kept is then replaced (its text never changes
/// afterwards).
///
/// Every step reads only the messages of its own request and what the
/// steps before it decided, and an image once replaced stays replaced: so
/// every request's rewrite of the messages the previous request sent is
/// that request's rewrite (the prefix stays byte-stable between rewrites),
/// and every replica decides the same.
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
    /// The steps replayed before this one.
    steps: usize,
    /// For an image already sent, kept and due: the step it became due at.
    due_since: Vec<Option<usize>>,
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
        let images = scan.images.len();
        Replay {
            scan,
            body,
            plan,
            fates: vec![Fate::Kept; images],
            starts_before,
            text_tokens,
            images_of,
            by_len: HashMap::new(),
            marked: vec![false; images],
            pinned: vec![false; images],
            steps: 0,
            due_since: vec![None; images],
        }
    }

    /// The request that ends at message `end`, after the one that ended at
    /// `prev_end`.
    fn step(&mut self, prev_end: usize, end: usize) {
        // An image written as base64 in a text where no image part can go
        // is replaced whatever the rules say (`transform::hoists`): it is
        // no image the model sees, to refer to or to count.
        let as_text = |f: &walk::Found| {
            self.plan.vision && self.plan.fit.hoist_text && f.in_text() && !f.hoistable
        };
        let in_scope: Vec<usize> = (0..self.scan.images.len())
            .filter(|&i| {
                let f = &self.scan.images[i];
                f.message < end && f.medium == Medium::Image && !as_text(f)
            })
            .collect();
        if self.plan.rules.dedupe {
            for &i in &in_scope {
                if self.is_new(i, prev_end) && self.fates[i] == Fate::Kept {
                    self.dedupe(i);
                }
            }
        }
        let wanted = self.wanted(&in_scope, end);
        // New images go at once; earlier ones when the rules below say.
        let (fresh, earlier): (Vec<_>, Vec<_>) =
            wanted.into_iter().partition(|w| self.is_new(w.0, prev_end));
        for &(i, reason) in &fresh {
            self.fates[i] = Fate::Replaced(reason);
            self.marked[i] = false;
        }
        for &i in &in_scope {
            let due = self.marked[i] && self.fates[i] == Fate::Kept;
            self.due_since[i] = due.then(|| self.due_since[i].unwrap_or(self.steps));
        }
        let vision = self.plan.vision;
        let over_hard = self
            .plan
            .rules
            .hard_max_images
            .filter(|_| vision && !earlier.is_empty())
            .filter(|&hard| self.kept(&in_scope, false).len() > hard);
        if let Some(hard) = over_hard {
            self.cap_to_half(&in_scope, &earlier, hard, prev_end);
        } else if !earlier.is_empty() && self.ages_now(&earlier, prev_end, end) {
            for &(i, reason) in &earlier {
                self.fates[i] = Fate::Replaced(reason);
            }
        }
        for &(i, _) in &earlier {
            self.marked[i] = false;
            if self.fates[i] != Fate::Kept {
                self.due_since[i] = None;
            }
        }
        self.steps += 1;
    }

    /// Whether image `i` arrives in the request after the one that ended
    /// at `prev_end` (it was never sent).
    fn is_new(&self, i: usize, prev_end: usize) -> bool {
        self.scan.images[i].message >= prev_end
    }

    /// The images the rules want replaced in the request that ends at
    /// `end` (each marked): those due to age out, then those over
    /// `max_images`.
    fn wanted(&mut self, in_scope: &[usize], end: usize) -> Vec<(usize, Reason)> {
        let rules = self.plan.rules;
        let mut wanted: Vec<(usize, Reason)> = Vec::new();
        for &i in in_scope {
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
                self.marked[i] = true;
            }
        }
        let remaining = self.kept(in_scope, true);
        let excess = remaining.len().saturating_sub(rules.max_images);
        for i in self.oldest_first(remaining).into_iter().take(excess) {
            wanted.push((i, Reason::Capped));
            self.marked[i] = true;
        }
        wanted
    }

    /// The images of `in_scope` still kept (and not marked, with
    /// `skip_marked`).
    fn kept(&self, in_scope: &[usize], skip_marked: bool) -> Vec<usize> {
        in_scope
            .iter()
            .copied()
            .filter(|&i| self.fates[i] == Fate::Kept && !(skip_marked && self.marked[i]))
            .collect()
    }

    /// The order images go in for a cap: tool images, then the user's.
    fn oldest_first(&self, images: Vec<usize>) -> Vec<usize> {
        let (tool, user): (Vec<usize>, Vec<usize>) = images
            .into_iter()
            .partition(|&i| self.scan.images[i].in_tool_result);
        tool.into_iter().chain(user).collect()
    }

    /// The model's hard `max_images` is passed: `earlier` go, and then the
    /// oldest images already sent until half the limit is left (the new
    /// ones are the ones the model needs).
    fn cap_to_half(
        &mut self,
        in_scope: &[usize],
        earlier: &[(usize, Reason)],
        hard: usize,
        prev_end: usize,
    ) {
        let target = (hard / 2).max(1);
        let remaining = self.kept(in_scope, true);
        for &(i, reason) in earlier {
            self.fates[i] = Fate::Replaced(reason);
        }
        let excess = remaining.len().saturating_sub(target);
        let sent: Vec<usize> = remaining
            .into_iter()
            .filter(|&i| !self.is_new(i, prev_end))
            .collect();
        for i in self.oldest_first(sent).into_iter().take(excess) {
            self.fates[i] = Fate::Replaced(Reason::Capped);
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

    /// Whether the images due that the previous request already sent
    /// (`earlier`, all of them or none) age out in the request that ends at
    /// `end`.
    ///
    /// - A model that cannot see: never (their text would change, and
    ///   nothing would be saved).
    /// - No prompt cache: at once (every token is paid every turn).
    /// - The request is estimated past `context_fraction` of the model's
    ///   context window: at once, whatever it costs.
    /// - Otherwise the break-even (ski-rental) rule. Keeping an image due
    ///   costs, on every request, its cached price less its replacement's:
    ///   a tenth of (765 − 40) tokens, the rent. Ageing costs a rewrite:
    ///   the messages from the first of them to the previous request's end
    ///   are sent again at full price, changed, instead of read from the
    ///   cache, once. They age when the rent already paid for them, summed
    ///   over the requests since each became due, reaches what the rewrite
    ///   costs now (the rewrite's cost is `after − before/10` over that
    ///   suffix: what this request pays more than sending it unchanged, so
    ///   a rewrite that already pays is made at once). Whatever the
    ///   conversation does next, what it pays for them is then at most the
    ///   rent plus one rewrite, twice the rewrite: as in ski rental (taking
    ///   the rewrite's price as it is now), never more than twice what
    ///   keeping them to the end or ageing them at once would have cost,
    ///   the best of which only hindsight knows. Ageing them all at once
    ///   pays one rewrite for all.
    fn ages_now(&self, earlier: &[(usize, Reason)], prev_end: usize, end: usize) -> bool {
        if !self.plan.vision {
            return false;
        }
        if !self.plan.rules.prompt_cache || self.past_context(end) {
            return true;
        }
        let rent: usize = earlier
            .iter()
            .filter_map(|&(i, _)| self.due_since[i])
            .map(|since| (self.steps - since) * (IMAGE_TOKENS - REPLACED_TOKENS))
            .sum();
        let (cached, rewritten) = self.suffix_cost(earlier, prev_end);
        rent + cached >= rewritten
    }

    /// Estimated tokens of image `i` as it is sent now, or replaced.
    fn image_tokens(&self, i: usize, replaced: bool) -> usize {
        match replaced || self.fates[i] != Fate::Kept || !self.plan.vision {
            true => REPLACED_TOKENS,
            false => IMAGE_TOKENS,
        }
    }

    /// The messages from the first of `earlier` to the previous request's
    /// end, in tenths of a token: as they are, read from the cache; and
    /// with `earlier` replaced, at full price.
    fn suffix_cost(&self, earlier: &[(usize, Reason)], prev_end: usize) -> (usize, usize) {
        let Some(first) = earlier.iter().map(|w| self.scan.images[w.0].message).min() else {
            return (0, 0);
        };
        let (mut before, mut after) = (0, 0);
        for m in first..prev_end.min(self.text_tokens.len()) {
            before += self.text_tokens[m];
            after += self.text_tokens[m];
            for &i in &self.images_of[m] {
                before += self.image_tokens(i, false);
                after += self.image_tokens(i, self.marked[i]);
            }
        }
        (before, after * CACHED_DIVISOR)
    }

    /// Whether the request that ends at `end`, as it would be sent with
    /// nothing more replaced, is estimated past `context_fraction` of the
    /// model's context window.
    fn past_context(&self, end: usize) -> bool {
        let rules = self.plan.rules;
        let Some(window) = rules.context_window else {
            return false;
        };
        let tokens: usize = (0..end.min(self.text_tokens.len()))
            .map(|m| {
                let images: usize = self.images_of[m]
                    .iter()
                    .map(|&i| self.image_tokens(i, false))
                    .sum();
                self.text_tokens[m] + images
            })
            .sum();
        (tokens as u64).saturating_mul(1000) > window.saturating_mul(rules.context_permille.into())
    }
}
