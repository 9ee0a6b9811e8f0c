-- Where a table source's snapshot has got to (docs/table-source.md): the key of the last row
-- of the last snapshot part that settled in every revision. A follower killed during a long
-- snapshot resumes after it instead of reading the whole table again. NULL: from the start.
-- Cleared with snapshot_done_at (a TRUNCATE or a trigger repair starts a resync over).
ALTER TABLE embed_table_sources
    ADD COLUMN snapshot_after_key text,
    ADD COLUMN snapshot_after_chunk integer;
