//! `[[upstream]]`: the providers visor forwards to — base URL, credential,
//! the model globs that route to each (first match wins), extra CA
//! certificates, and fallback chains, flattened here at load.

use globset::{Glob, GlobSet, GlobSetBuilder};
use http::Uri;
use serde::Deserialize;

use super::{Problems, Secret};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawUpstream {
    pub name: String,
    pub base_url: String,
    #[serde(default)]
    pub api_key: Option<Secret>,
    #[serde(default = "default_models")]
    pub models: Vec<String>,
    #[serde(default = "default_auth")]
    pub auth: String,
    /// PEM file of extra CA certificates trusted for this upstream (besides
    /// the webpki roots), for providers behind a private CA.
    #[serde(default)]
    pub ca_file: Option<String>,
    /// Upstreams tried in order when this one fails before its response
    /// head (names of other `[[upstream]]`s of the same API shape).
    #[serde(default)]
    pub fallbacks: Vec<String>,
    /// OpenAI kind: a request without a `prompt_cache_key` gets a stable
    /// one (never sent to an upstream that did not opt in: some servers
    /// refuse fields they do not know).
    #[serde(default)]
    pub prompt_cache_key: bool,
}

fn default_models() -> Vec<String> {
    vec!["*".to_owned()]
}
fn default_auth() -> String {
    "bearer".to_owned()
}

/// How an upstream's own key is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthMode {
    /// `Authorization: Bearer KEY`
    Bearer,
    /// `x-api-key: KEY` (Anthropic kind)
    XApiKey,
}

impl AuthMode {
    pub fn as_str(self) -> &'static str {
        match self {
            AuthMode::Bearer => "bearer",
            AuthMode::XApiKey => "x-api-key",
        }
    }

    /// The API shape an upstream of this auth mode speaks: `x-api-key` is
    /// the Anthropic kind, `bearer` the OpenAI kind. Visor never translates
    /// between shapes, so a fallback must speak the same one.
    pub fn shape(self) -> &'static str {
        match self {
            AuthMode::Bearer => "OpenAI (auth = \"bearer\")",
            AuthMode::XApiKey => "Anthropic (auth = \"x-api-key\")",
        }
    }
}

/// One `[[upstream]]`, checked.
#[derive(Debug)]
pub struct Upstream {
    pub name: String,
    /// The base URL without a trailing slash, e.g. `https://api.openai.com/v1`.
    pub base_url: Uri,
    pub api_key: Option<Secret>,
    pub auth: AuthMode,
    /// `models`, as written.
    pub models: Vec<String>,
    /// `models` built.
    pub matcher: GlobSet,
    /// Extra trusted CA certificates (`ca_file`).
    pub ca_certs: Vec<rustls::pki_types::CertificateDer<'static>>,
    /// `fallbacks`, as written.
    pub fallbacks: Vec<String>,
    /// `prompt_cache_key = true`.
    pub prompt_cache_key: bool,
    /// The upstreams a request routed here may go to, in order: this one,
    /// then its fallbacks, each followed by its own (depth first, each
    /// once). Just this one when it has no fallbacks.
    pub chain: Vec<usize>,
}

impl Upstream {
    /// True when a request routed here may fall back to another upstream.
    pub fn has_fallbacks(&self) -> bool {
        self.chain.len() > 1
    }

    pub fn matches(&self, model: &str) -> bool {
        self.matcher.is_match(model)
    }

    /// True when this upstream takes every model name.
    pub fn matches_all(&self) -> bool {
        self.models.iter().any(|m| m == "*" || m == "**")
    }
}

/// How the prompt cache treats a request routed to `upstreams[index]`:
/// whether it is of the Anthropic kind (it caches at breakpoints), and
/// whether every upstream of its chain opted in to `prompt_cache_key`.
pub fn cache_kind(upstreams: &[Upstream], index: usize) -> (bool, bool) {
    let Some(u) = upstreams.get(index) else {
        return (false, false);
    };
    let key = u
        .chain
        .iter()
        .all(|&i| upstreams.get(i).is_some_and(|c| c.prompt_cache_key));
    (u.auth == AuthMode::XApiKey, key)
}

