//! Reaching the coordinator, for the commands that are its clients (`admin …`, `healthcheck`),
//! and a transport failure in words an operator acts on: the gRPC stack reports every one of
//! them as "transport error", its cause buried in the chain of sources. Walks the chain and
//! names the cause: nothing listening, a host that does not resolve, TLS where plain HTTP/2 was
//! spoken or the reverse, a certificate the CA does not vouch for.

use std::error::Error;
use std::time::Duration;

use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::config::coordinator::CoordinatorTarget;

/// Why no channel to the coordinator was made.
pub enum Unreached {
    /// The flags cannot make an endpoint (a usage error: exit 2).
    Flags(String),
    /// The coordinator could not be reached, for this cause.
    Transport(String),
}

/// A channel to `target`, over TLS when it has a CA, connected within `connect_timeout`.
pub async fn channel(
    target: &CoordinatorTarget,
    connect_timeout: Duration,
) -> Result<Channel, Unreached> {
    let mut endpoint = Endpoint::from_shared(target.coordinator.clone())
        .map_err(|error| Unreached::Flags(format!("--coordinator: {error}")))?
        .connect_timeout(connect_timeout);
    if let Some(ca) = &target.ca {
        let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca));
        if let Some((certificate, key)) = &target.identity {
            tls = tls.identity(Identity::from_pem(certificate, key));
        }
        endpoint = endpoint
            .tls_config(tls)
            .map_err(|error| Unreached::Flags(format!("--coordinator-ca: {error}")))?;
    }
    endpoint.connect().await.map_err(|error| {
        Unreached::Transport(
            transport_cause(&error, target.ca.is_some()).unwrap_or_else(|| error.to_string()),
        )
    })
}

/// What a coordinator that requires mutual TLS answers a client without a certificate.
const CERTIFICATE_REQUIRED: &str = "the coordinator closed the TLS connection: it requires a \
    client certificate its CA vouches for (--client-cert and --client-key)";

/// What went wrong reaching the coordinator (over TLS or not), from `error` and its sources:
/// the cause alone (the caller names the coordinator), or `None` when nothing in the chain is
/// a transport's.
pub fn transport_cause(error: &(dyn Error + 'static), over_tls: bool) -> Option<String> {
    let mut chain = Vec::new();
    let mut next: Option<&(dyn Error + 'static)> = Some(error);
    while let Some(current) = next {
        if let Some(io) = current.downcast_ref::<std::io::Error>()
            && io.kind() == std::io::ErrorKind::ConnectionRefused
        {
            return Some(
                "connection refused (nothing listens there: is the coordinator running, on \
                 that port?)"
                    .to_owned(),
            );
        }
        chain.push(current.to_string());
        next = current.source();
    }
    let text = chain.join(": ");
    let says = |words: &[&str]| words.iter().any(|word| text.contains(word));
    let cause = if says(&["lookup address", "Name or service not known", "No address"]) {
        "unknown host: the name does not resolve"
    } else if says(&["UnknownIssuer", "BadSignature"]) {
        "the coordinator's certificate is not signed by the CA of --coordinator-ca: not trusted"
    } else if says(&["NotValidForName", "not valid for name"]) {
        "the coordinator's certificate does not name this host: connect by a name it holds"
    } else if says(&["InvalidContentType", "corrupt message", "received corrupt"]) {
        "the coordinator does not speak TLS on that port: use http://"
    } else if says(&["CertificateRequired", "certificate required"]) {
        CERTIFICATE_REQUIRED
    } else if says(&[
        "frame with invalid size",
        "h2 protocol error",
        "invalid HTTP version",
        "connection closed",
        "operation was canceled",
        "broken pipe",
        "connection reset",
    ]) {
        // What an http:// connection to a TLS port meets, depending on when the server gives
        // up on bytes that are no TLS handshake: an HTTP/2 protocol error, or the connection
        // closed (or reset, or its pipe broken) before any answer. Over TLS, the same closing
        // is a coordinator that wanted a client certificate and said so too late (TLS 1.3
        // refuses it after the client's side of the handshake is done).
        if over_tls {
            CERTIFICATE_REQUIRED
        } else {
            "the coordinator did not answer in plain HTTP/2 (a TLS port? use https:// with \
             --coordinator-ca)"
        }
    } else if chain.len() > 1 || says(&["transport error", "tcp connect"]) {
        return Some(text);
    } else {
        return None;
    };
    Some(cause.to_owned())
}
