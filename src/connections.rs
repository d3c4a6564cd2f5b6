//! Client connections: how many may be open, how long one may wait before
//! sending a request, and which one is closed to make room.
//!
//! - [`Gate`]: `server.max_connections` permits shared by every worker. At
//!   the limit a peer just accepted waits for a slot (the next ones wait in
//!   the kernel's backlog) and the connection idle the longest — nothing in
//!   flight — is asked to close, so a new peer (a `/healthz` probe) gets in while silent or
//!   idle peers hold every slot. Connections with requests in flight are
//!   never closed to make room.
//! - [`sniff`]: the first bytes decide HTTP/1.1 or HTTP/2 (the preface),
//!   within `server.header_timeout_secs`; a peer that sends nothing, or
//!   part of the preface, is closed then.
//! - [`Conn`]: a connection's requests in flight (counted by [`Tracked`],
//!   until its response body is done) and when it last went idle; HTTP/2
//!   connections with nothing in flight for `header_timeout_secs` are
//!   closed (HTTP/1.1 idle connections are closed by hyper's header read
//!   timeout, which runs while a connection waits for its next head).

use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use hyper::rt::{Read, ReadBufCursor, Write};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// A connection idle for less than this is never closed to make room: a
/// peer just accepted has this long to send its request.
pub const SHED_GRACE: Duration = Duration::from_millis(200);

/// At the limit, how often the accept loop looks again for a connection to
/// close.
pub const SHED_RETRY: Duration = Duration::from_millis(100);

/// The HTTP/2 client connection preface.
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// File descriptors kept out of the client-connection budget: listeners,
/// store files, the runtime, logs.
const FD_RESERVE: u64 = 64;

/// `max_connections`, lowered when the open-file limit could not hold it:
/// each client connection may need an upstream connection too, so at most
/// half of what is left after [`FD_RESERVE`]. Returns the limit and the
/// open-file limit that lowered it, if one did.
pub fn effective_limit(max_connections: usize) -> (usize, Option<u64>) {
    match open_file_limit() {
        Some(n) => {
            let fit = usize::try_from(n.saturating_sub(FD_RESERVE) / 2)
                .unwrap_or(usize::MAX)
                .max(1);
            if fit < max_connections {
                (fit, Some(n))
            } else {
                (max_connections, None)
            }
        }
        None => (max_connections, None),
    }
}

/// The soft `RLIMIT_NOFILE`, read from `/proc/self/limits` (Linux).
fn open_file_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The connection budget shared by all workers, and the open connections
/// that may be asked to close.
pub struct Gate {
    permits: Arc<Semaphore>,
    limit: usize,
    open: Mutex<HashMap<u64, Arc<Conn>>>,
    next_id: AtomicU64,
    epoch: Instant,
}

