//! Who the store logs in as, from wherever the operator keeps it: the URL itself, a file that
//! holds the whole URL (`--database-url-file`), a file that holds the password
//! (`--database-password-file`: a Kubernetes secret, an RDS IAM token a sidecar rewrites every
//! few minutes, a Vault agent's template), or libpq's password file (`passfile=` in the URL,
//! else `PGPASSFILE`, else `~/.pgpass`), in libpq's order with the password file where the
//! operator put it: a password in the URL wins, then the password file, then `PGPASSWORD`, then
//! the passfile's first matching line.
//!
//! The files are read again whenever the store checks its health (every
//! `--health-check-interval`, more often while it is not ready) and at once when PostgreSQL
//! refuses a password, and a change is applied to the connections opened from then on
//! (`PgStore::refresh_credentials`); connections already open stay as they are, as with any
//! rotation PostgreSQL itself supports. (The driver's pool has no hook that runs before each new
//! connection, so "read for every connection" is this: read when it may have changed.)
//!
//! A rotation writes the file and changes the password in PostgreSQL, in either order, a moment
//! apart. So the login in use before the last change is kept: when PostgreSQL refuses the one
//! in use, each of the two is tried on a connection of its own, and new connections use the one
//! accepted ([`Credentials::use_previous`]); a rotation fails no call as long as one of them is.
//!
//! No password is ever logged or printed: this module's types print only paths.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Where the login comes from, besides the URL the store was started with.
#[derive(Debug, Clone, Default)]
pub struct CredentialFiles {
    /// The whole URL; only its user and password are taken again after start.
    pub url_file: Option<PathBuf>,
    /// The password, the file's whole content less a final line break.
    pub password_file: Option<PathBuf>,
}

/// One host as a passfile line matches it.
#[derive(Debug, Clone)]
pub struct HostKey {
    pub host: String,
    pub port: u16,
    pub database: String,
}

/// The login of one host: the user, and the password when one is known.
#[derive(Clone, PartialEq, Eq)]
pub struct Login {
    pub user: String,
    pub password: Option<String>,
}

impl std::fmt::Debug for Login {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Login")
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "…"))
            .finish()
    }
}

/// The logins of every host of one URL, as last read. Its `Debug` prints the files and hosts,
/// never a login's password or the URL file's text.
pub struct Credentials {
    files: CredentialFiles,
    /// libpq's password file, when one applies.
    passfile: Option<PathBuf>,
    hosts: Vec<HostKey>,
    /// The URL's user and password as the store was started with them.
    started_with: Login,
    /// `PGPASSWORD`, below the password file.
    env_password: Option<String>,
    /// What the URL file said besides its login, at start: a later change of it is reported
    /// once, since it takes a restart.
    url_file_rest: Option<String>,
    current: Mutex<Current>,
}

#[derive(Debug)]
struct Current {
    logins: Vec<Login>,
    /// The logins before the last change, and whether new connections use them for now (the
    /// database refused the new ones: it has not been changed yet).
    previous: Option<Vec<Login>>,
    using_previous: bool,
    /// The problem last reported (a file that cannot be read), so it is logged once.
    problem: Option<String>,
    /// The URL file's other parts last reported as changed.
    reported_rest: Option<String>,
}

impl Credentials {
    /// `started_with`: the URL's own user and password; `passfile`: the URL's `passfile=`,
    /// if any (libpq's environment and default are looked up here).
    pub fn new(
        files: CredentialFiles,
        passfile: Option<PathBuf>,
        hosts: Vec<HostKey>,
        (started_with, env_password): (Login, Option<String>),
        url_file_rest: Option<String>,
    ) -> Self {
        let passfile = passfile.or_else(default_passfile);
        let logins = vec![started_with.clone(); hosts.len()];
        let credentials = Self {
            files,
            passfile,
            hosts,
            started_with,
            env_password,
            url_file_rest,
            current: Mutex::new(Current {
                logins,
                previous: None,
                using_previous: false,
                problem: None,
                reported_rest: None,
            }),
        };
        // At start the files are read once; a problem is reported by the first connection.
        let _ = credentials.refresh();
        credentials
    }

    /// The login of host `index` new connections use: as last read, or the one before it while
    /// the database refuses that (see [`Self::alternate`]).
    pub fn login(&self, index: usize) -> Login {
        let current = self.lock();
        let logins = match (&current.previous, current.using_previous) {
            (Some(previous), true) => previous,
            _ => &current.logins,
        };
        logins
            .get(index)
            .cloned()
            .unwrap_or_else(|| self.started_with.clone())
    }

