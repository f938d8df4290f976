//! Connections under guard: what a client that is slow, silent or hostile can hold, and for how
//! long.
//!
//! - **Accepting.** [`Incoming`] accepts connections for tonic. An accept error (`EMFILE` when
//!   descriptors run out, `ENOBUFS`, ...) backs off (5 ms, doubling to 1 s) instead of retrying
//!   at once, and is logged at most once a second with the count of those not logged, so that
//!   running out of descriptors neither spins a core nor floods the log, and accepting resumes
//!   when descriptors free up. With `--max-connections`, no connection is accepted beyond the cap
//!   (the kernel's backlog holds the rest until one closes).
//! - **Handshake.** A connection must send the HTTP/2 preface (24 bytes; under TLS, the first 24
//!   bytes of its handshake, whose completion tonic bounds separately) within the handshake
//!   timeout, or it is closed: keepalive PINGs start only after the preface, so without this a
//!   silent socket would be held for ever.
//! - **Idle.** A connection with no call open for the idle timeout is closed, whatever it
//!   sends meanwhile: floods of PINGs, WINDOW_UPDATEs or SETTINGS, which h2 answers without a
//!   limit, end there when no call is open.
//! - **Responses not taken.** A response body of the API is accounted ([`ResponseBudget`]) from
//!   the moment the handler produced it until it has been handed to HTTP/2 in full, server-wide
//!   and per connection, and it must be taken within the send timeout: a connection holding a
//!   response its client has not taken by then (a client that advertises a zero window, or
//!   never sends WINDOW_UPDATE) is closed, which frees every response it held. While the
//!   budget is spent, responses of calls that wrote nothing are refused (`RESOURCE_EXHAUSTED`)
//!   instead of being held; responses of calls that wrote are never refused (the write is
//!   done), only accounted. A response is handed to HTTP/2 in copies of at most 16 KiB, so that
//!   HTTP/2's own buffer holds at most one such piece per stream, never the whole response.
//!
//! Everything is enforced from the connection's own I/O ([`GuardedIo`]): its timer wakes the
//! connection's task, and a read that fails closes the connection.

use std::collections::BTreeSet;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll, Waker, ready};
use std::time::Duration;

use bytes::{Buf, Bytes};
use http_body::{Body, Frame};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tonic::codegen::http;
use tonic::transport::server::{Connected, TlsConnectInfo};
use tower::{Layer, Service};

use crate::domain::Holder;

/// The bytes of the HTTP/2 client preface (`PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`).
const PREFACE_BYTES: u64 = 24;

/// The largest piece of a response handed to HTTP/2 at once (its default frame size).
const RESPONSE_PIECE_BYTES: usize = 16 * 1024;

/// The first pause after a failed accept, and the longest.
const ACCEPT_BACKOFF_FIRST: Duration = Duration::from_millis(5);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);
/// At most one log line per this interval about failing accepts.
const ACCEPT_LOG_INTERVAL: Duration = Duration::from_secs(1);

pub use crate::config::ConnectionSettings;

/// What a connection's I/O and the calls on it share.
#[derive(Debug)]
pub struct ConnectionState {
    open_calls: AtomicUsize,
    /// When the last call ended (or the connection was accepted).
    quiet_since: Mutex<Instant>,
    /// Bytes of this connection's responses not yet handed to HTTP/2.
    pending_response_bytes: AtomicU64,
    /// When each accounted response must have been taken, with a number to tell equal
    /// instants apart.
    send_deadlines: Mutex<BTreeSet<(Instant, u64)>>,
    next_response: AtomicU64,
    /// The connection's task, woken when its deadlines change.
    task: Mutex<Option<Waker>>,
    /// Who the connection's client certificate names, read on its first call (see
    /// [`super::identity`]).
    certificate_holder: OnceLock<Option<Holder>>,
}

impl ConnectionState {
    /// The connection's certificate holder, worked out by `read` on the first call and kept.
    pub(super) fn certificate_holder(
        &self,
        read: impl FnOnce() -> Option<Holder>,
    ) -> Option<Holder> {
        self.certificate_holder.get_or_init(read).clone()
    }

    fn new(now: Instant) -> Self {
        Self {
            open_calls: AtomicUsize::new(0),
            quiet_since: Mutex::new(now),
            pending_response_bytes: AtomicU64::new(0),
            send_deadlines: Mutex::new(BTreeSet::new()),
            next_response: AtomicU64::new(0),
            task: Mutex::new(None),
            certificate_holder: OnceLock::new(),
        }
    }

