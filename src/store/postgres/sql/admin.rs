//! The admin API's statements (`store/postgres/admin.rs`): listings and their filters, a key's
//! record, a namespace's counts, ForceRelease, the erasures' batches, the audit trail. Written
//! with the macros of `sql/mod.rs`, which this module follows.

/// A key's state code (`AdminKeyState::code`) by `$now`: completed (3); released by an
/// operator and not claimed since (4: its token is still the one ForceRelease gave it); its
/// lease run out (2, stuck); else in progress (1).
macro_rules! state_code {
    ($now:literal) => {
        concat!(
            "CASE WHEN completed_at IS NOT NULL THEN 3 \
             WHEN released_token = lease_token THEN 4 WHEN lease_expires_at <= ",
            $now,
            " THEN 2 ELSE 1 END"
        )
    };
}

/// The columns of `AdminKeyRow`: a key's summary (sizes, not bytes) and its state by `$now`.
macro_rules! summary_columns {
    ($now:literal) => {
        concat!(
            "key, ",
            state_code!($now),
            "::bigint AS state_code, attempt, lease_token, attempt_id, \
             lease_expires_at, completed_at, expires_at, retention_us, fingerprint, \
             coalesce(octet_length(response), 0)::bigint AS response_bytes, \
             octet_length(checkpoint)::bigint AS checkpoint_bytes, claimed_at, holder, \
             released_by, released_at"
        )
    };
}

/// Not released by an operator since its last claim (`released_token` is NULL or older).
macro_rules! not_released {
    () => {
        " AND released_token IS DISTINCT FROM lease_token"
    };
}

