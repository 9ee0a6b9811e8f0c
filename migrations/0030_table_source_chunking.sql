-- Documents to chunks (docs/table-source.md): a source whose rows hold whole documents cuts
-- each one into chunks of at most `chunk_size` characters or cl100k_base tokens, chunk 0 first,
-- so an edit re-embeds only the chunks whose text changed and a shorter document deletes its
-- trailing chunks. NULL `chunk_unit`: a row is one chunk (or a chunk, with `chunk_column`).
ALTER TABLE embed_table_sources
    ADD COLUMN chunk_unit     text CHECK (chunk_unit IN ('chars', 'tokens')),
    ADD COLUMN chunk_size     integer CHECK (chunk_size > 0),
    ADD COLUMN chunk_overlap  integer NOT NULL DEFAULT 0 CHECK (chunk_overlap >= 0),
    ADD COLUMN chunk_markdown boolean NOT NULL DEFAULT false,
    ADD CONSTRAINT embed_table_sources_chunking
        CHECK ((chunk_unit IS NULL) = (chunk_size IS NULL)
               AND (chunk_unit IS NULL OR chunk_column IS NULL)
               AND (chunk_size IS NULL OR chunk_overlap < chunk_size));
