//! The per-call series of every RPC (`grpc_server_*`): a tower layer that labels a call by its
//! method, from a fixed table, and by its status code, counted when its answer's body ends.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Body, Frame};
use metrics::{counter, histogram};
use tokio::time::Instant;
use tonic::codegen::http;
use tower::{Layer, Service};

/// A known RPC: its labels.
struct Method {
    path: &'static str,
    service: &'static str,
    method: &'static str,
    kind: &'static str,
}

const API: &str = "idempotency.v1.IdempotencyService";
const HEALTH: &str = "grpc.health.v1.Health";

/// How many methods are known.
const METHOD_COUNT: usize = 10;

/// A static, so that each method has one address (see [`Series::of`]).
static METHODS: [Method; METHOD_COUNT] = [
    Method {
        path: "/idempotency.v1.IdempotencyService/TryStart",
        service: API,
        method: "TryStart",
        kind: "unary",
    },
    Method {
        path: "/idempotency.v1.IdempotencyService/Complete",
        service: API,
        method: "Complete",
        kind: "unary",
    },
    Method {
        path: "/idempotency.v1.IdempotencyService/Release",
        service: API,
        method: "Release",
        kind: "unary",
    },
    Method {
        path: "/idempotency.v1.IdempotencyService/ExtendLease",
        service: API,
        method: "ExtendLease",
        kind: "unary",
    },
    Method {
        path: "/idempotency.v1.IdempotencyService/Lookup",
        service: API,
        method: "Lookup",
        kind: "unary",
    },
    Method {
        path: "/idempotency.v1.IdempotencyService/MarkProcessed",
        service: API,
        method: "MarkProcessed",
        kind: "unary",
    },
    Method {
        path: "/grpc.health.v1.Health/Check",
        service: HEALTH,
        method: "Check",
        kind: "unary",
    },
    Method {
        path: "/grpc.health.v1.Health/Watch",
        service: HEALTH,
        method: "Watch",
        kind: "server_stream",
    },
    Method {
        path: "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        service: "grpc.reflection.v1.ServerReflection",
        method: "ServerReflectionInfo",
        kind: "bidi_stream",
    },
    Method {
        path: "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        service: "grpc.reflection.v1alpha.ServerReflection",
        method: "ServerReflectionInfo",
        kind: "bidi_stream",
    },
];

/// Every known method's `grpc_server_started_total` at 0 from the start, so that a rate over
/// a method's first calls has a series to start from.
pub(super) fn start_counts_at_zero() {
    for method in &METHODS {
        counter!("grpc_server_started_total",
            "grpc_type" => method.kind, "grpc_service" => method.service, "grpc_method" => method.method)
        .absolute(0);
    }
}

/// Any other path (a client can send any): one bounded set of labels.
static UNKNOWN: Method = Method {
    path: "",
    service: "unknown",
    method: "unknown",
    kind: "unary",
};

fn method_of(path: &str) -> &'static Method {
    METHODS
        .iter()
        .find(|method| method.path == path)
        .unwrap_or(&UNKNOWN)
}

/// A gRPC status code's name as go-grpc-middleware writes it (`OK`, `NotFound`, ...).
fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code;
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "Canceled",
        Code::Unknown => "Unknown",
        Code::InvalidArgument => "InvalidArgument",
        Code::DeadlineExceeded => "DeadlineExceeded",
        Code::NotFound => "NotFound",
        Code::AlreadyExists => "AlreadyExists",
        Code::PermissionDenied => "PermissionDenied",
        Code::ResourceExhausted => "ResourceExhausted",
        Code::FailedPrecondition => "FailedPrecondition",
        Code::Aborted => "Aborted",
        Code::OutOfRange => "OutOfRange",
        Code::Unimplemented => "Unimplemented",
        Code::Internal => "Internal",
        Code::Unavailable => "Unavailable",
        Code::DataLoss => "DataLoss",
        Code::Unauthenticated => "Unauthenticated",
    }
}

fn status_code(headers: &http::HeaderMap) -> Option<tonic::Code> {
    let value = headers.get("grpc-status")?.to_str().ok()?;
    value.parse::<i32>().ok().map(tonic::Code::from)
}

/// A method's series, registered on its first call and kept: recording a call is then a few
/// atomic additions, with no label hashing or allocation on the hot path.
struct Series {
    started: metrics::Counter,
    received: metrics::Counter,
    sent: metrics::Counter,
    seconds: metrics::Histogram,
    /// `grpc_server_handled_total` by code (indexed by the code's number), each on first use.
    handled: [std::sync::OnceLock<metrics::Counter>; 17],
}