    /// Host `index`'s login as last read, and the one before it if there was a change: the
    /// logins to try when PostgreSQL refuses the one in use.
    pub fn candidates(&self, index: usize) -> (Login, Option<Login>) {
        let current = self.lock();
        let latest = current
            .logins
            .get(index)
            .cloned()
            .unwrap_or_else(|| self.started_with.clone());
        let previous = current
            .previous
            .as_ref()
            .and_then(|previous| previous.get(index).cloned());
        (latest, previous)
    }

    /// Whether new connections use the login before the last change (the database has not been
    /// changed yet) or the latest.
    pub fn use_previous(&self, previous: bool) {
        let mut current = self.lock();
        current.using_previous = previous && current.previous.is_some();
    }

    /// Reads the files again: `Ok(true)` when a host's login changed. A file that cannot be
    /// read keeps the last login and is reported (`Err`, once per problem; the caller logs it).
    pub fn refresh(&self) -> Result<bool, Option<String>> {
        let read = self.read();
        let mut current = self.lock();
        match read {
            Ok((logins, rest)) => {
                current.problem = None;
                if let (Some(rest), Some(started)) = (&rest, &self.url_file_rest)
                    && rest != started
                    && current.reported_rest.as_ref() != Some(rest)
                {
                    current.reported_rest = Some(rest.clone());
                    tracing::warn!(
                        file = %self.files.url_file.as_deref().unwrap_or(Path::new("")).display(),
                        "the database URL file changed beyond its user and password; the new \
                         user and password are used, the rest takes a restart"
                    );
                }
                let changed = current.logins != logins;
                if changed {
                    let before = std::mem::replace(&mut current.logins, logins);
                    current.previous = Some(before);
                    current.using_previous = false;
                }
                Ok(changed)
            }
            Err(problem) => {
                let new = current.problem.as_ref() != Some(&problem);
                current.problem = Some(problem.clone());
                Err(new.then_some(problem))
            }
        }
    }

    /// The problem that keeps the files from being read now, if any.
    pub fn problem(&self) -> Option<String> {
        self.lock().problem.clone()
    }

    /// Whether any file may change the login after start.
    pub fn rotates(&self) -> bool {
        self.files.url_file.is_some()
            || self.files.password_file.is_some()
            || self.passfile.is_some()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Current> {
        self.current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Every host's login from the files as they stand, and the URL file's other parts.
    fn read(&self) -> Result<(Vec<Login>, Option<String>), String> {
        let (mut base, rest) = match &self.files.url_file {
            Some(path) => {
                let url = read_secret(path, "--database-url-file")?;
                let (login, rest) = login_of_url(&url)
                    .map_err(|why| format!("--database-url-file {}: {why}", path.display()))?;
                (login, Some(rest))
            }
            None => (self.started_with.clone(), None),
        };
        if base.password.is_none()
            && let Some(path) = &self.files.password_file
        {
            base.password = Some(read_secret(path, "--database-password-file")?);
        }
        if base.password.is_none() {
            base.password = self.env_password.clone();
        }
        let mut logins = Vec::with_capacity(self.hosts.len());
        for host in &self.hosts {
            let mut login = base.clone();
            if login.password.is_none()
                && let Some(passfile) = &self.passfile
            {
                login.password = passfile_password(passfile, host, &login.user)?;
            }
            logins.push(login);
        }
        Ok((logins, rest))
    }
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("files", &self.files)
            .field("passfile", &self.passfile)
            .field("hosts", &self.hosts)
            .finish_non_exhaustive()
    }
}

/// A secret file's content less its final line break; an empty one is a problem.
pub fn read_secret(path: &Path, flag: &str) -> Result<String, String> {
    let text = std::fs::read_to_string(path).map_err(|error| {
        let why = match error.kind() {
            std::io::ErrorKind::NotFound => "no such file".to_owned(),
            std::io::ErrorKind::PermissionDenied => "permission denied".to_owned(),
            _ => error.to_string(),
        };
        format!("{flag} {}: cannot be read ({why})", path.display())
    })?;
    let text = text.strip_suffix('\n').unwrap_or(&text);
    let text = text.strip_suffix('\r').unwrap_or(text);
    if text.is_empty() {
        return Err(format!("{flag} {}: the file is empty", path.display()));
    }
    Ok(text.to_owned())
}

/// The user and password of a `postgres://` URL, and the URL without them (to notice other
/// changes).
pub fn login_of_url(url: &str) -> Result<(Login, String), String> {
    let (scheme, rest) = url
        .split_once("://")
        .ok_or("must start with postgres:// or postgresql://")?;
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let (userinfo, hosts) = match authority.rfind('@') {
        Some(at) => (&authority[..at], &authority[at + 1..]),
        None => ("", authority),
    };
    let (user, password) = match userinfo.split_once(':') {
        Some((user, password)) => (user, Some(password)),
        None => (userinfo, None),
    };
    let decode = |text: &str| {
        percent_encoding::percent_decode_str(text)
            .decode_utf8()
            .map(|decoded| decoded.into_owned())
            .map_err(|_| "its user or password is not UTF-8 once percent-decoded".to_owned())
    };
    let user = if user.is_empty() {
        default_user()
    } else {
        decode(user)?
    };
    let password = password.map(decode).transpose()?;
    Ok((
        Login { user, password },
        format!("{scheme}://{hosts}{tail}"),
    ))
}

/// libpq's default user: `PGUSER`, else the operating system's user (as the driver does).
pub fn default_user() -> String {
    std::env::var("PGUSER")
        .ok()
        .filter(|user| !user.is_empty())
        .or_else(|| std::env::var("USER").ok())
        .unwrap_or_else(|| "postgres".to_owned())
}

/// `PGPASSFILE`, else `~/.pgpass` when it exists.
fn default_passfile() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("PGPASSFILE").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(path));
    }
    let home = std::env::var_os("HOME")?;
    let path = Path::new(&home).join(".pgpass");
    path.exists().then_some(path)
}

