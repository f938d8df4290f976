//! Every statement of the PostgreSQL store. The statements share pieces (the columns of a key,
//! TryStart's decision table), so they are put together here with `concat!` rather than read
//! from separate files.

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
pub(super) const TRY_START: &str =
    "SELECT * FROM idempotency_try_start($1, $2, $3, $4, $5, $6, $7)";

/// TryStart for many keys (distinct) in one call: `idempotency_try_start_batch`, the same
/// table row by row, the keys taken in key order. Its arrays are the columns of [`TRY_START`].
pub(super) const TRY_START_BATCH: &str = "SELECT * FROM idempotency_try_start_batch($1::text[], \
     $2::text[], $3::bytea[], $4::bigint[], $5::bigint[], $6::text[], $7::text[])";

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
    WHERE k.namespace = $1 AND k.key = $2
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
        r#"WITH locked AS MATERIALIZED (
    SELECT namespace, key, lease_token, completed_at, expires_at, retention_us
    FROM idempotency_keys
    WHERE namespace = $1 AND key = $2
    FOR UPDATE
)
"#
    };
}

/// Read after a guarded write (Release, ExtendLease) changed nothing, to say why. Tokens are
/// never reused and a completed key never returns to progress, so what this finds explains the
/// refusal. No response is offered, so a completed key is never "the same completion".
pub(super) const GUARD_STATE: &str = r#"
SELECT lease_token, completed_at, expires_at, false AS same_response
FROM idempotency_keys
WHERE namespace = $1 AND key = $2 AND expires_at > now()
"#;

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
            " FROM idempotency_keys WHERE namespace = $1 AND key = $2 AND expires_at > now()"
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
     WHERE k.namespace = $1 AND k.key = $2 AND NOT k.watched RETURNING ",
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

/// The columns of `AdminKeyRow`: a key's summary (sizes, not bytes) and its state by `$now`.
macro_rules! summary_columns {
    ($now:literal) => {
        concat!(
            "key, CASE WHEN completed_at IS NOT NULL THEN 3 WHEN lease_expires_at <= ",
            $now,
            " THEN 2 ELSE 1 END::bigint AS state_code, attempt, lease_token, attempt_id, \
             lease_expires_at, completed_at, expires_at, retention_us, fingerprint, \
             coalesce(octet_length(response), 0)::bigint AS response_bytes, \
             octet_length(checkpoint)::bigint AS checkpoint_bytes, claimed_at, holder"
        )
    };
}

/// Keys of namespace `$1` in key order, from `$2` (the prefix, or after the page cursor's key:
/// `$3` says which is greater) to before `$4`; `$5` a state code or 0, `$6`/`$7` completed at
/// or after / before, `$8`/`$9` claimed at or after / before (in progress only); `$10` the page
/// size. Reads the primary key's range.
pub(super) const LIST_KEYS_BY_KEY: &str = concat!(
    "SELECT ",
    summary_columns!("now()"),
    " FROM idempotency_keys
WHERE namespace = $1 AND key >= $2 AND key > $3 AND key < $4 AND expires_at > now()
  AND ($5::bigint = 0 OR $5::bigint = CASE WHEN completed_at IS NOT NULL THEN 3
                                      WHEN lease_expires_at <= now() THEN 2 ELSE 1 END)
  AND ($6::timestamptz IS NULL OR completed_at >= $6::timestamptz)
  AND ($7::timestamptz IS NULL OR completed_at < $7::timestamptz)
  AND ($8::timestamptz IS NULL OR (completed_at IS NULL AND claimed_at >= $8::timestamptz))
  AND ($9::timestamptz IS NULL OR (completed_at IS NULL AND claimed_at < $9::timestamptz))
ORDER BY key
LIMIT $10"
);

/// The claim-time filter of the in-progress listings: claimed at or after `$4`, before `$5`
/// (NULL: unbounded). A key claimed before the store recorded claim times has none, and
/// matches no bound.
macro_rules! claimed_between {
    () => {
        "
  AND ($4::timestamptz IS NULL OR claimed_at >= $4::timestamptz)
  AND ($5::timestamptz IS NULL OR claimed_at < $5::timestamptz)"
    };
}

/// Stuck keys of namespace `$1`, the longest stuck first, after the cursor (`$2`, `$3`; the
/// first page passes NULL), claimed between `$4` and `$5`, `$6` the page size. Reads
/// `idempotency_keys_in_progress` from its start up to now (the claim time is read from the
/// rows it finds: only the namespace's keys in progress are read, never the table).
pub(super) const LIST_STUCK_KEYS: &str = concat!(
    "SELECT ",
    summary_columns!("now()"),
    " FROM idempotency_keys
WHERE namespace = $1 AND completed_at IS NULL
  AND (lease_expires_at, key) > (coalesce($2::timestamptz, '-infinity'), coalesce($3::text, ''))
  AND lease_expires_at <= now() AND expires_at > now()",
    claimed_between!(),
    "
ORDER BY lease_expires_at, key
LIMIT $6"
);

