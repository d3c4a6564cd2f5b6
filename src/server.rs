//! Listening, connections, and graceful shutdown.
//!
//! visor runs one worker per core (`server.workers`), each a single-threaded
//! runtime with its own listening socket on the shared address. Each accepted
//! connection is served by hyper's auto builder (HTTP/1.1, or HTTP/2 with
//! prior knowledge) and watched by its worker's [`GracefulShutdown`]. On
//! shutdown visor marks itself draining (`/readyz` → 503), on SIGTERM keeps
//! serving for `server.drain_delay_secs` (0 by default; SIGINT never waits
//! it), stops accepting, lets in-flight responses (streams included) finish
//! for up to `server.drain_timeout_secs`, and returns — at once when nothing
//! is in flight. A second SIGINT or SIGTERM exits at once (see
//! [`shutdown_signal`]).

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::{Barrier, oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::connections::{Gate, Prefixed, Proto, Registered, Slot, Tracked, sniff};
use crate::metrics::Metrics;
use crate::proxy::{AppState, stack};
use crate::upstream;

/// Blocking threads per worker runtime (large-image transforms, artifact
/// writes). Few on purpose: each thread that allocates multi-megabyte
/// buffers gets its own malloc arena, and with tokio's default (512) the
/// arenas' retained memory made a 4 MB image request cost 4.5× its size in
/// resident memory instead of 2× (`benches/load.sh`, large-strip).
pub const MAX_BLOCKING_THREADS: usize = 2;

/// A bound, not yet serving, proxy.
pub struct Server {
    state: Arc<AppState>,
    addr: SocketAddr,
    /// One listening socket per worker, all on `addr` (SO_REUSEPORT): the
    /// kernel spreads connections over them.
    listeners: Vec<std::net::TcpListener>,
    /// The client-connection budget all workers share.
    gate: Arc<Gate>,
}

impl Server {
    /// Builds the shared state and binds `listen` (or `server.listen`) once
    /// per worker.
    pub async fn bind(mut config: Config, listen: Option<SocketAddr>) -> io::Result<Self> {
        let addr = listen.unwrap_or(config.server.listen);
        // The address served is the one the parts see (the inspector is
        // open without a key only on a loopback one).
        config.server.listen = addr;
        let workers = match config.server.workers {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        let metrics = Arc::new(Metrics::new().map_err(io::Error::other)?);
        let upstreams = upstream::Upstreams::new(config.server.connect_timeout, &config.upstreams)
            .map_err(io::Error::other)?;
        let learned_path = config.learned_path();
        let state =
            Arc::new(crate::app::build(config, metrics, upstreams).map_err(io::Error::other)?);
        state.rewrite.import_legacy_learned(&learned_path).await;
        let learned = state.rewrite.sync_learned().await;
        match state.store.problem() {
            None => tracing::info!(store = %state.store.label(), learned, "store ready"),
            Some(p) => tracing::warn!(problem = %p, "starting with memory only"),
        }
        tracing::info!(
            documents = %state.rewrite.media.reader_note(),
            "documents read"
        );
        // The workers' listeners share the port (SO_REUSEPORT), which another
        // process of the same user could join too: a second visor started
        // on a port that is served would quietly take part of its traffic.
        // It is refused instead, as a server without the option would be.
        if workers > 1 && addr.port() != 0 && someone_listens(addr).await {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!(
                    "{addr} is already served by another process (another visor still running or draining?): stop it first, or choose another server.listen"
                ),
            ));
        }
        let first = reuseport_listener(addr, workers > 1)?;
        let addr = first.local_addr()?;
        let mut listeners = vec![first.into_std()?];
        for _ in 1..workers {
            listeners.push(reuseport_listener(addr, true)?.into_std()?);
        }
        let max_connections = state.server.max_connections;
        let (limit, lowered_by) = crate::connections::effective_limit(max_connections);
        if let Some(nofile) = lowered_by {
            // The built-in default (or the shipped config's copy of it) is
            // not something the user asked for: lowering it is said, not
            // warned about. A value of the user's own is.
            if max_connections == crate::config::DEFAULT_MAX_CONNECTIONS {
                tracing::info!(
                    max_connections,
                    open_file_limit = nofile,
                    using = limit,
                    "server.max_connections (the default) fitted to the open-file limit"
                );
            } else {
                tracing::warn!(
                    max_connections,
                    open_file_limit = nofile,
                    using = limit,
                    "server.max_connections lowered to fit the open-file limit (raise `ulimit -n` for more)"
                );
            }
        }
        Ok(Self {
            state,
            addr,
            listeners,
            gate: Gate::new(limit),
        })
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.addr)
    }

    /// Worker threads (one listener each).
    pub fn workers(&self) -> usize {
        self.listeners.len()
    }

    pub fn state(&self) -> Arc<AppState> {
        self.state.clone()
    }

    /// Serves until `shutdown` resolves, then drains.
    ///
    /// Worker 0 runs on the calling task's runtime; every other worker gets
    /// an OS thread with a single-threaded runtime of its own. A connection
    /// lives on one worker from accept to close, and the upstream connections
    /// it uses are driven by the same task, so a request never waits for a
    /// wake-up from another thread (thread-per-core, as nginx does it).
    ///
    /// `shutdown` resolves to the [`Stop`] that asked (`()` counts as
    /// [`Stop::Terminate`]): only a SIGTERM waits `server.drain_delay_secs`.
    pub async fn run<S: Into<Stop>>(self, shutdown: impl Future<Output = S>) -> io::Result<()> {
        let Server {
            state,
            listeners,
            gate,
            ..
        } = self;
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut listeners = listeners.into_iter();
        let first = listeners
            .next()
            .ok_or_else(|| io::Error::other("no listener"))?;
        // Workers leave together: a worker that has drained keeps its runtime
        // (and the upstream connection tasks it spawned, which others may
        // share) running until every worker has drained.
        let all_drained = Arc::new(Barrier::new(listeners.len() + 1));
        let mut workers = Vec::new();
        for (i, listener) in listeners.enumerate() {
            let (done_tx, done_rx) = oneshot::channel();
            let (state, stop, gate) = (state.clone(), stop_rx.clone(), gate.clone());
            let all_drained = all_drained.clone();
            std::thread::Builder::new()
                .name(format!("visor-worker-{}", i + 1))
                .spawn(move || {
                    let result = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .max_blocking_threads(MAX_BLOCKING_THREADS)
                        .build()
                        .and_then(|rt| {
                            rt.block_on(serve_then_wait(state, gate, listener, stop, all_drained))
                        });
                    let _ = done_tx.send(result);
                })?;
            workers.push(done_rx);
        }
        let signal = async {
            let how: Stop = shutdown.await.into();
            // /readyz answers 503 at once; on SIGTERM (what orchestrators
            // send) serving goes on for drain_delay so load balancers see it
            // before the listeners close. SIGINT is someone at a terminal:
            // no load balancer to wait for.
            state.life.draining.store(true, Ordering::Relaxed);
            let delay = match how {
                Stop::Terminate => state.server.drain_delay,
                Stop::Interrupt => {
                    if !state.server.drain_delay.is_zero() {
                        tracing::info!(
                            "SIGINT: not waiting server.drain_delay_secs (only SIGTERM does)"
                        );
                    }
                    Duration::ZERO
                }
            };
            if !delay.is_zero() {
                tracing::info!(
                    delay_secs = delay.as_secs_f64(),
                    "shutting down: /readyz answers 503, still serving"
                );
                tokio::time::sleep(delay).await;
            }
            state.rewrite.media.describer().shutdown();
            state.rewrite.media.transcriber().shutdown();
            state.life.shutdown.cancel();
            let drain = state.server.drain_timeout;
            tracing::info!(
                drain_secs = drain.as_secs_f64(),
                "shutting down: draining connections"
            );
            let _ = stop_tx.send(true);
        };
        let (learned, probe) = (
            refresh_learned(state.clone(), stop_rx.clone()),
            probe_store(state.clone(), stop_rx.clone()),
        );
        let refresh = async move {
            tokio::join!(learned, probe);
        };
        let local = serve_then_wait(state.clone(), gate, first, stop_rx, all_drained);
        let (local, (), ()) = tokio::join!(local, signal, refresh);
        let mut result = local;
        for w in workers {
            match w.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => result = result.and(Err(e)),
                Err(_) => result = result.and(Err(io::Error::other("a worker thread died"))),
            }
        }
        // The drained requests' spans go to the collector (bounded).
        if let Some(t) = &state.telemetry {
            t.flush(TELEMETRY_FLUSH).await;
        }
        result
    }
}

