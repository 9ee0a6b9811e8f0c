-- One database, one set of streams. The outbox of a database is relayed to the streams under
-- one stream prefix: two deployments with different prefixes over one database would each
-- claim part of the outbox, so each prefix's streams would hold part of the events, and each
-- reconciler would find the other's entries missing and publish them again. The first
-- `serve` or `reconcile` (with Redis) records its prefix here; a process configured with
-- another prefix refuses to start. `embed-dlq migrate --adopt-stream-prefix P` moves the
-- database to new streams on purpose.
CREATE TABLE IF NOT EXISTS embed_dlq_streams (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    stream_prefix text NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now()
);
