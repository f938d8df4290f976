//! A replicated PostgreSQL of the tests' own: a primary made by `initdb` and a real streaming
//! standby made from it by `pg_basebackup`, each its own cluster on a free loopback port, run
//! by Debian's PostgreSQL 15 binaries (which `scripts/services` installs). Tests promote,
//! stop and demote them as a failover would; both are stopped when the pair is dropped.
//!
//! PostgreSQL refuses to run as root: as root, every command runs as `postgres`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::process::Command;

use super::eventually;

const BIN: &str = "/usr/lib/postgresql/15/bin";

/// One cluster: its folder and port.
#[derive(Debug, Clone)]
pub struct Node {
    pub name: &'static str,
    pub port: u16,
    data: PathBuf,
    log: PathBuf,
    socket_dir: PathBuf,
}

/// A primary and its standby. `nodes[0]` starts as the primary, `nodes[1]` as its standby.
pub struct ReplicatedPair {
    pub nodes: [Node; 2],
    _dir: tempfile::TempDir,
}

/// How commits wait for the standby.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replication {
    /// `synchronous_standby_names = '*'`: a commit is acknowledged once the standby has it.
    Synchronous,
    /// Commits do not wait for the standby.
    Asynchronous,
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port()
}

fn is_root() -> bool {
    std::env::var("USER").is_ok_and(|user| user == "root")
        || std::fs::metadata("/proc/self").is_ok_and(|m| {
            use std::os::unix::fs::MetadataExt;
            m.uid() == 0
        })
}

/// PostgreSQL's `program`, to run as `postgres` when this process is root.
fn as_postgres(program: &str) -> Command {
    let path = format!("{BIN}/{program}");
    if is_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--", &path]);
        command
    } else {
        Command::new(&path)
    }
}

/// `program` with `args`, as `postgres` when this process is root; it must succeed.
pub(super) async fn run(program: &str, args: &[&str]) -> String {
    run_or_tell(program, args, String::new).await
}

