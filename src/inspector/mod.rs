//! The inspector: what visor did to each recent request, kept as a
//! summary in a bounded ring (`[inspector] keep`, newest first) and shown as
//! JSON at `/visor/api/requests` and as a page at `/visor/ui` (readable
//! without JavaScript). Recording is one short lock and a push, at the end
//! of a response; nothing of a request's body, and never a credential, is
//! kept.

pub mod page;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use serde::Serialize;

use crate::config::{Inspector as Config, Secret};

/// What one request was and what visor did to it.
#[derive(Debug, Clone, Serialize, Default)]
pub struct Summary {
    /// Its `x-request-id`.
    pub id: String,
    /// When it arrived, milliseconds since the Unix epoch.
    pub time_ms: u64,
    /// The replica that served it.
    pub replica: String,
    /// The caller's key name (`none` without one).
    pub key: String,
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
}

#[derive(Debug, Clone, Copy, Serialize, Default, PartialEq, Eq)]
pub struct Tokens {
    pub prompt: u64,
    pub cached_read: u64,
    pub cache_written: u64,
    pub completion: u64,
}

/// What visor changed.
#[derive(Debug, Clone, Copy, Serialize, Default, PartialEq, Eq)]
pub struct Changes {
    pub images_replaced: usize,
    pub images_described: usize,
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
}

/// The prompt cache as judged and settled.
#[derive(Debug, Clone, Serialize, Default, PartialEq, Eq)]
pub struct CacheSeen {
    pub readable: Option<u64>,
    /// `client at message 3`, `expired`…
    pub miss: Option<String>,
}

/// The recent requests of this replica.
pub struct Inspector {
    pub enabled: bool,
    keep: usize,
    admin_keys: Vec<Secret>,
    /// Open without a key: a loopback listener and no proxy keys.
    open: bool,
    /// This replica's name (`HOSTNAME`, else `local`).
    pub replica: String,
    recent: Mutex<VecDeque<Arc<Summary>>>,
}

/// Who may read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Granted,
    /// No admin key sent, or a wrong one.
    Unauthorized,
    /// Not open, and no admin key configured.
    NotConfigured,
}

impl Inspector {
    /// `listen`: where visor listens; `proxy_keys`: whether clients need a
    /// key (then the inspector does too, an admin one).
    pub fn new(config: &Config, listen: Option<SocketAddr>, proxy_keys: bool) -> Self {
        let loopback = listen.is_some_and(|a| a.ip().is_loopback());
        Inspector {
            enabled: config.enabled,
            keep: config.keep,
            admin_keys: config.admin_keys.clone(),
            open: loopback && !proxy_keys,
            replica: std::env::var("HOSTNAME")
                .ok()
                .filter(|h| !h.is_empty())
                .unwrap_or_else(|| "local".to_owned()),
            recent: Mutex::new(VecDeque::new()),
        }
    }

    /// Keeps `s` as the newest (the oldest goes past `keep`).
    pub fn record(&self, s: Summary) {
        if !self.enabled {
            return;
        }
        let s = Arc::new(s);
        if let Ok(mut r) = self.recent.lock() {
            if r.len() >= self.keep {
                r.pop_back();
            }
            r.push_front(s);
        }
    }

    /// Whether a request with these headers may read the inspector: open,
    /// or `Authorization: Bearer <admin key>` (or the sign-in cookie).
    pub fn access(&self, headers: &http::HeaderMap) -> Access {
        if self.open {
            return Access::Granted;
        }
        if self.admin_keys.is_empty() {
            return Access::NotConfigured;
        }
        let bearer = headers
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        let granted = bearer.is_some_and(|b| {
            self.admin_keys
                .iter()
                .any(|k| constant_time_eq(k.expose().as_bytes(), b.as_bytes()))
        });
        match granted {
            true => Access::Granted,
            false => Access::Unauthorized,
        }
    }

    /// The kept summaries that pass `filter`, newest first, at most
    /// `filter.limit`.
    pub fn requests(&self, filter: &Filter) -> Vec<Arc<Summary>> {
        let Ok(r) = self.recent.lock() else {
            return Vec::new();
        };
        r.iter()
            .filter(|s| filter.passes(s))
            .take(filter.limit)
            .cloned()
            .collect()
    }

    /// The summary of request `id`, if it is still kept.
    pub fn request(&self, id: &str) -> Option<Arc<Summary>> {
        let r = self.recent.lock().ok()?;
        r.iter().find(|s| s.id == id).cloned()
    }
}

/// Compares two secrets in time that does not depend on where they differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `/visor/api/requests?key=&model=&upstream=&conversation=&status=&changed=&limit=`
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    pub key: Option<String>,
    pub model: Option<String>,
    pub upstream: Option<String>,
    pub conversation: Option<String>,
    pub status: Option<u16>,
    /// Only requests visor changed.
    pub changed: bool,
    pub limit: usize,
}

