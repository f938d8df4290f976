-- Who released a key by force (the admin API's ForceRelease), and when: so that the admin
-- API shows a released key as released, not as stuck, until the next claim takes it over
-- (docs/contract.md, "The admin API").
--
-- ForceRelease writes `released_token` (the fresh token it gave the key, which nobody holds),
-- `released_by` (the operator, as the audit trail names them) and `released_at` (the database
-- clock). A key counts as released while `released_token = lease_token`: the next claim draws
-- a greater token, and the key is then held again without any claim writing these columns, so
-- TryStart's functions stay as they are. Expand only: three nullable columns, which the
-- previous release neither reads nor writes (its ForceRelease leaves them NULL, and its keys
-- show as stuck, as before). No index: a listing of released keys reads the in-progress keys
-- of one namespace through `idempotency_keys_in_progress`, like the stuck keys.
ALTER TABLE idempotency_keys
    ADD COLUMN released_token bigint,
    ADD COLUMN released_by text,
    ADD COLUMN released_at timestamptz;
