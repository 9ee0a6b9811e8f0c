-- Core schema: manifest, dead-letter queue, outbox and the default vector table.
--
-- Postgres is the system of record. Every chunk that an ingest run finished has exactly one
-- manifest row, and that row says where the chunk lives:
--   stored    -> a row in the vector table with the same content_hash
--   parked    -> a row in embedding_dlq (waiting for replay or for an operator)
--   exhausted -> a row in embedding_dlq that automatic replay gave up on
-- The manifest row, the vector/DLQ row and the outbox row for an outcome are always written in
-- one transaction, so the three can never disagree.

CREATE EXTENSION IF NOT EXISTS vector;

CREATE TABLE ingest_manifest (
    doc_id       text        NOT NULL,
    chunk_index  int         NOT NULL CHECK (chunk_index >= 0),
    -- sha256 over (model, dimensions, text): a model change re-embeds, an identical rerun does not.
    content_hash text        NOT NULL,
    status       text        NOT NULL CHECK (status IN ('stored', 'parked', 'exhausted')),
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (doc_id, chunk_index)
);

CREATE INDEX ingest_manifest_status_idx ON ingest_manifest (status) WHERE status <> 'stored';

CREATE TABLE embedding_dlq (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    doc_id          text        NOT NULL,
    chunk_index     int         NOT NULL,
    content_hash    text        NOT NULL,
    -- The full original record (text + metadata), so the row can be replayed after the
    -- source is gone. Never contains credentials.
    payload         jsonb       NOT NULL,
    error_class     text        NOT NULL CHECK (error_class IN
                        ('transient', 'permanent_input', 'invalid_record',
                         'dimension_mismatch', 'invalid_vector')),
    -- Stable, bounded reason code (e.g. http_503, timeout, too_long): what dashboards group by.
    error_reason    text        NOT NULL,
    -- Sanitised and truncated (never a whole provider body; never a secret).
    last_error      text,
    last_status     int,
    -- Provider attempts spent on this content so far (ingest and replay alike).
    attempts        int         NOT NULL CHECK (attempts >= 0),
    -- Replay passes made from the DLQ; drives the separate, longer DLQ schedule.
    replays         int         NOT NULL DEFAULT 0,
    first_failed_at timestamptz NOT NULL DEFAULT now(),
    last_failed_at  timestamptz NOT NULL DEFAULT now(),
    -- NULL means "never replayed automatically" (permanent classes, exhausted rows).
    next_retry_at   timestamptz,
    exhausted_at    timestamptz,
    UNIQUE (doc_id, chunk_index)
);

-- Only what replay scans: transient rows that are scheduled.
CREATE INDEX embedding_dlq_ready_idx ON embedding_dlq (next_retry_at)
    WHERE next_retry_at IS NOT NULL;
CREATE INDEX embedding_dlq_class_idx ON embedding_dlq (error_class);

-- Transactional outbox: one row per event, written in the same transaction as the state
-- change it describes, relayed to Redis Streams by the relay (at least once, deduplicated
-- by id on the Redis side).
CREATE TABLE dlq_outbox (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event        text        NOT NULL CHECK (event IN ('parked', 'resolved', 'replayed', 'reparked', 'exhausted')),
    dlq_id       bigint,
    doc_id       text        NOT NULL,
    chunk_index  int         NOT NULL,
    -- Compact envelope (ids, class, attempts, timestamps); the payload stays in Postgres.
    body         jsonb       NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz
);

CREATE INDEX dlq_outbox_unpublished_idx ON dlq_outbox (id) WHERE published_at IS NULL;

-- Default target table. Any table with these columns (and any vector(N)) can be used instead;
-- its dimension is read from the catalog at start.
CREATE TABLE doc_embeddings (
    doc_id       text        NOT NULL,
    chunk_index  int         NOT NULL,
    content_hash text        NOT NULL,
    embedding    vector(768) NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    UNIQUE (doc_id, chunk_index)
);
