//! `POST /visor/api/explain`: the dry run inside the running proxy — the
//! body is a request as a client would send it (`?endpoint=chat|responses|
//! messages`, default chat; `?model=` overrides the body's), the answer
//! `{"request": what would be sent, "report": why}` as `visor explain`
//! prints it, with the describer's live caches and the model table as it
//! has learned. Nothing is sent upstream and no describer is called. One
//! runs at a time (another meanwhile: 503 `inspector_busy`), on a blocking
//! thread, under `server.request_timeout_secs`.

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt as _;

use super::AppState;
use super::body::ProxyBody;
use super::edge::refuse;
use super::router::json_owned;
use crate::error::VisorError;
use crate::explain::{self, Texts};
use crate::transform::Shape;
use crate::upstream::RequestBody;

pub async fn answer(state: &AppState, req: Request<RequestBody>) -> Response<ProxyBody> {
    let bad = |why: String| refuse(&state.metrics, VisorError::BadFilter(why));
    let (mut shape, mut model) = (Shape::Chat, None);
    for pair in req
        .uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
    {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let v = crate::inspector::filter::percent_decode(v).unwrap_or_default();
        match (k, v.as_str()) {
            ("endpoint", "chat") => shape = Shape::Chat,
            ("endpoint", "responses") => shape = Shape::Responses,
            ("endpoint", "messages") => shape = Shape::Messages,
            ("endpoint", other) => {
                return bad(format!(
                    "endpoint: {other:?} is not chat, responses or messages"
                ));
            }
            ("model", m) if !m.is_empty() => model = Some(m.to_owned()),
            _ => return bad(format!("{k}: not a parameter of explain (endpoint, model)")),
        }
    }
    let limit = state.server.max_body_bytes as usize;
    let body: Bytes = match http_body_util::Limited::new(req.into_body(), limit)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(_) => {
            return refuse(
                &state.metrics,
                VisorError::BodyTooLarge {
                    limit: state.server.max_body_bytes,
                },
            );
        }
    };
    let probed = match super::request_body::probe(&body) {
        Ok(p) => p,
        Err(e) => return refuse(&state.metrics, VisorError::InvalidJson(e.to_string())),
    };
    let Some(model) = model.or(probed.model) else {
        return bad("the body names no model: give one with ?model=".to_owned());
    };
    let rw = &state.rewrite;
    let resolved = rw.models.resolve(&model, None);
    let plan = explain::plan(
        shape,
        &resolved,
        rw.describes,
        rw.rules
            .for_model(resolved.caps.max_images, resolved.caps.context_window),
        rw.query_aware,
        crate::transform::Limits {
            hoist_text: resolved.known(),
            ..super::prepare::fit_limits(&resolved.caps, rw.fit)
        },
    );
    // One at a time, on a blocking thread (documents are read), under the
    // request timeout; the thread keeps the permit until it is done.
    let Ok(permit) = state.inspector.explaining.clone().try_acquire_owned() else {
        return refuse(
            &state.metrics,
            VisorError::InspectorBusy("an explain is already running"),
        );
    };
    let describer = rw.media.describer().clone();
    let runtime = tokio::runtime::Handle::current();
    let input = body.clone();
    let work = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        runtime.block_on(explain::rewrite(
            &input,
            &plan,
            &Texts::Describer(&describer),
        ))
    });
    let mut rewrite = match tokio::time::timeout(state.server.request_timeout, work).await {
        Ok(Ok(r)) => r,
        Ok(Err(_)) | Err(_) => return refuse(&state.metrics, VisorError::TransformTimeout),
    };
    let upstreams = &state.routes.upstreams;
    let gate = &state.gate;
    let key_name = gate.label(super::headers::Caller::Anonymous, gate.keyless);
    let asked = (
        shape,
        model.as_str(),
        resolved.caps.cache_min_tokens,
        &*key_name,
    );
    explain::with_cache(state.cache.config(), upstreams, asked, &body, &mut rewrite);
    let sent = rewrite.body.as_deref().unwrap_or(&body);
    let request: serde_json::Value = serde_json::from_slice(sent).unwrap_or_default();
    let out = serde_json::json!({
        "request": request,
        "report": explain::report(&model, shape, &resolved, &rewrite, state.store.label().to_owned()),
    });
    json_owned(StatusCode::OK, out.to_string())
}
