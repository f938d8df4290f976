//! The admin API on a table of a million keys (PostgreSQL, the store for large deployments):
//! every listing (with its claim-time filter) and the stuck-keys gauges read an index, never
//! the table (EXPLAIN, under the service's own session settings), and the first page of one
//! namespace's stuck keys, and of its keys held for over an hour, comes back through the RPC in
//! under 50 ms. An erasure of a large namespace goes through it once, each batch starting after
//! the last key the one before it erased, so that no batch reads what the batches before it
//! deleted, and erases all of it while calls keep being answered.

use std::time::{Duration, Instant};

use idempotency_coordinator::proto::idempotency::v1 as pb;
use idempotency_coordinator::store::postgres::{batched_deletes, indexed_admin_statements};
use sqlx::Connection;

use super::*;

/// A million keys in ten namespaces of 100 000 (`ns-0` … `ns-9`); in each, one key in a hundred
/// is stuck, one is running, and the rest are completed, at different times; each claimed 30 s
/// before its lease's end.
const MILLION_KEYS: &str = r"
INSERT INTO idempotency_keys
    (namespace, key, fingerprint, lease_token, attempt, lease_expires_at, response,
     completed_at, retention_us, expires_at, claimed_at)
SELECT 'ns-' || (i / 100000), 'key-' || lpad(i::text, 7, '0'), '\x00'::bytea, i, 1,
       CASE i % 100 WHEN 0 THEN now() - (i || ' seconds')::interval
                    WHEN 1 THEN now() + interval '1 hour'
                    ELSE now() - interval '1 day' END,
       CASE WHEN i % 100 > 1 THEN '\x01'::bytea END,
       CASE WHEN i % 100 > 1 THEN now() - (i || ' seconds')::interval END,
       86400000000, now() + interval '1 day',
       CASE i % 100 WHEN 0 THEN now() - (i || ' seconds')::interval
                    WHEN 1 THEN now() + interval '1 hour'
                    ELSE now() - interval '1 day' END - interval '30 seconds'
FROM generate_series(0, 999999) AS i
";

/// Each statement's parameters for namespace `ns-5`, as SQL literals.
fn parameters(name: &str) -> &'static str {
    match name {
        "stuck" | "released" | "in_progress" | "held" => {
            "('ns-5', NULL, NULL, now() - interval '2 days', now() - interval '1 hour', 101)"
        }
        "completed" => "('ns-5', NULL, NULL, now() - interval '2 days', NULL, 101)",
        "erase_keys" | "erase_events" => "('ns-5', 1000, 'key-0550000')",
        "reap_keys" | "reap_events" | "reap_audit" => "(1000)",
        "by_key" => {
            "('ns-5', 'key-05001', '', 'key-05002', 0, NULL, NULL, now() - interval '2 days', \
             NULL, 101)"
        }
        _ => "",
    }
}

/// A session on `app`'s database in which `rows` (`what`) were inserted and the keys' table
/// analyzed, so that the planner plans for its size.
async fn rows_analyzed(app: &TestApp, rows: &'static str, what: &str) -> sqlx::PgConnection {
    let mut session = crate::support::raw::session(&app.database.url).await;
    sqlx::raw_sql(rows).execute(&mut session).await.expect(what);
    sqlx::query("VACUUM ANALYZE idempotency_keys")
        .execute(&mut session)
        .await
        .expect("analyze");
    session
}

