//! Request transforms: pure functions from a request body (and the data
//! they need, looked up by the async edges) to a rewritten body and a
//! [`Report`]. No I/O here.
//!
//! - [`images`]: finds every image and replaces the chosen ones in place.
//! - the image rules for every model ([`decide`]): tool-result images older
//!   than `keep_turns` aged out, later copies of an image turned into a
//!   reference, only the newest `max_per_request` kept.
//! - [`dedup`]: repeated lines and JSON array elements removed.
//!
//! A body nothing applies to is left alone: the caller forwards the
//! original bytes.

pub mod dedup;
pub mod images;
pub mod json;

use std::collections::HashMap;
use std::sync::Arc;

use serde::Serialize;

use crate::artifacts::Artifact;
use crate::config::Config;
use images::{Found, Reason, Role, Source, placeholder};

/// The API shape of a transformed endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Shape {
    /// `POST /v1/chat/completions`
    Chat,
    /// `POST /v1/responses`
    Responses,
    /// `POST /v1/messages` (Anthropic)
    Messages,
}

impl Shape {
    /// The shape of a path after `/v1`, for `POST`.
    pub fn of_path(rest: &str) -> Option<Shape> {
        match rest {
            "/chat/completions" => Some(Shape::Chat),
            "/responses" => Some(Shape::Responses),
            "/messages" => Some(Shape::Messages),
            _ => None,
        }
    }
}

/// What the transforms need to know about the request's model.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    pub shape: Shape,
    /// False: every image is replaced.
    pub vision: bool,
    /// True: replaced images that can be described are given their
    /// description when one is supplied (`images.non_vision = "describe"`).
    pub describe: bool,
    pub rules: Rules,
}

/// The rules for every model: `[images]` and `[dedup]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rules {
    /// A tool-result image with more than this many assistant turns after
    /// it is replaced.
    pub keep_turns: usize,
    /// Only the newest this many images stay (when it pays, see [`decide`]).
    pub max_images: usize,
    /// The model's own limit (its table row's `max_images`): always held.
    pub hard_max_images: Option<usize>,
    /// A later copy of an image becomes a reference to the first.
    pub dedupe: bool,
    /// The provider caches prompt prefixes (cached input at a tenth): an
    /// image already sent is replaced only when that pays (see [`decide`]).
    pub prompt_cache: bool,
    /// When a repeated run of lines is worth a note; `None`: no dedup.
    pub dedup: Option<dedup::Blocks>,
}

impl Rules {
    /// No rule applies: only a non-vision model's images are replaced.
    pub const NONE: Rules = Rules {
        keep_turns: usize::MAX,
        max_images: usize::MAX,
        hard_max_images: None,
        dedupe: false,
        prompt_cache: true,
        dedup: None,
    };

    /// The configured rules, for a model whose table row says `max_images`
    /// (the smaller cap wins).
    pub fn from_config(cfg: &Config, model_max_images: Option<u32>) -> Rules {
        let cap = cfg.images.max_per_request as usize;
        Rules {
            keep_turns: cfg.images.keep_turns as usize,
            max_images: model_max_images.map_or(cap, |m| cap.min(m as usize)),
            hard_max_images: model_max_images.map(|m| m as usize),
            dedupe: cfg.images.dedupe,
            prompt_cache: cfg.images.prompt_cache,
            dedup: cfg.dedup.enabled.then_some(dedup::Blocks {
                min_lines: cfg.dedup.min_run_lines as usize,
                min_bytes: cfg.dedup.min_run_bytes as usize,
            }),
        }
    }

    fn any(&self) -> bool {
        *self != Rules::NONE
    }
}

impl Plan {
    /// A plan with no rule for every model (the image replacement of a
    /// non-vision model only).
    pub fn images_only(shape: Shape, vision: bool, describe: bool) -> Plan {
        Plan {
            shape,
            vision,
            describe,
            rules: Rules::NONE,
        }
    }
}

/// What becomes of one image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    Kept,
    Replaced(Reason),
}

