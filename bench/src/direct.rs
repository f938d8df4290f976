//! The baseline the coordinator must beat: what a careful team writes by hand, straight on
//! PostgreSQL, one statement per operation, one connection per caller.
//!
//! - TryStart: `INSERT … ON CONFLICT DO NOTHING RETURNING`, then, on a conflict, a `SELECT` of
//!   the existing row.
//! - Complete: one `UPDATE`.
//! - MarkProcessed: one multi-row `INSERT … ON CONFLICT DO NOTHING RETURNING` per batch.

use std::sync::Arc;

use anyhow::Context;
use idempotency_testkit::load;
use sqlx::{Connection, PgConnection};
use tokio::sync::Mutex;

use crate::cost::{self, CostProbe};
use crate::load::{REPLAY_KEYS, Report, Workload, replay_key};

const SCHEMA: [&str; 2] = [
    "CREATE TABLE IF NOT EXISTS direct_keys (
        namespace text NOT NULL,
        key text NOT NULL,
        fingerprint bytea NOT NULL,
        response bytea,
        completed_at timestamptz,
        expires_at timestamptz NOT NULL,
        PRIMARY KEY (namespace, key))",
    "CREATE TABLE IF NOT EXISTS direct_events (
        consumer text NOT NULL,
        event_id text NOT NULL,
        processed_at timestamptz NOT NULL,
        expires_at timestamptz NOT NULL,
        PRIMARY KEY (consumer, event_id))",
];

const CLAIM: &str = "INSERT INTO direct_keys (namespace, key, fingerprint, expires_at)
    VALUES ($1, $2, $3, now() + interval '24 hours')
    ON CONFLICT (namespace, key) DO NOTHING
    RETURNING key";

const EXISTING: &str = "SELECT fingerprint, response, completed_at FROM direct_keys
    WHERE namespace = $1 AND key = $2";

const COMPLETE: &str = "UPDATE direct_keys SET response = $3, completed_at = now()
    WHERE namespace = $1 AND key = $2 AND completed_at IS NULL
    RETURNING completed_at";

const MARK: &str = "INSERT INTO direct_events (consumer, event_id, processed_at, expires_at)
    SELECT $1, id, now(), now() + interval '7 days' FROM unnest($2::text[]) AS id
    ON CONFLICT (consumer, event_id) DO NOTHING
    RETURNING event_id";

pub async fn prepare(url: &str) -> anyhow::Result<()> {
    let mut connection = PgConnection::connect(url)
        .await
        .context("connecting for the direct baseline")?;
    for statement in SCHEMA {
        sqlx::query(statement).execute(&mut connection).await?;
    }
    Ok(())
}

type ExistingRow = (
    Vec<u8>,
    Option<Vec<u8>>,
    Option<chrono::DateTime<chrono::Utc>>,
);

/// TryStart by hand: claim, or read what is there.
async fn claim(connection: &mut PgConnection, key: &str) -> sqlx::Result<bool> {
    let inserted: Option<(String,)> = sqlx::query_as(CLAIM)
        .bind("bench")
        .bind(key)
        .bind(&b"bench-fingerprint"[..])
        .fetch_optional(&mut *connection)
        .await?;
    if inserted.is_some() {
        return Ok(true);
    }
    // The existing row: what a handler would answer from (in progress, completed, or
    // another request's).
    let _existing: Option<ExistingRow> = sqlx::query_as(EXISTING)
        .bind("bench")
        .bind(key)
        .fetch_optional(&mut *connection)
        .await?;
    Ok(false)
}

/// One measured run of a workload straight against PostgreSQL, without the coordinator: what
/// both baselines take (the hand-written one here, and pgbench's), so that, side by side, they
/// run the same load.
pub struct DirectRun<'a> {
    pub url: &'a str,
    pub workload: Workload,
    pub callers: usize,
    pub duration: std::time::Duration,
    /// With a probe, what the run (not its preparation) cost the database.
    pub probe: Option<&'a CostProbe>,
}

/// Runs `run` with one connection per caller, under keys of a fresh run id.
pub async fn drive(
    &DirectRun {
        url,
        workload,
        callers,
        duration,
        probe,
    }: &DirectRun<'_>,
) -> anyhow::Result<Report> {
    let run = crate::load::run_id();
    let mut connections = Vec::with_capacity(callers);
    for _ in 0..callers {
        connections.push(PgConnection::connect(url).await?);
    }
    let replay_keys: Arc<Vec<String>> = Arc::new(if workload == Workload::Replay {
        let connection = &mut connections[0];
        let mut keys = Vec::with_capacity(REPLAY_KEYS);
        for index in 0..REPLAY_KEYS {
            let key = format!("{run}:replay:{index}");
            claim(connection, &key).await?;
            sqlx::query(COMPLETE)
                .bind("bench")
                .bind(&key)
                .bind(vec![b'r'; 256])
                .execute(&mut *connection)
                .await?;
            keys.push(key);
        }
        keys
    } else {
        Vec::new()
    });
    // Each caller has its own connection; the lock is never contended, it only lends the
    // connection to one call at a time.
    let connections: Arc<Vec<Mutex<PgConnection>>> =
        Arc::new(connections.into_iter().map(Mutex::new).collect());
    let connections_kept = connections.clone();
    let measuring = cost::start(probe).await?;
    let stop = tokio::time::sleep(duration);
    let tally = load::run_until(callers, stop, move |caller, sequence| {
        let connections = connections.clone();
        let run = run.clone();
        let replay_keys = replay_keys.clone();
        async move {
            let mut connection = connections[caller].lock().await;
            let connection = &mut *connection;
            let succeeded = match workload {
                Workload::TryStart => {
                    let key = format!("{run}:{caller}:{sequence}");
                    matches!(claim(connection, &key).await, Ok(true))
                }
                Workload::Lifecycle => {
                    let key = format!("{run}:{caller}:{sequence}");
                    match claim(connection, &key).await {
                        Ok(true) => sqlx::query(COMPLETE)
                            .bind("bench")
                            .bind(&key)
                            .bind(vec![b'r'; 256])
                            .execute(&mut *connection)
                            .await
                            .is_ok(),
                        _ => false,
                    }
                }
                Workload::Replay => {
                    let key = replay_key(&replay_keys, caller, sequence);
                    matches!(claim(connection, key).await, Ok(false))
                }
                Workload::Health => sqlx::query("SELECT 1").execute(connection).await.is_ok(),
                Workload::MarkProcessed1 | Workload::MarkProcessed100 => {
                    let ids: Vec<String> = (0..workload.items_per_op())
                        .map(|item| format!("{run}:{caller}:{sequence}:{item}"))
                        .collect();
                    sqlx::query_as::<_, (String,)>(MARK)
                        .bind("bench")
                        .bind(&ids)
                        .fetch_all(connection)
                        .await
                        .is_ok()
                }
            };
            if succeeded { Ok(()) } else { Err(()) }
        }
    })
    .await?;
    // The connections close first: a backend publishes its last second of statistics only
    // when it exits (or after ten idle seconds), which would otherwise count in the next run.
    // The postmaster reaps them at once, so their CPU is in its children's times by the time
    // `finish` reads it.
    drop(connections_kept);
    let cost = cost::finish(measuring)
        .await?
        .map(cost::Cost::without_service);
    Ok(Report::new(workload, callers, tally, cost))
}
