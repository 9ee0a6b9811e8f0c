-- A Postgres table as a source (docs/table-source.md): the registered sources, and the queue
-- of changes their triggers write in the changing transaction. A change row names a key only;
-- the follower reads the row as it is when it embeds it, so a later read always carries a
-- version at least as new, and the run's positions (when it read) fence older writes.
CREATE TABLE embed_table_sources (
    name            text PRIMARY KEY,
    -- The source table as given (schema-qualified or not) and its resolved OID at `add-table`.
    source_table    text NOT NULL,
    source_oid      oid NOT NULL,
    key_column      text NOT NULL,
    key_type        text NOT NULL,
    -- Row per chunk: the column holding the chunk index; NULL: one chunk (index 0) a row.
    chunk_column    text,
    -- The text embedded: `{column}` placeholders, the columns they name.
    template        text NOT NULL,
    text_columns    text[] NOT NULL,
    metadata_columns text[] NOT NULL DEFAULT '{}',
    target_table    text NOT NULL,
    -- Set once a snapshot run over every row finished with every row settled; cleared by a
    -- TRUNCATE (the next follower then resyncs the table with a full cleanup).
    snapshot_done_at timestamptz,
    -- Set by a TRUNCATE: the resync deletes every vector of the target it did not meet
    -- (`--cleanup full`, under its guard).
    resync_full     boolean NOT NULL DEFAULT false,
    created_at      timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE embed_table_changes (
    id          bigserial PRIMARY KEY,
    source      text NOT NULL REFERENCES embed_table_sources (name) ON DELETE CASCADE,
    -- The key as text, NULL for a TRUNCATE.
    doc_key     text,
    chunk_key   integer,
    op          "char" NOT NULL CHECK (op IN ('c', 't')),
    queued_at   timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX embed_table_changes_source ON embed_table_changes (source, id);

-- The capture trigger of every table source. Arguments: the source name, the key column,
-- the chunk column or ''. Updates reach it only when a key or an embedded column changed
-- (the trigger's WHEN clause), so an update of other columns costs nothing more.
CREATE FUNCTION embed_dlq_capture() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    src text := TG_ARGV[0];
    key_col text := TG_ARGV[1];
    chunk_col text := NULLIF(TG_ARGV[2], '');
    o jsonb;
    n jsonb;
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        INSERT INTO embed_table_changes (source, op) VALUES (src, 't');
        RETURN NULL;
    END IF;
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        o := to_jsonb(OLD);
        INSERT INTO embed_table_changes (source, doc_key, chunk_key, op)
        VALUES (src, o->>key_col, CASE WHEN chunk_col IS NULL THEN 0 ELSE (o->>chunk_col)::integer END, 'c');
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        n := to_jsonb(NEW);
        IF o IS NULL OR (o->key_col) IS DISTINCT FROM (n->key_col)
           OR (chunk_col IS NOT NULL AND (o->chunk_col) IS DISTINCT FROM (n->chunk_col)) THEN
            INSERT INTO embed_table_changes (source, doc_key, chunk_key, op)
            VALUES (src, n->>key_col, CASE WHEN chunk_col IS NULL THEN 0 ELSE (n->>chunk_col)::integer END, 'c');
        END IF;
    END IF;
    RETURN NULL;
END
$$;
