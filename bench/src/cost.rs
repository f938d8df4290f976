//! What a run cost the database: CPU of every PostgreSQL process, commits of the bench's
//! database, WAL written and synced, statements run (its round trips, from
//! `pg_stat_statements`, which scripts/services preloads), read before and after the run; and
//! what it cost the coordinator: its process's CPU.
//!
//! CPU is read from `/proc`, so it needs PostgreSQL on this machine (the bench's case): the
//! postmaster is the parent of the bench's own backend; its children that exited are in its
//! `cutime`/`cstime` (the postmaster reaps them), the live ones in their own `utime`/`stime`.
//! Elsewhere the CPU column is left empty. WAL and CPU are the whole server's, so anything else
//! running on the same PostgreSQL counts too: compare sides of one run.

use std::time::Duration;

use anyhow::Context;
use sqlx::{Connection, PgConnection};
use tokio::sync::Mutex;

/// Reads the counters on a connection of its own to the bench's database.
pub struct CostProbe {
    connection: Mutex<PgConnection>,
    /// The postmaster, when it runs on this machine.
    postmaster: Option<u32>,
    /// Clock ticks per second of `/proc`'s CPU times.
    ticks_per_second: u64,
    /// The coordinator's process, whose CPU is counted too, when set.
    service: Option<u32>,
    /// Whether `pg_stat_statements` can be read (it is preloaded and its extension exists).
    statements_view: bool,
}

/// The counters at one moment.
#[derive(Debug, Clone, Copy)]
struct Counters {
    cpu_ticks: Option<u64>,
    service_ticks: Option<u64>,
    statements: Option<i64>,
    commits: i64,
    wal_bytes: f64,
    wal_syncs: i64,
}

/// What a run cost, in total.
#[derive(Debug, Clone, Copy)]
pub struct Cost {
    cpu: Option<Duration>,
    service_cpu: Option<Duration>,
    statements: Option<i64>,
    commits: i64,
    wal_bytes: f64,
    wal_syncs: i64,
}

/// Backends publish their statistics within a second of a transaction's end, or when they go
/// idle: the "after" reading waits this long first.
const STATISTICS_SETTLE: Duration = Duration::from_millis(1200);

impl CostProbe {
    pub async fn connect(url: &str) -> anyhow::Result<Self> {
        let mut connection = PgConnection::connect(url)
            .await
            .context("connecting to read the database's counters")?;
        let (backend,): (i32,) = sqlx::query_as("SELECT pg_backend_pid()")
            .fetch_one(&mut connection)
            .await?;
        let postmaster = u32::try_from(backend)
            .ok()
            .and_then(|pid| proc_stat(pid).map(|stat| stat.parent));
        let ticks_per_second = std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|out| String::from_utf8(out.stdout).ok())
            .and_then(|text| text.trim().parse().ok())
            .unwrap_or(100);
        // Top-level statements only (the default): a PL/pgSQL function call is one round trip.
        let statements_view = sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .execute(&mut connection)
            .await
            .is_ok()
            && sqlx::query("SELECT 1 FROM pg_stat_statements LIMIT 1")
                .execute(&mut connection)
                .await
                .is_ok();
        Ok(Self {
            connection: Mutex::new(connection),
            postmaster,
            ticks_per_second,
            service: None,
            statements_view,
        })
    }

    /// Counts the CPU of the coordinator's process `pid` as well (all its threads).
    pub fn with_service(mut self, pid: u32) -> Self {
        self.service = Some(pid);
        self
    }

    /// Starts measuring: call it once the run's preparation is done.
    pub async fn start(&self) -> anyhow::Result<Started<'_>> {
        Ok(Started {
            probe: self,
            before: self.read().await?,
        })
    }

    /// Ends the idle sessions of `application` on the bench's database (the coordinator's pool,
    /// which reconnects on its next call), so that their statistics are published now: a live
    /// backend publishes its commits at most once a second, and an idle one only after ten
    /// seconds, which would leave part of a run's commits to the next run. A session ended
    /// this way publishes at exit, and its CPU moves to the postmaster's reaped children.
    pub async fn end_idle_sessions_of(&self, application: &str) -> anyhow::Result<()> {
        let mut connection = self.connection.lock().await;
        sqlx::query(
            "SELECT count(pg_terminate_backend(pid, 5000)) FROM pg_stat_activity
             WHERE datname = current_database() AND application_name = $1 AND state = 'idle'
               AND pid <> pg_backend_pid()",
        )
        .bind(application)
        .execute(&mut *connection)
        .await
        .context("ending the coordinator's idle sessions")?;
        Ok(())
    }

    async fn read(&self) -> anyhow::Result<Counters> {
        let mut connection = self.connection.lock().await;
        // A new snapshot of the statistics, not the one this transaction saw first.
        sqlx::query("SELECT pg_stat_clear_snapshot()")
            .execute(&mut *connection)
            .await?;
        let (commits, wal_bytes, wal_syncs): (i64, f64, i64) = sqlx::query_as(
            "SELECT (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()),
                    wal_bytes::float8, wal_sync FROM pg_stat_wal",
        )
        .fetch_one(&mut *connection)
        .await
        .context("reading pg_stat_database and pg_stat_wal")?;
        let statements = if self.statements_view {
            // The probe's own readings are a handful per run, against thousands of calls.
            let (calls,): (i64,) = sqlx::query_as(
                "SELECT coalesce(sum(calls), 0)::int8 FROM pg_stat_statements
                 WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())",
            )
            .fetch_one(&mut *connection)
            .await
            .context("reading pg_stat_statements")?;
            Some(calls)
        } else {
            None
        };
        Ok(Counters {
            cpu_ticks: self.postmaster.and_then(server_cpu_ticks),
            service_ticks: self.service.and_then(proc_stat).map(|stat| stat.own_ticks),
            statements,
            commits,
            wal_bytes,
            wal_syncs,
        })
    }
}

