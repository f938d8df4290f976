//! Every statement of the PostgreSQL store. The statements share pieces (the columns of a key,
//! TryStart's decision table), so they are put together with `concat!` rather than read from
//! separate files: here those of the calls, the reaper and the health probe; in `admin` the
//! admin API's, which use the macros defined here (and so are declared after them).

/// The channel on which a committed Complete or Release announces its key, when a waiter
/// watches it, for TryStarts that wait on any replica (`LISTEN`).
pub(super) const KEY_CHANNEL: &str = "idempotency_keys";

/// `pg_notify` of the key of row `$alias`, by its hash (`domain::KeyHash`), never its name, when
/// a waiting TryStart watches the key (`watched`, set by [`WATCH_KEY`]); the notification is
/// sent when the statement's transaction commits, and only then. A key nobody waits for is not
/// announced: each notification costs PostgreSQL an entry in its queue at commit, and every
/// replica's listening session a wake-up and a message.
macro_rules! notify_watched_key {
    ($alias:literal) => {
        concat!(
            "CASE WHEN ",
            $alias,
            "watched THEN pg_notify('idempotency_keys', encode(sha256(convert_to(",
            $alias,
            "namespace || chr(31) || ",
            $alias,
            "key, 'UTF8')), 'hex')) END"
        )
    };
}

/// The placement gate (`migrations/postgres/20261207000001_placement_gates.sql`): true while no
/// scope the statement names (`scope $cond`) has a row in `idempotency_placement_gates`; for a
/// scope that has one, the statement fails with SQLSTATE IDM01 before it reads or writes a row
/// (`StoreError::Placed`), and the service asks the cluster the row names. Uncorrelated, so
/// PostgreSQL evaluates it once per statement, first (an InitPlan in a one-time filter).
macro_rules! gate {
    ($cond:literal) => {
        concat!(
            "NOT EXISTS (SELECT FROM idempotency_placement_gates AS gate WHERE gate.scope ",
            $cond,
            " AND idempotency_gate_refuses(gate.scope, gate.state, gate.peer))"
        )
    };
}

/// The columns of [`KeyRow`], for statements that return one.
macro_rules! key_columns {
    ($alias:literal) => {
        concat!(
            $alias,
            "lease_token, ",
            $alias,
            "attempt, ",
            $alias,
            "attempt_id, ",
            $alias,
            "lease_expires_at, ",
            $alias,
            "fingerprint, ",
            $alias,
            "checkpoint, ",
            $alias,
            "response, ",
            $alias,
            "completed_at, ",
            $alias,
            "retention_us, ",
            $alias,
            "expires_at"
        )
    };
}

/// TryStart for one key: the migration's `idempotency_try_start`, which claims an absent key
/// with a plain insert and judges a key that has a row by the contract's order, under the row's
/// lock (see `migrations/postgres/20261203000001_tokens_drawn_last.sql`, where the decision
/// table lives). A fencing token is always drawn once the row that carries it is this
/// transaction's own, never before a wait. `$1` … `$7`: namespace, key, fingerprint, lease and
/// retention in microseconds, attempt id, holder (written with a claim: see
/// `migrations/postgres/20261205000001_holder.sql`).
pub(super) const TRY_START: &str = concat!(
    "SELECT * FROM idempotency_try_start($1, $2, $3, $4, $5, $6, $7) WHERE ",
    gate!("= $1")
);

/// TryStart for many keys (distinct) in one call: `idempotency_try_start_batch`, the same
/// table row by row, the keys taken in key order. Its arrays are the columns of [`TRY_START`].
pub(super) const TRY_START_BATCH: &str = concat!(
    "SELECT * FROM idempotency_try_start_batch($1::text[], $2::text[], $3::bytea[], \
     $4::bigint[], $5::bigint[], $6::text[], $7::text[]) WHERE ",
    gate!("= ANY($1::text[])")
);

/// What Complete reads of each locked row, beside its call's input.
macro_rules! complete_locked_columns {
    () => {
        "k.namespace, k.key, k.lease_token, k.completed_at, k.expires_at, k.retention_us, \
         k.response"
    };
}

