//! Why a connection to PostgreSQL could not be opened, in an operator's words: the host, the
//! cause (refused, unknown host, no answer, TLS, the password, `pg_hba.conf`), and what to
//! change. The driver's own errors say "pool timed out", "Connection refused (os error 111)" or
//! "invalid peer certificate: UnknownIssuer"; these say which host, which setting, which file.

use std::fmt;

use super::tls::{Roots, SslMode, TlsSettings};

/// A connection that could not be opened: which host, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConnectFailure {
    pub host: String,
    pub cause: String,
}

impl fmt::Display for ConnectFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cannot connect to PostgreSQL at {}: {}",
            self.host, self.cause
        )
    }
}

/// What a description needs to know of the attempt besides its error.
pub struct Attempt<'a> {
    pub host: &'a str,
    /// The name the server's certificate must hold under `verify-full`.
    pub host_name: &'a str,
    pub user: &'a str,
    pub database: &'a str,
    pub tls: &'a TlsSettings,
    /// A problem reading the credential files, which may explain a refused password.
    pub credentials_problem: Option<String>,
}

impl Attempt<'_> {
    /// `error`, the driver's, described.
    pub fn failure(&self, error: &sqlx::Error) -> ConnectFailure {
        ConnectFailure {
            host: self.host.to_owned(),
            cause: self.cause(error),
        }
    }

    fn cause(&self, error: &sqlx::Error) -> String {
        // The driver reads the certificate and key files as it connects, and reports a file it
        // could not use as an I/O error like a network one, or as a certificate that no root
        // vouches for (a CA file without a certificate in it): the files are looked at first.
        if matches!(error, sqlx::Error::Io(_) | sqlx::Error::Tls(_))
            && let Some(problem) = self.tls.check_files()
        {
            return problem;
        }
        match error {
            sqlx::Error::Io(io) => self.io_cause(io),
            sqlx::Error::Tls(tls) => match tls.downcast_ref::<rustls::Error>() {
                Some(rustls) => self.tls_cause(rustls),
                None => self.tls_text_cause(&tls.to_string()),
            },
            sqlx::Error::Database(db) => {
                let code = db.code().unwrap_or_default().into_owned();
                self.database_cause(&code, db.message())
            }
            sqlx::Error::Protocol(_) if super::error::tls_request_unanswered(error) => {
                "the connection was closed before the server answered the TLS request (a \
                 proxy with no server behind it, or a server shutting down)"
                    .to_owned()
            }
            sqlx::Error::PoolTimedOut => {
                "no connection could be opened within the store's wait (the host may be cut \
                 off, or every connection the server allows is taken)"
                    .to_owned()
            }
            sqlx::Error::Configuration(inner) => match self.tls.check_files() {
                Some(problem) => problem,
                None => inner.to_string(),
            },
            other => crate::telemetry::error_chain(other),
        }
    }

    fn io_cause(&self, io: &std::io::Error) -> String {
        use std::io::ErrorKind;
        // The handshake's own failures reach the driver as I/O errors carrying rustls's.
        if let Some(rustls) = io
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        {
            return self.tls_cause(rustls);
        }
        let text = io.to_string();
        match io.kind() {
            ErrorKind::ConnectionRefused => {
                "connection refused: is PostgreSQL running on that host and listening on that \
                 port (listen_addresses, port)?"
                    .to_owned()
            }
            ErrorKind::TimedOut => format!("no answer ({text})"),
            // One cause whichever of these the socket reports (they alternate with timing).
            ErrorKind::ConnectionReset | ErrorKind::UnexpectedEof | ErrorKind::BrokenPipe => {
                format!(
                    "the server closed the connection during start-up{}",
                    if self.tls.mode >= SslMode::Prefer {
                        " (a server or proxy that does not speak TLS can do this)"
                    } else {
                        ""
                    }
                )
            }
            _ if text.contains("failed to lookup address")
                || text.contains("Name or service not known")
                || text.contains("nodename nor servname") =>
            {
                format!("unknown host: the name does not resolve ({text})")
            }
            _ => text,
        }
    }

    fn roots(&self) -> String {
        match &self.tls.roots {
            Some(Roots::File(path)) => format!("a CA in sslrootcert ({})", path.display()),
            Some(Roots::System(_)) => {
                "any of the operating system's roots (sslrootcert=system)".to_owned()
            }
            None => "any root (no sslrootcert)".to_owned(),
        }
    }

    fn tls_cause(&self, error: &rustls::Error) -> String {
        use rustls::{AlertDescription, CertificateError, Error};
        let mode = self.tls.mode;
        match error {
            Error::InvalidCertificate(CertificateError::UnknownIssuer) => format!(
                "the server's certificate is not signed by {} (sslmode={mode}): name the CA \
                 that signed it",
                self.roots()
            ),
            Error::InvalidCertificate(CertificateError::NotValidForNameContext {
                presented,
                ..
            }) => format!(
                "the server's certificate is not valid for the name {} (it names {}); \
                 sslmode=verify-full checks the host name: connect by a name the certificate \
                 holds",
                self.host_name,
                presented
                    .iter()
                    .map(|name| presented_name(name))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Error::InvalidCertificate(CertificateError::NotValidForName) => format!(
                "the server's certificate is not valid for the name {}; sslmode=verify-full \
                 checks the host name: connect by a name the certificate holds",
                self.host_name
            ),
            Error::InvalidCertificate(
                CertificateError::Expired | CertificateError::ExpiredContext { .. },
            ) => "the server's certificate has expired".to_owned(),
            Error::InvalidCertificate(
                CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. },
            ) => "the server's certificate is not valid yet (check both clocks)".to_owned(),
            Error::AlertReceived(
                AlertDescription::CertificateRequired | AlertDescription::HandshakeFailure,
            ) if self.tls.client.is_none() => {
                "the server requires a client certificate: name it with sslcert and sslkey"
                    .to_owned()
            }
            Error::AlertReceived(
                AlertDescription::UnknownCA
                | AlertDescription::BadCertificate
                | AlertDescription::CertificateUnknown
                | AlertDescription::DecryptError,
            ) => format!(
                "the server refused the client certificate (sslcert) as not signed by a CA it \
                 trusts (its ssl_ca_file) ({error})"
            ),
            other => format!("the TLS handshake failed: {other}"),
        }
    }

    fn tls_text_cause(&self, text: &str) -> String {
        if text.contains("server does not support TLS") {
            return format!(
                "the server does not accept TLS (its ssl setting is off), and sslmode={} needs \
                 it: turn ssl on in the server, or lower sslmode",
                self.tls.mode
            );
        }
        if let Some(problem) = self.tls.check_files() {
            return problem;
        }
        format!("the TLS set-up failed: {text}")
    }

    fn database_cause(&self, code: &str, message: &str) -> String {
        let (user, database) = (self.user, self.database);
        match code {
            "28P01" => {
                let source = match &self.credentials_problem {
                    Some(problem) => format!(" ({problem})"),
                    None => String::new(),
                };
                format!(
                    "PostgreSQL refused the password of user \"{user}\"{source}: check the \
                     password the URL, --database-password-file or the passfile gives"
                )
            }
            "28000" if message.contains("no encryption") => format!(
                "{message}: the server accepts this user only over TLS: use sslmode=require \
                 or stronger (now sslmode={})",
                self.tls.mode
            ),
            "28000" if message.contains("SSL encryption") || message.contains("SSL off") => {
                format!("{message}: the server accepts this user only without TLS (hostnossl)")
            }
            "28000" if message.contains("client certificate") => format!(
                "{message}: name a client certificate the server trusts with sslcert and sslkey"
            ),
            "28000" if message.contains("certificate authentication failed") => format!(
                "{message}: the client certificate's common name must be the user name \
                 \"{user}\" (or map it in pg_ident.conf)"
            ),
            "28000" if message.contains("does not exist") => {
                format!("{message}: create the role, or name another user in the URL")
            }
            "3D000" => format!(
                "{message}: create it (CREATE DATABASE \"{database}\"), or let `migrate` create \
                 it with a role that may"
            ),
            "53300" => format!("{message}: the server has no connection left for this user"),
            "57P03" => format!("{message}: the server is starting up or shutting down"),
            _ => format!("{message} (SQLSTATE {code})"),
        }
    }
}

