-- A ticket per claim attempt: the value a TryStart statement drew when it began, stored by the
-- statement that claimed the key. It tells a statement whether it was the one that claimed a
-- key, while the fencing token itself is drawn only once the key's row is locked, so that a
-- statement that waited for the lock can never hand out a token older than the key's current
-- one.
ALTER TABLE idempotency_keys ADD COLUMN claim_ticket bigint;