/// The rest of a Complete statement, once `locked` holds the calls' rows with their input
/// (`presented_token`, `new_response`, `new_retention_us`): the clock is read once every row is
/// held (`judged.at`), the holder's own in-progress keys are completed (stamped with that
/// instant, the checkpoint dropped, their key announced), and `$returned` names what the
/// update returns to match each call (`completed`). The final `SELECT` follows.
macro_rules! complete_judged {
    ($returned:literal) => {
        concat!(
            r#"judged AS MATERIALIZED (
    SELECT clock_timestamp() AS at FROM (SELECT count(*) FROM locked) AS every_lock_held
),
completed AS (
    UPDATE idempotency_keys AS k
    SET (response, completed_at, checkpoint, retention_us, expires_at) =
        (l.new_response, j.at, NULL::bytea, coalesce(l.new_retention_us, l.retention_us),
         j.at + coalesce(l.new_retention_us, l.retention_us) * interval '1 microsecond')
    FROM locked AS l
    CROSS JOIN judged AS j
    WHERE k.namespace = l.namespace AND k.key = l.key
      AND l.lease_token = l.presented_token AND l.completed_at IS NULL AND l.expires_at > j.at
    RETURNING "#,
            $returned,
            "k.completed_at, k.expires_at, ",
            notify_watched_key!("k."),
            r#"
)
SELECT c.completed_at AS applied_at,
       c.expires_at AS applied_expires_at,
       coalesce(l.expires_at > j.at, false) AS live,
       l.lease_token,
       l.completed_at,
       l.expires_at,
       coalesce(l.response = l.new_response, false) AS same_response
"#
        )
    };
}

/// Complete, for many keys, in one statement that answers every call. The rows are locked in
/// key order before anything is judged; once all are held, the clock is read once
/// (`judged.at`), and each call's key is judged by it: the holder's own in-progress key is
/// completed, and for every other call the row as it stood under the lock comes back, which
/// says why it was refused (`domain::classify_refusal`), so no second statement is needed to
/// explain a refusal.
///
/// The locked rows carry their call's input (token, response, retention, position), so the
/// update and the answer join each row with its call by key once (the index) or by position,
/// never by searching the input again: a generic plan, which cannot know how many calls came,
/// would search it with a nested loop, once per row.
pub(super) const COMPLETE: &str = concat!(
    r#"
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bytea[], $5::bigint[])
        WITH ORDINALITY AS i(namespace, key, lease_token, response, retention_us, position)
),
locked AS MATERIALIZED (
    SELECT "#,
    complete_locked_columns!(),
    r#", i.position, i.lease_token AS presented_token,
           i.response AS new_response, i.retention_us AS new_retention_us
    FROM idempotency_keys AS k
    JOIN input AS i ON k.namespace = i.namespace AND k.key = i.key
    WHERE "#,
    gate!("= ANY($1::text[])"),
    r#"
    ORDER BY k.namespace COLLATE "C", k.key COLLATE "C"
    FOR UPDATE OF k
),
"#,
    complete_judged!("l.position, "),
    r#"FROM input AS i
CROSS JOIN judged AS j
LEFT JOIN locked AS l ON l.position = i.position
LEFT JOIN completed AS c ON c.position = i.position
ORDER BY i.position
"#
);

/// [`COMPLETE`] for one key (`$1`, `$2`; token, response, retention `$3` … `$5`): the same
/// judgement, without the arrays, their sort and their joins, which PostgreSQL sets up on every
/// execution (priced in BENCHMARKS.md, fourth pass).
pub(super) const COMPLETE_ONE: &str = concat!(
    r#"
WITH locked AS MATERIALIZED (
    SELECT "#,
    complete_locked_columns!(),
    r#", $3::bigint AS presented_token, $4::bytea AS new_response,
           $5::bigint AS new_retention_us
    FROM idempotency_keys AS k
    WHERE k.namespace = $1 AND k.key = $2 AND "#,
    gate!("= $1"),
    r#"
    FOR UPDATE
),
"#,
    complete_judged!(""),
    r#"FROM judged AS j
LEFT JOIN locked AS l ON true
LEFT JOIN completed AS c ON true
"#
);

