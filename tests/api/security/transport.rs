//! Transport security: TLS for clients that trust the server, mutual TLS for clients of the
//! trusted CA, and no unauthenticated service on a network address unless asked for.

use std::time::Duration;

use idempotency_coordinator::proto::idempotency::v1::idempotency_service_client::IdempotencyServiceClient;

use crate::support::process::ServerProcess;
use crate::support::security::*;
use crate::support::*;

async fn tls_serves_clients_that_trust_its_certificate(backend: Backend) {
    let pki = Pki::new("server CA");
    let (app, _pem_files) = start_with_tls(backend, &pki, None).await;

    let channel = tls_channel(app.addr, &pki, None)
        .await
        .expect("a TLS handshake");
    let client = IdempotencyServiceClient::new(channel);
    eventually(Duration::from_secs(20), "Lookup over TLS", || async {
        client.clone().lookup(lookup("k")).await.is_ok()
    })
    .await;

    let plaintext = IdempotencyServiceClient::connect(app.endpoint()).await;
    let refused = match plaintext {
        Err(_) => true,
        Ok(mut client) => client.lookup(lookup("k")).await.is_err(),
    };
    assert!(refused, "plaintext is not served on a TLS port");
    let stranger = Pki::new("another CA");
    assert!(
        tls_channel(app.addr, &stranger, None).await.is_err(),
        "a client that does not trust the server's CA does not connect"
    );
}

async fn mutual_tls_requires_a_client_certificate_from_its_ca(backend: Backend) {
    let servers = Pki::new("server CA");
    let clients = Pki::new("client CA");
    let strangers = Pki::new("stranger CA");
    let (app, _pem_files) = start_with_tls(backend, &servers, Some(&clients)).await;

    let admitted = clients.client("payments-service");
    let channel = tls_channel(app.addr, &servers, Some(&admitted))
        .await
        .expect("an mTLS handshake");
    let client = IdempotencyServiceClient::new(channel);
    eventually(
        Duration::from_secs(20),
        "Lookup with a client certificate",
        || async { client.clone().lookup(lookup("k")).await.is_ok() },
    )
    .await;

    let forged = strangers.client("payments-service");
    for identity in [None, Some(&forged)] {
        let answered = match tls_channel(app.addr, &servers, identity).await {
            Err(_) => false,
            Ok(channel) => IdempotencyServiceClient::new(channel)
                .lookup(lookup("k"))
                .await
                .is_ok(),
        };
        assert!(!answered, "no certificate from the client CA, no call");
    }
}

/// The real binary refuses a non-loopback address without tokens or mTLS, naming the flag.
#[tokio::test]
async fn the_binary_refuses_to_serve_the_network_unauthenticated() {
    let directory = tempfile::tempdir().expect("a temporary folder");
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_idempotency-coordinator"))
        .current_dir(directory.path())
        .env_remove("DATABASE_URL")
        .args(["--listen", "0.0.0.0:0"])
        .output()
        .await
        .expect("run the binary");
    assert!(!output.status.success());
    let printed = String::from_utf8_lossy(&output.stdout);
    assert!(printed.contains("--allow-unauthenticated"), "{printed}");

    let mut allowed = ServerProcess::start_embedded_in_with(
        directory.path(),
        &["--listen", "0.0.0.0:0", "--allow-unauthenticated"],
    )
    .await;
    allowed.signal("TERM");
    assert_eq!(allowed.wait(Duration::from_secs(20)).await, Some(0));
}

for_each_backend!(
    tls_serves_clients_that_trust_its_certificate,
    mutual_tls_requires_a_client_certificate_from_its_ca,
);