/// Keys of namespace `$1` in key order, from `$2` (the prefix, or after the page cursor's key:
/// `$3` says which is greater) to before `$4`; `$5` a state code or 0, `$6`/`$7` completed at
/// or after / before, `$8`/`$9` claimed at or after / before (in progress only); `$10` the page
/// size. Reads the primary key's range.
pub(in crate::store::postgres) const LIST_KEYS_BY_KEY: &str = concat!(
    "SELECT ",
    summary_columns!("now()"),
    " FROM idempotency_keys
WHERE namespace = $1 AND key >= $2 AND key > $3 AND key < $4 AND expires_at > now() AND ",
    gate!("= $1"),
    "
  AND ($5::bigint = 0 OR $5::bigint = ",
    state_code!("now()"),
    ")
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

/// Keys of namespace `$1` whose lease has run out, live, that `$which` selects (appended to
/// the `WHERE`), the longest stuck first, after the cursor (`$2`, `$3`; the first page passes
/// NULL), claimed between `$4` and `$5`, `$6` the page size. Reads
/// `idempotency_keys_in_progress` from its start up to now (the claim time is read from the
/// rows it finds: only the namespace's keys in progress are read, never the table).
macro_rules! run_out_keys {
    ($($which:tt)*) => {
        concat!(
            "SELECT ",
            summary_columns!("now()"),
            " FROM idempotency_keys
WHERE namespace = $1 AND completed_at IS NULL
  AND (lease_expires_at, key) > (coalesce($2::timestamptz, '-infinity'), coalesce($3::text, ''))
  AND lease_expires_at <= now() AND expires_at > now() AND ",
            gate!("= $1"),
            $($which)*,
            claimed_between!(),
            "
ORDER BY lease_expires_at, key
LIMIT $6"
        )
    };
}

/// Stuck keys: not released by an operator ([`run_out_keys!`]).
pub(in crate::store::postgres) const LIST_STUCK_KEYS: &str = run_out_keys!(not_released!());

/// Keys released by an operator and not claimed since ([`run_out_keys!`]: a release ends the
/// lease, so they are among the keys whose lease has run out).
pub(in crate::store::postgres) const LIST_RELEASED_KEYS: &str =
    run_out_keys!(" AND released_token = lease_token");

/// Every key in progress of namespace `$1`, stuck and live, the longest stuck first, like
/// [`LIST_STUCK_KEYS`] without its end at now.
pub(in crate::store::postgres) const LIST_HELD_KEYS: &str = concat!(
    "SELECT ",
    summary_columns!("now()"),
    " FROM idempotency_keys
WHERE namespace = $1 AND completed_at IS NULL
  AND (lease_expires_at, key) > (coalesce($2::timestamptz, '-infinity'), coalesce($3::text, ''))
  AND expires_at > now() AND ",
    gate!("= $1"),
    claimed_between!(),
    "
ORDER BY lease_expires_at, key
LIMIT $6"
);

/// In-progress keys of namespace `$1` whose lease runs, soonest to end first, like
/// [`LIST_STUCK_KEYS`].
pub(in crate::store::postgres) const LIST_IN_PROGRESS_KEYS: &str = concat!(
    "SELECT ",
    summary_columns!("now()"),
    " FROM idempotency_keys
WHERE namespace = $1 AND completed_at IS NULL
  AND (lease_expires_at, key) > (coalesce($2::timestamptz, now()), coalesce($3::text, ''))
  AND lease_expires_at > now() AND expires_at > now() AND ",
    gate!("= $1"),
    claimed_between!(),
    "
ORDER BY lease_expires_at, key
LIMIT $6"
);

/// Completed keys of namespace `$1` by completion time, after the cursor (`$2`, `$3`),
/// completed at or after `$4` and before `$5` (NULL: unbounded), `$6` the page size. Reads
/// `idempotency_keys_completed`.
pub(in crate::store::postgres) const LIST_COMPLETED_KEYS: &str = concat!(
    "SELECT ",
    summary_columns!("now()"),
    " FROM idempotency_keys
WHERE namespace = $1 AND completed_at IS NOT NULL
  AND (completed_at, key) > (coalesce($2::timestamptz, '-infinity'), coalesce($3::text, ''))
  AND completed_at >= coalesce($4::timestamptz, '-infinity')
  AND completed_at < coalesce($5::timestamptz, 'infinity')
  AND expires_at > now() AND ",
    gate!("= $1"),
    "
ORDER BY completed_at, key
LIMIT $6"
);

/// One live key's whole record, its bytes included.
pub(in crate::store::postgres) const GET_KEY: &str = concat!(
    "SELECT ",
    summary_columns!("now()"),
    ", response, checkpoint FROM idempotency_keys
WHERE namespace = $1 AND key = $2 AND expires_at > now() AND ",
    gate!("= $1")
);

/// Namespace `$1`'s counts and bytes (one pass over its live rows), its oldest stuck key (from
/// `idempotency_keys_in_progress`), its live processed events, and the clock. A released key
/// counts as released, not stuck.
pub(in crate::store::postgres) const NAMESPACE_STATS: &str = concat!(
    r#"
SELECT
    count(*) FILTER (WHERE k.completed_at IS NULL AND k.lease_expires_at > now()
                     AND k.released_token IS DISTINCT FROM k.lease_token) AS in_progress,
    count(*) FILTER (WHERE k.completed_at IS NULL AND k.lease_expires_at <= now()
                     AND k.released_token IS DISTINCT FROM k.lease_token) AS stuck,
    count(*) FILTER (WHERE k.completed_at IS NULL
                     AND k.released_token = k.lease_token) AS released,
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
      AND s.released_token IS DISTINCT FROM s.lease_token
    ORDER BY s.lease_expires_at, s.key
    LIMIT 1
) AS oldest ON true
WHERE k.namespace = $1 AND k.expires_at > now() AND "#,
    gate!("= $1"),
    r#"
GROUP BY oldest.key, oldest.lease_expires_at
"#
);

/// A namespace's live processed events alone, with the clock: [`NAMESPACE_STATS`] when the
/// namespace has no live key (its GROUP BY answers no row then). Gated as well: between the
/// two statements a move may have fenced the namespace.
pub(in crate::store::postgres) const NAMESPACE_EVENTS: &str = concat!(
    r#"
SELECT count(*), now() FROM processed_events
WHERE consumer = $1 AND expires_at > now() AND "#,
    gate!("= $1")
);

/// Stuck keys across all namespaces (not the released ones), for the gauges: how many, and how
/// long ago (in microseconds) the oldest one's lease ran out. Reads only
/// `idempotency_keys_in_progress` (in-progress keys), never the table.
pub(in crate::store::postgres) const STUCK_KEYS: &str = r#"
SELECT count(*),
       coalesce((extract(epoch FROM now() - min(lease_expires_at)) * 1000000)::bigint, 0)
FROM idempotency_keys
WHERE completed_at IS NULL AND lease_expires_at <= now() AND expires_at > now()
  AND released_token IS DISTINCT FROM lease_token
"#;

/// ForceRelease: revokes the lease of key `$1`, `$2` if it is in progress and live by the clock
/// read under its lock, whatever its token: the key keeps its row, but with a fresh token that
/// nobody holds (drawn under the row's lock, so above every token the key had), no attempt_id
/// (its holder cannot re-enter) and its lease ended now. Its holder's Complete, Release and
/// ExtendLease are then refused as LEASE_LOST, and the next TryStart takes it over (a greater
/// token, attempt + 1, the checkpoint handed over). The fresh token is kept as the released one,
/// with the operator `$3` and the clock, so that the key shows as released until that claim.
/// Waiters are told. Answers the row as it was.
pub(in crate::store::postgres) const FORCE_RELEASE: &str = concat!(
    "WITH before AS (
    SELECT ",
    summary_columns!("clock_timestamp()"),
    " FROM idempotency_keys
    WHERE namespace = $1 AND key = $2 AND completed_at IS NULL
      AND expires_at > clock_timestamp() AND ",
    gate!("= $1"),
    "
    FOR UPDATE
), revoked AS (
    UPDATE idempotency_keys AS k
    SET (lease_token, released_token) =
            (SELECT n.token, n.token FROM (SELECT nextval('lease_token_seq') AS token) AS n),
        lease_expires_at = least(k.lease_expires_at, clock_timestamp()),
        attempt_id = NULL,
        claim_ticket = NULL,
        holder = NULL,
        released_by = $3,
        released_at = clock_timestamp()
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
pub(in crate::store::postgres) const KEY_COMPLETED: &str = concat!(
    "SELECT completed_at IS NOT NULL FROM idempotency_keys \
     WHERE namespace = $1 AND key = $2 AND expires_at > now() AND ",
    gate!("= $1")
);

/// EraseKey: deletes key `$1`, `$2` in whatever state, announcing it to waiters; answers the row
/// as it was when it was live. The transaction also runs [`ANNOUNCE_ERASED`].
pub(in crate::store::postgres) const ERASE_KEY: &str = concat!(
    "WITH gone AS (
    DELETE FROM idempotency_keys AS k WHERE k.namespace = $1 AND k.key = $2 AND ",
    gate!("= $1"),
    "
    RETURNING ",
    summary_columns!("clock_timestamp()"),
    ", k.expires_at > clock_timestamp() AS live, ",
    notify_watched_key!("k."),
    " AS announced
)
SELECT * FROM gone WHERE live"
);

/// One batch of an erasure of `$table`'s rows of owner `$1` (its `$owner` column) after name
/// `$3` (its `$name` column, part of the primary key), at most `$2` of them: see
/// [`ERASE_KEYS_BATCH`].
macro_rules! erase_batch {
    ($table:literal, $owner:literal, $name:literal) => {
        concat!(
            "
WITH doomed AS (
    SELECT ctid, ",
            $name,
            " FROM ",
            $table,
            "
    WHERE ",
            $owner,
            " = $1 AND ",
            $name,
            " > $3 AND ",
            gate!("= $1"),
            "
    ORDER BY ",
            $name,
            "
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM ",
            $table,
            "
    WHERE ctid = ANY (ARRAY(SELECT ctid FROM doomed))
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone), count(*), max(",
            $name,
            ") FROM doomed
"
        )
    };
}

/// One batch of a namespace's erasure: at most `$2` keys of namespace `$1`, the first ones after
/// key `$3` (`''`, which no key is, from the start), rows another transaction holds skipped, to
/// be taken by a later pass. The key range's start is an index bound, and the delete finds the
/// locked rows by tuple id (see [`reap!`]), so that a batch never reads the index entries of
/// the keys deleted before it: they stay until a vacuum, and while any older snapshot is open a
/// scan that meets them must read each. Answers how many it deleted, how many it locked and the greatest key it locked
/// (where the next batch starts): a row updated since the statement began is locked in a
/// version the delete does not see, and is left behind the cursor for the next pass, without
/// ending this one. The transaction also runs [`ANNOUNCE_ERASED`].
pub(in crate::store::postgres) const ERASE_KEYS_BATCH: &str =
    erase_batch!("idempotency_keys", "namespace", "key");

/// Announces an erasure on [`ERASED_CHANNEL`] when its transaction commits (payload `$1`).
pub(in crate::store::postgres) const ANNOUNCE_ERASED: &str =
    "SELECT pg_notify('idempotency_erased', $1)";

/// One batch of the erasure of consumer `$1`'s processed events, after event id `$3`, like
/// [`ERASE_KEYS_BATCH`].
pub(in crate::store::postgres) const ERASE_EVENTS_BATCH: &str =
    erase_batch!("processed_events", "consumer", "event_id");

/// Whether namespace `$1` still has any key or processed event (rows skipped because they
/// were held, or written since).
pub(in crate::store::postgres) const NAMESPACE_HAS_ROWS: &str = concat!(
    "SELECT EXISTS (SELECT 1 FROM idempotency_keys WHERE namespace = $1) \
     OR EXISTS (SELECT 1 FROM processed_events WHERE consumer = $1) WHERE ",
    gate!("= $1")
);

/// Records an audit event, stamped by the database clock and kept for `$8` microseconds.
pub(in crate::store::postgres) const RECORD_AUDIT: &str = concat!(
    r#"
INSERT INTO admin_audit_events
    (at, actor, action, namespace, key, reason, record_before, outcome, expires_at)
SELECT clock_timestamp(), $1, $2, $3, $4, $5, $6, $7,
       clock_timestamp() + $8 * interval '1 microsecond'
WHERE "#,
    gate!("= $3"),
    r#"
RETURNING id
"#
);

/// Namespace `$1`'s live audit events, newest first, before id `$2` (NULL: from the newest),
/// `$3` at most.
pub(in crate::store::postgres) const LIST_AUDIT: &str = concat!(
    r#"
SELECT id, at, actor, action, namespace, key, reason, record_before, outcome
FROM admin_audit_events
WHERE namespace = $1 AND id < coalesce($2::bigint, 9223372036854775807) AND expires_at > now()
  AND "#,
    gate!("= $1"),
    r#"
  AND ($4::text IS NULL OR key = $4::text) AND ($5::text IS NULL OR actor = $5::text)

ORDER BY id DESC
LIMIT $3
"#
);

/// The reaper's batch of expired audit events.
pub(in crate::store::postgres) const REAP_AUDIT: &str = reap!("admin_audit_events");
