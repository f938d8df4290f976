//! The client: a channel to the coordinator, the bearer token, and one way to make a call
//! (deadline, typed error, retries).

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

use crate::duration_message;
use crate::error::{CallError, Error};
use crate::proto::idempotency_service_client::IdempotencyServiceClient;
use crate::proto::{MarkProcessedRequest, MarkProcessedResponse};

/// The generated client over the channel.
pub(crate) type Grpc = IdempotencyServiceClient<Channel>;

// The defaults every client shares: `clients/conformance/defaults.json` (the table in
// docs/contract.md, "Client defaults"), which a test compares with these.

/// The deadline of one call ([`ClientBuilder::call_timeout`]); a waiting TryStart gets its wait
/// on top.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// The lease `run_once` asks for ([`crate::RunOnce::lease_ttl`]).
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(30);
/// `run_once` renews the lease every `lease_ttl / HEARTBEAT_DIVISOR`.
pub const HEARTBEAT_DIVISOR: u32 = 3;
/// How long `run_once` waits for another holder ([`crate::RunOnce::wait`]); zero answers at once.
pub const DEFAULT_WAIT: Duration = Duration::ZERO;
/// Each pause between tries is drawn between this fraction of its step and the whole step.
pub const JITTER_LOW_FRACTION: f64 = 0.5;

/// How calls that failed with `UNAVAILABLE`, a deadline or a rate limit are retried:
/// exponential backoff with jitter, from `initial_delay` up to `max_delay` between tries, for at
/// most `total` in all. A `RetryInfo` from the service lengthens a pause, never shortens it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    pub initial_delay: Duration,
    pub max_delay: Duration,
    pub multiplier: f64,
    pub total: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            initial_delay: Duration::from_millis(50),
            max_delay: Duration::from_secs(2),
            multiplier: 2.0,
            total: Duration::from_secs(30),
        }
    }
}

impl RetryPolicy {
    /// No retries at all.
    pub fn none() -> Self {
        Self {
            total: Duration::ZERO,
            ..Self::default()
        }
    }

    pub(crate) fn delays(&self) -> Backoff {
        Backoff {
            step: self.initial_delay,
            max: self.max_delay,
            multiplier: self.multiplier,
        }
    }
}

/// Pauses between tries, each drawn between half and all of the exponential step, so that
/// callers that failed together do not retry together.
pub(crate) struct Backoff {
    step: Duration,
    max: Duration,
    multiplier: f64,
}

impl Iterator for Backoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let pause = self
            .step
            .mul_f64(JITTER_LOW_FRACTION + fastrand::f64() * (1.0 - JITTER_LOW_FRACTION));
        self.step = self.max.min(self.step.mul_f64(self.multiplier.max(1.0)));
        Some(pause)
    }
}

/// Which failures a call may be sent again after.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Retry {
    /// Never (a heartbeat: the next beat is the retry).
    Never,
    /// Unreachable, slow, store down, rate limited or overloaded: for calls whose repetition is
    /// harmless (TryStart with its attempt_id, Complete with the same response, Release,
    /// ExtendLease, Lookup).
    Transient,
    /// Only when refused at the door before anything ran (rate limited, overloaded): for
    /// MarkProcessed, whose repetition after a lost answer would report the events as already
    /// seen.
    AtTheDoor,
}

impl Retry {
    fn allows(self, error: &Error) -> bool {
        match self {
            Self::Never => false,
            Self::Transient => error.is_transient(),
            Self::AtTheDoor => error.is_refused_at_the_door(),
        }
    }
}

/// Builds a [`Client`]; see [`Client::builder`].
#[derive(Debug, Clone)]
pub struct ClientBuilder {
    endpoint: String,
    token: Option<String>,
    tls: Option<ClientTlsConfig>,
    call_timeout: Duration,
    connect_timeout: Duration,
    retry: RetryPolicy,
    max_decoding_message_size: Option<usize>,
}

impl ClientBuilder {
    /// Sent as `authorization: Bearer <token>` on every call (`idempotency-coordinator token
    /// new` makes one).
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// TLS for the channel (use an `https://` endpoint). Give the CA with
    /// `ClientTlsConfig::ca_certificate`, and an identity for mutual TLS.
    pub fn tls(mut self, tls: ClientTlsConfig) -> Self {
        self.tls = Some(tls);
        self
    }

