//! Credentials kept outside the URL: a password file (read again as it changes, so a rotation
//! under load fails no call and needs no restart), libpq's passfile, the whole URL in a file;
//! none of them ever logged.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{says, serves_encrypted, tls_cluster_with_database};
use crate::support::process::ServerProcess;
use crate::support::tls_cluster::Cluster;
use idempotency_testkit::load::Callers;

use crate::support::{eventually, lifecycles, lookup};

const DB: &str = "idempotency";

/// A cluster where `app` (password `pw-first-7f3a`) owns the service's database.
async fn cluster_for_app() -> Cluster {
    tls_cluster_with_database(DB, "app").await
}

/// A cluster for `app` (see [`cluster_for_app`]) and a password file beside it holding
/// `password`: the cluster, the file, and the URL of the service's database without a password.
async fn cluster_and_password_file(password: &str) -> (Cluster, PathBuf, String) {
    let cluster = cluster_for_app().await;
    let password_file = cluster.folder().join("password");
    write_secret(&password_file, password);
    let url = cluster.url("app", "localhost", DB, &verify(&cluster));
    (cluster, password_file, url)
}

/// Writes `text` to `path` as a secret mount or a sidecar does: beside it, then renamed into
/// place, mode 0600.
fn write_secret(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    let aside = path.with_extension("new");
    std::fs::write(&aside, text).expect("write the secret");
    std::fs::set_permissions(&aside, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    std::fs::rename(&aside, path).expect("rename the secret into place");
}

fn verify(cluster: &Cluster) -> String {
    format!(
        "sslmode=verify-full&sslrootcert={}",
        cluster.certificates.ca.display()
    )
}

/// The sessions `app` opened since `since` (the database's clock).
async fn sessions_of_app_since(cluster: &Cluster, since: chrono::DateTime<chrono::Utc>) -> i64 {
    let mut connection = cluster.connect("postgres").await;
    let (count,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM pg_stat_activity WHERE usename = 'app' AND backend_start > $1",
    )
    .bind(since)
    .fetch_one(&mut connection)
    .await
    .expect("pg_stat_activity");
    count
}

/// Under steady load, the password is rotated as a secret manager does it: the new password is
/// written to the file, then the old one stops being accepted. More callers then make the pool
/// open new connections, which log in with the new password: no call fails, no restart.
#[tokio::test]
async fn a_rotated_password_file_is_used_by_new_connections_without_a_failed_call() {
    let (cluster, password_file, url) = cluster_and_password_file("pw-first-7f3a\n").await;
    let file = password_file.display().to_string();
    // Checks every 200 ms (the default is 2 s), so the test waits less for the file to be
    // read again; a rotation is taken up at the next check or the next refusal, whichever is
    // first.
    let server = ServerProcess::start_with_log_level(
        &url,
        &[
            "--database-password-file",
            &file,
            "--health-check-interval",
            "200ms",
        ],
        "debug",
    )
    .await;
    let client = server.client_when_serving().await;
    let steady = lifecycles(&client, 2, "before");
    eventually(Duration::from_secs(10), "calls flow", || async {
        steady.successes_so_far() > 20
    })
    .await;

    write_secret(&password_file, "pw-second-9c1e\n");
    cluster
        .admin("ALTER ROLE app PASSWORD 'pw-second-9c1e'")
        .await;
    let mut connection = cluster.connect("postgres").await;
    let (rotated_at,): (chrono::DateTime<chrono::Utc>,) = sqlx::query_as("SELECT now()")
        .fetch_one(&mut connection)
        .await
        .expect("the clock");
    // Lookups are not coalesced: each takes a connection of its own, so more lookups at once
    // than connections open make the pool open new ones, after the rotation.
    let busier = Callers::start(8, {
        let client = client.clone();
        move |caller, _| {
            let mut client = client.clone();
            async move {
                client
                    .lookup(lookup(&format!("looked-{caller}")))
                    .await
                    .map(drop)
            }
        }
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while sessions_of_app_since(&cluster, rotated_at).await < 4 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no new connections with the new password: {}",
            server.output()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let after = busier.successes_so_far();
    eventually(Duration::from_secs(10), "calls keep flowing", || async {
        busier.successes_so_far() > after + 50
    })
    .await;
    let steady = steady.finish().await.expect("the steady callers");
    let busier = busier.finish().await.expect("the busier callers");
    assert!(
        steady.failures.is_empty() && busier.failures.is_empty(),
        "no call fails across the rotation: {:?} {:?}; the service said:\n{}",
        steady.failures.first(),
        busier.failures.first(),
        server.output()
    );
    says(&server, "the database credentials changed").await;
    let output = server.output();
    assert!(
        !output.contains("pw-first") && !output.contains("pw-second"),
        "no password is logged, even at debug: {output}"
    );
}

/// A password the server refuses is named as such, and a corrected file is taken up without a
/// restart.
#[tokio::test]
async fn a_refused_password_is_named_and_a_corrected_file_serves_without_a_restart() {
    let (cluster, password_file, url) = cluster_and_password_file("wrong").await;
    let file = password_file.display().to_string();
    let server = ServerProcess::start(&url, &["--database-password-file", &file]).await;
    let line = says(&server, "refused the password of user \"app\"").await;
    assert!(
        line.contains(&format!(
            "cannot connect to PostgreSQL at localhost:{}",
            cluster.port
        )),
        "{line}"
    );
    write_secret(&password_file, "pw-first-7f3a");
    serves_encrypted(&server, &cluster, DB).await;
    assert!(!server.output().contains("wrong"), "no password is logged");
}

/// libpq's passfile, named in the URL: the line for this host, port, database and user.
#[tokio::test]
async fn a_passfile_gives_the_password() {
    let cluster = cluster_for_app().await;
    let passfile = cluster.folder().join("pgpass");
    write_secret(
        &passfile,
        &format!(
            "# host:port:database:user:password\nother:1:*:app:nope\nlocalhost:{}:{DB}:app:pw-first-7f3a\n",
            cluster.port
        ),
    );
    let url = cluster.url(
        "app",
        "localhost",
        DB,
        &format!("{}&passfile={}", verify(&cluster), passfile.display()),
    );
    let server = ServerProcess::start(&url, &[]).await;
    serves_encrypted(&server, &cluster, DB).await;
}

/// The whole URL in a file: its password rotates like a password file's.
#[tokio::test]
async fn a_url_file_serves_and_its_new_password_is_taken_up() {
    let cluster = cluster_for_app().await;
    let url_file = cluster.folder().join("database-url");
    let url_with = |password: &str| {
        cluster.url(
            &format!("app:{password}"),
            "localhost",
            DB,
            &verify(&cluster),
        )
    };
    write_secret(&url_file, &url_with("pw-first-7f3a"));
    let file = url_file.display().to_string();
    let mut command = crate::support::process::coordinator().command();
    command
        .args(["serve", "--database-url-file", &file])
        .args(["--health-check-interval", "200ms"])
        .env("RUST_LOG", "info");
    let server = ServerProcess::spawn(command, &[]).await;
    serves_encrypted(&server, &cluster, DB).await;
    write_secret(&url_file, &url_with("pw-second-9c1e"));
    cluster
        .admin("ALTER ROLE app PASSWORD 'pw-second-9c1e'")
        .await;
    says(&server, "the database credentials changed").await;
    // Every session ended: the ones the service opens next must log in with the new password.
    cluster
        .admin("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'app'")
        .await;
    let mut client = server.client_when_serving().await;
    eventually(Duration::from_secs(10), "a call succeeds again", || {
        let mut client = client.clone();
        async move {
            client
                .try_start(crate::support::try_start(&crate::support::unique_key(
                    "again",
                )))
                .await
                .is_ok()
        }
    })
    .await;
    crate::support::claim_and_complete(&mut client, "after-rotation", b"ok").await;
    assert!(!server.output().contains("pw-first") && !server.output().contains("pw-second"));
}
