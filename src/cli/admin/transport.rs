//! A transport failure in words an operator acts on: the gRPC stack reports every one of them
//! as "transport error", its cause buried in the chain of sources. Walks the chain and names
//! the cause: nothing listening, a host that does not resolve, TLS where plain HTTP/2 was
//! spoken or the reverse, a certificate the CA does not vouch for, a CA that is not PEM.

use std::error::Error;

/// What went wrong reaching the coordinator, from `error` and its sources: the cause alone
/// (the caller names the coordinator), or `None` when nothing in the chain is a transport's.
pub(super) fn transport_cause(error: &(dyn Error + 'static)) -> Option<String> {
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
        // closed (or reset, or its pipe broken) before any answer.
        "the coordinator did not answer in plain HTTP/2 (a TLS port? use https:// with \
         --coordinator-ca)"
    } else if chain.len() > 1 || says(&["transport error", "tcp connect"]) {
        return Some(text);
    } else {
        return None;
    };
    Some(cause.to_owned())
}
