//! The response budget: response bytes handed out by handlers but not yet taken by clients,
//! accounted server-wide and per connection (see the module above).

use super::*;

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

    fn call(&mut self, mut request: http::Request<ReqBody>) -> Self::Future {
        crate::grpc::identity::mark_certificate_holder(&mut request);
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
                    Ok(crate::grpc::status::responses_pending()
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
