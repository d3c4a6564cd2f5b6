//! The async edge of the request transforms: reads visor's request headers,
//! resolves the model in the model-spec table, runs the pure transforms
//! ([`crate::transform`]) — off the worker thread for large bodies — saves
//! the replaced images in the background, and records metrics. Nothing here
//! fails a request: a body the transforms cannot walk goes out unchanged.

use std::collections::VecDeque;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use http::{HeaderMap, HeaderName};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::dedup_states::Walked;
use super::headers::{X_VISOR_TRANSFORM, X_VISOR_VISION};
use crate::artifacts::Artifacts;
use crate::error::VisorError;
use crate::media_text::describe::{Credential, Describer, describe};
use crate::media_text::{self, Credentials, MediaText, Within};
use crate::metrics::Metrics;
use crate::models::{Medium, ModelTable};
use crate::store::Store;
use crate::transform::{
    self, Limits, MediaJob, Plan, Report, Rewrite, Rules, Shape, Subject, Takes,
};
use crate::upstream::UpstreamBody;

/// Bodies larger than this are transformed on the blocking pool, so a
/// multi-megabyte image does not hold up the other connections of a worker.
const INLINE_LIMIT: usize = 256 * 1024;
/// A body walked on the worker (for a model that can see) is finished on
/// the blocking pool past this size, whatever its work: its copies alone
/// take a while.
const HEAVY_BODY: usize = 4 << 20;

/// What the transform phase (and the learning after a refusal) reads: the
/// model table, the rules built at load, the part that turns media into
/// text, and where replaced originals go.
pub struct Rewriter {
    /// The model-spec table (user, built-in and learned rows).
    pub models: Arc<ModelTable>,
    /// The `[images]` and `[dedup]` rules, built at load (a model's own
    /// `max_images` narrows them per request).
    pub rules: Rules,
    /// `images.non_vision = "describe"`.
    pub describes: bool,
    /// `describer.query_aware`.
    pub query_aware: bool,
    /// `images.refusal_phrases`, lower case.
    pub refusal_phrases: Vec<String>,
    /// Where replaced images are saved and served from.
    pub artifacts: Artifacts,
    /// Proxy keys are set: the client's own credential is not forwarded to
    /// the describer or transcriber.
    pub proxy_keys_set: bool,
    /// `server.request_timeout`: a share of it is kept for the upstream.
    pub request_timeout: std::time::Duration,
    /// `server.max_body_bytes`: documents are cut to fit it.
    pub max_body_bytes: u64,
    pub media: Arc<MediaText>,
    /// Learned models, shared with the other replicas.
    pub store: Arc<Store>,
    pub metrics: Arc<Metrics>,
    /// `[images]`'s part of what a kept image must fit (`provider_size`,
    /// the opt-in diet); each model's row adds its provider's limits.
    pub fit: Limits,
    /// Fitted images, cached.
    pub fitter: Arc<super::fit_images::Fitter>,
    /// What dedup read of each conversation (`dedup.state_bytes`; none
    /// at 0).
    pub dedup_states: Option<Arc<super::dedup_states::DedupStates>>,
}

/// What a kept image sent to a model with `caps` must fit: its provider's
/// limits from the table, and `[images]`' settings (`base`).
pub fn fit_limits(caps: &crate::models::Caps, base: Limits) -> Limits {
    use crate::image_fit::Formula;
    use crate::models::ImageTokens;
    Limits {
        max_bytes: caps.max_image_bytes,
        max_edge: caps.max_image_edge,
        max_pixels: caps.max_image_pixels,
        many_images: caps.many_images,
        many_edge: caps.many_images_edge,
        max_request_bytes: caps.max_request_bytes,
        formula: caps.image_tokens.map(|t| match t {
            ImageTokens::Anthropic => Formula::Anthropic,
            ImageTokens::OpenaiTiles => Formula::OpenaiTiles,
            ImageTokens::OpenaiPatches => Formula::OpenaiPatches,
            ImageTokens::Gemini => Formula::Gemini,
        }),
        hoist_text: true,
        ..base
    }
}

impl Rewriter {
    /// Loads the learned models from the store; returns how many were new.
    pub async fn sync_learned(&self) -> usize {
        match self.store.learned().await {
            Ok(names) => self.models.learned.merge(names),
            Err(_) => 0,
        }
    }

    /// Moves the models in `learned-models.json` (`path`, where the version
    /// before the store kept them) into the store, then renames the file to
    /// `learned-models.json.imported`. While the store is down they are
    /// learned in memory and the file stays for the next start.
    pub async fn import_legacy_learned(&self, path: &std::path::Path) {
        let legacy = crate::models::legacy_learned(path);
        if legacy.is_empty() {
            return;
        }
        let mut stored = true;
        for name in &legacy {
            stored &= self.store.learn(name).await.is_ok();
        }
        self.models.learned.merge(legacy);
        if !stored {
            return;
        }
        let done = path.with_extension("json.imported");
        match std::fs::rename(path, &done) {
            Ok(()) => {
                tracing::info!(from = %path.display(), "learned models moved into the store")
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot rename the imported learned-models file")
            }
        }
    }
}

