//! Listening, connections, and graceful shutdown.
//!
//! Each accepted connection is served by hyper's auto builder (HTTP/1.1, or
//! HTTP/2 with prior knowledge) and watched by a [`GracefulShutdown`]. On
//! shutdown visor stops accepting, marks itself draining (`/readyz` → 503),
//! lets in-flight responses (streams included) finish for up to
//! `server.drain_timeout_secs`, and returns.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;

use crate::config::Config;
use crate::metrics::Metrics;
use crate::proxy::{AppState, stack};
use crate::upstream;

/// A bound, not yet serving, proxy.
pub struct Server {
    state: Arc<AppState>,
    listener: TcpListener,
}

impl Server {
    /// Builds the shared state and binds `listen` (or `server.listen`).
    pub async fn bind(config: Config, listen: Option<SocketAddr>) -> io::Result<Self> {
        let addr = listen.unwrap_or(config.server.listen);
        let metrics = Arc::new(Metrics::new().map_err(io::Error::other)?);
        let upstreams =
            upstream::Upstreams::new(config.server.connect_timeout, config.upstreams.len())
                .map_err(io::Error::other)?;
        let state = Arc::new(AppState::new(config, metrics, upstreams).map_err(io::Error::other)?);
        let listener = TcpListener::bind(addr).await?;
        Ok(Self { state, listener })
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    pub fn state(&self) -> Arc<AppState> {
        self.state.clone()
    }

    /// Serves until `shutdown` resolves, then drains.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> io::Result<()> {
        let Server { state, listener } = self;
        let service = TowerToHyperService::new(stack(state.clone()));
        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(Duration::from_secs(30));
        builder.http2().timer(TokioTimer::new());
        let graceful = GracefulShutdown::new();
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                accepted = listener.accept() => {
                    let (stream, _peer) = match accepted {
                        Ok(a) => a,
                        Err(e) => {
                            // Out of file descriptors and the like: log, back
                            // off a moment, keep serving.
                            tracing::warn!(error = %e, "accept failed");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    };
                    let _ = stream.set_nodelay(true);
                    let conn = builder.serve_connection(TokioIo::new(stream), service.clone());
                    let conn = graceful.watch(conn.into_owned());
                    tokio::spawn(async move {
                        if let Err(e) = conn.await {
                            tracing::debug!(error = %e, "connection ended with an error");
                        }
                    });
                }
                () = &mut shutdown => break,
            }
        }
        drop(listener);
        state.draining.store(true, Ordering::Relaxed);
        let drain = state.config.server.drain_timeout;
        tracing::info!(
            drain_secs = drain.as_secs_f64(),
            "shutting down: draining connections"
        );
        tokio::select! {
            () = graceful.shutdown() => tracing::info!("all connections closed"),
            () = tokio::time::sleep(drain) => tracing::warn!("drain timeout reached; closing the rest"),
        }
        Ok(())
    }
}

/// Registers SIGINT and SIGTERM handlers now (so a signal that arrives
/// before the returned future is first polled is not lost) and returns a
/// future that resolves on either.
#[cfg(unix)]
pub fn shutdown_signal() -> io::Result<impl Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received"),
            _ = int.recv() => tracing::info!("SIGINT received"),
        }
    })
}

#[cfg(not(unix))]
pub fn shutdown_signal() -> io::Result<impl Future<Output = ()>> {
    Ok(async {
        let _ = tokio::signal::ctrl_c().await;
    })
}