/// How long spans still queued at shutdown may take to reach the collector.
const TELEMETRY_FLUSH: Duration = Duration::from_secs(5);

/// Whether something accepts connections at `addr` (an unspecified address
/// is asked on loopback).
async fn someone_listens(addr: SocketAddr) -> bool {
    let mut at = addr;
    if at.ip().is_unspecified() {
        at.set_ip(match at {
            SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    let probe = tokio::net::TcpStream::connect(at);
    matches!(
        tokio::time::timeout(Duration::from_millis(500), probe).await,
        Ok(Ok(_))
    )
}

fn reuseport_listener(addr: SocketAddr, reuse_port: bool) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    #[cfg(unix)]
    if reuse_port {
        socket.set_reuseport(true)?;
    }
    #[cfg(not(unix))]
    let _ = reuse_port;
    socket.bind(addr)?;
    socket.listen(1024)
}

/// [`serve`], then waits (bounded) for the other workers to finish draining.
async fn serve_then_wait(
    state: Arc<AppState>,
    gate: Arc<Gate>,
    listener: std::net::TcpListener,
    stop: watch::Receiver<bool>,
    all_drained: Arc<Barrier>,
) -> io::Result<()> {
    let (result, drained_by) = match serve(state.clone(), gate, listener, stop).await {
        Ok(by) => (Ok(()), by),
        Err(e) => (Err(e), Instant::now()),
    };
    // One bound for everything after the drain started: the drain itself,
    // the other workers, and the work requests left behind.
    let bound = drained_by + Duration::from_secs(5);
    let _ = tokio::time::timeout_at(bound, all_drained.wait()).await;
    // Work requests left behind (turns being stored, WebSocket relays)
    // runs on the workers' runtimes: each stays up until all of it is
    // done, within the bound.
    state.life.tasks.close();
    if tokio::time::timeout_at(bound, state.life.tasks.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            left = state.life.tasks.len(),
            "shutting down with background work unfinished"
        );
    }
    result
}

/// A request head (HTTP/2: a header list) larger than this is refused
/// (HTTP/1.1: 431).
const MAX_HEAD_BYTES: usize = 64 * 1024;

/// Accept errors back off from this…
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(5);
/// …doubling up to this, and reset by the next accepted connection.
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);
/// HTTP/2 pings while a connection is open: a peer that does not answer
/// one within [`H2_PING_TIMEOUT`] is gone.
const H2_PING_EVERY: Duration = Duration::from_secs(20);
const H2_PING_TIMEOUT: Duration = Duration::from_secs(20);

