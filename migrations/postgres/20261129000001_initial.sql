-- The coordinator's schema. Every instant stored here comes from the database clock (now()),
-- never from a replica's clock, so replicas whose clocks disagree still agree on leases.

-- One global sequence for fencing tokens: strictly increasing and never reused, even after a key
-- is released or expires, so a token from a key's earlier life can never match a new claim.
CREATE SEQUENCE lease_token_seq AS bigint START WITH 1 NO CYCLE;

-- A key is IN_PROGRESS while completed_at is NULL and COMPLETED once it is set. A row whose
-- expires_at has passed is ABSENT for every RPC, whether or not the reaper has deleted it yet.
CREATE TABLE idempotency_keys (
    namespace        text COLLATE "C" NOT NULL,
    key              text COLLATE "C" NOT NULL,
    fingerprint      bytea            NOT NULL,
    lease_token      bigint           NOT NULL,
    attempt          integer          NOT NULL,
    -- NULL when the holder gave no attempt_id: an absent attempt_id never matches.
    attempt_id       text COLLATE "C",
    lease_expires_at timestamptz      NOT NULL,
    -- NULL: no checkpoint was ever saved; an empty bytea is a saved empty checkpoint.
    checkpoint       bytea,
    response         bytea,
    completed_at     timestamptz,
    -- The retention the current claim asked for, in microseconds: a Complete without its own
    -- retention keeps the key this long after completion.
    retention_us     bigint           NOT NULL,
    expires_at       timestamptz      NOT NULL,
    PRIMARY KEY (namespace, key),
    CONSTRAINT completed_has_response CHECK ((completed_at IS NULL) = (response IS NULL)),
    CONSTRAINT positive_attempt CHECK (attempt >= 1)
);

-- The reaper's scan: oldest expiries first, without touching live rows.
CREATE INDEX idempotency_keys_expires_at ON idempotency_keys (expires_at);

CREATE TABLE processed_events (
    consumer     text COLLATE "C" NOT NULL,
    event_id     text COLLATE "C" NOT NULL,
    processed_at timestamptz      NOT NULL,
    expires_at   timestamptz      NOT NULL,
    -- The MarkProcessed call that first recorded this event (one value of mark_batch_seq per
    -- call), so the statement can tell a row it created from one it found.
    mark_batch   bigint           NOT NULL,
    PRIMARY KEY (consumer, event_id)
);

CREATE INDEX processed_events_expires_at ON processed_events (expires_at);

CREATE SEQUENCE mark_batch_seq AS bigint START WITH 1 NO CYCLE;
