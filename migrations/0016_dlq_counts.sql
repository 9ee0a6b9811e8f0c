-- DLQ gauges whose cost does not grow with the DLQ (issue 19, item 6).
--
-- Until this migration every `serve` ran two aggregates over the whole of `embedding_dlq`
-- every 5 s for its gauges (depth by class; ready, backing off, exhausted, oldest, next due):
-- at 1,000,000 rows of ~1 kB, a sequential scan of a gigabyte, twice, every 5 s, per serve.
-- Now:
--
-- * Exact row counts by (error_class, exhausted, scheduled) are kept as counters. Statement-
--   level AFTER triggers with transition tables (one per event: Postgres allows transition
--   tables only on single-event triggers) append *delta rows* to `embedding_dlq_count_delta`:
--   one row per key whose count the statement changed, so a 500-row park adds one or two
--   rows, and concurrent writers never wait on a shared counter row (no update, no lock).
--   A delta commits or rolls back with the change it describes.
-- * The gauge sampler folds the deltas into `embedding_dlq_counts` (one folder at a time: a
--   tried transaction-level advisory lock; a second folder skips, it does not wait) and reads
--   base + remaining deltas in one statement, so it sees the counts of one snapshot.
-- * Bounds: `embedding_dlq_counts` has at most one row per key (5 classes x exhausted x
--   scheduled: at most 20 rows). `embedding_dlq_count_delta` holds the deltas of the
--   statements since the last fold: at most 20 rows per statement that changed the DLQ
--   (in practice 1 or 2), folded on every sample (`serve`: every 5 s; `reconcile`: after each
--   run; the console's overview), autovacuum takes the dead rows.
-- * TRUNCATE empties both (it takes an exclusive lock: no writer is in flight).
--
-- `scheduled` is exactly what the ready and backing-off gauges split: a transient row replay
-- has not given up on, with a due time. Its total lets the sampler count only one of the two
-- by an index range scan bounded by a cap (`crate::store::dlq::SCHEDULE_COUNT_CAP`) and derive
-- the other exactly.
--
-- The oldest-row gauge is the first entry of a new index on `first_failed_at`; the next-due
-- gauge the first entry of `embedding_dlq_ready_idx`, and the ready (or backing-off) count a
-- range of it. That index is rebuilt with the predicate every reader of `next_retry_at`
-- already filters on (the scheduler, the replay-stalled check, the gauges): transient rows
-- replay has not given up on. Every writer sets `next_retry_at` only on such rows, so it holds
-- the same entries as before; but now no reader has to reject entries by reading their rows,
-- and the planner has no reason to combine it with `embedding_dlq_class_idx` (a bitmap over
-- every transient row, which is what it chose for the capped count with the old predicate).

CREATE TABLE embedding_dlq_counts (
    error_class text    NOT NULL,
    exhausted   boolean NOT NULL,
    scheduled   boolean NOT NULL,
    n           bigint  NOT NULL,
    PRIMARY KEY (error_class, exhausted, scheduled)
);

-- Append-only between folds; no index: it is only ever read and deleted whole.
CREATE TABLE embedding_dlq_count_delta (
    error_class text    NOT NULL,
    exhausted   boolean NOT NULL,
    scheduled   boolean NOT NULL,
    n           bigint  NOT NULL
);

-- The folder's lock (tried, never waited for): a second folder has nothing to add.
CREATE FUNCTION embed_dlq_count_fold_lock_key() RETURNS bigint LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN 7310313382545957733;

CREATE FUNCTION embed_dlq_count_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO embedding_dlq_count_delta (error_class, exhausted, scheduled, n)
    SELECT error_class, exhausted_at IS NOT NULL,
           next_retry_at IS NOT NULL AND error_class = 'transient' AND exhausted_at IS NULL,
           count(*)
      FROM new_rows GROUP BY 1, 2, 3;
    RETURN NULL;
END $$;

CREATE FUNCTION embed_dlq_count_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO embedding_dlq_count_delta (error_class, exhausted, scheduled, n)
    SELECT error_class, exhausted_at IS NOT NULL,
           next_retry_at IS NOT NULL AND error_class = 'transient' AND exhausted_at IS NULL,
           -count(*)
      FROM old_rows GROUP BY 1, 2, 3;
    RETURN NULL;
END $$;

-- An update moves a row from its old key to its new one; rows whose key did not change
-- (most re-parks) cancel out and write nothing.
CREATE FUNCTION embed_dlq_count_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO embedding_dlq_count_delta (error_class, exhausted, scheduled, n)
    SELECT error_class, exhausted, scheduled, sum(n)
      FROM (SELECT error_class, exhausted_at IS NOT NULL AS exhausted,
                   next_retry_at IS NOT NULL AND error_class = 'transient' AND exhausted_at IS NULL
                       AS scheduled,
                   1 AS n
              FROM new_rows
            UNION ALL
            SELECT error_class, exhausted_at IS NOT NULL,
                   next_retry_at IS NOT NULL AND error_class = 'transient' AND exhausted_at IS NULL,
                   -1
              FROM old_rows) k
     GROUP BY 1, 2, 3
    HAVING sum(n) <> 0;
    RETURN NULL;
END $$;

CREATE FUNCTION embed_dlq_count_truncate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM embedding_dlq_count_delta;
    DELETE FROM embedding_dlq_counts;
    RETURN NULL;
END $$;

-- No writer may change the DLQ between the seed below and the triggers taking over.
LOCK TABLE embedding_dlq IN SHARE ROW EXCLUSIVE MODE;

CREATE TRIGGER embedding_dlq_count_insert AFTER INSERT ON embedding_dlq
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION embed_dlq_count_insert();
CREATE TRIGGER embedding_dlq_count_update AFTER UPDATE ON embedding_dlq
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION embed_dlq_count_update();
CREATE TRIGGER embedding_dlq_count_delete AFTER DELETE ON embedding_dlq
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION embed_dlq_count_delete();
CREATE TRIGGER embedding_dlq_count_truncate AFTER TRUNCATE ON embedding_dlq
    FOR EACH STATEMENT EXECUTE FUNCTION embed_dlq_count_truncate();

INSERT INTO embedding_dlq_counts (error_class, exhausted, scheduled, n)
SELECT error_class, exhausted_at IS NOT NULL,
       next_retry_at IS NOT NULL AND error_class = 'transient' AND exhausted_at IS NULL,
       count(*)
  FROM embedding_dlq GROUP BY 1, 2, 3;

-- The oldest-row gauge reads its first entry.
CREATE INDEX embedding_dlq_first_failed_idx ON embedding_dlq (first_failed_at);

DROP INDEX embedding_dlq_ready_idx;
CREATE INDEX embedding_dlq_ready_idx ON embedding_dlq (next_retry_at)
    WHERE next_retry_at IS NOT NULL AND error_class = 'transient' AND exhausted_at IS NULL;
