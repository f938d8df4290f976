-- Who holds a key, and since when: each claim records its time (`claimed_at`, the database
-- clock when the claim took the key, the time its lease is counted from) and its caller
-- (`holder`: `token:<name>` when callers present tokens, `cert:<subject>` under mutual TLS,
-- NULL when callers are anonymous). The admin API lists and filters keys by them
-- (docs/contract.md, "The admin API"). Rows claimed before this migration have neither.
--
-- Both columns are written by the claim itself, in the statement that takes the key, so they
-- never describe another claim than the current token's; a re-entry (the holder's own
-- attempt_id) keeps them, like its token. No index: a filter on the claim time reads the
-- in-progress keys of one namespace through `idempotency_keys_in_progress` (or the primary
-- key's range of a key prefix), never the table, and an index of its own would cost every
-- claim an index write.
ALTER TABLE idempotency_keys ADD COLUMN claimed_at timestamptz, ADD COLUMN holder text;

-- TryStart's two functions again, with the holder as their last argument: the same decision
-- table and token rule as migrations/postgres/20261203000001_tokens_drawn_last.sql (whose
-- comments explain them), writing claimed_at and holder wherever a claim takes a key. The
-- functions of that migration stay, as wrappers with no holder, so that a replica of the
-- previous version keeps working during a rolling upgrade (its claims record no holder).

CREATE FUNCTION idempotency_try_start_batch(
    p_namespaces text[], p_keys text[], p_fingerprints bytea[], p_leases_us bigint[],
    p_retentions_us bigint[], p_attempt_ids text[], p_holders text[])
RETURNS TABLE (namespace text, key text, newly_claimed boolean, lease_token bigint,
               attempt integer, attempt_id text, lease_expires_at timestamptz,
               fingerprint bytea, checkpoint bytea, response bytea, completed_at timestamptz,
               retention_us bigint, expires_at timestamptz)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    ticket bigint := nextval('lease_token_seq');
    answered bigint;
BEGIN
    RETURN QUERY
    WITH input AS (
        SELECT * FROM unnest(p_namespaces, p_keys, p_fingerprints, p_leases_us,
                             p_retentions_us, p_attempt_ids, p_holders)
            AS i(namespace, key, fingerprint, lease_us, retention_us, attempt_id, holder)
    ),
    written AS (
        INSERT INTO idempotency_keys AS k
            (namespace, key, fingerprint, lease_token, claim_ticket, attempt, attempt_id,
             lease_expires_at, checkpoint, response, completed_at, retention_us, expires_at,
             claimed_at, holder)
        SELECT r.namespace, r.key, r.fingerprint, r.token, -ticket, 1, r.attempt_id,
               r.at + r.lease_us * interval '1 microsecond', NULL, NULL, NULL, r.retention_us,
               r.at + greatest(r.lease_us, r.retention_us) * interval '1 microsecond',
               r.at, r.holder
        FROM (
            SELECT i.*, nextval('lease_token_seq') AS token, clock_timestamp() AS at
            FROM input AS i
            ORDER BY i.namespace COLLATE "C", i.key COLLATE "C"
        ) AS r
        ON CONFLICT (namespace, key) DO UPDATE SET
            (fingerprint, lease_token, claim_ticket, attempt, attempt_id, lease_expires_at,
             checkpoint, response, completed_at, retention_us, expires_at, claimed_at,
             holder) =
            (SELECT
                CASE t.action WHEN 'fresh' THEN excluded.fingerprint ELSE k.fingerprint END,
                -- Drawn under the row's lock: above the token of whoever held the key before.
                CASE WHEN t.action IN ('fresh', 'takeover') THEN nextval('lease_token_seq')
                     ELSE k.lease_token END,
                CASE WHEN t.action IN ('fresh', 'takeover') THEN ticket
                     ELSE k.claim_ticket END,
                CASE t.action WHEN 'fresh' THEN 1 WHEN 'takeover' THEN k.attempt + 1
                     ELSE k.attempt END,
                CASE WHEN t.action IN ('fresh', 'takeover') THEN excluded.attempt_id
                     ELSE k.attempt_id END,
                CASE t.action
                     WHEN 'reenter' THEN greatest(k.lease_expires_at, t.lease_end)
                     WHEN 'none' THEN k.lease_expires_at
                     ELSE t.lease_end END,
                CASE t.action WHEN 'fresh' THEN NULL ELSE k.checkpoint END,
                CASE t.action WHEN 'fresh' THEN NULL ELSE k.response END,
                CASE t.action WHEN 'fresh' THEN NULL ELSE k.completed_at END,
                CASE WHEN t.action IN ('fresh', 'takeover') THEN excluded.retention_us
                     ELSE k.retention_us END,
                CASE t.action
                     WHEN 'fresh' THEN t.retention_end
                     WHEN 'takeover' THEN greatest(k.expires_at, t.retention_end)
                     WHEN 'reenter' THEN greatest(k.expires_at, t.lease_end)
                     ELSE k.expires_at END,
                CASE WHEN t.action IN ('fresh', 'takeover') THEN locked.at
                     ELSE k.claimed_at END,
                CASE WHEN t.action IN ('fresh', 'takeover') THEN p.holder
                     ELSE k.holder END
             FROM (SELECT i.lease_us, i.retention_us, i.holder FROM input AS i
                   WHERE i.namespace = excluded.namespace AND i.key = excluded.key) AS p
             CROSS JOIN (SELECT clock_timestamp() AS at) AS locked
             CROSS JOIN LATERAL (SELECT
                locked.at + p.lease_us * interval '1 microsecond' AS lease_end,
                locked.at + greatest(p.lease_us, p.retention_us) * interval '1 microsecond'
                    AS retention_end,
                CASE
                    WHEN k.expires_at <= locked.at THEN 'fresh'
                    WHEN k.fingerprint <> excluded.fingerprint THEN 'none'
                    WHEN k.completed_at IS NOT NULL THEN 'none'
                    WHEN k.attempt_id = excluded.attempt_id THEN 'reenter'
                    WHEN k.lease_expires_at > locked.at THEN 'none'
                    ELSE 'takeover'
                END AS action) AS t)
        RETURNING k.namespace, k.key, k.claim_ticket, k.lease_token, k.attempt, k.attempt_id,
                  k.lease_expires_at, k.fingerprint, k.checkpoint, k.response, k.completed_at,
                  k.retention_us, k.expires_at
    ),
    -- What the check needs of every row written: a window over all of them, so that nothing is
    -- answered before the last key is written. This call drew the ticket, one token per key as
    -- it inserted it, and one per key it claimed in the conflict branch.
    checked AS (
        SELECT w.*,
               count(*) FILTER (WHERE w.claim_ticket = ticket) OVER () AS claimed_by_conflict,
               coalesce(bool_or(w.claim_ticket = -ticket AND clock_timestamp()
                       - (w.lease_expires_at - i.lease_us * interval '1 microsecond')
                       > interval '10 milliseconds') OVER (), false) AS waited
        FROM written AS w
        JOIN input AS i ON i.namespace = w.namespace AND i.key = w.key
    )
    -- If the sequence has gone no further than this call's draws, nobody else drew a token
    -- meanwhile, and no token this call drew can have been overtaken; and if no key it inserted
    -- waited for another transaction (within 10 ms a batch inserts its rows unhindered), no
    -- lease was counted from before a wait. Then every row is answered as written; else none is
    -- (the check is the same for every row: the sequence is read once, after the last write).
    -- (It is read by pg_sequence_last_value, not as a table: a scan, which the sessions'
    -- enable_seqscan = off prices past jit_above_cost, would be compiled on every call: 30 ms.)
    SELECT c.namespace::text, c.key::text, coalesce(c.claim_ticket IN (ticket, -ticket), false),
           c.lease_token, c.attempt, c.attempt_id::text, c.lease_expires_at, c.fingerprint,
           c.checkpoint, c.response, c.completed_at, c.retention_us, c.expires_at
    FROM checked AS c
    WHERE NOT c.waited
      AND (SELECT pg_sequence_last_value('lease_token_seq'))
          = ticket + cardinality(p_keys) + c.claimed_by_conflict;
    GET DIAGNOSTICS answered = ROW_COUNT;
    IF answered = cardinality(p_keys) THEN
        RETURN;
    ELSIF answered <> 0 THEN
        RAISE EXCEPTION 'idempotency_try_start_batch answered % of % keys', answered,
            cardinality(p_keys);
    END IF;

    -- Another token was drawn while this call ran, or a key waited. The keys judged in the
    -- conflict branch are answered as they stand now; the keys inserted, rows of this
    -- transaction, draw their tokens again. An insert that waited (for another transaction's
    -- insert or delete of its key) counts its lease and retention from now, when the key became
    -- its own, like a claim that waited for a row's lock; one that did not keeps them, so that
    -- the update changes no indexed column and stays a heap-only one.
    RETURN QUERY
    SELECT k.namespace::text, k.key::text, coalesce(k.claim_ticket = ticket, false),
           k.lease_token, k.attempt, k.attempt_id::text, k.lease_expires_at, k.fingerprint,
           k.checkpoint, k.response, k.completed_at, k.retention_us, k.expires_at
    FROM idempotency_keys AS k
    JOIN unnest(p_namespaces, p_keys) AS i(namespace, key)
      ON k.namespace = i.namespace AND k.key = i.key
    WHERE k.claim_ticket IS DISTINCT FROM -ticket;

    RETURN QUERY
    UPDATE idempotency_keys AS k
    SET (lease_token, lease_expires_at, expires_at, claimed_at) =
        (SELECT nextval('lease_token_seq'),
                CASE WHEN n.waited THEN n.at + i.lease_us * interval '1 microsecond'
                     ELSE k.lease_expires_at END,
                CASE WHEN n.waited
                     THEN n.at + greatest(i.lease_us, k.retention_us) * interval '1 microsecond'
                     ELSE k.expires_at END,
                CASE WHEN n.waited THEN n.at ELSE k.claimed_at END
         FROM (SELECT c.at, c.at - (k.lease_expires_at - i.lease_us * interval '1 microsecond')
                                > interval '1 millisecond' AS waited
               FROM (SELECT clock_timestamp() AS at) AS c) AS n)
    FROM unnest(p_namespaces, p_keys, p_leases_us) AS i(namespace, key, lease_us)
    WHERE k.namespace = i.namespace AND k.key = i.key AND k.claim_ticket = -ticket
    RETURNING k.namespace::text, k.key::text, true, k.lease_token, k.attempt,
              k.attempt_id::text, k.lease_expires_at, k.fingerprint, k.checkpoint, k.response,
              k.completed_at, k.retention_us, k.expires_at;
END
$$;

-- TryStart for one key. Most TryStarts are of absent keys: a plain insert claims one without
-- the conflict branch, which PostgreSQL would set up on every call; a key that has a row is
-- judged by the batch function.
CREATE FUNCTION idempotency_try_start(
    p_namespace text, p_key text, p_fingerprint bytea, p_lease_us bigint,
    p_retention_us bigint, p_attempt_id text, p_holder text)
RETURNS TABLE (newly_claimed boolean, lease_token bigint, attempt integer, attempt_id text,
               lease_expires_at timestamptz, fingerprint bytea, checkpoint bytea,
               response bytea, completed_at timestamptz, retention_us bigint,
               expires_at timestamptz)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    started_at timestamptz := clock_timestamp();
    claimed idempotency_keys;
BEGIN
    INSERT INTO idempotency_keys AS k
        (namespace, key, fingerprint, lease_token, claim_ticket, attempt, attempt_id,
         lease_expires_at, checkpoint, response, completed_at, retention_us, expires_at,
         claimed_at, holder)
    VALUES (p_namespace, p_key, p_fingerprint, nextval('lease_token_seq'), NULL, 1, p_attempt_id,
            started_at + p_lease_us * interval '1 microsecond', NULL, NULL, NULL,
            p_retention_us,
            started_at + greatest(p_lease_us, p_retention_us) * interval '1 microsecond',
            started_at, p_holder)
    ON CONFLICT (namespace, key) DO NOTHING
    RETURNING k.* INTO claimed;
    IF FOUND THEN
        -- Nobody drew a token since this one: it stands (see above), unless the insert waited
        -- (see the batch function).
        IF pg_sequence_last_value('lease_token_seq') = claimed.lease_token
           AND clock_timestamp() - started_at <= interval '10 milliseconds' THEN
            newly_claimed := true;
            lease_token := claimed.lease_token;
            attempt := claimed.attempt;
            attempt_id := claimed.attempt_id;
            lease_expires_at := claimed.lease_expires_at;
            fingerprint := claimed.fingerprint;
            checkpoint := claimed.checkpoint;
            response := claimed.response;
            completed_at := claimed.completed_at;
            retention_us := claimed.retention_us;
            expires_at := claimed.expires_at;
            RETURN NEXT;
            RETURN;
        END IF;
        -- Another token was drawn meanwhile, or the insert waited: the row, now this
        -- transaction's, draws its token again, and an insert that waited counts its lease from
        -- now (see the batch function).
        RETURN QUERY
        UPDATE idempotency_keys AS k
        SET (lease_token, claim_ticket, lease_expires_at, expires_at, claimed_at) =
            (n.token, n.token,
             CASE WHEN n.waited THEN n.at + p_lease_us * interval '1 microsecond'
                  ELSE k.lease_expires_at END,
             CASE WHEN n.waited
                  THEN n.at + greatest(p_lease_us, p_retention_us) * interval '1 microsecond'
                  ELSE k.expires_at END,
             CASE WHEN n.waited THEN n.at ELSE k.claimed_at END)
        FROM (SELECT nextval('lease_token_seq') AS token, c.at,
                     c.at - started_at > interval '1 millisecond' AS waited
              FROM (SELECT clock_timestamp() AS at) AS c) AS n
        WHERE k.namespace = p_namespace AND k.key = p_key
        RETURNING true, k.lease_token, k.attempt, k.attempt_id::text, k.lease_expires_at,
                  k.fingerprint, k.checkpoint, k.response, k.completed_at, k.retention_us,
                  k.expires_at;
        RETURN;
    END IF;
    RETURN QUERY
    SELECT b.newly_claimed, b.lease_token, b.attempt, b.attempt_id, b.lease_expires_at,
           b.fingerprint, b.checkpoint, b.response, b.completed_at, b.retention_us,
           b.expires_at
    FROM idempotency_try_start_batch(ARRAY[p_namespace], ARRAY[p_key], ARRAY[p_fingerprint],
                                     ARRAY[p_lease_us], ARRAY[p_retention_us],
                                     ARRAY[p_attempt_id], ARRAY[p_holder]) AS b;
END
$$;

-- The previous signatures, for replicas of the previous version during a rolling upgrade.
CREATE OR REPLACE FUNCTION idempotency_try_start_batch(
    p_namespaces text[], p_keys text[], p_fingerprints bytea[], p_leases_us bigint[],
    p_retentions_us bigint[], p_attempt_ids text[])
RETURNS TABLE (namespace text, key text, newly_claimed boolean, lease_token bigint,
               attempt integer, attempt_id text, lease_expires_at timestamptz,
               fingerprint bytea, checkpoint bytea, response bytea, completed_at timestamptz,
               retention_us bigint, expires_at timestamptz)
LANGUAGE sql AS $$
    SELECT * FROM idempotency_try_start_batch(p_namespaces, p_keys, p_fingerprints, p_leases_us,
        p_retentions_us, p_attempt_ids, array_fill(NULL::text, ARRAY[cardinality(p_keys)]))
$$;

CREATE OR REPLACE FUNCTION idempotency_try_start(
    p_namespace text, p_key text, p_fingerprint bytea, p_lease_us bigint,
    p_retention_us bigint, p_attempt_id text)
RETURNS TABLE (newly_claimed boolean, lease_token bigint, attempt integer, attempt_id text,
               lease_expires_at timestamptz, fingerprint bytea, checkpoint bytea,
               response bytea, completed_at timestamptz, retention_us bigint,
               expires_at timestamptz)
LANGUAGE sql AS $$
    SELECT * FROM idempotency_try_start(p_namespace, p_key, p_fingerprint, p_lease_us,
        p_retention_us, p_attempt_id, NULL::text)
$$;
