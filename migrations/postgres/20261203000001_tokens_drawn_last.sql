-- TryStart as two functions, so that no claim carries a fencing token drawn before the row that
-- carries it was written.
--
-- Why functions: a new claim of an absent key is an INSERT, and an INSERT computes its values
-- (a token drawn with nextval among them) before it checks the primary key, where it may wait
-- for another transaction's uncommitted insert of the same key, or its backend may simply be
-- paused. If that row is then committed, its holder's token drawn, and the row deleted again
-- (Release, the reaper) before the insert goes on, the insert would store a token lower than
-- one the key already had. So a fresh row is inserted with the placeholder token 0 (tokens
-- start at 1), and its token is drawn by the UPDATE that follows, in the same call: the row is
-- then this transaction's own, uncommitted and locked, and every earlier claim of the key drew
-- its token before its row was written, so before that row was deleted, so before this insert.
-- A claim that finds the key's row takes the ON CONFLICT branch, which draws a new token only
-- once it holds that row's lock. Two statements in one call: one round trip, as before.
--
-- The placeholder is never seen: the row is invisible to others until the call's transaction
-- commits, and the call never ends before its UPDATE. The decision table lives here, once; the
-- lone function hands a key that has a row to the batch function.

-- TryStart for many keys (distinct within a call) in one call. Row by row it is the contract's
-- TryStart order on the key's row as it stands once its lock is held, by the clock read then:
--   fresh    the row's retention is over: the key is absent, claim it anew (attempt 1);
--   none     another fingerprint, a completed key, or a lease still running: change nothing;
--   reenter  the holder's own attempt_id: same token, lease renewed to the later expiry;
--   takeover the lease ran out: new token, attempt + 1, checkpoint handed over.
-- The rows are inserted in key order (COLLATE "C"), the order every statement that locks
-- several keys takes them in, and each reads the clock only when its turn comes (volatile
-- columns are computed above the sort, as the insert pulls each row). The call draws one
-- ticket, stored by every claim it makes, by which it recognises its claims (`newly_claimed`).
-- The update of a `none` row always happens, so that RETURNING reports the row as it stands
-- under the lock, never a stale snapshot.
CREATE FUNCTION idempotency_try_start_batch(
    p_namespaces text[], p_keys text[], p_fingerprints bytea[], p_leases_us bigint[],
    p_retentions_us bigint[], p_attempt_ids text[])
RETURNS TABLE (namespace text, key text, newly_claimed boolean, lease_token bigint,
               attempt integer, attempt_id text, lease_expires_at timestamptz,
               fingerprint bytea, checkpoint bytea, response bytea, completed_at timestamptz,
               retention_us bigint, expires_at timestamptz)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    ticket bigint := nextval('lease_token_seq');
    judged bigint;
