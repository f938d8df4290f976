//! One request through the gateway: pass it through, or claim its key with the coordinator,
//! forward it, and store, replay or release.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::header::{CONNECTION, CONTENT_LENGTH, HeaderName, HeaderValue};
use hyper::{HeaderMap, Request, Response, StatusCode, Uri};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use idempotency_client::{Client, Error, Lease, Outcome, RunError};
use tokio::time::Instant;

use crate::body::{Body, boxed, chained, full};
use crate::config::Settings;
use crate::key::{KeyError, fingerprint, read_key, scoped_key};
use crate::problem::Problem;
use crate::record::{Record, RecordCodec};

/// Sent to the upstream with every guarded request: the fencing token of the claim it runs
/// under. A client's own header of this name is removed first.
pub const LEASE_TOKEN_HEADER: HeaderName = HeaderName::from_static("idempotency-lease-token");
/// `true` on a response replayed from the coordinator.
pub const REPLAYED_HEADER: HeaderName = HeaderName::from_static("idempotent-replayed");
/// Says what the gateway could not do for a response it forwarded (see docs/gateway.md).
pub const WARNING_HEADER: HeaderName = HeaderName::from_static("idempotency-warning");

/// What every request shares.
pub struct Proxy {
    pub settings: Settings,
    pub coordinator: Client,
    pub upstream: HttpClient<HttpConnector, Body>,
}

/// Why a forwarded request's claim is released rather than completed (the retry runs again).
enum NotFinal {
    /// A status that is not final (5xx, 408, 409, 425, 429): forwarded as it is.
    Status(Response<Body>),
    Unreachable(String),
    Timeout,
}

/// What the work handed back besides its result, for the cases where `run` does not return it
/// (the Complete failed, the lease was lost) and for the part of a response too large to
/// store.
#[derive(Default)]
struct Ran {
    started: bool,
    record: Option<Record>,
    rest: Option<Body>,
}

type Shared<T> = Arc<Mutex<T>>;

impl Proxy {
    pub async fn handle(self: Arc<Self>, request: Request<Incoming>) -> Response<Body> {
        let settings = &self.settings;
        if !settings.methods.contains(request.method()) {
            return self.pass_through(request.map(boxed)).await;
        }
        let key = match read_key(request.headers(), &settings.header, settings.max_key_length) {
            Ok(key) => key,
            Err(KeyError::Missing) if !self.requires_key(request.uri()) => {
                return self.pass_through(request.map(boxed)).await;
            }
            Err(KeyError::Missing) => {
                let detail = format!(
                    "{} requests to this path need a {} header",
                    request.method(),
                    settings.header
                );
                return Problem::KeyMissing.response(&detail, None);
            }
            Err(KeyError::Repeated) => {
                let detail = format!("send one {} header, not several", settings.header);
                return Problem::KeyRepeated.response(&detail, None);
            }
            Err(KeyError::Malformed(detail)) => {
                return Problem::KeyMalformed.response(&detail, None);
            }
        };
        let identity = match &settings.identity_header {
            None => None,
            Some(name) => {
                let values: Vec<&[u8]> = request
                    .headers()
                    .get_all(name)
                    .iter()
                    .map(HeaderValue::as_bytes)
                    .collect();
                if values.is_empty() {
                    let detail = format!("requests with a key need a {name} header");
                    return Problem::IdentityMissing.response(&detail, None);
                }
                Some(values.join(&b'\n'))
            }
        };
        let (parts, body) = request.into_parts();
        if let Some(length) = parts.headers.get(CONTENT_LENGTH)
            && let Some(length) = length.to_str().ok().and_then(|l| l.parse::<u64>().ok())
            && length > u64::try_from(settings.max_request_bytes).unwrap_or(u64::MAX)
        {
            return too_large(settings.max_request_bytes);
        }
        let body = match Limited::new(body, settings.max_request_bytes)
            .collect()
            .await
        {
            Ok(collected) => collected.to_bytes(),
            Err(error) if error.is::<http_body_util::LengthLimitError>() => {
                return too_large(settings.max_request_bytes);
            }
            Err(error) => {
                let detail = format!("the request body could not be read: {error}");
                return Problem::RequestUnreadable.response(&detail, None);
            }
        };
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        let fingerprint = fingerprint(parts.method.as_str(), path, &parts.headers, &body);
        let stored_key = scoped_key(identity.as_deref(), &key);
        let ran: Shared<Ran> = Shared::default();
        let outcome = self
            .coordinator
            .run_once(settings.namespace.clone(), stored_key)
            .fingerprint(fingerprint)
            .codec(RecordCodec)
            .lease_ttl(settings.lease)
            .retention(settings.retention)
            .wait(settings.wait)
            // The upstream call is never cut short by a lost lease: it ends within its own
            // timeout, and its outcome is then reported as lost.
            .cancel_grace(settings.upstream_timeout)
            .run(|lease| self.forward_guarded(&parts, body.clone(), lease, ran.clone()))
            .await;
        let ran = std::mem::take(&mut *ran.lock().unwrap_or_else(|p| p.into_inner()));
        match outcome {
            Ok(Outcome {
                value,
                replayed: true,
            }) => replay(value),
            Ok(Outcome {
                value,
                replayed: false,
            }) => first_response(value, ran.rest),
            Err(RunError::Work(not_final)) => match not_final {
                NotFinal::Status(response) => response,
                NotFinal::Unreachable(error) => Problem::UpstreamUnreachable.response(&error, None),
                NotFinal::Timeout => Problem::UpstreamTimeout.response(
                    &format!("no answer within {:?}", settings.upstream_timeout),
                    None,
                ),
            },
            Err(RunError::Coordinator(error)) => self.refused(error, ran, &parts, body).await,
        }
    }

