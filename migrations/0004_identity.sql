-- Identity: a chunk is (target_table, doc_id, chunk_index) everywhere, and every commit is
-- fenced by a generation that only ever grows.
--
-- Before this migration the manifest and the DLQ were keyed by (doc_id, chunk_index) alone,
-- so two target tables shared one state. ASSUMPTION for existing data: every existing
-- manifest, DLQ and outbox row belongs to the default table `doc_embeddings` (the only table
-- the tool created by itself). Rows that were really written for another table are then
-- either left alone (reconcile reports them as leaks of the default table and `reconcile
-- --repair` marks them for re-ingest) or picked up again by the next ingest of that table,
-- which now has a state of its own. DLQ rows parked before this migration have no recorded
-- model (NULL): replay embeds them with the model `serve` is configured with, as it did before.

-- The canonical spelling of a table: schema-qualified, each part quoted only when needed
-- (`public.doc_embeddings`, `"My".chunks`). `doc_embeddings` and `public.doc_embeddings` are
-- one identity. Also valid SQL as it stands, so the code uses it directly as the identifier.
CREATE FUNCTION embed_dlq_table_name(t regclass) RETURNS text LANGUAGE sql STABLE AS $$
    SELECT quote_ident(n.nspname) || '.' || quote_ident(c.relname)
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE c.oid = t
$$;

-- DLQ generations: bumped whenever a row's content changes, on every re-park by replay and
-- on requeue (never on an uncharged postpone). A replay result commits only for the
-- generation (and content hash) it was computed for.
CREATE SEQUENCE embed_dlq_generation_seq AS bigint;

-- Ingest run ids: a record's position is (run_id << 32) | line_number, so later runs beat
-- earlier ones and, within a run, later lines beat earlier lines.
CREATE SEQUENCE embed_dlq_ingest_run_seq AS bigint MAXVALUE 2147483647;

-- Manifest.
ALTER TABLE ingest_manifest
    ADD COLUMN target_table text,
    -- Position of the record whose outcome this row holds; an outcome of an older position
    -- is rejected ("superseded"). 0 for rows written before this migration.
    ADD COLUMN source_seq bigint NOT NULL DEFAULT 0;
UPDATE ingest_manifest
   SET target_table = COALESCE(embed_dlq_table_name(to_regclass('doc_embeddings')), 'public.doc_embeddings');
ALTER TABLE ingest_manifest ALTER COLUMN target_table SET NOT NULL;
ALTER TABLE ingest_manifest DROP CONSTRAINT ingest_manifest_pkey;
ALTER TABLE ingest_manifest ADD PRIMARY KEY (target_table, doc_id, chunk_index);

-- DLQ: the table, model and dimensions a row was meant for, and its generation.
ALTER TABLE embedding_dlq
    ADD COLUMN target_table text,
    -- NULL only for rows parked before this migration (see above).
    ADD COLUMN model text,
    -- The target column's dimension when the row was parked.
    ADD COLUMN dimensions int CHECK (dimensions > 0),
    -- The `dimensions` request parameter sent to the provider, if any.
    ADD COLUMN request_dimensions int CHECK (request_dimensions > 0),
    ADD COLUMN generation bigint;
UPDATE embedding_dlq
   SET target_table = COALESCE(embed_dlq_table_name(to_regclass('doc_embeddings')), 'public.doc_embeddings'),
       dimensions = (SELECT NULLIF(a.atttypmod, -1) FROM pg_attribute a
                      WHERE a.attrelid = to_regclass('doc_embeddings') AND a.attname = 'embedding'),
       generation = nextval('embed_dlq_generation_seq');
ALTER TABLE embedding_dlq
    ALTER COLUMN target_table SET NOT NULL,
    ALTER COLUMN generation SET NOT NULL,
    ALTER COLUMN generation SET DEFAULT nextval('embed_dlq_generation_seq');
ALTER TABLE embedding_dlq DROP CONSTRAINT embedding_dlq_doc_id_chunk_index_key;
ALTER TABLE embedding_dlq ADD CONSTRAINT embedding_dlq_identity_key UNIQUE (target_table, doc_id, chunk_index);

-- Outbox: events name the table too (NULL for events written before this migration).
ALTER TABLE dlq_outbox ADD COLUMN target_table text;
