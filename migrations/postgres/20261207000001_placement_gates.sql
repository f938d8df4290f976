-- Namespaces moved between clusters (`admin placement move`, docs/scaling.md, "Moving a
-- namespace"): the fence that keeps a namespace written on exactly one cluster.
--
-- A row here says that this cluster does not serve `scope` (a namespace, and the consumer of
-- the same name), and where it is served instead:
--   arriving  a move to this cluster from `peer` has begun and not switched: not served yet;
--   leaving   a move from this cluster to `peer` has begun and not switched: not served any more;
--   left      the scope lives on `peer` now (it moved there, or a move here was rolled back).
-- Every statement of the calls and of the admin API on a scope's rows first reads this table for
-- its scopes (an InitPlan, evaluated once per statement under the statement's snapshot; about a
-- microsecond on an empty table) and, if it finds a row, fails with SQLSTATE IDM01 before it
-- reads or writes anything: the service then asks `peer`. So a replica with a stale idea of
-- where a scope lives, paused for any time between deciding and sending, can neither write nor
-- read the scope here once the fence has committed; the move waits for the statements that began
-- before it (pg_stat_activity's xact_start) before it copies.
--
-- Expand only: a new table and functions, which the previous release neither reads nor writes.
-- A previous release does not look at the gates: a cluster must not be moved from or to while
-- replicas of a release older than this one serve it (docs/scaling.md).
CREATE TABLE idempotency_placement_gates (
    scope text PRIMARY KEY,
    state text NOT NULL CHECK (state IN ('arriving', 'leaving', 'left')),
    peer text NOT NULL,
    since timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- The refusal of a statement on a gated scope. Always raises; its boolean result only lets it
-- stand in a WHERE clause, where it is reached only for a scope that has a row here. The DETAIL
-- is what the service reads (state, peer and scope, separated by U+001F); the message is for a
-- person reading the database's log.
CREATE FUNCTION idempotency_gate_refuses(p_scope text, p_state text, p_peer text)
RETURNS boolean
LANGUAGE plpgsql COST 1000 AS $$
BEGIN
    RAISE EXCEPTION USING
        ERRCODE = 'IDM01',
        MESSAGE = format('namespace %s is not served by this cluster (%s, cluster %s)',
                         p_scope, p_state, p_peer),
        DETAIL = p_state || chr(31) || p_peer || chr(31) || p_scope;
END
$$;

-- Raises `lease_token_seq` to at least `p_lease_token` and `mark_batch_seq` to at least
-- `p_mark_batch`, so that every value they hand out afterwards is greater than every value a
-- moved namespace's rows carry from the cluster they came from: a key's tokens (and the claim
-- tickets drawn from the same sequence) keep increasing across the move, and a processed
-- event's `mark_batch` is never taken for the batch of a later MarkProcessed. `ALTER SEQUENCE`
-- holds a sequence against every `nextval` until this transaction ends, so the value read is
-- the last one drawn and `setval` never lowers it (at worst it skips one value); a claim in flight that drew just before
-- sees another value as the sequence's last, and draws its tokens again
-- (20261203000001_tokens_drawn_last.sql asks for "never setval": an upward jump only sends a
-- claim down that path, which is why it is safe here). Run as the sequences' owner (SECURITY
-- DEFINER): the service's role owns nothing.
CREATE FUNCTION idempotency_raise_sequences(p_lease_token bigint, p_mark_batch bigint)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    ALTER SEQUENCE lease_token_seq INCREMENT BY 1;
    ALTER SEQUENCE mark_batch_seq INCREMENT BY 1;
    -- Marked as called, so that the next value is above both: a sequence never drawn from
    -- has `last_value` 1 and hands out 1 next.
    PERFORM setval('lease_token_seq', greatest(last_value, p_lease_token), true)
    FROM lease_token_seq;
    PERFORM setval('mark_batch_seq', greatest(last_value, p_mark_batch), true)
    FROM mark_batch_seq;
END
$$;
REVOKE ALL ON FUNCTION idempotency_raise_sequences(bigint, bigint) FROM PUBLIC;
