//! Every way TLS to PostgreSQL can be wrong is refused with a message that names the host and
//! the cause: a CA that did not sign the server's certificate, a host name the certificate does
//! not hold, a server without TLS under `require`, a certificate file missing, unreadable or
//! not PEM, a private key others may read, a client certificate missing or not trusted; and
//! settings that can never work are refused at start.

use super::{not_serving, run_to_end, says, tls_cluster_with_database};
use crate::support::process::ServerProcess;
use crate::support::tls_cluster::Cluster;

const DB: &str = "idempotency";

/// Starts the service on `url`, which must come to serve.
async fn comes_to_serve(url: &str) {
    ServerProcess::start(url, &[])
        .await
        .client_when_serving()
        .await;
}

/// Starts the service on `url` and asserts that it says `expected` of `host` and does not
/// serve.
async fn refused_with(url: &str, host: &str, expected: &str) {
    let server = ServerProcess::start(url, &[]).await;
    let line = says(&server, expected).await;
    assert!(
        line.contains(&format!("cannot connect to PostgreSQL at {host}")),
        "the line names the host {host}: {line}"
    );
    not_serving(&server).await;
}

#[tokio::test]
async fn a_wrong_ca_and_a_wrong_name_are_named() {
    let cluster = Cluster::tls().await;
    let certs = &cluster.certificates;
    let host = format!("localhost:{}", cluster.port);
    let other = certs.other_ca.display().to_string();
    for mode in ["verify-ca", "verify-full", "require"] {
        // `require` with a root named verifies the chain, as libpq does.
        let url = cluster.url(
            "postgres",
            "localhost",
            DB,
            &format!("sslmode={mode}&sslrootcert={other}"),
        );
        refused_with(
            &url,
            &host,
            &format!("the server's certificate is not signed by a CA in sslrootcert ({other})"),
        )
        .await;
    }
    let by_address = |mode: &str| {
        let params = format!("sslmode={mode}&sslrootcert={}", certs.ca.display());
        cluster.url("postgres", "127.0.0.1", DB, &params)
    };
    refused_with(
        &by_address("verify-full"),
        &format!("127.0.0.1:{}", cluster.port),
        "not valid for the name 127.0.0.1 (it names localhost)",
    )
    .await;
    // verify-ca does not check the name: the same URL serves.
    comes_to_serve(&by_address("verify-ca")).await;
}

#[tokio::test]
async fn a_server_without_tls_is_refused_under_require() {
    let cluster = Cluster::plain().await;
    for mode in ["require", "verify-full"] {
        let params = match mode {
            "require" => "sslmode=require".to_owned(),
            _ => format!(
                "sslmode=verify-full&sslrootcert={}",
                cluster.certificates.ca.display()
            ),
        };
        let url = cluster.url("postgres", "localhost", DB, &params);
        refused_with(
            &url,
            &format!("localhost:{}", cluster.port),
            &format!("the server does not accept TLS (its ssl setting is off), and sslmode={mode} needs it"),
        )
        .await;
    }
    // prefer falls back to a plain session, as libpq's does.
    let url = cluster.url("postgres", "localhost", DB, "sslmode=prefer");
    comes_to_serve(&url).await;
}

#[tokio::test]
async fn a_certificate_file_missing_unreadable_or_not_pem_is_named() {
    let cluster = Cluster::tls().await;
    let host = format!("localhost:{}", cluster.port);
    let missing = cluster.folder().join("absent-ca.pem");
    let folder = cluster.folder().join("a-folder");
    std::fs::create_dir(&folder).expect("a folder");
    let not_pem = cluster.folder().join("not-pem.pem");
    std::fs::write(&not_pem, "this is not a certificate\n").expect("write");
    for (path, cause) in [
        (&missing, "no such file"),
        (&folder, "cannot be read"),
        (&not_pem, "holds no PEM block"),
    ] {
        let url = cluster.url(
            "postgres",
            "localhost",
            DB,
            &format!("sslmode=verify-full&sslrootcert={}", path.display()),
        );
        refused_with(
            &url,
            &host,
            &format!("sslrootcert {}: {cause}", path.display()),
        )
        .await;
    }
}

#[tokio::test]
async fn client_certificates_refused_are_named() {
    use std::os::unix::fs::PermissionsExt;
    let cluster = tls_cluster_with_database(DB, "certuser").await;
    let certs = &cluster.certificates;
    let host = format!("localhost:{}", cluster.port);
    let verify = format!("sslmode=verify-full&sslrootcert={}", certs.ca.display());
    // No certificate where the server requires one.
    refused_with(
        &cluster.url("certuser", "localhost", DB, &verify),
        &host,
        "client certificate",
    )
    .await;
    // One signed by a CA the server does not trust.
    let foreign = format!(
        "{verify}&sslcert={}&sslkey={}",
        certs.foreign_client_cert.display(),
        certs.foreign_client_key.display()
    );
    refused_with(
        &cluster.url("certuser", "localhost", DB, &foreign),
        &host,
        "the server refused the client certificate",
    )
    .await;
    // A key others may read, as libpq refuses it.
    let open_key = cluster.folder().join("open.key");
    std::fs::copy(&certs.client_key, &open_key).expect("copy the key");
    std::fs::set_permissions(&open_key, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let url = cluster.url(
        "certuser",
        "localhost",
        DB,
        &format!(
            "{verify}&sslcert={}&sslkey={}",
            certs.client_cert.display(),
            open_key.display()
        ),
    );
    refused_with(
        &url,
        &host,
        &format!(
            "sslkey {}: has permissions 0644; a private key must not be readable by others",
            open_key.display()
        ),
    )
    .await;
}

#[tokio::test]
async fn settings_that_can_never_work_are_refused_at_start() {
    for (params, expected) in [
        (
            "sslmode=verify-full",
            "has sslmode=verify-full but no sslrootcert",
        ),
        (
            "sslmode=require&sslrootcert=system",
            "use sslmode=verify-full (as libpq requires)",
        ),
        (
            "sslmode=verify",
            "accepted: disable, allow, prefer, require",
        ),
        ("sslcert=/tmp/c.pem", "has sslcert without sslkey"),
        ("ssl-mode=require", "not one of libpq's parameters"),
        (
            "sslpassword=secret",
            "an encrypted private key is not supported",
        ),
    ] {
        let url = format!("postgres://postgres@localhost:5432/{DB}?{params}");
        let (status, said) =
            run_to_end(&["serve", "--listen", "127.0.0.1:0", "--database-url", &url]).await;
        // Before anything starts, like every other setting the service refuses.
        assert_eq!(status, Some(1), "{params}: {said}");
        assert!(
            said.contains("--database-url") && said.contains(expected),
            "{params}: {said}"
        );
    }
}
