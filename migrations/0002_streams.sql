-- Streams and replay: outbox routing, relay wake-ups, replay bookkeeping on DLQ rows.

-- Which Redis stream an outbox row goes to: `events` (every park/replay/exhaust, for tailers)
-- or `replay` (a due work item for the replayers' consumer group).
ALTER TABLE dlq_outbox ADD COLUMN stream text NOT NULL DEFAULT 'events'
    CHECK (stream IN ('events', 'replay'));
ALTER TABLE dlq_outbox DROP CONSTRAINT dlq_outbox_event_check;
ALTER TABLE dlq_outbox ADD CONSTRAINT dlq_outbox_event_check
    CHECK (event IN ('parked', 'resolved', 'replay', 'replayed', 'reparked', 'exhausted', 'requeued'));
CREATE INDEX dlq_outbox_published_idx ON dlq_outbox (published_at) WHERE published_at IS NOT NULL;

-- Wake the relay as soon as a transaction that wrote outbox rows commits (NOTIFY is
-- delivered at commit); the relay also polls, so a lost notification only costs latency.
CREATE FUNCTION dlq_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('embed_dlq_outbox', '');
    RETURN NULL;
END $$;
CREATE TRIGGER dlq_outbox_notify AFTER INSERT ON dlq_outbox
    FOR EACH STATEMENT EXECUTE FUNCTION dlq_outbox_notify();

-- Replay bookkeeping.
-- enqueued_at: when the row was last published as replay work (next_retry_at is then pushed
--   out by a lease, so work lost in Redis is scheduled again).
-- replays doubles as the row's generation: a replay result commits only if `replays` still
--   holds the value the work item carried, so a redelivered or stolen item applies at most once.
-- last_error_signature / same_error_count: the same content failing the same way several
--   passes in a row is reclassified as permanent (servers that fail certain inputs with 500).
ALTER TABLE embedding_dlq
    ADD COLUMN enqueued_at timestamptz,
    ADD COLUMN last_error_signature text,
    ADD COLUMN same_error_count int NOT NULL DEFAULT 0,
    ADD COLUMN exhausted_reason text;
