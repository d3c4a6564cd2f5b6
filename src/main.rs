//! The `visor` command line: `serve` (the default), `check`, `explain` and
//! `init`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

/// Prints a line on stdout. A closed pipe (`visor check | head -3`) ends
/// the program quietly, as `cat` would; another write error exits 1.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout().lock(), $($arg)*) {
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                std::process::exit(0);
            }
            eprintln!("error: cannot write to stdout: {e}");
            std::process::exit(1);
        }
    }};
}

use clap::{Parser, Subcommand, ValueEnum};
use std::sync::Arc;
use std::time::Duration;
use visor::config::{Config, StoreBackend};

use visor::media_text::describe::PROMPT_VERSION;
use visor::metrics::Metrics;
use visor::models::{Caps, Learned, Medium, ModelTable, legacy_learned};
use visor::server::{Server, shutdown_signal};
use visor::store::Store;
use visor::transform::Shape;

#[derive(Parser)]
#[command(
    name = "visor",
    version,
    about = "A transparent, streaming reverse proxy for OpenAI-compatible LLM APIs"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy (the default).
    Serve {
        /// Config file [default: $VISOR_CONFIG, ./visor.toml,
        /// ./config/visor.toml, $XDG_CONFIG_HOME/visor/visor.toml,
        /// /etc/visor/visor.toml, then the built-in default]
        #[arg(long)]
        config: Option<PathBuf>,
        /// Listen address, overriding server.listen
        #[arg(long)]
        listen: Option<SocketAddr>,
    },
    /// Validate the config and print the routes and the model table; exit 0
    /// when valid, 1 if not.
    Check {
        /// Config file [default: $VISOR_CONFIG, ./visor.toml,
        /// ./config/visor.toml, $XDG_CONFIG_HOME/visor/visor.toml,
        /// /etc/visor/visor.toml, then the built-in default]
        #[arg(long)]
        config: Option<PathBuf>,
        /// Also print what the model table says about this model, and which
        /// row decided
        #[arg(long)]
        model: Option<String>,
        /// Exit 1 on warnings too
        #[arg(long)]
        strict: bool,
    },
    /// Dry run, offline: print the request visor would send for FILE (or
    /// stdin) and a report of what it changed, as JSON.
    Explain {
        /// Config file [default: $VISOR_CONFIG, ./visor.toml,
        /// ./config/visor.toml, $XDG_CONFIG_HOME/visor/visor.toml,
        /// /etc/visor/visor.toml, then the built-in default]
        #[arg(long)]
        config: Option<PathBuf>,
        /// The model to resolve [default: the body's `model`]
        #[arg(long)]
        model: Option<String>,
        /// Print only the exact bytes visor would send
        #[arg(long)]
        raw: bool,
        /// The API shape of the body
        #[arg(long, value_enum, default_value = "chat")]
        endpoint: Endpoint,
        /// Request body file; `-` or nothing reads stdin
        file: Option<PathBuf>,
    },
    /// Write a recipe config to ./visor.toml; without RECIPE, list them.
    Init {
        /// claude-code, codex, local or team
        recipe: Option<String>,
        /// Where to write it
        #[arg(long, default_value = "visor.toml")]
        output: PathBuf,
        /// Replace the file if it exists
        #[arg(long)]
        force: bool,
    },
    /// Reads one document from stdin under memory and CPU limits (what
    /// `serve` runs in a child process per document; not for people).
    #[command(hide = true)]
    MediaWorker { memory_mib: u64, cpu_secs: u64 },
}

#[derive(Clone, Copy, ValueEnum)]
enum Endpoint {
    /// POST /v1/chat/completions
    Chat,
    /// POST /v1/responses
    Responses,
    /// POST /v1/messages (Anthropic)
    Messages,
}

/// The shipped default config, compiled in: used when no file is found.
const DEFAULT_CONFIG: &str = include_str!("../config/visor.toml");