    fn remember_task(&self, waker: &Waker) {
        let mut task = lock(&self.task);
        if !task.as_ref().is_some_and(|known| known.will_wake(waker)) {
            *task = Some(waker.clone());
        }
    }

    fn wake_task(&self) {
        if let Some(waker) = lock(&self.task).as_ref() {
            waker.wake_by_ref();
        }
    }

    fn earliest_send_deadline(&self) -> Option<Instant> {
        lock(&self.send_deadlines)
            .first()
            .map(|(deadline, _)| *deadline)
    }

    /// When the idle timeout starts counting, if no call is open.
    fn quiet_since(&self) -> Option<Instant> {
        (self.open_calls.load(Ordering::Acquire) == 0).then(|| *lock(&self.quiet_since))
    }
}

/// A poisoned lock here only means a panic elsewhere; the data (instants, wakers) stays sound.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What tonic puts in every request's extensions for a connection of [`Incoming`].
#[derive(Debug, Clone)]
pub struct ConnectionInfo {
    pub remote: SocketAddr,
    state: Arc<ConnectionState>,
}

impl ConnectionInfo {
    pub(super) fn state(&self) -> &ConnectionState {
        &self.state
    }
}

/// The accepted connections, for `serve_with_incoming_shutdown`. Dropping it closes the
/// listening socket.
pub struct Incoming {
    listener: TcpListener,
    settings: Arc<ConnectionSettings>,
    /// The cap on open connections, and the permit held for the next one.
    slots: Option<Arc<Semaphore>>,
    slot: Option<OwnedSemaphorePermit>,
    waiting_for_slot: Option<Pin<Box<dyn Future<Output = Option<OwnedSemaphorePermit>> + Send>>>,
    backoff: Option<Pin<Box<Sleep>>>,
    failures_in_a_row: u32,
    last_logged: Option<Instant>,
    not_logged: u64,
}

impl Incoming {
    pub fn new(listener: TcpListener, settings: Arc<ConnectionSettings>) -> Self {
        let slots = settings
            .max_connections
            .map(|cap| Arc::new(Semaphore::new(cap as usize)));
        Self {
            listener,
            settings,
            slots,
            slot: None,
            waiting_for_slot: None,
            backoff: None,
            failures_in_a_row: 0,
            last_logged: None,
            not_logged: 0,
        }
    }

    /// Holds a slot for the next connection, when connections are capped.
    fn poll_slot(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(slots) = &self.slots else {
            return Poll::Ready(());
        };
        if self.slot.is_some() {
            return Poll::Ready(());
        }
        let waiting = self.waiting_for_slot.get_or_insert_with(|| {
            let slots = slots.clone();
            Box::pin(async move { slots.acquire_owned().await.ok() })
        });
        let slot = ready!(waiting.as_mut().poll(cx));
        self.waiting_for_slot = None;
        self.slot = slot;
        Poll::Ready(())
    }

    fn accept_failed(&mut self, error: &std::io::Error) {
        self.failures_in_a_row = self.failures_in_a_row.saturating_add(1);
        let pause = ACCEPT_BACKOFF_FIRST
            .saturating_mul(1 << self.failures_in_a_row.min(16).saturating_sub(1))
            .min(ACCEPT_BACKOFF_MAX);
        self.backoff = Some(Box::pin(tokio::time::sleep(pause)));
        let now = Instant::now();
        if self
            .last_logged
            .is_some_and(|logged| now.duration_since(logged) < ACCEPT_LOG_INTERVAL)
        {
            self.not_logged += 1;
            return;
        }
        tracing::warn!(%error, ?pause, not_logged = self.not_logged,
            "accepting a connection failed; pausing before the next try");
        self.last_logged = Some(now);
        self.not_logged = 0;
    }
}

impl tokio_stream::Stream for Incoming {
    type Item = std::io::Result<GuardedIo>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(backoff) = &mut this.backoff {
                ready!(backoff.as_mut().poll(cx));
                this.backoff = None;
            }
            ready!(this.poll_slot(cx));
            match ready!(this.listener.poll_accept(cx)) {
                Ok((stream, remote)) => {
                    this.failures_in_a_row = 0;
                    // Small responses go out at once rather than waiting to fill a segment.
                    let _ = stream.set_nodelay(true);
                    let io =
                        GuardedIo::new(stream, remote, this.settings.clone(), this.slot.take());
                    return Poll::Ready(Some(Ok(io)));
                }
                Err(error) => this.accept_failed(&error),
            }
        }
    }
}

