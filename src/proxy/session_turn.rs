//! The async edge of sessions (`x-visor-session`; Chat Completions,
//! Responses and Anthropic Messages): reads
//! the history before the request goes upstream and merges it in
//! ([`open`]), then records the reply as the response passes
//! ([`Recorder`]) and appends the request's new messages with it — before
//! the response's last bytes are released, so the next request in the
//! session sees it.
//!
//! What is stored: the client's new non-system messages and the assistant
//! reply (text and tool calls; assembled from the stream when streaming).
//! When the upstream answers with an error, the stream is cut, or the client
//! goes away first, the new messages are stored without a reply (nothing the
//! user sent is lost, and no partial reply passes for a whole one).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;
use serde_json::Value;
use tokio_util::task::TaskTracker;

use super::headers::{ProxyKeys, X_VISOR_HISTORY, X_VISOR_SESSION};
use crate::api::{self, StreamedReply};
use crate::error::VisorError;
use crate::metrics::Metrics;
use crate::sessions;
use crate::store::Store;
use crate::transform::Shape;

/// Largest non-stream answer read for its reply.
const MAX_JSON_REPLY: usize = 4 * 1024 * 1024;

/// A request in a session, once merged: where its messages go.
pub struct Opened {
    /// The request body with the history in it.
    pub body: Bytes,
    pub history_used: usize,
    /// Before which of the client's messages the history went.
    pub history_at: usize,
    pub recorder: Recorder,
}

/// The session header of a request, if any: `Ok(None)` without one.
pub fn requested(headers: &HeaderMap) -> Result<Option<String>, VisorError> {
    let Some(v) = headers.get(&X_VISOR_SESSION) else {
        return Ok(None);
    };
    let id = v
        .to_str()
        .map_err(|_| VisorError::BadRequest(sessions::BAD_ID))?
        .trim();
    sessions::valid_id(id).map_err(bad)?;
    Ok(Some(id.to_owned()))
}

/// Checks `x-visor-history` on a request to a transformed endpoint, with
/// or without `x-visor-session`: when sent, it is a whole number (400
/// otherwise).
pub fn check_history(headers: &HeaderMap) -> Result<(), VisorError> {
    history_depth(headers, 0, 0).map(|_| ())
}

/// The history depth `x-visor-history` asks for (see [`sessions::depth`]).
fn history_depth(
    headers: &HeaderMap,
    default_depth: usize,
    max_depth: usize,
) -> Result<usize, VisorError> {
    let header = headers
        .get(&X_VISOR_HISTORY)
        .map(|v| v.to_str().unwrap_or("?"));
    sessions::depth(header, default_depth, max_depth).map_err(bad)
}

fn bad(e: sessions::BadHeader) -> VisorError {
    VisorError::BadRequest(e.0)
}

/// Conversations kept by visor: where they are stored, how long, how many
/// messages, and whose they are. Cheap to clone (each turn's recorder
/// holds one).
#[derive(Clone)]
pub struct Sessions {
    pub store: Arc<Store>,
    /// Whose a session is: the proxy key the client presents.
    keys: Arc<ProxyKeys>,
    metrics: Arc<Metrics>,
    /// Where a turn still being stored when its client left runs (shutdown
    /// waits for it).
    tasks: TaskTracker,
    /// `sessions.default_depth`.
    default_depth: usize,
    /// `sessions.max_depth`: messages kept per session.
    pub max_depth: usize,
    /// `sessions.idle_ttl_secs`.
    pub ttl: Duration,
}

impl Sessions {
    pub fn new(
        settings: &crate::config::Sessions,
        store: Arc<Store>,
        keys: Arc<ProxyKeys>,
        metrics: Arc<Metrics>,
        tasks: TaskTracker,
    ) -> Self {
        Sessions {
            store,
            keys,
            metrics,
            tasks,
            default_depth: settings.default_depth as usize,
            max_depth: settings.max_depth as usize,
            ttl: settings.idle_ttl,
        }
    }

    /// The store key of session `id` for the client of `headers`.
    pub fn key(&self, headers: &HeaderMap, id: &str) -> String {
        sessions::store_key(self.keys.key_id(headers).as_deref(), id)
    }

    /// Reads session `id`'s history and merges the request's messages into
    /// it.
    pub async fn open(
        &self,
        shape: Shape,
        headers: &HeaderMap,
        id: &str,
        body: &Bytes,
    ) -> Result<Opened, VisorError> {
        open(self, shape, headers, id, body).await
    }
}

