//! The PostgreSQL store behind a real PgBouncer (Debian's, 1.18) in transaction mode, set up as
//! users do (`ignore_startup_parameters = extra_float_digits`): with `--pooler transaction` every
//! RPC works through it, and a waiting TryStart is woken through the direct `--notify-database-url`;
//! without it, the service reports why it cannot serve (PgBouncer refuses the startup options)
//! rather than only a pool timeout; migrating through the pooler is refused with directions.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use idempotency_coordinator::proto::idempotency::v1::lookup_response::State;
use tokio::process::{Child, Command};
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;

use crate::support::process::{ServerProcess, assert_refused_saying, coordinator};
use crate::support::*;

/// Debian's PgBouncer binary, which `scripts/services` installs (no test installs anything).
fn pgbouncer_binary() -> PathBuf {
    let installed = PathBuf::from("/usr/sbin/pgbouncer");
    assert!(
        installed.exists(),
        "/usr/sbin/pgbouncer is missing: run scripts/services (as root) to install Debian's pgbouncer"
    );
    installed
}

/// A PgBouncer in transaction mode on a free port, in front of the test PostgreSQL.
pub(crate) struct PgBouncer {
    port: u16,
    _child: Child,
    _dir: tempfile::TempDir,
}

impl PgBouncer {
    pub(crate) async fn start() -> Self {
        let binary = pgbouncer_binary();
        let dir = tempfile::tempdir().expect("a folder for pgbouncer");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let users = dir.path().join("users.txt");
        std::fs::write(&users, "\"postgres\" \"\"\n").expect("users file");
        let config = dir.path().join("pgbouncer.ini");
        std::fs::write(
            &config,
            format!(
                "[databases]\n* = host=127.0.0.1 port=5432\n\
                 [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\n\
                 unix_socket_dir =\nauth_type = trust\nauth_file = {}\n\
                 pool_mode = transaction\ndefault_pool_size = 4\n\
                 ignore_startup_parameters = extra_float_digits\n",
                users.display()
            ),
        )
        .expect("pgbouncer.ini");
        readable_by_all(dir.path());
        let mut command = Command::new(binary);
        // PgBouncer refuses to run as root; as root, it is told to become `postgres`.
        if running_as_root().await {
            command.args(["-u", "postgres"]);
        }
        let child = command
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start pgbouncer");
        let deadline = Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            assert!(Instant::now() < deadline, "pgbouncer did not listen");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Self {
            port,
            _child: child,
            _dir: dir,
        }
    }

    /// `direct` (a URL of the test PostgreSQL) through this PgBouncer.
    pub(crate) fn url(&self, direct: &str) -> String {
        direct.replacen("127.0.0.1:5432", &format!("127.0.0.1:{}", self.port), 1)
    }
}

fn readable_by_all(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755));
    for entry in std::fs::read_dir(dir).expect("read the folder").flatten() {
        let _ = std::fs::set_permissions(entry.path(), std::fs::Permissions::from_mode(0o644));
    }
}

async fn running_as_root() -> bool {
    let output = Command::new("id").arg("-u").output().await.expect("id -u");
    String::from_utf8_lossy(&output.stdout).trim() == "0"
}

/// Migrates `url` (PostgreSQL directly, as the documentation says) with the real binary's
/// `migrate` subcommand, which must succeed.
pub(crate) async fn migrate_directly(url: &str) {
    let migrated = migrate(url, &[]).await;
    assert!(migrated.status.success(), "migrate: {migrated:?}");
}

