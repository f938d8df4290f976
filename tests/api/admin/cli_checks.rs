//! The CLI's own refusals, through the real binary: every documented range and contradiction
//! of its flags refused before any call (exit 2, in the flags' words), and every way of not
//! reaching a coordinator named (exit 1): nothing listening, a host that does not resolve,
//! `http://` to a TLS port and `https://` to a plain one, a certificate the CA does not vouch
//! for, a CA file that holds no certificate, a client certificate the coordinator requires; and
//! the placement commands on one database, refused by the coordinator, naming why (exit 1).

use super::cli::{admin, admin_with, erase_all};
use super::*;
use crate::support::security::*;

async fn the_cli_refuses_contradicting_and_out_of_range_flags(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let list = ["keys", "list", "--namespace", NAMESPACE];
    let at = "2026-12-04T03:00:00Z";
    let later = "2026-12-04T04:00:00Z";
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            [&list[..], &["--limit", "0"]].concat(),
            "error: invalid value '0' for '--limit <LIMIT>': 0 is not in 1..=1000",
        ),
        (
            [&list[..], &["--limit", "5000"]].concat(),
            "error: invalid value '5000' for '--limit <LIMIT>': 5000 is not in 1..=1000",
        ),
        (
            vec!["audit", "--namespace", NAMESPACE, "--limit", "0"],
            "error: invalid value '0' for '--limit <LIMIT>': 0 is not in 1..=1000",
        ),
        (
            [&erase_all(NAMESPACE, "r")[..], &["--batch-size", "0"]].concat(),
            "error: invalid value '0' for '--batch-size <BATCH_SIZE>': 0 is not in 1..=10000",
        ),
        (
            [&list[..], &["--state", "stuck", "--completed-after", at]].concat(),
            "error: --completed-after selects completed keys, and --state stuck keys in \
             progress: give one",
        ),
        (
            [&list[..], &["--state", "completed", "--claimed-before", at]].concat(),
            "error: --claimed-before selects keys in progress, and --state completed completed \
             keys: give one",
        ),
        (
            [
                &list[..],
                &["--claimed-after", at, "--completed-before", at],
            ]
            .concat(),
            "error: --claimed-after selects keys in progress, and --completed-before completed \
             keys: give one",
        ),
        (
            [
                &list[..],
                &["--completed-after", later, "--completed-before", at],
            ]
            .concat(),
            "error: --completed-after must be earlier than --completed-before: no key is both",
        ),
        (
            [&list[..], &["--claimed-before", "2026-12-04T03:00:00"]].concat(),
            "error: --claimed-before: \"2026-12-04T03:00:00\" is not an RFC 3339 instant: \
             premature end of input (it has no zone: add one, e.g. 2026-12-04T03:00:00Z for \
             UTC)",
        ),
        (
            vec!["keys", "erase", "--namespace", NAMESPACE, "--reason", "r"],
            "error: the following required arguments were not provided:\n  <--key <KEY>|--all>",
        ),
    ];
    for (args, said) in cases {
        let run = admin(&app, &args).await;
        assert_eq!(run.status, Some(2), "{args:?}: {}", run.stderr);
        assert!(run.stderr.starts_with(said), "{args:?}: {}", run.stderr);
        assert!(run.stdout.is_empty(), "{args:?}: {}", run.stdout);
    }
}

