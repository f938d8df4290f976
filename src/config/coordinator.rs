//! Where a client command (`admin …`, `healthcheck`) finds the coordinator: its endpoint
//! (`http://host:port`, or `https://host:port` with the CA that signed its certificate) and,
//! for a coordinator that requires mutual TLS, a client certificate. Checked once here, so that
//! both commands take the same forms and refuse the same mistakes in the same words.

use std::path::Path;

use idempotency_settings::{SettingError, read_file};

/// The coordinator to reach, checked, with the PEM files read.
#[derive(Debug, Clone)]
pub struct CoordinatorTarget {
    /// `http://host:port` or `https://host:port`.
    pub coordinator: String,
    /// The CA certificate (PEM) that signed the coordinator's certificate (https:// only).
    pub ca: Option<Vec<u8>>,
    /// The client certificate and its key (PEM), for mutual TLS.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

/// The connection flags as given: the endpoint, the CA file, the client certificate and key
/// (both commands spell them alike, so a refusal names the flag as the operator typed it).
pub struct TargetFlags<'a> {
    pub coordinator: &'a str,
    pub coordinator_ca: Option<&'a Path>,
    pub client_cert: Option<&'a Path>,
    pub client_key: Option<&'a Path>,
}

impl TargetFlags<'_> {
    /// Checks the endpoint's form and its agreement with the TLS flags, and reads the files.
    pub fn check(&self) -> Result<CoordinatorTarget, SettingError> {
        let invalid = |flag: &'static str, problem: String| SettingError::new(flag, problem);
        let https = self.coordinator.starts_with("https://");
        let authority = self
            .coordinator
            .strip_prefix("http://")
            .or_else(|| self.coordinator.strip_prefix("https://"))
            .map(|rest| rest.trim_end_matches('/'))
            .filter(|authority| {
                !authority.is_empty()
                    && !authority.contains(['/', '?', '#', ' '])
                    && authority
                        .rsplit_once(':')
                        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok())
            });
        if authority.is_none() {
            return Err(invalid(
                "coordinator",
                format!(
                    "{:?} must be http://host:port or https://host:port",
                    self.coordinator
                ),
            ));
        }
        if https && self.coordinator_ca.is_none() {
            return Err(invalid(
                "coordinator-ca",
                "an https:// --coordinator needs the CA that signed its certificate".into(),
            ));
        }
        if !https && self.client_cert.is_some() {
            return Err(invalid(
                "client-cert",
                "a client certificate is shown over TLS only: --coordinator must be https://"
                    .into(),
            ));
        }
        let read = |flag: &'static str, path: Option<&Path>| {
            path.map(|path| read_file(flag, path)).transpose()
        };
        let ca = read("coordinator-ca", self.coordinator_ca)?;
        // A file that is no PEM certificate would only fail later, as "not trusted".
        if let (Some(ca), Some(path)) = (&ca, self.coordinator_ca)
            && !String::from_utf8_lossy(ca).contains("-----BEGIN CERTIFICATE-----")
        {
            return Err(invalid(
                "coordinator-ca",
                format!("{} holds no PEM certificate", path.display()),
            ));
        }
        let identity =
            read("client-cert", self.client_cert)?.zip(read("client-key", self.client_key)?);
        Ok(CoordinatorTarget {
            coordinator: self.coordinator.to_owned(),
            ca,
            identity,
        })
    }
}