#[tokio::test]
async fn postgres_listings_read_indexes_and_the_first_stuck_page_is_fast_on_a_million_keys() {
    let app = TestApp::spawn(Backend::Postgres).await;
    let mut session = rows_analyzed(&app, MILLION_KEYS, "a million keys").await;
    // The service's own session settings (`store/postgres/connect.rs`).
    for setting in [
        "SET plan_cache_mode = force_generic_plan",
        "SET enable_seqscan = off",
    ] {
        sqlx::query(setting)
            .execute(&mut session)
            .await
            .expect("set");
    }
    for (name, statement) in indexed_admin_statements() {
        let lines: Vec<String> = if parameters(name).is_empty() {
            sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "EXPLAIN (FORMAT TEXT) {statement}"
            )))
            .fetch_all(&mut session)
            .await
            .expect("explain")
        } else {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "PREPARE {name} AS {statement}"
            )))
            .execute(&mut session)
            .await
            .expect("prepare");
            sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "EXPLAIN EXECUTE {name}{}",
                parameters(name)
            )))
            .fetch_all(&mut session)
            .await
            .expect("explain")
        };
        let plan = lines.join("\n");
        assert!(
            !plan.contains("Seq Scan"),
            "{name} scans the table:\n{plan}"
        );
        let index = match name {
            "stuck" | "released" | "in_progress" | "held" | "stuck_gauges" => {
                "idempotency_keys_in_progress"
            }
            "completed" => "idempotency_keys_completed",
            "erase_events" => "processed_events_pkey",
            _ => "idempotency_keys_pkey",
        };
        assert!(
            plan.contains(index),
            "{name} does not read {index}:\n{plan}"
        );
        let resumes = match name {
            "erase_keys" => Some("(key > $3)"),
            "erase_events" => Some("(event_id > $3)"),
            _ => None,
        };
        if let Some(bound) = resumes {
            assert!(
                plan.lines()
                    .any(|line| line.contains("Index Cond") && line.contains(bound)),
                "{name} does not start its index scan at {bound}:\n{plan}"
            );
        }
    }

    // The reaper's and the erasure's batches delete what they locked by tuple id: a join back
    // to the table read every expired row, or the primary key from its start, per batch.
    for (name, statement) in batched_deletes() {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "PREPARE {name}_batch AS {statement}"
        )))
        .execute(&mut session)
        .await
        .expect("prepare");
        let lines: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "EXPLAIN EXECUTE {name}_batch{}",
            parameters(name)
        )))
        .fetch_all(&mut session)
        .await
        .expect("explain");
        let plan = lines.join("\n");
        assert!(
            plan.contains("Tid Scan") && !plan.contains("Join") && !plan.contains("Seq Scan"),
            "{name} does not delete by tuple id:\n{plan}"
        );
    }

    // Through the RPC: the first page of ns-5's stuck keys (1000 of them), the longest stuck
    // first, and the first page of its keys held since over an hour ago (claimed before then:
    // its stuck keys, whose claims are 139 hours old and more). The best of five calls each,
    // so that a connection's first use is not what is timed.
    let admin = admin_client(&app).await;
    let an_hour_ago = chrono::Utc::now() - chrono::Duration::hours(1);
    let held_long = pb::ListKeysRequest {
        namespace: "ns-5".into(),
        claimed_before: Some(prost_types::Timestamp {
            seconds: an_hour_ago.timestamp(),
            nanos: 0,
        }),
        ..Default::default()
    };
    let stuck = pb::ListKeysRequest {
        namespace: "ns-5".into(),
        state: pb::AdminKeyState::Stuck.into(),
        ..Default::default()
    };
    for (what, request) in [("stuck", stuck), ("held for over an hour", held_long)] {
        let mut fastest = Duration::MAX;
        for _ in 0..5 {
            let began = Instant::now();
            let page = answered(admin.clone().list_keys(request.clone()).await, "ListKeys");
            fastest = fastest.min(began.elapsed());
            assert_eq!(page.keys.len(), 100);
            assert!(
                page.keys
                    .iter()
                    .all(|k| k.state() == pb::AdminKeyState::Stuck)
            );
            // key-0599900 is ns-5's longest stuck key (its lease ran out 599 900 s ago).
            assert_eq!(page.keys[0].key, "key-0599900");
            assert!(!page.next_page_token.is_empty());
        }
        assert!(
            fastest < Duration::from_millis(50),
            "the first page of keys {what} took {fastest:?}"
        );
    }
}

/// A tenant of 50 000 completed keys and 20 000 processed events, beside the live traffic's
/// namespace.
const TENANT: &str = r"
INSERT INTO idempotency_keys
    (namespace, key, fingerprint, lease_token, attempt, lease_expires_at, response,
     completed_at, retention_us, expires_at, claimed_at)
SELECT 'tenant', 'key-' || lpad(i::text, 6, '0'), '\x00'::bytea, i, 1, now(), '\x01'::bytea,
       now(), 86400000000, now() + interval '1 day', now()
FROM generate_series(0, 49999) AS i;
INSERT INTO processed_events (consumer, event_id, processed_at, expires_at, mark_batch)
SELECT 'tenant', 'event-' || lpad(i::text, 6, '0'), now(), now() + interval '1 day', 1
FROM generate_series(0, 19999) AS i
";

/// The buffers the erase batch's index scan of `idempotency_keys_pkey` touched, from the JSON
/// of `EXPLAIN (ANALYZE, BUFFERS)`.
fn index_scan_buffers(plan: &serde_json::Value) -> Option<u64> {
    if plan.is_null() {
        return None;
    }
    if plan["Node Type"] == "Index Scan" && plan["Index Name"] == "idempotency_keys_pkey" {
        let blocks = |name: &str| plan[name].as_u64().unwrap_or(0);
        return Some(blocks("Shared Hit Blocks") + blocks("Shared Read Blocks"));
    }
    let children = plan["Plans"].as_array().into_iter().flatten();
    children.chain([&plan["Plan"]]).find_map(index_scan_buffers)
}