/// What the client asked of visor for this request.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// `x-visor-transform: off`
    pub off: bool,
    /// `x-visor-vision: true|false`
    pub vision: Option<bool>,
}

impl Options {
    pub fn from_headers(headers: &HeaderMap) -> Result<Self, VisorError> {
        let flag = |name: &HeaderName| {
            headers
                .get(name)
                .map(|v| v.to_str().unwrap_or("?").trim().to_ascii_lowercase())
        };
        let off = match flag(&X_VISOR_TRANSFORM).as_deref() {
            None | Some("on") => false,
            Some("off") => true,
            Some(_) => {
                return Err(VisorError::BadRequest(
                    "x-visor-transform must be \"off\" (or \"on\")",
                ));
            }
        };
        let vision = match flag(&X_VISOR_VISION).as_deref() {
            None => None,
            Some("true") => Some(true),
            Some("false") => Some(false),
            Some(_) => {
                return Err(VisorError::BadRequest(
                    "x-visor-vision must be \"true\" or \"false\"",
                ));
            }
        };
        Ok(Self { off, vision })
    }
}

/// The body to send, what was done to it, and what may follow.
pub struct Prepared {
    pub body: Bytes,
    pub report: Report,
    /// Replaced images being saved; awaited before the response is returned.
    pub saving: Option<JoinHandle<()>>,
    /// Set when the model's vision is unknown and the body may hold images:
    /// an upstream refusal can then be learned from, once.
    pub learn: Option<Learnable>,
    /// The request's place among its conversation's kept states (a body
    /// of [`super::dedup_states::MIN_BODY`] or more, with dedup).
    pub conversation: Option<Continues>,
    /// What `body` shares with the conversation's previous body as sent,
    /// for the inspector (set by the prompt cache's reading).
    pub shared: super::checked_prefixes::Shared,
}

/// What the prompt cache read of a conversation's previous request, kept
/// with the state this request continued; and where this request's own
/// state is kept (once it is), for the prompt cache's reading of it to
/// join.
pub struct Continues {
    pub states: Arc<super::dedup_states::DedupStates>,
    pub from: Option<crate::prompt_cache::Prefixes>,
    pub kept: Arc<OnceLock<u128>>,
}

impl Continues {
    /// For a request that may continue its conversation (`states`): with
    /// the prompt cache's reading it continues from, and where its own
    /// state's key will be.
    fn new(
        states: Option<Arc<super::dedup_states::DedupStates>>,
        from: Option<crate::prompt_cache::Prefixes>,
    ) -> (Option<Continues>, Arc<OnceLock<u128>>) {
        let kept = Arc::new(OnceLock::new());
        let c = states.map(|states| Continues {
            states,
            from,
            kept: kept.clone(),
        });
        (c, kept)
    }

    /// Adds the prompt cache's reading of this request to its kept state.
    pub fn attach(&self, read: crate::prompt_cache::Prefixes) {
        if let Some(&key) = self.kept.get() {
            self.states.attach(key, read);
        }
    }
}

pub struct Learnable {
    pub shape: Shape,
    pub rules: Rules,
    pub original: Bytes,
    /// For the describer, should the retry describe images.
    pub credential: Credentials,
    /// What the model was taken to accept.
    pub vision: bool,
    /// What kept images must fit.
    pub fit: Limits,
    pub takes: Takes,
    /// No row states the model's vision: a refusal of images teaches it.
    pub vision_unknown: bool,
    /// No row states whether it reads PDFs / hears audio (a row that says
    /// so is never overruled by an error message).
    pub pdf_unknown: bool,
    pub audio_unknown: bool,
    /// The first try's bounds: the retry reads under the same deadline.
    pub within: Within,
    /// The request's deadline: past it, no retry is sent.
    pub deadline: Instant,
    /// Whose conversation it is (see [`tenant`]).
    pub tenant: u64,
}

/// What a refusal taught, learned once the retry without it succeeded
/// ([`learn`]).
pub struct Lesson {
    model: String,
    phrase: String,
    images: bool,
    documents: bool,
    audio: bool,
}

/// A refused request's second try: the body with what was refused
/// replaced, and what to learn when that one is answered.
pub struct Retry {
    pub prepared: Prepared,
    pub lesson: Lesson,
}

/// Who is asking: the client's headers and the upstream the request goes
/// to (the describer may carry the client's credential there).
pub struct Asker<'a> {
    pub headers: &'a HeaderMap,
    pub upstream: usize,
    /// The digests the body's check computed (see
    /// [`super::checked_prefixes::Digests`]).
    pub digests: super::checked_prefixes::Digests,
}

