//! The `visor` command line: `serve` (the default) and `check`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use visor::config::Config;
use visor::server::{Server, shutdown_signal};

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
        /// Config file [default: $VISOR_CONFIG, then config/visor.toml]
        #[arg(long)]
        config: Option<PathBuf>,
        /// Listen address, overriding server.listen
        #[arg(long)]
        listen: Option<SocketAddr>,
    },
    /// Validate the config and print the routes; exit 0 when valid, 1 if not.
    Check {
        /// Config file [default: $VISOR_CONFIG, then config/visor.toml]
        #[arg(long)]
        config: Option<PathBuf>,
    },
}

fn config_path(flag: Option<PathBuf>) -> PathBuf {
    flag.or_else(|| std::env::var_os("VISOR_CONFIG").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("config/visor.toml"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command.unwrap_or(Command::Serve {
        config: None,
        listen: None,
    }) {
        Command::Check { config } => check(&config_path(config)),
        Command::Serve { config, listen } => serve(&config_path(config), listen),
    }
}

fn load(path: &std::path::Path) -> Option<Config> {
    match Config::load(path) {
        Ok(c) => Some(c),
        Err(e) => {
            eprintln!("error: {e}");
            None
        }
    }
}

fn check(path: &std::path::Path) -> ExitCode {
    let Some(cfg) = load(path) else {
        return ExitCode::FAILURE;
    };
    let s = &cfg.server;
    println!("{}: ok", path.display());
    println!("listen: {}", s.listen);
    println!(
        "limits: max_body_bytes={} connect={:?} first_byte={:?} idle={:?} request={:?} drain={:?}",
        s.max_body_bytes,
        s.connect_timeout,
        s.first_byte_timeout,
        s.idle_timeout,
        s.request_timeout,
        s.drain_timeout
    );
    if s.api_keys.is_empty() {
        println!("proxy keys: none (clients' own Authorization / x-api-key are forwarded)");
    } else {
        println!(
            "proxy keys: {} configured (clients must send one; it is never forwarded)",
            s.api_keys.len()
        );
    }
    println!("routes (first match wins; requests without a model go to the first):");
    let width = cfg
        .upstreams
        .iter()
        .map(|u| u.name.len())
        .max()
        .unwrap_or(0);
    for u in &cfg.upstreams {
        let credential = match &u.api_key {
            Some(_) => format!("own key as {}", u.auth.as_str()),
            None if s.api_keys.is_empty() => "client's key forwarded".to_owned(),
            None => "no credential".to_owned(),
        };
        println!(
            "  {:width$}  {}  models={}  ({credential})",
            u.name,
            u.base_url,
            u.models.join(","),
        );
    }
    println!("user model rows: {}", cfg.models.len());
    ExitCode::SUCCESS
}

fn serve(path: &std::path::Path, listen: Option<SocketAddr>) -> ExitCode {
    init_logging();
    let Some(cfg) = load(path) else {
        return ExitCode::FAILURE;
    };
    // Worker 0 runs on this thread; Server::run starts the others.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
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
        tracing::info!(%addr, workers, config = %path.display(), "visor listening");
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

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .init();
}
