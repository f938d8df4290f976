//! The held-rows probe (`postgres::held`).

/// Which of the named keys ($1 namespaces, $2 keys) and events ($3 consumers, $4 ids) another
/// transaction holds now: each existing row is locked as a write would lock it, skipping
/// those it cannot lock at once (never waiting), and the rows skipped are answered (`true`
/// for a key, `false` for an event). Its locks last only as long as the statement.
pub(in crate::store::postgres) const HELD_ROWS: &str = r#"
WITH wanted_keys AS (
    SELECT * FROM unnest($1::text[], $2::text[]) AS wanted(namespace, key)
), wanted_events AS (
    SELECT * FROM unnest($3::text[], $4::text[]) AS wanted(consumer, event_id)
), free_keys AS (
    SELECT k.namespace, k.key
    FROM idempotency_keys k JOIN wanted_keys w ON (k.namespace, k.key) = (w.namespace, w.key)
    FOR NO KEY UPDATE OF k SKIP LOCKED
), free_events AS (
    SELECT e.consumer, e.event_id
    FROM processed_events e JOIN wanted_events w ON (e.consumer, e.event_id) = (w.consumer, w.event_id)
    FOR NO KEY UPDATE OF e SKIP LOCKED
)
SELECT true, k.namespace, k.key
FROM idempotency_keys k JOIN wanted_keys w ON (k.namespace, k.key) = (w.namespace, w.key)
WHERE NOT EXISTS (SELECT 1 FROM free_keys f WHERE (f.namespace, f.key) = (k.namespace, k.key))
UNION ALL
SELECT false, e.consumer, e.event_id
FROM processed_events e JOIN wanted_events w ON (e.consumer, e.event_id) = (w.consumer, w.event_id)
WHERE NOT EXISTS (SELECT 1 FROM free_events f WHERE (f.consumer, f.event_id) = (e.consumer, e.event_id))
"#;
