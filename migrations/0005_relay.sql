-- Relay: event identities that cannot repeat, the stream entry each event became, and relay
-- wake-ups only when there is something to relay.

-- event_id: the event's identity on the Redis side (dedup marker key, `event_id` field of the
--   stream entry). A random uuid written with the row, so it never repeats across a database
--   restore (restored rows keep theirs: re-publishing them is still deduplicated), a
--   re-created database or two deployments sharing a stream prefix. The outbox id alone
--   repeats in all three cases, and new events were dropped as "duplicates" of old markers.
-- entry_id: the stream entry id the relay got back when it published the row (the original
--   entry when the marker said "already published"), so the reconciler can check that every
--   published event is really on its stream without scanning the stream.
ALTER TABLE dlq_outbox
    ADD COLUMN event_id uuid NOT NULL DEFAULT gen_random_uuid(),
    ADD COLUMN entry_id text;

-- The reconciler walks published events by id.
CREATE INDEX dlq_outbox_published_events_idx ON dlq_outbox (id)
    WHERE published_at IS NOT NULL AND stream = 'events';

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
