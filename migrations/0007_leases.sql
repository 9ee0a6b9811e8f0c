-- Ingest leases: concurrent runs of the same corpus share the work.
--
-- Before a run sends a chunk to the provider it claims the chunk here (one statement per
-- intake window, folded into the manifest lookup). Another run that meets the same content
-- while the lease is live leaves the chunk to the holder and reports it as
-- `leased_elsewhere`. The holder's store or park marks the lease finished in its own
-- transaction. A finished lease turns away a claim of the same content only if the claim's
-- snapshot cannot see that transaction (its manifest lookup missed the outcome and would
-- embed the chunk again); once visible, the manifest speaks for the chunk. The holder
-- sweeps its finished leases a few seconds later.
--
-- An unfinished lease is live while both hold:
--   * expires_at is in the future ([ingest] lease_secs after the claim), and
--   * the holding run still holds its session advisory lock
--     (pg_advisory_lock(embed_dlq_lease_lock_space(), run_id)): a run killed with -9 loses
--     its connection, Postgres drops the lock, and its leases are taken over at once.
-- A lease never decides an outcome: the manifest's content hash and source_seq fence every
-- write as before. Losing every lease (a crash of Postgres truncates this UNLOGGED table, a
-- failover does not carry it) costs duplicate provider calls, never a wrong or lost chunk,
-- so the table skips the WAL.
CREATE UNLOGGED TABLE ingest_lease (
    target_table text        NOT NULL,
    doc_id       text        NOT NULL,
    chunk_index  int         NOT NULL,
    -- The content the holder is embedding: only a run with the same content defers to it.
    content_hash text        NOT NULL,
    -- Position of the holder's record (ingest run << 32 | line).
    source_seq   bigint      NOT NULL,
    -- The holding ingest run (nextval of embed_dlq_ingest_run_seq).
    run_id       bigint      NOT NULL,
    expires_at   timestamptz NOT NULL,
    -- When and in which transaction the holder's outcome (store or park) was written;
    -- NULL while it is in flight.
    finished_at  timestamptz,
    finished_xact xid8,
    PRIMARY KEY (target_table, doc_id, chunk_index)
);

-- A run's sweep of its own finished leases at each window (a range: only the rows it
-- deletes) and its release when it ends.
CREATE INDEX ingest_lease_run_idx ON ingest_lease (run_id, finished_at);
-- The sweep of expired leases at the start of a run.
CREATE INDEX ingest_lease_expires_idx ON ingest_lease (expires_at);

-- The first key of the two-key advisory lock that marks a run alive (the second is its run id),
-- named once so the statements and an operator's query agree.
CREATE FUNCTION embed_dlq_lease_lock_space() RETURNS int LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN 1701667172;
