//! The same operations as `direct`, driven by PostgreSQL's own load generator, `pgbench`: a
//! client written in C that costs far less CPU per statement than any driver, so it is the
//! hardest baseline for the coordinator on a machine where the load, the database and the
//! coordinator share the cores.
//!
//! Each workload is one pgbench script (one "transaction" of pgbench per operation), with
//! prepared statements, against the `direct` tables. TryStart is one statement that claims or
//! reads what is there (`INSERT … ON CONFLICT DO NOTHING` in a CTE, and the existing row when
//! it inserted nothing), as a careful team would write it to spare a round trip.

use std::fmt::Write as _;
use std::process::Stdio;

use anyhow::{Context, bail};
use sqlx::{Connection, PgConnection};

use crate::cost::{self, Cost};
use crate::direct::DirectRun;
use crate::load::{REPLAY_KEYS, Workload};

/// What one pgbench run measured. pgbench reports no latency distribution, only its mean.
pub struct PgbenchReport {
    workload: Workload,
    callers: usize,
    operations: u64,
    per_second: f64,
    mean_latency_ms: f64,
    failures: u64,
    cost: Option<Cost>,
}

impl PgbenchReport {
    pub fn ops_per_second(&self) -> f64 {
        self.per_second
    }

    pub fn mean_latency_ms(&self) -> f64 {
        self.mean_latency_ms
    }

    pub fn database_cpu_micros(&self) -> Option<f64> {
        self.cost?.cpu_micros_per_operation(self.operations)
    }

    /// A row of the bench's table: the p50 column holds pgbench's mean, p99 columns are empty.
    pub fn row(&self) -> String {
        format!(
            "{:<19} {:<20} {:>7} {:>10.0} {:>11.0} {:>9} {:>9} {:>9} {:>7}",
            self.workload.name(),
            "pgbench (mean ms)",
            self.callers,
            self.per_second,
            self.per_second * self.workload.items_per_op() as f64,
            format!("{:.2}", self.mean_latency_ms),
            "",
            "",
            self.failures,
        ) + &self.cost.map_or_else(String::new, |cost| {
            format!(" {}", cost.per_operation(self.operations))
        })
    }
}

/// The script of `workload` for keys of namespace `namespace`, or None when pgbench has no
/// counterpart for it.
fn script(workload: Workload, namespace: &str) -> Option<String> {
    // Claims `:key`, or reads what is there: one statement, one round trip.
    let claim_or_read = |key: &str| {
        format!(
            "WITH claimed AS (\n\
             INSERT INTO direct_keys (namespace, key, fingerprint, expires_at)\n\
             VALUES ('{namespace}', {key}, '\\x62656e6368', now() + interval '24 hours')\n\
             ON CONFLICT (namespace, key) DO NOTHING RETURNING key)\n\
             SELECT key, NULL::bytea AS response, NULL::timestamptz AS completed_at FROM claimed\n\
             UNION ALL\n\
             SELECT NULL, response, completed_at FROM direct_keys\n\
             WHERE namespace = '{namespace}' AND key = {key}\n\
             AND NOT EXISTS (SELECT 1 FROM claimed);\n"
        )
    };
    let fresh_key = "\\set key random(1, 1000000000000000)\n";
    let mut text = String::new();
    match workload {
        Workload::TryStart => {
            text.push_str(fresh_key);
            text.push_str(&claim_or_read(":key::text"));
        }
        Workload::Lifecycle => {
            text.push_str(fresh_key);
            text.push_str(&claim_or_read(":key::text"));
            let _ = writeln!(
                text,
                "UPDATE direct_keys SET response = decode(repeat('72', 256), 'hex'), \
                 completed_at = now() WHERE namespace = '{namespace}' AND key = :key::text \
                 AND completed_at IS NULL RETURNING completed_at;"
            );
        }
        Workload::Replay => {
            let _ = writeln!(text, "\\set index random(0, {})", REPLAY_KEYS - 1);
            text.push_str(&claim_or_read("'replay-' || :index"));
        }
        Workload::MarkProcessed1 => {
            text.push_str(fresh_key);
            let _ = writeln!(
                text,
                "INSERT INTO direct_events (consumer, event_id, processed_at, expires_at) \
                 VALUES ('{namespace}', :key::text, now(), now() + interval '7 days') \
                 ON CONFLICT (consumer, event_id) DO NOTHING RETURNING event_id;"
            );
        }
        Workload::Health => text.push_str("SELECT 1;\n"),
        Workload::MarkProcessed100 => return None,
    }
    Some(text)
}

/// Runs `run` with as many pgbench clients as it has callers, under a fresh run id, or answers
/// None when pgbench has no script for its workload.
pub async fn drive(pgbench: &str, run: &DirectRun<'_>) -> anyhow::Result<Option<PgbenchReport>> {
    let run_id = crate::load::run_id();
    let namespace = format!("pgbench-{run_id}");
    let Some(text) = script(run.workload, &namespace) else {
        return Ok(None);
    };
    if run.workload == Workload::Replay {
        let mut connection = PgConnection::connect(run.url).await?;
        sqlx::query(
            "INSERT INTO direct_keys (namespace, key, fingerprint, response, completed_at, expires_at)
             SELECT $1, 'replay-' || n, '\\x62656e6368', decode(repeat('72', 256), 'hex'), now(),
                    now() + interval '24 hours'
             FROM generate_series(0, $2 - 1) AS n",
        )
        .bind(&namespace)
        .bind(i64::try_from(REPLAY_KEYS)?)
        .execute(&mut connection)
        .await
        .context("preparing pgbench's replay keys")?;
    }
    let script_path = std::env::temp_dir().join(format!("idempotency-bench-{run_id}.pgbench.sql"));
    std::fs::write(&script_path, text).context("writing the pgbench script")?;
    let measuring = cost::start(run.probe).await?;
    let output = tokio::process::Command::new(pgbench)
        .args(["--no-vacuum", "--protocol=prepared"])
        .arg(format!("--client={}", run.callers))
        .arg(format!("--jobs={}", run.callers.min(2)))
        .arg(format!("--time={}", run.duration.as_secs().max(1)))
        .arg(format!("--file={}", script_path.display()))
        .arg(run.url)
        .stdin(Stdio::null())
        .output()
        .await
        .with_context(|| format!("running {pgbench}"))?;
    // pgbench's clients have disconnected once it exits: their statistics are published.
    let cost = cost::finish(measuring)
        .await?
        .map(cost::Cost::without_service);
    let _ = std::fs::remove_file(&script_path);
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!(
            "pgbench failed ({}): {}{}",
            output.status,
            stdout,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let number_after = |prefix: &str| -> anyhow::Result<f64> {
        stdout
            .lines()
            .find_map(|line| line.trim().strip_prefix(prefix))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|number| number.parse().ok())
            .with_context(|| format!("pgbench printed no \"{prefix}\": {stdout}"))
    };
    let operations = number_after("number of transactions actually processed:")?;
    let failures = number_after("number of failed transactions:").unwrap_or(0.0);
    Ok(Some(PgbenchReport {
        workload: run.workload,
        callers: run.callers,
        operations: operations as u64,
        per_second: number_after("tps =")?,
        mean_latency_ms: number_after("latency average =")?,
        failures: failures as u64,
        cost,
    }))
}