/// One worker: accepts on its listener until told to stop, then drains its
/// connections for up to `server.drain_timeout_secs`.
///
/// Each accepted connection takes a slot of the shared [`Gate`] before it
/// is served (at `max_connections` it waits while the longest-idle
/// connection is asked to close, and the worker accepts no other meanwhile). Accept errors (out of file descriptors)
/// back off, doubling, and ask an idle connection to close too. Returns
/// when the drain ended or had to end (connections still open then are
/// dropped): the bound of what shutdown waits for after it.
async fn serve(
    state: Arc<AppState>,
    gate: Arc<Gate>,
    listener: std::net::TcpListener,
    mut stop: watch::Receiver<bool>,
) -> io::Result<Instant> {
    let cut = CancellationToken::new();
    listener.set_nonblocking(true)?;
    let listener = TcpListener::from_std(listener)?;
    let service = TowerToHyperService::new(stack(state.clone()));
    let header_timeout = state.server.header_timeout;
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .max_buf_size(MAX_HEAD_BYTES);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(MAX_HEAD_BYTES as u32)
        .keep_alive_interval(H2_PING_EVERY)
        .keep_alive_timeout(H2_PING_TIMEOUT);
    let builder = Arc::new(builder);
    let tracker = TaskTracker::new();
    let mut backoff = ACCEPT_BACKOFF_MIN;
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            () = stopped(&mut stop) => break,
        };
        let stream = match accepted {
            Ok((stream, _peer)) => {
                backoff = ACCEPT_BACKOFF_MIN;
                stream
            }
            Err(e) => {
                // Out of file descriptors and the like: make room, back off,
                // keep serving.
                tracing::warn!(error = %e, backoff_ms = backoff.as_millis() as u64, "accept failed");
                gate.shed_one();
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    () = stopped(&mut stop) => break,
                }
                backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                continue;
            }
        };
        // A slot for this peer, now that there is one: at the limit the
        // connection idle the longest is asked to close while this one waits
        // (and the next peers wait in the listen backlog).
        let permit = tokio::select! {
            p = gate.admit(crate::connections::SHED_RETRY) => p,
            () = stopped(&mut stop) => break,
        };
        let Some(permit) = permit else { break };
        let _ = stream.set_nodelay(true);
        let registered = gate.register();
        let conn = Connection {
            state: state.clone(),
            builder: builder.clone(),
            service: service.clone(),
            stop: stop.clone(),
        };
        let gauge = state.metrics.connections.clone();
        let slot = Slot::new(permit, gate.clone());
        let cut = cut.clone();
        tracker.spawn(async move {
            gauge.inc();
            tokio::select! {
                () = conn.serve(stream, registered, slot) => {}
                () = cut.cancelled() => {}
            }
            gauge.dec();
        });
    }
    drop(listener);
    tracker.close();
    let drained_by = Instant::now() + state.server.drain_timeout;
    tokio::select! {
        () = tracker.wait() => tracing::debug!("worker: all connections closed"),
        () = tokio::time::sleep_until(drained_by) => {
            tracing::warn!("drain timeout reached; closing the rest");
            // Dropped here, while the runtime runs: their responses end as
            // a client that left (a session turn is still stored, on the
            // tracked task set).
            cut.cancel();
            let _ = tokio::time::timeout(Duration::from_secs(1), tracker.wait()).await;
        }
    }
    Ok(drained_by)
}

