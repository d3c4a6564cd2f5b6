//! `[server]`: the listener, the body cap, the timeouts, `server.api_keys`,
//! workers and connections.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::{Problems, Secret};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    #[serde(default = "default_listen")]
    pub listen: String,
    #[serde(default = "default_max_body_bytes")]
    pub max_body_bytes: u64,
    #[serde(default = "default_request_timeout_secs")]
    pub request_timeout_secs: f64,
    #[serde(default = "default_connect_timeout_secs")]
    pub connect_timeout_secs: f64,
    #[serde(default = "default_first_byte_timeout_secs")]
    pub first_byte_timeout_secs: f64,
    #[serde(default = "default_idle_timeout_secs")]
    pub idle_timeout_secs: f64,
    #[serde(default = "default_drain_timeout_secs")]
    pub drain_timeout_secs: f64,
    #[serde(default = "default_data_dir")]
    pub data_dir: String,
    #[serde(default)]
    pub api_keys: Vec<Secret>,
    /// Worker threads, each with its own listener; 0 = one per CPU.
    #[serde(default)]
    pub workers: usize,
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    #[serde(default = "default_header_timeout_secs")]
    pub header_timeout_secs: f64,
    #[serde(default = "default_drain_delay_secs")]
    pub drain_delay_secs: f64,
    /// `"text"` (a line for people) or `"json"` (one object per line, for
    /// log pipelines).
    #[serde(default = "default_log_format")]
    pub log_format: String,
}

fn default_log_format() -> String {
    "text".to_owned()
}

/// How `visor serve` writes its log lines (`server.log_format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

impl Default for RawServer {
    fn default() -> Self {
        Self {
            listen: default_listen(),
            max_body_bytes: default_max_body_bytes(),
            request_timeout_secs: default_request_timeout_secs(),
            connect_timeout_secs: default_connect_timeout_secs(),
            first_byte_timeout_secs: default_first_byte_timeout_secs(),
            idle_timeout_secs: default_idle_timeout_secs(),
            drain_timeout_secs: default_drain_timeout_secs(),
            data_dir: default_data_dir(),
            api_keys: Vec::new(),
            workers: 0,
            max_connections: default_max_connections(),
            header_timeout_secs: default_header_timeout_secs(),
            drain_delay_secs: default_drain_delay_secs(),
            log_format: default_log_format(),
        }
    }
}

/// `server.max_connections` when not set (lowered quietly to fit the
/// open-file limit; a value of the user's own is lowered with a warning).
pub const DEFAULT_MAX_CONNECTIONS: usize = 10_000;

fn default_max_connections() -> usize {
    DEFAULT_MAX_CONNECTIONS
}
fn default_header_timeout_secs() -> f64 {
    10.0
}
/// 0: a plain stop (nothing in flight) exits at once. Behind a load
/// balancer set it (`deploy/k8s/configmap.yaml` sets 5); only SIGTERM
/// waits it.
fn default_drain_delay_secs() -> f64 {
    0.0
}

fn default_listen() -> String {
    "127.0.0.1:8787".to_owned()
}
fn default_max_body_bytes() -> u64 {
    32 * 1024 * 1024
}
fn default_request_timeout_secs() -> f64 {
    600.0
}
fn default_connect_timeout_secs() -> f64 {
    10.0
}
fn default_first_byte_timeout_secs() -> f64 {
    300.0
}
fn default_idle_timeout_secs() -> f64 {
    120.0
}
fn default_drain_timeout_secs() -> f64 {
    30.0
}
fn default_data_dir() -> String {
    "var".to_owned()
}

/// `[server]`, checked.
#[derive(Debug)]
pub struct Server {
    pub listen: SocketAddr,
    pub max_body_bytes: u64,
    pub request_timeout: Duration,
    pub connect_timeout: Duration,
    pub first_byte_timeout: Duration,
    pub idle_timeout: Duration,
    pub drain_timeout: Duration,
    pub data_dir: PathBuf,
    pub api_keys: Vec<Secret>,
    pub workers: usize,
    /// Open client connections at most (all workers together).
    pub max_connections: usize,
    /// A connection sends a whole request head (HTTP/2: its preface) within
    /// this — counted from its opening, and from the end of its last
    /// response while it sits idle.
    pub header_timeout: Duration,
    /// At shutdown on SIGTERM (not SIGINT): `/readyz` answers 503 this long
    /// before the listeners close. 0 by default.
    pub drain_delay: Duration,
    pub log_format: LogFormat,
}

impl RawServer {
    pub(super) fn validate(self, p: &mut Problems) -> Server {
        let listen = match self.listen.parse::<SocketAddr>() {
            Ok(a) => a,
            Err(_) => {
                p.bad(
                    "server.listen",
                    format_args!("{:?}", self.listen),
                    "must be an IP:port address such as \"127.0.0.1:8787\"",
                );
                SocketAddr::from(([127, 0, 0, 1], 0))
            }
        };
        p.at_least_one("server.max_body_bytes", self.max_body_bytes);
        let server = Server {
            listen,
            max_body_bytes: self.max_body_bytes,
            request_timeout: p.secs("server.request_timeout_secs", self.request_timeout_secs),
            connect_timeout: p.secs("server.connect_timeout_secs", self.connect_timeout_secs),
            first_byte_timeout: p.secs(
                "server.first_byte_timeout_secs",
                self.first_byte_timeout_secs,
            ),
            idle_timeout: p.secs("server.idle_timeout_secs", self.idle_timeout_secs),
            drain_timeout: p.secs("server.drain_timeout_secs", self.drain_timeout_secs),
            data_dir: PathBuf::from(&self.data_dir),
            api_keys: self.api_keys,
            workers: self.workers,
            max_connections: self.max_connections,
            header_timeout: p.secs("server.header_timeout_secs", self.header_timeout_secs),
            drain_delay: if self.drain_delay_secs == 0.0 {
                Duration::ZERO
            } else {
                p.secs("server.drain_delay_secs", self.drain_delay_secs)
            },
            log_format: p
                .one_of(
                    "server.log_format",
                    &self.log_format,
                    &[("text", LogFormat::Text), ("json", LogFormat::Json)],
                )
                .unwrap_or(LogFormat::Text),
        };
        p.at_least_one("server.max_connections", server.max_connections as u64);
        if server.workers > 1024 {
            p.bad(
                "server.workers",
                server.workers,
                "at most 1024 (0 = one per CPU)",
            );
        }
        for (i, k) in server.api_keys.iter().enumerate() {
            if k.expose().trim().is_empty() {
                p.bad(
                    format_args!("server.api_keys[{i}]"),
                    "\"\"",
                    "a proxy key must not be empty",
                );
            }
        }
        server
    }
}
