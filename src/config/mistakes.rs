//! The mistakes a valid config can still hold, as warnings (`visor check`
//! prints them; `--strict` makes them errors).

use globset::Glob;

use super::{AuthMode, Key, Upstream};

/// What [`usual_mistakes`] looks at.
pub(super) struct Mistakes<'a> {
    pub upstreams: &'a [Upstream],
    /// `describer.upstream` / `transcriber.upstream` as written (`None`:
    /// the first upstream).
    pub describer: Option<&'a str>,
    pub transcriber: Option<&'a str>,
    /// Each `[[key]]` (its name and `models` globs).
    pub keys: &'a [Key],
    /// `server.api_keys` or a `[[key]]` with a key: clients' keys are never
    /// forwarded.
    pub proxy_keys: bool,
}

/// A `base_url` that names an endpoint or has no version segment, a route
/// an earlier upstream's `*` shadows, a `[[key]]` whose models no upstream
/// serves, a describer or transcriber that would call without a credential
/// or call an upstream of the other API kind.
pub(super) fn usual_mistakes(m: &Mistakes<'_>) -> Vec<String> {
    let mut w = Vec::new();
    base_urls(m.upstreams, &mut w);
    let ups = m.upstreams;
    // Upstreams used other than by routing: a describer's or transcriber's,
    // a fallback.
    let named = |n: Option<&str>| match n {
        Some(n) => ups.iter().position(|u| u.name == n),
        None => (!ups.is_empty()).then_some(0),
    };
    let describer = named(m.describer);
    let transcriber = named(m.transcriber);
    shadowed_routes(ups, [describer, transcriber], &mut w);
    unserved_keys(ups, m.keys, &mut w);
    // The transcriber only when it is set (it serves audio alone).
    let transcriber = m.transcriber.and(transcriber);
    for (role, at) in [("describer", describer), ("transcriber", transcriber)] {
        if let Some(at) = at {
            helper_credentials(m, role, at, &mut w);
        }
    }
    w
}

/// A `base_url` that ends in an endpoint, or has no version segment.
fn base_urls(ups: &[Upstream], w: &mut Vec<String>) {
    for (i, u) in ups.iter().enumerate() {
        let path = u.base_url.path().trim_end_matches('/');
        let at = format!("upstream[{i}].base_url {:?}", u.base_url.to_string());
        if let Some(end) = [
            "/chat/completions",
            "/completions",
            "/responses",
            "/messages",
            "/embeddings",
        ]
        .into_iter()
        .find(|e| path.ends_with(e))
        {
            w.push(format!(
                "{at} ends in {end}: visor appends the client's path after /v1 to base_url (a client's /v1{end} goes to <base_url>{end}); give the API's base, e.g. https://api.example.com/v1"
            ));
        } else if !path.split('/').any(is_version_segment) {
            w.push(format!(
                "{at} has no version segment such as /v1: visor appends the client's path after /v1 (/chat/completions, /messages…) to it, and most OpenAI-compatible APIs serve them under …/v1"
            ));
        }
    }
}

/// An upstream no request is routed to (an earlier one takes every model,
/// or each model it lists), unless it is the describer's or transcriber's
/// (`helpers`) or a fallback.
fn shadowed_routes(ups: &[Upstream], helpers: [Option<usize>; 2], w: &mut Vec<String>) {
    let fallback = |j: usize| ups.iter().any(|u| u.fallbacks.contains(&ups[j].name));
    for (j, u) in ups.iter().enumerate() {
        if helpers.contains(&Some(j)) || fallback(j) {
            continue;
        }
        let wide = ups[..j]
            .iter()
            .position(|e| e.models.iter().any(|g| g == "*" || g == "**"));
        let literal_taken = !u.models.is_empty()
            && u.models.iter().all(|g| {
                !g.contains(['*', '?', '[', '{'])
                    && ups[..j]
                        .iter()
                        .any(|e| e.matches(&g.to_ascii_lowercase()) || e.matches(g))
            });
        if let Some(e) = wide {
            w.push(format!(
                "upstream[{j}] {:?}: no request is ever routed to it — upstream[{e}] {:?} before it takes every model (\"*\"); put it first, or narrow {:?}'s models",
                u.name, ups[e].name, ups[e].name
            ));
        } else if literal_taken {
            w.push(format!(
                "upstream[{j}] {:?}: every model it lists is taken by an earlier upstream (first match wins)",
                u.name
            ));
        }
    }
}

