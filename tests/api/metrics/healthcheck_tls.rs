//! `healthcheck` in the forms `admin` takes, through the real binary: `--coordinator` plain or
//! `https://` with `--coordinator-ca` (and a client certificate for a coordinator that requires
//! mutual TLS), every way of not reaching it named as `admin` names it (exit 1), and the flags
//! that cannot make an endpoint refused (exit 2).

use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use super::*;
use crate::support::security::*;

/// Waits, through a health Watch stream over TLS, until `app` serves the API: a TLS server is
/// started without waiting, and a check before its store is ready rightly answers NOT_SERVING.
async fn serving_over_tls(app: &TestApp, servers: &Pki, identity: Option<&Issued>) {
    let channel = tls_channel(app.addr, servers, identity)
        .await
        .expect("a TLS handshake");
    let mut stream = HealthClient::new(channel)
        .watch(HealthCheckRequest {
            service: "idempotency.v1.IdempotencyService".into(),
        })
        .await
        .expect("watch health")
        .into_inner();
    let waited = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(message) = stream.message().await.expect("health stream") {
            if message.status() == ServingStatus::Serving {
                return;
            }
        }
        panic!("the health stream ended before SERVING");
    })
    .await;
    assert!(waited.is_ok(), "the server did not serve in time");
}

/// `healthcheck` with `args` and a bounded time; its exit status and standard error.
async fn check(args: &[&str]) -> (Option<i32>, String) {
    let args = [&["healthcheck", "--timeout", "5s"], args].concat();
    let output = coordinator(&args).await;
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr)
            .trim_end()
            .to_owned(),
    )
}

async fn healthcheck_reaches_plain_and_tls_coordinators_and_names_each_failure(backend: Backend) {
    let servers = Pki::new("server CA");
    let (tls_app, pem_files) = start_with_tls(backend, &servers, None).await;
    serving_over_tls(&tls_app, &servers, None).await;
    let plain_app = TestApp::spawn(backend).await;
    plain_app.wait_for_status(ServingStatus::Serving).await;
    let faults = TransportFaults::write(pem_files.path(), &servers);
    let (ca, stranger, junk, closed) = (faults.ca, faults.stranger, faults.junk, faults.closed);
    let tls = format!("https://localhost:{}", tls_app.addr.port());
    let tls_as_plain = format!("http://127.0.0.1:{}", tls_app.addr.port());
    let plain = plain_app.endpoint();
    let plain_as_tls = format!("https://localhost:{}", plain_app.addr.port());
    let plain_addr = plain_app.addr.to_string();
    let refused = format!("http://127.0.0.1:{closed}");
    let cases: Vec<(Vec<&str>, i32, String)> =
        vec![
        (vec!["--coordinator", &plain], 0, String::new()),
        // The older form, as the container definitions and the guides write it.
        (vec!["--addr", &plain_addr], 0, String::new()),
        (vec!["--coordinator", &tls, "--coordinator-ca", &ca], 0, String::new()),
        (
            vec!["--coordinator", &refused],
            1,
            format!(
                "unhealthy: cannot reach {refused}: connection refused (nothing listens there: \
                 is the coordinator running, on that port?)"
            ),
        ),
        (
            vec!["--coordinator", "http://no-such-host.invalid:50051"],
            1,
            "unhealthy: cannot reach http://no-such-host.invalid:50051: unknown host: the name \
             does not resolve"
                .into(),
        ),
        (
            vec!["--coordinator", &tls_as_plain],
            1,
            format!(
                "unhealthy: cannot reach {tls_as_plain}: the coordinator did not answer in plain \
                 HTTP/2 (a TLS port? use https:// with --coordinator-ca)"
            ),
        ),
        (
            vec!["--coordinator", &plain_as_tls, "--coordinator-ca", &ca],
            1,
            format!(
                "unhealthy: cannot reach {plain_as_tls}: the coordinator does not speak TLS on \
                 that port: use http://"
            ),
        ),
        (
            vec!["--coordinator", &tls, "--coordinator-ca", &stranger],
            1,
            format!(
                "unhealthy: cannot reach {tls}: the coordinator's certificate is not signed by \
                 the CA of --coordinator-ca: not trusted"
            ),
        ),
        (
            vec!["--coordinator", &tls, "--coordinator-ca", &junk],
            2,
            format!("error: --coordinator-ca: {junk} holds no PEM certificate"),
        ),
        (
            vec!["--coordinator", &tls],
            2,
            "error: --coordinator-ca: an https:// --coordinator needs the CA that signed its \
             certificate"
                .into(),
        ),
        (
            vec!["--coordinator", "127.0.0.1:50051"],
            2,
            "error: --coordinator: \"127.0.0.1:50051\" must be http://host:port or \
             https://host:port"
                .into(),
        ),
    ];
    for (args, status, said) in cases {
        let (code, stderr) = check(&args).await;
        assert_eq!(code, Some(status), "{args:?}: {stderr}");
        assert_eq!(stderr, said, "{args:?}");
    }
    // Both forms at once are refused by the flags' parser, naming both.
    let (code, stderr) = check(&["--coordinator", &plain, "--addr", &plain_addr]).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.starts_with(
            "error: the argument '--coordinator <COORDINATOR>' cannot be used with '--addr <ADDR>'"
        ),
        "{stderr}"
    );
}

async fn healthcheck_shows_a_client_certificate_to_a_coordinator_that_requires_one(
    backend: Backend,
) {
    let servers = Pki::new("server CA");
    let clients = Pki::new("client CA");
    let (app, pem_files) = start_with_tls(backend, &servers, Some(&clients)).await;
    let prober = clients.client("prober");
    serving_over_tls(&app, &servers, Some(&prober)).await;
    let pems = ClientPemFiles::write(pem_files.path(), &servers, "prober", &prober);
    let ca = pems.ca.as_str();
    let tls = format!("https://localhost:{}", app.addr.port());
    let (code, stderr) = check(&[&["--coordinator", &tls][..], &pems.flags()].concat()).await;
    assert_eq!(code, Some(0), "{stderr}");
    // Without it the coordinator closes the connection, and that is named.
    let (code, stderr) = check(&["--coordinator", &tls, "--coordinator-ca", ca]).await;
    assert_eq!(code, Some(1), "{stderr}");
    assert_eq!(
        stderr,
        format!(
            "unhealthy: cannot reach {tls}: the coordinator closed the TLS connection: it \
             requires a client certificate its CA vouches for (--client-cert and --client-key)"
        )
    );
    // A client certificate over plaintext is refused before any connection.
    let plain = format!("http://127.0.0.1:{}", app.addr.port());
    let (code, stderr) =
        check(&[&["--coordinator", &plain][..], &pems.certificate_flags()].concat()).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert_eq!(
        stderr,
        "error: --client-cert: a client certificate is shown over TLS only: --coordinator must \
         be https://"
    );
}

for_each_backend!(
    healthcheck_reaches_plain_and_tls_coordinators_and_names_each_failure,
    healthcheck_shows_a_client_certificate_to_a_coordinator_that_requires_one,
);
