-- Who holds a key, and since when: the same model as migrations/postgres/20261205000001_holder.sql.
-- `claimed_at` in microseconds since the epoch, like every instant of this store; both NULL for
-- rows claimed before this migration.
ALTER TABLE idempotency_keys ADD COLUMN claimed_at INTEGER;
ALTER TABLE idempotency_keys ADD COLUMN holder TEXT;