    fn requires_key(&self, uri: &Uri) -> bool {
        let path = uri.path();
        self.settings
            .require_key
            .iter()
            .any(|prefix| path.starts_with(prefix.as_str()))
    }

    /// What to answer when `run` failed on the coordinator's side.
    async fn refused(
        &self,
        error: Error,
        ran: Ran,
        parts: &hyper::http::request::Parts,
        body: Bytes,
    ) -> Response<Body> {
        if let Error::LeaseLost(cause) = &error {
            tracing::warn!(%cause, "the lease was lost while the upstream ran");
            return Problem::LeaseLost.response(
                "another request took the key over while this one ran; retry to get its result",
                Some(Duration::from_secs(1)),
            );
        }
        if let Some(record) = ran.record {
            // The upstream ran and answered, but the answer could not be stored: the caller
            // gets it, told that a retry after the lease may run the request again.
            tracing::warn!(%error, "the upstream's response could not be stored");
            let mut response = first_response(record, ran.rest);
            response
                .headers_mut()
                .insert(WARNING_HEADER, HeaderValue::from_static("not-recorded"));
            return response;
        }
        if ran.started {
            return Problem::LeaseLost.response(
                "the request ran, but its claim could not be settled",
                Some(Duration::from_secs(1)),
            );
        }
        match error {
            // The holder's lease is the latest moment a retry could take over, but the holder
            // usually finishes well before (its heartbeat keeps renewing it): a retry is
            // suggested after the shorter of the two and the wait, at least 1 s.
            Error::InProgress { retry_after, .. } => Problem::InProgress.response(
                &format!(
                    "another request with this key is still running after {:?}",
                    self.settings.wait
                ),
                Some(retry_after.min(self.settings.wait.max(Duration::from_secs(1)))),
            ),
            Error::FingerprintMismatch => Problem::KeyReused.response(
                "this key was used for a request with another method, path, content type or body",
                None,
            ),
            Error::InvalidArgument(call) => Problem::KeyMalformed.response(&call.message, None),
            Error::Decode(cause) => {
                tracing::error!(%cause, "a stored response cannot be decoded");
                Problem::StoredResponseUnreadable.response(
                    "the response stored for this key was not written by the gateway",
                    None,
                )
            }
            error @ (Error::Unavailable(_)
            | Error::StoreUnavailable(_)
            | Error::DeadlineExceeded(_)
            | Error::RateLimited(_)) => {
                if self.settings.fail_open {
                    tracing::warn!(%error, "coordinator unavailable; forwarding without idempotency");
                    let request = Request::from_parts(parts.clone(), full(body));
                    let mut response = self.pass_through(request).await;
                    response
                        .headers_mut()
                        .insert(WARNING_HEADER, HeaderValue::from_static("not-deduplicated"));
                    return response;
                }
                tracing::warn!(%error, "coordinator unavailable; refusing");
                Problem::CoordinatorUnavailable.response(
                    "the gateway cannot reach the idempotency coordinator; retry later",
                    Some(error.retry_after().unwrap_or(Duration::from_secs(1))),
                )
            }
            error => {
                tracing::error!(%error, "the coordinator refused the gateway");
                Problem::CoordinatorRefused.response(&error.to_string(), None)
            }
        }
    }

