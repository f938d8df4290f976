//! Tokens, certificates and TLS clients for the security tests, all made in the test.

use idempotency_coordinator::proto::idempotency::v1::idempotency_service_client::IdempotencyServiceClient;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

use super::TestDatabase;
use super::process::ServerProcess;

/// Adds `authorization: Bearer <token>` to every call (or nothing, for a caller without one).
#[derive(Clone)]
pub struct Bearer(Option<MetadataValue<Ascii>>);

impl Bearer {
    pub fn token(token: &str) -> Self {
        Self(Some(
            format!("Bearer {token}")
                .parse()
                .expect("an ASCII header value"),
        ))
    }

    pub fn raw(header: &str) -> Self {
        Self(Some(header.parse().expect("an ASCII header value")))
    }

    pub fn none() -> Self {
        Self(None)
    }
}

impl Interceptor for Bearer {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(value) = &self.0 {
            request
                .metadata_mut()
                .insert("authorization", value.clone());
        }
        Ok(request)
    }
}

pub type AuthedClient = IdempotencyServiceClient<InterceptedService<Channel, Bearer>>;

pub async fn authed_client(endpoint: String, bearer: Bearer) -> AuthedClient {
    IdempotencyServiceClient::with_interceptor(super::channel_to(endpoint).await, bearer)
}

/// After a reload of the tokens file (SIGHUP): waits until the token of `admitted`, new in the
/// file, is in force, then asserts that the token of `revoked`, gone from it, is refused.
pub async fn assert_the_reload_took_effect(admitted: &AuthedClient, revoked: &AuthedClient) {
    let lookup = || super::lookup("k");
    super::eventually(
        std::time::Duration::from_secs(10),
        "the reload took effect",
        || async { admitted.clone().lookup(lookup()).await.is_ok() },
    )
    .await;
    let status = revoked.clone().lookup(lookup()).await.expect_err("revoked");
    assert_eq!(status.code(), tonic::Code::Unauthenticated);
}

/// A tokens file in a temporary folder, rewritten at will.
pub struct TokensFile {
    _dir: tempfile::TempDir,
    pub path: std::path::PathBuf,
}

impl TokensFile {
    pub fn new(lines: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("a temporary folder");
        let path = dir.path().join("tokens");
        let file = Self { _dir: dir, path };
        file.write(lines);
        file
    }

    pub fn write(&self, lines: &[&str]) {
        // Written aside and renamed, so that a reload never reads half a file.
        let staging = self.path.with_extension("new");
        std::fs::write(&staging, lines.join("\n") + "\n").expect("write tokens");
        std::fs::rename(&staging, &self.path).expect("replace tokens");
    }

    pub fn flag(&self) -> String {
        self.path.display().to_string()
    }

    /// The real binary on `database` with these tokens, once it serves.
    pub async fn serve_binary(&self, database: &TestDatabase) -> ServerProcess {
        let server = ServerProcess::start(&database.url, &["--tokens-file", &self.flag()]).await;
        let _ = server.client_when_serving().await;
        server
    }
}

/// A token for `scopes`, and its tokens-file line.
pub fn token(name: &str, scopes: &str) -> (String, String) {
    admin_token(
        name,
        scopes,
        idempotency_coordinator::auth::AdminRight::None,
    )
}

/// A token for `scopes` with `admin` over the admin API, and its tokens-file line.
pub fn admin_token(
    name: &str,
    scopes: &str,
    admin: idempotency_coordinator::auth::AdminRight,
) -> (String, String) {
    idempotency_coordinator::auth::new_token(name, scopes, admin).expect("a token")
}

/// A certificate authority made for one test.
pub struct Pki {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

pub struct Issued {
    pub certificate: String,
    pub key: String,
}

impl Pki {
    pub fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().expect("a key");
        let issuer = CertifiedIssuer::self_signed(params, key).expect("a CA");
        Self { issuer }
    }

    pub fn ca_pem(&self) -> String {
        self.issuer.pem()
    }

    fn issue(&self, name: &str, purpose: ExtendedKeyUsagePurpose) -> Issued {
        let mut params = CertificateParams::new(vec![name.to_owned()]).expect("params");
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![purpose];
        let key = KeyPair::generate().expect("a key");
        let certificate = params.signed_by(&key, &self.issuer).expect("a certificate");
        Issued {
            certificate: certificate.pem(),
            key: key.serialize_pem(),
        }
    }

    /// A server certificate for `localhost`.
    pub fn server(&self) -> Issued {
        self.issue("localhost", ExtendedKeyUsagePurpose::ServerAuth)
    }

    pub fn client(&self, name: &str) -> Issued {
        self.issue(name, ExtendedKeyUsagePurpose::ClientAuth)
    }
}

/// Writes PEM files for the server's TLS flags into `dir`.
pub fn server_tls_flags(dir: &std::path::Path, pki: &Pki, client_ca: Option<&Pki>) -> Vec<String> {
    let server = pki.server();
    let cert = dir.join("server.pem");
    let key = dir.join("server.key");
    std::fs::write(&cert, &server.certificate).expect("write cert");
    std::fs::write(&key, &server.key).expect("write key");
    let mut flags = vec![
        "--tls-cert".to_owned(),
        cert.display().to_string(),
        "--tls-key".to_owned(),
        key.display().to_string(),
    ];
    if let Some(client_ca) = client_ca {
        let ca = dir.join("clients-ca.pem");
        std::fs::write(&ca, client_ca.ca_pem()).expect("write client CA");
        flags.extend(["--tls-client-ca".to_owned(), ca.display().to_string()]);
    }
    flags
}