async fn open(
    state: &Sessions,
    shape: Shape,
    headers: &HeaderMap,
    id: &str,
    body: &Bytes,
) -> Result<Opened, VisorError> {
    let depth = history_depth(headers, state.default_depth, state.max_depth)?;
    let mut request: Value =
        serde_json::from_slice(body).map_err(|e| VisorError::InvalidJson(e.to_string()))?;
    let items = shape.items_key();
    let as_array = matches!(request.get(items), Some(Value::Array(_)));
    let messages = match request.get_mut(items).map(Value::take) {
        Some(Value::Array(m)) => m,
        // Responses: a string input is one user message.
        Some(Value::String(text)) if shape == Shape::Responses => {
            vec![serde_json::json!({"role": "user", "content": text})]
        }
        _ => {
            return Err(VisorError::BadRequest(
                "a request with x-visor-session needs its messages as an array (`messages`, or `input` for Responses)",
            ));
        }
    };
    let key = state.key(headers, id);
    // Enough of the stored tail to find what the client re-sent, and the
    // history to prepend.
    let want = depth.max(messages.len());
    let stored = match state.store.session(&key, want, state.ttl).await {
        Ok(s) => s.unwrap_or_default(),
        Err(e) => return Err(VisorError::StoreUnavailable(e.to_string())),
    };
    // Each stored message as its bytes (what the upstream was sent) and its
    // value (what the merge compares).
    let (stored_raw, stored): (Vec<Bytes>, Vec<Value>) = stored
        .into_iter()
        .filter_map(|b| serde_json::from_slice(&b).ok().map(|v| (b, v)))
        .unzip();
    let merged = sessions::merge(&messages, &stored, depth);
    if merged.answers_again(&messages) {
        return Err(VisorError::BadRequest(
            "x-visor-session: a tool result in this request answers a call the session already holds an answer to (the provider would get two results for one call)",
        ));
    }
    state
        .metrics
        .session_history
        .observe(merged.history_used as f64);
    let new = new_messages(body, items, as_array, &messages, &merged);
    let body = merged_body(body, items, as_array, &stored_raw, &merged, || {
        request[items] = Value::Array(merged.messages(&messages));
        serde_json::to_vec(&request)
    })?;
    Ok(Opened {
        body,
        history_used: merged.history_used,
        history_at: merged.at,
        recorder: Recorder {
            state: state.clone(),
            shape,
            key,
            new,
            reply: Reply::Waiting,
            done: false,
        },
    })
}

/// The request's new messages, to store: each as the client's bytes (its
/// key order, its spacing), so sending them again later changes nothing.
fn new_messages(
    body: &Bytes,
    items: &str,
    as_array: bool,
    messages: &[Value],
    merged: &sessions::Merged,
) -> Vec<Bytes> {
    let ranges = as_array
        .then(|| sessions::item_ranges(body, items))
        .flatten()
        .filter(|r| r.len() == messages.len());
    merged
        .new
        .iter()
        .zip(&merged.new_at)
        .filter_map(|(m, &i)| match ranges.as_ref().and_then(|r| r.get(i)) {
            // A copy: a slice would keep the whole request body alive in the
            // memory store.
            Some(r) => Some(Bytes::copy_from_slice(&body[r.clone()])),
            None => serde_json::to_vec(m).ok().map(Bytes::from),
        })
        .collect()
}

/// The body with the history in it. The client's messages go as they came:
/// its bytes untouched when nothing is inserted, the history spliced in
/// otherwise — each stored message as the bytes it was stored as, which are
/// the bytes its client sent (a reply: as visor wrote it), so the prefix a
/// provider cached last turn is sent again byte for byte, less the cache
/// markers its client placed on it then (they belong to that request, and
/// would pile up). `rebuilt`: the body made anew, when it cannot be spliced.
fn merged_body(
    body: &Bytes,
    items: &str,
    as_array: bool,
    stored_raw: &[Bytes],
    merged: &sessions::Merged,
    rebuilt: impl FnOnce() -> serde_json::Result<Vec<u8>>,
) -> Result<Bytes, VisorError> {
    // Nothing inserted: the body as it came (a Responses string `input`
    // stays a string).
    if merged.history.is_empty() {
        return Ok(body.clone());
    }
    let unmarked: Vec<Option<Vec<u8>>> = stored_raw
        .iter()
        .skip(merged.history_from)
        .take(merged.history_used)
        .map(|b| sessions::without_cache_markers(b))
        .collect();
    let history_raw: Vec<&[u8]> = stored_raw
        .iter()
        .skip(merged.history_from)
        .zip(&unmarked)
        .map(|(b, u)| u.as_deref().unwrap_or(&b[..]))
        .collect();
    if let Some(spliced) = as_array
        .then(|| sessions::insert_items(body, items, merged.at, &history_raw))
        .flatten()
    {
        return Ok(Bytes::from(spliced));
    }
    rebuilt()
        .map(Bytes::from)
        .map_err(|e| VisorError::InvalidJson(e.to_string()))
}