/// Checks every `[[upstream]]` and their fallbacks; `proxy_keys`: clients'
/// own keys are never forwarded (so a fallback may lack a key of its own).
pub(super) fn validate(raw: Vec<RawUpstream>, proxy_keys: bool, p: &mut Problems) -> Vec<Upstream> {
    if raw.is_empty() {
        p.bad(
            "upstream",
            "(none)",
            "at least one [[upstream]] is required",
        );
    }
    let mut upstreams: Vec<Upstream> = Vec::with_capacity(raw.len());
    for (i, u) in raw.into_iter().enumerate() {
        let checked = u.validate(i, &upstreams, p);
        upstreams.push(checked);
    }
    fallback_chains(p, &mut upstreams);
    if !proxy_keys {
        fallback_credentials(p, &upstreams);
    }
    upstreams
}

impl RawUpstream {
    /// The `i`th upstream, after `earlier`.
    fn validate(self, i: usize, earlier: &[Upstream], p: &mut Problems) -> Upstream {
        let key = format!("upstream[{i}]");
        let name_ok = |c: char| c.is_ascii_alphanumeric() || "-_.".contains(c);
        if self.name.is_empty() || !self.name.chars().all(name_ok) {
            p.bad(
                format_args!("{key}.name"),
                format_args!("{:?}", self.name),
                "must be non-empty ASCII letters, digits, '-', '_' or '.'",
            );
        }
        if earlier.iter().any(|o| o.name == self.name) {
            p.bad(
                format_args!("{key}.name"),
                format_args!("{:?}", self.name),
                "another upstream has this name",
            );
        }
        let base_url = parse_base_url(&self.base_url).unwrap_or_else(|why| {
            p.bad(
                format_args!("{key}.base_url"),
                format_args!("{:?}", self.base_url),
                why,
            );
            Uri::from_static("http://invalid")
        });
        let auth = p
            .one_of(
                &format!("{key}.auth"),
                &self.auth,
                &[
                    ("bearer", AuthMode::Bearer),
                    ("x-api-key", AuthMode::XApiKey),
                ],
            )
            .unwrap_or(AuthMode::Bearer);
        if self.prompt_cache_key && auth == AuthMode::XApiKey {
            p.bad(
                format_args!("{key}.prompt_cache_key"),
                true,
                "is for the OpenAI kind (auth = \"bearer\"); the Anthropic kind caches at breakpoints (see [cache])",
            );
        }
        if let Some(k) = &self.api_key
            && k.expose().trim().is_empty()
        {
            p.bad(
                format_args!("{key}.api_key"),
                "\"\"",
                "empty; remove the key to forward the client's own",
            );
        }
        let matcher = self.matcher(&key, p);
        let ca_certs = match &self.ca_file {
            None => Vec::new(),
            Some(f) => read_ca_file(f).unwrap_or_else(|why| {
                p.bad(format_args!("{key}.ca_file"), format_args!("{f:?}"), why);
                Vec::new()
            }),
        };
        Upstream {
            name: self.name,
            base_url,
            api_key: self.api_key,
            auth,
            models: self.models,
            matcher,
            ca_certs,
            fallbacks: self.fallbacks,
            prompt_cache_key: self.prompt_cache_key,
            chain: vec![i],
        }
    }

    /// `models` built: the routing globs, as written (case-sensitive).
    fn matcher(&self, key: &str, p: &mut Problems) -> GlobSet {
        if self.models.is_empty() {
            p.bad(
                format_args!("{key}.models"),
                "[]",
                "list at least one glob, e.g. [\"*\"]",
            );
        }
        let mut set = GlobSetBuilder::new();
        for (j, m) in self.models.iter().enumerate() {
            match Glob::new(m) {
                Ok(g) => {
                    set.add(g);
                }
                Err(e) => p.bad(
                    format_args!("{key}.models[{j}]"),
                    format_args!("{m:?}"),
                    format_args!("not a valid glob: {e}"),
                ),
            }
        }
        set.build().unwrap_or_else(|_| GlobSet::empty())
    }
}

/// Checks every upstream's `fallbacks` (known names, not itself, the same
/// API shape, no cycle through other upstreams' fallbacks) and sets each
/// upstream's `chain`.
fn fallback_chains(p: &mut Problems, upstreams: &mut [Upstream]) {
    let Some(edges) = fallback_edges(p, upstreams) else {
        return;
    };
    // A cycle (a → b → a) would make the order of a chain ambiguous.
    for start in 0..upstreams.len() {
        let mut path = vec![start];
        if let Some(cycle) = find_cycle(&edges, &mut path) {
            let names: Vec<&str> = cycle.iter().map(|&k| upstreams[k].name.as_str()).collect();
            p.bad(
                format_args!("upstream[{start}].fallbacks"),
                format_args!("{:?}", upstreams[start].fallbacks),
                format_args!("fallbacks form a cycle: {}", names.join(" → ")),
            );
            return;
        }
    }
    for (i, u) in upstreams.iter_mut().enumerate() {
        let mut chain = vec![i];
        flatten(&edges, i, &mut chain);
        u.chain = chain;
    }
}

