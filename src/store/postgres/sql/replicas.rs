//! The replicas' heartbeat and an erasure's acknowledgements (`postgres::replicas`).

/// The channel on which an eraser asks every replica to acknowledge (`barrier <id>`) and each
/// replica acknowledges (`ack <id> <replica>`). A replica's own heartbeat is announced on a
/// channel of its own ([`own_channel`]), so that nobody else hears it.
pub(in crate::store::postgres) const REPLICAS_CHANNEL: &str = "idempotency_replicas";

/// The channel on which replica `replica` (its id as 32 hex digits) hears its own heartbeat.
pub(in crate::store::postgres) fn own_channel(replica: &str) -> String {
    format!("idempotency_replica_{replica}")
}

/// A replica's heartbeat: its row ($1, a uuid) seen now by the database clock, and `$3`
/// announced on its own channel `$2`. Delivered in commit order after every erasure committed
/// before it, so that hearing it says that this replica has heard those. Committed without
/// waiting for the flush or a standby: a lost heartbeat only makes the replica look gone. A
/// heartbeat that commits late never moves its row back in time.
pub(in crate::store::postgres) const BEAT: &str = r#"
WITH quick AS (
    SELECT set_config('synchronous_commit', 'off', true) AS setting
), seen AS (
    INSERT INTO idempotency_replicas (replica, seen_at) VALUES ($1::uuid, now())
    ON CONFLICT (replica) DO UPDATE
    SET seen_at = greatest(idempotency_replicas.seen_at, excluded.seen_at)
)
SELECT pg_notify($2, $3) FROM quick
"#;

/// Announces each of the payloads `$1` (acknowledgements) on [`REPLICAS_CHANNEL`].
pub(in crate::store::postgres) const ACKNOWLEDGE: &str = r#"
WITH quick AS (
    SELECT set_config('synchronous_commit', 'off', true) AS setting
)
SELECT pg_notify('idempotency_replicas', payload) FROM quick, unnest($1::text[]) AS payload
"#;

/// An eraser's request to every replica to acknowledge (payload `$1`), on [`REPLICAS_CHANNEL`],
/// and the replicas whose heartbeat the database clock saw within the last `$2` seconds (one
/// row, their ids in an array). Committed without waiting for the flush or a standby, so that
/// the announcements queued behind it (every replica's heartbeat) do not wait for those either;
/// a lost request only makes the eraser wait its whole bound.
pub(in crate::store::postgres) const ASK_ACKNOWLEDGEMENTS: &str = r#"
WITH quick AS (
    SELECT set_config('synchronous_commit', 'off', true) AS setting
), announced AS (
    SELECT pg_notify('idempotency_replicas', $1) FROM quick
)
SELECT array(
    SELECT replace(replica::text, '-', '') FROM idempotency_replicas
    WHERE seen_at > now() - make_interval(secs => $2)
) FROM announced
"#;

/// A replica's row (`$1`), deleted as it shuts down: erasures need not wait for it any more.
pub(in crate::store::postgres) const DEPART: &str =
    "DELETE FROM idempotency_replicas WHERE replica = $1::uuid";

/// Forgets the replicas the database clock has not seen for `$1` seconds.
pub(in crate::store::postgres) const FORGET_DEPARTED: &str =
    "DELETE FROM idempotency_replicas WHERE seen_at < now() - make_interval(secs => $1)";
