//! Completed keys of the namespace `tenant` (`order-1`, `order-2`, …), loaded straight into a
//! store for the benchmarks that erase or move a big namespace.

use sqlx::{Connection, PgConnection};

use crate::scratch::{Direct, ScratchStore};

/// `rows` completed keys in the benchmark's own store.
pub async fn insert(store: &ScratchStore, rows: u64) -> anyhow::Result<()> {
    match store.connect().await? {
        Direct::Postgres(mut connection) => insert_into_postgres(&mut connection, rows).await,
        Direct::Sqlite(mut connection) => {
            sqlx::query(
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
                 INSERT INTO idempotency_keys (namespace, key, fingerprint, lease_token, attempt,
                     lease_expires_at, response, completed_at, retention_us, expires_at)
                 SELECT 'tenant', 'order-' || i, x'00', 3000000000 + i, 1, 0, x'7b7d', 0,
                        86400000000, 9000000000000000 FROM n",
            )
            .bind(i64::try_from(rows)?)
            .execute(&mut connection)
            .await?;
            Ok(())
        }
    }
}

/// `rows` completed keys in the PostgreSQL database at `url`.
pub async fn insert_postgres(url: &str, rows: u64) -> anyhow::Result<()> {
    let mut connection = PgConnection::connect(url).await?;
    insert_into_postgres(&mut connection, rows).await
}

async fn insert_into_postgres(connection: &mut PgConnection, rows: u64) -> anyhow::Result<()> {
    sqlx::query(
        "INSERT INTO idempotency_keys (namespace, key, fingerprint, lease_token, attempt,
             lease_expires_at, response, completed_at, retention_us, expires_at)
         SELECT 'tenant', 'order-' || n, '\\x00'::bytea, nextval('lease_token_seq'), 1,
                now(), '\\x7b7d'::bytea, now(), 86400000000, now() + interval '1 day'
         FROM generate_series(1, $1) AS n",
    )
    .bind(i64::try_from(rows)?)
    .execute(&mut *connection)
    .await?;
    sqlx::query("VACUUM ANALYZE idempotency_keys")
        .execute(connection)
        .await?;
    Ok(())
}
