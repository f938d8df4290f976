-- The admin API (proto/idempotency/v1/admin.proto): its indexes, and the audit trail; the same
-- model as migrations/postgres/20261204000001_admin.sql.

-- In-progress and stuck keys of a namespace by lease expiry; the stuck-keys gauges.
CREATE INDEX idempotency_keys_in_progress
    ON idempotency_keys (namespace, lease_expires_at, key, expires_at)
    WHERE completed_at IS NULL;

-- Completed keys of a namespace by completion time.
CREATE INDEX idempotency_keys_completed
    ON idempotency_keys (namespace, completed_at, key)
    WHERE completed_at IS NOT NULL;

CREATE TABLE admin_audit_events (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    at            INTEGER NOT NULL,
    actor         TEXT    NOT NULL,
    action        TEXT    NOT NULL,
    namespace     TEXT    NOT NULL,
    key           TEXT,
    reason        TEXT    NOT NULL,
    record_before TEXT,
    outcome       TEXT,
    expires_at    INTEGER NOT NULL
);

CREATE INDEX admin_audit_events_namespace ON admin_audit_events (namespace, id);
CREATE INDEX admin_audit_events_expires_at ON admin_audit_events (expires_at);
