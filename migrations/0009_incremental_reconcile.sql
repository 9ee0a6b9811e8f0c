-- Incremental reconcile: a run can look only at the chunks whose manifest row changed since
-- the previous run, and each run records where the next one may start.
--
-- Every writer of this tool moves a chunk's manifest `updated_at` (to its transaction's
-- now()) in the transaction that changes its vector or DLQ row: ingest's store and park, a
-- replay commit, requeue, and the reconciler's own repairs. The index makes "changed since"
-- a range scan whose cost grows with the changes, not with the corpus.
--
-- On a large manifest this build holds a write lock on ingest_manifest for its duration
-- (about a second per million rows here); run the migration when no ingest is running, or
-- create the index CONCURRENTLY by hand first under the same name.
CREATE INDEX IF NOT EXISTS ingest_manifest_updated_at_idx ON ingest_manifest (updated_at);

-- sweep: what the run looked at.
--   incremental  the table checks only over chunks whose manifest changed since `resume`
--                of the previous run (per check)
--   full         every chunk; vectors' contents are not read
--   deep         every chunk, every vector's contents, duplicates by scanning
--   Runs recorded before this migration read every vector: they count as deep.
-- scope_from: for an incremental run, the earliest change it looked at.
-- resume: per table check, where the next incremental run starts: the run's horizon (every
--   change committed later has a newer updated_at, see src/reconcile.rs), or earlier if a
--   finding was left unrepaired (so it is found again until it is repaired).
ALTER TABLE reconcile_runs
    ADD COLUMN sweep text NOT NULL DEFAULT 'deep' CHECK (sweep IN ('incremental', 'full', 'deep')),
    ADD COLUMN scope_from timestamptz,
    ADD COLUMN resume jsonb;
ALTER TABLE reconcile_runs ALTER COLUMN sweep DROP DEFAULT;

-- The scheduler asks when the last full or deep sweep finished, and the next run reads the
-- latest run's resume points.
CREATE INDEX reconcile_runs_sweep_idx ON reconcile_runs (sweep, finished_at);

-- Reconcile runs of one database take this transaction-level advisory lock for their whole
-- duration, one after another: a run's resume points are always computed from the run
-- before it. Named once so the statements and an operator's look at pg_locks agree.
CREATE FUNCTION embed_dlq_reconcile_lock_key() RETURNS bigint LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN 7310313382545957731;