BEGIN
    RETURN QUERY
    WITH input AS (
        SELECT * FROM unnest(p_namespaces, p_keys, p_fingerprints, p_leases_us,
                             p_retentions_us, p_attempt_ids)
            AS i(namespace, key, fingerprint, lease_us, retention_us, attempt_id)
    ),
    claimed AS (
        INSERT INTO idempotency_keys AS k
            (namespace, key, fingerprint, lease_token, claim_ticket, attempt, attempt_id,
             lease_expires_at, checkpoint, response, completed_at, retention_us, expires_at)
        SELECT r.namespace, r.key, r.fingerprint, 0, ticket, 1, r.attempt_id,
               r.at + r.lease_us * interval '1 microsecond', NULL, NULL, NULL, r.retention_us,
               r.at + greatest(r.lease_us, r.retention_us) * interval '1 microsecond'
        FROM (
            SELECT i.*, clock_timestamp() AS at
            FROM input AS i
            ORDER BY i.namespace COLLATE "C", i.key COLLATE "C"
        ) AS r
        ON CONFLICT (namespace, key) DO UPDATE SET
            (fingerprint, lease_token, claim_ticket, attempt, attempt_id, lease_expires_at,
             checkpoint, response, completed_at, retention_us, expires_at) =
            (SELECT
                CASE t.action WHEN 'fresh' THEN excluded.fingerprint ELSE k.fingerprint END,
                -- Drawn under the row's lock: above the token of whoever held the key before.
                CASE WHEN t.action IN ('fresh', 'takeover') THEN nextval('lease_token_seq')
                     ELSE k.lease_token END,
                CASE WHEN t.action IN ('fresh', 'takeover') THEN excluded.claim_ticket
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
                     ELSE k.expires_at END
             FROM (SELECT i.lease_us, i.retention_us FROM input AS i
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
    )
    SELECT c.namespace::text, c.key::text, coalesce(c.claim_ticket = ticket, false),
           c.lease_token, c.attempt, c.attempt_id::text, c.lease_expires_at, c.fingerprint,
           c.checkpoint, c.response, c.completed_at, c.retention_us, c.expires_at
    FROM claimed AS c
    WHERE c.lease_token <> 0;

    -- Every key answered already: none was inserted, nothing is left to draw.
    GET DIAGNOSTICS judged = ROW_COUNT;
    IF judged = cardinality(p_keys) THEN
        RETURN;
    END IF;

    -- The keys inserted above, now rows of this transaction: their tokens are drawn last. An
    -- insert that waited (for another transaction's insert of its key) counts its lease and
    -- retention from now, when the key became its own, like a claim that waited for a row's
    -- lock; one that did not keeps them, so that the update changes no indexed column and
    -- stays a heap-only one.
    RETURN QUERY
    UPDATE idempotency_keys AS k
    SET (lease_token, lease_expires_at, expires_at) =
        (SELECT nextval('lease_token_seq'),
                CASE WHEN n.waited THEN n.at + i.lease_us * interval '1 microsecond'
                     ELSE k.lease_expires_at END,
                CASE WHEN n.waited
                     THEN n.at + greatest(i.lease_us, k.retention_us) * interval '1 microsecond'
                     ELSE k.expires_at END
         FROM (SELECT c.at, c.at - (k.lease_expires_at - i.lease_us * interval '1 microsecond')
                                > interval '1 millisecond' AS waited
               FROM (SELECT clock_timestamp() AS at) AS c) AS n)
    FROM unnest(p_namespaces, p_keys, p_leases_us) AS i(namespace, key, lease_us)
    WHERE k.namespace = i.namespace AND k.key = i.key AND k.lease_token = 0
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
    p_retention_us bigint, p_attempt_id text)
RETURNS TABLE (newly_claimed boolean, lease_token bigint, attempt integer, attempt_id text,
               lease_expires_at timestamptz, fingerprint bytea, checkpoint bytea,
               response bytea, completed_at timestamptz, retention_us bigint,
               expires_at timestamptz)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    claimed_at timestamptz := clock_timestamp();
BEGIN
    INSERT INTO idempotency_keys AS k
        (namespace, key, fingerprint, lease_token, claim_ticket, attempt, attempt_id,
         lease_expires_at, checkpoint, response, completed_at, retention_us, expires_at)
    VALUES (p_namespace, p_key, p_fingerprint, 0, NULL, 1, p_attempt_id,
            claimed_at + p_lease_us * interval '1 microsecond', NULL, NULL, NULL,
            p_retention_us,
            claimed_at + greatest(p_lease_us, p_retention_us) * interval '1 microsecond')
    ON CONFLICT (namespace, key) DO NOTHING;
    IF FOUND THEN
        -- The row is this transaction's: its token is drawn last, and an insert that waited
        -- counts its lease from now (see the batch function).
        RETURN QUERY
        UPDATE idempotency_keys AS k
        SET (lease_token, claim_ticket, lease_expires_at, expires_at) =
            (n.token, n.token,
             CASE WHEN n.waited THEN n.at + p_lease_us * interval '1 microsecond'
                  ELSE k.lease_expires_at END,
             CASE WHEN n.waited
                  THEN n.at + greatest(p_lease_us, p_retention_us) * interval '1 microsecond'
                  ELSE k.expires_at END)
        FROM (SELECT nextval('lease_token_seq') AS token, c.at,
                     c.at - claimed_at > interval '1 millisecond' AS waited
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
                                     ARRAY[p_attempt_id]) AS b;
END
$$;