enum Reply {
    /// The response head has not been seen.
    Waiting,
    /// A JSON answer, kept by reference until it ends.
    Json(Vec<Bytes>, usize),
    /// An event stream, assembled as it passes.
    Stream(Box<StreamedReply>),
    /// An error answer, or a body that cannot be read: no reply.
    None,
}

/// Records one request's turn in its session.
pub struct Recorder {
    state: Sessions,
    shape: Shape,
    key: String,
    new: Vec<Bytes>,
    reply: Reply,
    done: bool,
}

/// The append of a finished turn, to be awaited before the response's last
/// bytes go out: true when the turn is stored.
pub type Storing = Pin<Box<dyn Future<Output = bool> + Send>>;

impl Recorder {
    /// Where work this turn leaves behind runs (tracked until shutdown).
    pub fn tasks(&self) -> TaskTracker {
        self.state.tasks.clone()
    }

    /// The response head: what kind of body carries the reply.
    pub fn head(&mut self, status: http::StatusCode, headers: &HeaderMap) {
        let sse = headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|t| t.starts_with("text/event-stream"));
        self.reply = match (status.is_success(), sse) {
            (false, _) => Reply::None,
            (true, true) => Reply::Stream(Box::new(StreamedReply::new(self.shape))),
            (true, false) => Reply::Json(Vec::new(), 0),
        };
    }

    pub fn observe(&mut self, data: &Bytes) {
        match &mut self.reply {
            Reply::Json(chunks, len) => {
                *len += data.len();
                if *len > MAX_JSON_REPLY {
                    self.reply = Reply::None;
                } else {
                    chunks.push(data.clone());
                }
            }
            Reply::Stream(s) => s.observe(data),
            Reply::Waiting | Reply::None => {}
        }
    }

    /// True once a stream's reply is whole (its last event passed): the
    /// chunk that completed it is held until the turn is stored.
    pub fn stream_complete(&self) -> bool {
        matches!(&self.reply, Reply::Stream(s) if s.complete)
    }

    /// The turn to store (once): the new messages, and the reply when the
    /// response ended whole (`whole`).
    pub fn finish(&mut self, whole: bool) -> Option<Storing> {
        if self.done {
            return None;
        }
        self.done = true;
        let reply = match (&self.reply, whole) {
            (Reply::Json(chunks, _), true) => api::reply_from_json(self.shape, &chunks.concat()),
            (Reply::Stream(s), _) => s.reply(),
            _ => Vec::new(),
        };
        let mut turn = std::mem::take(&mut self.new);
        let result = match reply.is_empty() {
            true => "without_reply",
            false => "with_reply",
        };
        turn.extend(
            reply
                .iter()
                .filter_map(|r| serde_json::to_vec(r).ok().map(Bytes::from)),
        );
        if turn.is_empty() {
            return None;
        }
        let state = self.state.clone();
        let key = std::mem::take(&mut self.key);
        Some(Box::pin(async move {
            let keep = state.max_depth;
            let stored = state
                .store
                .append_session(&key, turn, keep, state.ttl)
                .await;
            let ok = stored.is_ok();
            let result = match stored {
                Ok(()) => result,
                Err(e) => {
                    tracing::warn!(error = %e, "session turn could not be stored");
                    "failed"
                }
            };
            state
                .metrics
                .session_turns
                .with_label_values(&[result])
                .inc();
            ok
        }))
    }
}

impl Drop for Recorder {
    /// The client went away (or the response failed) before the turn was
    /// stored: its new messages are stored without a reply.
    fn drop(&mut self) {
        if let Some(storing) = self.finish(false)
            && tokio::runtime::Handle::try_current().is_ok()
        {
            self.state.tasks.spawn(storing);
        }
    }
}