/// Each upstream's fallbacks as indexes; `None` when one is unknown, itself,
/// of another API shape or listed twice (each a problem).
fn fallback_edges(p: &mut Problems, upstreams: &[Upstream]) -> Option<Vec<Vec<usize>>> {
    let index_of = |name: &str| upstreams.iter().position(|u| u.name == name);
    let mut edges: Vec<Vec<usize>> = Vec::with_capacity(upstreams.len());
    let mut sound = true;
    for (i, u) in upstreams.iter().enumerate() {
        let mut next = Vec::new();
        for (j, f) in u.fallbacks.iter().enumerate() {
            let key = format!("upstream[{i}].fallbacks[{j}]");
            let value = format!("{f:?}");
            match index_of(f) {
                None => p.bad(key, value, "no [[upstream]] has this name"),
                Some(t) if t == i => p.bad(key, value, "an upstream cannot fall back to itself"),
                Some(t) if upstreams[t].auth != u.auth => p.bad(
                    key,
                    value,
                    format_args!(
                        "speaks {}, but {:?} speaks {}; visor never translates between API shapes, so a fallback must speak the same one",
                        upstreams[t].auth.shape(),
                        u.name,
                        u.auth.shape()
                    ),
                ),
                Some(t) if next.contains(&t) => p.bad(key, value, "listed twice"),
                Some(t) => {
                    next.push(t);
                    continue;
                }
            }
            sound = false;
        }
        edges.push(next);
    }
    sound.then_some(edges)
}

/// A fallback without an `api_key` is sent the client's own key, which the
/// client sent for the upstream it falls back from: refused unless that one
/// also forwards the client's key and is the same origin (scheme, host,
/// port) — the same provider.
fn fallback_credentials(p: &mut Problems, upstreams: &[Upstream]) {
    let origin = |u: &Upstream| {
        (
            u.base_url.scheme_str().map(str::to_ascii_lowercase),
            u.base_url.host().map(str::to_ascii_lowercase),
            u.base_url.port_u16(),
        )
    };
    for (i, u) in upstreams.iter().enumerate() {
        for (j, f) in u.fallbacks.iter().enumerate() {
            let Some(t) = upstreams.iter().find(|t| &t.name == f) else {
                continue;
            };
            if t.api_key.is_some() || (u.api_key.is_none() && origin(u) == origin(t)) {
                continue;
            }
            p.say(format!(
                "upstream[{i}].fallbacks[{j}]: {f:?} has no api_key, so it would be sent the client's own key, which the client sent for {:?} ({}): give {f:?} an api_key of its own (or give visor proxy keys: server.api_keys or [[key]])",
                u.name,
                u.base_url.host().unwrap_or("")
            ));
        }
    }
}

/// A cycle reachable from the end of `path`, as the names along it.
fn find_cycle(edges: &[Vec<usize>], path: &mut Vec<usize>) -> Option<Vec<usize>> {
    let last = *path.last()?;
    for &n in &edges[last] {
        if let Some(pos) = path.iter().position(|&k| k == n) {
            let mut cycle = path[pos..].to_vec();
            cycle.push(n);
            return Some(cycle);
        }
        path.push(n);
        if let Some(c) = find_cycle(edges, path) {
            return Some(c);
        }
        path.pop();
    }
    None
}

fn flatten(edges: &[Vec<usize>], from: usize, chain: &mut Vec<usize>) {
    for &n in &edges[from] {
        if !chain.contains(&n) {
            chain.push(n);
            flatten(edges, n, chain);
        }
    }
}

fn read_ca_file(path: &str) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>, String> {
    use rustls::pki_types::pem::PemObject;
    let certs = rustls::pki_types::CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("cannot read: {e}"))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("not a PEM certificate file: {e}"))?;
    if certs.is_empty() {
        return Err("holds no PEM certificate".to_owned());
    }
    Ok(certs)
}