/// An image a describer can be sent: the full SHA-256 hex it is known by
/// (of its bytes, or of its URL) and the image itself.
#[derive(Debug, Clone)]
pub struct Subject {
    pub sha256: String,
    pub image: SubjectImage,
    /// Only a cached description may be used (an aged-out or capped
    /// image): the describer is not called for it.
    pub lookup_only: bool,
}

#[derive(Debug, Clone)]
pub enum SubjectImage {
    /// Decoded bytes and their media type.
    Inline {
        media_type: String,
        bytes: bytes::Bytes,
    },
    /// An http(s) URL, passed on as it is.
    Url(String),
}

/// One image, as reported.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ImageNote {
    pub path: String,
    /// Empty for an image that was kept without being decoded.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub sha256: String,
    pub kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub width: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub height: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub problem: Option<&'static str>,
    /// `kept`, `described` or `stripped` (a model that cannot see), or
    /// `aged_out`, `capped`, `deduped` (the rules for every model).
    pub action: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<Reason>,
    pub in_tool_result: bool,
}

/// What the transforms did to one request.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Report {
    pub images_found: usize,
    pub images_replaced: usize,
    /// Of the replaced images, those replaced by their description.
    pub images_described: usize,
    /// Request bytes removed (negative when the rewrite grew the body).
    pub bytes_saved: i64,
    /// Of those, removed by line and item dedup.
    pub bytes_saved_dedup: i64,
    /// Repeated lines and JSON array elements removed.
    pub lines_omitted: usize,
    pub items_omitted: usize,
    /// Stored session messages prepended (set by the proxy).
    #[serde(skip)]
    pub history_used: usize,
    pub images: Vec<ImageNote>,
    /// Set when the body could not be walked and was left unchanged.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped: Option<&'static str>,
}

/// A rewrite: the new body (`None`: forward the original), the report, and
/// the replaced images' bytes to save.
#[derive(Debug, Default)]
pub struct Rewrite {
    pub body: Option<Vec<u8>>,
    pub report: Report,
    pub artifacts: Vec<Artifact>,
}

/// True when the plan may change something, so the body must be walked.
pub fn needed(plan: &Plan) -> bool {
    !plan.vision || plan.rules.any()
}

/// Applies the plan to a body that is valid JSON, with placeholders only.
pub fn rewrite(body: &[u8], plan: &Plan) -> Rewrite {
    match scan(body, plan) {
        Ok(scanned) => scanned.finish(body, &[]),
        Err(nothing) => *nothing,
    }
}

/// The first half of a rewrite: every image found, and which are replaced.
/// Between [`scan`] and [`Scanned::finish`] the caller may look up
/// descriptions for [`Scanned::subjects`].
#[derive(Debug)]
pub struct Scanned {
    scan: images::Scan,
    plan: Plan,
    fates: Vec<Fate>,
}

/// Finds the images in `body`. `Err` holds the finished rewrite when
/// nothing is to be done (or the body cannot be walked).
pub fn scan(body: &[u8], plan: &Plan) -> Result<Scanned, Box<Rewrite>> {
    let mut scanned = walk(body, plan)?;
    scanned.resolve(body);
    Ok(scanned)
}

/// The cheap half of [`scan`]: the walk and the decisions, no image
/// decoded yet (see [`Scanned::resolve`] and [`Scanned::work`]).
pub fn walk(body: &[u8], plan: &Plan) -> Result<Scanned, Box<Rewrite>> {
    if !needed(plan) {
        return Err(Box::default());
    }
    let scan = match images::scan(body, plan.shape) {
        Ok(s) => s,
        Err(_) => {
            return Err(Box::new(Rewrite {
                report: Report {
                    skipped: Some("the body is not an object of the expected shape"),
                    ..Report::default()
                },
                ..Rewrite::default()
            }));
        }
    };
    let fates = decide(&scan, body, plan);
    Ok(Scanned {
        scan,
        plan: *plan,
        fates,
    })
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
pub fn decide(scan: &images::Scan, body: &[u8], plan: &Plan) -> Vec<Fate> {
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
        for fate in &mut fates {
            if *fate == Fate::Kept {
                *fate = Fate::Replaced(Reason::NonVision);
            }
        }
    }
    fates
}

