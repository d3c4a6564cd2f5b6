//! The inspector: what visor did to each recent request. A request's
//! summary is kept in a bounded ring (`[inspector] keep`, newest first;
//! with a shared store also in the replicas' stream), its bodies without
//! their media bytes up to `[inspector] body_bytes`; shown as JSON at
//! `/visor/api/…` and as pages at `/visor/ui` (readable without
//! JavaScript). Recording is one send on a bounded queue at the end of a
//! response; a task does the rest. Never a credential is kept.

pub mod access;
pub mod bodies;
pub mod chart;
pub mod detail;
pub mod filter;
pub mod page;
pub mod savings;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, mpsc};

pub use access::Access;
use access::Gate;
use bodies::{Bodies, Kept};
pub use filter::Filter;
pub use savings::{Prices, Saving};

use crate::config::Inspector as Config;
use crate::store::{Shared, Store};
use crate::transform::Report;

/// What one request was and what visor did to it.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct Summary {
    /// Its `x-request-id`.
    pub id: String,
    /// When it arrived, milliseconds since the Unix epoch.
    pub time_ms: u64,
    /// The replica that served it.
    pub replica: String,
    /// The caller's key name (`none` without one).
    pub key: String,
    /// `/v1/chat/completions`…
    pub endpoint: String,
    pub model: String,
    pub upstream: String,
    pub status: u16,
    /// `complete`, `client_cancelled`, `reset`…
    pub outcome: String,
    pub first_byte_ms: Option<u64>,
    pub total_ms: u64,
    /// From the provider's `usage`, when it said it.
    pub tokens: Option<Tokens>,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub changes: Changes,
    /// The prompt cache, when the request was followed.
    pub cache: Option<CacheSeen>,
    /// The conversation (as the prompt cache follows it), 16 hex digits.
    pub conversation: Option<String>,
    /// The model's prices per million tokens, when the table has them.
    pub prices: Option<Prices>,
    /// What visor saved it.
    pub saving: Saving,
    /// What the provider billed, in dollars (with prices and usage).
    pub cost: Option<f64>,
    /// Whether the replica that served it keeps its bodies.
    pub bodies_kept: bool,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct Tokens {
    pub prompt: u64,
    pub cached_read: u64,
    pub cache_written: u64,
    pub completion: u64,
}

/// What visor changed.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, Default, PartialEq, Eq)]
#[serde(default)]
pub struct Changes {
    pub images_replaced: usize,
    /// Of the replaced images, by what became of each.
    pub images_described: usize,
    pub images_stripped: usize,
    pub images_aged_out: usize,
    pub images_capped: usize,
    pub images_deduped: usize,
    pub media_replaced: usize,
    pub lines_omitted: usize,
    pub items_omitted: usize,
    pub bytes_saved: i64,
    pub history_used: usize,
    pub breakpoints: usize,
    pub prompt_cache_key: bool,
}

impl Changes {
    pub fn any(&self) -> bool {
        *self != Changes::default()
    }

    /// The counts of `report`.
    pub fn of(r: &Report) -> Changes {
        let images = |action: &str| {
            r.images
                .iter()
                .filter(|n| n.medium == "image" && n.action == action)
                .count()
        };
        Changes {
            images_replaced: r.images_replaced,
            images_described: r.images_described,
            images_stripped: images("stripped"),
            images_aged_out: images("aged_out"),
            images_capped: images("capped"),
            images_deduped: images("deduped"),
            media_replaced: r.media_replaced,
            lines_omitted: r.lines_omitted,
            items_omitted: r.items_omitted,
            bytes_saved: r.bytes_saved,
            history_used: r.history_used,
            breakpoints: r.breakpoints,
            prompt_cache_key: r.cache_key,
        }
    }
}

/// The prompt cache as judged and settled.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct CacheSeen {
    pub readable: Option<u64>,
    /// `client at message 3`, `expired`…
    pub miss: Option<String>,
}