/// [`run`], whose failure also tells `more()` (the server's own log, say).
async fn run_or_tell(program: &str, args: &[&str], more: impl FnOnce() -> String) -> String {
    let output = as_postgres(program)
        .args(args)
        .output()
        .await
        .unwrap_or_else(|error| panic!("run {program}: {error} (is postgresql-15 installed?)"));
    assert!(
        output.status.success(),
        "{program} {args:?} failed: {}{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
        more()
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Gives `path` to `postgres` when this process is root (PostgreSQL wants its folder its own).
pub(super) async fn own(path: &Path) {
    if is_root() {
        let status = Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(path)
            .status()
            .await
            .expect("chown");
        assert!(status.success(), "chown {path:?}");
    }
}

impl Node {
    /// A node named `name` in `dir` (owned by `postgres`), on a free port, not made yet.
    pub(super) fn in_dir(dir: &Path, name: &'static str) -> Self {
        Self {
            name,
            port: free_port(),
            data: dir.join(name),
            log: dir.join(format!("{name}.log")),
            socket_dir: dir.to_path_buf(),
        }
    }

    /// Makes the node's cluster (`initdb`), set up for tests and with `settings` added.
    pub(super) async fn init(&self, settings: &str) {
        let data = self.data.to_string_lossy().into_owned();
        run(
            "initdb",
            &["-D", &data, "-U", "postgres", "-A", "trust", "--no-sync"],
        )
        .await;
        self.append_conf(&format!(
            "\nport = {}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\n\
             fsync = off\nfull_page_writes = off\nmax_connections = 60\n\
             shared_buffers = 16MB\n{settings}",
            self.port,
            self.socket_dir.display()
        ));
    }

    /// Stops every process of the node where it stands (SIGSTOP): a stalled server, whose
    /// connections stay open and answer nothing, as a machine frozen or cut off would.
    pub async fn pause(&self) {
        self.signal_all("STOP").await;
    }

    /// Lets a paused node run again (SIGCONT).
    pub async fn resume(&self) {
        self.signal_all("CONT").await;
    }

    /// Sends `signal` to the postmaster and to every process it started.
    async fn signal_all(&self, signal: &str) {
        let pid_file = std::fs::read_to_string(self.data.join("postmaster.pid"))
            .expect("postmaster.pid of a running node");
        let postmaster = pid_file
            .lines()
            .next()
            .expect("the postmaster's pid")
            .trim();
        let children = Command::new("pgrep")
            .args(["-P", postmaster])
            .output()
            .await
            .expect("pgrep");
        let children = String::from_utf8_lossy(&children.stdout).into_owned();
        let pids: Vec<&str> = std::iter::once(postmaster)
            .chain(children.split_whitespace())
            .collect();
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .args(&pids)
            .status()
            .await
            .expect("kill");
        assert!(status.success(), "kill -{signal} {pids:?}");
    }

    /// `postgres://postgres@127.0.0.1:port/database`.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn append_conf(&self, lines: &str) {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(self.data.join("postgresql.conf"))
            .expect("postgresql.conf");
        file.write_all(lines.as_bytes())
            .expect("append to postgresql.conf");
    }

    pub async fn start(&self) {
        start_cluster(&self.data, &self.log).await;
    }

    /// Stops at once, as a crash would (`immediate`): no shutdown checkpoint.
    pub async fn kill(&self) {
        let data = self.data.to_string_lossy().into_owned();
        run("pg_ctl", &["-D", &data, "-m", "immediate", "-w", "stop"]).await;
    }

    /// Stops cleanly (`fast`): everything it wrote has reached a streaming standby.
    pub async fn stop(&self) {
        let data = self.data.to_string_lossy().into_owned();
        run("pg_ctl", &["-D", &data, "-m", "fast", "-w", "stop"]).await;
    }

    /// Promotes this standby to primary, waiting until it accepts writes.
    pub async fn promote(&self) {
        let data = self.data.to_string_lossy().into_owned();
        run("pg_ctl", &["-D", &data, "-w", "-t", "60", "promote"]).await;
    }

    /// Makes this stopped node a standby of `primary` (as a switchover demotes the old
    /// primary), and starts it.
    pub async fn rejoin_as_standby_of(&self, primary: &Node) {
        self.append_conf(&format!(
            "\nprimary_conninfo = 'host=127.0.0.1 port={} user=postgres application_name={}'\n",
            primary.port, self.name
        ));
        std::fs::write(self.data.join("standby.signal"), "").expect("standby.signal");
        own(&self.data).await;
        self.start().await;
    }

    /// A connection to `database` on this node.
    pub async fn connect(&self, database: &str) -> sqlx::PgConnection {
        use sqlx::Connection;
        sqlx::PgConnection::connect(&self.url(database))
            .await
            .unwrap_or_else(|error| panic!("connect to {}: {error}", self.name))
    }

    /// Whether this node is in recovery (a standby).
    pub async fn in_recovery(&self) -> bool {
        let mut connection = self.connect("postgres").await;
        let (in_recovery,): (bool,) = sqlx::query_as("SELECT pg_is_in_recovery()")
            .fetch_one(&mut connection)
            .await
            .expect("pg_is_in_recovery()");
        in_recovery
    }

    /// How many standbys stream from this node.
    pub async fn streaming_standbys(&self) -> i64 {
        let mut connection = self.connect("postgres").await;
        let (count,): (i64,) =
            sqlx::query_as("SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'")
                .fetch_one(&mut connection)
                .await
                .expect("pg_stat_replication");
        count
    }
}

impl ReplicatedPair {
    /// A primary and a standby streaming from it, both running.
    pub async fn start(replication: Replication) -> Self {
        let dir = tempfile::tempdir().expect("a folder for the clusters");
        let node = |name: &'static str| Node::in_dir(dir.path(), name);
        let nodes = [node("node_a"), node("node_b")];
        own(dir.path()).await;
        let [primary, standby] = &nodes;
        let synchronous = match replication {
            Replication::Synchronous => "'*'",
            Replication::Asynchronous => "''",
        };
        primary
            .init(&format!(
                "synchronous_standby_names = {synchronous}\n\
                 wal_keep_size = 64MB\nwal_receiver_status_interval = 1s\n"
            ))
            .await;
        primary.start().await;
        let standby_data = standby.data.to_string_lossy().into_owned();
        let port = primary.port.to_string();
        run(
            "pg_basebackup",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-U",
                "postgres",
                "-D",
                &standby_data,
                "-R",
                "-X",
                "stream",
                "--no-sync",
            ],
        )
        .await;
        // The copy of the primary's settings is the standby's, less the wait for a standby of
        // its own: promoted, it has none until the old primary rejoins.
        standby.append_conf(&format!(
            "\nport = {}\nsynchronous_standby_names = ''\n",
            standby.port
        ));
        standby.start().await;
        let pair = Self { nodes, _dir: dir };
        pair.wait_until_streaming(0).await;
        pair
    }

    /// Waits until `nodes[primary]` has a standby streaming from it.
    pub async fn wait_until_streaming(&self, primary: usize) {
        let node = self.nodes[primary].clone();
        eventually(Duration::from_secs(30), "the standby streams", || {
            let node = node.clone();
            async move { node.streaming_standbys().await > 0 }
        })
        .await;
    }

    /// A multi-host URL naming `order`'s nodes in that order.
    pub fn url(&self, order: [usize; 2], database: &str, attrs: &str) -> String {
        format!(
            "postgres://postgres@{},{}/{database}?target_session_attrs={attrs}",
            self.nodes[order[0]].host(),
            self.nodes[order[1]].host()
        )
    }
}

