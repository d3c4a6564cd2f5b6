//! The async edge of the request transforms: reads visor's request headers,
//! resolves the model in the model-spec table, runs the pure transforms
//! ([`crate::transform`]) — off the worker thread for large bodies — saves
//! the replaced images in the background, and records metrics. Nothing here
//! fails a request: a body the transforms cannot walk goes out unchanged.

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;
use http::HeaderMap;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::AppState;
use crate::describe::{Credential, describe};
use crate::error::VisorError;
use crate::transform::{self, Plan, Report, Rewrite, Rules, Shape};
use crate::upstream::UpstreamBody;

/// Bodies larger than this are transformed on the blocking pool, so a
/// multi-megabyte image does not hold up the other connections of a worker.
const INLINE_LIMIT: usize = 256 * 1024;

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
        let flag = |name: &str| {
            headers
                .get(name)
                .map(|v| v.to_str().unwrap_or("?").trim().to_ascii_lowercase())
        };
        let off = match flag("x-visor-transform").as_deref() {
            None | Some("on") => false,
            Some("off") => true,
            Some(_) => {
                return Err(VisorError::BadRequest(
                    "x-visor-transform must be \"off\" (or \"on\")",
                ));
            }
        };
        let vision = match flag("x-visor-vision").as_deref() {
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
}

pub struct Learnable {
    pub shape: Shape,
    pub rules: Rules,
    pub original: Bytes,
    /// For the describer, should the retry describe images.
    pub credential: Credential,
}

/// Who is asking: the client's headers and the upstream the request goes
/// to (the describer may carry the client's credential there).
pub struct Asker<'a> {
    pub headers: &'a HeaderMap,
    pub upstream: usize,
}

impl Prepared {
    pub fn upstream_body(&self) -> UpstreamBody {
        UpstreamBody {
            prefix: VecDeque::from([self.body.clone()]),
            rest: None,
        }
    }
}

pub async fn prepare(
    state: &Arc<AppState>,
    shape: Shape,
    model: Option<&str>,
    body: Bytes,
    opts: Options,
    asker: Asker<'_>,
) -> Prepared {
    let unchanged = |body: Bytes, learn| Prepared {
        body,
        report: Report::default(),
        saving: None,
        learn,
    };
    if opts.off {
        return unchanged(body, None);
    }
    let mut resolved = state.models.resolve(model.unwrap_or(""), opts.vision);
    // A model another replica may have learned (a shared store): asked of
    // the store now, not at the next 30 s refresh, so this request does not
    // pay the refusal round trip again.
    if !resolved.known() && state.store.is_shared() && might_hold_images(&body) {
        let name = crate::models::normalise(model.unwrap_or(""));
        if !name.is_empty() && matches!(state.store.is_learned(&name).await, Ok(true)) {
            state.models.learned.merge([name]);
            resolved = state.models.resolve(model.unwrap_or(""), opts.vision);
        }
    }
    let plan = Plan {
        shape,
        vision: resolved.vision,
        describe: describes(state),
        rules: Rules::new(
            &state.config.images,
            &state.config.dedup,
            resolved.caps.max_images,
        ),
    };
    let credential = match plan.describe {
        true => Credential::for_request(
            &state.describer,
            state.keys.is_set(),
            asker.headers,
            asker.upstream,
        ),
        false => Credential::default(),
    };
    // A model of unknown vision: an upstream refusal of its images can be
    // learned from, once, by sending the original again without them.
    let learn = (!resolved.known() && might_hold_images(&body)).then(|| Learnable {
        shape,
        rules: plan.rules,
        original: body.clone(),
        credential: credential.clone(),
    });
    if !transform::needed(&plan) {
        return unchanged(body, learn);
    }
    let mut prepared = run(state, body, plan, &credential).await;
    prepared.learn = learn;
    prepared
}

/// `images.non_vision = "describe"`
fn describes(state: &AppState) -> bool {
    state.config.non_vision == crate::config::NonVision::Describe
}

