-- The tables stream sources feed, and the oldest position each stream may still hand on
-- (issue 44). Nothing in Postgres knew of a stream's entries until a consumer wrote them,
-- and an entry a consumer died holding, or one nobody has read yet, can be written long after
-- newer records of its chunk:
--
-- * A corpus run alone skips an unchanged line without moving its manifest row's position,
--   so an identical rerun writes nothing. An entry older than the run, taken over after it,
--   then passed the position fence of the row the run skipped and stored its text over the
--   newer corpus line. Now a corpus run of a table listed here confirms the position of
--   every unchanged line it skips, as it does beside another live run (`src/ingest/lease.rs`,
--   `racing`).
-- * The sweep at each run start dropped tombstones older than an hour that no live run could
--   still need; a dead consumer's pending entries belong to no live run, so an entry older
--   than a deletion, taken over after the sweep, brought the deleted chunk back. Now a
--   tombstone is kept while a stream of its table may still hand on something older
--   (`floor_position`, `src/store/delete.rs`).
--
-- A stream source registers each of its streams before it reads anything (floor 0: the
-- oldest of all) and sets the floor at every segment start to the oldest entry its group may
-- still hand on (its oldest pending entry, or the last one delivered). A floor only lags:
-- when Redis cannot tell, the old one stays.
--
-- Bound: one row per target table, stream and consumer group that a stream source has read.
-- Deleting the rows of a retired stream source (its streams drained) gives the table's
-- corpus runs the write-free unchanged rerun back and lets its old tombstones go.
CREATE TABLE IF NOT EXISTS ingest_stream_fed (
    target_table   text        NOT NULL,
    stream         text        NOT NULL,
    group_name     text        NOT NULL,
    floor_position bigint      NOT NULL DEFAULT 0,
    first_read_at  timestamptz NOT NULL DEFAULT now(),
    floor_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (target_table, stream, group_name)
);
