-- Who released a key by force, and when: the same model as
-- migrations/postgres/20261206000001_released.sql. `released_at` in microseconds since the
-- epoch, like every instant of this store.
ALTER TABLE idempotency_keys ADD COLUMN released_token INTEGER;
ALTER TABLE idempotency_keys ADD COLUMN released_by TEXT;
ALTER TABLE idempotency_keys ADD COLUMN released_at INTEGER;
