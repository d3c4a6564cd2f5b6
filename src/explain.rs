//! The dry run of a request: what visor would send upstream and why,
//! without sending it and without calling a describer or transcriber.
//! `visor explain` runs it offline (descriptions from the store on disk);
//! `POST /visor/api/explain` runs it inside the proxy, with the describer's
//! live caches and the model table as it has learned.

use std::sync::Arc;

use bytes::Bytes;

use crate::config::upstreams::{Upstream, cache_kind};
use crate::media_text::describe::{Describer, description_key};
use crate::models::Resolved;
use crate::store::Store;
use crate::transform::{self, Plan, Rewrite, Rules, Shape, Takes};

/// Where descriptions already made are found.
pub enum Texts<'a> {
    /// The store alone (`visor explain`; `None`: not readable here), for
    /// the describer's `model`.
    Store(Option<&'a Store>, &'a str),
    /// The running describer's memory, then its store.
    Describer(&'a Describer),
}

impl Texts<'_> {
    async fn lookup(&self, id: &str) -> Option<Arc<str>> {
        match self {
            Texts::Store(store, model) => {
                let text = (*store)?.description(&description_key(id, model)).await;
                text.ok().flatten().map(Arc::from)
            }
            Texts::Describer(d) => d.cached(&description_key(id, d.model())).await,
        }
    }
}

/// The transform plan for a model, as the proxy makes it.
pub fn plan(
    shape: Shape,
    resolved: &Resolved,
    describe: bool,
    rules: Rules,
    query_aware: bool,
    fit: crate::transform::Limits,
) -> Plan {
    Plan {
        shape,
        vision: resolved.vision,
        describe,
        rules,
        takes: Takes {
            pdf: resolved.pdf,
            office: resolved.office,
            audio: resolved.audio,
        },
        query_aware,
        fit,
    }
}

/// The rewrite without calls: descriptions as already made (an image
/// without one shows its placeholder); documents read here (their figures
/// not described); audio not transcribed.
pub async fn rewrite(body: &[u8], plan: &Plan, texts: &Texts<'_>) -> Rewrite {
    let mut scanned = match transform::scan(body, plan) {
        Err(done) => return *done,
        Ok(scanned) => scanned,
    };
    // Kept images fitted here, as the proxy would (its cache aside).
    transform::fit_here(&mut scanned, body);
    let mut descriptions = Vec::new();
    for (_, s) in scanned.subjects(body) {
        let id = transform::subject_key(&s.sha256, s.query.as_deref());
        if let Some(text) = texts.lookup(&id).await {
            descriptions.push((id, text));
        }
    }
    let made: Vec<_> = scanned
        .media(body)
        .iter()
        .map(crate::media_text::offline)
        .collect();
    let failed: Vec<String> = made
        .iter()
        .filter(|m| m.action == "stripped")
        .map(|m| m.sha256.clone())
        .collect();
    descriptions.extend(made.into_iter().map(|m| (m.sha256, m.text)));
    let mut rewrite = scanned.finish(body, &descriptions);
    for sha in &failed {
        rewrite.report.not_converted(sha);
    }
    rewrite
}

/// What the prompt cache adds to what `rewrite` sends, as the proxy does
/// for a request to the first of `upstreams` that takes `model` (none:
/// nothing added): breakpoints on a Messages request to an Anthropic-kind
/// upstream, or a `prompt_cache_key` where the upstream opted in. Asked as
/// for a request that presents no proxy key (`key_name`: what the proxy
/// counts such a request under) and no `x-visor-session` (another key or a
/// session would give another `prompt_cache_key`).
pub fn with_cache(
    cache: &crate::config::Cache,
    upstreams: &[Upstream],
    (shape, model, min_tokens, key_name): (Shape, &str, Option<u32>, &str),
    received: &[u8],
    rewrite: &mut Rewrite,
) {
    let Some(index) = upstreams.iter().position(|u| u.matches(model)) else {
        return;
    };
    let (anthropic_kind, cache_key) = cache_kind(upstreams, index);
    let received = Bytes::copy_from_slice(received);
    let prepared = match &rewrite.body {
        Some(b) => Bytes::copy_from_slice(b),
        None => received.clone(),
    };
    let asked = crate::prompt_cache::Asked {
        shape,
        received: &received,
        prepared: &prepared,
        model,
        key_name,
        session: None,
        anthropic_kind,
        cache_key,
        min_tokens,
        may_change: true,
        continues: None,
        leaves: false,
    };
    if let Some((body, breakpoints)) = crate::prompt_cache::added(cache, asked) {
        rewrite.report.breakpoints = breakpoints;
        rewrite.report.cache_key = shape != Shape::Messages;
        rewrite.body = Some(body.to_vec());
    }
}

/// What the rewrite changed, and why.
pub fn report(
    model: &str,
    shape: Shape,
    resolved: &Resolved,
    rewrite: &Rewrite,
    store: String,
) -> serde_json::Value {
    serde_json::json!({
        "model": model,
        "endpoint": shape,
        "vision": resolved.vision,
        "vision_decided_by": resolved.vision_from.to_string(),
        "changed": rewrite.body.is_some(),
        "images_found": rewrite.report.images_found,
        "images_replaced": rewrite.report.images_replaced,
        "images_described": rewrite.report.images_described,
        "images_resized": rewrite.report.images_resized,
        "pdf": resolved.pdf,
        "office": resolved.office,
        "audio": resolved.audio,
        "media_replaced": rewrite.report.media_replaced,
        "store": store,
        "bytes_saved": rewrite.report.bytes_saved,
        "bytes_saved_dedup": rewrite.report.bytes_saved_dedup,
        "lines_omitted": rewrite.report.lines_omitted,
        "items_omitted": rewrite.report.items_omitted,
        "images": rewrite.report.images,
        "skipped": rewrite.report.skipped,
        "cache_breakpoints": rewrite.report.breakpoints,
        "cache_key": rewrite.report.cache_key,
    })
}
