-- The admin API (proto/idempotency/v1/admin.proto): its indexes, and the audit trail.

-- Listing in-progress and stuck keys of a namespace by lease expiry (the longest stuck first),
-- and the stuck-keys gauges, which read only this index's rows: in-progress keys, a small part
-- of the table (completed keys are not in it). `expires_at` rides along so that a key past its
-- retention (absent, not yet reaped) is skipped without reading its row.
CREATE INDEX idempotency_keys_in_progress
    ON idempotency_keys (namespace, lease_expires_at, key) INCLUDE (expires_at)
    WHERE completed_at IS NULL;

-- Listing completed keys of a namespace by completion time, and by completed before/after.
-- Listing by key (all states, a key prefix) reads the primary key (namespace, key).
CREATE INDEX idempotency_keys_completed
    ON idempotency_keys (namespace, completed_at, key)
    WHERE completed_at IS NOT NULL;

-- Every admin change: who, when (the database clock), what, why, and the key's record before
-- it (JSON, built by the service). Kept until expires_at (--audit-retention when recorded),
-- then deleted by the reaper.
CREATE TABLE admin_audit_events (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at            timestamptz      NOT NULL,
    actor         text             NOT NULL,
    action        text             NOT NULL,
    namespace     text COLLATE "C" NOT NULL,
    key           text COLLATE "C",
    reason        text             NOT NULL,
    record_before text,
    outcome       text,
    expires_at    timestamptz      NOT NULL
);

-- ListAuditEvents: one namespace's events, newest first.
CREATE INDEX admin_audit_events_namespace ON admin_audit_events (namespace, id);
-- The reaper's scan.
CREATE INDEX admin_audit_events_expires_at ON admin_audit_events (expires_at);
