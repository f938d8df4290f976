//! One cluster's side of a namespace's move (`store/clusters/moves.rs` leads it): its placement
//! gate (`migrations/postgres/20261207000001_placement_gates.sql`), the wait for the statements
//! that began before the gate closed, the copy of the namespace's rows out of the source and
//! into the target, and their deletion from the source. Each runs on a session of its own, not
//! on the calls' pool: a move's statements take as long as its rows do.

use std::time::Duration;

use futures::TryStreamExt;
use sqlx::{AssertSqlSafe, Connection, PgConnection};

use super::PgStore;
use super::error::classify;
use crate::domain::Instant;
use crate::store::{GateRow, GateState, StoreError};

/// The tables a move carries, each with the column that names its scope and the order its rows
/// are copied in. The audit trail's rows are copied without their id: the target numbers them
/// anew, in the order they came.
pub const MOVED_TABLES: [(&str, &str, &str); 3] = [
    ("idempotency_keys", "namespace", "key"),
    ("processed_events", "consumer", "event_id"),
    ("admin_audit_events", "namespace", "id"),
];

/// How many rows one statement of the source's cleanup deletes.
const DELETE_BATCH: i64 = 5_000;

/// How often the wait for the source's older transactions looks again.
const DRAIN_POLL: Duration = Duration::from_millis(10);

/// What a cluster's sequences last handed out.
#[derive(Debug, Clone, Copy)]
pub struct LastDrawn {
    pub lease_token: i64,
    pub mark_batch: i64,
}

/// A session on one cluster for a move.
pub struct MoveSession {
    connection: PgConnection,
}

/// A move's session failed: what it was doing, and why.
fn failed(doing: &str, error: sqlx::Error) -> StoreError {
    match classify(error) {
        StoreError::Internal(cause) | StoreError::Unavailable(cause) => {
            StoreError::Unready(format!("{doing}: {cause}"))
        }
        other => other,
    }
}

/// Deletes `scope`'s gate on `connection`: the cluster serves it again once that commits.
async fn lift_gate_on(
    connection: &mut PgConnection,
    scope: &str,
    doing: &str,
) -> Result<(), StoreError> {
    sqlx::query("DELETE FROM idempotency_placement_gates WHERE scope = $1")
        .bind(scope)
        .execute(connection)
        .await
        .map_err(|error| failed(doing, error))?;
    Ok(())
}

/// Deletes `scope`'s rows of the moved table `table`, whose column `owner` names the scope, in
/// one statement: the rows a target holds of an arrival that is redone or undone.
async fn delete_scope_rows(
    connection: &mut PgConnection,
    table: &str,
    owner: &str,
    scope: &str,
    doing: &str,
) -> Result<(), StoreError> {
    sqlx::query(AssertSqlSafe(format!(
        "DELETE FROM {table} WHERE {owner} = $1"
    )))
    .bind(scope)
    .execute(connection)
    .await
    .map_err(|error| failed(doing, error))?;
    Ok(())
}

/// How long the raise of the target's sequences waits for the claims in flight there to let go
/// of them, at each try: every claim that comes meanwhile queues behind it.
const RAISE_LOCK_WAIT: &str = "SET LOCAL lock_timeout = '100ms'";

/// How many times the raise is tried before the move stops (resumable).
const RAISE_TRIES: usize = 50;

/// Raises the target's sequences to `drawn` ([`MoveSession::copy_to`]), in a savepoint tried
/// again while the sequences are held longer than [`RAISE_LOCK_WAIT`]: the raise holds them
/// against every claim until the copy commits, so it must not wait long for them, nor make the
/// claims that come meanwhile wait long behind it.
async fn raise_sequences(
    transaction: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    drawn: LastDrawn,
) -> Result<(), StoreError> {
    for _ in 0..RAISE_TRIES {
        sqlx::raw_sql(AssertSqlSafe(format!("SAVEPOINT raise; {RAISE_LOCK_WAIT}")))
            .execute(&mut **transaction)
            .await
            .map_err(|error| failed("raising the target's sequences", error))?;
        let raised = sqlx::query("SELECT idempotency_raise_sequences($1, $2)")
            .bind(drawn.lease_token)
            .bind(drawn.mark_batch)
            .execute(&mut **transaction)
            .await;
        match raised {
            Ok(_) => {
                sqlx::raw_sql("RELEASE SAVEPOINT raise; SET LOCAL lock_timeout = 0")
                    .execute(&mut **transaction)
                    .await
                    .map_err(|error| failed("raising the target's sequences", error))?;
                return Ok(());
            }
            Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("55P03") => {
                sqlx::raw_sql("ROLLBACK TO SAVEPOINT raise")
                    .execute(&mut **transaction)
                    .await
                    .map_err(|error| failed("raising the target's sequences", error))?;
            }
            Err(error) => return Err(failed("raising the target's sequences", error)),
        }
    }
    Err(StoreError::Unready(format!(
        "the target's sequences stayed held by its claims through {RAISE_TRIES} tries of the \
         raise"
    )))
}

