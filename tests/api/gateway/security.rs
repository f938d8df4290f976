//! The gateway is a caller like any other: its token file is sent, a token without the
//! namespace in its scopes is refused by the coordinator (and nothing is forwarded), and it
//! reaches a coordinator over TLS with the CA it is given.

use crate::support::security::{Pki, TokensFile, start_with_tls, token};
use clap::Parser;

use crate::support::{Backend, TestApp};

use super::{Http, TestGateway, Upstream, key};

#[tokio::test]
async fn the_gateways_token_and_its_scopes_apply() {
    let (orders_secret, orders_line) = token("gateway", super::ORDERS);
    let (billing_secret, billing_line) = token("billing-gateway", "billing");
    let tokens = TokensFile::new(&[&orders_line, &billing_line]);
    let app = TestApp::spawn_with(Backend::Postgres, &["--tokens-file", &tokens.flag()]).await;
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().expect("a folder for the token files");
    let token_file = |name: &str, secret: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, format!("{secret}\n")).expect("write the token file");
        path.to_str().expect("UTF-8 path").to_owned()
    };
    let allowed = token_file("orders", &orders_secret);
    let wrong_scope = token_file("billing", &billing_secret);
    let http = Http::new();

    let gateway = TestGateway::start(&upstream, &app.endpoint(), &["--token-file", &allowed]).await;
    let url = format!("{}/orders", gateway.url());
    let key = key("token");
    assert_eq!(http.post(&url, &key, "{}").await.status, 201);
    assert!(http.post(&url, &key, "{}").await.replayed());

    // A gateway with a token of another scope, then one with no token: the coordinator refuses.
    let other_scope = ["--token-file", wrong_scope.as_str()];
    for (flags, label) in [(&other_scope[..], "scope"), (&[][..], "none")] {
        let refused = TestGateway::start(&upstream, &app.endpoint(), flags).await;
        let url = format!("{}/orders", refused.url());
        http.post(&url, &super::key(label), "{}")
            .await
            .assert_problem(500, "coordinator-refused");
    }
    assert_eq!(
        upstream.executions(),
        1,
        "refused requests are not forwarded"
    );
}

/// Over TLS: a gateway given the coordinator's CA (--coordinator-ca) works; without it, the
/// gateway refuses to start.
#[tokio::test]
async fn the_gateway_reaches_a_tls_coordinator_with_its_ca() {
    let pki = Pki::new("coordinator CA");
    let (app, dir) = start_with_tls(Backend::Postgres, &pki, None).await;
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, pki.ca_pem()).expect("write the CA");
    let ca = ca.to_str().expect("UTF-8 path");
    // The certificate names localhost; the retries cover the store's first moments.
    let endpoint = format!("https://localhost:{}", app.addr.port());
    let upstream = Upstream::start().await;
    let http = Http::new();
    let trusting = TestGateway::start(
        &upstream,
        &endpoint,
        &["--coordinator-ca", ca, "--coordinator-retry", "10s"],
    )
    .await;
    let url = format!("{}/orders", trusting.url());
    let key = key("tls");
    assert_eq!(http.post(&url, &key, "{}").await.status, 201);
    assert!(http.post(&url, &key, "{}").await.replayed());
    // Without the CA the gateway does not start: it could not verify the coordinator.
    let args = idempotency_coordinator::config::Cli::try_parse_from([
        "idempotency-coordinator",
        "gateway",
        "--upstream",
        &upstream.url(),
        "--coordinator",
        &endpoint,
        "--namespace",
        super::ORDERS,
    ])
    .expect("the flags parse")
    .into_command();
    let idempotency_coordinator::config::Command::Gateway(args) = args else {
        panic!("the gateway subcommand");
    };
    let error = args.settings().expect_err("https without a CA is refused");
    assert_eq!(error.flag, "coordinator-ca");
    assert_eq!(upstream.executions(), 1);
}