    /// The work `run_once` runs under the claim: the request to the upstream with the key's
    /// lease token, its response read and classified.
    async fn forward_guarded(
        &self,
        parts: &hyper::http::request::Parts,
        body: Bytes,
        lease: Lease,
        ran: Shared<Ran>,
    ) -> Result<Record, NotFinal> {
        set(&ran, |ran| ran.started = true);
        let request = Request::from_parts(parts.clone(), full(body));
        let deadline = Instant::now() + self.settings.upstream_timeout;
        let sent = self.send(request, Some(lease.token()));
        let response = match tokio::time::timeout_at(deadline, sent).await {
            Err(_) => return Err(NotFinal::Timeout),
            Ok(Err(error)) => return Err(NotFinal::Unreachable(error)),
            Ok(Ok(response)) => response,
        };
        if !is_final(response.status()) {
            return Err(NotFinal::Status(response.map(boxed)));
        }
        let (parts, mut body) = response.into_parts();
        let mut headers = parts.headers;
        strip_hop_by_hop(&mut headers);
        let limit = self.settings.max_stored_response_bytes;
        let mut size = Record::encoded_len(&headers, 0);
        let mut chunks = VecDeque::new();
        let too_large = loop {
            let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
                Err(_) => return Err(NotFinal::Timeout),
                Ok(None) => break false,
                Ok(Some(Err(error))) => {
                    return Err(NotFinal::Unreachable(format!(
                        "the upstream's response broke off: {error}"
                    )));
                }
                Ok(Some(Ok(frame))) => frame,
            };
            // Trailers are not stored (nor forwarded): few APIs send them.
            if let Ok(data) = frame.into_data() {
                size += data.len();
                chunks.push_back(data);
                if size > limit {
                    break true;
                }
            }
        };
        let record = Record {
            status: parts.status,
            body: if too_large {
                Bytes::new()
            } else {
                concat(&chunks)
            },
            headers,
            too_large,
        };
        set(&ran, |ran| {
            ran.record = Some(record.clone());
            ran.rest = too_large.then(|| chained(std::mem::take(&mut chunks), boxed(body)));
        });
        Ok(record)
    }

    /// Forwards a request that gets no idempotency, as it is.
    async fn pass_through(&self, request: Request<Body>) -> Response<Body> {
        let deadline = self.settings.upstream_timeout;
        match tokio::time::timeout(deadline, self.send(request, None)).await {
            Ok(Ok(response)) => response.map(boxed),
            Ok(Err(error)) => Problem::UpstreamUnreachable.response(&error, None),
            Err(_) => {
                Problem::UpstreamTimeout.response(&format!("no answer within {deadline:?}"), None)
            }
        }
    }

    /// Sends `request` to the upstream: its path under the upstream's, hop-by-hop headers
    /// removed, and the claim's lease token (any the client sent is removed, so that the
    /// upstream can trust the header).
    async fn send(
        &self,
        request: Request<Body>,
        lease_token: Option<u64>,
    ) -> Result<Response<Incoming>, String> {
        let (mut parts, body) = request.into_parts();
        let upstream = &self.settings.upstream;
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        parts.uri = Uri::builder()
            .scheme("http")
            .authority(upstream.authority.clone())
            .path_and_query(format!("{}{path}", upstream.path_prefix))
            .build()
            .map_err(|error| format!("cannot make the upstream URL: {error}"))?;
        parts.version = hyper::Version::HTTP_11;
        strip_hop_by_hop(&mut parts.headers);
        parts.headers.remove(LEASE_TOKEN_HEADER);
        if let Some(token) = lease_token {
            parts
                .headers
                .insert(LEASE_TOKEN_HEADER, HeaderValue::from(token));
        }
        let mut response = self
            .upstream
            .request(Request::from_parts(parts, body))
            .await
            .map_err(|error| format!("the upstream could not be reached: {error}"))?;
        strip_hop_by_hop(response.headers_mut());
        Ok(response)
    }
}

