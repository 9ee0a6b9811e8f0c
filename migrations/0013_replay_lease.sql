-- Replay leases in a narrow table of their own, and attempts counted where they happen.
--
-- Until this migration the scheduler handed a DLQ row out as replay work by pushing its
-- `next_retry_at` out by a fixed 15-minute lease (a new version of the ~1 kB row with its index
-- entries), issued a new work item whenever that lease ran out whether or not the last one
-- was still unread (a backlog grew the replay stream without bound), and a row was exhausted
-- after `delivery_cap` Redis deliveries, which a database outage burns without any replay
-- being tried. Now:
--
-- * `next_retry_at` is only the row's due time, written when it is parked, re-parked,
--   postponed or requeued; handing it out writes one narrow `replay_lease` row.
-- * A row has at most one live lease, and so at most one work item that counts: the item
--   carries `lease_no`, and an older item of the same row left in the stream is skipped.
-- * Live leases are capped (`[serve] replay_outstanding_max`): the scheduler issues no more.
-- * `loads` counts the times a replayer loaded the item's row and began to replay it without
--   an outcome committing. It is written by the load statement itself, so a database that
--   cannot be reached charges nothing; past `delivery_cap` the row is exhausted (an input that
--   kills its replayer every time). Any outcome (replayed, re-parked, postponed, exhausted,
--   requeued) deletes the lease.
--
-- generation    the DLQ row's generation the item was issued for (another one: stale lease)
-- lease_no      the one item that stands for this lease (from embed_dlq_lease_seq)
-- leased_at     when the item was issued (the reconciler's lost-work grace counts from it)
-- leased_until  no other item is issued before then; extended when a replayer loads the row
CREATE SEQUENCE IF NOT EXISTS embed_dlq_lease_seq;
CREATE TABLE IF NOT EXISTS replay_lease (
    dlq_id       bigint PRIMARY KEY,
    generation   bigint NOT NULL,
    lease_no     bigint NOT NULL DEFAULT nextval('embed_dlq_lease_seq'),
    leased_at    timestamptz NOT NULL DEFAULT now(),
    leased_until timestamptz NOT NULL,
    loads        int NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS replay_lease_until_idx ON replay_lease (leased_until);

-- One scheduler pass at a time per database (a transaction-level advisory lock, tried, never
-- waited for): two passes side by side would each see room under the cap and overshoot it.
CREATE OR REPLACE FUNCTION embed_dlq_schedule_lock_key() RETURNS bigint LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN 7310313382545957732;
