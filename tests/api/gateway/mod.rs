//! The HTTP gateway (`idempotency-coordinator gateway`) in front of a real upstream HTTP server
//! written here, which counts its executions and can be slowed, held or made to fail, called
//! through a real HTTP client (hyper's, and curl), with the real coordinator behind it.

mod concurrency;
mod curl;
mod failures;
mod leases;
mod processes;
mod security;
mod semantics;
mod waited;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{HeaderMap, Request, Response, StatusCode};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use idempotency_coordinator::config::Command;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// The namespace the gateway tests use.
pub const ORDERS: &str = "orders";

/// One request as the upstream saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Seen {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The fencing token the gateway sent.
    pub fn lease_token(&self) -> u64 {
        self.header("idempotency-lease-token")
            .expect("the gateway sends the lease token")
            .parse()
            .expect("a number")
    }
}

/// What the upstream answers, in order; once the script is used up, `201` with
/// `{"order":N}` where N counts executions (so a second execution shows in the body).
#[derive(Debug, Clone)]
pub struct Scripted {
    pub status: u16,
    pub body: Bytes,
}

#[derive(Default)]
struct UpstreamState {
    executions: AtomicUsize,
    in_flight: AtomicUsize,
    script: Mutex<VecDeque<Scripted>>,
    seen: Mutex<Vec<Seen>>,
    delay: Mutex<Duration>,
    held: Mutex<bool>,
    release: Notify,
}

/// A real HTTP/1.1 server on port 0.
#[derive(Clone)]
pub struct Upstream {
    pub addr: SocketAddr,
    state: Arc<UpstreamState>,
    _stop: Arc<StopOnDrop>,
}

struct StopOnDrop(CancellationToken);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