/// The key's row, locked before anything is judged. Release and ExtendLease decide on
/// the row this yields, by the clock read after the lock was granted. (A plain `UPDATE … WHERE
/// expires_at > clock_timestamp()` would judge the row while scanning, before waiting for the
/// lock, and keep that verdict when the lock holder leaves the row unchanged.)
macro_rules! locked_key {
    () => {
        concat!(
            r#"WITH locked AS MATERIALIZED (
    SELECT namespace, key, lease_token, completed_at, expires_at, retention_us
    FROM idempotency_keys
    WHERE namespace = $1 AND key = $2 AND "#,
            gate!("= $1"),
            r#"
    FOR UPDATE
)
"#
        )
    };
}

/// Read after a guarded write (Release, ExtendLease) changed nothing, to say why. Tokens are
/// never reused and a completed key never returns to progress, so what this finds explains the
/// refusal. No response is offered, so a completed key is never "the same completion".
pub(super) const GUARD_STATE: &str = concat!(
    r#"
SELECT lease_token, completed_at, expires_at, false AS same_response
FROM idempotency_keys
WHERE namespace = $1 AND key = $2 AND expires_at > now() AND "#,
    gate!("= $1")
);

pub(super) const RELEASE: &str = concat!(
    locked_key!(),
    r#", released AS (
    DELETE FROM idempotency_keys AS k
    USING locked AS l
    WHERE k.namespace = l.namespace AND k.key = l.key
      AND l.lease_token = $3 AND l.completed_at IS NULL AND l.expires_at > clock_timestamp()
    RETURNING k.lease_token, "#,
    notify_watched_key!("k."),
    r#"
)
SELECT lease_token FROM released
"#
);

/// The database clock, for estimating how far the service's clock is from it.
pub(super) const CLOCK: &str = "SELECT clock_timestamp()";

/// The lease becomes now + ttl (which may shorten it); retention stretches to cover it.
/// `$5` says whether a checkpoint was sent at all, so that an empty one still replaces.
pub(super) const EXTEND_LEASE: &str = concat!(
    locked_key!(),
    r#"UPDATE idempotency_keys AS k
SET (lease_expires_at, expires_at, checkpoint) =
    (SELECT c.at + $4 * interval '1 microsecond',
            greatest(l.expires_at, c.at + $4 * interval '1 microsecond'),
            CASE WHEN $5 THEN $6::bytea ELSE k.checkpoint END
     FROM (SELECT clock_timestamp() AS at) AS c)
FROM locked AS l
WHERE k.namespace = l.namespace AND k.key = l.key
  AND l.lease_token = $3 AND l.completed_at IS NULL AND l.expires_at > clock_timestamp()
RETURNING k.lease_expires_at
"#
);

/// The live row of key `$1`, `$2` (none when expired), with [`key_columns!`] and `$extra`.
macro_rules! lookup {
    ($extra:literal) => {
        concat!(
            "SELECT ",
            key_columns!(""),
            $extra,
            " FROM idempotency_keys WHERE namespace = $1 AND key = $2 AND expires_at > now() AND ",
            gate!("= $1")
        )
    };
}

pub(super) const LOOKUP: &str = lookup!("");

/// [`LOOKUP`] for a waiter, which also needs to know whether the key is watched already.
pub(super) const LOOKUP_WATCHED: &str = lookup!(", watched");

/// Marks the key watched, so that its next Complete or Release announces it, and answers the
/// row as it stands under the lock (a Complete committed meanwhile included) and whether it is
/// still live by the clock read then. Answers no row when the key has none, or is watched
/// already.
pub(super) const WATCH_KEY: &str = concat!(
    "UPDATE idempotency_keys AS k SET watched = true \
     WHERE k.namespace = $1 AND k.key = $2 AND NOT k.watched AND ",
    gate!("= $1"),
    " RETURNING ",
    key_columns!("k."),
    ", k.expires_at > clock_timestamp() AS live"
);

