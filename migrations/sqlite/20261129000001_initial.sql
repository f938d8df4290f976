-- The embedded store's schema: the same model as migrations/postgres, for one instance.
-- Instants are whole microseconds since the Unix epoch, read from SQLite's clock.

-- A key is IN_PROGRESS while completed_at is NULL and COMPLETED once it is set. A row whose
-- expires_at has passed is ABSENT for every RPC, whether or not the reaper has deleted it yet.
-- A rowid table (not WITHOUT ROWID): responses of up to megabytes would make its b-tree pages
-- overflow otherwise.
CREATE TABLE idempotency_keys (
    namespace        TEXT    NOT NULL,
    key              TEXT    NOT NULL,
    fingerprint      BLOB    NOT NULL,
    lease_token      INTEGER NOT NULL,
    attempt          INTEGER NOT NULL CHECK (attempt >= 1),
    -- NULL when the holder gave no attempt_id: an absent attempt_id never matches.
    attempt_id       TEXT,
    lease_expires_at INTEGER NOT NULL,
    -- NULL: no checkpoint was ever saved; an empty blob is a saved empty checkpoint.
    checkpoint       BLOB,
    response         BLOB,
    completed_at     INTEGER,
    -- The retention the current claim asked for, in microseconds.
    retention_us     INTEGER NOT NULL,
    expires_at       INTEGER NOT NULL,
    CHECK ((completed_at IS NULL) = (response IS NULL))
);

CREATE UNIQUE INDEX idempotency_keys_scope_key ON idempotency_keys (namespace, key);
CREATE INDEX idempotency_keys_expires_at ON idempotency_keys (expires_at);

CREATE TABLE processed_events (
    consumer     TEXT    NOT NULL,
    event_id     TEXT    NOT NULL,
    processed_at INTEGER NOT NULL,
    expires_at   INTEGER NOT NULL,
    PRIMARY KEY (consumer, event_id)
) WITHOUT ROWID;

CREATE INDEX processed_events_expires_at ON processed_events (expires_at);

-- Fencing tokens: one counter, strictly increasing, never reused, even after a key is released
-- or expires.
CREATE TABLE lease_token_seq (
    only_row   INTEGER PRIMARY KEY CHECK (only_row = 1),
    last_value INTEGER NOT NULL
);

INSERT INTO lease_token_seq (only_row, last_value) VALUES (1, 0);
