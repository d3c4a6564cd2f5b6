//! The page at `/visor/ui`: the recent requests as an HTML table, made on
//! the server (readable without JavaScript), with a filter form. Everything
//! is in the page: no external request, light and dark.

use std::fmt::Write as _;

use super::{Filter, Summary};

const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:1.5rem;color:#1b1b1b;background:#fff}\
table{border-collapse:collapse;width:100%}th,td{padding:.3rem .5rem;border-bottom:1px solid #ddd;text-align:left;vertical-align:top}\
th{position:sticky;top:0;background:#f4f4f4}td.n{text-align:right;font-variant-numeric:tabular-nums}\
.miss{color:#b00020}.changed{font-weight:600}form{margin:0 0 1rem}input,select,button{font:inherit;margin-right:.5rem}\
a{color:#0645ad}a:focus,button:focus,input:focus{outline:2px solid #0645ad}\
@media (prefers-color-scheme:dark){body{color:#e8e8e8;background:#121212}th{background:#1f1f1f}td,th{border-color:#333}a{color:#8ab4f8}.miss{color:#ff8a80}}";

/// Text for HTML, escaped.
fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// The changes as words (`2 images replaced, 14 lines omitted, …`).
pub fn changes_text(s: &Summary) -> String {
    let c = &s.changes;
    let mut parts = Vec::new();
    let mut say = |n: usize, what: &str| {
        if n > 0 {
            parts.push(format!("{n} {what}"));
        }
    };
    say(c.images_replaced, "images replaced");
    say(c.images_described, "described");
    say(c.media_replaced, "documents/audio read");
    say(c.lines_omitted, "lines omitted");
    say(c.items_omitted, "items omitted");
    say(c.history_used, "session messages added");
    say(c.breakpoints, "cache breakpoints added");
    if c.prompt_cache_key {
        parts.push("prompt_cache_key added".to_owned());
    }
    parts.join(", ")
}

fn time_text(ms: u64) -> String {
    let secs = ms / 1000;
    let (h, m, s) = ((secs / 3600) % 24, (secs / 60) % 60, secs % 60);
    format!("{h:02}:{m:02}:{s:02} UTC")
}

/// The whole page.
pub fn requests(list: &[std::sync::Arc<Summary>], filter: &Filter, replica: &str) -> String {
    let mut h = String::with_capacity(4096 + list.len() * 512);
    let _ = write!(
        h,
        "<!doctype html><html lang=en><head><meta charset=utf-8>\
         <meta name=viewport content=\"width=device-width,initial-scale=1\">\
         <title>visor — requests</title><style>{STYLE}</style></head><body>\
         <h1>Requests</h1><p>Newest first, as kept by replica <b>{}</b>. \
         JSON: <a href=\"/visor/api/requests\">/visor/api/requests</a>.</p>",
        esc(replica)
    );
    let field = |name: &str, value: &Option<String>| {
        format!(
            "<label>{name} <input name={name} value=\"{}\" size=12></label>",
            esc(value.as_deref().unwrap_or(""))
        )
    };
    let _ = write!(
        h,
        "<form method=get action=/visor/ui>{}{}{}{}<label>status <input name=status value=\"{}\" size=4></label>\
         <label><input type=checkbox name=changed value=true{}> changed</label><button>Filter</button></form>",
        field("key", &filter.key),
        field("model", &filter.model),
        field("upstream", &filter.upstream),
        field("conversation", &filter.conversation),
        filter.status.map(|s| s.to_string()).unwrap_or_default(),
        if filter.changed { " checked" } else { "" },
    );
    if list.is_empty() {
        h.push_str("<p>No request yet.</p></body></html>");
        return h;
    }
    h.push_str(
        "<table><thead><tr><th>time</th><th>key</th><th>model → upstream</th><th>status</th>\
         <th>first byte / total ms</th><th>tokens (prompt, cache read, written, completion)</th>\
         <th>bytes in → out</th><th>changes</th><th>cache</th></tr></thead><tbody>",
    );
    for s in list {
        row(&mut h, s);
    }
    h.push_str("</tbody></table></body></html>");
    h
}

fn row(h: &mut String, s: &Summary) {
    let tokens = s.tokens.map_or("—".to_owned(), |t| {
        format!(
            "{}, {}, {}, {}",
            t.prompt, t.cached_read, t.cache_written, t.completion
        )
    });
    let cache = match &s.cache {
        Some(c) => {
            let readable = c.readable.map_or("?".to_owned(), |r| r.to_string());
            match &c.miss {
                Some(m) => format!(
                    "readable {readable}; <span class=miss>miss: {}</span>",
                    esc(m)
                ),
                None => format!("readable {readable}"),
            }
        }
        None => "—".to_owned(),
    };
    let changes = changes_text(s);
    let _ = write!(
        h,
        "<tr><td><a href=\"/visor/api/requests/{id}\">{time}</a></td><td>{key}</td><td>{model} → {upstream}</td>\
         <td class=n>{status}</td><td class=n>{fb} / {total}</td><td class=n>{tokens}</td>\
         <td class=n>{bin} → {bout}</td><td{cls}>{changes}</td><td>{cache}</td></tr>",
        id = esc(&s.id),
        time = time_text(s.time_ms),
        key = esc(&s.key),
        model = esc(&s.model),
        upstream = esc(&s.upstream),
        status = s.status,
        fb = s.first_byte_ms.map_or("—".to_owned(), |v| v.to_string()),
        total = s.total_ms,
        bin = s.bytes_in,
        bout = s.bytes_out,
        cls = if s.changes.any() {
            " class=changed"
        } else {
            ""
        },
        changes = if changes.is_empty() {
            "—".to_owned()
        } else {
            esc(&changes)
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_says_what_changed_and_escapes_what_the_client_named() {
        let s = Summary {
            id: "req_1".into(),
            model: "<script>".into(),
            key: "team-a".into(),
            changes: super::super::Changes {
                images_replaced: 2,
                lines_omitted: 14,
                breakpoints: 2,
                ..Default::default()
            },
            ..Summary::default()
        };
        let page = requests(&[std::sync::Arc::new(s)], &Filter::default(), "r1");
        assert!(page.contains("2 images replaced, 14 lines omitted, 2 cache breakpoints added"));
        assert!(page.contains("&lt;script&gt;") && !page.contains("<script>"));
        assert!(
            !page.contains("http://") && !page.contains("https://"),
            "no external request"
        );
    }
}
