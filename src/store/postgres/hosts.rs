//! Database URLs that name several hosts, as libpq takes them:
//! `postgres://user@h1:5432,h2:5432/db?target_session_attrs=read-write`.
//!
//! The driver (sqlx) connects to one host only and refuses such a URL ("invalid port number"),
//! so the URL is split here into one single-host URL per host, each parsed by the driver with
//! every other parameter it carries, and the store chooses among them (`primary/`).
//!
//! What is accepted differs from libpq in one way, on purpose: several hosts need
//! `target_session_attrs=read-write` or `primary`. libpq's default (`any`) takes the first host
//! that answers, which after a failover may be a standby; this service writes on every call, so
//! it must always look for the writable one, and a URL that would let it settle on a standby is
//! refused at start rather than failing every call after a failover.

use std::fmt;
use std::path::PathBuf;

use sqlx::postgres::PgConnectOptions;

use super::credentials::{HostKey, Login, login_of_url};
use super::tls::{TlsParams, TlsSettings};

/// The most hosts one URL may name: a primary and its standbys, with room to spare. A longer
/// list is more likely a mistake (a pasted list of every node of several clusters) than a
/// cluster, and every host is asked at once whenever the store looks for its primary.
pub const MAX_HOSTS: usize = 16;

/// PostgreSQL's default port, for a host named without one.
const DEFAULT_PORT: u16 = 5432;

/// Which session the store accepts (libpq's `target_session_attrs`, the values that can write).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionAttrs {
    /// Whatever the host is (libpq's default). Only with a single host: the service then
    /// connects as before and checks nothing.
    Any,
    /// A session whose transactions may write: `transaction_read_only` is off (libpq's
    /// `read-write`: a primary, unless an operator made it read-only by default).
    ReadWrite,
    /// A server not in recovery (libpq's `primary`), whatever its default read-only setting.
    Primary,
}

impl SessionAttrs {
    /// Whether sessions are checked (and a host that is not writable is left for another).
    pub fn checked(self) -> bool {
        self != Self::Any
    }
}

impl fmt::Display for SessionAttrs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Any => "any",
            Self::ReadWrite => "read-write",
            Self::Primary => "primary",
        })
    }
}

/// A database URL split by host: each host's connection settings, in the URL's order.
#[derive(Clone)]
pub struct HostList {
    /// One per host, each with everything else the URL says (user, database, options), but
    /// TLS, which [`HostList::tls`] applies, and the password, which the store's credentials
    /// apply (`credentials.rs`).
    pub hosts: Vec<PgConnectOptions>,
    pub attrs: SessionAttrs,
    /// What TLS every host's connections use (`sslmode`, `sslrootcert`, `sslcert`, `sslkey`).
    pub tls: TlsSettings,
    /// libpq's `passfile=`, when the URL names one.
    pub passfile: Option<PathBuf>,
    /// The URL's user (or libpq's default) and password (in its authority, or `password=`).
    pub login: Login,
    /// libpq's `PGPASSWORD`, which a password file (`--database-password-file`) outranks.
    pub env_password: Option<String>,
}

impl fmt::Debug for HostList {
    // The options carry the password: only the hosts are printed.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostList")
            .field(
                "hosts",
                &self.hosts.iter().map(host_name).collect::<Vec<_>>(),
            )
            .field("attrs", &self.attrs)
            .field("tls", &self.tls)
            .finish_non_exhaustive()
    }
}

/// `host:port` of one host's settings, for logs (never the user or password).
pub fn host_name(options: &PgConnectOptions) -> String {
    let host = options.get_host();
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{}", options.get_port())
    } else {
        format!("{host}:{}", options.get_port())
    }
}

/// Why a URL was refused; the message names what is wrong and what is accepted, never the
/// password.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct UrlProblem(String);

fn problem(text: impl Into<String>) -> UrlProblem {
    UrlProblem(text.into())
}

