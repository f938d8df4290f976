//! The door of `idempotency.v1`: a tower layer that admits a call, or turns it away before any
//! handler runs, so that nothing is read or written for a caller who may not. Health and
//! reflection pass untouched (orchestrators' probes carry no token).
//!
//! Every request of the API carries its scope (`namespace` or `consumer`) in field 1, so the
//! layer reads the one message, takes field 1, and asks the [`Authenticator`]. The message is
//! read only up to the decoding limit: a bigger one is refused from its length prefix, as the
//! gRPC layer would.
//!
//! The admin API (`idempotency.v1.AdminService`) passes the same door and more: its caller's
//! token must carry the admin right the method needs (`read` or `write`), within its scopes.
//! Without a tokens file there is no door (the API is open, and its calls pay nothing for a
//! layer), and no token to carry an admin right: the admin service itself is then wrapped in
//! [`LoopbackOnly`], which answers callers connected over the loopback interface only. Either
//! way the admitted caller's identity goes to the handler as an [`AdminCaller`] extension, for
//! the audit trail.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http_body_util::BodyExt;
use prost::Message;
use tonic::body::Body;
use tonic::codegen::http;
use tonic::{Code, Status};
use tower::{Layer, Service};

use super::identity::CallerIdentity;
use crate::auth::{AdminRight, Authenticator, Refusal};
use crate::domain::Holder;

/// The path prefix of the calls this layer guards.
const GUARDED: &str = "/idempotency.v1.IdempotencyService/";

/// The path prefix of the admin API, guarded with the admin right too.
const ADMIN: &str = "/idempotency.v1.AdminService/";

/// Who an admitted admin call comes from, for the audit trail: `token:<name>`, else
/// `cert:<subject>` (a loopback caller with a client certificate), else `loopback`.
#[derive(Debug, Clone)]
pub struct AdminCaller(pub Holder);

/// The admin right a method of the admin API needs: reads need `read`; anything else
/// (changes, and a method this build does not know) `write`.
fn admin_right_needed(method: &str) -> AdminRight {
    match method {
        "ListKeys" | "GetKey" | "NamespaceStats" | "ListAuditEvents" | "GetPlacement" => {
            AdminRight::Read
        }
        _ => AdminRight::Write,
    }
}

/// The `action` label of `idempotency_admin_actions_total` for a method (a fixed set).
pub fn admin_action_label(method: &str) -> &'static str {
    match method {
        "ListKeys" => "list_keys",
        "GetKey" => "get_key",
        "NamespaceStats" => "namespace_stats",
        "ListAuditEvents" => "list_audit_events",
        "ForceRelease" => "force_release",
        "EraseKey" => "erase_key",
        "EraseNamespace" => "erase_namespace",
        "MovePlacement" => "move_placement",
        "GetPlacement" => "get_placement",
        _ => "unknown",
    }
}

/// Whether the request came over a loopback connection.
fn from_loopback<B>(request: &http::Request<B>) -> bool {
    use tonic::transport::server::TlsConnectInfo;
    let extensions = request.extensions();
    extensions
        .get::<super::connections::ConnectionInfo>()
        .or_else(|| {
            extensions
                .get::<TlsConnectInfo<super::connections::ConnectionInfo>>()
                .map(TlsConnectInfo::get_ref)
        })
        .is_some_and(|info| info.remote.ip().is_loopback())
}

/// Field 1 of any request of the API, read without knowing which request it is.
#[derive(Clone, PartialEq, Message)]
struct ScopeField {
    #[prost(string, tag = "1")]
    scope: String,
}

#[derive(Clone)]
pub struct AuthLayer {
    authenticator: Arc<Authenticator>,
    decoding_limit: usize,
    read_timeout: Duration,
}

impl AuthLayer {
    /// `read_timeout` bounds the wait for a request's message once its caller is known.
    pub fn new(
        authenticator: Arc<Authenticator>,
        decoding_limit: usize,
        read_timeout: Duration,
    ) -> Self {
        Self {
            authenticator,
            decoding_limit,
            read_timeout,
        }
    }
}

impl<S> Layer<S> for AuthLayer {
    type Service = AuthService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        AuthService {
            inner,
            authenticator: self.authenticator.clone(),
            decoding_limit: self.decoding_limit,
            read_timeout: self.read_timeout,
        }
    }
}

#[derive(Clone)]
pub struct AuthService<S> {
    inner: S,
    authenticator: Arc<Authenticator>,
    decoding_limit: usize,
    read_timeout: Duration,
}

type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

fn refuse(status: Status) -> http::Response<Body> {
    status.into_http()
}

