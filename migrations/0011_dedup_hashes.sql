-- Relay dedup records as hashes. Until this migration the relay recorded every published event
-- under a Redis key of its own ({tag}:outbox:<event_id>, with a TTL); from here on it records
-- it as a field of a hash per stream shard and hour of the outbox row's creation
-- ({tag}:published:YYYYMMDDHH), which costs Redis about a third per event (BENCHMARKS.md).
-- `since` is when the hashes took over: a row created before it may have been published by an
-- older relay that wrote the old marker and crashed before marking the row, so the relay
-- still looks at the old marker of such rows. Rows created later never had one.
-- Stop every older `serve` before starting the upgraded ones: an older relay still running
-- would record new rows under the old markers only.
CREATE TABLE IF NOT EXISTS embed_dlq_dedup_hashes (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    since timestamptz NOT NULL DEFAULT now()
);
INSERT INTO embed_dlq_dedup_hashes DEFAULT VALUES ON CONFLICT DO NOTHING;

-- Which hash records a row's event: the UTC hour the row was created, `YYYYMMDDHH`. One
-- definition for the relay (which writes the record) and the reconciler (which deletes it to
-- publish an event again).
CREATE OR REPLACE FUNCTION embed_dlq_dedup_hour(created_at timestamptz) RETURNS text
    LANGUAGE sql STABLE PARALLEL SAFE
    RETURN to_char(created_at AT TIME ZONE 'UTC', 'YYYYMMDDHH24');

-- The relay's mark updates every row it publishes, and each index on the outbox costs that
-- update an index insert (about a fifth of the mark, measured). The reconciler's walk over
-- published events by id, the only reader of this index, takes the primary key instead: past
-- its cursor nearly every row is published, so it skips few rows.
DROP INDEX IF EXISTS dlq_outbox_published_events_idx;