/// A finished request on its way to the inspector: its summary, and what
/// the detail is read from later.
pub struct Record {
    pub summary: Summary,
    /// The body as the client sent it (a transformed endpoint's).
    pub client: Option<Bytes>,
    /// The body sent upstream, when visor changed it.
    pub upstream: Option<Bytes>,
    /// What the transforms did.
    pub report: Option<Report>,
}

/// The recording queue's length: past it, a record is dropped (counted),
/// never waited for.
pub const QUEUE: usize = 1024;

/// The recent requests: this replica's, and with a shared store every
/// replica's summaries.
pub struct Inspector {
    pub enabled: bool,
    keep: usize,
    gate: Gate,
    /// This replica's name (`HOSTNAME`, else `local`).
    pub replica: String,
    /// The `[describer]` model, for `described by …`.
    describer: String,
    recent: Mutex<VecDeque<Arc<Summary>>>,
    bodies: Mutex<Bodies>,
    events: broadcast::Sender<Arc<Summary>>,
    queue: OnceLock<mpsc::Sender<Record>>,
    /// Records dropped because the queue was full.
    pub dropped: AtomicU64,
    /// The store the replicas share (`redis://`).
    fleet: OnceLock<Arc<Store>>,
}

impl Inspector {
    /// `listen`: where visor listens; `proxy_keys`: whether clients need a
    /// key (then the inspector does too, an admin one).
    pub fn new(
        config: &Config,
        listen: Option<SocketAddr>,
        proxy_keys: bool,
        describer: &str,
    ) -> Self {
        let loopback = listen.is_some_and(|a| a.ip().is_loopback());
        Inspector {
            enabled: config.enabled,
            keep: config.keep,
            gate: Gate {
                admin_keys: config.admin_keys.clone(),
                open: loopback && !proxy_keys,
            },
            replica: std::env::var("HOSTNAME")
                .ok()
                .filter(|h| !h.is_empty())
                .unwrap_or_else(|| "local".to_owned()),
            describer: describer.to_owned(),
            recent: Mutex::new(VecDeque::new()),
            bodies: Mutex::new(Bodies::new(config.body_bytes)),
            events: broadcast::channel(256).0,
            queue: OnceLock::new(),
            dropped: AtomicU64::new(0),
            fleet: OnceLock::new(),
        }
    }

    /// Starts the task that keeps what is recorded (inside a Tokio
    /// runtime); with a shared store, summaries also go to (and lists come
    /// from) the replicas' stream.
    pub fn start(self: &Arc<Self>, store: Arc<Store>) {
        if !self.enabled {
            return;
        }
        if store.is_shared() {
            let _ = self.fleet.set(store);
        }
        let (tx, mut rx) = mpsc::channel::<Record>(QUEUE);
        if self.queue.set(tx).is_err() {
            return;
        }
        let me = Arc::downgrade(self);
        // Not a tracked task: it holds nothing to finish at shutdown.
        tokio::spawn(async move {
            while let Some(r) = rx.recv().await {
                let Some(me) = me.upgrade() else { return };
                let s = me.keep_record(r);
                if let Some(store) = me.fleet.get()
                    && let Ok(json) = serde_json::to_vec(&*s)
                {
                    let _ = store.publish_summary(json, me.keep).await;
                }
            }
        });
    }