async fn the_cli_names_why_it_cannot_reach_the_coordinator(backend: Backend) {
    let servers = Pki::new("server CA");
    let (tls_app, pem_files) = start_with_tls(backend, &servers, None).await;
    let plain_app = TestApp::spawn(backend).await;
    let TransportFaults {
        ca,
        stranger,
        junk,
        closed,
    } = TransportFaults::write(pem_files.path(), &servers);
    let tls_port = tls_app.addr.port();
    let stats = ["stats", "--namespace", NAMESPACE];
    let cases: Vec<(String, Vec<&str>, i32, String)> = vec![
        (
            format!("http://127.0.0.1:{closed}"),
            vec![],
            1,
            format!(
                "error: cannot reach http://127.0.0.1:{closed}: connection refused (nothing \
                 listens there: is the coordinator running, on that port?)"
            ),
        ),
        (
            "http://no-such-host.invalid:50051".into(),
            vec![],
            1,
            "error: cannot reach http://no-such-host.invalid:50051: unknown host: the name does \
             not resolve"
                .into(),
        ),
        (
            format!("http://127.0.0.1:{tls_port}"),
            vec![],
            1,
            format!(
                "error: cannot reach http://127.0.0.1:{tls_port}: the coordinator did not answer \
                 in plain HTTP/2 (a TLS port? use https:// with --coordinator-ca)"
            ),
        ),
        (
            format!("https://localhost:{}", plain_app.addr.port()),
            vec!["--coordinator-ca", &ca],
            1,
            format!(
                "error: cannot reach https://localhost:{}: the coordinator does not speak TLS \
                 on that port: use http://",
                plain_app.addr.port()
            ),
        ),
        (
            format!("https://localhost:{tls_port}"),
            vec!["--coordinator-ca", &stranger],
            1,
            format!(
                "error: cannot reach https://localhost:{tls_port}: the coordinator's \
                 certificate is not signed by the CA of --coordinator-ca: not trusted"
            ),
        ),
        (
            format!("https://localhost:{tls_port}"),
            vec!["--coordinator-ca", &junk],
            2,
            format!("error: --coordinator-ca: {junk} holds no PEM certificate"),
        ),
    ];
    for (endpoint, connection, status, said) in cases {
        let run = admin_with(&endpoint, &connection, &stats).await;
        assert_eq!(run.status, Some(status), "{endpoint}: {}", run.stderr);
        assert_eq!(run.stderr.trim_end(), said, "{endpoint}");
    }
    // And with the right CA, it answers.
    let reached = admin_with(
        &format!("https://localhost:{tls_port}"),
        &["--coordinator-ca", &ca],
        &stats,
    )
    .await;
    assert_eq!(reached.status, Some(0), "{}", reached.stderr);
}

async fn the_cli_names_a_client_certificate_a_coordinator_requires(backend: Backend) {
    let servers = Pki::new("server CA");
    let clients = Pki::new("client CA");
    let (app, pem_files) = start_with_tls(backend, &servers, Some(&clients)).await;
    let ca = pem_files.path().join("ca.pem");
    std::fs::write(&ca, servers.ca_pem()).expect("write the CA");
    let ca = ca.display().to_string();
    let endpoint = format!("https://localhost:{}", app.addr.port());
    let run = admin_with(
        &endpoint,
        &["--coordinator-ca", &ca],
        &["stats", "--namespace", NAMESPACE],
    )
    .await;
    assert_eq!(run.status, Some(1), "{}", run.stderr);
    assert_eq!(
        run.stderr.trim_end(),
        format!(
            "error: cannot reach {endpoint}: the coordinator closed the TLS connection: it \
             requires a client certificate its CA vouches for (--client-cert and --client-key)"
        )
    );
}

async fn placement_on_one_database_is_refused_naming_why(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let show = vec!["placement", "show", "--namespace", NAMESPACE];
    let move_to = vec![
        "placement",
        "move",
        "--namespace",
        NAMESPACE,
        "--to",
        "b",
        "--reason",
        "r",
    ];
    for args in [show, move_to] {
        let run = admin(&app, &args).await;
        assert_eq!(run.status, Some(1), "{args:?}: {}", run.stderr);
        assert!(
            run.stderr.contains("this service runs on one database")
                && run.stderr.contains("--cluster"),
            "{args:?}: {}",
            run.stderr
        );
        assert!(run.stdout.is_empty(), "{args:?}: {}", run.stdout);
    }
}

for_each_backend!(
    placement_on_one_database_is_refused_naming_why,
    the_cli_refuses_contradicting_and_out_of_range_flags,
    the_cli_names_why_it_cannot_reach_the_coordinator,
    the_cli_names_a_client_certificate_a_coordinator_requires,
);