impl Prepared {
    /// `body` sent as it came.
    fn unchanged(body: Bytes, learn: Option<Learnable>) -> Prepared {
        Prepared {
            body,
            report: Report::default(),
            saving: None,
            learn,
            conversation: None,
            shared: Default::default(),
        }
    }

    pub fn upstream_body(&self) -> UpstreamBody {
        UpstreamBody {
            prefix: VecDeque::from([self.body.clone()]),
            rest: None,
        }
    }
}

/// How much of what is left of a request's time its documents, audio and
/// images may take: the rest (a quarter of `server.request_timeout_secs`,
/// or what is left when that is less) is the upstream's.
const UPSTREAM_SHARE: u32 = 4;

impl Rewriter {
    /// The body to send upstream for a request that must be answered by
    /// `deadline` (`started + server.request_timeout_secs`). Documents, audio
    /// and images are turned into text until a quarter of the request's time
    /// is left (what is not done by then says "out of time"); document text is
    /// bounded per document and per request, and a body that it would take
    /// past `server.max_body_bytes` has its documents cut further. `Err`: 504
    /// when the deadline passed before the body was ready (nothing is sent),
    /// 413 when even documents cut to their headers do not fit.
    pub async fn prepare_by(
        &self,
        shape: Shape,
        model: Option<&str>,
        body: Bytes,
        opts: Options,
        asker: Asker<'_>,
        deadline: Instant,
    ) -> Result<Prepared, VisorError> {
        let rw = self;
        let prepared = prepare_within(rw, shape, model, body, opts, asker, deadline).await?;
        if Instant::now() >= deadline {
            return Err(VisorError::TransformTimeout);
        }
        Ok(prepared)
    }
}

async fn prepare_within(
    rw: &Rewriter,
    shape: Shape,
    model: Option<&str>,
    body: Bytes,
    opts: Options,
    asker: Asker<'_>,
    deadline: Instant,
) -> Result<Prepared, VisorError> {
    let reserve = rw.request_timeout / UPSTREAM_SHARE;
    let within = Within {
        stop_at: Some(deadline.checked_sub(reserve).unwrap_or(deadline)),
        ..Within::unbounded_time(&rw.media)
    };
    let unchanged = Prepared::unchanged;
    if opts.off {
        return Ok(unchanged(body, None));
    }
    let mut resolved = rw.models.resolve(model.unwrap_or(""), opts.vision);
    // A conversation's body is looked for words only after the bytes its
    // previous body shared, when those are known.
    let digests = asker.digests.of(&body);
    let might_hold_images = |body: &[u8]| digests.holds(body, b"image");
    // A model another replica may have learned (a shared store): asked of
    // the store now, not at the next 30 s refresh, so this request does not
    // pay the refusal round trip again.
    if !resolved.known() && rw.store.is_shared() && might_hold_images(&body) {
        let name = crate::models::normalise(model.unwrap_or(""));
        if !name.is_empty() && matches!(rw.store.is_learned(&name).await, Ok(true)) {
            rw.models.learned.merge([name]);
            resolved = rw.models.resolve(model.unwrap_or(""), opts.vision);
        }
    }
    let plan = Plan {
        shape,
        vision: resolved.vision,
        describe: rw.describes,
        rules: rw
            .rules
            .for_model(resolved.caps.max_images, resolved.caps.context_window),
        takes: Takes {
            pdf: resolved.pdf,
            office: resolved.office,
            audio: resolved.audio,
        },
        query_aware: rw.query_aware,
        // A body without the word holds no image to fit: not walked for it.
        fit: match resolved.vision && might_hold_images(&body) {
            // Base64 in a text becomes an image part only for a model the
            // table says can see (an unknown one keeps its text as it was).
            true => Limits {
                hoist_text: resolved.known(),
                ..fit_limits(&resolved.caps, rw.fit)
            },
            false => Limits::NONE,
        },
    };
    let for_service = |d: &Describer| {
        Credential::for_request(d, rw.proxy_keys_set, asker.headers, asker.upstream)
    };
    let credential = Credentials {
        describer: match plan.describe {
            true => for_service(rw.media.describer()),
            false => Credential::default(),
        },
        transcriber: for_service(rw.media.transcriber()),
    };
    // Whose conversation it is: only for a body that may leave a state.
    let who = match body.len() >= super::dedup_states::MIN_BODY {
        true => tenant(asker.headers),
        false => 0,
    };
    // A model of unknown vision: an upstream refusal of its images can be
    // learned from, once, by sending the original again without them.
    let learn = (!resolved.known() && might_hold_images(&body)
        || might_hold_media(&|w| digests.holds(&body, w), plan.takes, &resolved.caps))
    .then(|| Learnable {
        shape,
        rules: plan.rules,
        original: body.clone(),
        credential: credential.clone(),
        vision: plan.vision,
        fit: plan.fit,
        takes: plan.takes,
        vision_unknown: !resolved.known(),
        pdf_unknown: resolved.caps.pdf.is_none(),
        audio_unknown: resolved.caps.audio.is_none(),
        within,
        deadline,
        tenant: who,
    });
    if !transform::needed(&plan) {
        return Ok(unchanged(body, learn));
    }
    // Boxed: its state (6 KB) is not carried by each future above it, and
    // made in its box (not copied there).
    let mut prepared =
        super::in_box(|| run(rw, body, plan, &credential, within, (who, digests))).await?;
    prepared.learn = learn;
    Ok(prepared)
}

