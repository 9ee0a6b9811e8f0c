-- A switch between revisions under live writes (issue 46).
--
-- Every write of a target with revisions reaches each live revision, but each revision's
-- pipeline commits on its own: under a stream source writing all the time, some chunks are
-- always committed in one revision and not yet in the other, and the coverage check that
-- gates `revision activate` would refuse the switch. `activate --wait-secs N` first records
-- a pause here; every stream source writing the target reads no new entry while it holds
-- (`until` bounds it, so a killed `activate` cannot stop intake for longer), the work in
-- flight commits in every revision, and the check passes; the row goes when the switch is
-- done or refused.
CREATE TABLE IF NOT EXISTS embed_dlq_revision_switch (
    target text        PRIMARY KEY,
    since  timestamptz NOT NULL DEFAULT now(),
    until  timestamptz NOT NULL
);
