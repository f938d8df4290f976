//! TLS to PostgreSQL, with libpq's parameters and their meanings: `sslmode`, `sslrootcert`
//! (a file, or `system` for the operating system's roots), `sslcert` and `sslkey`, from the URL
//! or from libpq's environment variables (`PGSSLMODE`, `PGSSLROOTCERT`, `PGSSLCERT`,
//! `PGSSLKEY`), the URL's winning.
//!
//! The driver (sqlx, built with rustls and ring, as tonic is) makes the handshake; this module
//! decides what it is asked to do, so that each mode means what libpq's does:
//!
//! - `disable`: never TLS. `allow`: plain first, TLS when the server refuses a plain session
//!   (the driver alone treats `allow` as `disable`; the store switches a host to TLS after such
//!   a refusal, `PgStore::renegotiate`). `prefer` (the default): TLS when the server offers it,
//!   unchecked. `require`: TLS, unchecked, unless a root certificate is named, which makes it
//!   `verify-ca`, as in libpq. `verify-ca`: the server's chain must lead to a root of
//!   `sslrootcert`. `verify-full`: that, and the certificate must name the host.
//! - The roots are exactly those named: `sslrootcert`'s file, or with `system` the operating
//!   system's (read once, at start). The driver keeps what it read of the files in a pool's
//!   settings; they are made again when a file changes (checked at every health check,
//!   `Follower::tls_files_changed`), so a CA bundle or a client certificate replaced in place
//!   is used by the connections opened next. The driver would add the public web's roots to any file it is given; the
//!   workspace patches its source of them to an empty list (`patches/webpki-roots`), because
//!   under `verify-ca`, which does not check the host name, any public certificate would pass.
//! - Unlike libpq, nothing is looked for in `~/.postgresql/`: a mode that verifies needs
//!   `sslrootcert`, and a client certificate is used only when `sslcert` and `sslkey` name it.
//!
//! What can be judged from the settings alone (an unknown mode, a verifying mode without roots,
//! `system` with a weaker mode, a certificate without its key) is refused at start. What depends
//! on files that a secret mount may still be writing (missing, unreadable, not PEM, a key others
//! may read) is a reason a connection fails, reported with its host and retried
//! ([`TlsSettings::check_files`]).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sqlx::postgres::{PgConnectOptions, PgSslMode};

/// libpq's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SslMode {
    Disable,
    Allow,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    fn parse(text: &str) -> Result<Self, String> {
        Ok(match text {
            "disable" => Self::Disable,
            "allow" => Self::Allow,
            "prefer" => Self::Prefer,
            "require" => Self::Require,
            "verify-ca" => Self::VerifyCa,
            "verify-full" => Self::VerifyFull,
            other => {
                return Err(format!(
                    "has sslmode={other}; accepted: disable, allow, prefer, require, verify-ca, \
                     verify-full"
                ));
            }
        })
    }

    /// Whether the server's certificate is checked against the roots.
    pub fn verifies(self) -> bool {
        self >= Self::VerifyCa
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Disable => "disable",
            Self::Allow => "allow",
            Self::Prefer => "prefer",
            Self::Require => "require",
            Self::VerifyCa => "verify-ca",
            Self::VerifyFull => "verify-full",
        })
    }
}

/// Where the roots that a server's certificate must lead to come from.
#[derive(Clone)]
pub enum Roots {
    /// `sslrootcert=<file>`: the certificates in that PEM file.
    File(PathBuf),
    /// `sslrootcert=system`: the operating system's trusted roots, as PEM, read at start.
    System(Arc<Vec<u8>>),
}

impl fmt::Debug for Roots {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::File(path) => write!(f, "File({})", path.display()),
            Self::System(_) => f.write_str("System"),
        }
    }
}

/// What the store asks of every connection's TLS.
#[derive(Debug, Clone)]
pub struct TlsSettings {
    /// The mode as asked (before `require` with roots becomes `verify-ca`).
    pub mode: SslMode,
    pub roots: Option<Roots>,
    /// `sslcert` and `sslkey`: the client certificate and its private key.
    pub client: Option<(PathBuf, PathBuf)>,
}

