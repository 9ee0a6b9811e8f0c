-- Deletions (issue 21): cleanup modes of a corpus run and explicit deletes in the input.
--
-- A chunk deleted by an ingest (an `{"op": "delete"}` record, or a run's `--cleanup
-- incremental|full`) loses its manifest row, its vector and any DLQ row (and replay lease) in
-- one transaction, with one `deleted` event through the outbox. Two tables of their own keep
-- what deletions need, so the manifest keeps meaning "a chunk that must have a vector or a
-- DLQ row" and the seed's leak query stays valid.

-- Tombstones fence deletions like `source_seq` fences writes: an ingest outcome of a record
-- older than a tombstone of its chunk (`chunk_index`) or of its whole document
-- (`chunk_index` -1) is rejected as superseded, so a write or park still in flight in an
-- older run can never bring a deleted chunk back. A delete itself removes only manifest rows
-- older than its own position, so it never deletes a newer run's chunk.
--
-- Bound: one row per deleted chunk or document, swept at each run start once it is an hour
-- old and no ingest run older than it is alive (nothing older can still be in flight then).
CREATE TABLE IF NOT EXISTS ingest_tombstone (
    target_table text        NOT NULL,
    doc_id       text        NOT NULL,
    -- -1: the whole document.
    chunk_index  int         NOT NULL CHECK (chunk_index >= -1),
    -- Position of the delete ((run id << 32) | line; a cleanup's is its run's last position).
    source_seq   bigint      NOT NULL,
    deleted_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (target_table, doc_id, chunk_index)
);
CREATE INDEX IF NOT EXISTS ingest_tombstone_deleted_at_idx ON ingest_tombstone (deleted_at);

-- The keys a run with a cleanup mode has met, one row per key, written one statement per
-- intake window: what the cleanup keeps (everything else of its scope is deleted). Kept in
-- the database so that a run of 10 million chunks holds no set of them in memory. UNLOGGED
-- (no WAL): a Postgres crash empties it, which the run notices (it counts what it wrote and
-- refuses to clean up on a mismatch). A run's rows are deleted when its cleanup ends; rows of
-- runs that died are swept by the next run with a cleanup mode.
CREATE UNLOGGED TABLE IF NOT EXISTS ingest_seen (
    run_id      bigint NOT NULL,
    doc_id      text   NOT NULL,
    chunk_index int    NOT NULL,
    PRIMARY KEY (run_id, doc_id, chunk_index)
);

-- Deletions and ingest writes of one table are serialised by an advisory lock: every store
-- and park transaction takes it shared (one lock, before its manifest claim), every deletion
-- transaction exclusive. So a claim's snapshot always sees every tombstone committed before
-- it, and a deletion never misses a write committed before it. Key: (this space,
-- hashtext(canonical table name)).
CREATE OR REPLACE FUNCTION embed_dlq_delete_lock_space() RETURNS int LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN 1701602412;

-- The `deleted` event, added to the allowed events the way 0015 added `withdrawn`.
DO $$
DECLARE
    def text;
BEGIN
    SELECT pg_get_constraintdef(c.oid) INTO def
      FROM pg_constraint c
     WHERE c.conrelid = 'dlq_outbox'::regclass AND c.conname = 'dlq_outbox_event_check';
    IF def IS NULL THEN
        RAISE EXCEPTION 'dlq_outbox_event_check is missing';
    END IF;
    IF position('''deleted''' IN def) > 0 THEN
        RETURN;
    END IF;
    IF position('ARRAY[' IN def) = 0 THEN
        RAISE EXCEPTION 'dlq_outbox_event_check has an unexpected form: %', def;
    END IF;
    ALTER TABLE dlq_outbox DROP CONSTRAINT dlq_outbox_event_check;
    EXECUTE 'ALTER TABLE dlq_outbox ADD CONSTRAINT dlq_outbox_event_check '
            || replace(def, 'ARRAY[', 'ARRAY[''deleted''::text, ');
END
$$;
