-- Events name the revision they are about (issue 46).
--
-- A target with revisions writes each revision under its own identity (`doc_embeddings__r2`
-- for revision 2; revision 1 keeps the target's name), so an event's `table` says which
-- revision it is about only to a reader who knows the registry. An event of a chunk whose
-- identity is in the registry (`embed_dlq_revision`) now also carries `target` (the query
-- name users search) and `revision` (its number): a tailer can route or filter a shadow's
-- events without a lookup of its own. Events of tables without revisions are unchanged.
--
-- Added by the events' BEFORE INSERT trigger (migration 0014), beside `seq`, rather than in
-- `embed_dlq_event`: one place for every kind, the seven statements untouched, one probe of
-- the registry's unique index on `identity` per event row.
CREATE OR REPLACE FUNCTION embed_dlq_event_seq() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    named record;
BEGIN
    NEW.body := NEW.body || jsonb_build_object('seq', NEW.id);
    SELECT r.target, r.revision INTO named FROM embed_dlq_revision r WHERE r.identity = NEW.target_table;
    IF FOUND THEN
        NEW.body := NEW.body || jsonb_build_object('target', named.target, 'revision', named.revision);
    END IF;
    RETURN NEW;
END $$;