/// Every key in progress of namespace `$1`, stuck and live, the longest stuck first, like
/// [`LIST_STUCK_KEYS`] without its end at now.
pub(super) const LIST_HELD_KEYS: &str = concat!(
    "SELECT ",
    summary_columns!("now()"),
    " FROM idempotency_keys
WHERE namespace = $1 AND completed_at IS NULL
  AND (lease_expires_at, key) > (coalesce($2::timestamptz, '-infinity'), coalesce($3::text, ''))
  AND expires_at > now()",
    claimed_between!(),
    "
ORDER BY lease_expires_at, key
LIMIT $6"
);

/// In-progress keys of namespace `$1` whose lease runs, soonest to end first, like
/// [`LIST_STUCK_KEYS`].
pub(super) const LIST_IN_PROGRESS_KEYS: &str = concat!(
    "SELECT ",
    summary_columns!("now()"),
    " FROM idempotency_keys
WHERE namespace = $1 AND completed_at IS NULL
  AND (lease_expires_at, key) > (coalesce($2::timestamptz, now()), coalesce($3::text, ''))
  AND lease_expires_at > now() AND expires_at > now()",
    claimed_between!(),
    "
ORDER BY lease_expires_at, key
LIMIT $6"
);

/// Completed keys of namespace `$1` by completion time, after the cursor (`$2`, `$3`),
/// completed at or after `$4` and before `$5` (NULL: unbounded), `$6` the page size. Reads
/// `idempotency_keys_completed`.
pub(super) const LIST_COMPLETED_KEYS: &str = concat!(
    "SELECT ",
    summary_columns!("now()"),
    " FROM idempotency_keys
WHERE namespace = $1 AND completed_at IS NOT NULL
  AND (completed_at, key) > (coalesce($2::timestamptz, '-infinity'), coalesce($3::text, ''))
  AND completed_at >= coalesce($4::timestamptz, '-infinity')
  AND completed_at < coalesce($5::timestamptz, 'infinity')
  AND expires_at > now()
ORDER BY completed_at, key
LIMIT $6"
);

/// One live key's whole record, its bytes included.
pub(super) const GET_KEY: &str = concat!(
    "SELECT ",
    summary_columns!("now()"),
    ", response, checkpoint FROM idempotency_keys
WHERE namespace = $1 AND key = $2 AND expires_at > now()"
);

/// Namespace `$1`'s counts and bytes (one pass over its live rows), its oldest stuck key (from
/// `idempotency_keys_in_progress`), its live processed events, and the clock.
pub(super) const NAMESPACE_STATS: &str = r#"
SELECT
    count(*) FILTER (WHERE k.completed_at IS NULL AND k.lease_expires_at > now()) AS in_progress,
    count(*) FILTER (WHERE k.completed_at IS NULL AND k.lease_expires_at <= now()) AS stuck,
    count(*) FILTER (WHERE k.completed_at IS NOT NULL) AS completed,
    coalesce(sum(octet_length(k.key) + octet_length(k.fingerprint)
                 + coalesce(octet_length(k.response), 0)
                 + coalesce(octet_length(k.checkpoint), 0)), 0)::bigint AS stored_bytes,
    (SELECT count(*) FROM processed_events AS e
     WHERE e.consumer = $1 AND e.expires_at > now()) AS processed_events,
    oldest.key AS oldest_stuck_key,
    oldest.lease_expires_at AS oldest_stuck_at,
    now() AS read_at
FROM idempotency_keys AS k
LEFT JOIN LATERAL (
    SELECT s.key, s.lease_expires_at FROM idempotency_keys AS s
    WHERE s.namespace = $1 AND s.completed_at IS NULL
      AND s.lease_expires_at <= now() AND s.expires_at > now()
    ORDER BY s.lease_expires_at, s.key
    LIMIT 1
) AS oldest ON true
WHERE k.namespace = $1 AND k.expires_at > now()
GROUP BY oldest.key, oldest.lease_expires_at
"#;

/// Stuck keys across all namespaces, for the gauges: how many, and how long ago (in
/// microseconds) the oldest one's lease ran out. Reads only `idempotency_keys_in_progress`
/// (in-progress keys), never the table.
pub(super) const STUCK_KEYS: &str = r#"
SELECT count(*),
       coalesce((extract(epoch FROM now() - min(lease_expires_at)) * 1000000)::bigint, 0)
FROM idempotency_keys
WHERE completed_at IS NULL AND lease_expires_at <= now() AND expires_at > now()
"#;