fn parse_base_url(s: &str) -> Result<Uri, &'static str> {
    let uri: Uri = s
        .trim_end_matches('/')
        .parse()
        .map_err(|_| "not a valid URL")?;
    match uri.scheme_str() {
        Some("http") | Some("https") => {}
        _ => return Err("must start with http:// or https://"),
    }
    if uri.authority().is_none() {
        return Err("has no host");
    }
    if uri.query().is_some() {
        return Err("must not have a query string");
    }
    Ok(uri)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::super::Config;
    use super::super::testing::{load, problems, ups};

    #[test]
    fn prompt_cache_key_is_for_the_openai_kind() {
        let ok = load(&ups(&[("a", "prompt_cache_key = true")])).unwrap();
        assert!(ok.upstreams[0].prompt_cache_key);
        let p = problems(&ups(&[(
            "a",
            "auth = \"x-api-key\"\nprompt_cache_key = true",
        )]));
        assert!(
            p.contains("upstream[0].prompt_cache_key: true — is for the OpenAI kind"),
            "{p}"
        );
    }

    #[test]
    fn shipped_default_forwards_client_key_to_openai() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/visor.toml");
        let cfg = Config::load(&path).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(cfg.upstreams.len(), 1);
        assert_eq!(cfg.upstreams[0].base_url, "https://api.openai.com/v1");
        assert!(cfg.upstreams[0].api_key.is_none());
        assert!(cfg.server.api_keys.is_empty());
        assert!(cfg.upstreams[0].matches("gpt-4o"));
    }

    #[test]
    fn no_upstream_is_an_error() {
        assert!(problems("").contains("at least one [[upstream]]"));
    }

    #[test]
    fn fallback_chains_are_flattened_in_order() {
        let cfg = load(&ups(&[
            ("a", "fallbacks = [\"b\", \"c\"]\napi_key = \"k-a\""),
            ("b", "fallbacks = [\"d\"]\napi_key = \"k-b\""),
            ("c", "fallbacks = [\"d\"]\napi_key = \"k-c\""),
            ("d", "api_key = \"k-d\""),
        ]))
        .unwrap();
        assert_eq!(cfg.upstreams[0].chain, vec![0, 1, 3, 2]);
        assert_eq!(cfg.upstreams[1].chain, vec![1, 3]);
        assert_eq!(cfg.upstreams[3].chain, vec![3]);
        assert!(!cfg.upstreams[3].has_fallbacks());
    }

    #[test]
    fn bad_fallbacks_are_refused() {
        let e = problems(&ups(&[("a", "fallbacks = [\"nope\"]")]));
        assert!(
            e.contains("upstream[0].fallbacks[0]: \"nope\" — no [[upstream]]"),
            "{e}"
        );
        let e = problems(&ups(&[("a", "fallbacks = [\"a\"]")]));
        assert!(e.contains("cannot fall back to itself"), "{e}");
        let e = problems(&ups(&[
            ("a", "fallbacks = [\"b\"]"),
            ("b", "fallbacks = [\"c\"]"),
            ("c", "fallbacks = [\"a\"]"),
        ]));
        assert!(e.contains("cycle: a → b → c → a"), "{e}");
        let e = problems(&ups(&[
            ("a", "fallbacks = [\"b\"]"),
            ("b", "auth = \"x-api-key\""),
        ]));
        assert!(e.contains("never translates between API shapes"), "{e}");
        // The client's key, sent for `a`, is never sent to another host.
        let e = problems(&ups(&[("a", "fallbacks = [\"b\"]"), ("b", "")]));
        assert!(
            e.contains("upstream[0].fallbacks[0]: \"b\" has no api_key, so it would be sent the client's own key"),
            "{e}"
        );
        // Fine: the fallback has its own key; proxy keys (clients' keys are
        // never forwarded); the same host's other port is another origin,
        // the same origin is the same provider.
        assert_eq!(
            problems(&ups(&[
                ("a", "fallbacks = [\"b\"]"),
                ("b", "api_key = \"k\"")
            ])),
            "(valid)"
        );
        assert_eq!(
            problems(&format!(
                "[server]\napi_keys = [\"p\"]\n{}",
                ups(&[("a", "fallbacks = [\"b\"]"), ("b", "")])
            )),
            "(valid)"
        );
        let same = "[[upstream]]\nname = \"a\"\nbase_url = \"http://h.test/v1\"\nfallbacks = [\"b\"]\n\
                    [[upstream]]\nname = \"b\"\nbase_url = \"http://h.test/v2\"\n";
        assert_eq!(problems(same), "(valid)");
        assert!(problems(&same.replace("h.test/v2", "h.test:8080/v2")).contains("has no api_key"));
        // `a` has a key of its own: the client's key was not for it either.
        assert!(
            problems(&same.replace("fallbacks", "api_key = \"k\"\nfallbacks"))
                .contains("has no api_key")
        );
    }
}