/// The TLS parameters as the URL (or the environment) gives them, before they are judged.
#[derive(Debug, Default, Clone)]
pub struct TlsParams {
    pub sslmode: Option<String>,
    pub sslrootcert: Option<String>,
    pub sslcert: Option<String>,
    pub sslkey: Option<String>,
}

impl TlsParams {
    /// Takes `key=value` if it is a TLS parameter (answers whether it was). The driver's own
    /// spellings (`ssl-mode`, `ssl-ca`, …) are refused: they would bypass the rules here.
    pub fn take(&mut self, key: &str, value: String) -> Result<bool, String> {
        let slot = match key {
            "sslmode" => &mut self.sslmode,
            "sslrootcert" => &mut self.sslrootcert,
            "sslcert" => &mut self.sslcert,
            "sslkey" => &mut self.sslkey,
            // A passphrase would sit in the URL, and the driver would log it as a parameter it
            // does not know: an encrypted key is refused.
            "sslpassword" => {
                return Err(
                    "has sslpassword: an encrypted private key is not supported; give \
                            sslkey a key without a passphrase, readable by the service only"
                        .into(),
                );
            }
            "ssl-mode" | "ssl-root-cert" | "ssl-ca" | "ssl-cert" | "ssl-key" => {
                return Err(format!(
                    "has `{key}`, which is not one of libpq's parameters; use sslmode, \
                     sslrootcert, sslcert and sslkey"
                ));
            }
            _ => return Ok(false),
        };
        if slot.is_some() {
            return Err(format!("gives {key} twice"));
        }
        *slot = Some(value);
        Ok(true)
    }

    /// Fills what the URL left out from libpq's environment variables.
    pub fn with_environment(mut self) -> Self {
        let from_env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        self.sslmode = self.sslmode.or_else(|| from_env("PGSSLMODE"));
        self.sslrootcert = self.sslrootcert.or_else(|| from_env("PGSSLROOTCERT"));
        self.sslcert = self.sslcert.or_else(|| from_env("PGSSLCERT"));
        self.sslkey = self.sslkey.or_else(|| from_env("PGSSLKEY"));
        self
    }
}

impl TlsSettings {
    /// Judges `params`: the refusals say what is wrong and what to write instead.
    pub fn from_params(params: TlsParams) -> Result<Self, String> {
        let system = params.sslrootcert.as_deref() == Some("system");
        let mode = match params.sslmode.as_deref() {
            Some(text) => SslMode::parse(text)?,
            // libpq: with the system's roots, the default is verify-full.
            None if system => SslMode::VerifyFull,
            None => SslMode::Prefer,
        };
        if system && mode != SslMode::VerifyFull {
            return Err(format!(
                "has sslrootcert=system with sslmode={mode}: the system's roots vouch for \
                 every public certificate, so they are safe only when the host name is checked \
                 too; use sslmode=verify-full (as libpq requires)"
            ));
        }
        let roots = match params.sslrootcert {
            None => None,
            Some(_) if system => Some(Roots::System(Arc::new(system_roots()?))),
            Some(path) if path.is_empty() => return Err("has an empty sslrootcert".into()),
            Some(path) => Some(Roots::File(PathBuf::from(path))),
        };
        if mode.verifies() && roots.is_none() {
            return Err(format!(
                "has sslmode={mode} but no sslrootcert: name the CA file that signed the \
                 server's certificate (sslrootcert=/path/to/ca.pem), or sslrootcert=system for \
                 the operating system's roots"
            ));
        }
        let client = match (params.sslcert, params.sslkey) {
            (None, None) => None,
            (Some(cert), Some(key)) if !cert.is_empty() && !key.is_empty() => {
                Some((PathBuf::from(cert), PathBuf::from(key)))
            }
            (Some(_), None) => {
                return Err(
                    "has sslcert without sslkey: name the certificate's private key \
                            too"
                    .into(),
                );
            }
            (None, Some(_)) => {
                return Err("has sslkey without sslcert: name the client certificate too".into());
            }
            _ => return Err("has an empty sslcert or sslkey".into()),
        };
        Ok(Self {
            mode,
            roots,
            client,
        })
    }