/// A server on a fresh `backend` database that serves TLS with a certificate of `pki` and, given
/// `client_ca`, requires a client certificate of it; and the folder of its PEM files, which
/// must outlive it. Not waited for: the caller waits for what it expects to work.
pub async fn start_with_tls(
    backend: super::Backend,
    pki: &Pki,
    client_ca: Option<&Pki>,
) -> (super::TestApp, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("a folder for the PEM files");
    let flags = server_tls_flags(dir.path(), pki, client_ca);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let database = super::TestDatabase::create(backend).await;
    (super::TestApp::start_on(database, None, &flags).await, dir)
}

/// A TLS channel that trusts `ca` and, for mTLS, shows `identity`.
pub async fn tls_channel(
    addr: std::net::SocketAddr,
    ca: &Pki,
    identity: Option<&Issued>,
) -> Result<Channel, tonic::transport::Error> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca.ca_pem()))
        .domain_name("localhost");
    if let Some(identity) = identity {
        tls = tls.identity(Identity::from_pem(&identity.certificate, &identity.key));
    }
    Channel::from_shared(format!("https://{addr}"))
        .expect("endpoint")
        .tls_config(tls)?
        .connect()
        .await
}

/// A server on a fresh `backend` database under mutual TLS, the folder of its PEM files, its two
/// CAs, and a channel to it that shows the certificate of the client named `client`.
pub struct MutualTls {
    pub app: super::TestApp,
    pub pem_files: tempfile::TempDir,
    pub servers: Pki,
    pub clients: Pki,
    pub channel: Channel,
}

impl MutualTls {
    /// Starts the server and returns once it claims keys over the channel: until its schema is
    /// migrated it answers UNAVAILABLE, so a claim elsewhere (namespace `elsewhere`) tells when.
    pub async fn start(backend: super::Backend, client: &str) -> Self {
        let servers = Pki::new("server CA");
        let clients = Pki::new("client CA");
        let (app, pem_files) = start_with_tls(backend, &servers, Some(&clients)).await;
        let channel = tls_channel(app.addr, &servers, Some(&clients.client(client)))
            .await
            .expect("an mTLS handshake");
        use super::InNamespace;
        let service = IdempotencyServiceClient::new(channel.clone());
        super::eventually(
            std::time::Duration::from_secs(20),
            "the server claims keys",
            || async {
                let warm_up = super::try_start("warm-up").in_namespace("elsewhere".into());
                service.clone().try_start(warm_up).await.is_ok()
            },
        )
        .await;
        Self {
            app,
            pem_files,
            servers,
            clients,
            channel,
        }
    }
}

/// Writes `text` into `dir` as `name`; answers its path.
pub fn write_pem(dir: &std::path::Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write a PEM file");
    path.display().to_string()
}

/// The files a command-line client (the admin CLI, healthcheck) is pointed at for mutual TLS,
/// written into a folder as `<name>-ca.pem`, `<name>.pem` and `<name>.key` (paths).
pub struct ClientPemFiles {
    /// The CA that signed the server's certificate.
    pub ca: String,
    pub certificate: String,
    pub key: String,
}

impl ClientPemFiles {
    pub fn write(dir: &std::path::Path, servers: &Pki, name: &str, client: &Issued) -> Self {
        Self {
            ca: write_pem(dir, &format!("{name}-ca.pem"), &servers.ca_pem()),
            certificate: write_pem(dir, &format!("{name}.pem"), &client.certificate),
            key: write_pem(dir, &format!("{name}.key"), &client.key),
        }
    }

    /// `--client-cert` and `--client-key`.
    pub fn certificate_flags(&self) -> [&str; 4] {
        [
            "--client-cert",
            &self.certificate,
            "--client-key",
            &self.key,
        ]
    }

    /// `--coordinator-ca`, `--client-cert` and `--client-key`.
    pub fn flags(&self) -> Vec<&str> {
        [
            &["--coordinator-ca", self.ca.as_str()][..],
            &self.certificate_flags(),
        ]
        .concat()
    }
}

/// What a test of a client's transport failures points it at, written into `dir`: the servers'
/// CA, another CA, a file that holds no certificate (paths), and a port nothing listens on.
pub struct TransportFaults {
    pub ca: String,
    pub stranger: String,
    pub junk: String,
    pub closed: u16,
}

impl TransportFaults {
    pub fn write(dir: &std::path::Path, servers: &Pki) -> Self {
        let write = |name: &str, text: &str| write_pem(dir, name, text);
        let closed = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
            listener.local_addr().expect("its address").port()
        };
        Self {
            ca: write("ca.pem", &servers.ca_pem()),
            stranger: write("stranger.pem", &Pki::new("another CA").ca_pem()),
            junk: write("junk.pem", "not a certificate\n"),
            closed,
        }
    }
}