/// A `[[key]]` glob no upstream serves a model of.
fn unserved_keys(ups: &[Upstream], keys: &[Key], w: &mut Vec<String>) {
    for key in keys {
        let name = &key.name;
        for (g_at, g) in key.models.iter().enumerate() {
            if g == "*" || g == "**" {
                continue;
            }
            let samples = [
                g.replace('*', "").replace('?', "x"),
                g.replace(['*', '?'], "x"),
            ];
            // Either side's globs, tried on names made from the other's.
            let key_glob = Glob::new(&g.to_ascii_lowercase())
                .ok()
                .map(|g| g.compile_matcher());
            let served = ups.iter().any(|u| {
                samples.iter().any(|s| u.matches(s))
                    || u.models.iter().any(|ug| {
                        let sample = ug.to_ascii_lowercase().replace(['*', '?'], "x");
                        key_glob.as_ref().is_some_and(|k| k.is_match(&sample))
                    })
            });
            if !served {
                w.push(format!(
                    "key {name:?} models[{g_at}] {g:?}: no [[upstream]] serves a model it names"
                ));
            }
        }
    }
}

/// The describer's or transcriber's upstream (`ups[at]`): of the Anthropic
/// kind, or without a credential for some requests.
fn helper_credentials(m: &Mistakes<'_>, role: &str, at: usize, w: &mut Vec<String>) {
    let ups = m.upstreams;
    let u = &ups[at];
    let which = match (role, m.describer, m.transcriber) {
        ("describer", None, _) | ("transcriber", _, None) => {
            format!(
                "{role}.upstream is not set, so it is the first upstream, {:?},",
                u.name
            )
        }
        _ => format!("{role}.upstream {:?}", u.name),
    };
    if u.auth == AuthMode::XApiKey {
        w.push(format!(
            "{which} is of the Anthropic kind (auth = \"x-api-key\"), but {role} calls are OpenAI-kind ({}): name an OpenAI-kind upstream with a vision model",
            match role {
                "describer" => "POST /chat/completions",
                _ => "POST /audio/transcriptions",
            }
        ));
    }
    if u.api_key.is_some() {
        return;
    }
    // An upstream some request is routed to: no earlier one takes `*`.
    let routed = |k: usize| {
        !ups[..k]
            .iter()
            .any(|e| e.models.iter().any(|g| g == "*" || g == "**"))
    };
    if m.proxy_keys {
        w.push(format!(
            "{which} has no api_key, and with proxy keys clients' keys are never forwarded: its calls go out without a credential (a provider that needs one answers 401{}) — give it an api_key (any value for a local server)",
            match role {
                "describer" => ", and images become \"not shown\" placeholders",
                _ => "",
            }
        ));
    } else if ups
        .iter()
        .enumerate()
        .any(|(k, o)| k != at && routed(k) && o.base_url.authority() != u.base_url.authority())
    {
        w.push(format!(
            "{which} has no api_key: it gets the client's key only for requests routed to {:?}; for requests routed elsewhere its calls go out without a credential (a provider that needs one answers 401) — give it an api_key (any value for a local server)",
            u.name
        ));
    }
}

/// `v1`, `v4`, `v1beta`, `v2alpha1`: a path segment naming an API version.
fn is_version_segment(seg: &str) -> bool {
    let Some(rest) = seg.strip_prefix('v') else {
        return false;
    };
    let digits = rest.chars().take_while(char::is_ascii_digit).count();
    digits > 0 && rest[digits..].chars().all(|c| c.is_ascii_alphanumeric())
}
