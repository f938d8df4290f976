//! docs/operations.md, "Two roles", run as written: the block the guide marks as run here is
//! read from the guide itself and each of its commands run by `bash` in order, with the
//! variables the guide names pointing at a TLS-only cluster of the test's own whose two roles
//! log in with passwords; `serve` is started as the guide writes it (plus a free port and an
//! address file) and must serve, encrypted, as a role that owns nothing.

use std::path::Path;

use super::serves_encrypted;
use crate::support::process::{run_as_written, serve_as_written};
use crate::support::tls_cluster::Cluster;
use crate::support::written::commands_marked;

const MARK: &str = "<!-- run as written by tests/api/reaching_postgres/guide.rs -->";

fn secret(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).expect("a password file");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
}

#[tokio::test]
async fn the_two_roles_of_the_operations_guide_work_as_written() {
    let commands = commands_marked("docs/operations.md", MARK);
    assert_eq!(commands.len(), 3, "psql, migrate, serve: {commands:#?}");
    let cluster = Cluster::tls().await;
    let migrator_password = cluster.folder().join("migrator-password");
    let service_password = cluster.folder().join("service-password");
    secret(&migrator_password, "migrator-pw-4c1d\n");
    secret(&service_password, "service-pw-9e2b\n");
    let ca = cluster.certificates.ca.display().to_string();
    let environment = [
        (
            "ADMIN_URL",
            format!(
                "postgres://postgres@localhost:{}/postgres?sslmode=verify-full&sslrootcert={ca}",
                cluster.port
            ),
        ),
        ("DB_HOST", "localhost".to_owned()),
        ("DB_PORT", cluster.port.to_string()),
        ("DB_CA_FILE", ca.clone()),
        (
            "MIGRATOR_PASSWORD_FILE",
            migrator_password.display().to_string(),
        ),
        (
            "SERVICE_PASSWORD_FILE",
            service_password.display().to_string(),
        ),
    ];
    let (serve, setup) = commands.split_last().expect("commands");
    run_as_written(setup, &environment).await;
    let server = serve_as_written(serve, &environment).await;
    serves_encrypted(&server, &cluster, "idempotency").await;
    let mut connection = cluster.connect("idempotency").await;
    let (owned,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM pg_class c JOIN pg_roles r ON r.oid = c.relowner \
         WHERE r.rolname = 'idempotency_service'",
    )
    .fetch_one(&mut connection)
    .await
    .expect("the catalogue");
    assert_eq!(owned, 0, "the serving role owns nothing");
    let output = server.output();
    assert!(
        !output.contains("service-pw") && !output.contains("lacks rights"),
        "{output}"
    );
}
