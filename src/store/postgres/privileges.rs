//! The rights `serve` needs on the schema, and no more: written once here, checked at start
//! (a role that lacks one is told which, before a call fails on it), and granted by
//! `migrate --grant-to <role>` (docs/operations.md, "Two roles").
//!
//! Each right is used by a statement of `sql.rs` or a function of `migrations/postgres/`:
//! the three tables of data are read, inserted, updated (a claim's takeover, a mark's conflict,
//! and `FOR UPDATE`, which the reaper's and the erasure's batches take) and deleted from
//! (Release, the reaper, the erasure), and so is the replicas' table (a heartbeat is an upsert;
//! a starting replica deletes the rows of replicas long gone); the two sequences give tokens and mark batches (`nextval`, and
//! `pg_sequence_last_value`, which needs `USAGE` or `SELECT`); the migrations' table is only
//! read (the schema's version); TryStart's functions are executed. A move of a namespace
//! (`moves.rs`) sets and lifts the placement gates (the table's DML), copies the rows with
//! `COPY` (`SELECT`, `INSERT`), and raises the sequences through a function that runs as their
//! owner. Nothing else: no `CREATE`,
//! no ownership, no `TRUNCATE`, no `REFERENCES`, no `TRIGGER`.

use sqlx::{AssertSqlSafe, PgConnection};

use crate::store::StoreError;

/// What one right is on.
#[derive(Debug, Clone, Copy)]
enum Object {
    Table,
    Sequence,
    /// Every overload of a function of that name in the schema.
    Function,
}

/// One object and the privileges the service needs on it.
#[derive(Debug, Clone, Copy)]
struct Right {
    object: Object,
    name: &'static str,
    privileges: &'static [&'static str],
}

const DATA: &[&str] = &["SELECT", "INSERT", "UPDATE", "DELETE"];

/// Every right `serve` needs.
const SERVICE_RIGHTS: &[Right] = &[
    Right {
        object: Object::Table,
        name: "idempotency_keys",
        privileges: DATA,
    },
    Right {
        object: Object::Table,
        name: "processed_events",
        privileges: DATA,
    },
    Right {
        object: Object::Table,
        name: "admin_audit_events",
        privileges: DATA,
    },
    Right {
        object: Object::Table,
        name: "idempotency_replicas",
        privileges: DATA,
    },
    Right {
        object: Object::Table,
        name: "idempotency_placement_gates",
        privileges: DATA,
    },
    Right {
        object: Object::Table,
        name: "_sqlx_migrations",
        privileges: &["SELECT"],
    },
    Right {
        object: Object::Sequence,
        name: "lease_token_seq",
        privileges: &["USAGE"],
    },
    Right {
        object: Object::Sequence,
        name: "mark_batch_seq",
        privileges: &["USAGE"],
    },
    Right {
        object: Object::Function,
        name: "idempotency_try_start",
        privileges: &["EXECUTE"],
    },
    Right {
        object: Object::Function,
        name: "idempotency_try_start_batch",
        privileges: &["EXECUTE"],
    },
    Right {
        object: Object::Function,
        name: "idempotency_gate_refuses",
        privileges: &["EXECUTE"],
    },
    Right {
        object: Object::Function,
        name: "idempotency_raise_sequences",
        privileges: &["EXECUTE"],
    },
];

/// The rights of [`SERVICE_RIGHTS`] this session's role lacks, as `INSERT on
/// idempotency_keys`, with `USAGE on schema public` first if that is missing.
pub(super) async fn missing(connection: &mut PgConnection) -> Result<Vec<String>, sqlx::Error> {
    let mut missing = Vec::new();
    let (schema, usable): (String, bool) =
        sqlx::query_as("SELECT current_schema(), has_schema_privilege(current_schema(), 'USAGE')")
            .fetch_one(&mut *connection)
            .await?;
    if !usable {
        missing.push(format!("USAGE on schema {schema}"));
    }
    for right in SERVICE_RIGHTS {
        for privilege in right.privileges {
            let held: (Option<bool>,) = match right.object {
                Object::Table => sqlx::query_as("SELECT has_table_privilege($1, $2)"),
                Object::Sequence => sqlx::query_as("SELECT has_sequence_privilege($1, $2)"),
                Object::Function => sqlx::query_as(
                    "SELECT bool_and(has_function_privilege(p.oid, $2)) FROM pg_proc AS p \
                     WHERE p.proname = $1 AND p.pronamespace = current_schema()::regnamespace",
                ),
            }
            .bind(right.name)
            .bind(*privilege)
            .fetch_one(&mut *connection)
            .await?;
            if held.0 != Some(true) {
                missing.push(format!("{privilege} on {}", right.name));
            }
        }
    }
    Ok(missing)
}

