-- The relay's position is made of snapshots, and snapshots compare transaction ids, which only
-- mean something inside one cluster. A logical restore into another cluster (`pg_dump`, then
-- `pg_restore` or `psql` on another server) keeps the outbox rows' txids and the position,
-- but not the transaction counter: rows written after it can read as published already, and
-- rows the old relay had not published as never committed. The position now records the
-- cluster it was taken in; a relay that finds itself in another cluster, or the position
-- ahead of the server, hands every row it cannot be sure of back to publishing and starts
-- from a new position (src/relay/sql.rs, `take`). Recorded by the first relay to take it.
ALTER TABLE relay_position ADD COLUMN system_identifier text;

-- The cluster's identity (`pg_control_system`), or NULL where the role may not read it (a
-- managed service may not allow it): then only a position ahead of the server tells.
CREATE FUNCTION embed_dlq_system_identifier() RETURNS text
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT system_identifier::text FROM pg_control_system());
EXCEPTION WHEN insufficient_privilege OR undefined_function THEN
    RETURN NULL;
END
$$;

-- The snapshot of now with this transaction, and every transaction id from the snapshot's
-- xmax up to it, among its running ones (a snapshot never lists its own transaction, and its
-- xmax can be below it): a `lower` that leaves this transaction's rows, and every transaction
-- still running, to the relay. (Migration 0022 built the first position the same way.)
CREATE FUNCTION embed_dlq_snapshot_before_own() RETURNS pg_snapshot
LANGUAGE sql VOLATILE AS $$
SELECT (least(xmin, x)::text || ':' || greatest(xmax, x + 1)::text || ':' ||
        COALESCE((SELECT string_agg(t::text, ',' ORDER BY t)
                    FROM (SELECT pg_snapshot_xip(s)::text::bigint AS t
                          UNION SELECT generate_series(least(xmax, x), x)) u), ''))::pg_snapshot
  FROM (SELECT s, pg_snapshot_xmin(s)::text::bigint AS xmin, pg_snapshot_xmax(s)::text::bigint AS xmax,
               pg_current_xact_id()::text::bigint AS x
          FROM (SELECT pg_current_snapshot() AS s) snap) q
$$;
