//! `fault-proxy`: a gRPC-aware proxy in front of a real coordinator, for the clients' scenario
//! vectors (`clients/conformance/scenarios.json`). Every client's suite starts this one binary,
//! so that a lost answer, a refusal at the door or an unreachable coordinator is the same fault,
//! byte for byte, whichever language is on the other side.
//!
//! ```text
//! fault-proxy --upstream 127.0.0.1:50051
//! {"proxy":"127.0.0.1:41234","control":"127.0.0.1:41235"}
//! ```
//!
//! It prints one line of JSON with its two addresses and then serves until stdin closes (so it
//! never outlives the test that started it) or it is killed. The control port speaks HTTP/1.1
//! and JSON (curl, or any language's HTTP client):
//!
//! - `POST /faults` with `{"method": "TryStart", "action": …, "times": n}` adds a fault for the
//!   next `n` calls of that method (`times` -1: every call until `/reset`). Actions:
//!   `"status"` answers without asking the coordinator, with `code` (a gRPC code name such as
//!   `RESOURCE_EXHAUSTED`) and, when given, an ErrorInfo `reason` (domain `idempotency.v1`) and
//!   a RetryInfo of `retry_delay_ms`; `"lose_answer"` lets the call reach the coordinator, waits
//!   for its whole answer, and answers `UNAVAILABLE` instead, as a connection lost after the
//!   request went out does; `"delay"` passes the answer on `delay_ms` late.
//! - `POST /refuse`: every connection is dropped and new ones are closed as soon as accepted:
//!   the coordinator is unreachable. `POST /restore` lets connections through again.
//! - `POST /reset`: no faults, connections let through, the call log emptied.
//! - `GET /calls`: `{"TryStart": [12.5, 440.1], …}`, the milliseconds since the proxy started at
//!   which each call of each method arrived (faulted or not).

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde::Deserialize;
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tonic::Code;
use tonic_types::{ErrorDetails, StatusExt};

type ProxyBody = BoxBody<Bytes, hyper::Error>;

/// The ErrorInfo domain of the coordinator's own errors (docs/contract.md).
const DOMAIN: &str = "idempotency.v1";

#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
enum Action {
    Status {
        code: String,
        #[serde(default)]
        reason: Option<String>,
        #[serde(default)]
        retry_delay_ms: Option<u64>,
        #[serde(default)]
        message: Option<String>,
    },
    LoseAnswer,
    Delay {
        delay_ms: u64,
    },
}

#[derive(Debug, Deserialize)]
struct FaultRequest {
    method: String,
    times: i64,
    #[serde(flatten)]
    action: Action,
}

struct Fault {
    method: String,
    /// Calls left to fault; `None` for every call.
    left: Option<u64>,
    action: Action,
}

#[derive(Default)]
struct Faults {
    faults: Vec<Fault>,
    calls: HashMap<String, Vec<f64>>,
}

struct Proxy {
    upstream: SocketAddr,
    started: Instant,
    state: Mutex<Faults>,
    /// `true` while connections are refused; every connection watches it and ends when it turns.
    refusing: watch::Sender<bool>,
}

impl Proxy {
    fn state(&self) -> MutexGuard<'_, Faults> {
        // A panic while holding the lock leaves plain data behind: keep using it.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Logs the call and takes the first fault that applies to it, counting it down.
    fn arrived(&self, method: &str) -> Option<Action> {
        let at = self.started.elapsed().as_secs_f64() * 1000.0;
        let mut state = self.state();
        state.calls.entry(method.to_owned()).or_default().push(at);
        let index = state
            .faults
            .iter()
            .position(|fault| fault.method == method)?;
        let fault = &mut state.faults[index];
        let action = fault.action.clone();
        if let Some(left) = fault.left.as_mut() {
            *left -= 1;
            if *left == 0 {
                state.faults.remove(index);
            }
        }
        Some(action)
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let upstream = upstream_from_args()?;
    let proxy_listener = TcpListener::bind("127.0.0.1:0").await?;
    let control_listener = TcpListener::bind("127.0.0.1:0").await?;
    let (refusing, _) = watch::channel(false);
    let proxy = Arc::new(Proxy {
        upstream,
        started: Instant::now(),
        state: Mutex::new(Faults::default()),
        refusing,
    });
    println!(
        "{}",
        serde_json::json!({
            "proxy": proxy_listener.local_addr()?.to_string(),
            "control": control_listener.local_addr()?.to_string(),
        })
    );
    tokio::spawn(accept_proxied(proxy_listener, Arc::clone(&proxy)));
    tokio::spawn(accept_control(control_listener, proxy));
    // Serve until whoever started us closes our stdin (or exits, which closes it).
    let mut sink = [0u8; 64];
    let mut stdin = tokio::io::stdin();
    while stdin.read(&mut sink).await.unwrap_or(0) > 0 {}
    Ok(())
}

fn upstream_from_args() -> anyhow::Result<SocketAddr> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [flag, address] if flag == "--upstream" => address
            .parse()
            .with_context(|| format!("--upstream: {address:?} is not host:port")),
        _ => bail!("usage: fault-proxy --upstream HOST:PORT"),
    }
}