/// What MarkProcessed does to an id's existing row: a live row is kept as it is, an expired one
/// is recorded anew (`excluded`). The update always happens, so that RETURNING reports every id
/// with the row as it stands under its lock.
macro_rules! mark_on_conflict {
    () => {
        r#"ON CONFLICT (consumer, event_id) DO UPDATE SET
        processed_at = CASE WHEN e.expires_at <= now() THEN excluded.processed_at
                            ELSE e.processed_at END,
        expires_at = CASE WHEN e.expires_at <= now() THEN excluded.expires_at
                          ELSE e.expires_at END,
        mark_batch = CASE WHEN e.expires_at <= now() THEN excluded.mark_batch
                          ELSE e.mark_batch END
"#
    };
}

/// MarkProcessed as one statement, for one call or for many: row `i` of the input is event
/// `$2[i]` of consumer `$1[i]`, to be kept for `$3[i]`, and the rows come in call order. Each
/// distinct (consumer, id) is inserted once, with its first occurrence's retention, in sorted
/// order (so concurrent statements lock rows in the same order and do not deadlock), as
/// [`mark_on_conflict!`] says. `mark_batch` tells rows this statement recorded from rows it
/// found; within the statement, only an id's first position counts as new, exactly as if the
/// calls had come one after another.
///
/// Unlike the key statements, expiry is judged by `now()`: a row live at that instant is left
/// untouched and reported as processed, which was true then, so waiting for its lock changes
/// nothing that anyone could have observed in between.
pub(super) const MARK_PROCESSED: &str = concat!(
    r#"
WITH batch AS (SELECT nextval('mark_batch_seq') AS id),
requested AS (
    SELECT r.consumer COLLATE "C" AS consumer, r.event_id COLLATE "C" AS event_id,
           r.retention_us, r.position
    FROM unnest($1::text[], $2::text[], $3::bigint[]) WITH ORDINALITY
        AS r(consumer, event_id, retention_us, position)
    WHERE "#,
    gate!("= ANY($1::text[])"),
    r#"
),
first_requests AS (
    SELECT DISTINCT ON (consumer, event_id) consumer, event_id, retention_us
    FROM requested
    ORDER BY consumer, event_id, position
),
recorded AS (
    INSERT INTO processed_events AS e (consumer, event_id, processed_at, expires_at, mark_batch)
    SELECT f.consumer, f.event_id, now(), now() + f.retention_us * interval '1 microsecond',
           batch.id
    FROM first_requests AS f CROSS JOIN batch
    ORDER BY f.consumer, f.event_id
    "#,
    mark_on_conflict!(),
    r#"    RETURNING e.consumer, e.event_id, e.processed_at,
              e.mark_batch = (SELECT id FROM batch) AS recorded_now
)
SELECT r.event_id,
       rec.processed_at,
       NOT (rec.recorded_now
            AND r.position = min(r.position) OVER (PARTITION BY r.consumer, r.event_id))
           AS already_processed
FROM requested AS r
JOIN recorded AS rec ON rec.consumer = r.consumer AND rec.event_id = r.event_id
ORDER BY r.position
"#
);

/// [`MARK_PROCESSED`] for one id (`$1` consumer, `$2` id, `$3` retention): the same insert,
/// without the arrays, the duplicates' sort and the window over positions, which PostgreSQL
/// sets up on every execution.
pub(super) const MARK_PROCESSED_ONE: &str = concat!(
    r#"
WITH batch AS (SELECT nextval('mark_batch_seq') AS id)
INSERT INTO processed_events AS e (consumer, event_id, processed_at, expires_at, mark_batch)
SELECT $1, $2, now(), now() + $3 * interval '1 microsecond', batch.id
FROM batch
WHERE "#,
    gate!("= $1"),
    r#"
"#,
    mark_on_conflict!(),
    r#"RETURNING e.event_id, e.processed_at,
          e.mark_batch <> (SELECT id FROM batch) AS already_processed
"#
);

