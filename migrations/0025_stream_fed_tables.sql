-- The tables a stream source has fed (issue 44). A corpus run alone skips an unchanged line
-- without moving its manifest row's position, so an identical rerun writes nothing. That is
-- only sound while nothing older than the run can still be written: a stream source's
-- entries can be. An entry a consumer died holding, or one nobody has read yet, is older
-- than a corpus run that reads the same chunk after it entered; taken over after that run,
-- it passed the position fence of a row the run skipped and stored its text over the newer
-- corpus line. So a stream source registers its table here before it reads anything, and
-- from then on a corpus run of that table confirms the position of every unchanged line it
-- skips, as it does beside another live run (`src/ingest/lease.rs`, `racing`).
--
-- Bound: one row per target table a stream source has read into. Deleting a table's row
-- (its stream source retired and its streams drained) gives its corpus runs the write-free
-- unchanged rerun back.
CREATE TABLE IF NOT EXISTS ingest_stream_fed (
    target_table text        PRIMARY KEY,
    first_read_at timestamptz NOT NULL DEFAULT now()
);