impl Series {
    fn of(method: &'static Method) -> &'static Series {
        static SERIES: [std::sync::OnceLock<Series>; METHOD_COUNT + 1] =
            [const { std::sync::OnceLock::new() }; METHOD_COUNT + 1];
        let index = METHODS
            .iter()
            .position(|known| std::ptr::eq(known, method))
            .unwrap_or(METHOD_COUNT);
        SERIES[index].get_or_init(|| Series::register(method))
    }

    fn register(method: &'static Method) -> Series {
        let labels = [
            ("grpc_type", method.kind),
            ("grpc_service", method.service),
            ("grpc_method", method.method),
        ];
        Series {
            started: counter!("grpc_server_started_total", &labels),
            received: counter!("grpc_server_msg_received_total", &labels),
            sent: counter!("grpc_server_msg_sent_total", &labels),
            seconds: histogram!("grpc_server_handling_seconds", &labels),
            handled: Default::default(),
        }
    }

    fn handled(&self, method: &'static Method, code: tonic::Code) -> &metrics::Counter {
        let slot = usize::try_from(code as i32).unwrap_or(2).min(16);
        self.handled[slot].get_or_init(|| {
            counter!("grpc_server_handled_total",
                "grpc_type" => method.kind, "grpc_service" => method.service,
                "grpc_method" => method.method, "grpc_code" => code_name(code))
        })
    }
}

/// One call being observed, until its status is known.
struct Call {
    method: &'static Method,
    started: Instant,
    sent: u64,
}

impl Call {
    fn start(method: &'static Method) -> Self {
        let series = Series::of(method);
        series.started.increment(1);
        if method.kind != "bidi_stream" && method.kind != "client_stream" {
            series.received.increment(1);
        }
        Self {
            method,
            started: Instant::now(),
            sent: 0,
        }
    }

    fn handled(self, code: tonic::Code) {
        let method = self.method;
        let series = Series::of(method);
        let sent = if method.kind == "unary" || method.kind == "client_stream" {
            u64::from(code == tonic::Code::Ok)
        } else {
            self.sent
        };
        if sent > 0 {
            series.sent.increment(sent);
        }
        series.handled(method, code).increment(1);
        series.seconds.record(self.started.elapsed().as_secs_f64());
    }
}

/// The tower layer that counts every gRPC call, outermost, so that calls refused at the door
/// are counted too. Off, it passes calls through untouched.
#[derive(Debug, Clone, Copy)]
pub struct GrpcMetricsLayer {
    pub on: bool,
}

impl<S> Layer<S> for GrpcMetricsLayer {
    type Service = GrpcMetrics<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GrpcMetrics { inner, on: self.on }
    }
}

#[derive(Debug, Clone)]
pub struct GrpcMetrics<S> {
    inner: S,
    on: bool,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, ReqBody, ResBody> Service<http::Request<ReqBody>> for GrpcMetrics<S>
where
    S: Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    S::Future: Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
{
    type Response = http::Response<ObservedBody<ResBody>>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<ReqBody>) -> Self::Future {
        let call = self
            .on
            .then(|| Call::start(method_of(request.uri().path())));
        let answer = self.inner.call(request);
        Box::pin(async move {
            let response = answer.await?;
            // A trailers-only answer (every refusal) carries its status in the headers.
            let call = match (call, status_code(response.headers())) {
                (Some(call), Some(code)) => {
                    call.handled(code);
                    None
                }
                (call, _) => call,
            };
            Ok(response.map(|inner| ObservedBody {
                inner: Box::pin(inner),
                call,
            }))
        })
    }
}

/// A response body that records its call once the trailers carry the status (or, if the body
/// is dropped before, as `Canceled`).
pub struct ObservedBody<B> {
    inner: Pin<Box<B>>,
    call: Option<Call>,
}

impl<B> Body for ObservedBody<B>
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
        let frame = ready!(this.inner.as_mut().poll_frame(cx));
        match &frame {
            Some(Ok(frame)) => {
                if let Some(trailers) = frame.trailers_ref() {
                    if let Some(call) = this.call.take() {
                        call.handled(status_code(trailers).unwrap_or(tonic::Code::Unknown));
                    }
                } else if frame.is_data()
                    && let Some(call) = this.call.as_mut()
                {
                    call.sent += 1;
                }
            }
            Some(Err(_)) => {
                if let Some(call) = this.call.take() {
                    call.handled(tonic::Code::Internal);
                }
            }
            None => {
                if let Some(call) = this.call.take() {
                    call.handled(tonic::Code::Ok);
                }
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
}

impl<B> Drop for ObservedBody<B> {
    fn drop(&mut self) {
        if let Some(call) = self.call.take() {
            call.handled(tonic::Code::Cancelled);
        }
    }
}