impl Upstream {
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the upstream");
        let addr = listener.local_addr().expect("address");
        let state = Arc::new(UpstreamState::default());
        let stop = CancellationToken::new();
        let serving = state.clone();
        let stopped = stop.clone();
        tokio::spawn(async move {
            loop {
                let stream = tokio::select! {
                    () = stopped.cancelled() => return,
                    accepted = listener.accept() => match accepted {
                        Ok((stream, _)) => stream,
                        Err(_) => continue,
                    },
                };
                let state = serving.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |request| {
                        let state = state.clone();
                        async move { Ok::<_, std::convert::Infallible>(answer(&state, request).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Self {
            addr,
            state,
            _stop: Arc::new(StopOnDrop(stop)),
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// How many requests the upstream has run (received in full).
    pub fn executions(&self) -> usize {
        self.state.executions.load(Ordering::SeqCst)
    }

    /// Requests the upstream is running now.
    pub fn in_flight(&self) -> usize {
        self.state.in_flight.load(Ordering::SeqCst)
    }

    /// The next answers, before the default ones.
    pub fn script(&self, answers: &[(u16, &str)]) {
        let mut script = self.state.script.lock().expect("lock");
        script.extend(answers.iter().map(|(status, body)| Scripted {
            status: *status,
            body: Bytes::copy_from_slice(body.as_bytes()),
        }));
    }

    /// An answer with a body of `size` bytes next.
    pub fn script_large(&self, size: usize) {
        let body = Bytes::from(vec![b'x'; size]);
        let mut script = self.state.script.lock().expect("lock");
        script.push_back(Scripted { status: 200, body });
    }

    /// Every request takes this long before it is answered.
    pub fn slow_down(&self, delay: Duration) {
        *self.state.delay.lock().expect("lock") = delay;
    }

    /// Requests wait, once received, until [`Upstream::open`].
    pub fn hold(&self) {
        *self.state.held.lock().expect("lock") = true;
    }

    pub fn open(&self) {
        *self.state.held.lock().expect("lock") = false;
        self.state.release.notify_waiters();
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.state.seen.lock().expect("lock").clone()
    }

    /// Waits until `count` requests are running in the upstream.
    pub async fn wait_for_in_flight(&self, count: usize) {
        crate::support::eventually(Duration::from_secs(20), "the upstream runs", || async {
            self.in_flight() >= count
        })
        .await;
    }
}

async fn answer(state: &UpstreamState, request: Request<Incoming>) -> Response<Full<Bytes>> {
    let (parts, body) = request.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let execution = state.executions.fetch_add(1, Ordering::SeqCst) + 1;
    state.in_flight.fetch_add(1, Ordering::SeqCst);
    state.seen.lock().expect("lock").push(Seen {
        method: parts.method.to_string(),
        path: parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned(),
        headers: parts.headers,
        body,
    });
    loop {
        let released = state.release.notified();
        if !*state.held.lock().expect("lock") {
            break;
        }
        released.await;
    }
    let delay = *state.delay.lock().expect("lock");
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let scripted = state.script.lock().expect("lock").pop_front();
    state.in_flight.fetch_sub(1, Ordering::SeqCst);
    let (status, body) = match scripted {
        Some(scripted) => (scripted.status, scripted.body),
        None => (201, Bytes::from(format!("{{\"order\":{execution}}}"))),
    };
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .header("x-execution", execution.to_string())
        .header("set-cookie", "a=1")
        .header("set-cookie", "b=2")
        .body(Full::new(body))
        .expect("a response")
}

/// A gateway served in this process, as `idempotency-coordinator gateway` parses its flags.
pub struct TestGateway {
    pub addr: SocketAddr,
    stop: CancellationToken,
}

impl TestGateway {
    /// A gateway for `upstream` and the coordinator at `coordinator`, with extra flags.
    pub async fn start(upstream: &Upstream, coordinator: &str, flags: &[&str]) -> Self {
        let mut args: Vec<String> = [
            "idempotency-coordinator",
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &upstream.url(),
            "--coordinator",
            coordinator,
            "--namespace",
            ORDERS,
            "--coordinator-retry",
            "0s",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(flags.iter().map(|s| s.to_string()));
        let Command::Gateway(args) = crate::support::app::parse_command(args) else {
            panic!("the gateway subcommand");
        };
        let settings = args.settings().expect("valid settings");
        let gateway = idempotency_gateway::Gateway::bind(settings)
            .await
            .expect("the gateway binds");
        let addr = gateway.local_addr();
        let stop = CancellationToken::new();
        tokio::spawn(gateway.serve(stop.clone()));
        Self { addr, stop }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for TestGateway {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// An answer as the caller saw it.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// `Retry-After`, in seconds.
    pub fn retry_after(&self) -> u64 {
        self.header("retry-after")
            .expect("Retry-After")
            .parse()
            .expect("seconds")
    }

    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The problem document's `type`, for the gateway's own answers.
    pub fn problem_type(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        let problem: serde_json::Value = serde_json::from_slice(&self.body).expect("JSON");
        assert_eq!(problem["status"], self.status.as_u16(), "{problem}");
        problem["type"].as_str().expect("a type").to_owned()
    }

    /// Asserts a problem answer: the status and the `type`'s last part.
    pub fn assert_problem(&self, status: u16, slug: &str) {
        assert_eq!(self.status.as_u16(), status, "{self:?}");
        assert_eq!(
            self.problem_type(),
            format!("urn:idempotency-gateway:problem:{slug}")
        );
    }
}

/// A real HTTP/1.1 client.
#[derive(Clone)]
pub struct Http(HttpClient<HttpConnector, Full<Bytes>>);

impl Http {
    pub fn new() -> Self {
        Self(HttpClient::builder(TokioExecutor::new()).build_http())
    }

    /// Sends `method` to `url` with `headers` and `body`.
    pub async fn send(
        &self,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Answer {
        self.try_send(method, url, headers, body)
            .await
            .expect("the gateway answers")
    }

    /// Sends the same request twice, one after the other: a retry. Answers both answers.
    pub async fn send_twice(
        &self,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> (Answer, Answer) {
        let first = self.send(method, url, headers, body).await;
        (first, self.send(method, url, headers, body).await)
    }

    /// Like [`Http::send`], answering `None` when the connection breaks instead of an answer.
    pub async fn try_send(
        &self,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Option<Answer> {
        let mut request = Request::builder().method(method).uri(url);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request
            .body(Full::new(Bytes::copy_from_slice(body.as_bytes())))
            .expect("a request");
        let response = self.0.request(request).await.ok()?;
        let (parts, body) = response.into_parts();
        Some(Answer {
            status: parts.status,
            headers: parts.headers,
            body: body.collect().await.ok()?.to_bytes(),
        })
    }

    /// `POST url` with `Idempotency-Key: "<key>"`, a JSON content type and `body`.
    pub async fn post(&self, url: &str, key: &str, body: &str) -> Answer {
        self.try_post(url, key, body)
            .await
            .expect("the gateway answers")
    }

    /// [`Http::try_post`] in a task of its own, for requests that run while the test goes on.
    pub fn spawn_post(
        &self,
        url: &str,
        key: &str,
        body: &'static str,
    ) -> tokio::task::JoinHandle<Option<Answer>> {
        let (http, url, key) = (self.clone(), url.to_owned(), key.to_owned());
        tokio::spawn(async move { http.try_post(&url, &key, body).await })
    }

    /// Like [`Http::post`], answering `None` when the connection breaks.
    pub async fn try_post(&self, url: &str, key: &str, body: &str) -> Option<Answer> {
        let quoted = format!("\"{key}\"");
        let headers = [
            ("idempotency-key", quoted.as_str()),
            ("content-type", "application/json"),
        ];
        self.try_send("POST", url, &headers, body).await
    }
}

/// A unique key.
pub fn key(label: &str) -> String {
    crate::support::unique_key(label)
}

/// An endpoint that accepts connections and closes them at once, without a byte: the server
/// behind it is gone. Held for the test's life, so that no other test's server can get its port
/// (a port bound and given back could be, and would then receive this test's requests).
pub struct Dead {
    pub url: String,
    _stop: StopOnDrop,
}

pub async fn dead_endpoint() -> Dead {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    let stop = CancellationToken::new();
    let stopped = stop.clone();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = stopped.cancelled() => return,
                accepted = listener.accept() => drop(accepted),
            }
        }
    });
    Dead {
        url,
        _stop: StopOnDrop(stop),
    }
}
