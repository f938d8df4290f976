//! A PostgreSQL cluster of the test's own that takes TLS only, as a managed PostgreSQL does:
//! made by `initdb` on a free loopback port, with a CA, a server certificate for `localhost`
//! and client certificates that the test generates with `openssl`; `pg_hba.conf` has `hostssl`
//! lines only (a plain connection is refused), `certuser` must present a client certificate
//! (`cert`), `app` and the two roles of docs/operations.md log in with a password
//! (`scram-sha-256`), and every other role is trusted (over TLS). [`Cluster::plain`] is the same without TLS (`ssl = off`), for a server that does
//! not speak it. The cluster stops when dropped.

use std::path::{Path, PathBuf};
use std::time::Duration;

use sqlx::{Connection, PgConnection};
use tokio::process::Command;

use super::cluster::{free_port, own, run};

/// The files a test names in its URLs.
#[derive(Debug, Clone)]
pub struct Certificates {
    /// The CA that signed the server's and the clients' certificates.
    pub ca: PathBuf,
    /// A CA that signed nothing here (a wrong `sslrootcert`).
    pub other_ca: PathBuf,
    /// `certuser`'s certificate and key (mode 0600).
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    /// A certificate for `certuser` signed by the other CA (the server refuses it).
    pub foreign_client_cert: PathBuf,
    pub foreign_client_key: PathBuf,
}

pub struct Cluster {
    pub port: u16,
    pub certificates: Certificates,
    data: PathBuf,
    log: PathBuf,
    dir: tempfile::TempDir,
}

/// `openssl` with `args` in `dir`; it must succeed.
async fn openssl(dir: &Path, args: &[&str]) {
    let output = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .await
        .expect("run openssl (is it installed?)");
    super::process::assert_succeeded(&output, &format!("openssl {args:?}"));
}

/// A P-256 key and a certificate for `subject` signed by `ca` (`ca.pem`/`ca.key` in `dir`), or
/// self-signed as a CA when `ca` is `None`. `names`: its subjectAltName.
async fn certificate(dir: &Path, name: &str, subject: &str, ca: Option<&str>, names: Option<&str>) {
    let key = format!("{name}.key");
    let pem = format!("{name}.pem");
    let csr = format!("{name}.csr");
    openssl(
        dir,
        &[
            "ecparam",
            "-name",
            "prime256v1",
            "-genkey",
            "-noout",
            "-out",
            &key,
        ],
    )
    .await;
    match ca {
        None => {
            openssl(
                dir,
                &[
                    "req",
                    "-x509",
                    "-new",
                    "-key",
                    &key,
                    "-out",
                    &pem,
                    "-days",
                    "2",
                    "-subj",
                    subject,
                    "-addext",
                    "basicConstraints=critical,CA:TRUE",
                    "-addext",
                    "keyUsage=critical,keyCertSign,cRLSign",
                ],
            )
            .await;
        }
        Some(ca) => {
            openssl(
                dir,
                &["req", "-new", "-key", &key, "-out", &csr, "-subj", subject],
            )
            .await;
            let extensions = format!("{name}.ext");
            let mut text = "basicConstraints=CA:FALSE\n".to_owned();
            if let Some(names) = names {
                text.push_str(&format!("subjectAltName={names}\n"));
            }
            std::fs::write(dir.join(&extensions), text).expect("extensions file");
            openssl(
                dir,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &csr,
                    "-CA",
                    &format!("{ca}.pem"),
                    "-CAkey",
                    &format!("{ca}.key"),
                    "-CAcreateserial",
                    "-out",
                    &pem,
                    "-days",
                    "2",
                    "-extfile",
                    &extensions,
                ],
            )
            .await;
        }
    }
    // PostgreSQL, and libpq's rule this service follows, want private keys private.
    set_mode(&dir.join(&key), 0o600);
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

impl Cluster {
    /// A cluster that takes TLS only.
    pub async fn tls() -> Self {
        Self::start(true).await
    }

    /// A cluster without TLS (`ssl = off`), trusting every role on loopback.
    pub async fn plain() -> Self {
        Self::start(false).await
    }

