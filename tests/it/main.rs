//! visor's integration tests: one test binary, so the crate (the PDF stack
//! included) is linked once, not once per file. The folders mirror `src/`;
//! the rest tests the binary, the documents and the clients as users see
//! them. `cargo test --test it proxy::streaming::` runs one folder's file.
//!
//! The tests share this process: none sets environment variables, changes
//! directory or binds a fixed port; each visor, mock and `redis-server` is
//! on a port of its own, and every file they write is under a folder of its
//! own (`support::temp_dir`, `support::temp_config`).

mod support;

/// The `visor` binary as a user runs it.
mod cli;
/// End to end with the real clients (npm and Python), and the OpenAI SDK.
mod clients;
/// `deploy/` and the README and `docs/`, kept true.
mod deploy;
mod docs;
mod sdk_openai;

/// `src/connections.rs`: client connections.
mod connections;
/// `src/media_text/describe.rs`: the describer.
mod describe;
/// `src/inspector/`: the page and JSON of recent requests.
mod inspector;
/// The inspector page in a real browser (headless Chromium, WebDriver).
mod inspector_browser;
/// `src/limits.rs`: `[[key]]` limits.
mod limits;
/// `src/prompt_cache/`: breakpoints, keys and the cache judged.
mod prompt_cache;
/// `src/sessions.rs`: server-side sessions.
mod sessions;
/// `src/telemetry/`: OpenTelemetry traces, to a real OTLP receiver.
mod telemetry;

/// `src/media/`: documents and audio.
mod media {
    mod documents;
    mod fault_documents;
}

/// `src/proxy/`: the request path.
mod proxy {
    mod bad_input;
    mod fallbacks;
    mod fault_corpus;
    mod in_process;
    mod streaming;
    mod transparency;
    mod websocket;
}

/// `src/server.rs`: starting and stopping.
mod server {
    mod shutdown;
}

/// `src/store/`: the store backends.
mod store {
    mod faults;
    mod redis;
    mod sessions;
}

/// `src/transform/`: what the transforms do to a request.
mod transform {
    mod context;
    mod fit_images;
    mod images;
}

/// `src/upstream.rs`: the transport to upstreams.
mod upstream {
    mod tls;
}
