-- Positions from the time a record entered (issue 21): a record's position (`source_seq` in
-- the manifest, leases and tombstones) was `(ingest run id << 32) | line`, the order in which
-- a consumer got round to it. For a stream source that is wrong: an entry taken over from a
-- dead consumer would be processed, and positioned, after a newer entry of the same chunk that
-- another consumer already stored. Now a position is when the record entered, on one scale
-- for both sources (`src/store/position.rs`): milliseconds since the Unix epoch shifted left
-- by 21 bits, plus
--
-- - for a stream entry `ms-seq` (the stream's own clock, Redis): `(seq << 6) | stream index`;
-- - for a corpus line: its offset in a block of 2^21 positions the run reserves here
--   (Postgres's clock), one block per 2,097,152 lines.
--
-- Every position written before this migration is below every position after it (run ids
-- would have to pass 2^29 to reach today's clock), so existing rows stay older than anything
-- new, as they are.

-- The next position a corpus run may reserve: never below the clock, never reused.
CREATE TABLE IF NOT EXISTS ingest_position_clock (
    only_row      boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    next_position bigint  NOT NULL
);
INSERT INTO ingest_position_clock (next_position)
SELECT GREATEST(
           floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint << 21,
           COALESCE((SELECT max(source_seq) + 1 FROM ingest_manifest), 0),
           COALESCE((SELECT max(source_seq) + 1 FROM ingest_tombstone), 0),
           COALESCE((SELECT max(source_seq) + 1 FROM ingest_lease), 0))
ON CONFLICT (only_row) DO NOTHING;

-- The oldest position each run may write (a corpus run's first; a stream segment's oldest
-- entry it could still take over), so the tombstone sweep knows which live run could still
-- write something older than a tombstone (it was `run id < tombstone's run id`).
-- Bound: one row per live run; rows of runs no longer alive are swept at each run start.
CREATE TABLE IF NOT EXISTS ingest_run_start (
    run_id         bigint      PRIMARY KEY,
    first_position bigint      NOT NULL,
    started_at     timestamptz NOT NULL DEFAULT now()
);