/// The recipes `visor init` writes: name, what it is for, the file.
const RECIPES: [(&str, &str, &str); 4] = [
    (
        "claude-code",
        "Claude Code → a text-only model's Anthropic endpoint; images and PDFs described by a vision model on another provider",
        include_str!("../config/examples/claude-code.toml"),
    ),
    (
        "codex",
        "Codex / OpenAI SDKs → a text-only OpenAI-compatible provider; images described by OpenAI",
        include_str!("../config/examples/codex.toml"),
    ),
    (
        "local",
        "a local stack: a text model on Ollama or vLLM, a local vision model describing",
        include_str!("../config/examples/local.toml"),
    ),
    (
        "team",
        "a team gateway: proxy keys with limits, a fallback provider, Redis",
        include_str!("../config/examples/team.toml"),
    ),
];

/// Where the config comes from.
enum Source {
    File(PathBuf),
    /// No file found: [`DEFAULT_CONFIG`].
    BuiltIn,
}

impl Source {
    fn label(&self) -> String {
        match self {
            Source::File(p) => p.display().to_string(),
            Source::BuiltIn => "the built-in default config".to_owned(),
        }
    }
}

/// The places a config is looked for when neither `--config` nor
/// `$VISOR_CONFIG` names one, in order.
fn config_candidates() -> Vec<PathBuf> {
    let mut c = vec![
        PathBuf::from("visor.toml"),
        PathBuf::from("config/visor.toml"),
    ];
    let xdg = std::env::var_os("XDG_CONFIG_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")));
    if let Some(dir) = xdg {
        c.push(dir.join("visor").join("visor.toml"));
    }
    c.push(PathBuf::from("/etc/visor/visor.toml"));
    c
}

/// `--config`, else `$VISOR_CONFIG` (either must exist), else the first of
/// [`config_candidates`] that exists, else the built-in default.
fn config_source(flag: Option<PathBuf>) -> Source {
    if let Some(p) = flag.or_else(|| {
        std::env::var_os("VISOR_CONFIG")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    }) {
        return Source::File(p);
    }
    config_candidates()
        .into_iter()
        .find(|p| p.is_file())
        .map_or(Source::BuiltIn, Source::File)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command.unwrap_or(Command::Serve {
        config: None,
        listen: None,
    }) {
        Command::Check {
            config,
            model,
            strict,
        } => check(&config_source(config), model.as_deref(), strict),
        Command::Explain {
            config,
            model,
            raw,
            endpoint,
            file,
        } => explain(&config_source(config), model, raw, endpoint, file),
        Command::Serve { config, listen } => serve(&config_source(config), listen),
        Command::Init {
            recipe,
            output,
            force,
        } => init(recipe.as_deref(), &output, force),
        Command::MediaWorker {
            memory_mib,
            cpu_secs,
        } => visor::media_text::worker_main(memory_mib, cpu_secs),
    }
}

fn load(source: &Source) -> Option<Config> {
    let loaded = match source {
        Source::File(path) => Config::load(path),
        Source::BuiltIn => Config::from_toml(
            DEFAULT_CONFIG,
            std::path::Path::new("built-in default (config/visor.toml)"),
            &|name| std::env::var(name).ok(),
        ),
    };
    match loaded {
        Ok(c) => Some(c),
        Err(e) => {
            eprintln!("error: {e}");
            None
        }
    }
}

/// The store as the CLI sees it, and the model table with its learned rows.
struct Offline {
    rt: tokio::runtime::Runtime,
    table: ModelTable,
    store: Option<Store>,
    /// Why the store was not read, when it was not.
    note: Option<String>,
}

