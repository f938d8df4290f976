-- Whether a waiting TryStart watches the key: only then do Complete and Release announce it
-- (pg_notify) to the replicas' listening sessions. A key nobody waits for is not announced,
-- which spares PostgreSQL a notification per completion and every replica's listener a
-- wake-up. Set by a waiter (WATCH_KEY) before it sleeps; it stays set for the row's life, a
-- takeover included. A constant default: no table rewrite.
ALTER TABLE idempotency_keys ADD COLUMN watched boolean NOT NULL DEFAULT false;