    /// The deadline of each call (default 10 s; the service answers within its operation
    /// timeout, 5 s by default).
    pub fn call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }

    /// How long connecting may take (default 5 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Backoff for retried calls (default [`RetryPolicy::default`]).
    pub fn retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// The largest message the client accepts (tonic's default is 4 MiB); raise it when the
    /// service stores larger responses.
    pub fn max_decoding_message_size(mut self, limit: usize) -> Self {
        self.max_decoding_message_size = Some(limit);
        self
    }

    /// Connects, so that a wrong address or TLS setting fails here.
    pub async fn build(self) -> Result<Client, Error> {
        let (endpoint, client) = self.prepare()?;
        let channel = endpoint.connect().await.map_err(|error| Error::Config {
            message: "cannot connect to the coordinator".into(),
            source: Some(Box::new(error)),
        })?;
        Ok(client(channel))
    }

    /// Builds without connecting: the first call connects (and a failure to connect is an
    /// `Unavailable` error of that call, retried like any other). Call it inside a Tokio
    /// runtime.
    pub fn build_lazy(self) -> Result<Client, Error> {
        let (endpoint, client) = self.prepare()?;
        Ok(client(endpoint.connect_lazy()))
    }

    fn prepare(self) -> Result<(Endpoint, impl FnOnce(Channel) -> Client), Error> {
        let mut endpoint = Endpoint::from_shared(self.endpoint.clone())
            .map_err(|error| Error::Config {
                message: format!("invalid endpoint {:?}", self.endpoint),
                source: Some(Box::new(error)),
            })?
            .connect_timeout(self.connect_timeout);
        if let Some(tls) = self.tls {
            endpoint = endpoint.tls_config(tls).map_err(|error| Error::Config {
                message: "invalid TLS configuration".into(),
                source: Some(Box::new(error)),
            })?;
        }
        let authorization = match &self.token {
            None => None,
            Some(token) => Some(
                format!("Bearer {token}")
                    .parse::<MetadataValue<Ascii>>()
                    .map_err(|_| Error::config("the token must be printable ASCII"))?,
            ),
        };
        let call_timeout = self.call_timeout;
        let retry = self.retry;
        let limit = self.max_decoding_message_size;
        Ok((endpoint, move |channel: Channel| {
            let mut grpc = IdempotencyServiceClient::new(channel);
            if let Some(limit) = limit {
                grpc = grpc.max_decoding_message_size(limit);
            }
            Client {
                grpc,
                authorization,
                call_timeout,
                retry,
            }
        }))
    }
}

/// A client of the coordinator. Cheap to clone (clones share one channel); use it from any task.
#[derive(Debug, Clone)]
pub struct Client {
    grpc: Grpc,
    authorization: Option<MetadataValue<Ascii>>,
    call_timeout: Duration,
    pub(crate) retry: RetryPolicy,
}

impl Client {
    /// Starts building a client for `endpoint` (`http://host:port`, or `https://` with
    /// [`ClientBuilder::tls`]).
    pub fn builder(endpoint: impl Into<String>) -> ClientBuilder {
        ClientBuilder {
            endpoint: endpoint.into(),
            token: None,
            tls: None,
            call_timeout: DEFAULT_CALL_TIMEOUT,
            connect_timeout: Duration::from_secs(5),
            retry: RetryPolicy::default(),
            max_decoding_message_size: None,
        }
    }