/// How providers and servers say "no documents for this model" (each
/// matched as whole words: "does not support file" is not "does not
/// support file_search").
const DOCUMENT_REFUSALS: &[&str] = &[
    "file input is not supported",
    "file inputs are not supported",
    "does not support file input",
    "does not support file content",
    "doesn't support file input",
    "doesn't support file content",
    "does not support files",
    "pdf input is not supported",
    "does not support pdf",
    "doesn't support pdf",
    "document input is not supported",
    "documents are not supported",
    "does not support document input",
    "does not support documents",
    "doesn't support documents",
    "unknown variant `file`",
    "unknown variant `input_file`",
    "unknown variant `document`",
    "no endpoints found that support file input",
];

/// How they say "no audio for this model".
const AUDIO_REFUSALS: &[&str] = &[
    "audio input is not supported",
    "audio inputs are not supported",
    "does not support audio",
    "doesn't support audio",
    "input_audio is not supported",
    "unknown variant `input_audio`",
    "unknown variant `audio`",
    "no endpoints found that support input audio",
];

/// The first of `phrases` that `text` holds as whole words (not followed
/// by a letter, digit or `_`; a plural `s` is allowed).
fn said_word(text: &str, phrases: &[&'static str]) -> Option<&'static str> {
    phrases.iter().copied().find(|p| {
        text.match_indices(p).any(|(at, _)| {
            let rest = &text[at + p.len()..];
            let rest = rest.strip_prefix('s').unwrap_or(rest);
            !rest
                .chars()
                .next()
                .is_some_and(|c| c.is_alphanumeric() || c == '_')
        })
    })
}

impl Rewriter {
    /// After an upstream refused a request whose images (model of unknown
    /// vision), documents or audio (flags no row states) it was assumed to
    /// take: when its error says which, the body with those replaced, and what
    /// to learn once that is answered.
    pub async fn after_refusal(
        &self,
        learn: &Learnable,
        model: &str,
        error_body: &[u8],
    ) -> Option<Retry> {
        let rw = self;
        use transform::placeholder::Reason;
        let text = String::from_utf8_lossy(error_body).to_lowercase();
        let images = learn
            .vision_unknown
            .then(|| {
                rw.refusal_phrases
                    .iter()
                    .find(|p| text.contains(p.as_str()))
            })
            .flatten();
        let documents = (learn.takes.pdf && learn.pdf_unknown)
            .then(|| said_word(&text, DOCUMENT_REFUSALS))
            .flatten();
        let audio = (learn.takes.audio && learn.audio_unknown)
            .then(|| said_word(&text, AUDIO_REFUSALS))
            .flatten();
        let phrase = match (images, documents.or(audio)) {
            (Some(p), _) => p.clone(),
            (None, Some(p)) => p.to_owned(),
            (None, None) => return None,
        };
        // Past the request's deadline no retry is sent: the refusal is the
        // answer.
        if Instant::now() >= learn.deadline {
            return None;
        }
        let plan = Plan {
            shape: learn.shape,
            vision: learn.vision && images.is_none(),
            describe: rw.describes,
            rules: learn.rules,
            takes: Takes {
                pdf: learn.takes.pdf && documents.is_none(),
                office: learn.takes.office,
                audio: learn.takes.audio && audio.is_none(),
            },
            query_aware: rw.query_aware,
            fit: learn.fit,
        };
        let prepared = run(
            rw,
            learn.original.clone(),
            plan,
            &learn.credential,
            learn.within,
            (learn.tenant, Default::default()),
        )
        .await
        .ok()?;
        if Instant::now() >= learn.deadline {
            return None;
        }
        let replaced = |medium: &str, reason: Reason| {
            prepared
                .report
                .images
                .iter()
                .any(|n| n.medium == medium && n.reason == Some(reason))
        };
        let lesson = Lesson {
            model: model.to_owned(),
            phrase,
            images: images.is_some() && replaced("image", Reason::NonVision),
            documents: documents.is_some() && replaced("document", Reason::CannotTake),
            audio: audio.is_some() && replaced("audio", Reason::CannotTake),
        };
        if !(lesson.images || lesson.documents || lesson.audio) {
            return None;
        }
        tracing::info!(
            phrase = %lesson.phrase,
            images = lesson.images,
            documents = lesson.documents,
            audio = lesson.audio,
            "upstream refused what the model was assumed to take: retrying once with it replaced"
        );
        Some(Retry { prepared, lesson })
    }
}

impl Rewriter {
    /// The retry without what was refused was answered: the model is learned
    /// (memory, store, `visor check`). A retry that fails too teaches nothing.
    pub async fn learn(&self, lesson: Lesson) {
        let rw = self;
        let mut names = Vec::new();
        if lesson.images {
            names.extend(rw.models.learned.learn(&lesson.model));
        }
        if lesson.documents {
            names.extend(rw.models.learned.learn_media(Medium::Pdf, &lesson.model));
        }
        if lesson.audio {
            names.extend(rw.models.learned.learn_media(Medium::Audio, &lesson.model));
        }
        for name in names {
            rw.metrics.capability_learned.inc();
            // A store that is down logged and counted it; the model stays
            // learned in memory.
            let _ = rw.store.learn(&name).await;
        }
        tracing::info!(
            phrase = %lesson.phrase,
            images = lesson.images,
            documents = lesson.documents,
            audio = lesson.audio,
            "model learned: the retry without what it refused was answered"
        );
    }
}

/// Whose conversation a request is, for the dedup states: a keyed hash of
/// the client's credential headers (never the credential), 0 for none.
pub(super) fn tenant(headers: &HeaderMap) -> u64 {
    let mut who = Vec::new();
    for name in ["authorization", "x-api-key", "api-key", "x-goog-api-key"] {
        if let Some(v) = headers.get(name) {
            who.extend_from_slice(name.as_bytes());
            who.push(0);
            who.extend_from_slice(v.as_bytes());
            who.push(0);
        }
    }
    match who.is_empty() {
        true => 0,
        false => transform::tenant(&who),
    }
}

/// The states a request may continue from and leave its own in (none for
/// a body under [`super::dedup_states::MIN_BODY`] or without dedup), its
/// seed, and what the conversation's previous request left when this body
/// begins with its messages (its prefix hashed here, at memory speed):
/// the walk up to where they end, dedup's state, and the prompt cache's
/// reading.
#[allow(clippy::type_complexity)]
fn continuing(
    rw: &Rewriter,
    body: &[u8],
    plan: &Plan,
    tenant: u64,
    digest: Option<(usize, u128)>,
) -> (
    Option<Arc<super::dedup_states::DedupStates>>,
    u64,
    Option<(transform::walk::Scan, usize)>,
    Option<transform::dedup::State>,
    Option<crate::prompt_cache::Prefixes>,
) {
    let Some(states) = rw
        .dedup_states
        .clone()
        .filter(|_| plan.rules.dedup.is_some() && body.len() >= super::dedup_states::MIN_BODY)
    else {
        // (A small request pays for none of it.)
        return (None, 0, None, None, None);
    };
    let seed = transform::conversation_seed(plan, tenant);
    match states.find(body, seed, digest) {
        Some(r) => (
            Some(states),
            seed,
            Some((r.scan, r.end)),
            Some(r.state),
            r.cache,
        ),
        None => (Some(states), seed, None, None, None),
    }
}

/// The walk of `body`: only what follows `prefix` (the walk of the
/// previous request, up to where its messages end) when there is one; and
/// the dedup `state` that goes with it, when dedup will continue it.
#[allow(clippy::type_complexity)]
fn walk_on(
    prefix: Option<(transform::walk::Scan, usize)>,
    state: Option<transform::dedup::State>,
    body: &[u8],
    plan: &Plan,
) -> Result<(transform::Scanned, Option<transform::dedup::State>), Box<Rewrite>> {
    let mut scanned = match prefix {
        Some((scan, end)) => {
            transform::walk_from(body, plan, scan, end).or_else(|_| transform::walk(body, plan))?
        }
        None => transform::walk(body, plan)?,
    };
    let state = state.filter(|s| scanned.continues(s, body));
    Ok((scanned, state))
}

/// Whether a request walked on the worker is finished on the blocking
/// pool: much text to read (a continued walk's work is its new texts) or
/// images to decode, or a body of several MiB (its copies alone).
fn heavy(walked: &transform::Scanned, body: &[u8]) -> bool {
    walked.work() > INLINE_LIMIT || body.len() > HEAVY_BODY
}

/// What a request carries to its finish to continue its conversation:
/// the states, its seed ([`transform::conversation_seed`]), the state it
/// continues and its walk as it was (before its images were decoded); and
/// where the state it leaves is kept, once it is.
struct Carry {
    states: Option<Arc<super::dedup_states::DedupStates>>,
    seed: u64,
    state: Option<transform::dedup::State>,
    walked: Option<Walked>,
    kept: Arc<OnceLock<u128>>,
    /// The body's digest up to where its messages end, when its check
    /// computed it.
    digest: Option<(usize, u128)>,
}

async fn run(
    rw: &Rewriter,
    body: Bytes,
    plan: Plan,
    credential: &Credentials,
    within: Within,
    (tenant, digests): (u64, super::checked_prefixes::Digests),
) -> Result<Prepared, VisorError> {
    let large = body.len() > INLINE_LIMIT;
    let started = Instant::now();
    // Resolved, and finished at once when there is nothing to describe
    // (one trip to the blocking pool for a large body, not two).
    let b = body.clone();
    let fitter = rw.fitter.clone();
    let metrics = rw.metrics.clone();
    let (states, seed, prefix, state, cache) = continuing(rw, &body, &plan, tenant, digests.before);
    let (conversation, kept) = Continues::new(states.clone(), cache);
    let walk = move |b: &[u8], plan: &Plan| walk_on(prefix, state, b, plan);
    let resolve =
        move |(mut scanned, state): (transform::Scanned, Option<transform::dedup::State>)| {
            // The walk as it is, kept for the next request of the conversation.
            let walked = states.as_ref().map(|_| Walked::of(scanned.scan()));
            scanned.resolve(&b);
            let fits = scanned.fit_jobs(&b, 0, &|q| fitter.quick(q));
            // Over the provider's request bound with no image over its own:
            // the request pass still runs.
            let over = scanned
                .plan()
                .fit
                .max_request_bytes
                .is_some_and(|m| b.len() as u64 > m);
            let subjects: Vec<_> = scanned.subjects(&b).into_iter().map(|(_, s)| s).collect();
            let media = scanned.media(&b);
            let carry = Carry {
                states,
                seed,
                state,
                walked,
                kept,
                digest: digests.now,
            };
            match subjects.is_empty() && media.is_empty() && fits.is_empty() && !over {
                true => Err(Box::new(finish(carry, &metrics, scanned, &b, &[]))),
                false => Ok((scanned, (subjects, media, fits), carry)),
            }
        };
    // The walk skips strings it does not need (a kept image's base64) at
    // memory speed, so a large body for a model that can see is walked here
    // and goes to the blocking pool only when there is real work: images to
    // decode, or much text to dedup.
    let scanned = match large && plan.vision {
        true => match walk(&body, &plan) {
            Err(done) => Some(Err(done)),
            Ok(walked) => off_thread(heavy(&walked.0, &body), move || resolve(walked)).await,
        },
        false => {
            let b = body.clone();
            off_thread(large, move || walk(&b, &plan).and_then(resolve)).await
        }
    }
    .unwrap_or_else(|| Err(Box::default()));
    let mut spent = started.elapsed();
    // Documents and audio whose text could not be made (counted as made).
    let mut failed: Vec<String> = Vec::new();
    let rewrite = match scanned {
        Err(done) => *done,
        Ok((mut scanned, (subjects, media, fits), carry)) => {
            fit_images(rw, &mut scanned, fits, &body, within.stop_at).await;
            let texts = Texts {
                subjects,
                media,
                describe: plan.describe,
                credential,
                within,
            };
            let describing = describe_then_finish(rw, &body, large, (scanned, carry), texts);
            let (described, finishing) = Box::pin(describing).await?;
            spent += finishing;
            failed = described.failed;
            described.rewrite
        }
    };
    rw.metrics.transform_duration.observe(spent.as_secs_f64());
    let Rewrite {
        body: new,
        report,
        artifacts,
    } = rewrite;
    count(&rw.metrics, &report, &failed);
    if let Some(why) = report.skipped {
        tracing::debug!(why, "request body left unchanged");
    }
    let saving = (!artifacts.is_empty()).then(|| save(rw, artifacts));
    Ok(Prepared {
        report,
        saving,
        conversation,
        ..Prepared::unchanged(new.map(Bytes::from).unwrap_or(body), None)
    })
}

/// A request finished: from its conversation's dedup state when one is
/// kept, the state it leaves kept, and how it was read counted.
fn finish(
    carry: Carry,
    metrics: &Metrics,
    scanned: transform::Scanned,
    body: &[u8],
    descriptions: &[(String, Arc<str>)],
) -> Rewrite {
    let Carry {
        states,
        seed,
        state,
        walked,
        kept,
        digest,
    } = carry;
    let (Some(states), Some(walked)) = (states, walked) else {
        return scanned.finish(body, descriptions);
    };
    let (rewrite, left, scan) = scanned.finish_keeping(body, descriptions, state);
    let walked = walked.or(scan);
    let (read, key) = states.kept(body, seed, &rewrite, left, (walked, digest));
    if let Some(key) = key {
        let _ = kept.set(key);
    }
    metrics.dedup_reads.with_label_values(&[read.label()]).inc();
    rewrite
}

/// Kept images fitted to the model: first to its limits, then, when the
/// request would still be over its `max_request_bytes`, its largest images
/// again to byte budgets that take it back within.
async fn fit_images(
    rw: &Rewriter,
    scanned: &mut transform::Scanned,
    fits: Vec<transform::FitJob>,
    body: &Bytes,
    stop_at: Option<Instant>,
) {
    rw.fitter.fit_into(scanned, fits, stop_at).await;
    let Some(max) = scanned.plan().fit.max_request_bytes else {
        return;
    };
    let len = scanned.len_with_fitted(body.len());
    if len <= max {
        return;
    }
    let (mut s, b) = (scanned.clone(), body.clone());
    // A little under the bound: the JSON around each image stays.
    let over = len - max + max / 100;
    let fitter = rw.fitter.clone();
    let again = off_thread(body.len() > INLINE_LIMIT, move || {
        let jobs = s.fit_jobs(&b, over, &|q| fitter.quick(q));
        (s, jobs)
    })
    .await;
    if let Some((s, jobs)) = again {
        *scanned = s;
        rw.fitter.fit_into(scanned, jobs, stop_at).await;
    }
}

/// What a scanned request needs turned into text before it is finished:
/// its images to describe, its documents and audio, and how.
struct Texts<'a> {
    subjects: Vec<Subject>,
    media: Vec<MediaJob>,
    describe: bool,
    credential: &'a Credentials,
    within: Within,
}

/// A request finished with its texts, and the documents and audio whose
/// text could not be made.
struct Described {
    rewrite: Rewrite,
    failed: Vec<String>,
}

/// The images described and the media turned into text (concurrently, by
/// the deadline: what is not done keeps its placeholder), then the request
/// finished with them — again with its documents cut, should their text
/// take it past `server.max_body_bytes`. Also the time spent finishing.
/// Its caller boxes it: its state (9 KB) is then carried only by the
/// requests that have something to describe.
async fn describe_then_finish(
    rw: &Rewriter,
    body: &Bytes,
    large: bool,
    (scanned, carry): (transform::Scanned, Carry),
    texts: Texts<'_>,
) -> Result<(Described, std::time::Duration), VisorError> {
    let Texts {
        subjects,
        media,
        describe: describe_pages,
        credential,
        within,
    } = texts;
    let described = async {
        let d = describe(rw.media.describer(), subjects, &credential.describer);
        media_text::until(within.stop_at, d)
            .await
            .unwrap_or_default()
    };
    let made = media_text::make_within(&rw.media, media, describe_pages, credential, within);
    let (mut descriptions, made) = futures_util::future::join(described, made).await;
    let failed: Vec<String> = made
        .iter()
        .filter(|m| m.action == "stripped")
        .map(|m| m.sha256.clone())
        .collect();
    let documents: Vec<String> = made
        .iter()
        .filter(|m| m.action == "described")
        .map(|m| m.sha256.clone())
        .collect();
    descriptions.extend(made.into_iter().map(|m| (m.sha256, m.text)));
    let finishing = Instant::now();
    // Kept to finish again, should the documents' text take the body past
    // `server.max_body_bytes`.
    let again = (!documents.is_empty()).then(|| (scanned.clone(), descriptions.clone()));
    let b = body.clone();
    let metrics = rw.metrics.clone();
    let mut rewrite = off_thread(large, move || {
        finish(carry, &metrics, scanned, &b, &descriptions)
    })
    .await
    .unwrap_or_default();
    let limit = usize::try_from(rw.max_body_bytes)
        .unwrap_or(usize::MAX)
        .max(body.len());
    if let (Some((scanned, descriptions)), Some(new)) = (again, &rewrite.body)
        && new.len() > limit
    {
        let over = Over {
            body: body.clone(),
            documents,
            limit,
            large,
        };
        rewrite = fit(scanned, descriptions, over, new.len()).await?;
    }
    for sha in &failed {
        rewrite.report.not_converted(sha);
    }
    Ok((Described { rewrite, failed }, finishing.elapsed()))
}

/// A rewrite counted: each image action, the documents and audio left as
/// references (those `failed` were counted as made), the bytes saved by
/// each rule.
fn count(m: &Metrics, report: &Report, failed: &[String]) {
    let mut actions: Vec<(&str, u64)> = Vec::new();
    for n in report.images.iter().filter(|n| n.medium == "image") {
        match actions.iter_mut().find(|(a, _)| *a == n.action) {
            Some((_, count)) => *count += 1,
            None => actions.push((n.action, 1)),
        }
    }
    for (action, count) in actions {
        m.images.with_label_values(&[action]).inc_by(count);
    }
    // Documents and audio turned into text were counted as they were
    // made; references (file ids, URLs, later copies) are counted here.
    for n in report.images.iter().filter(|n| n.medium != "image") {
        let action = match n.action {
            "deduped" => "deduped",
            "stripped" if !failed.contains(&n.sha256) => "stripped",
            _ => continue,
        };
        m.media.with_label_values(&[n.medium, action]).inc();
    }
    // (Resized images save bytes too: counted as the header counts them.)
    if report.images_replaced + report.media_replaced + report.images_resized > 0 {
        let images = report.bytes_saved - report.bytes_saved_dedup;
        m.bytes_saved
            .with_label_values(&["images"])
            .inc_by(images.max(0) as u64);
    }
    if report.lines_omitted + report.items_omitted > 0 {
        m.bytes_saved
            .with_label_values(&["dedup"])
            .inc_by(report.bytes_saved_dedup.max(0) as u64);
    }
}

/// The replaced originals written on the blocking pool, while the request
/// goes upstream.
fn save(rw: &Rewriter, artifacts: Vec<crate::artifacts::Artifact>) -> JoinHandle<()> {
    let store = rw.artifacts.clone();
    let metrics = rw.metrics.clone();
    tokio::task::spawn_blocking(move || {
        if let Err(e) = store.save_all(&artifacts) {
            metrics.artifact_errors.inc();
            tracing::warn!(dir = %store.dir().display(), error = %e, "cannot save replaced images");
        }
    })
}

/// A rewrite whose documents took it past `limit`, to be finished again.
struct Over {
    body: Bytes,
    /// The SHA-256 of each document turned into text.
    documents: Vec<String>,
    limit: usize,
    large: bool,
}

/// Finishes `scanned` again with its documents' text cut, in proportion
/// to each one's length, until the body is within `over.limit` (each cut
/// says so: `server.max_body_bytes`); 413 when even documents cut to
/// their headers do not fit.
async fn fit(
    scanned: transform::Scanned,
    descriptions: Vec<(String, Arc<str>)>,
    over: Over,
    mut len: usize,
) -> Result<Rewrite, VisorError> {
    let chars = |sha: &str| {
        descriptions
            .iter()
            .find(|(s, _)| s == sha)
            .map_or(0, |(_, t)| t.chars().count())
    };
    let total: usize = over.documents.iter().map(|d| chars(d)).sum();
    let mut target = total;
    // A cut line is about a hundred bytes: room for each.
    let notes = 200 * over.documents.len();
    for _ in 0..4 {
        if target == 0 {
            break;
        }
        // Every character cut is at least one byte of the body.
        target = target.saturating_sub(len.saturating_sub(over.limit) + notes);
        let cut: Vec<(String, Arc<str>)> = descriptions
            .iter()
            .map(|(sha, text)| match over.documents.contains(sha) {
                true => {
                    let share = chars(sha).saturating_mul(target) / total.max(1);
                    let text = media_text::cut(text, share, "server.max_body_bytes");
                    (sha.clone(), Arc::from(text))
                }
                false => (sha.clone(), text.clone()),
            })
            .collect();
        let (s, b) = (scanned.clone(), over.body.clone());
        let rewrite = off_thread(over.large, move || s.finish(&b, &cut))
            .await
            .unwrap_or_default();
        match rewrite.body.as_ref().map(Vec::len) {
            Some(n) if n > over.limit => len = n,
            _ => return Ok(rewrite),
        }
    }
    tracing::info!(
        limit = over.limit,
        "documents cut to their headers still take the body past server.max_body_bytes"
    );
    Err(VisorError::BodyTooLarge {
        limit: over.limit as u64,
    })
}

/// Runs `f` on the blocking pool when `large` (a multi-megabyte body must
/// not hold up the worker's other connections), else here. `None` if the
/// blocking task failed.
async fn off_thread<T: Send + 'static>(
    large: bool,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    if large {
        tokio::task::spawn_blocking(f).await.ok()
    } else {
        Some(f())
    }
}

/// A cheap test before keeping a body for a possible retry.
/// Whether the body (`has`: whether it holds a word) may hold a document
/// or audio the model is only assumed to take (no row states it): a
/// refusal can then be learned from.
fn might_hold_media(has: &dyn Fn(&[u8]) -> bool, takes: Takes, caps: &crate::models::Caps) -> bool {
    (takes.pdf
        && caps.pdf.is_none()
        && (has(b"\"file\"") || has(b"\"input_file\"") || has(b"\"document\"")))
        || (takes.audio && caps.audio.is_none() && (has(b"\"input_audio\"") || has(b"\"audio\"")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_matched_as_whole_words() {
        let said = |t: &str| said_word(&t.to_lowercase(), DOCUMENT_REFUSALS);
        assert_eq!(
            said("This model does not support file inputs."),
            Some("does not support file input")
        );
        assert_eq!(
            said("Model does not support PDF."),
            Some("does not support pdf")
        );
        assert_eq!(said("This model does not support file_search tools."), None);
        assert_eq!(said("does not support pdfium"), None);
        assert_eq!(
            said_word("unknown variant `input_audio`, expected", AUDIO_REFUSALS),
            Some("unknown variant `input_audio`")
        );
    }
}