/// The most summaries one answer lists.
pub const MAX_LIMIT: usize = 1000;

impl Filter {
    /// From a query string; `Err` names the parameter that is wrong.
    pub fn parse(query: Option<&str>) -> Result<Filter, String> {
        let mut f = Filter {
            limit: 100,
            ..Filter::default()
        };
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let v = percent_decode(v).ok_or_else(|| format!("{k}: not valid percent-encoding"))?;
            match k {
                "key" => f.key = Some(v),
                "model" => f.model = Some(v),
                "upstream" => f.upstream = Some(v),
                "conversation" => f.conversation = Some(v),
                "status" => {
                    f.status = Some(
                        v.parse()
                            .map_err(|_| format!("status: {v:?} is not a status code"))?,
                    )
                }
                "changed" => f.changed = matches!(v.as_str(), "" | "true" | "1"),
                "limit" => {
                    let n: usize = v
                        .parse()
                        .map_err(|_| format!("limit: {v:?} is not a number"))?;
                    f.limit = n.clamp(1, MAX_LIMIT);
                }
                _ => {
                    return Err(format!(
                        "{k}: not a filter (key, model, upstream, conversation, status, changed, limit)"
                    ));
                }
            }
        }
        Ok(f)
    }

    fn passes(&self, s: &Summary) -> bool {
        let is = |want: &Option<String>, have: &str| want.as_deref().is_none_or(|w| w == have);
        is(&self.key, &s.key)
            && is(&self.model, &s.model)
            && is(&self.upstream, &s.upstream)
            && self
                .conversation
                .as_deref()
                .is_none_or(|c| s.conversation.as_deref() == Some(c))
            && self.status.is_none_or(|st| st == s.status)
            && (!self.changed || s.changes.any())
    }
}

/// `%XX` and `+` decoded; `None` for a broken escape or bytes that are not
/// UTF-8.
fn percent_decode(v: &str) -> Option<String> {
    let b = v.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

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

    fn inspector(keep: usize, open: bool, admin: &[&str]) -> Inspector {
        let config = Config {
            enabled: true,
            keep,
            admin_keys: admin.iter().map(|k| Secret::new(*k)).collect(),
        };
        let listen = Some(SocketAddr::from(([127, 0, 0, 1], 8787)));
        Inspector::new(&config, listen, !open)
    }

    #[test]
    fn keeps_the_newest_first_and_no_more_than_keep() {
        let i = inspector(3, true, &[]);
        for n in 0..5 {
            i.record(summary(&n.to_string(), "a", n % 2 == 0));
        }
        let ids: Vec<String> = i
            .requests(&Filter::parse(None).unwrap())
            .iter()
            .map(|s| s.id.clone())
            .collect();
        assert_eq!(ids, ["4", "3", "2"]);
        assert!(i.request("1").is_none() && i.request("3").is_some());
        let changed = i.requests(&Filter::parse(Some("changed=true&limit=1")).unwrap());
        assert_eq!(changed.len(), 1);
        assert_eq!(changed[0].id, "4");
    }

    #[test]
    fn filters_read_from_the_query() {
        let f = Filter::parse(Some("key=team%20a&status=200&limit=99999&changed")).unwrap();
        assert_eq!(f.key.as_deref(), Some("team a"));
        assert_eq!((f.status, f.limit, f.changed), (Some(200), MAX_LIMIT, true));
        assert!(
            Filter::parse(Some("status=abc"))
                .unwrap_err()
                .starts_with("status")
        );
        assert!(
            Filter::parse(Some("colour=red"))
                .unwrap_err()
                .starts_with("colour")
        );
        assert!(Filter::parse(Some("key=%zz")).is_err());
    }

    #[test]
    fn open_on_loopback_without_keys_else_an_admin_key() {
        let mut h = http::HeaderMap::new();
        assert_eq!(inspector(1, true, &[]).access(&h), Access::Granted);
        assert_eq!(inspector(1, false, &[]).access(&h), Access::NotConfigured);
        let closed = inspector(1, false, &["adm-1"]);
        assert_eq!(closed.access(&h), Access::Unauthorized);
        h.insert(http::header::AUTHORIZATION, "Bearer adm-2".parse().unwrap());
        assert_eq!(closed.access(&h), Access::Unauthorized);
        h.insert(http::header::AUTHORIZATION, "Bearer adm-1".parse().unwrap());
        assert_eq!(closed.access(&h), Access::Granted);
        // Listening on every address is not open.
        let config = Config {
            enabled: true,
            keep: 1,
            admin_keys: Vec::new(),
        };
        let any = Inspector::new(&config, Some(SocketAddr::from(([0, 0, 0, 0], 8787))), false);
        assert_eq!(any.access(&http::HeaderMap::new()), Access::NotConfigured);
    }
}