/// A service on a fresh database behind `bouncer` in transaction mode, as the documentation
/// says: migrated against PostgreSQL directly, notified directly, with `flags` besides;
/// serving. With how to start another replica of it.
pub(crate) async fn serve_behind(bouncer: &PgBouncer, flags: &[&str]) -> (TestApp, Replica) {
    let database = TestDatabase::create(Backend::Postgres).await;
    let direct = database.url.clone();
    migrate_directly(&direct).await;
    // As docs/operations.md says, the pooler's server connections told (this PgBouncer's
    // default_pool_size).
    let documented = [
        "--pooler",
        "transaction",
        "--pooler-server-connections",
        "4",
        "--no-migrate",
        "--notify-database-url",
        direct.as_str(),
    ];
    let replica = Replica {
        pooled_url: bouncer.url(&direct),
        flags: documented
            .iter()
            .chain(flags)
            .map(|f| f.to_string())
            .collect(),
    };
    let app = TestApp::start_on(database, Some(&replica.pooled_url), &replica.flags()).await;
    app.wait_for_status(ServingStatus::Serving).await;
    (app, replica)
}

/// How a service behind PgBouncer was started: its URL through the pooler and its flags.
pub(crate) struct Replica {
    pooled_url: String,
    flags: Vec<String>,
}

impl Replica {
    fn flags(&self) -> Vec<&str> {
        self.flags.iter().map(String::as_str).collect()
    }

    /// Another replica on the same database, with the same flags.
    async fn start(&self) -> ServerProcess {
        ServerProcess::start(&self.pooled_url, &self.flags()).await
    }
}

/// Migrates `url` with the real binary's `migrate` subcommand, as an operator would.
async fn migrate(url: &str, flags: &[&str]) -> std::process::Output {
    coordinator()
        .command()
        .args(["migrate", "--database-url", url])
        .args(flags)
        .output()
        .await
        .expect("run migrate")
}

#[tokio::test]
async fn every_rpc_works_through_pgbouncer_in_transaction_mode() {
    let bouncer = PgBouncer::start().await;
    // Only a notification can wake the waiter below in time.
    let (app, replica) = serve_behind(&bouncer, &["--waiter-recheck-interval", "10m"]).await;
    let mut client = app.client().await;

    // TryStart, ExtendLease with a checkpoint, Lookup, Complete, replay.
    let key = unique_key("pgbouncer");
    let held = claim(&mut client, try_start(&key)).await;
    assert_eq!(held.attempt, 1);
    let mut extension = extend(&key, held.lease_token);
    extension.checkpoint = Some(b"step-2".to_vec());
    client.extend_lease(extension).await.expect("ExtendLease");
    match key_state(&client, &key).await {
        State::InProgress(progress) => assert_eq!(progress.attempt, 1),
        other => panic!("expected in progress, got {other:?}"),
    }
    complete_key(&client, &key, held.lease_token, b"done").await;
    expect_replay(&client, &key, b"done").await;
    let wrong = client
        .complete(complete(&key, held.lease_token + 1000, b"other"))
        .await
        .expect_err("a wrong token is refused");
    assert_eq!(wrong.code(), Code::Aborted);

    // Release makes the key absent again.
    let released = unique_key("pgbouncer-release");
    let claim_of_released = claim(&mut client, try_start(&released)).await;
    client
        .release(release(&released, claim_of_released.lease_token))
        .await
        .expect("Release");
    assert!(matches!(
        key_state(&client, &released).await,
        State::Absent(_)
    ));

    // MarkProcessed: a repeated id is already processed.
    let marked = client
        .mark_processed(mark("billing", &["evt-1", "evt-2", "evt-1"]))
        .await
        .expect("MarkProcessed")
        .into_inner();
    let already: Vec<bool> = marked.results.iter().map(|r| r.already_processed).collect();
    assert_eq!(already, [false, false, true]);

    // A waiting TryStart is woken by another replica's Complete, which reaches it only as a
    // notification on the direct URL (the recheck interval is 10 minutes).
    let other = replica.start().await;
    let mut other_client = other.client_when_serving().await;
    let waited = unique_key("pgbouncer-wait");
    let holder = claim(&mut other_client, try_start(&waited)).await;
    let mut waiter_client = client.clone();
    let mut request = try_start(&waited);
    request.wait = Some(duration(Duration::from_secs(30)));
    let waiter = tokio::spawn(async move { waiter_client.try_start(request).await });
    app.wait_for_waiters(1).await;
    let started = Instant::now();
    other_client
        .complete(complete(&waited, holder.lease_token, b"woken"))
        .await
        .expect("Complete on the other replica");
    let answer = waiter.await.expect("the waiter");
    let woken = expect_completed(answer.expect("TryStart").into_inner());
    assert_eq!(woken.response, b"woken");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "woken by the notification, not by the end of the wait"
    );

    // An erasure through the pooler is honoured by the other replica before it answers: its
    // request to the replicas goes through the pooler, their heartbeats and acknowledgements
    // on the direct URL, and every replica acknowledges (well within the bound).
    expect_replay(&other_client, &waited, b"woken").await;
    let admin = crate::admin::admin_client(&app).await;
    let erasing = Instant::now();
    crate::admin::erased(&admin, &waited, "data protection").await;
    let erased_in = erasing.elapsed();
    let again = try_start(&waited).with_fingerprint(b"another request");
    expect_started(try_start_response(&other_client, again).await);
    assert!(
        erased_in < idempotency_coordinator::service::erasures::CONFIRMED_FOR,
        "the erasure took {erased_in:?}: the replicas' acknowledgements were not heard"
    );
}