/// ForceRelease: revokes the lease of key `$1`, `$2` if it is in progress and live by the clock
/// read under its lock, whatever its token: the key keeps its row, but with a fresh token that
/// nobody holds (drawn under the row's lock, so above every token the key had), no attempt_id
/// (its holder cannot re-enter) and its lease ended now. Its holder's Complete, Release and
/// ExtendLease are then refused as LEASE_LOST, and the next TryStart takes it over (a greater
/// token, attempt + 1, the checkpoint handed over). Waiters are told. Answers the row as it was.
pub(super) const FORCE_RELEASE: &str = concat!(
    "WITH before AS (
    SELECT ",
    summary_columns!("clock_timestamp()"),
    " FROM idempotency_keys
    WHERE namespace = $1 AND key = $2 AND completed_at IS NULL
      AND expires_at > clock_timestamp()
    FOR UPDATE
), revoked AS (
    UPDATE idempotency_keys AS k
    SET lease_token = nextval('lease_token_seq'),
        lease_expires_at = least(k.lease_expires_at, clock_timestamp()),
        attempt_id = NULL,
        claim_ticket = NULL,
        holder = NULL
    FROM before AS b
    WHERE k.namespace = $1 AND k.key = b.key
    RETURNING k.lease_token AS revoked_token, ",
    notify_watched_key!("k."),
    " AS announced
)
SELECT before.*, revoked.revoked_token FROM before, revoked"
);

/// Whether live key `$1`, `$2` is completed (no row: absent), to explain a ForceRelease that
/// changed nothing.
pub(super) const KEY_COMPLETED: &str = "SELECT completed_at IS NOT NULL FROM idempotency_keys \
     WHERE namespace = $1 AND key = $2 AND expires_at > now()";

/// EraseKey: deletes key `$1`, `$2` in whatever state, announcing it to waiters; answers the row
/// as it was when it was live. The transaction also runs [`ANNOUNCE_ERASED`].
pub(super) const ERASE_KEY: &str = concat!(
    "WITH gone AS (
    DELETE FROM idempotency_keys AS k WHERE k.namespace = $1 AND k.key = $2
    RETURNING ",
    summary_columns!("clock_timestamp()"),
    ", k.expires_at > clock_timestamp() AS live, ",
    notify_watched_key!("k."),
    " AS announced
)
SELECT * FROM gone WHERE live"
);

/// One batch of a namespace's erasure: at most `$2` keys of namespace `$1`, the first ones after
/// key `$3` (`''`, which no key is, from the start), rows another transaction holds skipped, to
/// be taken by a later pass. The key range's start is an index bound, and the delete finds the
/// locked rows by tuple id (see [`reap!`]), so that a batch never reads the index entries of
/// the keys deleted before it: they stay until a vacuum, and while any older snapshot is open a
/// scan that meets them must read each. Answers how many it deleted, how many it locked and the greatest key it locked
/// (where the next batch starts): a row updated since the statement began is locked in a
/// version the delete does not see, and is left behind the cursor for the next pass, without
/// ending this one. The transaction also runs [`ANNOUNCE_ERASED`].
pub(super) const ERASE_KEYS_BATCH: &str = r#"
WITH doomed AS (
    SELECT ctid, key FROM idempotency_keys
    WHERE namespace = $1 AND key > $3
    ORDER BY key
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM idempotency_keys
    WHERE ctid = ANY (ARRAY(SELECT ctid FROM doomed))
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone), count(*), max(key) FROM doomed
"#;

/// Announces an erasure on [`ERASED_CHANNEL`] when its transaction commits (payload `$1`).
pub(super) const ANNOUNCE_ERASED: &str = "SELECT pg_notify('idempotency_erased', $1)";

/// One batch of the erasure of consumer `$1`'s processed events, after event id `$3`, like
/// [`ERASE_KEYS_BATCH`].
pub(super) const ERASE_EVENTS_BATCH: &str = r#"
WITH doomed AS (
    SELECT ctid, event_id FROM processed_events
    WHERE consumer = $1 AND event_id > $3
    ORDER BY event_id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM processed_events
    WHERE ctid = ANY (ARRAY(SELECT ctid FROM doomed))
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone), count(*), max(event_id) FROM doomed
"#;

/// Whether namespace `$1` still has any key or processed event (rows skipped because they
/// were held, or written since).
pub(super) const NAMESPACE_HAS_ROWS: &str = "SELECT \
     EXISTS (SELECT 1 FROM idempotency_keys WHERE namespace = $1) \
     OR EXISTS (SELECT 1 FROM processed_events WHERE consumer = $1)";

/// Records an audit event, stamped by the database clock and kept for `$8` microseconds.
pub(super) const RECORD_AUDIT: &str = r#"
INSERT INTO admin_audit_events
    (at, actor, action, namespace, key, reason, record_before, outcome, expires_at)
VALUES (clock_timestamp(), $1, $2, $3, $4, $5, $6, $7,
        clock_timestamp() + $8 * interval '1 microsecond')
RETURNING id
"#;

/// Namespace `$1`'s live audit events, newest first, before id `$2` (NULL: from the newest),
/// `$3` at most.
pub(super) const LIST_AUDIT: &str = r#"
SELECT id, at, actor, action, namespace, key, reason, record_before, outcome
FROM admin_audit_events
WHERE namespace = $1 AND id < coalesce($2::bigint, 9223372036854775807) AND expires_at > now()
ORDER BY id DESC
LIMIT $3
"#;

/// The reaper's batch of expired audit events.
pub(super) const REAP_AUDIT: &str = reap!("admin_audit_events");

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