    /// Records a finished request: one send on a bounded queue (kept at
    /// once when no task was started).
    pub fn record(&self, r: Record) {
        if !self.enabled {
            return;
        }
        match self.queue.get() {
            Some(q) => {
                if q.try_send(r).is_err() {
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
            None => {
                self.keep_record(r);
            }
        }
    }

    /// The work recording defers: the saving, the bodies without their
    /// media, the summary kept and sent to whoever watches the events.
    fn keep_record(&self, r: Record) -> Arc<Summary> {
        let Record {
            mut summary,
            client,
            upstream,
            report,
        } = r;
        let report = report.unwrap_or_default();
        let visor_cached = report.breakpoints > 0 || report.cache_key;
        summary.saving = savings::saving(
            &report.images,
            report.bytes_saved_dedup,
            visor_cached,
            &summary,
        );
        summary.cost = savings::cost(&summary);
        let kept = client.as_deref().and_then(bodies::without_media).map(|c| {
            let u = upstream.as_deref().and_then(bodies::without_media);
            let mut k = Kept::new(Some(c), u);
            k.notes = report.images;
            k.history_used = report.history_used;
            k
        });
        if let Some(k) = kept
            && let Ok(mut b) = self.bodies.lock()
        {
            summary.bodies_kept = b.keep(summary.id.clone(), k);
        }
        let s = Arc::new(summary);
        if let Ok(mut r) = self.recent.lock() {
            if r.len() >= self.keep {
                r.pop_back();
            }
            r.push_front(s.clone());
        }
        let _ = self.events.send(s.clone());
        s
    }

    /// Whether a request with these headers may read the inspector: open,
    /// or an admin key as a Bearer token or the sign-in cookie.
    pub fn access(&self, headers: &http::HeaderMap) -> Access {
        self.gate.access(headers, unix_secs())
    }

    /// The sign-in cookie's value for `key`, when it is an admin key.
    pub fn sign_in(&self, key: &str) -> Option<String> {
        self.gate.sign_in(key, unix_secs())
    }

    /// Whether the inspector needs no key here.
    pub fn is_open(&self) -> bool {
        self.gate.open
    }

    /// New summaries as they are kept.
    pub fn events(&self) -> broadcast::Receiver<Arc<Summary>> {
        self.events.subscribe()
    }

    /// The kept summaries, newest first: every replica's through the
    /// shared store, else (or when it fails) this replica's. `bool`: the
    /// fleet's.
    pub async fn all(&self) -> (Vec<Arc<Summary>>, bool) {
        if let Some(store) = self.fleet.get()
            && let Shared::Done(list) = store.recent_summaries(self.keep).await
        {
            let list = list
                .iter()
                .filter_map(|j| serde_json::from_slice::<Summary>(j).ok())
                .map(Arc::new)
                .collect();
            return (list, true);
        }
        let list = self
            .recent
            .lock()
            .map(|r| r.iter().cloned().collect())
            .unwrap_or_default();
        (list, false)
    }

    /// The kept summaries that pass `filter`, newest first, at most
    /// `filter.limit`; `bool`: every replica's.
    pub async fn requests(&self, filter: &Filter) -> (Vec<Arc<Summary>>, bool) {
        let (all, fleet) = self.all().await;
        let list = all
            .into_iter()
            .filter(|s| filter.passes(s))
            .take(filter.limit)
            .collect();
        (list, fleet)
    }

    /// The summary of request `id`, if it is still kept (by any replica).
    pub async fn request(&self, id: &str) -> Option<Arc<Summary>> {
        let local = self
            .recent
            .lock()
            .ok()
            .and_then(|r| r.iter().find(|s| s.id == id).cloned());
        match local {
            Some(s) => Some(s),
            None => self.all().await.0.into_iter().find(|s| s.id == id),
        }
    }

    /// Request `id`'s messages side by side, when this replica keeps its
    /// bodies.
    pub fn detail(&self, s: &Summary) -> Option<Vec<detail::Pair>> {
        let kept = self.bodies.lock().ok()?.get(&s.id)?;
        let shape = crate::api::Shape::of_path(s.endpoint.strip_prefix("/v1")?)?;
        Some(detail::pairs(&detail::Sides {
            shape,
            client: kept.client.as_ref()?,
            upstream: kept.upstream.as_ref(),
            notes: &kept.notes,
            history_used: kept.history_used,
            describer: &self.describer,
        }))
    }

    /// Conversation `id`'s requests, oldest first.
    pub async fn conversation(&self, id: &str) -> Vec<Arc<Summary>> {
        let (all, _) = self.all().await;
        let mut list: Vec<_> = all
            .into_iter()
            .filter(|s| s.conversation.as_deref() == Some(id))
            .collect();
        list.reverse();
        list
    }

    /// The savings over the kept window.
    pub async fn savings(&self) -> savings::Savings {
        let (all, _) = self.all().await;
        savings::savings(all.iter().map(|s| &**s))
    }
}

fn unix_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Secret;

    fn summary(id: &str, key: &str, changed: bool) -> Summary {
        Summary {
            id: id.to_owned(),
            key: key.to_owned(),
            model: "m".to_owned(),
            status: 200,
            changes: Changes {
                images_replaced: usize::from(changed),
                ..Changes::default()
            },
            ..Summary::default()
        }
    }

    fn record(s: Summary) -> Record {
        Record {
            summary: s,
            client: None,
            upstream: None,
            report: None,
        }
    }

    fn inspector(keep: usize, body_bytes: usize, listen: [u8; 4], admin: &[&str]) -> Inspector {
        let config = Config {
            enabled: true,
            keep,
            body_bytes,
            admin_keys: admin.iter().map(|k| Secret::new(*k)).collect(),
        };
        Inspector::new(&config, Some(SocketAddr::from((listen, 8787))), false, "d")
    }

    #[tokio::test]
    async fn keeps_the_newest_first_and_no_more_than_keep() {
        let i = inspector(3, 0, [127, 0, 0, 1], &[]);
        for n in 0..5 {
            i.record(record(summary(&n.to_string(), "a", n % 2 == 0)));
        }
        let ids: Vec<String> = i
            .requests(&Filter::parse(None).unwrap())
            .await
            .0
            .iter()
            .map(|s| s.id.clone())
            .collect();
        assert_eq!(ids, ["4", "3", "2"]);
        assert!(i.request("1").await.is_none() && i.request("3").await.is_some());
        let changed = i
            .requests(&Filter::parse(Some("changed=true&limit=1")).unwrap())
            .await
            .0;
        assert_eq!(changed.len(), 1);
        assert_eq!(changed[0].id, "4");
    }

    #[tokio::test]
    async fn bodies_are_kept_without_media_and_read_side_by_side() {
        let i = inspector(10, 1 << 20, [127, 0, 0, 1], &[]);
        let png = "iVBORw0KGgo".repeat(100);
        let client = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{png}"}}}}]}}]}}"#
        );
        let upstream = r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"[image sha256:7ae32ec79dcb: a chart]"}]}]}"#;
        let mut report = Report::default();
        report.images.push(detail::tests_note("described"));
        let mut s = summary("r1", "a", true);
        s.endpoint = "/v1/chat/completions".to_owned();
        i.record(Record {
            summary: s,
            client: Some(Bytes::from(client)),
            upstream: Some(Bytes::from_static(upstream.as_bytes())),
            report: Some(report),
        });
        let s = i.request("r1").await.unwrap();
        assert!(s.bodies_kept);
        let pairs = i.detail(&s).unwrap();
        assert_eq!(pairs.len(), 1);
        assert!(pairs[0].changed);
        assert_eq!(pairs[0].labels[0].rule, "images");
        let kept = pairs[0].client.as_ref().unwrap().to_string();
        assert!(
            kept.contains("[base64: ") && !kept.contains(&png[..64]),
            "{kept}"
        );
    }

    #[test]
    fn listening_on_every_address_is_not_open() {
        let any = inspector(1, 0, [0, 0, 0, 0], &[]);
        assert!(!any.is_open());
        assert_eq!(any.access(&http::HeaderMap::new()), Access::NotConfigured);
        assert!(inspector(1, 0, [127, 0, 0, 1], &[]).is_open());
    }
}
