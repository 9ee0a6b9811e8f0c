-- The relay consumes the outbox by commit order, read-only, instead of marking every row.
--
-- It used to lock each row it published (`FOR UPDATE SKIP LOCKED`) and write
-- `published_at`/`entry_id` back: a new version of every row, in three partial indexes, the
-- larger part of its Postgres cost. Now each row records the transaction that wrote it
-- (`txid`), and one row of `relay_position` records how far the relay got, as PgQ does: the
-- events of every transaction visible in snapshot `lower` are published; with `upper` set,
-- the relay is inside the interval of the transactions visible in `upper` and not in
-- `lower`, and published the rows of that interval up to id `after_id` (an interval is read
-- by id up to its largest id, `last_id`). A relay publishes while it holds the position row
-- (`FOR UPDATE SKIP LOCKED` in a transaction with an idle timeout); what it published
-- becomes the new position when that transaction commits, and a crash before the commit
-- only republishes rows the dedup records in Redis (keyed by `event_id`) turn into no-ops.
--
-- Per-chunk order: a chunk's later event is written by a transaction that waited for the
-- earlier one's row locks and drew its id after that one committed, so it is in a later
-- interval or in the same one with a higher id. See src/relay/sql.rs.
ALTER TABLE dlq_outbox ADD COLUMN txid xid8;

-- Rows an older relay left unpublished belong to this transaction: it is in `lower`'s list
-- of running transactions below, so they form part of the first interval. Rows it published
-- keep no txid: published, never walked again, pruned after the retention.
UPDATE dlq_outbox SET txid = pg_current_xact_id() WHERE published_at IS NULL;

ALTER TABLE dlq_outbox ALTER COLUMN txid SET DEFAULT pg_current_xact_id();

CREATE TABLE relay_position (
    name     text PRIMARY KEY,
    lower    pg_snapshot NOT NULL,
    upper    pg_snapshot,
    after_id bigint NOT NULL DEFAULT 0,
    last_id  bigint NOT NULL DEFAULT 0,
    -- Intervals finished since the position was created: how far the relay got, as a number.
    batches  bigint NOT NULL DEFAULT 0,
    moved_at timestamptz NOT NULL DEFAULT now()
);

-- The first `lower`: the snapshot of now, with this transaction and every transaction id from
-- the snapshot's xmax up to it added to its running ones (a snapshot never lists its own
-- transaction, and its xmax is one past the latest completed transaction, so ids between
-- are running), so the rows above and every transaction still running (one that writes an
-- outbox row after this commits) are not yet published.
INSERT INTO relay_position (name, lower)
SELECT 'outbox',
       (least(xmin, x)::text || ':' || greatest(xmax, x + 1)::text || ':' ||
        COALESCE((SELECT string_agg(t::text, ',' ORDER BY t)
                    FROM (SELECT pg_snapshot_xip(s)::text::bigint AS t
                          UNION SELECT generate_series(least(xmax, x), x)) u), ''))::pg_snapshot
  FROM (SELECT s, pg_snapshot_xmin(s)::text::bigint AS xmin, pg_snapshot_xmax(s)::text::bigint AS xmax,
               pg_current_xact_id()::text::bigint AS x
          FROM (SELECT pg_current_snapshot() AS s) snap) q;

-- Nothing reads `published_at IS NULL` any more.
DROP INDEX IF EXISTS dlq_outbox_unpublished_idx;
DROP INDEX IF EXISTS dlq_outbox_unpublished_chunk_idx;
DROP INDEX IF EXISTS dlq_outbox_published_idx;
-- An interval's rows (and the reconciler's walk over what was published since a run).
CREATE INDEX IF NOT EXISTS dlq_outbox_txid_idx ON dlq_outbox (txid, id);
-- The retention prune, oldest first.
CREATE INDEX IF NOT EXISTS dlq_outbox_created_idx ON dlq_outbox (created_at);

-- Where the reconciler's check of published events resumes: the rows of the transactions not
-- visible in this snapshot (NULL: every retained row).
ALTER TABLE reconcile_runs ADD COLUMN events_window pg_snapshot;
