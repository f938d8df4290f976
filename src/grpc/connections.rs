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
use std::sync::{Arc, Mutex};
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

/// The bytes of the HTTP/2 client preface (`PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`).
const PREFACE_BYTES: u64 = 24;

/// The largest piece of a response handed to HTTP/2 at once (its default frame size).
const RESPONSE_PIECE_BYTES: usize = 16 * 1024;

/// The first pause after a failed accept, and the longest.
const ACCEPT_BACKOFF_FIRST: Duration = Duration::from_millis(5);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);
/// At most one log line per this interval about failing accepts.
const ACCEPT_LOG_INTERVAL: Duration = Duration::from_secs(1);

/// The limits on connections (flags of `serve`; see `config`).
#[derive(Debug, Clone)]
pub struct ConnectionSettings {
    pub handshake_timeout: Duration,
    pub idle_timeout: Duration,
    /// `None`: no cap.
    pub max_connections: Option<u32>,
    pub response_send_timeout: Duration,
    pub max_pending_response_bytes: u64,
    pub max_connection_pending_response_bytes: u64,
    /// Health Watch streams open at once, server-wide.
    pub max_health_watchers: u32,
}

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
}

impl ConnectionState {
    fn new(now: Instant) -> Self {
        Self {
            open_calls: AtomicUsize::new(0),
            quiet_since: Mutex::new(now),
            pending_response_bytes: AtomicU64::new(0),
            send_deadlines: Mutex::new(BTreeSet::new()),
            next_response: AtomicU64::new(0),
            task: Mutex::new(None),
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
        let this = self.get_mut();
        if this.response_overdue(Instant::now()) {
            return Poll::Ready(Err(
                this.closing("a response not taken within the send timeout")
            ));
        }
        Pin::new(&mut this.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        if this.response_overdue(Instant::now()) {
            return Poll::Ready(Err(
                this.closing("a response not taken within the send timeout")
            ));
        }
        Pin::new(&mut this.stream).poll_write_vectored(cx, bufs)
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

/// The size of a handler's response message, put in its extensions for [`ResponseBudget`].
#[derive(Debug, Clone, Copy)]
pub struct ResponseSize {
    pub bytes: u64,
    /// The call wrote nothing, so its response may be refused while the budget is spent.
    pub refusable: bool,
}

/// Response bytes produced but not yet taken by clients, server-wide.
#[derive(Debug, Clone)]
pub struct ResponseBudget {
    pending: Arc<AtomicU64>,
    settings: Arc<ConnectionSettings>,
}

impl ResponseBudget {
    pub fn new(settings: Arc<ConnectionSettings>) -> Self {
        Self {
            pending: Arc::new(AtomicU64::new(0)),
            settings,
        }
    }

    /// Accounts `size` on `connection`, or refuses it. The first response in line is always
    /// admitted (nothing pending, server-wide or on its connection), so that any single
    /// response can be sent whatever the limits.
    fn reserve(
        &self,
        connection: &Arc<ConnectionState>,
        size: ResponseSize,
    ) -> Option<Reservation> {
        let bytes = size.bytes;
        let total_before = self.pending.fetch_add(bytes, Ordering::AcqRel);
        let connection_before = connection
            .pending_response_bytes
            .fetch_add(bytes, Ordering::AcqRel);
        let over = |before: u64, limit: u64| before > 0 && before.saturating_add(bytes) > limit;
        if size.refusable
            && (over(total_before, self.settings.max_pending_response_bytes)
                || over(
                    connection_before,
                    self.settings.max_connection_pending_response_bytes,
                ))
        {
            self.pending.fetch_sub(bytes, Ordering::AcqRel);
            connection
                .pending_response_bytes
                .fetch_sub(bytes, Ordering::AcqRel);
            return None;
        }
        let deadline = (
            Instant::now() + self.settings.response_send_timeout,
            connection.next_response.fetch_add(1, Ordering::Relaxed),
        );
        lock(&connection.send_deadlines).insert(deadline);
        // The connection's timer may be armed for later (or not at all): let it re-arm.
        connection.wake_task();
        Some(Reservation {
            bytes,
            deadline,
            total: self.pending.clone(),
            connection: connection.clone(),
        })
    }

    /// Response bytes accounted and not yet taken, server-wide.
    pub fn pending_bytes(&self) -> u64 {
        self.pending.load(Ordering::Acquire)
    }
}

/// An accounted response; released when its body has been handed over or dropped.
#[derive(Debug)]
struct Reservation {
    bytes: u64,
    deadline: (Instant, u64),
    total: Arc<AtomicU64>,
    connection: Arc<ConnectionState>,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.total.fetch_sub(self.bytes, Ordering::AcqRel);
        self.connection
            .pending_response_bytes
            .fetch_sub(self.bytes, Ordering::AcqRel);
        lock(&self.connection.send_deadlines).remove(&self.deadline);
    }
}

/// A call open on a connection, from its request until its response body is dropped.
#[derive(Debug)]
struct OpenCall(Arc<ConnectionState>);

impl OpenCall {
    fn new(connection: Arc<ConnectionState>) -> Self {
        connection.open_calls.fetch_add(1, Ordering::AcqRel);
        Self(connection)
    }
}

impl Drop for OpenCall {
    fn drop(&mut self) {
        if self.0.open_calls.fetch_sub(1, Ordering::AcqRel) == 1 {
            *lock(&self.0.quiet_since) = Instant::now();
            // The idle timeout starts now: let the connection's timer know.
            self.0.wake_task();
        }
    }
}

fn connection_of<B>(request: &http::Request<B>) -> Option<Arc<ConnectionState>> {
    let extensions = request.extensions();
    extensions
        .get::<ConnectionInfo>()
        .or_else(|| {
            extensions
                .get::<TlsConnectInfo<ConnectionInfo>>()
                .map(TlsConnectInfo::get_ref)
        })
        .map(|info| info.state.clone())
}

/// Counts open calls per connection and accounts responses (see the module's notes).
#[derive(Debug, Clone)]
pub struct ConnectionLayer {
    budget: ResponseBudget,
}

impl ConnectionLayer {
    pub fn new(budget: ResponseBudget) -> Self {
        Self { budget }
    }
}

impl<S> Layer<S> for ConnectionLayer {
    type Service = ConnectionService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ConnectionService {
            inner,
            budget: self.budget.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct ConnectionService<S> {
    inner: S,
    budget: ResponseBudget,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, ReqBody, ResBody> Service<http::Request<ReqBody>> for ConnectionService<S>
where
    S: Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    S::Future: Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
{
    type Response = http::Response<AccountedBody<ResBody>>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<ReqBody>) -> Self::Future {
        let connection = connection_of(&request);
        let call = connection.clone().map(OpenCall::new);
        let answer = self.inner.call(request);
        let budget = self.budget.clone();
        Box::pin(async move {
            let mut response = answer.await?;
            let size = response.extensions_mut().remove::<ResponseSize>();
            let (Some(size), Some(connection)) = (size, connection) else {
                return Ok(response.map(|body| AccountedBody::new(body, None, call)));
            };
            match budget.reserve(&connection, size) {
                Some(reservation) => {
                    Ok(response.map(|body| AccountedBody::new(body, Some(reservation), call)))
                }
                None => {
                    tracing::debug!(
                        bytes = size.bytes,
                        "response refused: too many response bytes not taken"
                    );
                    Ok(super::status::responses_pending()
                        .into_http::<()>()
                        .map(|()| AccountedBody::empty(call)))
                }
            }
        })
    }
}

/// A response body: the inner body, handed over in copies of at most [`RESPONSE_PIECE_BYTES`]
/// when it is accounted, releasing its reservation once handed over in full.
pub struct AccountedBody<B> {
    inner: Option<Pin<Box<B>>>,
    /// Taken from the inner body, not yet handed over.
    unsent: Bytes,
    reservation: Option<Reservation>,
    _call: Option<OpenCall>,
}

impl<B> AccountedBody<B> {
    fn new(inner: B, reservation: Option<Reservation>, call: Option<OpenCall>) -> Self {
        Self {
            inner: Some(Box::pin(inner)),
            unsent: Bytes::new(),
            reservation,
            _call: call,
        }
    }

    fn empty(call: Option<OpenCall>) -> Self {
        Self {
            inner: None,
            unsent: Bytes::new(),
            reservation: None,
            _call: call,
        }
    }

    /// The next piece of `unsent`, as a copy: the allocation behind `unsent` is freed once the
    /// last piece is out, whatever HTTP/2 still holds.
    fn next_piece(&mut self) -> Bytes {
        let length = self.unsent.len().min(RESPONSE_PIECE_BYTES);
        let piece = Bytes::copy_from_slice(&self.unsent[..length]);
        self.unsent.advance(length);
        if self.unsent.is_empty() {
            self.unsent = Bytes::new();
        }
        piece
    }
}

impl<B> Body for AccountedBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.get_mut();
        if !this.unsent.is_empty() {
            return Poll::Ready(Some(Ok(Frame::data(this.next_piece()))));
        }
        let Some(inner) = &mut this.inner else {
            return Poll::Ready(None);
        };
        match ready!(inner.as_mut().poll_frame(cx)) {
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) if this.reservation.is_some() && data.len() > RESPONSE_PIECE_BYTES => {
                    this.unsent = data;
                    Poll::Ready(Some(Ok(Frame::data(this.next_piece()))))
                }
                Ok(data) => Poll::Ready(Some(Ok(Frame::data(data)))),
                Err(frame) => {
                    // Trailers: the message is out.
                    this.reservation = None;
                    Poll::Ready(Some(Ok(frame)))
                }
            },
            Some(Err(error)) => Poll::Ready(Some(Err(error))),
            None => {
                this.reservation = None;
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.unsent.is_empty()
            && self
                .inner
                .as_ref()
                .is_none_or(|inner| inner.is_end_stream())
    }
}