/// What one accepted connection is served with.
struct Connection<S> {
    state: Arc<AppState>,
    builder: Arc<auto::Builder<TokioExecutor>>,
    service: S,
    stop: watch::Receiver<bool>,
}

impl<S> Connection<S>
where
    S: hyper::service::Service<
            http::Request<hyper::body::Incoming>,
            Response = http::Response<crate::proxy::body::ProxyBody>,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    /// Sniffs the protocol within `header_timeout`, then serves until the
    /// peer closes, the connection sits idle too long (HTTP/2; hyper's header
    /// read timeout does it for HTTP/1), the gate asks for room, or the
    /// worker stops; the last three close it gracefully.
    async fn serve(
        mut self,
        mut stream: tokio::net::TcpStream,
        registered: Registered,
        slot: Slot,
    ) {
        let conn = registered.conn.clone();
        let header_timeout = self.state.server.header_timeout;
        let closed = &self.state.metrics.connections_closed;
        let sniffed = tokio::select! {
            r = tokio::time::timeout(header_timeout, sniff(&mut stream)) => r,
            () = conn.close_asked() => {
                closed.with_label_values(&["shed"]).inc();
                return;
            }
            () = stopped(&mut self.stop) => return,
        };
        let (proto, prefix) = match sniffed {
            Ok(Ok(p)) => p,
            Ok(Err(_)) => return, // closed before a request
            Err(_) => {
                closed.with_label_values(&["header_timeout"]).inc();
                return;
            }
        };
        let io = Prefixed::new(prefix, TokioIo::new(stream));
        let service = Tracked::new(self.service.clone(), conn.clone(), slot);
        let served = self.builder.serve_connection_with_upgrades(io, service);
        tokio::pin!(served);
        let mut closing = false;
        loop {
            let idle_at = match (proto, closing) {
                (Proto::Http2, false) => conn.idle_deadline(header_timeout),
                _ => None,
            };
            tokio::select! {
                r = served.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(error = %e, "connection ended with an error");
                    }
                    break;
                }
                () = conn.close_asked(), if !closing => {
                    closed.with_label_values(&["shed"]).inc();
                    served.as_mut().graceful_shutdown();
                    closing = true;
                }
                () = stopped(&mut self.stop), if !closing => {
                    served.as_mut().graceful_shutdown();
                    closing = true;
                }
                () = conn.went_idle(), if proto == Proto::Http2 && !closing => {}
                () = sleep_until_or_forever(idle_at) => {
                    // Still idle at the deadline (a request may have come
                    // and gone: the deadline is read again).
                    if conn.idle_deadline(header_timeout).is_some_and(|d| d <= tokio::time::Instant::now()) {
                        closed.with_label_values(&["idle"]).inc();
                        served.as_mut().graceful_shutdown();
                        closing = true;
                    }
                }
            }
        }
        drop(registered);
    }
}

