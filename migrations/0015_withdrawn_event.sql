-- The `withdrawn` event: a vector of a chunk's previous text deleted because the chunk's
-- newer text is parked (`[ingest] on_newer_parked = withdraw`, in the park's transaction) or by
-- the reconciler's `superseded_vectors` repair.
--
-- The allowed events are extended, not restated: the constraint's current list is read from
-- the catalog and 'withdrawn' added to it, so an event another migration added is kept
-- whatever order the two were written in.
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
    IF position('''withdrawn''' IN def) > 0 THEN
        RETURN;
    END IF;
    IF position('ARRAY[' IN def) = 0 THEN
        RAISE EXCEPTION 'dlq_outbox_event_check has an unexpected form: %', def;
    END IF;
    ALTER TABLE dlq_outbox DROP CONSTRAINT dlq_outbox_event_check;
    EXECUTE 'ALTER TABLE dlq_outbox ADD CONSTRAINT dlq_outbox_event_check '
            || replace(def, 'ARRAY[', 'ARRAY[''withdrawn''::text, ');
END
$$;
