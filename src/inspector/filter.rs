//! The filter of `/visor/api/requests` and the page: key, model, upstream,
//! conversation, status, changed, limit — read from a query string.

use super::Summary;

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
            // The page's form sends every field, the empty ones too: an
            // empty field filters nothing.
            let named = [
                "key",
                "model",
                "upstream",
                "conversation",
                "status",
                "limit",
            ];
            if v.is_empty() && named.contains(&k) {
                continue;
            }
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

    pub fn passes(&self, s: &Summary) -> bool {
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

/// A path segment's `%XX` decoded (`+` stays `+`); `None` for a broken
/// escape or bytes that are not UTF-8.
pub fn percent_decode_path(v: &str) -> Option<String> {
    decode(v, false)
}

/// `%XX` and `+` decoded; `None` for a broken escape or bytes that are not
/// UTF-8.
pub fn percent_decode(v: &str) -> Option<String> {
    decode(v, true)
}

fn decode(v: &str, plus_is_space: bool) -> Option<String> {
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
            b'+' if plus_is_space => {
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
        // As the page's form sends it: empty fields filter nothing.
        let f = Filter::parse(Some("key=&model=m&upstream=&conversation=&status=")).unwrap();
        assert_eq!(
            (f.key, f.model.as_deref(), f.upstream, f.status, f.changed),
            (None, Some("m"), None, None, false)
        );
        assert!(Filter::parse(Some("colour=")).is_err());
    }
}