impl HostList {
    /// Parses `url` (`postgres://` or `postgresql://`), one host or several.
    pub fn parse(url: &str) -> Result<Self, UrlProblem> {
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| problem("must start with postgres:// or postgresql://"))?;
        // The authority ends where the path or the query begins; a '/' or '?' in a user name or
        // password must be percent-encoded, as in any URL.
        let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(authority_end);
        let (userinfo, host_list) = match authority.rfind('@') {
            Some(at) => (&authority[..=at], &authority[at + 1..]),
            None => ("", authority),
        };
        let (path, query) = match tail.split_once('?') {
            Some((path, query)) => (path, Some(query)),
            None => (tail, None),
        };
        let Parameters {
            attrs,
            tls,
            passfile,
            password,
            kept: query,
        } = parameters(query)?;
        let tls = TlsSettings::from_params(tls.with_environment()).map_err(problem)?;
        let (mut login, _) = login_of_url(url).map_err(problem)?;
        login.password = login.password.or(password);
        let env_password = std::env::var("PGPASSWORD").ok().filter(|p| !p.is_empty());
        let host_specs: Vec<&str> = host_list.split(',').collect();
        if host_specs.len() > MAX_HOSTS {
            return Err(problem(format!(
                "names {} hosts; at most {MAX_HOSTS} are accepted",
                host_specs.len()
            )));
        }
        if host_specs.len() > 1 && !attrs.checked() {
            return Err(problem(
                "names several hosts, so it needs target_session_attrs=read-write or \
                 target_session_attrs=primary: the service writes on every call and must find \
                 the writable host, also after a failover",
            ));
        }
        let query = query
            .as_deref()
            .map(|q| format!("?{q}"))
            .unwrap_or_default();
        if let [_] = host_specs.as_slice() {
            // One host: the URL as the driver has always read it (a Unix socket in `host=`,
            // a host without a port), less target_session_attrs.
            let options = format!("{scheme}://{authority}{path}{query}")
                .parse::<PgConnectOptions>()
                .map_err(invalid)?;
            login.user = options.get_username().to_owned();
            return Ok(Self {
                hosts: vec![options],
                attrs,
                tls,
                passfile,
                login,
                env_password,
            });
        }
        let mut hosts = Vec::with_capacity(host_specs.len());
        for (index, spec) in host_specs.iter().enumerate() {
            let (host, port) = host_and_port(spec).map_err(|why| {
                problem(format!("host {} of {}: {why}", index + 1, host_specs.len()))
            })?;
            let options = format!("{scheme}://{userinfo}{host}:{port}{path}{query}")
                .parse::<PgConnectOptions>()
                .map_err(invalid)?;
            hosts.push(options);
        }
        if let Some(first) = hosts.first() {
            login.user = first.get_username().to_owned();
        }
        Ok(Self {
            hosts,
            attrs,
            tls,
            passfile,
            login,
            env_password,
        })
    }

    /// Each host as a passfile line matches it.
    pub fn host_keys(&self) -> Vec<HostKey> {
        self.hosts
            .iter()
            .map(|options| HostKey {
                host: options.get_host().to_owned(),
                port: options.get_port(),
                database: options.get_database().unwrap_or_default().to_owned(),
            })
            .collect()
    }
}

/// The driver's refusal of a URL: its message names the setting it could not read, never the
/// URL.
fn invalid(error: sqlx::Error) -> UrlProblem {
    problem(format!("is not a valid PostgreSQL URL: {error}"))
}

/// The host (brackets kept for IPv6) and port of one comma-separated entry of the authority.
fn host_and_port(spec: &str) -> Result<(&str, u16), String> {
    if spec.is_empty() {
        return Err("has an empty host name (two commas, or a comma at an end)".into());
    }
    let (host, port) = if let Some(bracketed) = spec.strip_prefix('[') {
        let close = bracketed
            .find(']')
            .ok_or_else(|| format!("`{spec}`: an IPv6 address needs its closing `]`"))?;
        let after = &bracketed[close + 1..];
        let port = match after {
            "" => None,
            _ => Some(after.strip_prefix(':').ok_or_else(|| {
                format!("`{spec}`: only `:port` may follow an IPv6 address in brackets")
            })?),
        };
        (&spec[..close + 2], port)
    } else {
        match spec.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (spec, None),
        }
    };
    if host.is_empty() {
        return Err(format!("`{spec}` has an empty host name"));
    }
    let port = match port {
        None => DEFAULT_PORT,
        Some(text) => match text.parse::<u16>() {
            Ok(port) if port > 0 => port,
            _ => {
                return Err(format!(
                    "`{spec}` has an invalid port `{text}` (a number from 1 to 65535)"
                ));
            }
        },
    };
    Ok((host, port))
}