/// Opens the store (Redis only when `network`) and the model table.
fn offline(cfg: &Config, network: bool) -> Option<Offline> {
    let fail = |e: String| -> Option<Offline> {
        eprintln!("error: {e}");
        None
    };
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return fail(format!("cannot start the runtime: {e}")),
    };
    let mut names = legacy_learned(&cfg.learned_path());
    let mut note = None;
    let disk_file = cfg.server.data_dir.join(visor::store::DISK_FILE);
    let store = if matches!(cfg.store.backend, StoreBackend::Redis(_)) && !network {
        note = Some("not read: the store is Redis, and explain makes no network call".to_owned());
        None
    } else if cfg.store.backend == StoreBackend::Disk && !disk_file.exists() {
        // Nothing stored yet; the CLI does not create the file.
        note = Some(format!(
            "empty ({} does not exist yet)",
            disk_file.display()
        ));
        None
    } else {
        let metrics = match Metrics::new() {
            Ok(m) => Arc::new(m),
            Err(e) => return fail(e.to_string()),
        };
        let opened = rt.block_on(async {
            Store::open(
                &cfg.store.backend,
                &cfg.store.prefix,
                &cfg.server.data_dir,
                metrics,
            )
        });
        match opened {
            Ok(store) => {
                match rt.block_on(store.learned()) {
                    Ok(n) => names.extend(n),
                    Err(e @ visor::store::StoreError::InUse(_)) => {
                        note = Some(format!(
                            "unavailable: {e} (a running visor holds it: POST the request to its /visor/api/explain for the descriptions it has)"
                        ))
                    }
                    Err(e) => note = Some(format!("unavailable: {e}")),
                }
                Some(store)
            }
            Err(e) => return fail(e),
        }
    };
    match ModelTable::new(&cfg.models, Learned::new(names)) {
        Ok(table) => Some(Offline {
            rt,
            table,
            store,
            note,
        }),
        Err(e) => fail(e.to_string()),
    }
}

fn caps_text(c: &Caps) -> String {
    let flag = |v: Option<bool>| v.map_or("?".to_owned(), |b| b.to_string());
    let num = |v: Option<u64>| v.map_or("?".to_owned(), |n| n.to_string());
    let mut text = format!(
        "vision={} audio={} pdf={} office={} max_images={} context_window={} cache_min_tokens={}",
        flag(c.vision),
        flag(c.audio),
        flag(c.pdf),
        flag(c.office),
        num(c.max_images.map(u64::from)),
        num(c.context_window),
        num(c.cache_min_tokens.map(u64::from))
    );
    // Image and request limits, only when a row states one of them.
    let limits = [
        c.max_image_bytes,
        c.max_image_edge.map(u64::from),
        c.max_image_pixels,
        c.max_request_bytes,
        c.many_images.map(u64::from),
        c.many_images_edge.map(u64::from),
    ];
    if limits.iter().any(Option::is_some) || c.image_tokens.is_some() {
        text.push_str(&format!(
            " limits: max_image_bytes={} max_image_edge={} max_image_pixels={} \
             max_request_bytes={} many_images={} many_images_edge={} image_tokens={}",
            num(c.max_image_bytes),
            num(c.max_image_edge.map(u64::from)),
            num(c.max_image_pixels),
            num(c.max_request_bytes),
            num(c.many_images.map(u64::from)),
            num(c.many_images_edge.map(u64::from)),
            c.image_tokens.map_or("?", |t| t.name())
        ));
    }
    // Prices per million tokens, only when a row states one of them.
    let prices = [c.input, c.cached_input, c.cache_write, c.output];
    if prices.iter().any(Option::is_some) {
        let price = |v: Option<f64>| v.map_or("?".to_owned(), |p| p.to_string());
        text.push_str(&format!(
            " price/M: input={} cached_input={} cache_write={} output={}",
            price(c.input),
            price(c.cached_input),
            price(c.cache_write),
            price(c.output)
        ));
    }
    text
}

/// A duration in seconds as its config key was written (`1.14`, `20`):
/// exact to the nanosecond the key is kept in.
fn secs(d: Duration) -> f64 {
    d.as_nanos() as f64 / 1e9
}