/// A connection's socket, enforcing the handshake, idle and send timeouts from its reads and
/// writes (which the connection's task always has pending), and holding its slot under
/// `--max-connections` until it closes.
pub struct GuardedIo {
    stream: TcpStream,
    info: ConnectionInfo,
    settings: Arc<ConnectionSettings>,
    accepted: Instant,
    bytes_read: u64,
    timer: Pin<Box<Sleep>>,
    _slot: Option<OwnedSemaphorePermit>,
}

impl GuardedIo {
    fn new(
        stream: TcpStream,
        remote: SocketAddr,
        settings: Arc<ConnectionSettings>,
        slot: Option<OwnedSemaphorePermit>,
    ) -> Self {
        let now = Instant::now();
        Self {
            stream,
            info: ConnectionInfo {
                remote,
                state: Arc::new(ConnectionState::new(now)),
            },
            accepted: now,
            bytes_read: 0,
            timer: Box::pin(tokio::time::sleep_until(now + settings.handshake_timeout)),
            settings,
            _slot: slot,
        }
    }

    fn handshaken(&self) -> bool {
        self.bytes_read >= PREFACE_BYTES
    }

    fn response_overdue(&self, now: Instant) -> bool {
        self.info
            .state
            .earliest_send_deadline()
            .is_some_and(|deadline| deadline <= now)
    }

    /// Why the connection must close now, if it must: checked on every read.
    fn verdict(&self, now: Instant) -> Option<&'static str> {
        if !self.handshaken() && now >= self.accepted + self.settings.handshake_timeout {
            return Some("no HTTP/2 preface within the handshake timeout");
        }
        if self.response_overdue(now) {
            return Some("a response not taken within the send timeout");
        }
        let idle_since = self.info.state.quiet_since()?;
        (self.handshaken() && now >= idle_since + self.settings.idle_timeout)
            .then_some("idle beyond the idle timeout")
    }

    /// The next instant at which [`Self::verdict`] may change.
    fn next_check(&self) -> Option<Instant> {
        let handshake =
            (!self.handshaken()).then_some(self.accepted + self.settings.handshake_timeout);
        let idle = self
            .info
            .state
            .quiet_since()
            .filter(|_| self.handshaken())
            .map(|since| since + self.settings.idle_timeout);
        [handshake, idle, self.info.state.earliest_send_deadline()]
            .into_iter()
            .flatten()
            .min()
    }

    fn closing(&self, reason: &'static str) -> std::io::Error {
        tracing::debug!(remote = %self.info.remote, reason, "closing a connection");
        std::io::Error::new(std::io::ErrorKind::TimedOut, reason)
    }

    /// `write` on the stream, unless a response is overdue: then the connection closes instead
    /// of taking more bytes to send.
    fn unless_overdue(
        &mut self,
        write: impl FnOnce(Pin<&mut TcpStream>) -> Poll<std::io::Result<usize>>,
    ) -> Poll<std::io::Result<usize>> {
        if self.response_overdue(Instant::now()) {
            return Poll::Ready(Err(
                self.closing("a response not taken within the send timeout")
            ));
        }
        write(Pin::new(&mut self.stream))
    }
}

impl Connected for GuardedIo {
    type ConnectInfo = ConnectionInfo;

    fn connect_info(&self) -> ConnectionInfo {
        self.info.clone()
    }
}

impl AsyncRead for GuardedIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        this.info.state.remember_task(cx.waker());
        // Judged before reading as well as when there is nothing to read: a client that never
        // stops sending (a flood of PINGs, with no call open) must not escape the idle
        // timeout, nor keep an overdue response alive.
        if let Some(reason) = this.verdict(Instant::now()) {
            return Poll::Ready(Err(this.closing(reason)));
        }
        let before = buf.filled().len();
        if let Poll::Ready(result) = Pin::new(&mut this.stream).poll_read(cx, buf) {
            this.bytes_read = this
                .bytes_read
                .saturating_add((buf.filled().len() - before) as u64);
            return Poll::Ready(result);
        }
        // Nothing to read: sleep until the next moment the verdict may change (the timer wakes
        // this task, which reads again).
        loop {
            if let Some(reason) = this.verdict(Instant::now()) {
                return Poll::Ready(Err(this.closing(reason)));
            }
            let Some(next) = this.next_check() else {
                return Poll::Pending;
            };
            this.timer.as_mut().reset(next);
            if this.timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
        }
    }
}

impl AsyncWrite for GuardedIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.get_mut()
            .unless_overdue(|stream| stream.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        self.get_mut()
            .unless_overdue(|stream| stream.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

mod budget;
pub use budget::*;
