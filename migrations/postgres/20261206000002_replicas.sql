-- The replicas serving this database, as the database's own clock saw them last: each writes
-- its row a few times a second (its heartbeat, `src/store/postgres/replicas.rs`), and an
-- erasure returns only once every replica seen lately has acknowledged it, or once any that
-- has not can no longer serve a replay from memory (docs/contract.md, "The admin API").
--
-- Expand only: a new table, which the previous release neither reads nor writes (its replicas
-- write no heartbeat, and an erasure does not wait for them, as before). A replica's row is
-- written by the replica alone; rows of replicas gone for a day are deleted by the next
-- replica that starts.
CREATE TABLE idempotency_replicas (
    replica uuid PRIMARY KEY,
    seen_at timestamptz NOT NULL
);