/// After an upstream refused images for a model of unknown vision: when its
/// error says so, the body with every image replaced, and the model learned.
pub async fn after_refusal(
    state: &Arc<AppState>,
    learn: &Learnable,
    model: &str,
    error_body: &[u8],
) -> Option<Prepared> {
    let text = String::from_utf8_lossy(error_body).to_lowercase();
    let phrase = state
        .refusal_phrases
        .iter()
        .find(|p| text.contains(p.as_str()))?;
    let plan = Plan {
        shape: learn.shape,
        vision: false,
        describe: describes(state),
        rules: learn.rules,
    };
    let prepared = run(state, learn.original.clone(), plan, &learn.credential).await;
    if !prepared
        .report
        .images
        .iter()
        .any(|n| n.reason == Some(transform::placeholder::Reason::NonVision))
    {
        return None;
    }
    if let Some(name) = state.models.learned.learn(model) {
        state.metrics.capability_learned.inc();
        // A store that is down logged and counted it; the model stays
        // learned in memory.
        let _ = state.store.learn(&name).await;
    }
    tracing::info!(phrase = %phrase, "upstream refused images: retrying once with them replaced; model learned as non-vision");
    Some(prepared)
}

async fn run(state: &Arc<AppState>, body: Bytes, plan: Plan, credential: &Credential) -> Prepared {
    let large = body.len() > INLINE_LIMIT;
    let started = Instant::now();
    // Resolved, and finished at once when there is nothing to describe
    // (one trip to the blocking pool for a large body, not two).
    let b = body.clone();
    let resolve = move |mut scanned: transform::Scanned| {
        scanned.resolve(&b);
        let subjects: Vec<_> = scanned.subjects().into_iter().map(|(_, s)| s).collect();
        match subjects.is_empty() {
            true => Err(Box::new(scanned.finish(&b, &[]))),
            false => Ok((scanned, subjects)),
        }
    };
    // The walk skips strings it does not need (a kept image's base64) at
    // memory speed, so a large body for a model that can see is walked here
    // and goes to the blocking pool only when there is real work: images to
    // decode, or much text to dedup.
    let scanned = match (large && plan.vision).then(|| transform::walk(&body, &plan)) {
        Some(Err(done)) => Some(Err(done)),
        Some(Ok(walked)) => off_thread(walked.work() > INLINE_LIMIT, move || resolve(walked)).await,
        None => {
            let b = body.clone();
            off_thread(large, move || transform::walk(&b, &plan).and_then(resolve)).await
        }
    }
    .unwrap_or_else(|| Err(Box::default()));
    let mut spent = started.elapsed();
    let rewrite = match scanned {
        Err(done) => *done,
        Ok((scanned, subjects)) => {
            let descriptions = describe(&state.describer, subjects, credential).await;
            let finishing = Instant::now();
            let b = body.clone();
            let rewrite = off_thread(large, move || scanned.finish(&b, &descriptions))
                .await
                .unwrap_or_default();
            spent += finishing.elapsed();
            rewrite
        }
    };
    let m = &state.metrics;
    m.transform_duration.observe(spent.as_secs_f64());
    let Rewrite {
        body: new,
        report,
        artifacts,
    } = rewrite;
    let mut actions: Vec<(&str, u64)> = Vec::new();
    for n in &report.images {
        match actions.iter_mut().find(|(a, _)| *a == n.action) {
            Some((_, count)) => *count += 1,
            None => actions.push((n.action, 1)),
        }
    }
    for (action, count) in actions {
        m.images.with_label_values(&[action]).inc_by(count);
    }
    if report.images_replaced > 0 {
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
    if let Some(why) = report.skipped {
        tracing::debug!(why, "request body left unchanged");
    }
    let saving = (!artifacts.is_empty()).then(|| {
        let store = state.artifacts.clone();
        let metrics = state.metrics.clone();
        tokio::task::spawn_blocking(move || {
            if let Err(e) = store.save_all(&artifacts) {
                metrics.artifact_errors.inc();
                tracing::warn!(dir = %store.dir().display(), error = %e, "cannot save replaced images");
            }
        })
    });
    Prepared {
        body: new.map(Bytes::from).unwrap_or(body),
        report,
        saving,
        learn: None,
    }
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
fn might_hold_images(body: &[u8]) -> bool {
    memchr::memmem::find(body, b"image").is_some()
}
