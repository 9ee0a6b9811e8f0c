-- Revisions of a target (issue 46): the name users query (`public.doc_embeddings`) and the
-- relations that hold its vectors, one per embedding model.
--
-- Identity is unchanged: the `target_table` of the manifest, the DLQ, the outbox, the leases,
-- the tombstones and the positions names what is written, and every fence works per identity.
-- A revision added later is a relation of its own (`doc_embeddings__r2`) whose identity is its
-- own name. Revision 1 of an existing table is the one exception: for its name to become the
-- query name (a view over the active revision) the table is renamed (`doc_embeddings__r1`),
-- and rewriting its identity in every row (a 1M-row manifest: tens of seconds, and a new
-- `table` in the events consumers key on) is avoided by recording here which relation holds
-- the identity's vectors. `Store` reads this table when it opens a target: an identity with
-- no row here is its own relation, as before.
--
-- Bound: one row per revision ever made of a target (retired ones included).
CREATE TABLE IF NOT EXISTS embed_dlq_revision (
    -- The query name (canonical, like every table name this tool records).
    target             text        NOT NULL,
    revision           int         NOT NULL CHECK (revision > 0),
    -- What the manifest, DLQ and outbox rows of this revision record as `target_table`.
    identity           text        NOT NULL UNIQUE,
    -- The relation holding its vectors (canonical name).
    relation           text        NOT NULL UNIQUE,
    -- The model and the `dimensions` request parameter it embeds with; NULL for a revision 1
    -- adopted from a table whose model the tool never recorded (the ingest's own settings).
    model              text,
    request_dimensions int         CHECK (request_dimensions > 0),
    -- The relation's vector(N) when the revision was made.
    dimensions         int         NOT NULL CHECK (dimensions > 0),
    -- active: the query name answers it (exactly one a target); shadow: written beside the
    -- active one until it covers it; previous: the one before the last switch, kept for a
    -- rollback; retired: its relation dropped, kept as history.
    state              text        NOT NULL CHECK (state IN ('active', 'shadow', 'previous', 'retired')),
    created_at         timestamptz NOT NULL DEFAULT now(),
    activated_at       timestamptz,
    retired_at         timestamptz,
    PRIMARY KEY (target, revision)
);

CREATE UNIQUE INDEX IF NOT EXISTS embed_dlq_revision_one_active
    ON embed_dlq_revision (target) WHERE state = 'active';

-- The query name is a view, and nothing may write through it: a process still holding the
-- name from before the adoption would otherwise write into whichever revision is active.
-- (Its cast `embedding` column already refuses vectors; this refuses every write, deletes
-- too, with a message that says what to do.)
CREATE OR REPLACE FUNCTION embed_dlq_refuse_write() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is the query name of target revisions (embed_dlq_revision): write to its revisions'' relations, or through embed-dlq', TG_TABLE_NAME
        USING ERRCODE = 'object_not_in_prerequisite_state';
END
$$;

-- The hash of each chunk's text alone (16 bytes of SHA-256, no model or dimension in it:
-- `model::TextHash`), written by every store and park from now on: a revision embeds with
-- its own model, so its content hashes differ from another revision's, and this is what
-- shows that two revisions hold the same text of a chunk (the coverage a switch of the
-- active revision requires). NULL on rows written before this migration. Adding a column
-- with no default rewrites nothing.
ALTER TABLE ingest_manifest ADD COLUMN IF NOT EXISTS text_hash bytea;