fn check(source: &Source, model: Option<&str>, strict: bool) -> ExitCode {
    let Some(cfg) = load(source) else {
        return ExitCode::FAILURE;
    };
    if let Source::BuiltIn = source {
        let looked: Vec<String> = config_candidates()
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        out!(
            "no config file found (looked for --config, $VISOR_CONFIG, {}): the built-in default: ok",
            looked.join(", ")
        );
    } else {
        out!("{}: ok", source.label());
    }
    for w in &cfg.warnings {
        out!("warning: {w}");
    }
    if strict && !cfg.warnings.is_empty() {
        eprintln!(
            "error: {} warning(s), and --strict makes them errors",
            cfg.warnings.len()
        );
        return ExitCode::FAILURE;
    }
    let s = &cfg.server;
    out!("listen: {}", s.listen);
    out!(
        "limits: max_body_bytes={} connect={:?} first_byte={:?} idle={:?} request={:?} drain={:?}",
        s.max_body_bytes,
        s.connect_timeout,
        s.first_byte_timeout,
        s.idle_timeout,
        s.request_timeout,
        s.drain_timeout
    );
    let proxy_keys = print_keys(&cfg);
    print_routes(&cfg, proxy_keys);
    let Some(off) = offline(&cfg, true) else {
        return ExitCode::FAILURE;
    };
    match &off.note {
        None => out!("store: {}", cfg.store.backend),
        Some(n) => out!("store: {} — {n}", cfg.store.backend),
    }
    print_model_table(&cfg, &off.table);
    print_media(&cfg);
    if let Some(m) = model {
        print_model(&off.table, m);
    }
    ExitCode::SUCCESS
}

/// `check`: the proxy keys and the `[[key]]` entries; how many proxy keys
/// there are.
fn print_keys(cfg: &Config) -> usize {
    let s = &cfg.server;
    // Proxy keys: `server.api_keys` and every `[[key]]` with a key. With
    // any, a client's own provider key is not forwarded but refused (401).
    let entry_keys = cfg.keys.iter().filter(|k| k.key.is_some()).count();
    let proxy_keys = s.api_keys.len() + entry_keys;
    if proxy_keys == 0 {
        out!("proxy keys: none (clients' own Authorization / x-api-key are forwarded)");
    } else {
        out!(
            "proxy keys: {proxy_keys} configured ({} in server.api_keys, {entry_keys} in [[key]]); clients must send one, it is never forwarded, and a client's own provider key is refused with 401",
            s.api_keys.len()
        );
    }
    for k in &cfg.keys {
        let per = |v: Option<u64>| v.map_or("no limit".to_owned(), |n| n.to_string());
        out!(
            "key {:?}: {}, requests/min {}, tokens/min {}",
            k.name,
            match k.key {
                Some(_) => "clients send its key",
                None => "requests without a key",
            },
            per(k.requests_per_minute),
            per(k.tokens_per_minute)
        );
    }
    proxy_keys
}

/// `check`: the routes with their credentials and fallback chains, and the
/// retry budget when there are chains.
fn print_routes(cfg: &Config, proxy_keys: usize) {
    out!("routes (first match wins; requests without a model go to the first):");
    let width = cfg
        .upstreams
        .iter()
        .map(|u| u.name.len())
        .max()
        .unwrap_or(0);
    for u in &cfg.upstreams {
        let credential = match &u.api_key {
            Some(_) => format!("own key as {}", u.auth.as_str()),
            None if proxy_keys == 0 => "client's key forwarded".to_owned(),
            None => "no credential".to_owned(),
        };
        out!(
            "  {:width$}  {}  models={}  ({credential})",
            u.name,
            u.base_url,
            u.models.join(","),
        );
        if u.has_fallbacks() {
            let chain: Vec<&str> = u
                .chain
                .iter()
                .filter_map(|&i| cfg.upstreams.get(i).map(|f| f.name.as_str()))
                .collect();
            out!("  {:width$}  chain: {}", "", chain.join(" → "));
        }
    }
    if cfg.upstreams.iter().any(|u| u.has_fallbacks()) {
        let r = &cfg.retries;
        out!(
            "retries: at most {}% of the last minute's requests (at least {} a minute); a breaker opens after {} consecutive failures for {:?}, then one probe",
            r.budget_percent,
            r.min_retries_per_minute,
            r.breaker_failures,
            r.breaker_cooldown
        );
    }
}

