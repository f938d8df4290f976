"""The example's own tables (not the coordinator's), created at start under an advisory lock so
that components starting together do not race on CREATE TABLE."""

from __future__ import annotations

import psycopg

# The orders service's database: orders and its outbox, written in one transaction.
ORDERS = """
CREATE TABLE IF NOT EXISTS orders (
    id              uuid PRIMARY KEY,
    -- The client's Idempotency-Key. Unique, because the coordinator cannot share this
    -- database's transaction: a holder that committed and died before Complete leaves the key
    -- in progress, and whoever takes it over must find this order rather than make another.
    idempotency_key text NOT NULL UNIQUE,
    customer_id     text NOT NULL,
    amount_cents    bigint NOT NULL CHECK (amount_cents > 0),
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS outbox (
    id           uuid PRIMARY KEY,          -- the event id consumers deduplicate on
    aggregate_id uuid NOT NULL,
    event_type   text NOT NULL,
    payload      jsonb NOT NULL,
    status       text NOT NULL DEFAULT 'PENDING'
                 CHECK (status IN ('PENDING', 'PUBLISHING', 'PUBLISHED')),
    claims       integer NOT NULL DEFAULT 0, -- how many times a relay took it: 2+ = republished
    created_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    locked_at    timestamptz,
    published_at timestamptz
);
CREATE INDEX IF NOT EXISTS outbox_pending ON outbox (created_at) WHERE status = 'PENDING';
CREATE INDEX IF NOT EXISTS outbox_publishing ON outbox (locked_at) WHERE status = 'PUBLISHING';
"""

# The notifications service's database.
NOTIFICATIONS = """
CREATE TABLE IF NOT EXISTS inbox (
    event_id   text PRIMARY KEY,  -- one message per event however often it is handled
    order_id   text NOT NULL,
    message    text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
-- One row per delivery the consumer handled, and whether the coordinator saw the event for the
-- first time: the example's own record of redeliveries, for the report.
CREATE TABLE IF NOT EXISTS delivery (
    id          bigserial PRIMARY KEY,
    event_id    text NOT NULL,
    first_time  boolean NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now()
);
"""

_LOCK = 7_314_159  # any constant: it only serialises this file's DDL


def ensure(url: str, ddl: str) -> None:
    with psycopg.connect(url, autocommit=True) as connection, connection.transaction():
        connection.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK,))
        connection.execute(ddl.encode())