/// The cost of an erasure on PostgreSQL, where a deleted row's index entry stays until a vacuum
/// and, while an older snapshot is open (as there always is under load), a scan that meets it
/// must still read it: a batch that starts from the namespace's beginning reads every entry the
/// batches before it deleted (an erasure of a million keys once passed its statement timeout
/// this way and stopped short). With a snapshot held open throughout:
/// - the statement: a batch after the cursor reads a fraction of what the same batch from the
///   namespace's start reads once 45 000 keys before it are deleted (EXPLAIN ANALYZE, in a
///   transaction rolled back);
/// - the service: the erasure of all 50 000 keys and 20 000 events through the RPC, with the
///   default batch, while four callers keep calling another namespace, ends `done` with all of
///   them erased and no call failed, and it reads each index entry twice at most, once by its
///   batch and once when it looks whether the namespace is empty
///   (`pg_stat_user_indexes.idx_tup_read`: 1.4 million with batches from the namespace's start
///   that deleted by a join back to the table).
#[tokio::test]
async fn postgres_a_large_namespace_is_erased_under_load_reading_each_key_at_most_twice() {
    let (app, client) = app_and_client(Backend::Postgres).await;
    let mut session = rows_analyzed(&app, TENANT, "the tenant's rows").await;
    let mut old_snapshot = crate::support::raw::session(&app.database.url).await;
    sqlx::raw_sql("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM admin_audit_events")
        .execute(&mut old_snapshot)
        .await
        .expect("an old snapshot");

    let erase_keys = indexed_admin_statements()
        .into_iter()
        .find_map(|(name, statement)| (name == "erase_keys").then_some(statement))
        .expect("the erase batch");
    let mut explaining = crate::support::raw::session(&app.database.url).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "SET plan_cache_mode = force_generic_plan; SET enable_seqscan = off; BEGIN; \
         DELETE FROM idempotency_keys WHERE namespace = 'tenant' AND key <= 'key-044999'; \
         PREPARE erase_keys AS {erase_keys}"
    )))
    .execute(&mut explaining)
    .await
    .expect("45 000 keys deleted");
    let mut buffers = Vec::new();
    for after in ["key-044999", ""] {
        let (plan,): (serde_json::Value,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE erase_keys('tenant', 1000, '{after}')"
        )))
        .fetch_one(&mut explaining)
        .await
        .expect("explain");
        buffers.push(index_scan_buffers(&plan[0]).unwrap_or_else(|| panic!("{plan:#}")));
    }
    sqlx::query("ROLLBACK")
        .execute(&mut explaining)
        .await
        .expect("rollback");
    // Its statistics are reported when it ends.
    explaining.close().await.expect("close");
    let (after_cursor, from_start) = (buffers[0], buffers[1]);
    assert!(
        after_cursor * 10 < from_start,
        "after the cursor {after_cursor} buffers, from the start {from_start}"
    );
    // The rolled-back transaction's deletes count as attempted: 45 000 and two batches.
    let read_before = index_entries_read(&mut session, 47_000).await;

    let traffic = Traffic::start(&client, 4);
    let admin = admin_client(&app).await;
    let messages = erase_namespace(&admin, "tenant", 0).await;
    let (answered_calls, failed_calls) = traffic.stop().await;
    let last = messages.last().expect("a last message");
    assert!(last.done, "{last:?}");
    assert_eq!((last.keys_erased, last.events_erased), (50_000, 20_000));
    assert!(answered_calls > 0);
    assert_eq!(failed_calls, 0, "no call failed");
    let left: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM idempotency_keys WHERE namespace = 'tenant') \
              + (SELECT count(*) FROM processed_events WHERE consumer = 'tenant')",
    )
    .fetch_one(&mut session)
    .await
    .expect("count");
    assert_eq!(left, 0);

    let read_after = index_entries_read(&mut session, 97_000).await;
    // Each entry is read twice: by its batch, and by the last look that the namespace is empty.
    let read = read_after - read_before;
    assert!(
        read < 150_000,
        "the erasure read {read} index entries for 50 000 keys"
    );
    drop(old_snapshot);
}

/// The entries read from `idempotency_keys`'s primary key's index, once `deletes` from the
/// table are reported: each backend reports its statistics a while after its transactions
/// (within about 10 s while idle, at once when it ends).
async fn index_entries_read(session: &mut sqlx::PgConnection, deletes: i64) -> i64 {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        sqlx::query("SELECT pg_stat_clear_snapshot()")
            .execute(&mut *session)
            .await
            .expect("a fresh statistics snapshot");
        let (deleted, read): (i64, i64) = sqlx::query_as(
            "SELECT t.n_tup_del, i.idx_tup_read FROM pg_stat_user_tables AS t \
             JOIN pg_stat_user_indexes AS i USING (relid) \
             WHERE t.relname = 'idempotency_keys' AND i.indexrelname = 'idempotency_keys_pkey'",
        )
        .fetch_one(&mut *session)
        .await
        .expect("statistics");
        if deleted >= deletes {
            return read;
        }
        assert!(
            Instant::now() < deadline,
            "{deleted} deletes reported, {deletes} expected"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
