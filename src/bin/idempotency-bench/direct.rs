//! The baseline the coordinator must beat: what a careful team writes by hand, straight on
//! PostgreSQL, one statement per operation, one connection per caller.
//!
//! - TryStart: `INSERT … ON CONFLICT DO NOTHING RETURNING`, then, on a conflict, a `SELECT` of
//!   the existing row.
//! - Complete: one `UPDATE`.
//! - MarkProcessed: one multi-row `INSERT … ON CONFLICT DO NOTHING RETURNING` per batch.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::Context;
use sqlx::{Connection, PgConnection};

use crate::load::{REPLAY_KEYS, Report, Workload};

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

pub async fn drive(
    url: &str,
    workload: Workload,
    callers: usize,
    duration: std::time::Duration,
    run: &str,
) -> anyhow::Result<Report> {
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
    let stopped = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let tasks: Vec<_> = connections
        .into_iter()
        .enumerate()
        .map(|(caller, mut connection)| {
            let stopped = stopped.clone();
            let run = run.to_owned();
            let replay_keys = replay_keys.clone();
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut errors = 0u64;
                let mut sequence = 0usize;
                while !stopped.load(Ordering::Relaxed) {
                    sequence += 1;
                    let began = Instant::now();
                    let succeeded = match workload {
                        Workload::TryStart => {
                            let key = format!("{run}:{caller}:{sequence}");
                            matches!(claim(&mut connection, &key).await, Ok(true))
                        }
                        Workload::Lifecycle => {
                            let key = format!("{run}:{caller}:{sequence}");
                            match claim(&mut connection, &key).await {
                                Ok(true) => sqlx::query(COMPLETE)
                                    .bind("bench")
                                    .bind(&key)
                                    .bind(vec![b'r'; 256])
                                    .execute(&mut connection)
                                    .await
                                    .is_ok(),
                                _ => false,
                            }
                        }
                        Workload::Replay => {
                            let key = &replay_keys[(caller * 7919 + sequence) % replay_keys.len()];
                            matches!(claim(&mut connection, key).await, Ok(false))
                        }
                        Workload::Health => sqlx::query("SELECT 1")
                            .execute(&mut connection)
                            .await
                            .is_ok(),
                        Workload::MarkProcessed1 | Workload::MarkProcessed100 => {
                            let ids: Vec<String> = (0..workload.items_per_op())
                                .map(|item| format!("{run}:{caller}:{sequence}:{item}"))
                                .collect();
                            sqlx::query_as::<_, (String,)>(MARK)
                                .bind("bench")
                                .bind(&ids)
                                .fetch_all(&mut connection)
                                .await
                                .is_ok()
                        }
                    };
                    if succeeded {
                        latencies
                            .push(u64::try_from(began.elapsed().as_micros()).unwrap_or(u64::MAX));
                    } else {
                        errors += 1;
                    }
                }
                (latencies, errors)
            })
        })
        .collect();
    tokio::time::sleep(duration).await;
    stopped.store(true, Ordering::Relaxed);
    Report::gather(workload, started, tasks).await
}
