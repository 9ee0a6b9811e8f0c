-- Relay: relay wake-ups only when there is something to relay.

-- NOTIFY only when the statement really inserted outbox rows. A statement-level trigger
-- fires for every INSERT statement, including the store statement's CTE that inserts zero
-- `resolved` events on most batches; each NOTIFY takes the global notification queue lock
-- at commit, which serialised every ingest commit behind it.
CREATE OR REPLACE FUNCTION dlq_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM new_rows) THEN
        PERFORM pg_notify('embed_dlq_outbox', '');
    END IF;
    RETURN NULL;
END $$;
DROP TRIGGER dlq_outbox_notify ON dlq_outbox;
CREATE TRIGGER dlq_outbox_notify AFTER INSERT ON dlq_outbox
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION dlq_outbox_notify();