/// Why a role that lacks `missing` cannot serve, and how to give it what it lacks.
pub(super) fn unfit(user: &str, missing: &[String]) -> StoreError {
    StoreError::Unready(format!(
        "role \"{user}\" lacks rights the service needs: {}; grant them with \
         `idempotency-coordinator migrate --grant-to {user}` run as the role that owns the \
         schema (docs/operations.md, \"Two roles\")",
        missing.join(", ")
    ))
}

/// Grants `role` every right of [`SERVICE_RIGHTS`] (as the objects' owner: the migrating
/// role). Idempotent: run after every migration, so that what a new migration adds is granted.
pub(super) async fn grant(connection: &mut PgConnection, name: &str) -> Result<(), StoreError> {
    let role = quote_identifier(name);
    let mut statements = Vec::new();
    for right in SERVICE_RIGHTS {
        let privileges = right.privileges.join(", ");
        match right.object {
            Object::Table => statements.push(format!(
                "GRANT {privileges} ON TABLE {} TO {role}",
                quote_identifier(right.name)
            )),
            Object::Sequence => statements.push(format!(
                "GRANT {privileges} ON SEQUENCE {} TO {role}",
                quote_identifier(right.name)
            )),
            Object::Function => {
                let overloads: Vec<(String,)> = sqlx::query_as(
                    "SELECT p.oid::regprocedure::text FROM pg_proc AS p \
                     WHERE p.proname = $1 AND p.pronamespace = current_schema()::regnamespace",
                )
                .bind(right.name)
                .fetch_all(&mut *connection)
                .await
                .map_err(super::error::classify)?;
                statements.extend(overloads.into_iter().map(|(signature,)| {
                    format!("GRANT {privileges} ON FUNCTION {signature} TO {role}")
                }));
            }
        }
    }
    // The schema's USAGE too, when the role lacks it (PUBLIC has it on `public` by default;
    // another schema's owner must grant it).
    let (schema, usable): (String, bool) = sqlx::query_as(
        "SELECT current_schema(), has_schema_privilege($1, current_schema(), 'USAGE')",
    )
    .bind(name)
    .fetch_one(&mut *connection)
    .await
    .map_err(|error| match &error {
        sqlx::Error::Database(db) => StoreError::Unready(format!(
            "granting the service's rights to {role} failed: {} (does the role exist?)",
            db.message()
        )),
        _ => super::error::classify(error),
    })?;
    if !usable {
        statements.push(format!(
            "GRANT USAGE ON SCHEMA {} TO {role}",
            quote_identifier(&schema)
        ));
    }
    let script = statements.join(";\n");
    sqlx::raw_sql(AssertSqlSafe(script))
        .execute(&mut *connection)
        .await
        .map_err(|error| match &error {
            sqlx::Error::Database(db) => StoreError::Unready(format!(
                "granting the service's rights to {role} failed: {} (SQLSTATE {}); the \
                 migrating role must own the schema's objects and the role must exist",
                db.message(),
                db.code().unwrap_or_default()
            )),
            _ => super::error::classify(error),
        })?;
    tracing::info!(%role, "granted the rights the service needs");
    Ok(())
}

/// `name` as a quoted SQL identifier.
fn quote_identifier(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_quoted() {
        assert_eq!(quote_identifier("app"), "\"app\"");
        assert_eq!(quote_identifier("a\"b"), "\"a\"\"b\"");
    }
}
