//! The inspector's pages, made on the server (readable without
//! JavaScript; a small same-origin script only adds live rows): the recent
//! requests with a filter form, one request side by side, a conversation,
//! the savings, the sign-in form. No external request, light and dark,
//! every control reachable by keyboard.

use std::fmt::Write as _;
use std::sync::Arc;

use super::chart::{Series, stacked};
use super::detail::Pair;
use super::savings::{Savings, Sums};
use super::{Filter, Summary};

const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:1.5rem;color:#1b1b1b;background:#fff}\
table{border-collapse:collapse;width:100%}th,td{padding:.3rem .5rem;border-bottom:1px solid #ddd;text-align:left;vertical-align:top}\
th{position:sticky;top:0;background:#f4f4f4}td.n{text-align:right;font-variant-numeric:tabular-nums}\
.miss{color:#b00020}.changed{font-weight:600}form{margin:0 0 1rem}input,select,button{font:inherit;margin-right:.5rem}\
a{color:#0645ad}a:focus,button:focus,input:focus,summary:focus{outline:2px solid #0645ad}\
nav{margin:0 0 1rem}nav a{margin-right:1rem}pre{white-space:pre-wrap;word-break:break-word;margin:0;font:12px/1.35 ui-monospace,monospace}\
.pair{display:grid;grid-template-columns:1fr 1fr;gap:.75rem;border-top:1px solid #ddd;padding:.5rem 0}.pair h3{grid-column:1/3;margin:0;font-size:14px}\
.label{display:inline-block;background:#fff3cd;color:#1b1b1b;border-radius:3px;padding:0 .35rem;margin:0 .35rem .2rem 0}\
figure{display:inline-block;margin:.25rem .5rem .25rem 0}figure img{max-width:160px;max-height:120px;border:1px solid #ccc}\
.legend i{display:inline-block;width:.8em;height:.8em;margin:0 .3em 0 .6em}.chart{max-width:60rem;height:180px}\
dl{display:grid;grid-template-columns:max-content 1fr;gap:.15rem 1rem}dt{font-weight:600}\
@media (prefers-color-scheme:dark){body{color:#e8e8e8;background:#121212}th{background:#1f1f1f}td,th,.pair{border-color:#333}a{color:#8ab4f8}.miss{color:#ff8a80}.label{background:#5c4b00;color:#fff}}";

/// Text for HTML, escaped.
pub fn esc(s: &str) -> String {
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

/// Text for a URL path segment: every byte but the unreserved ones
/// percent-encoded (safe in an attribute as it is).
pub fn pct(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
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
    say(c.images_stripped, "stripped");
    say(c.images_aged_out, "aged out");
    say(c.images_capped, "capped");
    say(c.images_deduped, "deduped");
    say(c.images_resized, "images resized");
    say(c.images_hoisted, "base64 images sent as images");
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

/// The page's head, its title and the navigation.
fn open(h: &mut String, title: &str, live: bool) {
    let _ = write!(
        h,
        "<!doctype html><html lang=en><head><meta charset=utf-8>\
         <meta name=viewport content=\"width=device-width,initial-scale=1\">\
         <title>visor — {t}</title><style>{STYLE}</style>{script}</head><body>\
         <nav aria-label=inspector><a href=/visor/ui>Requests</a><a href=/visor/ui/savings>Savings</a>\
         <a href=/visor/api/requests>JSON</a></nav><h1>{t}</h1>",
        t = esc(title),
        script = if live {
            "<script src=/visor/ui/live.js defer></script>"
        } else {
            ""
        },
    );
}

fn money(m: Option<f64>) -> String {
    match m {
        Some(m) if m.abs() >= 0.01 => format!("${m:.2}"),
        Some(m) => format!("${m:.4}"),
        None => "—".to_owned(),
    }
}

fn opt(v: Option<u64>) -> String {
    v.map_or("—".to_owned(), |v| v.to_string())
}

/// The recent requests.
pub fn requests(list: &[Arc<Summary>], filter: &Filter, replica: &str, fleet: bool) -> String {
    let mut h = String::with_capacity(4096 + list.len() * 600);
    open(&mut h, "Requests", true);
    let whose = match fleet {
        true => "every replica (the shared store's stream)".to_owned(),
        false => format!("replica <b>{}</b>", esc(replica)),
    };
    let _ = write!(
        h,
        "<p>Newest first, as kept by {whose}. <span id=live></span></p>"
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
        h.push_str("<p id=none>No request yet.</p>");
    }
    h.push_str(
        "<table id=requests><thead><tr><th>time</th><th>replica</th><th>key</th><th>model → upstream</th><th>status</th>\
         <th>first byte / total ms</th><th>tokens (prompt, cache read, written, completion)</th>\
         <th>bytes in → out</th><th>changes</th><th>saved</th><th>cache</th></tr></thead><tbody>",
    );
    for s in list {
        row(&mut h, s);
    }
    h.push_str("</tbody></table></body></html>");
    h
}

fn cache_text(s: &Summary) -> String {
    match &s.cache {
        Some(c) => {
            let readable = opt(c.readable);
            match &c.miss {
                Some(m) => format!(
                    "readable {readable}; <span class=miss>miss: {}</span>",
                    esc(m)
                ),
                None => format!("readable {readable}"),
            }
        }
        None => "—".to_owned(),
    }
}

fn saved_text(s: &Summary) -> String {
    match (s.saving.tokens, s.saving.money) {
        (0, _) => "—".to_owned(),
        (t, None) => format!("{t} tokens"),
        (t, m) => format!("{t} tokens, {}", money(m)),
    }
}

fn row(h: &mut String, s: &Summary) {
    let tokens = s.tokens.map_or("—".to_owned(), |t| {
        format!(
            "{}, {}, {}, {}",
            t.prompt, t.cached_read, t.cache_written, t.completion
        )
    });
    let changes = changes_text(s);
    let conversation = s.conversation.as_deref().map_or(String::new(), |c| {
        format!(
            " <a href=\"/visor/ui/conversations/{c}\" title=\"its conversation\">conversation</a>",
            c = pct(c)
        )
    });
    let _ = write!(
        h,
        "<tr><td><a href=\"/visor/ui/requests/{id}\">{time}</a>{conversation}</td><td>{replica}</td><td>{key}</td>\
         <td>{model} → {upstream}</td><td class=n>{status}</td><td class=n>{fb} / {total}</td><td class=n>{tokens}</td>\
         <td class=n>{bin} → {bout}</td><td{cls}>{changes}</td><td class=n>{saved}</td><td>{cache}</td></tr>",
        id = pct(&s.id),
        time = time_text(s.time_ms),
        replica = esc(&s.replica),
        key = esc(&s.key),
        model = esc(&s.model),
        upstream = esc(&s.upstream),
        status = s.status,
        fb = opt(s.first_byte_ms),
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
        saved = saved_text(s),
        cache = cache_text(s),
    );
}

/// One request: its summary, then its messages side by side (`None`:
/// its bodies are not kept here).
pub fn request(s: &Summary, pairs: Option<&[Pair]>, replica: &str) -> String {
    let mut h = String::with_capacity(8192);
    open(&mut h, &format!("Request {}", s.id), false);
    let t = s.tokens;
    let _ = write!(
        h,
        "<dl><dt>time</dt><dd>{time}</dd><dt>replica</dt><dd>{replica}</dd><dt>key</dt><dd>{key}</dd>\
         <dt>endpoint</dt><dd>{endpoint}</dd><dt>model → upstream</dt><dd>{model} → {upstream}</dd>\
         <dt>status</dt><dd>{status} ({outcome})</dd><dt>first byte / total</dt><dd>{fb} / {total} ms</dd>\
         <dt>tokens</dt><dd>prompt {p}, cache read {r}, cache written {w}, completion {c}</dd>\
         <dt>cost</dt><dd>{cost}</dd><dt>bytes in → out</dt><dd>{bin} → {bout}</dd>\
         <dt>changes</dt><dd>{changes}</dd><dt>saved</dt><dd>{saved} (images {si}, dedup {sd}, cache {sc} tokens)</dd>\
         <dt>prompt cache</dt><dd>{cache}</dd>{conv}</dl>",
        time = time_text(s.time_ms),
        replica = esc(&s.replica),
        key = esc(&s.key),
        endpoint = esc(&s.endpoint),
        model = esc(&s.model),
        upstream = esc(&s.upstream),
        status = s.status,
        outcome = esc(&s.outcome),
        fb = opt(s.first_byte_ms),
        total = s.total_ms,
        p = opt(t.map(|t| t.prompt)),
        r = opt(t.map(|t| t.cached_read)),
        w = opt(t.map(|t| t.cache_written)),
        c = opt(t.map(|t| t.completion)),
        cost = money(s.cost),
        bin = s.bytes_in,
        bout = s.bytes_out,
        changes = esc(&changes_text(s)),
        saved = saved_text(s),
        si = s.saving.images,
        sd = s.saving.dedup,
        sc = s.saving.cache,
        cache = cache_text(s),
        conv = s.conversation.as_deref().map_or(String::new(), |c| format!(
            "<dt>conversation</dt><dd><a href=\"/visor/ui/conversations/{p}\">{c}</a></dd>",
            p = pct(c),
            c = esc(c)
        )),
    );
    match pairs {
        Some(pairs) => side_by_side(&mut h, pairs),
        None if s.replica != replica => {
            let _ = write!(
                h,
                "<p>Its bodies are kept by replica <b>{}</b>: open this page there.</p>",
                esc(&s.replica)
            );
        }
        None => h.push_str("<p>Its bodies are not kept (not a transformed endpoint, or past <code>[inspector] body_bytes</code>).</p>"),
    }
    h.push_str("</body></html>");
    h
}

fn side_by_side(h: &mut String, pairs: &[Pair]) {
    h.push_str("<h2>Messages: what the client sent, what the provider got</h2>");
    for p in pairs {
        let json = |v: &Option<serde_json::Value>| match v {
            Some(v) => esc(&serde_json::to_string_pretty(v).unwrap_or_default()),
            None => "<i>(none)</i>".to_owned(),
        };
        let mut labels = String::new();
        for l in &p.labels {
            let _ = write!(
                labels,
                "<span class=label data-rule=\"{rule}\">{rule}: {reason}</span>",
                rule = l.rule,
                reason = esc(&l.reason)
            );
            if let Some(a) = &l.artifact {
                let a = pct(a);
                let _ = write!(
                    labels,
                    "<figure><a href=\"/visor/artifacts/{a}\"><img src=\"/visor/artifacts/{a}\" alt=\"the original, sha256:{a}\" loading=lazy></a>\
                     <figcaption>sha256:{a}</figcaption></figure>"
                );
            }
        }
        let what = match p.at.as_str() {
            "system" => "system and tools".to_owned(),
            i => format!("message {i} ({})", esc(&p.role)),
        };
        let state = if p.changed { "changed" } else { "unchanged" };
        let _ = write!(
            h,
            "<details class=pair-box{open}><summary>{what} — {state}</summary><div class=pair>\
             <h3>{labels}</h3><div><b>client</b><pre>{c}</pre></div><div><b>upstream</b><pre>{u}</pre></div></div></details>",
            open = if p.changed { " open" } else { "" },
            c = json(&p.client),
            u = json(&p.upstream),
        );
    }
}

/// Conversation `id`: its requests in order, with where the cached prefix
/// ended and who broke it, and a chart of tokens per request.
pub fn conversation(id: &str, list: &[Arc<Summary>]) -> String {
    let mut h = String::with_capacity(4096 + list.len() * 400);
    open(&mut h, &format!("Conversation {id}"), false);
    if list.is_empty() {
        h.push_str("<p>No request of this conversation is kept.</p></body></html>");
        return h;
    }
    let labels: Vec<String> = (1..=list.len()).map(|i| format!("request {i}")).collect();
    let pick = |f: &dyn Fn(&Summary) -> u64| list.iter().map(|s| f(s)).collect::<Vec<u64>>();
    let sent = pick(&|s| {
        super::savings::prompt_total(s).saturating_sub(s.tokens.map_or(0, |t| t.cached_read))
    });
    h.push_str(&stacked(
        "tokens per request: sent at full price, read from the cache, saved by visor",
        &labels,
        &[
            Series {
                name: "sent",
                values: sent,
            },
            Series {
                name: "read from cache",
                values: pick(&|s| s.tokens.map_or(0, |t| t.cached_read)),
            },
            Series {
                name: "saved",
                values: pick(&|s| s.saving.tokens),
            },
        ],
    ));
    h.push_str(
        "<table><thead><tr><th>#</th><th>time</th><th>model</th><th>status</th><th>tokens (prompt, cache read, written, completion)</th>\
         <th>cached prefix (readable tokens)</th><th>who broke it</th><th>changes</th><th>saved</th></tr></thead><tbody>",
    );
    for (i, s) in list.iter().enumerate() {
        let tokens = s.tokens.map_or("—".to_owned(), |t| {
            format!(
                "{}, {}, {}, {}",
                t.prompt, t.cached_read, t.cache_written, t.completion
            )
        });
        let c = s.cache.as_ref();
        let _ = write!(
            h,
            "<tr><td>{n}</td><td><a href=\"/visor/ui/requests/{id}\">{time}</a></td><td>{model}</td><td class=n>{status}</td>\
             <td class=n>{tokens}</td><td class=n>{readable}</td><td class=miss>{miss}</td><td>{changes}</td><td class=n>{saved}</td></tr>",
            n = i + 1,
            id = pct(&s.id),
            time = time_text(s.time_ms),
            model = esc(&s.model),
            status = s.status,
            readable = opt(c.and_then(|c| c.readable)),
            miss = esc(c.and_then(|c| c.miss.as_deref()).unwrap_or("")),
            changes = esc(&changes_text(s)),
            saved = saved_text(s),
        );
    }
    h.push_str("</tbody></table></body></html>");
    h
}

/// The savings per key and per model over the kept window.
pub fn savings(v: &Savings) -> String {
    let mut h = String::with_capacity(8192);
    open(&mut h, "Savings", false);
    let _ = write!(
        h,
        "<p>Over the kept window: {} to {}. Saved tokens are estimates by rule \
         (images removed, dedup at 4 bytes a token, cache reads at visor's breakpoints); \
         money needs the model table's prices.</p>",
        time_text(v.from_ms),
        time_text(v.to_ms)
    );
    let labels: Vec<String> = v.over_time.iter().map(|b| time_text(b.from_ms)).collect();
    let pick = |f: &dyn Fn(&Sums) -> u64| v.over_time.iter().map(|b| f(&b.sums)).collect();
    h.push_str(&stacked(
        "tokens saved over time, by rule",
        &labels,
        &[
            Series {
                name: "images",
                values: pick(&|s| s.saved.images),
            },
            Series {
                name: "dedup",
                values: pick(&|s| s.saved.dedup),
            },
            Series {
                name: "cache",
                values: pick(&|s| s.saved.cache),
            },
        ],
    ));
    sums_table(&mut h, "All", std::iter::once(("all", &v.all)));
    sums_table(
        &mut h,
        "Per key",
        v.by_key.iter().map(|(k, s)| (k.as_str(), s)),
    );
    sums_table(
        &mut h,
        "Per model",
        v.by_model.iter().map(|(k, s)| (k.as_str(), s)),
    );
    h.push_str("</body></html>");
    h
}

fn sums_table<'a>(h: &mut String, title: &str, rows: impl Iterator<Item = (&'a str, &'a Sums)>) {
    let _ = write!(
        h,
        "<h2>{title}</h2><table><thead><tr><th>name</th><th>requests</th><th>prompt tokens</th><th>cache read ratio</th>\
         <th>saved: images</th><th>dedup</th><th>cache</th><th>saved money</th><th>cost</th></tr></thead><tbody>"
    );
    for (name, s) in rows {
        let _ = write!(
            h,
            "<tr><td>{name}</td><td class=n>{r}</td><td class=n>{p}</td><td class=n>{ratio:.1} %</td>\
             <td class=n>{i}</td><td class=n>{d}</td><td class=n>{c}</td><td class=n>{m}</td><td class=n>{cost}</td></tr>",
            name = esc(name),
            r = s.requests,
            p = s.prompt_tokens,
            ratio = s.cache_read_ratio * 100.0,
            i = s.saved.images,
            d = s.saved.dedup,
            c = s.saved.cache,
            m = money(s.saved.money),
            cost = money(s.cost),
        );
    }
    h.push_str("</tbody></table>");
}

/// The sign-in form (`failed`: a wrong key was given).
pub fn sign_in(failed: bool) -> String {
    let mut h = String::with_capacity(2048);
    open(&mut h, "Sign in", false);
    if failed {
        h.push_str("<p class=miss role=alert>That is not an inspector admin key.</p>");
    }
    h.push_str(
        "<p>The inspector needs one of <code>[inspector] admin_keys</code>.</p>\
         <form method=post action=/visor/ui/sign-in><label>admin key \
         <input type=password name=key autocomplete=current-password autofocus required></label>\
         <button>Sign in</button></form></body></html>",
    );
    h
}

/// The script that adds rows as requests finish (the page works without).
pub const LIVE_JS: &str = r#"(() => {
  const body = document.querySelector('#requests tbody');
  const live = document.getElementById('live');
  if (!body || !window.EventSource || location.search) return;
  const es = new EventSource('/visor/api/events');
  es.onopen = () => { live.textContent = 'Live.'; };
  es.onerror = () => { live.textContent = 'Not live (reload to retry).'; };
  es.onmessage = (e) => {
    const s = JSON.parse(e.data);
    const none = document.getElementById('none');
    if (none) none.remove();
    const tr = document.createElement('tr');
    const t = s.tokens ? `${s.tokens.prompt}, ${s.tokens.cached_read}, ${s.tokens.cache_written}, ${s.tokens.completion}` : '—';
    const cells = [new Date(s.time_ms).toISOString().slice(11, 19) + ' UTC', s.replica, s.key,
      `${s.model} → ${s.upstream}`, s.status, `${s.first_byte_ms ?? '—'} / ${s.total_ms}`, t,
      `${s.bytes_in} → ${s.bytes_out}`, '', s.saving.tokens ? `${s.saving.tokens} tokens` : '—', ''];
    cells.forEach((c, i) => {
      const td = document.createElement('td');
      if (i === 0) {
        const a = document.createElement('a');
        a.href = '/visor/ui/requests/' + encodeURIComponent(s.id);
        a.textContent = c;
        td.appendChild(a);
      } else td.textContent = String(c);
      tr.appendChild(td);
    });
    body.prepend(tr);
  };
})();
"#;

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
        let page = requests(&[Arc::new(s)], &Filter::default(), "r1", false);
        assert!(page.contains("2 images replaced, 14 lines omitted, 2 cache breakpoints added"));
        assert!(page.contains("&lt;script&gt;") && !page.contains("<script>"));
        assert_eq!(pct("a b/\"<x>?#%"), "a%20b%2F%22%3Cx%3E%3F%23%25");
        assert!(
            !page.contains("http://") && !page.contains("https://"),
            "no external request"
        );
    }
}