impl PgStore {
    /// A session of its own for a move, outside the calls' pool.
    pub async fn move_session(&self) -> Result<MoveSession, StoreError> {
        let options = self.connections.pool().connect_options();
        let mut connection = PgConnection::connect_with(&options)
            .await
            .map_err(|error| failed("connecting for the move", error))?;
        // The calls' limits do not fit a move: a copy takes as long as its rows do.
        // A transaction left idle (its mover frozen or cut off, holding the target's sequences
        // after their raise) still ends within a statement's time, as the pools' do.
        sqlx::raw_sql("SET statement_timeout = 0; SET lock_timeout = 0")
            .execute(&mut connection)
            .await
            .map_err(|error| failed("setting the move's session up", error))?;
        Ok(MoveSession { connection })
    }

    /// `scope`'s gate on this cluster, if it has one, read on the calls' pool (within a
    /// statement's time): for an operator's look, not for a move's steps.
    pub async fn placement_gate(&self, scope: &str) -> Result<Option<GateRow>, StoreError> {
        let row = self
            .fetch_optional(sqlx::query_as(GATE_OF).bind(scope))
            .await
            .map_err(classify)?;
        Ok(row.and_then(gate_row))
    }
}

/// A scope's gate: its state, the cluster it names, since when.
const GATE_OF: &str = "SELECT state, peer, since FROM idempotency_placement_gates WHERE scope = $1";

/// A row of [`GATE_OF`]; none for a state this build does not know (the table's check allows
/// none).
fn gate_row((state, peer, since): (String, String, Instant)) -> Option<GateRow> {
    GateState::parse(&state).map(|state| GateRow { state, peer, since })
}

impl MoveSession {
    /// `scope`'s gate on this cluster, if it has one.
    pub async fn gate(&mut self, scope: &str) -> Result<Option<GateRow>, StoreError> {
        let row = sqlx::query_as(GATE_OF)
            .bind(scope)
            .fetch_optional(&mut self.connection)
            .await
            .map_err(|error| failed("reading the placement gate", error))?;
        Ok(row.and_then(gate_row))
    }