impl Gate {
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            permits: Arc::new(Semaphore::new(limit.max(1))),
            limit: limit.max(1),
            open: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            epoch: Instant::now(),
        })
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// A slot for one more connection. At the limit, asks the connection
    /// idle the longest to close (again every `retry` while none frees).
    pub async fn admit(&self, retry: Duration) -> Option<OwnedSemaphorePermit> {
        loop {
            if let Ok(p) = self.permits.clone().try_acquire_owned() {
                return Some(p);
            }
            self.shed_one();
            match tokio::time::timeout(retry, self.permits.clone().acquire_owned()).await {
                Ok(Ok(p)) => return Some(p),
                Ok(Err(_)) => return None, // closed: never happens
                Err(_) => continue,
            }
        }
    }

    /// Asks the connection idle the longest to close; false if every open
    /// connection has a request in flight (or has been idle for less than
    /// [`SHED_GRACE`]: one just accepted gets the time to send its request).
    pub fn shed_one(&self) -> bool {
        let grace = u64::try_from(SHED_GRACE.as_millis()).unwrap_or(u64::MAX);
        let now = self.now_ms();
        let victim = {
            let open = self.open.lock().unwrap_or_else(|e| e.into_inner());
            // Idle the longest; among equals (the same millisecond) the
            // oldest connection, never the one that just came in.
            open.iter()
                .filter(|(_, c)| {
                    c.inflight.load(Ordering::Acquire) == 0
                        && !c.shed_asked()
                        && now.saturating_sub(c.idle_since.load(Ordering::Acquire)) >= grace
                })
                .min_by_key(|(id, c)| (c.idle_since.load(Ordering::Acquire), **id))
                .map(|(_, c)| c.clone())
        };
        match victim {
            Some(c) => {
                c.ask_to_close();
                true
            }
            None => false,
        }
    }

    /// Registers a new connection; it leaves the registry when the returned
    /// guard drops.
    pub fn register(self: &Arc<Self>) -> Registered {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(Conn {
            inflight: AtomicUsize::new(0),
            idle_since: AtomicU64::new(self.now_ms()),
            close: Notify::new(),
            idle: Notify::new(),
            shed: AtomicUsize::new(0),
            epoch: self.epoch,
        });
        self.open
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, conn.clone());
        Registered {
            gate: self.clone(),
            id,
            conn,
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// A registered connection; unregisters on drop.
pub struct Registered {
    gate: Arc<Gate>,
    id: u64,
    pub conn: Arc<Conn>,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.gate
            .open
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.id);
    }
}

/// One client connection's activity.
pub struct Conn {
    inflight: AtomicUsize,
    /// Milliseconds since the gate's epoch when the last request finished
    /// (or the connection opened).
    idle_since: AtomicU64,
    close: Notify,
    /// Told when the last request in flight finishes.
    idle: Notify,
    shed: AtomicUsize,
    epoch: Instant,
}

impl Conn {
    /// Resolves when the gate asks this connection to close.
    pub async fn close_asked(&self) {
        self.close.notified().await;
    }

    /// Resolves when the connection's last request in flight finishes.
    pub async fn went_idle(&self) {
        self.idle.notified().await;
    }

    fn ask_to_close(&self) {
        self.shed.store(1, Ordering::Release);
        self.close.notify_one();
    }

    fn shed_asked(&self) -> bool {
        self.shed.load(Ordering::Acquire) == 1
    }

    /// When the connection has had nothing in flight for `idle`: the
    /// instant it may be closed, or `None` while a request is in flight.
    pub fn idle_deadline(&self, idle: Duration) -> Option<Instant> {
        if self.inflight.load(Ordering::Acquire) > 0 {
            return None;
        }
        let since = Duration::from_millis(self.idle_since.load(Ordering::Acquire));
        Some(self.epoch + since + idle)
    }

    /// Counts one request (or WebSocket response) in flight until the
    /// returned guard drops.
    pub fn begin(self: &Arc<Self>) -> InFlight {
        self.inflight.fetch_add(1, Ordering::AcqRel);
        InFlight(self.clone())
    }
}

/// One request in flight on a connection, until dropped (its response body
/// done or abandoned).
pub struct InFlight(Arc<Conn>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let now = u64::try_from(self.0.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.0.idle_since.store(now, Ordering::Release);
        if self.0.inflight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_one();
        }
    }
}

/// Which protocol a connection speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    Http1,
    Http2,
}

/// Reads a connection's first bytes until they tell HTTP/1.1 from the
/// HTTP/2 preface. The bytes read are returned, to be replayed to hyper.
/// An error when the peer closes first.
pub async fn sniff(stream: &mut TcpStream) -> io::Result<(Proto, Bytes)> {
    let mut buf = [0u8; 24];
    let mut n = 0;
    loop {
        let got = stream.read(&mut buf[n..]).await?;
        if got == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        n += got;
        if buf[..n] != H2_PREFACE[..n] {
            return Ok((Proto::Http1, Bytes::copy_from_slice(&buf[..n])));
        }
        if n == H2_PREFACE.len() {
            return Ok((Proto::Http2, Bytes::copy_from_slice(&buf[..n])));
        }
    }
}

/// An IO that first replays bytes already read from it.
pub struct Prefixed<T> {
    prefix: Bytes,
    inner: T,
}