/// Sleeps until `at`, or forever when there is no deadline.
async fn sleep_until_or_forever(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Re-reads the learned models from the store every
/// [`crate::models::LEARNED_REFRESH`] (other replicas' lessons) until stop.
async fn refresh_learned(state: Arc<AppState>, mut stop: watch::Receiver<bool>) {
    let mut ticks: u32 = 0;
    loop {
        tokio::select! {
            () = tokio::time::sleep(crate::models::LEARNED_REFRESH) => {
                let new = state.rewrite.sync_learned().await;
                if new > 0 {
                    tracing::info!(new, "learned models read from the store");
                }
                // Every SWEEP_EVERY ticks: idle sessions leave the disk and
                // memory stores, expired descriptions the disk store (Redis
                // expires its own).
                ticks = ticks.wrapping_add(1);
                if ticks.is_multiple_of(SWEEP_EVERY) {
                    let ttl = state.sessions.ttl;
                    if let Ok(gone @ 1..) = state.store.sweep_sessions(ttl).await {
                        tracing::info!(sessions = gone, "idle sessions forgotten");
                    }
                    let ttl = crate::store::DESCRIPTION_TTL;
                    if let Ok(gone @ 1..) = state.store.sweep_descriptions(ttl).await {
                        tracing::info!(descriptions = gone, "expired descriptions forgotten");
                    }
                }
            }
            () = stopped(&mut stop) => return,
        }
    }
}

/// While the store is down, pings it every [`crate::store::PROBE_EVERY`]
/// so it is used again as soon as it answers.
async fn probe_store(state: Arc<AppState>, mut stop: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(crate::store::PROBE_EVERY) => {
                if state.store.probe_if_down().await {
                    state.rewrite.sync_learned().await;
                }
            }
            () = stopped(&mut stop) => return,
        }
    }
}

/// Idle sessions are swept every this many learned-model refreshes (30 s
/// each: every 5 minutes).
const SWEEP_EVERY: u32 = 10;

/// Resolves once the stop flag is set (or its sender is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    loop {
        if *stop.borrow_and_update() {
            return;
        }
        if stop.changed().await.is_err() {
            return;
        }
    }
}

/// What asked visor to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// SIGINT (Ctrl-C): no `drain_delay` is waited.
    Interrupt,
    /// SIGTERM (Kubernetes, Docker, systemd), or any other shutdown future:
    /// `drain_delay` is waited.
    Terminate,
}

impl From<()> for Stop {
    fn from((): ()) -> Self {
        Stop::Terminate
    }
}

/// Exit code of a second signal during shutdown (128 + SIGINT, as a shell
/// reports a Ctrl-C'd program).
pub const FORCED_EXIT_CODE: i32 = 130;

/// Registers SIGINT and SIGTERM handlers now (so a signal that arrives
/// before the returned future is first polled is not lost) and returns a
/// future that resolves on either. After it has resolved, another SIGINT or
/// SIGTERM ends the process at once with [`FORCED_EXIT_CODE`] (what is in
/// flight is cut, background work is dropped).
#[cfg(unix)]
pub fn shutdown_signal() -> io::Result<impl Future<Output = Stop>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        let how = tokio::select! {
            _ = term.recv() => {
                tracing::info!("SIGTERM received");
                Stop::Terminate
            }
            _ = int.recv() => {
                tracing::info!("SIGINT received");
                Stop::Interrupt
            }
        };
        tokio::spawn(async move {
            let again = tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            };
            forced_exit(again);
        });
        how
    })
}

#[cfg(not(unix))]
pub fn shutdown_signal() -> io::Result<impl Future<Output = Stop>> {
    Ok(async {
        let _ = tokio::signal::ctrl_c().await;
        tracing::info!("Ctrl-C received");
        tokio::spawn(async {
            let _ = tokio::signal::ctrl_c().await;
            forced_exit("Ctrl-C");
        });
        Stop::Interrupt
    })
}

fn forced_exit(signal: &str) -> ! {
    tracing::warn!(
        signal,
        code = FORCED_EXIT_CODE,
        "second signal during shutdown: exiting at once, without draining"
    );
    std::process::exit(FORCED_EXIT_CODE)
}