    /// The mode the driver is asked for: `require` with roots is `verify-ca` (libpq's rule);
    /// `allow` starts without TLS, and `tls_after_refusal` (a host that refused a plain
    /// session) makes it `require`; `prefer` made plain by `plain_after_refusal` (a host that
    /// refused a TLS session) is `disable`.
    pub fn effective_mode(&self, fallback: bool) -> PgSslMode {
        match self.mode {
            SslMode::Disable => PgSslMode::Disable,
            SslMode::Allow if fallback => PgSslMode::Require,
            SslMode::Allow => PgSslMode::Disable,
            SslMode::Prefer if fallback => PgSslMode::Disable,
            SslMode::Prefer => PgSslMode::Prefer,
            SslMode::Require if self.roots.is_some() => PgSslMode::VerifyCa,
            SslMode::Require => PgSslMode::Require,
            SslMode::VerifyCa => PgSslMode::VerifyCa,
            SslMode::VerifyFull => PgSslMode::VerifyFull,
        }
    }

    /// Whether a host's sessions may change between plain and TLS after a refusal.
    pub fn negotiates(&self) -> bool {
        matches!(self.mode, SslMode::Allow | SslMode::Prefer)
    }

    /// `options` set up for TLS as these settings say; `fallback` as in
    /// [`Self::effective_mode`].
    pub fn apply(&self, options: PgConnectOptions, fallback: bool) -> PgConnectOptions {
        let mut options = options.ssl_mode(self.effective_mode(fallback));
        match &self.roots {
            Some(Roots::File(path)) => options = options.ssl_root_cert(path),
            Some(Roots::System(pem)) => options = options.ssl_root_cert_from_pem(pem.to_vec()),
            None => {}
        }
        if let Some((cert, key)) = &self.client {
            options = options.ssl_client_cert(cert);
            // libpq's rule for the key's permissions, which the driver does not apply: a key
            // others may read is not offered (the connection then fails, and the failure names
            // the key and its permissions: `check_files`).
            options = match check_key_mode(key) {
                Ok(()) => options.ssl_client_key(key),
                Err(_) => options.ssl_client_key_from_pem(Vec::new()),
            };
        }
        options
    }

    /// What the files these settings name are now (modified, length, inode; `None`: cannot be
    /// read), to notice one replaced in place.
    pub fn files_stamp(&self) -> Vec<Option<(std::time::SystemTime, u64, u64)>> {
        use std::os::unix::fs::MetadataExt;
        let mut files: Vec<&Path> = Vec::new();
        if let Some(Roots::File(path)) = &self.roots {
            files.push(path);
        }
        if let Some((cert, key)) = &self.client {
            files.push(cert);
            files.push(key);
        }
        files
            .into_iter()
            .map(|path| {
                let metadata = std::fs::metadata(path).ok()?;
                Some((metadata.modified().ok()?, metadata.len(), metadata.ino()))
            })
            .collect()
    }

    /// The first problem with the files these settings name, for a connection that failed:
    /// each named with its parameter and path.
    pub fn check_files(&self) -> Option<String> {
        if let Some(Roots::File(path)) = &self.roots
            && let Err(problem) = check_pem(path, "CERTIFICATE")
        {
            return Some(format!("sslrootcert {}: {problem}", path.display()));
        }
        let (cert, key) = self.client.as_ref()?;
        if let Err(problem) = check_pem(cert, "CERTIFICATE") {
            return Some(format!("sslcert {}: {problem}", cert.display()));
        }
        if let Err(problem) = check_pem(key, "PRIVATE KEY").and_then(|()| check_key_mode(key)) {
            return Some(format!("sslkey {}: {problem}", key.display()));
        }
        None
    }
}