/// Starts measuring with `probe`, when there is one (see [`CostProbe::start`]).
pub async fn start(probe: Option<&CostProbe>) -> anyhow::Result<Option<Started<'_>>> {
    match probe {
        Some(probe) => Ok(Some(probe.start().await?)),
        None => Ok(None),
    }
}

/// Ends `measuring`, when it was started (see [`Started::finish`]).
pub async fn finish(measuring: Option<Started<'_>>) -> anyhow::Result<Option<Cost>> {
    match measuring {
        Some(measuring) => Ok(Some(measuring.finish().await?)),
        None => Ok(None),
    }
}

/// A measurement under way.
pub struct Started<'a> {
    probe: &'a CostProbe,
    before: Counters,
}

impl Started<'_> {
    /// Ends the measurement: call it when the run's calls have ended (and, for the direct
    /// side, its connections have closed, so that their backends have published their
    /// statistics; the settling pause gives the postmaster time to reap them).
    pub async fn finish(self) -> anyhow::Result<Cost> {
        tokio::time::sleep(STATISTICS_SETTLE).await;
        let after = self.probe.read().await?;
        let ticks_per_second = self.probe.ticks_per_second as f64;
        let spent = |before: Option<u64>, after: Option<u64>| match (before, after) {
            (Some(before), Some(after)) => Some(Duration::from_secs_f64(
                after.saturating_sub(before) as f64 / ticks_per_second,
            )),
            _ => None,
        };
        Ok(Cost {
            cpu: spent(self.before.cpu_ticks, after.cpu_ticks),
            service_cpu: spent(self.before.service_ticks, after.service_ticks),
            statements: after
                .statements
                .zip(self.before.statements)
                .map(|(after, before)| after - before),
            commits: after.commits - self.before.commits,
            wal_bytes: after.wal_bytes - self.before.wal_bytes,
            wal_syncs: after.wal_syncs - self.before.wal_syncs,
        })
    }
}

impl Cost {
    pub fn header() -> String {
        format!(
            "{:>10} {:>10} {:>10} {:>11} {:>7} {:>11}",
            "db CPU µs", "commits", "WAL B", "WAL syncs", "stmts", "svc CPU µs"
        )
    }

    /// The same cost without the coordinator's CPU: for a run that did not go through it (the
    /// direct and pgbench sides), where its CPU is that of an idle process.
    pub fn without_service(mut self) -> Self {
        self.service_cpu = None;
        self
    }

    /// The cost per operation of a run of `operations`.
    pub fn per_operation(&self, operations: u64) -> String {
        let per = |total: f64| total / operations.max(1) as f64;
        let micros = |cpu: Option<Duration>| {
            cpu.map_or_else(
                || "-".to_owned(),
                |cpu| format!("{:.1}", per(cpu.as_secs_f64() * 1e6)),
            )
        };
        let statements = self.statements.map_or_else(
            || "-".to_owned(),
            |statements| format!("{:.2}", per(statements as f64)),
        );
        format!(
            "{:>10} {:>10.3} {:>10.1} {:>11.4} {:>7} {:>11}",
            micros(self.cpu),
            per(self.commits as f64),
            per(self.wal_bytes),
            per(self.wal_syncs as f64),
            statements,
            micros(self.service_cpu),
        )
    }

    /// The database's CPU in all, when it was measured.
    pub fn cpu(&self) -> Option<Duration> {
        self.cpu
    }

    /// The coordinator's CPU per operation in µs, when it was measured.
    pub fn service_cpu_micros_per_operation(&self, operations: u64) -> Option<f64> {
        self.service_cpu
            .map(|cpu| cpu.as_secs_f64() * 1e6 / operations.max(1) as f64)
    }

    /// CPU per operation in µs, for ratios.
    pub fn cpu_micros_per_operation(&self, operations: u64) -> Option<f64> {
        self.cpu
            .map(|cpu| cpu.as_secs_f64() * 1e6 / operations.max(1) as f64)
    }
}

/// What `/proc/<pid>/stat` tells about a process.
struct ProcStat {
    parent: u32,
    /// utime + stime, in clock ticks.
    own_ticks: u64,
    /// cutime + cstime: the children it has reaped.
    children_ticks: u64,
}

fn proc_stat(pid: u32) -> Option<ProcStat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces: the fields follow the last ')'.
    let fields: Vec<&str> = text.rsplit_once(')')?.1.split_whitespace().collect();
    // After the name: state(3) ppid(4) … utime(14) stime(15) cutime(16) cstime(17).
    let field = |number: usize| fields.get(number - 3)?.parse::<u64>().ok();
    Some(ProcStat {
        parent: u32::try_from(field(4)?).ok()?,
        own_ticks: field(14)? + field(15)?,
        children_ticks: field(16)? + field(17)?,
    })
}

/// The CPU of the postmaster, its live children and its reaped ones, in clock ticks.
fn server_cpu_ticks(postmaster: u32) -> Option<u64> {
    let server = proc_stat(postmaster)?;
    let mut ticks = server.own_ticks + server.children_ticks;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if let Some(child) = proc_stat(pid).filter(|stat| stat.parent == postmaster) {
            ticks += child.own_ticks;
        }
    }
    Some(ticks)
}
