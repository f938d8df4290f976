//! The admin API on a table of a million keys (PostgreSQL, the store for large deployments):
//! every listing (with its claim-time filter) and the stuck-keys gauges read an index, never
//! the table (EXPLAIN, under the service's own session settings), and the first page of one
//! namespace's stuck keys, and of its keys held for over an hour, comes back through the RPC in
//! under 50 ms.

use std::time::{Duration, Instant};

use idempotency_coordinator::proto::idempotency::v1 as pb;
use idempotency_coordinator::store::postgres::indexed_admin_statements;
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
        "stuck" | "in_progress" | "held" => {
            "('ns-5', NULL, NULL, now() - interval '2 days', now() - interval '1 hour', 101)"
        }
        "completed" => "('ns-5', NULL, NULL, now() - interval '2 days', NULL, 101)",
        "by_key" => {
            "('ns-5', 'key-05001', '', 'key-05002', 0, NULL, NULL, now() - interval '2 days', \
             NULL, 101)"
        }
        _ => "",
    }
}

#[tokio::test]
async fn postgres_listings_read_indexes_and_the_first_stuck_page_is_fast_on_a_million_keys() {
    let app = TestApp::spawn(Backend::Postgres).await;
    let mut session = sqlx::PgConnection::connect(&app.database.url)
        .await
        .expect("a session");
    sqlx::query(MILLION_KEYS)
        .execute(&mut session)
        .await
        .expect("a million keys");
    sqlx::query("VACUUM ANALYZE idempotency_keys")
        .execute(&mut session)
        .await
        .expect("analyze");
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
            "stuck" | "in_progress" | "held" | "stuck_gauges" => "idempotency_keys_in_progress",
            "completed" => "idempotency_keys_completed",
            _ => "idempotency_keys_pkey",
        };
        assert!(
            plan.contains(index),
            "{name} does not read {index}:\n{plan}"
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
