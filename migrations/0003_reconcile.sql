-- Reconciliation and operator tooling.

-- 'reingest': the reconciler found the chunk's vector missing or drifted and cannot rebuild
-- it without the text; the next ingest of the corpus embeds it again (a manifest row whose
-- status is not stored/parked/exhausted never counts as "already done").
ALTER TABLE ingest_manifest DROP CONSTRAINT ingest_manifest_status_check;
ALTER TABLE ingest_manifest ADD CONSTRAINT ingest_manifest_status_check
    CHECK (status IN ('stored', 'parked', 'exhausted', 'reingest'));

-- The last failures of a DLQ row, newest last (at most 20 entries): what `dlq show` prints.
ALTER TABLE embedding_dlq ADD COLUMN error_history jsonb NOT NULL DEFAULT '[]';

-- One row per reconcile run, so any process can export when the last one succeeded.
CREATE TABLE reconcile_runs (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    started_at  timestamptz NOT NULL,
    finished_at timestamptz NOT NULL DEFAULT now(),
    repaired    boolean     NOT NULL,
    findings    jsonb       NOT NULL
);

-- Operator actions are announced like everything else.
ALTER TABLE dlq_outbox DROP CONSTRAINT dlq_outbox_event_check;
ALTER TABLE dlq_outbox ADD CONSTRAINT dlq_outbox_event_check
    CHECK (event IN ('parked', 'resolved', 'replay', 'replayed', 'reparked', 'exhausted',
                     'requeued', 'purged'));