impl<T> Prefixed<T> {
    pub fn new(prefix: Bytes, inner: T) -> Self {
        Self { prefix, inner }
    }
}

impl<T: Read + Unpin> Read for Prefixed<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        mut buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            let head = self.prefix.split_to(n);
            buf.put_slice(&head);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: Write + Unpin> Write for Prefixed<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
}

/// A connection's place in the [`Gate`], shared with what outlives the
/// connection's HTTP life: an upgraded connection (a WebSocket) keeps it
/// until the socket ends, so it counts against `max_connections` too.
/// Requests carry it in their extensions.
#[derive(Clone)]
pub struct Slot {
    _permit: Arc<OwnedSemaphorePermit>,
    gate: Arc<Gate>,
}

impl Slot {
    pub fn new(permit: OwnedSemaphorePermit, gate: Arc<Gate>) -> Self {
        Self {
            _permit: Arc::new(permit),
            gate,
        }
    }

    /// Registers what outlives its HTTP connection on this slot (an
    /// upgraded WebSocket) with the gate, so that, idle, it may be asked to
    /// close to make room like any idle connection.
    pub fn register(&self) -> Registered {
        self.gate.register()
    }
}

/// A service whose requests count as in flight on their connection until
/// their response body is done.
#[derive(Clone)]
pub struct Tracked<S> {
    inner: S,
    conn: Arc<Conn>,
    slot: Slot,
}

impl<S> Tracked<S> {
    pub fn new(inner: S, conn: Arc<Conn>, slot: Slot) -> Self {
        Self { inner, conn, slot }
    }
}

impl<S, B, RB> hyper::service::Service<Request<B>> for Tracked<S>
where
    S: hyper::service::Service<Request<B>, Response = Response<RB>>,
    S::Future: Send + 'static,
{
    type Response = Response<TrackedBody<RB>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn call(&self, mut req: Request<B>) -> Self::Future {
        req.extensions_mut().insert(self.slot.clone());
        let guard = self.conn.begin();
        let fut = self.inner.call(req);
        Box::pin(async move {
            let resp = fut.await?;
            Ok(resp.map(|body| TrackedBody {
                inner: body,
                _guard: guard,
            }))
        })
    }
}

/// A response body that holds its request's [`InFlight`] until dropped.
pub struct TrackedBody<B> {
    inner: B,
    _guard: InFlight,
}

impl<B: Body + Unpin> Body for TrackedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn shed_picks_the_longest_idle_and_never_a_busy_or_new_one() {
        let gate = Gate::new(2);
        let a = gate.register();
        tokio::time::advance(Duration::from_millis(5)).await;
        let b = gate.register();
        // Just accepted: they get the time to send a request.
        assert!(!gate.shed_one());
        tokio::time::advance(SHED_GRACE).await;
        let busy = a.conn.begin();
        assert!(gate.shed_one(), "b is idle");
        assert!(b.conn.shed_asked() && !a.conn.shed_asked());
        // b was asked already; a is busy: nobody left to ask.
        assert!(!gate.shed_one());
        drop(busy);
        tokio::time::advance(SHED_GRACE).await;
        assert!(gate.shed_one());
        assert!(a.conn.shed_asked());
        drop((a, b));
        assert!(gate.open.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn idle_deadline_only_when_nothing_in_flight() {
        let gate = Gate::new(1);
        let r = gate.register();
        let g = r.conn.begin();
        assert!(r.conn.idle_deadline(Duration::from_secs(1)).is_none());
        drop(g);
        let d = r.conn.idle_deadline(Duration::from_secs(1)).unwrap();
        assert!(d > Instant::now());
    }

    #[test]
    fn the_limit_fits_the_open_file_limit() {
        let (n, lowered) = effective_limit(usize::MAX);
        assert_eq!(
            lowered.is_some(),
            open_file_limit().is_some(),
            "{n} {lowered:?}"
        );
        assert!(n >= 1);
        assert_eq!(effective_limit(3).0, 3);
    }
}