/// Reads the request's one gRPC message (5-byte prefix, then the message), refusing it from
/// the prefix when it is over `limit`. Answers the whole body read, to be passed on.
async fn read_message(body: Body, limit: usize) -> Result<(Bytes, String), Status> {
    let mut body = body;
    let mut buffer = BytesMut::new();
    let mut expected: Option<usize> = None;
    while expected.is_none_or(|total| buffer.len() < total) {
        let Some(frame) = body.frame().await else {
            break;
        };
        let frame = frame.map_err(|_| Status::cancelled("the request body ended abruptly"))?;
        if let Ok(data) = frame.into_data() {
            buffer.extend_from_slice(&data);
        }
        if expected.is_none() && buffer.len() >= 5 {
            if buffer[0] != 0 {
                return Err(Status::new(
                    Code::Unimplemented,
                    "compressed requests are not supported",
                ));
            }
            let mut prefix = &buffer[1..5];
            let length = usize::try_from(prefix.get_u32()).unwrap_or(usize::MAX);
            if length > limit {
                return Err(Status::out_of_range(format!(
                    "the message is {length} bytes, the limit is {limit}"
                )));
            }
            expected = Some(5 + length);
        }
    }
    let total = expected.ok_or_else(|| Status::invalid_argument("the request has no message"))?;
    if buffer.len() < total {
        return Err(Status::invalid_argument(
            "the request's message is cut short",
        ));
    }
    let scope = ScopeField::decode(&buffer[5..total])
        .map_err(|_| Status::invalid_argument("the request could not be decoded"))?
        .scope;
    Ok((buffer.freeze(), scope))
}

impl<S> Service<http::Request<Body>> for AuthService<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let path = request.uri().path();
        let admin_method = path.strip_prefix(ADMIN).map(str::to_owned);
        if admin_method.is_none() && !path.starts_with(GUARDED) {
            return Box::pin(self.inner.call(request));
        }
        let authenticator = self.authenticator.clone();
        // The inner service was made ready for this call; a fresh clone takes its place.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let limit = self.decoding_limit;
        let read_timeout = self.read_timeout;
        Box::pin(async move {
            let (mut parts, body) = request.into_parts();
            let authorization = parts
                .headers
                .get(http::header::AUTHORIZATION)
                .and_then(|value| value.to_str().ok());
            // An unknown caller, or one over its rate, is turned away before its message is
            // even read.
            let caller = match authenticator
                .authenticate(authorization)
                .and_then(|caller| authenticator.within_rate(&caller).map(|()| caller))
            {
                Ok(caller) => caller,
                Err(refusal) => {
                    count_refusal(&refusal);
                    if let Some(method) = &admin_method {
                        count_admin_refusal(method);
                    }
                    return Ok(refuse(super::status::refused(refusal)));
                }
            };
            // A caller that sends its message too slowly does not hold a stream (and its
            // buffer) for ever.
            let read = tokio::time::timeout(read_timeout, read_message(body, limit)).await;
            let (message, scope) = match read {
                Ok(Ok(read)) => read,
                Ok(Err(status)) => return Ok(refuse(status)),
                Err(_) => {
                    return Ok(refuse(Status::deadline_exceeded(
                        "the request was not received in time",
                    )));
                }
            };
            let admitted = match &admin_method {
                Some(method) => authenticator.authorize_admin(
                    &caller,
                    &scope,
                    admin_right_needed(method),
                    method,
                ),
                None => authenticator.authorize(&caller, &scope),
            };
            if let Err(refusal) = admitted {
                count_refusal(&refusal);
                if let Some(method) = &admin_method {
                    count_admin_refusal(method);
                }
                return Ok(refuse(super::status::refused(refusal)));
            }
            // The token names the caller, even over a connection with a client certificate:
            // the token is what was granted the call.
            if admin_method.is_some() {
                parts
                    .extensions
                    .insert(AdminCaller(caller.identity.clone()));
            }
            parts
                .extensions
                .insert(CallerIdentity(caller.identity.clone()));
            let request =
                http::Request::from_parts(parts, Body::new(http_body_util::Full::new(message)));
            inner.call(request).await
        })
    }
}

/// The admin service, which on a server without a tokens file (`enforce`) answers callers
/// connected over the loopback interface only (as `loopback`), and `PERMISSION_DENIED` to the
/// others, before the request is read. With tokens it passes every call on: the door has
/// checked it.
#[derive(Clone)]
pub struct LoopbackOnly<S> {
    inner: S,
    enforce: bool,
}

impl<S> LoopbackOnly<S> {
    pub fn new(inner: S, enforce: bool) -> Self {
        Self { inner, enforce }
    }
}

impl<S: tonic::server::NamedService> tonic::server::NamedService for LoopbackOnly<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<Body>> for LoopbackOnly<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<Body>) -> Self::Future {
        if !self.enforce {
            return Box::pin(self.inner.call(request));
        }
        if !from_loopback(&request) {
            let method = request.uri().path().strip_prefix(ADMIN).unwrap_or_default();
            count_admin_refusal(method);
            return Box::pin(std::future::ready(Ok(refuse(
                super::status::admin_loopback_only(),
            ))));
        }
        let caller = request
            .extensions()
            .get::<CallerIdentity>()
            .map_or_else(Holder::loopback, |identity| identity.0.clone());
        request.extensions_mut().insert(AdminCaller(caller));
        Box::pin(self.inner.call(request))
    }
}

/// `idempotency_admin_actions_total{outcome="permission_denied"}`: an admin call turned away at
/// the door.
fn count_admin_refusal(method: &str) {
    metrics::counter!("idempotency_admin_actions_total",
        "action" => admin_action_label(method), "outcome" => "permission_denied")
    .increment(1);
}

/// `idempotency_auth_refusals_total`, by reason (never the caller's name or token).
fn count_refusal(refusal: &Refusal) {
    let reason = match refusal {
        Refusal::Unauthenticated => "unauthenticated",
        Refusal::PermissionDenied { .. } => "permission_denied",
        Refusal::RateLimited { .. } => "rate_limited",
    };
    metrics::counter!("idempotency_auth_refusals_total", "reason" => reason).increment(1);
}