/// `check`: the model table's rows, user and learned.
fn print_model_table(cfg: &Config, table: &ModelTable) {
    let learned: Vec<_> = table
        .learned
        .names()
        .into_iter()
        .map(|n| {
            let (medium, model) = Medium::of_learned(&n);
            (medium, model.to_owned())
        })
        .collect();
    let count = |m: Option<Medium>| learned.iter().filter(|(k, _)| *k == m).count();
    out!(
        "model table: {} user rows, {} built-in rows, {} learned rows ({} for images, {} for PDFs, {} for audio; first match wins, in that order)",
        cfg.models.len(),
        table.builtin_len(),
        learned.len(),
        count(None),
        count(Some(Medium::Pdf)),
        count(Some(Medium::Audio)),
    );
    for (pattern, caps) in table.user_rows() {
        out!("  user     {pattern:?}  {}", caps_text(caps));
    }
    for (medium, model) in &learned {
        let what = match medium {
            None => "vision=false (refused images)",
            Some(Medium::Pdf) => "pdf=false (refused documents)",
            Some(Medium::Audio) => "audio=false (refused audio)",
        };
        out!("  learned  {model:?}  {what}");
    }
}

/// `check`: what is done to images, repeated context, documents and audio,
/// and by whom.
fn print_media(cfg: &Config) {
    out!(
        "images: non_vision={} artifacts in {}",
        cfg.images.non_vision,
        cfg.artifacts_dir().display()
    );
    match cfg.dedup.enabled {
        true => out!(
            "dedup: runs of at least {} lines and {} bytes, each note saving {} bytes more than its length; kept whole: status lines, results under {} bytes, the instructions and the first user message",
            cfg.dedup.min_run_lines,
            cfg.dedup.min_run_bytes,
            visor::transform::dedup::NOTE_MIN_SAVING,
            visor::transform::dedup::SMALL_TEXT
        ),
        false => out!("dedup: off"),
    }
    let d = &cfg.describer;
    let describer_upstream = d
        .upstream
        .clone()
        .or_else(|| cfg.upstreams.first().map(|u| u.name.clone()))
        .unwrap_or_default();
    out!(
        "describer: model {} on upstream {describer_upstream}, prompt v{PROMPT_VERSION}, timeout {}s, concurrency {}, on_miss={}, query_aware={}",
        d.model,
        secs(d.timeout),
        d.concurrency,
        d.on_miss,
        d.query_aware
    );
    let t = &cfg.transcriber;
    out!(
        "transcriber: model {} on upstream {}, timeout {}s, concurrency {}",
        t.model,
        t.upstream
            .clone()
            .or_else(|| cfg.upstreams.first().map(|u| u.name.clone()))
            .unwrap_or_default(),
        secs(t.timeout),
        t.concurrency
    );
    out!(
        "documents: at most {} pages or images described per document",
        cfg.documents.max_pages_described
    );
}

/// `check --model`: what the model table says about one model, and which
/// row decided.
fn print_model(table: &ModelTable, m: &str) {
    let r = table.resolve(m, None);
    out!("model {m:?}: {}", caps_text(&r.caps));
    out!(
        "  images {} — decided by {}",
        if r.vision {
            "sent as they are"
        } else {
            "replaced"
        },
        r.vision_from
    );
    let said = |stated: Option<bool>, default: &str| match stated {
        Some(_) => "its row".to_owned(),
        None => default.to_owned(),
    };
    let fate = |takes: bool| match takes {
        true => "sent as they are",
        false => "replaced by their text",
    };
    out!(
        "  PDFs and other documents {} — decided by {}",
        fate(r.pdf),
        said(r.caps.pdf, "no row: follows images (or learned)")
    );
    out!(
        "  DOCX, PPTX, XLSX {} — decided by {}",
        fate(r.office),
        said(
            r.caps.office,
            "no row: replaced unless a row says office = true"
        )
    );
    out!(
        "  audio {} — decided by {}",
        match r.audio {
            true => "sent as it is",
            false => "replaced by its transcript",
        },
        said(r.caps.audio, "no row: follows images (or learned)")
    );
}