impl Drop for ReplicatedPair {
    fn drop(&mut self) {
        for node in &self.nodes {
            stop_at_once(&node.data);
        }
    }
}

/// Starts the cluster in `data`, logging to `log`, and waits until it accepts connections.
pub(super) async fn start_cluster(data: &Path, log: &Path) {
    let data = data.to_string_lossy().into_owned();
    let log_path = log.to_string_lossy().into_owned();
    // The server's own log says why it did not start (a port taken meanwhile, say).
    run_or_tell(
        "pg_ctl",
        &["-D", &data, "-l", &log_path, "-w", "-t", "60", "start"],
        || {
            format!(
                "\n{log_path}:\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            )
        },
    )
    .await;
}

/// Stops the cluster in `data` as a crash would, without waiting, ignoring failures: for
/// `Drop`, where nothing can be awaited or reported.
pub(super) fn stop_at_once(data: &Path) {
    let data = data.to_string_lossy().into_owned();
    let path = format!("{BIN}/pg_ctl");
    let mut command = if is_root() {
        let mut command = std::process::Command::new("runuser");
        command.args(["-u", "postgres", "--", &path]);
        command
    } else {
        std::process::Command::new(&path)
    };
    let _ = command
        .args(["-D", &data, "-m", "immediate", "stop"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status();
}

/// Independent clusters (no replication between them), one per name, each on its own port:
/// the PostgreSQL clusters a deployment places namespaces on. Stopped when dropped.
pub struct Clusters {
    pub nodes: Vec<Node>,
    _dir: tempfile::TempDir,
}

impl Clusters {
    /// One running cluster for each of `names`.
    pub async fn start(names: &[&'static str]) -> Self {
        let dir = tempfile::tempdir().expect("a folder for the clusters");
        own(dir.path()).await;
        let nodes: Vec<Node> = names
            .iter()
            .map(|name| Node::in_dir(dir.path(), name))
            .collect();
        futures::future::join_all(nodes.iter().map(|node| async move {
            node.init("").await;
            node.start().await;
        }))
        .await;
        Self { nodes, _dir: dir }
    }

    /// The service's flags for these clusters, each serving `database`: `--cluster NAME=URL`.
    pub fn flags(&self, database: &str) -> Vec<String> {
        self.nodes
            .iter()
            .flat_map(|node| {
                [
                    "--cluster".to_owned(),
                    format!("{}={}", node.name, node.url(database)),
                ]
            })
            .collect()
    }
}

impl Drop for Clusters {
    fn drop(&mut self) {
        for node in &self.nodes {
            // A paused node ignores the stop until it runs again.
            if let Some(postmaster) = std::fs::read_to_string(node.data.join("postmaster.pid"))
                .ok()
                .and_then(|pid_file| pid_file.lines().next().map(str::to_owned))
            {
                let _ = std::process::Command::new("pkill")
                    .args(["-CONT", "-P", postmaster.trim()])
                    .status();
                let _ = std::process::Command::new("kill")
                    .args(["-CONT", postmaster.trim()])
                    .status();
            }
            stop_at_once(&node.data);
        }
    }
}