/// Whether `path` can be read and holds a PEM block whose label ends with `label`.
fn check_pem(path: &Path, label: &str) -> Result<(), String> {
    let text = std::fs::read(path).map_err(|error| match error.kind() {
        std::io::ErrorKind::NotFound => "no such file".to_owned(),
        std::io::ErrorKind::PermissionDenied => "cannot be read (permission denied)".to_owned(),
        _ => format!("cannot be read ({error})"),
    })?;
    let text = String::from_utf8_lossy(&text);
    let found = text.lines().any(|line| {
        line.strip_prefix("-----BEGIN ")
            .and_then(|rest| rest.strip_suffix("-----"))
            .is_some_and(|found| found.ends_with(label))
    });
    if found {
        Ok(())
    } else {
        Err(format!("holds no PEM block `-----BEGIN …{label}-----`"))
    }
}

/// libpq's rule for a private key file: no access for others, and for the group only read
/// access when root owns it (a key owned by root and readable by the service's group).
fn check_key_mode(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let metadata = std::fs::metadata(path).map_err(|error| format!("cannot be read ({error})"))?;
    let mode = metadata.mode() & 0o777;
    let allowed = if metadata.uid() == 0 { 0o640 } else { 0o600 };
    if mode & !allowed != 0 {
        return Err(format!(
            "has permissions {mode:04o}; a private key must not be readable by others: \
             chmod 600 (or 640 if owned by root), as libpq requires (in Kubernetes, the \
             secret volume's defaultMode: 0600)"
        ));
    }
    Ok(())
}