    async fn start(ssl: bool) -> Self {
        let dir = tempfile::tempdir().expect("a folder for the cluster");
        let certs = dir.path().join("certs");
        std::fs::create_dir(&certs).expect("certs folder");
        certificate(&certs, "ca", "/CN=idempotency test CA", None, None).await;
        certificate(&certs, "other-ca", "/CN=another CA", None, None).await;
        certificate(
            &certs,
            "server",
            "/CN=localhost",
            Some("ca"),
            Some("DNS:localhost"),
        )
        .await;
        certificate(&certs, "client", "/CN=certuser", Some("ca"), None).await;
        certificate(&certs, "foreign", "/CN=certuser", Some("other-ca"), None).await;
        let port = free_port();
        let data = dir.path().join("data");
        let log = dir.path().join("postgres.log");
        own(dir.path()).await;
        let data_text = data.to_string_lossy().into_owned();
        run(
            "initdb",
            &[
                "-D",
                &data_text,
                "-U",
                "postgres",
                "-A",
                "trust",
                "--no-sync",
            ],
        )
        .await;
        // The server's own copies of its key and CA, owned by postgres as it requires.
        for file in ["server.pem", "server.key", "ca.pem"] {
            std::fs::copy(certs.join(file), data.join(file)).expect("copy into the data folder");
        }
        let tls = if ssl {
            "ssl = on\nssl_cert_file = 'server.pem'\nssl_key_file = 'server.key'\n\
             ssl_ca_file = 'ca.pem'\n"
        } else {
            "ssl = off\n"
        };
        append(
            &data.join("postgresql.conf"),
            &format!(
                "\nport = {port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\n\
                 fsync = off\nmax_connections = 100\nshared_buffers = 16MB\n\
                 password_encryption = 'scram-sha-256'\n{tls}",
                dir.path().display()
            ),
        );
        let hba = if ssl {
            "local all all trust\n\
             hostssl all certuser 127.0.0.1/32 cert\n\
             hostssl all app,idempotency_migrator,idempotency_service 127.0.0.1/32 \
             scram-sha-256\n\
             hostssl all all 127.0.0.1/32 trust\n"
        } else {
            "local all all trust\nhost all app 127.0.0.1/32 scram-sha-256\n\
             host all all 127.0.0.1/32 trust\n"
        };
        std::fs::write(data.join("pg_hba.conf"), hba).expect("pg_hba.conf");
        own(dir.path()).await;
        set_mode(&data.join("server.key"), 0o600);
        let cluster = Self {
            port,
            certificates: Certificates {
                ca: certs.join("ca.pem"),
                other_ca: certs.join("other-ca.pem"),
                client_cert: certs.join("client.pem"),
                client_key: certs.join("client.key"),
                foreign_client_cert: certs.join("foreign.pem"),
                foreign_client_key: certs.join("foreign.key"),
            },
            data,
            log,
            dir,
        };
        cluster.start_server().await;
        for role in [
            "CREATE ROLE certuser LOGIN",
            "CREATE ROLE app LOGIN PASSWORD 'pw-first-7f3a'",
        ] {
            cluster.admin(role).await;
        }
        cluster
    }

    /// Starts the stopped server.
    pub async fn start_server(&self) {
        super::cluster::start_cluster(&self.data, &self.log).await;
    }

    /// Stops the server (fast: sessions are ended).
    pub async fn stop_server(&self) {
        let data = self.data.to_string_lossy().into_owned();
        run("pg_ctl", &["-D", &data, "-m", "fast", "-w", "stop"]).await;
    }

    /// `postgres://{userinfo}@{host}:{port}/{database}?{params}`.
    pub fn url(&self, userinfo: &str, host: &str, database: &str, params: &str) -> String {
        let query = if params.is_empty() {
            String::new()
        } else {
            format!("?{params}")
        };
        format!(
            "postgres://{userinfo}@{host}:{}/{database}{query}",
            self.port
        )
    }

    /// A connection as `postgres` through the Unix socket (trusted, no TLS needed).
    pub async fn connect(&self, database: &str) -> PgConnection {
        let options = sqlx::postgres::PgConnectOptions::new()
            .socket(self.dir.path())
            .port(self.port)
            .username("postgres")
            .database(database);
        PgConnection::connect_with(&options)
            .await
            .expect("connect to the test cluster as postgres")
    }

    /// Runs `statement` as `postgres` in the maintenance database.
    pub async fn admin(&self, statement: &str) {
        self.run_in("postgres", statement).await;
    }

    /// Runs `statement` as `postgres` in `database`.
    pub async fn run_in(&self, database: &str, statement: &str) {
        let mut connection = self.connect(database).await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement.to_owned()))
            .execute(&mut connection)
            .await
            .unwrap_or_else(|error| panic!("{statement}: {error}"));
    }

    /// The service's sessions in `database` (`application_name` idempotency-coordinator…) and
    /// whether each is encrypted: (application_name, ssl).
    pub async fn service_sessions(&self, database: &str) -> Vec<(String, bool)> {
        let mut connection = self.connect("postgres").await;
        sqlx::query_as(
            "SELECT a.application_name, s.ssl FROM pg_stat_activity AS a \
             JOIN pg_stat_ssl AS s USING (pid) \
             WHERE a.datname = $1 AND a.application_name LIKE 'idempotency-coordinator%' \
             ORDER BY 1",
        )
        .bind(database)
        .fetch_all(&mut connection)
        .await
        .expect("pg_stat_ssl")
    }

    /// The folder the test may write its own files in (password files, a broken CA).
    pub fn folder(&self) -> &Path {
        self.dir.path()
    }
}

fn append(path: &Path, text: &str) {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .expect("open for append");
    file.write_all(text.as_bytes()).expect("append");
}

impl Drop for Cluster {
    fn drop(&mut self) {
        super::cluster::stop_at_once(&self.data);
    }
}

/// How long a test waits for the service to say what it says within 2 s of start, with room
/// for a loaded machine.
pub const SAYS_WITHIN: Duration = Duration::from_secs(10);