/// Whether `error` is a failed TLS handshake (reported by the driver as a TLS error, or as an
/// I/O error carrying rustls's).
pub(super) fn handshake_failed(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Tls(_) => true,
        sqlx::Error::Io(io) => io
            .get_ref()
            .is_some_and(|inner| inner.downcast_ref::<rustls::Error>().is_some()),
        _ => false,
    }
}

/// Whether `error` is PostgreSQL refusing the login's credentials: a password (28P01), or an
/// authentication method that checks them elsewhere (PAM, LDAP, RADIUS: RDS IAM tokens go
/// through PAM) and answers 28000 "… authentication failed".
pub(super) fn credentials_refused(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db) if match db.code().as_deref() {
        Some("28P01") => true,
        Some("28000") => db.message().contains("authentication failed"),
        _ => false,
    })
}

/// A name a certificate presents, as rustls writes it (`DnsName("db.example")`), without the
/// wrapping.
fn presented_name(name: &str) -> &str {
    match (name.find('"'), name.rfind('"')) {
        (Some(first), Some(last)) if last > first => &name[first + 1..last],
        _ => name,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::postgres::tls::TlsParams;

    fn attempt(tls: &TlsSettings) -> Attempt<'_> {
        Attempt {
            host: "db.example:5432",
            host_name: "db.example",
            user: "app",
            database: "idempotency",
            tls,
            credentials_problem: None,
        }
    }

    fn tls(pairs: &[(&str, &str)]) -> TlsSettings {
        let mut params = TlsParams::default();
        for (key, value) in pairs {
            params
                .take(key, (*value).to_owned())
                .expect("a TLS parameter");
        }
        TlsSettings::from_params(params).expect("valid")
    }

    #[test]
    fn a_refused_connection_and_an_unknown_host_are_named() {
        let settings = tls(&[]);
        let refused = attempt(&settings).failure(&sqlx::Error::Io(std::io::Error::from(
            std::io::ErrorKind::ConnectionRefused,
        )));
        assert_eq!(refused.host, "db.example:5432");
        assert!(
            refused
                .to_string()
                .starts_with("cannot connect to PostgreSQL at db.example:5432: connection refused"),
            "{refused}"
        );
        let unknown = attempt(&settings).failure(&sqlx::Error::Io(std::io::Error::other(
            "failed to lookup address information: Name or service not known",
        )));
        assert!(unknown.cause.starts_with("unknown host"), "{unknown}");
    }

    #[test]
    fn certificate_failures_name_the_setting_and_the_names() {
        use rustls::CertificateError;
        let dir = tempfile::tempdir().expect("a folder");
        let ca = dir.path().join("ca.pem");
        std::fs::write(
            &ca,
            "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n",
        )
        .expect("a CA file");
        let ca = ca.display().to_string();
        let settings = tls(&[("sslmode", "verify-full"), ("sslrootcert", &ca)]);
        let unknown = attempt(&settings).failure(&sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer),
        )));
        assert!(
            unknown.cause.contains(&format!(
                "not signed by a CA in sslrootcert ({ca}) (sslmode=verify-full)"
            )),
            "{unknown}"
        );
        let name = attempt(&settings).failure(&sqlx::Error::Tls(Box::new(
            rustls::Error::InvalidCertificate(CertificateError::NotValidForName),
        )));
        assert!(
            name.cause.contains("not valid for the name db.example"),
            "{name}"
        );
        let named = attempt(&settings).failure(&sqlx::Error::Tls(Box::new(
            rustls::Error::InvalidCertificate(CertificateError::NotValidForNameContext {
                expected: rustls::pki_types::ServerName::try_from("db.example")
                    .expect("a name")
                    .to_owned(),
                presented: vec!["DnsName(\"other.example\")".to_owned()],
            }),
        )));
        assert!(named.cause.contains("(it names other.example)"), "{named}");
        let no_tls =
            attempt(&settings).failure(&sqlx::Error::Tls("server does not support TLS".into()));
        assert!(no_tls.cause.contains("does not accept TLS"), "{no_tls}");
        // A CA file that cannot be read is the cause, whatever the handshake then said.
        std::fs::remove_file(dir.path().join("ca.pem")).expect("remove the CA");
        let gone = attempt(&settings).failure(&sqlx::Error::Io(std::io::Error::from(
            std::io::ErrorKind::NotFound,
        )));
        assert_eq!(gone.cause, format!("sslrootcert {ca}: no such file"));
    }
}