    /// Records (atomically, 1–1000 ids) that `consumer` handled the events; [`MarkProcessed::send`]
    /// answers the ids that were new, in request order.
    pub fn mark_processed<I, S>(
        &self,
        consumer: impl Into<String>,
        event_ids: I,
    ) -> MarkProcessed<'_>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        MarkProcessed {
            client: self,
            request: MarkProcessedRequest {
                consumer: consumer.into(),
                event_ids: event_ids.into_iter().map(Into::into).collect(),
                retention: None,
            },
        }
    }

    /// One call, sent again while `retry` allows, within the retry policy's total time.
    pub(crate) async fn call<Req, Resp, F, Fut>(
        &self,
        name: &'static str,
        message: &Req,
        retry: Retry,
        send: F,
    ) -> Result<Resp, Error>
    where
        Req: Clone,
        F: Fn(Grpc, tonic::Request<Req>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        let message = || (message.clone(), Duration::ZERO);
        self.call_until(name, message, retry, self.retry_deadline(), send)
            .await
    }

    /// When a call that starts now stops retrying: the retry policy's total time from now.
    pub(crate) fn retry_deadline(&self) -> Instant {
        Instant::now() + self.retry.total
    }

    /// Like [`Client::call`], with no try started after `give_up_at` (the first is always
    /// sent), and the message made afresh for every try, together with how long beyond the
    /// normal call timeout the service may hold that try (a TryStart's `wait`).
    pub(crate) async fn call_until<Req, Resp, M, F, Fut>(
        &self,
        name: &'static str,
        message: M,
        retry: Retry,
        give_up_at: Instant,
        send: F,
    ) -> Result<Resp, Error>
    where
        M: Fn() -> (Req, Duration),
        F: Fn(Grpc, tonic::Request<Req>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        let mut pauses = self.retry.delays();
        loop {
            let (request, held_for) = message();
            let error = match self.call_once(request, held_for, &send).await {
                Ok(answer) => return Ok(answer),
                Err(error) => error,
            };
            let pause = pauses
                .next()
                .unwrap_or(self.retry.max_delay)
                .max(error.retry_after().unwrap_or_default());
            if !retry.allows(&error) || Instant::now() + pause > give_up_at {
                return Err(error);
            }
            tracing::info!(rpc = name, %error, ?pause, "call failed; retrying");
            tokio::time::sleep(pause).await;
        }
    }

    async fn call_once<Req, Resp, F, Fut>(
        &self,
        message: Req,
        held_for: Duration,
        send: &F,
    ) -> Result<Resp, Error>
    where
        F: Fn(Grpc, tonic::Request<Req>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        // A call the service may hold (a waiting TryStart) gets that long on top of the normal
        // timeout, so that the timeout does not cut the wait short.
        let timeout = self.call_timeout.saturating_add(held_for);
        let mut request = tonic::Request::new(message);
        request.set_timeout(timeout);
        if let Some(authorization) = &self.authorization {
            request
                .metadata_mut()
                .insert("authorization", authorization.clone());
        }
        // The grpc-timeout header lets the service give up; this side's own timer covers a
        // connection that stopped answering altogether.
        match tokio::time::timeout(timeout, send(self.grpc.clone(), request)).await {
            Ok(Ok(response)) => Ok(response.into_inner()),
            Ok(Err(status)) => Err(Error::from_status(&status)),
            Err(_) => Err(Error::DeadlineExceeded(CallError::local(
                tonic::Code::DeadlineExceeded,
                format!("no answer within {timeout:?}"),
            ))),
        }
    }
}

/// A MarkProcessed call being built; see [`Client::mark_processed`].
#[derive(Debug)]
pub struct MarkProcessed<'c> {
    client: &'c Client,
    request: MarkProcessedRequest,
}

impl MarkProcessed<'_> {
    /// How long the events are remembered (the service's default is 7 days); 1 s – 30 d.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.request.retention = Some(duration_message(retention));
        self
    }

    /// Sends the call and answers the ids that were new, in request order (an id twice in one
    /// call is new the first time). Retried only when refused at the door (rate limited or
    /// overloaded): a retry after a lost answer would report the events as seen, and the caller
    /// would skip them, so the error is returned instead.
    pub async fn send(self) -> Result<Vec<String>, Error> {
        let answer: MarkProcessedResponse = self
            .client
            .call(
                "MarkProcessed",
                &self.request,
                Retry::AtTheDoor,
                |mut grpc, request| async move { grpc.mark_processed(request).await },
            )
            .await?;
        Ok(answer
            .results
            .into_iter()
            .filter(|result| !result.already_processed)
            .map(|result| result.event_id)
            .collect())
    }
}
