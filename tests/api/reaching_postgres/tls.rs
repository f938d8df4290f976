//! Every `sslmode` and certificate form against a server that takes TLS only (`hostssl`), as a
//! managed PostgreSQL does: each serves, with every session encrypted, through `--database-url`,
//! `--notify-database-url`, a multi-host URL and `migrate`.

use super::{
    migrate, not_serving, run_to_end, says, serve_with_environment, serves_encrypted,
    tls_cluster_with_database,
};
use crate::support::process::ServerProcess;
use crate::support::tls_cluster::Cluster;

const DB: &str = "idempotency";

#[tokio::test]
async fn every_mode_that_can_reach_a_tls_only_server_serves_encrypted() {
    let cluster = Cluster::tls().await;
    let ca = cluster.certificates.ca.display().to_string();
    for params in [
        // libpq's default: TLS when the server offers it.
        String::new(),
        "sslmode=prefer".to_owned(),
        // Plain first; the server refuses it (no `host` line), so TLS.
        "sslmode=allow".to_owned(),
        "sslmode=require".to_owned(),
        format!("sslmode=require&sslrootcert={ca}"),
        format!("sslmode=verify-ca&sslrootcert={ca}"),
        format!("sslmode=verify-full&sslrootcert={ca}"),
        // The system's roots default to verify-full; SSL_CERT_FILE stands in for them below.
    ] {
        let url = cluster.url("postgres", "localhost", DB, &params);
        let server = ServerProcess::start(&url, &[]).await;
        serves_encrypted(&server, &cluster, DB).await;
        drop(server);
    }
}

#[tokio::test]
async fn disable_is_refused_by_a_tls_only_server_with_the_cause() {
    let cluster = Cluster::tls().await;
    let url = cluster.url("postgres", "localhost", DB, "sslmode=disable");
    let server = ServerProcess::start(&url, &[]).await;
    let line = says(&server, "no encryption").await;
    assert!(
        line.contains(&format!("localhost:{}", cluster.port))
            && line.contains("the server accepts this user only over TLS: use sslmode=require"),
        "{line}"
    );
    not_serving(&server).await;
}

#[tokio::test]
async fn the_operating_systems_roots_are_trusted_with_sslrootcert_system() {
    let cluster = Cluster::tls().await;
    // rustls-native-certs reads SSL_CERT_FILE in place of the system's store: the test CA
    // stands for a public one here.
    let url = cluster.url("postgres", "localhost", DB, "sslrootcert=system");
    let ca = cluster.certificates.ca.display().to_string();
    let server = serve_with_environment(&url, &[("SSL_CERT_FILE", &ca)]).await;
    serves_encrypted(&server, &cluster, DB).await;
    // The same roots do not vouch for the name 127.0.0.1: verify-full is what system implies.
    let by_address = cluster.url("postgres", "127.0.0.1", DB, "sslrootcert=system");
    let refused = serve_with_environment(&by_address, &[("SSL_CERT_FILE", &ca)]).await;
    let line = says(&refused, "not valid for the name 127.0.0.1").await;
    assert!(line.contains("it names localhost"), "{line}");
}

#[tokio::test]
async fn a_client_certificate_logs_in_where_the_server_asks_for_one() {
    let cluster = tls_cluster_with_database(DB, "certuser").await;
    let certs = &cluster.certificates;
    let params = format!(
        "sslmode=verify-full&sslrootcert={}&sslcert={}&sslkey={}",
        certs.ca.display(),
        certs.client_cert.display(),
        certs.client_key.display()
    );
    let url = cluster.url("certuser", "localhost", DB, &params);
    let server = ServerProcess::start(&url, &[]).await;
    serves_encrypted(&server, &cluster, DB).await;
}

#[tokio::test]
async fn the_listener_url_and_a_multi_host_url_take_tls_too() {
    let cluster = Cluster::tls().await;
    let ca = cluster.certificates.ca.display().to_string();
    let verify = format!("sslmode=verify-full&sslrootcert={ca}");
    // The first host refuses connections: the store looks for the writable one among both.
    let dead = crate::support::cluster::free_port();
    let multi = format!(
        "postgres://postgres@127.0.0.1:{dead},localhost:{}/{DB}?target_session_attrs=read-write&{verify}",
        cluster.port
    );
    let notify = cluster.url("postgres", "localhost", DB, &verify);
    let server = ServerProcess::start(&multi, &["--notify-database-url", &notify]).await;
    serves_encrypted(&server, &cluster, DB).await;
}

#[tokio::test]
async fn migrate_connects_over_tls_and_names_what_refuses_it() {
    let cluster = Cluster::tls().await;
    let certs = &cluster.certificates;
    let good = cluster.url(
        "postgres",
        "localhost",
        DB,
        &format!("sslmode=verify-full&sslrootcert={}", certs.ca.display()),
    );
    migrate(&good, &[]).await;
    let wrong = cluster.url(
        "postgres",
        "localhost",
        DB,
        &format!("sslmode=verify-ca&sslrootcert={}", certs.other_ca.display()),
    );
    let (status, said) = run_to_end(&["migrate", "--database-url", &wrong]).await;
    assert_eq!(status, Some(1), "{said}");
    assert!(
        said.contains(&format!(
            "cannot connect to PostgreSQL at localhost:{}: the server's certificate is not \
             signed by a CA in sslrootcert ({})",
            cluster.port,
            certs.other_ca.display()
        )),
        "{said}"
    );
}

/// A CA bundle replaced in place (a provider's CA rotation): the service, refused while the
/// file names another CA, serves once the file holds the right one, without a restart (the
/// driver keeps what it read of the file in its settings, which are made again when it changes).
#[tokio::test]
async fn a_ca_bundle_replaced_in_place_is_used_without_a_restart() {
    let cluster = Cluster::tls().await;
    let bundle = cluster.folder().join("bundle.pem");
    std::fs::copy(&cluster.certificates.other_ca, &bundle).expect("the wrong CA first");
    let url = cluster.url(
        "postgres",
        "localhost",
        DB,
        &format!("sslmode=verify-full&sslrootcert={}", bundle.display()),
    );
    // Migrated beforehand, so that the service's own pools are what meet the wrong CA (a
    // migration connects anew each time, and would read the file anew anyway).
    let ca = cluster.certificates.ca.display().to_string();
    migrate(
        &cluster.url(
            "postgres",
            "localhost",
            DB,
            &format!("sslmode=verify-full&sslrootcert={ca}"),
        ),
        &[],
    )
    .await;
    let server = ServerProcess::start(&url, &["--no-migrate"]).await;
    says(&server, "not signed by a CA in sslrootcert").await;
    not_serving(&server).await;
    // Written aside and renamed into place, as a secret volume or a sidecar does.
    let aside = cluster.folder().join("bundle.pem.new");
    std::fs::copy(&cluster.certificates.ca, &aside).expect("the right CA");
    std::fs::rename(&aside, &bundle).expect("rename into place");
    serves_encrypted(&server, &cluster, DB).await;
}