/// Deletes a bounded batch ($1) of a table's expired rows, oldest expiry first, skipping rows
/// another transaction holds (another replica's reaper, or a TryStart reclaiming the key), and
/// answers how many it deleted. The delete finds the rows it locked by their tuple id (a Tid
/// Scan): joined back to the table by key, PostgreSQL's plan read every expired row into a
/// hash (or walked the primary key from its start) for each batch, however few it deleted.
/// It has no other condition, which could lead the planner to an index instead, and needs
/// none: `FOR UPDATE` rechecks `expires_at` on the latest version of a row updated since the
/// statement began (a renewal is not locked), and each tuple id it answers stays that of a row
/// this transaction holds until it ends, so it names no other row. A row updated meanwhile but
/// still expired is locked in its new version, which the delete's snapshot does not see: it is
/// left to the next sweep.
macro_rules! reap {
    ($table:literal) => {
        concat!(
            "
WITH doomed AS (
    SELECT ctid FROM ",
            $table,
            "
    WHERE expires_at <= now()
    ORDER BY expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
),
deleted AS (
    DELETE FROM ",
            $table,
            "
    WHERE ctid = ANY (ARRAY(SELECT ctid FROM doomed))
    RETURNING 1
)
SELECT count(*) FROM deleted
"
        )
    };
}

pub(super) const REAP_KEYS: &str = reap!("idempotency_keys");

pub(super) const REAP_EVENTS: &str = reap!("processed_events");

/// The reaper's lag: how long ago the oldest expired row of each table expired, in
/// microseconds (0 when none is). `min` under `expires_at <= now()` reads one end of each
/// table's `expires_at` index; a plain read, it waits for no row lock.
pub(super) const EXPIRED_BACKLOG: &str = r#"
SELECT
    coalesce((extract(epoch FROM now() - (SELECT min(expires_at) FROM idempotency_keys
                                          WHERE expires_at <= now())) * 1000000)::bigint, 0),
    coalesce((extract(epoch FROM now() - (SELECT min(expires_at) FROM processed_events
                                          WHERE expires_at <= now())) * 1000000)::bigint, 0)
"#;

// The admin API (`proto/idempotency/v1/admin.proto`). Its listings read the indexes of
// `migrations/postgres/20261204000001_admin.sql`, one per order, so that a page never scans the
// table; their bounds are plain comparisons with the statement's parameters, which a generic
// plan turns into index conditions.

/// The channel on which an erasure announces what it erased (`<namespace>` for a namespace,
/// `<namespace> U+001F <key>` for a key), so that every replica's replay cache forgets it.
pub(super) const ERASED_CHANNEL: &str = "idempotency_erased";

/// The health probe's write, and whether the session is read-only. A transactional logical
/// message is a WAL record that needs a transaction id, so its commit waits for a synchronous
/// standby exactly as a call's does; `txid_current()` would not do (PostgreSQL waits for a
/// standby only when the transaction wrote WAL before its commit record), and neither does a
/// read. A standby refuses it (it cannot assign a transaction id). Nothing is stored in any
/// table; logical decoding sees a message with the prefix `idempotency-coordinator`, which
/// no consumer needs to read. Any role may call it (PUBLIC has EXECUTE).
pub(super) const WRITE_PROBE: &str = "SELECT pg_logical_emit_message(true, \
     'idempotency-coordinator', 'probe')::text, current_setting('transaction_read_only')";

/// Whether this session's commits wait for a synchronous standby, and how many are attached:
/// `synchronous_commit` (`on`, `remote_write` and `remote_apply` wait; `local` and `off` do
/// not), `synchronous_standby_names` (no name: nothing to wait for), and the standbys
/// `pg_stat_replication` lists as `sync` or `quorum`. A role without `pg_monitor` sees the
/// standbys but not their state (NULL), counted apart as unknown. Last, every standby.
pub(super) const DURABILITY: &str = "SELECT current_setting('synchronous_commit'), \
     current_setting('synchronous_standby_names'), \
     count(*) FILTER (WHERE sync_state IN ('sync', 'quorum')), \
     count(*) FILTER (WHERE sync_state IS NULL), \
     count(*) \
     FROM pg_stat_replication";

/// Whether a new session can write: in recovery (a standby), and read-only by default
/// (libpq's checks for `target_session_attrs=primary` and `read-write`).
pub(super) const SESSION_WRITABLE: &str =
    "SELECT pg_is_in_recovery(), current_setting('transaction_read_only')";

mod admin;
mod held;
mod replicas;
pub(super) use admin::*;
pub(super) use held::HELD_ROWS;
pub(super) use replicas::*;