/// The operating system's trusted roots as one PEM text, as `rustls-native-certs` finds them
/// (also what tonic trusts for outgoing TLS): `SSL_CERT_FILE` / `SSL_CERT_DIR` when set, else
/// the platform's store.
fn system_roots() -> Result<Vec<u8>, String> {
    use base64::Engine as _;
    let found = rustls_native_certs::load_native_certs();
    if found.certs.is_empty() {
        let why = found
            .errors
            .first()
            .map(|error| format!(" ({error})"))
            .unwrap_or_default();
        return Err(format!(
            "has sslrootcert=system, but the operating system's trust store holds no \
             certificate{why}: install its CA certificates (Debian: ca-certificates) or name a \
             CA file"
        ));
    }
    let mut pem = Vec::new();
    for certificate in found.certs {
        let encoded = base64::engine::general_purpose::STANDARD.encode(certificate.as_ref());
        pem.extend_from_slice(b"-----BEGIN CERTIFICATE-----\n");
        for line in encoded.as_bytes().chunks(64) {
            pem.extend_from_slice(line);
            pem.push(b'\n');
        }
        pem.extend_from_slice(b"-----END CERTIFICATE-----\n");
    }
    Ok(pem)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(pairs: &[(&str, &str)]) -> Result<TlsSettings, String> {
        let mut params = TlsParams::default();
        for (key, value) in pairs {
            assert!(
                params.take(key, (*value).to_owned())?,
                "{key} is a TLS parameter"
            );
        }
        TlsSettings::from_params(params)
    }

    #[test]
    fn prefer_is_the_default_and_every_libpq_mode_is_read() {
        assert_eq!(settings(&[]).expect("valid").mode, SslMode::Prefer);
        for (text, mode) in [
            ("disable", SslMode::Disable),
            ("allow", SslMode::Allow),
            ("prefer", SslMode::Prefer),
            ("require", SslMode::Require),
        ] {
            assert_eq!(settings(&[("sslmode", text)]).expect("valid").mode, mode);
        }
        let verifying =
            settings(&[("sslmode", "verify-ca"), ("sslrootcert", "/ca.pem")]).expect("valid");
        assert!(matches!(
            verifying.effective_mode(false),
            PgSslMode::VerifyCa
        ));
        assert!(
            settings(&[("sslmode", "verify")])
                .expect_err("refused")
                .contains("accepted: disable, allow, prefer, require, verify-ca, verify-full")
        );
    }

    #[test]
    fn verifying_needs_roots_and_system_needs_verify_full() {
        for mode in ["verify-ca", "verify-full"] {
            let refused = settings(&[("sslmode", mode)]).expect_err("refused");
            assert!(refused.contains("no sslrootcert"), "{refused}");
        }
        for mode in ["require", "verify-ca", "prefer"] {
            let refused =
                settings(&[("sslmode", mode), ("sslrootcert", "system")]).expect_err("refused");
            assert!(refused.contains("use sslmode=verify-full"), "{refused}");
        }
    }

    #[test]
    fn require_with_roots_verifies_the_chain_as_in_libpq() {
        let plain = settings(&[("sslmode", "require")]).expect("valid");
        assert!(matches!(plain.effective_mode(false), PgSslMode::Require));
        let rooted =
            settings(&[("sslmode", "require"), ("sslrootcert", "/ca.pem")]).expect("valid");
        assert!(matches!(rooted.effective_mode(false), PgSslMode::VerifyCa));
    }

    #[test]
    fn allow_and_prefer_change_only_after_a_refusal() {
        let allow = settings(&[("sslmode", "allow")]).expect("valid");
        assert!(matches!(allow.effective_mode(false), PgSslMode::Disable));
        assert!(matches!(allow.effective_mode(true), PgSslMode::Require));
        let prefer = settings(&[]).expect("valid");
        assert!(matches!(prefer.effective_mode(false), PgSslMode::Prefer));
        assert!(matches!(prefer.effective_mode(true), PgSslMode::Disable));
        assert!(allow.negotiates() && prefer.negotiates());
        assert!(
            !settings(&[("sslmode", "require")])
                .expect("valid")
                .negotiates()
        );
    }

    #[test]
    fn a_client_certificate_needs_its_key_and_the_driver_spellings_are_refused() {
        assert!(
            settings(&[("sslcert", "/c.pem")])
                .expect_err("refused")
                .contains("without sslkey")
        );
        assert!(
            settings(&[("sslkey", "/k.pem")])
                .expect_err("refused")
                .contains("without sslcert")
        );
        let mut params = TlsParams::default();
        assert!(
            params
                .take("ssl-mode", "require".into())
                .expect_err("refused")
                .contains("use sslmode")
        );
        assert!(
            !params
                .take("application_name", "x".into())
                .expect("not TLS")
        );
        params.take("sslmode", "require".into()).expect("taken");
        assert!(
            params
                .take("sslmode", "disable".into())
                .expect_err("refused")
                .contains("twice")
        );
    }

    #[test]
    fn files_are_checked_by_their_parameter_name() {
        let dir = tempfile::tempdir().expect("a folder");
        let ca = dir.path().join("ca.pem");
        let with_roots = |path: &Path| TlsSettings {
            mode: SslMode::VerifyFull,
            roots: Some(Roots::File(path.to_owned())),
            client: None,
        };
        let missing = with_roots(&ca).check_files().expect("a problem");
        assert!(missing.contains("sslrootcert") && missing.contains("no such file"));
        std::fs::write(&ca, "not a certificate").expect("write");
        let not_pem = with_roots(&ca).check_files().expect("a problem");
        assert!(not_pem.contains("holds no PEM block"), "{not_pem}");
        std::fs::write(
            &ca,
            "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n",
        )
        .expect("write");
        assert_eq!(with_roots(&ca).check_files(), None);
    }

    #[test]
    fn a_key_others_may_read_is_named_with_its_permissions() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("a folder");
        let cert = dir.path().join("client.crt");
        let key = dir.path().join("client.key");
        std::fs::write(
            &cert,
            "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n",
        )
        .expect("write");
        std::fs::write(
            &key,
            "-----BEGIN PRIVATE KEY-----\nAA==\n-----END PRIVATE KEY-----\n",
        )
        .expect("write");
        let client = TlsSettings {
            mode: SslMode::Require,
            roots: None,
            client: Some((cert, key.clone())),
        };
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o604)).expect("chmod");
        let problem = client.check_files().expect("a problem");
        assert!(
            problem.contains("sslkey") && problem.contains("0604") && problem.contains("chmod 600"),
            "{problem}"
        );
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        assert_eq!(client.check_files(), None);
    }
}