/// The password of the first line of `passfile` that matches `host` and `user`
/// (`hostname:port:database:username:password`, `*` matching anything, `\` escaping `:` and
/// `\`). As in libpq, a passfile that others may read is not used, and a missing one is none.
fn passfile_password(
    passfile: &Path,
    host: &HostKey,
    user: &str,
) -> Result<Option<String>, String> {
    use std::os::unix::fs::MetadataExt;
    let metadata = match std::fs::metadata(passfile) {
        Ok(metadata) => metadata,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(format!("passfile {}: {error}", passfile.display())),
    };
    if metadata.mode() & 0o077 != 0 {
        return Err(format!(
            "passfile {}: has group or world access ({:04o}); libpq ignores such a file: chmod \
             600",
            passfile.display(),
            metadata.mode() & 0o777
        ));
    }
    let text = std::fs::read_to_string(passfile)
        .map_err(|error| format!("passfile {}: cannot be read ({error})", passfile.display()))?;
    let port = host.port.to_string();
    let wanted = [
        host.host.as_str(),
        port.as_str(),
        host.database.as_str(),
        user,
    ];
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let fields = passfile_fields(line);
        let [h, p, d, u, password] = fields.as_slice() else {
            continue;
        };
        let matches = [h, p, d, u]
            .iter()
            .zip(wanted)
            .all(|(field, value)| field.as_str() == "*" || field.as_str() == value);
        if matches {
            return Ok(Some(password.clone()));
        }
    }
    Ok(None)
}

