//! A raw PostgreSQL session of the test's own, which holds a key the way another replica, the
//! reaper or an operator would, inside a transaction the test ends.

use sqlx::{Connection, PgConnection};

use super::{FINGERPRINT, NAMESPACE};

/// A session on `url`.
pub async fn session(url: &str) -> PgConnection {
    PgConnection::connect(url).await.expect("a raw session")
}

/// A session on `url` inside a transaction it has begun, which the test ends.
pub async fn transaction(url: &str) -> PgConnection {
    let mut session = session(url).await;
    run(&mut session, "BEGIN").await;
    session
}

/// Runs `statement` (`BEGIN`, `COMMIT`, `ROLLBACK`) on `session`.
pub async fn run(session: &mut PgConnection, statement: &'static str) {
    sqlx::query(statement)
        .execute(session)
        .await
        .unwrap_or_else(|error| panic!("{statement}: {error}"));
}

/// Claims `key` as another replica would, with a token drawn now: in progress for 30 s, or
/// already past its retention when `expired`. Answers the token.
pub async fn insert_claim(session: &mut PgConnection, key: &str, expired: bool) -> i64 {
    let (lease, retention) = if expired {
        ("-2 hours", "-1 hour")
    } else {
        ("30 seconds", "1 hour")
    };
    let (token,): (i64,) = sqlx::query_as(
        "INSERT INTO idempotency_keys
             (namespace, key, fingerprint, lease_token, attempt, attempt_id, lease_expires_at,
              retention_us, expires_at)
         VALUES ($1, $2, $3, nextval('lease_token_seq'), 1, 'another-replica',
                 now() + $4::interval, 3600000000, now() + $5::interval)
         RETURNING lease_token",
    )
    .bind(NAMESPACE)
    .bind(key)
    .bind(FINGERPRINT)
    .bind(lease)
    .bind(retention)
    .fetch_one(session)
    .await
    .expect("insert the raw claim");
    token
}

/// Locks `key`'s row, as a slow statement or the reaper would.
pub async fn lock_key(session: &mut PgConnection, key: &str) {
    sqlx::query("SELECT 1 FROM idempotency_keys WHERE key = $1 FOR UPDATE")
        .bind(key)
        .execute(session)
        .await
        .expect("lock the row");
}

/// Deletes `key`'s row, as the reaper or a Release would.
pub async fn delete_key(session: &mut PgConnection, key: &str) {
    sqlx::query("DELETE FROM idempotency_keys WHERE key = $1")
        .bind(key)
        .execute(session)
        .await
        .expect("delete the key");
}

/// Locks the row of `consumer`'s processed event `event_id`, as a slow statement would.
pub async fn lock_event(session: &mut PgConnection, consumer: &str, event_id: &str) {
    sqlx::query("SELECT 1 FROM processed_events WHERE consumer = $1 AND event_id = $2 FOR UPDATE")
        .bind(consumer)
        .bind(event_id)
        .execute(session)
        .await
        .expect("lock the event's row");
}
