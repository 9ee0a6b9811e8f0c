-- One chunk's events in the order they happened, whatever the number of relays.
--
-- Several relays (one per `serve` host) claim batches of the outbox side by side with
-- `FOR UPDATE SKIP LOCKED`. A relay that skipped a row another relay holds could publish a
-- later row of the same chunk first: with a backlog (Redis back after an outage) a chunk's
-- `resolved` or `replayed` event reached the stream before its `parked` event. The claim now
-- leaves a row alone while an earlier unpublished row of the same chunk and stream exists,
-- and this index answers that question with one probe a row (only unpublished rows are in
-- it, so it stays as small as the backlog).
CREATE INDEX IF NOT EXISTS dlq_outbox_unpublished_chunk_idx
    ON dlq_outbox (doc_id, chunk_index, id) WHERE published_at IS NULL;