/// A passfile line split at unescaped colons, with `\:` and `\\` unescaped.
fn passfile_fields(line: &str) -> Vec<String> {
    let mut fields = vec![String::new()];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(next) = chars.next()
                    && let Some(field) = fields.last_mut()
                {
                    field.push(next);
                }
            }
            ':' if fields.len() < 5 => fields.push(String::new()),
            c => {
                if let Some(field) = fields.last_mut() {
                    field.push(c);
                }
            }
        }
    }
    fields
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn host(host: &str, port: u16, database: &str) -> HostKey {
        HostKey {
            host: host.into(),
            port,
            database: database.into(),
        }
    }

    /// The credentials of user `app` on `hosts`, its URL giving `url_password`, from
    /// `password_file` (`--database-password-file`) and `passfile` (libpq's).
    fn app_credentials(
        url_password: Option<&str>,
        password_file: Option<PathBuf>,
        passfile: Option<PathBuf>,
        hosts: Vec<HostKey>,
    ) -> Credentials {
        let login = Login {
            user: "app".into(),
            password: url_password.map(str::to_owned),
        };
        Credentials::new(
            CredentialFiles {
                url_file: None,
                password_file,
            },
            passfile,
            hosts,
            (login, None),
            None,
        )
    }

    fn private(path: &Path, text: &str) {
        std::fs::write(path, text).expect("write");
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    }

    #[test]
    fn passfile_lines_match_as_in_libpq() {
        let dir = tempfile::tempdir().expect("a folder");
        let file = dir.path().join("pgpass");
        private(
            &file,
            "# comment\n\
             other:5432:*:app:wrong\n\
             db1:5432:orders:app:first\n\
             *:*:*:app:p\\:w\\\\d\n",
        );
        let found = |h: &HostKey, user: &str| passfile_password(&file, h, user).expect("read");
        assert_eq!(
            found(&host("db1", 5432, "orders"), "app").as_deref(),
            Some("first")
        );
        assert_eq!(
            found(&host("db2", 6432, "x"), "app").as_deref(),
            Some("p:w\\d")
        );
        assert_eq!(found(&host("db1", 5432, "orders"), "nobody"), None);
        assert_eq!(
            passfile_password(&dir.path().join("absent"), &host("h", 1, "d"), "u").expect("none"),
            None
        );
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let refused =
            passfile_password(&file, &host("db1", 5432, "orders"), "app").expect_err("refused");
        assert!(
            refused.contains("group or world access (0644)"),
            "{refused}"
        );
    }

    #[test]
    fn the_url_password_wins_then_the_password_file_then_the_passfile() {
        let dir = tempfile::tempdir().expect("a folder");
        let password_file = dir.path().join("password");
        private(&password_file, "from-file\n");
        let passfile = dir.path().join("pgpass");
        private(&passfile, "*:*:*:*:from-passfile\n");
        let hosts = vec![host("h1", 5432, "db"), host("h2", 5432, "db")];
        let with = |url_password: Option<&str>, password_file: Option<PathBuf>| {
            app_credentials(
                url_password,
                password_file,
                Some(passfile.clone()),
                hosts.clone(),
            )
        };
        let url = with(Some("from-url"), Some(password_file.clone()));
        assert_eq!(url.login(1).password.as_deref(), Some("from-url"));
        let file = with(None, Some(password_file.clone()));
        assert_eq!(file.login(0).password.as_deref(), Some("from-file"));
        let pass = with(None, None);
        assert_eq!(pass.login(1).password.as_deref(), Some("from-passfile"));
        // A rotation: the file rewritten, read again.
        private(&password_file, "rotated");
        assert_eq!(file.refresh(), Ok(true));
        assert_eq!(file.login(0).password.as_deref(), Some("rotated"));
        assert_eq!(file.refresh(), Ok(false));
        // The database not changed yet: the login before it, and back.
        let (latest, previous) = file.candidates(0);
        assert_eq!(latest.password.as_deref(), Some("rotated"));
        assert_eq!(
            previous.and_then(|p| p.password).as_deref(),
            Some("from-file")
        );
        file.use_previous(true);
        assert_eq!(file.login(0).password.as_deref(), Some("from-file"));
        file.use_previous(false);
        assert_eq!(file.login(0).password.as_deref(), Some("rotated"));
        assert!(
            url.candidates(0).1.is_none(),
            "nothing before the first change"
        );
    }

    #[test]
    fn an_unreadable_file_keeps_the_last_login_and_is_reported_once() {
        let dir = tempfile::tempdir().expect("a folder");
        let password_file = dir.path().join("password");
        private(&password_file, "first");
        let hosts = vec![host("h", 5432, "db")];
        let credentials = app_credentials(None, Some(password_file.clone()), None, hosts);
        std::fs::write(&password_file, "").expect("empty it");
        let reported = credentials
            .refresh()
            .expect_err("a problem")
            .expect("reported");
        assert!(reported.contains("the file is empty"), "{reported}");
        assert_eq!(credentials.refresh(), Err(None), "reported once");
        assert_eq!(credentials.login(0).password.as_deref(), Some("first"));
        assert!(!format!("{credentials:?}").contains("first"));
    }

    #[test]
    fn a_url_file_gives_its_user_and_password() {
        let (login, rest) =
            login_of_url("postgres://vault-user%401:s%3Acret@h1,h2:5433/db?sslmode=require")
                .expect("valid");
        assert_eq!(login.user, "vault-user@1");
        assert_eq!(login.password.as_deref(), Some("s:cret"));
        assert_eq!(rest, "postgres://h1,h2:5433/db?sslmode=require");
        assert!(login_of_url("h1/db").is_err());
    }
}