    /// Sets `scope`'s gate (committed when this returns).
    pub async fn set_gate(
        &mut self,
        scope: &str,
        state: GateState,
        peer: &str,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO idempotency_placement_gates (scope, state, peer) VALUES ($1, $2, $3) \
             ON CONFLICT (scope) DO UPDATE SET state = excluded.state, peer = excluded.peer, \
             since = clock_timestamp()",
        )
        .bind(scope)
        .bind(state.as_str())
        .bind(peer)
        .execute(&mut self.connection)
        .await
        .map_err(|error| failed("setting the placement gate", error))?;
        Ok(())
    }

    /// Records that `scope` left for `home` (its gate `left`), and announces it as an erasure
    /// of the namespace when that commits: every replica's replay cache forgets what it held of
    /// it, and what it caches afterwards it reads through a statement, whose refusal here tells
    /// the replica where the namespace lives (so the cache is confirmed by that cluster's
    /// heartbeats, which carry the namespace's erasures from now on).
    pub async fn record_departure(&mut self, scope: &str, home: &str) -> Result<(), StoreError> {
        sqlx::query(
            "WITH gate AS (\
                 INSERT INTO idempotency_placement_gates (scope, state, peer) \
                 VALUES ($1, 'left', $2) \
                 ON CONFLICT (scope) DO UPDATE SET state = 'left', peer = $2, \
                 since = clock_timestamp() RETURNING scope) \
             SELECT pg_notify('idempotency_erased', scope) FROM gate",
        )
        .bind(scope)
        .bind(home)
        .execute(&mut self.connection)
        .await
        .map_err(|error| failed("recording the departure", error))?;
        Ok(())
    }

    /// Lifts `scope`'s gate: this cluster serves it again.
    pub async fn lift_gate(&mut self, scope: &str) -> Result<(), StoreError> {
        let doing = "lifting the placement gate";
        lift_gate_on(&mut self.connection, scope, doing).await
    }

    /// Takes the lock that lets one move of `scope` run at a time (held by this session until
    /// it ends): false when another session holds it.
    pub async fn lock_moves_of(&mut self, scope: &str) -> Result<bool, StoreError> {
        let (locked,): (bool,) = sqlx::query_as(
            "SELECT pg_try_advisory_lock(hashtextextended('idempotency move ' || $1, 0))",
        )
        .bind(scope)
        .fetch_one(&mut self.connection)
        .await
        .map_err(|error| failed("taking the move's lock", error))?;
        Ok(locked)
    }

    /// Waits until no transaction on this database began before now (read after the gate
    /// committed): every statement that could have missed the gate has then ended. Within
    /// `bound`; past it, the sessions still in such a transaction are named. A session whose
    /// transaction this role cannot see (another role's, without `pg_read_all_stats`) cannot be
    /// ruled out if its role may read the keys, and is waited for and named too; a role that
    /// may not cannot have run a statement on them.
    pub async fn drain(&mut self, bound: Duration) -> Result<(), StoreError> {
        let (fence,): (chrono::DateTime<chrono::Utc>,) = sqlx::query_as("SELECT clock_timestamp()")
            .fetch_one(&mut self.connection)
            .await
            .map_err(|error| failed("reading the clock", error))?;
        let ends = tokio::time::Instant::now() + bound;
        loop {
            let older: Vec<(i32, Option<String>, bool)> = sqlx::query_as(
                "SELECT pid, usename::text, state IS NULL FROM pg_stat_activity \
                 WHERE datname = current_database() AND backend_type = 'client backend' \
                   AND pid <> pg_backend_pid() \
                   AND (xact_start < $1 \
                        OR (state IS NULL \
                            AND has_table_privilege(usesysid, 'idempotency_keys', 'SELECT')))",
            )
            .bind(fence)
            .fetch_all(&mut self.connection)
            .await
            .map_err(|error| failed("looking for older transactions", error))?;
            if older.is_empty() {
                return Ok(());
            }
            if tokio::time::Instant::now() >= ends {
                let named: Vec<String> = older
                    .iter()
                    .map(|(pid, user, hidden)| {
                        let user = user.as_deref().unwrap_or("?");
                        if *hidden {
                            format!("pid {pid} (role {user}: its transaction is hidden from this role; GRANT pg_read_all_stats to it)")
                        } else {
                            format!("pid {pid} (role {user})")
                        }
                    })
                    .collect();
                return Err(StoreError::Unready(format!(
                    "sessions still in a transaction begun before the gate closed, after {bound:?}: {}",
                    named.join(", ")
                )));
            }
            tokio::time::sleep(DRAIN_POLL).await;
        }
    }

    /// The last values this cluster's sequences handed out: lease tokens (and claim tickets),
    /// and MarkProcessed's batches.
    pub async fn last_drawn(&mut self) -> Result<LastDrawn, StoreError> {
        let (tokens, batches): (Option<i64>, Option<i64>) = sqlx::query_as(
            "SELECT pg_sequence_last_value('lease_token_seq'), \
                    pg_sequence_last_value('mark_batch_seq')",
        )
        .fetch_one(&mut self.connection)
        .await
        .map_err(|error| failed("reading the sequences", error))?;
        Ok(LastDrawn {
            lease_token: tokens.unwrap_or(0),
            mark_batch: batches.unwrap_or(0),
        })
    }

    /// `scope` as a literal for a `COPY` statement, which takes no parameters (quoted by the
    /// server, which knows its own rules).
    async fn literal(&mut self, scope: &str) -> Result<String, StoreError> {
        let (literal,): (String,) = sqlx::query_as("SELECT quote_literal($1)")
            .bind(scope)
            .fetch_one(&mut self.connection)
            .await
            .map_err(|error| failed("quoting the namespace", error))?;
        Ok(literal)
    }

    /// The columns of `table` a move copies (all but the audit trail's id), in order.
    async fn columns(&mut self, table: &str) -> Result<String, StoreError> {
        let (columns,): (Option<String>,) = sqlx::query_as(
            "SELECT string_agg(quote_ident(column_name::text), ', ' ORDER BY ordinal_position) \
             FROM information_schema.columns \
             WHERE table_schema = current_schema() AND table_name = $1 AND column_name <> 'id'",
        )
        .bind(table)
        .fetch_one(&mut self.connection)
        .await
        .map_err(|error| failed("reading the tables' columns", error))?;
        columns.ok_or_else(|| StoreError::NotMigrated(format!("no table {table}")))
    }

    /// Copies `scope`'s rows of every moved table from this (the source) cluster to `target`,
    /// raises the target's sequences to `drawn` (what the source's last handed out), and lifts the target's gate, in one
    /// transaction on the target: the namespace appears there whole, served from that instant,
    /// or not at all. Rows left on the target by an earlier attempt are replaced. Answers how
    /// many rows of each table were copied.
    pub async fn copy_to(
        &mut self,
        target: &mut MoveSession,
        scope: &str,
        drawn: LastDrawn,
    ) -> Result<[u64; 3], StoreError> {
        let literal = self.literal(scope).await?;
        let mut copied = [0u64; 3];
        let mut transaction = target
            .connection
            .begin()
            .await
            .map_err(|error| failed("beginning the copy on the target", error))?;
        // The gate must still say the namespace is arriving: a rollback meanwhile took it back.
        let arriving: Option<(String,)> = sqlx::query_as(
            "SELECT state FROM idempotency_placement_gates WHERE scope = $1 FOR UPDATE",
        )
        .bind(scope)
        .fetch_optional(&mut *transaction)
        .await
        .map_err(|error| failed("locking the target's gate", error))?;
        if arriving.as_ref().map(|(state,)| state.as_str()) != Some("arriving") {
            return Err(StoreError::Unready(format!(
                "the target's gate for namespace {scope} no longer says it is arriving (rolled \
                 back meanwhile?)"
            )));
        }
        for (at, (table, owner, order)) in MOVED_TABLES.iter().enumerate() {
            let columns = self.columns(table).await?;
            let doing = "clearing an earlier attempt's rows";
            delete_scope_rows(&mut transaction, table, owner, scope, doing).await?;
            let mut rows = self
                .connection
                .copy_out_raw(&format!(
                    "COPY (SELECT {columns} FROM {table} WHERE {owner} = {literal} \
                     ORDER BY {order}) TO STDOUT (FORMAT binary)"
                ))
                .await
                .map_err(|error| failed("copying out of the source", error))?;
            let mut sink = transaction
                .copy_in_raw(&format!(
                    "COPY {table} ({columns}) FROM STDIN (FORMAT binary)"
                ))
                .await
                .map_err(|error| failed("copying into the target", error))?;
            let mut sent = Ok(());
            while let Some(chunk) = rows
                .try_next()
                .await
                .map_err(|error| failed("copying out of the source", error))?
            {
                if let Err(error) = sink.send(chunk).await {
                    sent = Err(error);
                    break;
                }
            }
            drop(rows);
            if let Err(error) = sent {
                let _ = sink.abort("the source's copy failed").await;
                return Err(failed("copying into the target", error));
            }
            copied[at] = sink
                .finish()
                .await
                .map_err(|error| failed("copying into the target", error))?;
        }
        raise_sequences(&mut transaction, drawn).await?;
        lift_gate_on(&mut transaction, scope, "lifting the target's gate").await?;
        transaction
            .commit()
            .await
            .map_err(|error| failed("committing the copy on the target", error))?;
        Ok(copied)
    }

    /// Deletes `scope`'s rows of every moved table, in batches, while its gate here says it
    /// left (nothing once another move has brought it back); the gate stays. Answers how many
    /// rows it deleted.
    pub async fn delete_rows(&mut self, scope: &str) -> Result<u64, StoreError> {
        let mut deleted = 0;
        for (table, owner, _) in MOVED_TABLES {
            loop {
                let result = sqlx::query(AssertSqlSafe(format!(
                    "DELETE FROM {table} WHERE ctid = ANY (ARRAY(\
                     SELECT ctid FROM {table} WHERE {owner} = $1 LIMIT $2)) \
                     AND EXISTS (SELECT FROM idempotency_placement_gates \
                                 WHERE scope = $1 AND state = 'left')"
                )))
                .bind(scope)
                .bind(DELETE_BATCH)
                .execute(&mut self.connection)
                .await
                .map_err(|error| failed("deleting the moved rows", error))?;
                deleted += result.rows_affected();
                if result.rows_affected() == 0 {
                    break;
                }
            }
        }
        Ok(deleted)
    }

    /// Deletes `scope`'s rows, its gate saying `arriving` from `home`, in one transaction: how a
    /// rolled-back arrival is undone (the gate is set to `left` once `home` serves again).
    pub async fn give_back(&mut self, scope: &str, home: &str) -> Result<(), StoreError> {
        let mut transaction = self
            .connection
            .begin()
            .await
            .map_err(|error| failed("beginning the rollback", error))?;
        for (table, owner, _) in MOVED_TABLES {
            let doing = "deleting the copied rows";
            delete_scope_rows(&mut transaction, table, owner, scope, doing).await?;
        }
        sqlx::query(
            "INSERT INTO idempotency_placement_gates (scope, state, peer) \
             VALUES ($1, 'arriving', $2) \
             ON CONFLICT (scope) DO UPDATE SET state = 'arriving', peer = $2, \
             since = clock_timestamp()",
        )
        .bind(scope)
        .bind(home)
        .execute(&mut *transaction)
        .await
        .map_err(|error| failed("closing the target's gate", error))?;
        transaction
            .commit()
            .await
            .map_err(|error| failed("committing the rollback", error))
    }

    pub async fn close(self) {
        let _ = self.connection.close().await;
    }
}