fn explain(
    source: &Source,
    model: Option<String>,
    raw: bool,
    endpoint: Endpoint,
    file: Option<PathBuf>,
) -> ExitCode {
    let Some(cfg) = load(source) else {
        return ExitCode::FAILURE;
    };
    let Some(off) = offline(&cfg, false) else {
        return ExitCode::FAILURE;
    };
    let body = match request_body(file.as_deref()) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let probed = match visor::proxy::request_body::probe(&body) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: the request body is not valid JSON: {e}");
            return ExitCode::FAILURE;
        }
    };
    // `--model`, else the body's own.
    let Some(model) = model.or(probed.model) else {
        eprintln!("error: the body names no model: give one with --model");
        return ExitCode::FAILURE;
    };
    let model = model.as_str();
    let shape = match endpoint {
        Endpoint::Chat => Shape::Chat,
        Endpoint::Responses => Shape::Responses,
        Endpoint::Messages => Shape::Messages,
    };
    let resolved = off.table.resolve(model, None);
    let plan = visor::explain::plan(
        shape,
        &resolved,
        cfg.images.non_vision == visor::config::NonVision::Describe,
        visor::transform::Rules::new(
            &cfg.images,
            &cfg.dedup,
            resolved.caps.max_images,
            resolved.caps.context_window,
        ),
        cfg.describer.query_aware,
        visor::transform::Limits {
            hoist_text: resolved.known(),
            ..visor::proxy::fit_limits(
                &resolved.caps,
                visor::transform::Limits {
                    provider_size: cfg.images.provider_size,
                    diet_edge: cfg.images.max_edge,
                    diet_tokens: cfg.images.max_image_tokens,
                    ..visor::transform::Limits::NONE
                },
            )
        },
    );
    let texts = visor::explain::Texts::Store(off.store.as_ref(), &cfg.describer.model);
    let mut rewrite = off
        .rt
        .block_on(visor::explain::rewrite(&body, &plan, &texts));
    // Counted as the proxy counts a request with no proxy key: under the
    // `[[key]]` that has none, if there is one.
    let anonymous = cfg.keys.iter().find(|k| k.key.is_none());
    let key_name = anonymous.map_or("none", |k| k.name.as_str());
    let asked = (shape, model, resolved.caps.cache_min_tokens, key_name);
    visor::explain::with_cache(&cfg.cache, &cfg.upstreams, asked, &body, &mut rewrite);
    let sent = rewrite.body.as_deref().unwrap_or(&body);
    if raw {
        return write_raw(sent);
    }
    // A request nested deeper than serde_json reads (128 levels; visor
    // itself streams through any depth) is printed as it is sent.
    let (request, verbatim) = match serde_json::from_slice::<serde_json::Value>(sent) {
        Ok(v) => (v, None),
        Err(e) if e.to_string().contains("recursion limit") => {
            (serde_json::Value::Null, Some(String::from_utf8_lossy(sent)))
        }
        Err(e) => {
            eprintln!("error: the rewritten request is not valid JSON ({e}); please report this");
            return ExitCode::FAILURE;
        }
    };
    let store = match &off.note {
        None => cfg.store.backend.to_string(),
        Some(n) => format!("{} ({n})", cfg.store.backend),
    };
    let out = serde_json::json!({
        "request": request,
        "report": visor::explain::report(model, shape, &resolved, &rewrite, store),
    });
    print_explained(&out, verbatim.as_deref())
}

/// `explain`: the request body from FILE, or stdin for `-` or none.
fn request_body(file: Option<&std::path::Path>) -> Result<Vec<u8>, String> {
    match file {
        Some(p) if p != std::path::Path::new("-") => {
            std::fs::read(p).map_err(|e| format!("cannot read {}: {e}", p.display()))
        }
        _ => {
            let mut b = Vec::new();
            std::io::Read::read_to_end(&mut std::io::stdin(), &mut b)
                .map(|_| b)
                .map_err(|e| format!("cannot read stdin: {e}"))
        }
    }
}

