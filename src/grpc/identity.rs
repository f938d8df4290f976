//! Who a call comes from, for the admin API (a key's holder, an audit event's actor): the
//! token's name when the door admitted a token, else the subject of the client certificate
//! the connection was verified with (mutual TLS), else nobody (anonymous callers).
//!
//! The certificate's subject is read once per connection (its DER parsed by `x509-parser`,
//! the rusticata project's parser, already used by the test suite's certificate maker) and
//! shared by every call of the connection.

use tonic::codegen::http;
use tonic::transport::server::TlsConnectInfo;

use super::connections::ConnectionInfo;
use crate::domain::Holder;

/// Who an admitted call comes from, in its request's extensions. Absent: an anonymous caller.
#[derive(Debug, Clone)]
pub struct CallerIdentity(pub Holder);

impl CallerIdentity {
    /// The identity `request` carries, if any.
    pub fn of<T>(request: &tonic::Request<T>) -> Option<Holder> {
        request.extensions().get::<Self>().map(|c| c.0.clone())
    }
}

/// Marks `request` with its connection's client certificate subject, when the connection is
/// TLS with a verified client certificate.
pub fn mark_certificate_holder<B>(request: &mut http::Request<B>) {
    let Some(tls) = request.extensions().get::<TlsConnectInfo<ConnectionInfo>>() else {
        return;
    };
    let holder = tls.get_ref().state().certificate_holder(|| {
        let certificates = tls.peer_certs()?;
        let leaf = certificates.first()?;
        certificate_subject(leaf.as_ref()).map(|subject| Holder::certificate(&subject))
    });
    if let Some(holder) = holder {
        request.extensions_mut().insert(CallerIdentity(holder));
    }
}

/// The subject of a DER certificate as RFC 4514 text (`CN=payments,O=Example`), `None` when it
/// cannot be parsed (rustls verified it, so that does not happen) or is empty.
fn certificate_subject(der: &[u8]) -> Option<String> {
    let (_, certificate) = x509_parser::parse_x509_certificate(der).ok()?;
    let subject = certificate.subject().to_string();
    (!subject.is_empty()).then_some(subject)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn certificate(subject: &str) -> Vec<u8> {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        let mut name = rcgen::DistinguishedName::new();
        name.push(rcgen::DnType::CommonName, subject);
        name.push(rcgen::DnType::OrganizationName, "Example");
        params.distinguished_name = name;
        let key = rcgen::KeyPair::generate().expect("key");
        params
            .self_signed(&key)
            .expect("certificate")
            .der()
            .to_vec()
    }

    #[test]
    fn a_certificate_names_its_holder_by_its_subject() {
        let subject = certificate_subject(&certificate("payments-worker")).expect("a subject");
        assert!(subject.contains("CN=payments-worker"), "{subject}");
        assert!(subject.contains("O=Example"), "{subject}");
        assert_eq!(
            Holder::certificate(&subject).as_str(),
            format!("cert:{subject}")
        );
    }

    #[test]
    fn bytes_that_are_no_certificate_name_nobody() {
        assert_eq!(certificate_subject(b"not a certificate"), None);
    }
}