/// The parameters of the URL's query this module reads rather than the driver.
struct Parameters {
    attrs: SessionAttrs,
    tls: TlsParams,
    passfile: Option<PathBuf>,
    /// `password=`: libpq takes the password from the query too.
    password: Option<String>,
    /// The rest of the query, for the driver.
    kept: Option<String>,
}

/// `target_session_attrs`, the TLS parameters and `passfile` read from `query` and taken out of
/// it (the driver does not know the first and the last, and reads the TLS ones otherwise than
/// libpq), with host lists in the query refused: several hosts are named in the authority only.
fn parameters(query: Option<&str>) -> Result<Parameters, UrlProblem> {
    let mut found = Parameters {
        attrs: SessionAttrs::Any,
        tls: TlsParams::default(),
        passfile: None,
        password: None,
        kept: None,
    };
    let Some(query) = query else {
        return Ok(found);
    };
    let mut attrs = None;
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|pair| !pair.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let decoded = percent_encoding::percent_decode_str(value)
            .decode_utf8()
            .map_err(|_| problem(format!("has a value of `{key}` that is not UTF-8")))?
            .into_owned();
        if found.tls.take(key, decoded.clone()).map_err(problem)? {
            continue;
        }
        match key {
            "target_session_attrs" => {
                if attrs.is_some() {
                    return Err(problem("gives target_session_attrs twice"));
                }
                attrs = Some(match value {
                    "any" => SessionAttrs::Any,
                    "read-write" => SessionAttrs::ReadWrite,
                    "primary" => SessionAttrs::Primary,
                    "read-only" | "standby" | "prefer-standby" => {
                        return Err(problem(format!(
                            "asks for target_session_attrs={value}, but the service writes on \
                             every call: use read-write or primary"
                        )));
                    }
                    other => {
                        return Err(problem(format!(
                            "has target_session_attrs={other}; accepted: read-write, primary, any"
                        )));
                    }
                });
            }
            "passfile" if !decoded.is_empty() => found.passfile = Some(PathBuf::from(decoded)),
            "password" => found.password = Some(decoded),
            "host" | "hostaddr" | "port" if value.contains(',') || value.contains("%2C") => {
                return Err(problem(format!(
                    "lists several values in `{key}=`; name several hosts in the URL itself: \
                     postgres://user@host1:5432,host2:5432/database"
                )));
            }
            _ => kept.push(pair),
        }
    }
    found.attrs = attrs.unwrap_or(SessionAttrs::Any);
    found.kept = (!kept.is_empty()).then(|| kept.join("&"));
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(url: &str) -> Vec<String> {
        HostList::parse(url)
            .expect("a valid URL")
            .hosts
            .iter()
            .map(host_name)
            .collect()
    }

    fn refused(url: &str) -> String {
        HostList::parse(url).expect_err("refused").to_string()
    }

    #[test]
    fn a_single_host_is_read_as_before() {
        let list =
            HostList::parse("postgres://u:p@db.example:6543/idem?sslmode=disable").expect("valid");
        assert_eq!(list.attrs, SessionAttrs::Any);
        assert_eq!(list.hosts.len(), 1);
        let options = &list.hosts[0];
        assert_eq!(host_name(options), "db.example:6543");
        assert_eq!(options.get_database(), Some("idem"));
        assert_eq!(options.get_username(), "u");
    }

    #[test]
    fn several_hosts_keep_their_order_ports_and_everything_else() {
        let list = HostList::parse(
            "postgresql://app:s%40cret@h1:5433,h2,[::1]:5434/orders?target_session_attrs=read-write&application_name=x",
        )
        .expect("valid");
        assert_eq!(list.attrs, SessionAttrs::ReadWrite);
        let names: Vec<String> = list.hosts.iter().map(host_name).collect();
        assert_eq!(names, ["h1:5433", "h2:5432", "[::1]:5434"]);
        for options in &list.hosts {
            assert_eq!(options.get_database(), Some("orders"));
            assert_eq!(options.get_username(), "app");
            assert_eq!(options.get_application_name(), Some("x"));
        }
    }

    #[test]
    fn primary_and_single_host_checks_are_accepted() {
        assert_eq!(
            HostList::parse("postgres://h1,h2/db?target_session_attrs=primary")
                .expect("valid")
                .attrs,
            SessionAttrs::Primary
        );
        assert_eq!(
            HostList::parse("postgres://h1/db?target_session_attrs=read-write")
                .expect("valid")
                .attrs,
            SessionAttrs::ReadWrite
        );
        assert_eq!(
            hosts("postgres://h1/db?target_session_attrs=any"),
            ["h1:5432"]
        );
    }

    #[test]
    fn at_most_sixteen_hosts() {
        let names = |n: usize| {
            (0..n)
                .map(|i| format!("h{i}"))
                .collect::<Vec<_>>()
                .join(",")
        };
        let url = |n| format!("postgres://{}/db?target_session_attrs=primary", names(n));
        assert_eq!(hosts(&url(MAX_HOSTS)).len(), MAX_HOSTS);
        assert!(refused(&url(MAX_HOSTS + 1)).contains("names 17 hosts; at most 16"));
    }

    #[test]
    fn several_hosts_need_a_writable_target() {
        for url in [
            "postgres://h1,h2/db",
            "postgres://h1,h2/db?target_session_attrs=any",
        ] {
            assert!(
                refused(url).contains("needs target_session_attrs=read-write"),
                "{url}"
            );
        }
        for value in ["read-only", "standby", "prefer-standby"] {
            let url = format!("postgres://h1,h2/db?target_session_attrs={value}");
            assert!(refused(&url).contains("use read-write or primary"), "{url}");
        }
        assert!(
            refused("postgres://h1/db?target_session_attrs=writable")
                .contains("accepted: read-write, primary, any")
        );
        assert!(
            refused("postgres://h1/db?target_session_attrs=primary&target_session_attrs=primary")
                .contains("twice")
        );
    }

    #[test]
    fn bad_hosts_and_ports_are_named() {
        let url = |hosts: &str| format!("postgres://u@{hosts}/db?target_session_attrs=primary");
        assert!(refused(&url("h1,,h2")).contains("host 2 of 3: has an empty host name"));
        assert!(refused(&url("h1,")).contains("host 2 of 2: has an empty host name"));
        assert!(refused(&url("h1:0,h2")).contains("host 1 of 2: `h1:0` has an invalid port `0`"));
        assert!(refused(&url("h1,h2:65536")).contains("invalid port `65536`"));
        assert!(refused(&url("h1,h2:")).contains("invalid port ``"));
        assert!(refused(&url("h1,h2:x")).contains("invalid port `x`"));
        assert!(refused(&url("h1,:5432")).contains("empty host name"));
        assert!(refused(&url("h1,[::1")).contains("closing `]`"));
        assert!(refused(&url("h1,[::1]5432")).contains("only `:port`"));
        assert_eq!(hosts(&url("h1:1,h2:65535")), ["h1:1", "h2:65535"]);
        assert!(refused("postgres://h1:99999/db").contains("is not a valid PostgreSQL URL"));
        // One host is read by the driver as before: a socket folder in `host=` included.
        let socket = HostList::parse("postgres:///db?host=/var/run/postgresql").expect("valid");
        assert_eq!(socket.hosts.len(), 1);
    }

    #[test]
    fn host_lists_in_the_query_are_refused_with_directions() {
        for url in [
            "postgres:///db?host=h1,h2",
            "postgres://u@/db?hostaddr=10.0.0.1%2C10.0.0.2",
            "postgres://h1/db?port=5432,5433",
        ] {
            assert!(
                refused(url).contains("name several hosts in the URL itself"),
                "{url}"
            );
        }
    }

    #[test]
    fn the_password_is_never_in_a_problem_or_a_debug_print() {
        let message = refused("postgres://u:hunter2@h1,h2/db");
        assert!(!message.contains("hunter2"), "{message}");
        let list = HostList::parse("postgres://u:hunter2@h1,h2/db?target_session_attrs=primary")
            .expect("valid");
        assert!(!format!("{list:?}").contains("hunter2"));
    }

    #[test]
    fn a_url_that_is_not_postgres_is_refused() {
        assert!(refused("h1,h2/db").contains("must start with postgres://"));
    }
}