#[tokio::test]
async fn without_the_pooler_mode_the_refusal_is_reported_with_its_cause() {
    let bouncer = PgBouncer::start().await;
    let database = TestDatabase::create(Backend::Postgres).await;
    let migrated = migrate(&database.url, &[]).await;
    assert!(migrated.status.success(), "migrate: {migrated:?}");
    let server = ServerProcess::start(&bouncer.url(&database.url), &["--no-migrate"]).await;
    eventually(
        Duration::from_secs(20),
        "the log names PgBouncer's refusal",
        || async { server.output_contains("unsupported startup parameter: options") },
    )
    .await;
    assert!(
        server.output_contains("store not ready"),
        "{}",
        server.output()
    );
    let health = health_client(server.endpoint())
        .await
        .expect("health client");
    assert!(!is_serving(&health).await, "not serving through the pooler");
}

#[tokio::test]
async fn migrating_through_the_pooler_is_refused_with_directions() {
    let database = TestDatabase::create(Backend::Postgres).await;
    let refused = migrate(&database.url, &["--pooler", "transaction"]).await;
    assert_refused_saying(
        &refused,
        &["--database-url pointing at PostgreSQL directly"],
        "migrate says where to point it",
    );
    // Nor may `serve` migrate through it.
    let app_refused = coordinator()
        .command()
        .args([
            "serve",
            "--database-url",
            &database.url,
            "--pooler",
            "transaction",
        ])
        .args([
            "--notify-database-url",
            &database.url,
            "--listen",
            "127.0.0.1:0",
        ])
        .output()
        .await
        .expect("run serve");
    assert_refused_saying(
        &app_refused,
        &["serve with --no-migrate"],
        "serve says to serve without migrating",
    );
}

#[tokio::test]
async fn a_refused_connection_is_reported_as_such_not_as_a_pool_timeout() {
    // A port nobody listens on: the pool retries refused connections until its wait runs out.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let url = format!("postgres://postgres@127.0.0.1:{port}/nowhere");
    let server = ServerProcess::start(&url, &["--no-migrate"]).await;
    eventually(
        Duration::from_secs(20),
        "the log says why the store is not ready",
        || async { server.output_contains("store not ready") },
    )
    .await;
    let output = server.output();
    let reported = output
        .lines()
        .find(|line| line.contains("store not ready"))
        .expect("the line");
    assert!(
        reported.contains(&format!(
            "cannot connect to PostgreSQL at 127.0.0.1:{port}: connection refused"
        )),
        "{reported}"
    );
    assert!(!reported.contains("pool timed out"), "{reported}");
}