/// Where each assistant turn starts (assistant messages; for Responses a
/// run of items the model produced is one turn), then the end.
fn turn_starts(items: &[images::Item], shape: Shape) -> Vec<usize> {
    let assistant = |k: usize| items.get(k).is_some_and(|it| it.role == Role::Assistant);
    (0..items.len())
        .filter(|&i| assistant(i) && (shape != Shape::Responses || i == 0 || !assistant(i - 1)))
        .collect()
}

/// The ends of the requests the conversation sent, this one last.
fn request_ends(items: &[images::Item], shape: Shape) -> Vec<usize> {
    let mut ends: Vec<usize> = turn_starts(items, shape)
        .into_iter()
        .filter(|&i| i > 0)
        .collect();
    ends.push(items.len());
    ends
}

struct Replay<'a> {
    scan: &'a images::Scan,
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
    fn new(scan: &'a images::Scan, body: &'a [u8], plan: &'a Plan) -> Self {
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
                list.push(i);
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
            .filter(|&i| self.scan.images[i].message < end)
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

impl Scanned {
    /// The replaced images a description could be given to, with their
    /// index: each distinct image once (in describe mode; none otherwise).
    /// Images a model cannot see may be sent to the describer; aged-out and
    /// capped ones only take a cached description; references none.
    pub fn subjects(&self) -> Vec<(usize, Subject)> {
        if !self.plan.describe {
            return Vec::new();
        }
        let mut at: HashMap<&str, usize> = HashMap::new();
        let mut out: Vec<(usize, Subject)> = Vec::new();
        for (i, f) in self.scan.images.iter().enumerate() {
            let lookup_only = match self.fates[i] {
                Fate::Replaced(Reason::NonVision) => false,
                Fate::Replaced(Reason::AgedOut | Reason::Capped) => true,
                Fate::Kept | Fate::Replaced(Reason::Deduped) => continue,
            };
            let Some(mut s) = f.subject() else { continue };
            s.lookup_only = lookup_only;
            match at.get(f.sha256.as_str()) {
                Some(&k) => out[k].1.lookup_only &= lookup_only,
                None => {
                    at.insert(f.sha256.as_str(), out.len());
                    out.push((i, s));
                }
            }
        }
        out
    }

    /// What becomes of each image.
    pub fn fates(&self) -> &[Fate] {
        &self.fates
    }

    /// Decodes and hashes the images to be replaced (after [`walk`]).
    pub fn resolve(&mut self, body: &[u8]) {
        for (i, fate) in self.fates.iter().enumerate() {
            if *fate != Fate::Kept {
                self.scan.resolve(i, body);
            }
        }
    }

    /// About how many bytes [`Scanned::resolve`] and [`Scanned::finish`]
    /// will go through: the base64 of the images to decode, and the text
    /// dedup reads. A caller runs them off its thread when this is large.
    pub fn work(&self) -> usize {
        let images: usize = (0..self.fates.len())
            .filter(|&i| self.fates[i] != Fate::Kept)
            .filter_map(|i| self.scan.pending_len(i))
            .sum();
        let texts: usize = match self.plan.rules.dedup {
            Some(_) => self
                .scan
                .texts
                .iter()
                .map(|t| self.scan.spot_literal_len(t.spot))
                .sum(),
            None => 0,
        };
        images + texts
    }

    /// Rewrites `body`: each replaced image becomes its description when
    /// `descriptions` has one for its SHA-256 (pairs of full hex and
    /// text), else the placeholder.
    pub fn finish(self, body: &[u8], descriptions: &[(String, Arc<str>)]) -> Rewrite {
        let Scanned { scan, plan, fates } = self;
        let by_sha: HashMap<&str, &str> = descriptions
            .iter()
            .map(|(sha, d)| (sha.as_str(), &**d))
            .collect();
        let described = |f: &Found, fate: Fate| match fate {
            Fate::Replaced(Reason::Deduped) | Fate::Kept => None,
            Fate::Replaced(_) => by_sha.get(f.sha256.as_str()).copied(),
        };
        let texts: Vec<Option<String>> = scan
            .images
            .iter()
            .zip(&fates)
            .map(|(f, &fate)| match fate {
                Fate::Kept => None,
                Fate::Replaced(reason) => Some(placeholder(f, described(f, fate), reason)),
            })
            .collect();
        let mut spot_text = scan.spot_texts(&texts);
        let mut joined = scan.joined(body, &texts, &spot_text);
        let omitted = match plan.rules.dedup {
            Some(blocks) => dedup::run(&scan, body, &mut spot_text, &mut joined, blocks),
            None => dedup::Omitted::default(),
        };
        let new = scan.assemble(body, plan.shape, &texts, &spot_text, &joined);
        let artifacts = scan.artifacts(|i| fates[i] != Fate::Kept);
        let mut report = Report {
            images_found: scan.images.len(),
            lines_omitted: omitted.lines,
            items_omitted: omitted.items,
            bytes_saved_dedup: omitted.bytes,
            ..Report::default()
        };
        for (f, &fate) in scan.images.iter().zip(&fates) {
            let action = match (fate, described(f, fate)) {
                (Fate::Kept, _) => Action::Kept,
                (Fate::Replaced(Reason::NonVision), Some(_)) => Action::Described,
                (Fate::Replaced(Reason::NonVision), None) => Action::Stripped,
                (Fate::Replaced(Reason::AgedOut), _) => Action::AgedOut,
                (Fate::Replaced(Reason::Capped), _) => Action::Capped,
                (Fate::Replaced(Reason::Deduped), _) => Action::Deduped,
            };
            report.images_replaced += usize::from(fate != Fate::Kept);
            report.images_described += usize::from(described(f, fate).is_some());
            report.images.push(note(f, fate, action));
        }
        if let Some(b) = &new {
            report.bytes_saved = body.len() as i64 - b.len() as i64;
            // A rewritten body also goes out compact: that saving counts
            // with dedup when no image was replaced, else with images.
            if report.images_replaced == 0 {
                report.bytes_saved_dedup = report.bytes_saved;
            }
        }
        Rewrite {
            body: new,
            report,
            artifacts,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Kept,
    Described,
    Stripped,
    AgedOut,
    Capped,
    Deduped,
}

impl Action {
    /// The `action` label of `visor_images_total`.
    fn label(self) -> &'static str {
        match self {
            Action::Kept => "kept",
            Action::Described => "described",
            Action::Stripped => "stripped",
            Action::AgedOut => "aged_out",
            Action::Capped => "capped",
            Action::Deduped => "deduped",
        }
    }
}

fn note(f: &Found, fate: Fate, action: Action) -> ImageNote {
    let reason = match fate {
        Fate::Kept => None,
        Fate::Replaced(r) => Some(r),
    };
    let mut n = ImageNote {
        path: f.path.clone(),
        sha256: f.sha256.clone(),
        kind: "",
        media_type: None,
        bytes: None,
        width: None,
        height: None,
        url: None,
        problem: None,
        action: action.label(),
        reason,
        in_tool_result: f.in_tool_result,
    };
    match &f.source {
        Source::Encoded { media_type } => {
            n.kind = "base64";
            n.media_type = (!media_type.is_empty()).then(|| media_type.clone());
        }
        Source::Inline {
            media_type,
            size,
            dims,
        } => {
            n.kind = "base64";
            n.media_type = Some(media_type.clone());
            n.bytes = Some(*size);
            n.width = dims.map(|d| d.0);
            n.height = dims.map(|d| d.1);
        }
        Source::Url(u) => {
            n.kind = "url";
            n.url = Some(u.clone());
        }
        Source::File(id) => {
            n.kind = "file";
            n.url = Some(id.clone());
        }
        Source::Broken(why) => {
            n.kind = "broken";
            n.problem = Some(why);
        }
    }
    n
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_context;
