//! The client's bearer token against a server with a tokens file, and its TLS settings against
//! a server that requires client certificates.

use idempotency_client::{
    Certificate, Client, ClientTlsConfig, Error, Identity, RetryPolicy, RunError,
};

use super::{PaymentError, Runs};
use crate::support::security::{Pki, TokensFile, start_with_tls, token};
use crate::support::*;

async fn a_token_is_sent_and_a_scope_it_lacks_is_a_typed_permission_error(backend: Backend) {
    let (secret, line) = token("payments", "payments");
    let tokens = TokensFile::new(&[&line]);
    let app = TestApp::spawn_with(backend, &["--tokens-file", &tokens.flag()]).await;
    let client = Client::builder(app.endpoint())
        .token(secret)
        .build()
        .await
        .expect("connect");
    let runs = Runs::default();

    let allowed = client
        .run_once("payments", unique_key("charge"))
        .run(|_lease| async {
            runs.record();
            Ok::<_, PaymentError>("ok".to_owned())
        })
        .await
        .expect("the token holds payments");
    assert_eq!(allowed.value, "ok");

    let denied = client
        .run_once("billing", unique_key("charge"))
        .run(|_lease| async {
            runs.record();
            Ok::<_, PaymentError>("no".to_owned())
        })
        .await;
    assert!(
        matches!(
            denied,
            Err(RunError::Coordinator(Error::PermissionDenied(_)))
        ),
        "{denied:?}"
    );
    let marked = client.mark_processed("billing", ["evt-1"]).send().await;
    assert!(
        matches!(marked, Err(Error::PermissionDenied(_))),
        "{marked:?}"
    );

    let anonymous = Client::builder(app.endpoint())
        .build()
        .await
        .expect("connect");
    let refused = anonymous.mark_processed("payments", ["evt-1"]).send().await;
    assert!(
        matches!(refused, Err(Error::Unauthenticated(_))),
        "{refused:?}"
    );
    assert_eq!(runs.count(), 1, "only the allowed work ran");
}

async fn mutual_tls_settings_reach_a_server_that_requires_them(backend: Backend) {
    let servers = Pki::new("server CA");
    let clients = Pki::new("client CA");
    let (app, _pem_files) = start_with_tls(backend, &servers, Some(&clients)).await;
    let endpoint = format!("https://{}", app.addr);
    let trust = || {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(servers.ca_pem()))
            .domain_name("localhost")
    };

    let admitted = clients.client("payments-service");
    let client = Client::builder(&endpoint)
        .tls(trust().identity(Identity::from_pem(&admitted.certificate, &admitted.key)))
        .build()
        .await
        .expect("an mTLS handshake");
    // The server may not serve yet (its store is being migrated): STORE_UNAVAILABLE is retried.
    let outcome = client
        .run_once("payments", unique_key("charge"))
        .run(|lease| async move { Ok::<_, PaymentError>(lease.attempt()) })
        .await
        .expect("run over mutual TLS");
    assert_eq!((outcome.value, outcome.replayed), (1, false));

    let anonymous = match Client::builder(&endpoint).tls(trust()).build().await {
        Err(error) => Some(error),
        Ok(client) => client
            .mark_processed("payments", ["evt"])
            .send()
            .await
            .err(),
    };
    assert!(
        anonymous.is_some(),
        "a client without a certificate is refused"
    );
}

async fn a_rate_limited_call_is_typed_with_its_wait_and_retried_after_it(backend: Backend) {
    let (secret, line) = token("busy", "*");
    let tokens = TokensFile::new(&[&line]);
    let app = TestApp::spawn_with(
        backend,
        &["--tokens-file", &tokens.flag(), "--rate-limit", "2"],
    )
    .await;
    let builder = Client::builder(app.endpoint()).token(secret);
    let impatient = builder
        .clone()
        .retry(RetryPolicy::none())
        .build()
        .await
        .expect("connect");
    let mut refused = None;
    for call in 0..10 {
        match impatient
            .mark_processed("billing", [format!("a-{call}")])
            .send()
            .await
        {
            Ok(new) => assert_eq!(new.len(), 1),
            Err(error) => {
                refused = Some(error);
                break;
            }
        }
    }
    let refused = refused.expect("a burst over the rate is refused");
    assert!(matches!(refused, Error::RateLimited(_)), "{refused:?}");
    let wait = refused.retry_after().expect("RetryInfo");
    assert!(
        wait > std::time::Duration::ZERO && wait <= std::time::Duration::from_millis(500),
        "at 2/s the next call is at most 500 ms away: {wait:?}"
    );

    // With retries, every call gets through, each after the wait the service asked for, and
    // each id is new: a refused call wrote nothing.
    let patient = builder.build().await.expect("connect");
    for call in 0..6 {
        let id = format!("b-{call}");
        let new = patient
            .mark_processed("billing", [id.clone()])
            .send()
            .await
            .expect("retried until allowed");
        assert_eq!(new, [id]);
    }
}

for_each_backend!(
    a_token_is_sent_and_a_scope_it_lacks_is_a_typed_permission_error,
    a_rate_limited_call_is_typed_with_its_wait_and_retried_after_it,
    mutual_tls_settings_reach_a_server_that_requires_them,
);