fn set(ran: &Shared<Ran>, change: impl FnOnce(&mut Ran)) {
    change(&mut ran.lock().unwrap_or_else(|p| p.into_inner()));
}

fn too_large(limit: usize) -> Response<Body> {
    Problem::RequestTooLarge.response(&format!("the body is larger than {limit} bytes"), None)
}

/// Final: the outcome of the request (2xx, and 4xx other than 408, 409, 425 and 429), stored
/// and replayed. Anything else (5xx, those four, 1xx and 3xx) may go otherwise on a retry.
pub fn is_final(status: StatusCode) -> bool {
    status.is_success()
        || (status.is_client_error() && !matches!(status.as_u16(), 408 | 409 | 425 | 429))
}

fn concat(chunks: &VecDeque<Bytes>) -> Bytes {
    match chunks.len() {
        0 => Bytes::new(),
        1 => chunks[0].clone(),
        _ => chunks.iter().flatten().copied().collect::<Vec<u8>>().into(),
    }
}

/// The stored response as it was: status, headers and body, and `Idempotent-Replayed: true`.
fn replay(record: Record) -> Response<Body> {
    if record.too_large {
        let mut members = serde_json::Map::new();
        members.insert("original_status".into(), record.status.as_u16().into());
        let mut response = Problem::ResponseNotReplayable.response_with(
            "the request ran once; its response was larger than the gateway stores, so it \
             cannot be sent again",
            None,
            members,
        );
        response
            .headers_mut()
            .insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
        return response;
    }
    let mut response = Response::new(full(record.body));
    *response.status_mut() = record.status;
    *response.headers_mut() = record.headers;
    response
        .headers_mut()
        .insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    response
}

/// The upstream's response to the request that ran it.
fn first_response(record: Record, rest: Option<Body>) -> Response<Body> {
    let (body, warning) = match rest {
        Some(rest) => (rest, Some("not-replayable")),
        None => (full(record.body), None),
    };
    let mut response = Response::new(body);
    *response.status_mut() = record.status;
    *response.headers_mut() = record.headers;
    if let Some(warning) = warning {
        response
            .headers_mut()
            .insert(WARNING_HEADER, HeaderValue::from_static(warning));
    }
    response
}

/// Headers that belong to one connection (RFC 9110 section 7.6.1), and those the Connection
/// header names.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in [
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    ] {
        headers.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn final_statuses_are_stored_and_the_others_released() {
        for status in [200, 201, 204, 400, 404, 410, 422] {
            assert!(
                is_final(StatusCode::from_u16(status).expect("status")),
                "{status}"
            );
        }
        for status in [100, 302, 408, 409, 425, 429, 500, 502, 503, 504] {
            assert!(
                !is_final(StatusCode::from_u16(status).expect("status")),
                "{status}"
            );
        }
    }

    #[test]
    fn hop_by_hop_headers_and_those_connection_names_are_removed() {
        let mut headers = HeaderMap::new();
        headers.insert(
            CONNECTION,
            HeaderValue::from_static("keep-alive, x-private"),
        );
        headers.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        headers.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        headers.insert("x-private", HeaderValue::from_static("1"));
        headers.insert("content-type", HeaderValue::from_static("text/plain"));
        strip_hop_by_hop(&mut headers);
        assert_eq!(headers.len(), 1);
        assert!(headers.contains_key("content-type"));
    }
}