/// `explain --raw`: the exact bytes, as visor sends them (the body itself
/// when nothing changed).
fn write_raw(sent: &[u8]) -> ExitCode {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(sent).and_then(|()| stdout.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: cannot write to stdout: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `explain`: the request and its report as pretty JSON; a request too
/// deep for serde_json (`verbatim`) in its place as it is sent.
fn print_explained(out: &serde_json::Value, verbatim: Option<&str>) -> ExitCode {
    match serde_json::to_string_pretty(out) {
        Ok(s) => {
            match verbatim {
                None => out!("{s}"),
                // "request" is the last key (keys are sorted).
                Some(raw) => {
                    let slot = "\"request\": null";
                    match s.rfind(slot) {
                        Some(at) => {
                            out!("{}\"request\": {raw}{}", &s[..at], &s[at + slot.len()..])
                        }
                        None => out!("{s}"),
                    }
                }
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn serve(source: &Source, listen: Option<SocketAddr>) -> ExitCode {
    let Some(cfg) = load(source) else {
        return ExitCode::FAILURE;
    };
    init_logging(cfg.server.log_format);
    let label = source.label();
    if let Source::BuiltIn = source {
        tracing::info!(
            "no config file found (--config, $VISOR_CONFIG, ./visor.toml, ./config/visor.toml, $XDG_CONFIG_HOME/visor/visor.toml, /etc/visor/visor.toml): using the built-in default; `visor init` writes one"
        );
    }
    for w in &cfg.warnings {
        tracing::warn!(config = %label, "{w}");
    }
    // Worker 0 runs on this thread; Server::run starts the others.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(visor::server::MAX_BLOCKING_THREADS)
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        let server = Server::bind(cfg, listen).await?;
        let shutdown = shutdown_signal()?;
        let addr = server.local_addr()?;
        let workers = server.workers();
        tracing::info!(%addr, workers, config = %label, "visor listening");
        server.run(shutdown).await
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `visor init [RECIPE]`: lists the recipes, or writes one.
fn init(recipe: Option<&str>, output: &std::path::Path, force: bool) -> ExitCode {
    let Some(name) = recipe else {
        out!("recipes (`visor init NAME` writes one to ./visor.toml):");
        for (name, what, _) in RECIPES {
            out!("  {name:12} {what}");
        }
        return ExitCode::SUCCESS;
    };
    let Some((_, _, text)) = RECIPES.iter().find(|(n, _, _)| *n == name) else {
        let names: Vec<&str> = RECIPES.iter().map(|(n, _, _)| *n).collect();
        eprintln!(
            "error: no recipe {name:?}; the recipes are: {}",
            names.join(", ")
        );
        return ExitCode::FAILURE;
    };
    if output.exists() && !force {
        eprintln!("error: {} exists; --force replaces it", output.display());
        return ExitCode::FAILURE;
    }
    if let Err(e) = std::fs::write(output, text) {
        eprintln!("error: cannot write {}: {e}", output.display());
        return ExitCode::FAILURE;
    }
    out!("wrote {} (recipe {name})", output.display());
    // The environment variables it reads.
    let vars: std::collections::BTreeSet<&str> = text
        .match_indices("${")
        .filter_map(|(at, _)| text[at + 2..].split_once('}').map(|(v, _)| v))
        .collect();
    if !vars.is_empty() {
        let vars: Vec<&str> = vars.into_iter().collect();
        out!("it reads these environment variables: {}", vars.join(", "));
    }
    let at = match output == std::path::Path::new("visor.toml") {
        true => String::new(),
        false => format!(" --config {}", output.display()),
    };
    out!("next: `visor check{at}`, then `visor serve{at}`");
    ExitCode::SUCCESS
}

/// Log lines to stderr: text for people, or one JSON object per line
/// (`server.log_format = "json"`: `timestamp`, `level`, `fields` with the
/// message and the same fields as the text line, for log pipelines).
fn init_logging(format: visor::config::LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_timer(visor::log_format::LogTime)
        .with_target(false);
    match format {
        visor::config::LogFormat::Json => fmt.json().with_current_span(false).init(),
        // The stock line, written by visor's faster field formatter
        // (byte for byte the same, as the clock above: src/log_format.rs).
        visor::config::LogFormat::Text => fmt
            .fmt_fields(visor::log_format::LogFields)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
    }
}