async fn accept_proxied(listener: TcpListener, proxy: Arc<Proxy>) {
    loop {
        let Ok((downstream, _)) = listener.accept().await else {
            // Out of file handles, say: pause rather than spin.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        if *proxy.refusing.borrow() {
            drop(downstream);
            continue;
        }
        tokio::spawn(serve_connection(downstream, Arc::clone(&proxy)));
    }
}

/// One client connection, carried over one connection of its own to the coordinator, until
/// either side closes or connections are refused.
async fn serve_connection(downstream: TcpStream, proxy: Arc<Proxy>) {
    let Ok(upstream) = TcpStream::connect(proxy.upstream).await else {
        return;
    };
    let _ = upstream.set_nodelay(true);
    let _ = downstream.set_nodelay(true);
    let Ok((sender, upstream_connection)) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(upstream)).await
    else {
        return;
    };
    let mut refusing = proxy.refusing.subscribe();
    let service_proxy = Arc::clone(&proxy);
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        let proxy = Arc::clone(&service_proxy);
        let mut sender = sender.clone();
        async move { Ok::<_, Infallible>(answer(&proxy, &mut sender, request).await) }
    });
    let connection = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        .serve_connection(TokioIo::new(downstream), service);
    // Refusing comes first: once /refuse has answered, no request of this connection may be
    // read and answered any more.
    tokio::select! {
        biased;
        _ = refusing.wait_for(|refusing| *refusing) => {}
        _ = connection => {}
        _ = upstream_connection => {}
    }
}

async fn answer(
    proxy: &Proxy,
    upstream: &mut hyper::client::conn::http2::SendRequest<Incoming>,
    request: Request<Incoming>,
) -> Response<ProxyBody> {
    let method = request
        .uri()
        .path()
        .rsplit('/')
        .next()
        .unwrap_or_default()
        .to_owned();
    if *proxy.refusing.borrow() {
        // Read in the instant before the connection is dropped: never logged, never answered.
        return grpc_status(
            "UNAVAILABLE",
            None,
            None,
            "connection refused (fault-proxy)".to_owned(),
        );
    }
    match proxy.arrived(&method) {
        None => forward(upstream, request).await,
        Some(Action::Status {
            code,
            reason,
            retry_delay_ms,
            message,
        }) => {
            let message = message.unwrap_or_else(|| format!("{code} (injected by fault-proxy)"));
            grpc_status(
                &code,
                reason.as_deref(),
                retry_delay_ms.map(Duration::from_millis),
                message,
            )
        }
        Some(Action::LoseAnswer) => {
            // The coordinator has acted on the call once its whole answer (trailers included)
            // is here; only then is the answer lost. If the coordinator could not be asked, the
            // fault did not happen as ordered: say so, rather than pass for a lost answer.
            let acted = match upstream.send_request(request).await {
                Ok(answer) => answer.into_body().collect().await.is_ok(),
                Err(_) => false,
            };
            if acted {
                grpc_status(
                    "UNAVAILABLE",
                    None,
                    None,
                    "connection lost (fault-proxy)".to_owned(),
                )
            } else {
                let message = "fault-proxy: the coordinator did not answer the call whose answer was to be lost";
                grpc_status("INTERNAL", None, None, message.to_owned())
            }
        }
        Some(Action::Delay { delay_ms }) => {
            let answer = forward(upstream, request).await;
            tokio::time::sleep(Duration::from_millis(delay_ms)).await;
            answer
        }
    }
}

async fn forward(
    upstream: &mut hyper::client::conn::http2::SendRequest<Incoming>,
    request: Request<Incoming>,
) -> Response<ProxyBody> {
    match upstream.send_request(request).await {
        Ok(response) => response.map(BodyExt::boxed),
        Err(error) => grpc_status("UNAVAILABLE", None, None, format!("upstream: {error}")),
    }
}

/// A trailers-only gRPC answer with the coordinator's error details.
fn grpc_status(
    code: &str,
    reason: Option<&str>,
    retry_delay: Option<Duration>,
    message: String,
) -> Response<ProxyBody> {
    let code = code_named(code).unwrap_or(Code::Unknown);
    let mut details = match reason {
        Some(reason) => ErrorDetails::with_error_info(reason, DOMAIN, HashMap::new()),
        None => ErrorDetails::new(),
    };
    if retry_delay.is_some() {
        details.set_retry_info(retry_delay);
    }
    let status = tonic::Status::with_error_details(code, message, details);
    status
        .into_http::<http_body_util::Empty<Bytes>>()
        .map(|body| body.map_err(|never| match never {}).boxed())
}

fn code_named(name: &str) -> Option<Code> {
    (0..=16)
        .map(Code::from_i32)
        .find(|code| code_name(*code) == name)
}

fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

async fn accept_control(listener: TcpListener, proxy: Arc<Proxy>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let proxy = Arc::clone(&proxy);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                let proxy = Arc::clone(&proxy);
                async move { Ok::<_, Infallible>(control(&proxy, request).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn control(proxy: &Proxy, request: Request<Incoming>) -> Response<Full<Bytes>> {
    let route = (request.method().clone(), request.uri().path().to_owned());
    let body = match request.into_body().collect().await {
        Ok(body) => body.to_bytes(),
        Err(error) => {
            return plain(
                StatusCode::BAD_REQUEST,
                format!("reading the body: {error}"),
            );
        }
    };
    match (route.0, route.1.as_str()) {
        (Method::POST, "/faults") => match add_fault(proxy, &body) {
            Ok(()) => plain(StatusCode::OK, "ok".to_owned()),
            Err(error) => plain(StatusCode::BAD_REQUEST, format!("{error:#}")),
        },
        (Method::POST, "/refuse") => {
            proxy.refusing.send_replace(true);
            plain(StatusCode::OK, "refusing".to_owned())
        }
        (Method::POST, "/restore") => {
            proxy.refusing.send_replace(false);
            plain(StatusCode::OK, "passing".to_owned())
        }
        (Method::POST, "/reset") => {
            *proxy.state() = Faults::default();
            proxy.refusing.send_replace(false);
            plain(StatusCode::OK, "reset".to_owned())
        }
        (Method::GET, "/calls") => {
            let calls = serde_json::to_string(&proxy.state().calls).unwrap_or_default();
            let mut response = plain(StatusCode::OK, calls);
            response.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static("application/json"),
            );
            response
        }
        _ => plain(
            StatusCode::NOT_FOUND,
            "routes: POST /faults /refuse /restore /reset, GET /calls".to_owned(),
        ),
    }
}

fn add_fault(proxy: &Proxy, body: &[u8]) -> anyhow::Result<()> {
    let value: serde_json::Value =
        serde_json::from_slice(body).context("a fault is a JSON object")?;
    // serde's flatten cannot refuse unknown fields itself; a misspelt one must not be ignored.
    if let Some(unknown) = value.as_object().and_then(|fields| {
        fields
            .keys()
            .find(|name| !FAULT_FIELDS.contains(&name.as_str()))
    }) {
        bail!(
            "unknown field {unknown:?}; a fault has {}",
            FAULT_FIELDS.join(", ")
        );
    }
    let request: FaultRequest = serde_json::from_value(value).context("a fault")?;
    let left = match request.times {
        -1 => None,
        n if n >= 1 => Some(n.unsigned_abs()),
        n => bail!("times: {n} (a count of calls from 1, or -1 for every call)"),
    };
    if let Action::Status { code, .. } = &request.action
        && code_named(code).is_none()
    {
        bail!("code: {code:?} is not a gRPC code name (such as RESOURCE_EXHAUSTED)");
    }
    proxy.state().faults.push(Fault {
        method: request.method,
        left,
        action: request.action,
    });
    Ok(())
}

const FAULT_FIELDS: &[&str] = &[
    "method",
    "times",
    "action",
    "code",
    "reason",
    "retry_delay_ms",
    "message",
    "delay_ms",
];

fn plain(status: StatusCode, text: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(text + "\n")));
    *response.status_mut() = status;
    response
}
