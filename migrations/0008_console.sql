-- The operator console (src/console/): an audit trail of every action taken through it.
--
-- One row per action: a login or logout, a bulk requeue or purge (after its dry run and
-- confirmation), a reconcile run. A bulk action is written as `running` before its first
-- change and finished with the count it changed, so a console killed mid-action leaves a
-- visible `running` row rather than no trace. Rows are never updated after they finish and
-- never deleted by the tool.
CREATE TABLE console_audit (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    started_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    -- Who: the name given at login (at most 64 characters; the token itself is never stored),
    -- and the peer address the request came from.
    actor       text        NOT NULL CHECK (length(actor) BETWEEN 1 AND 64),
    remote      text,
    action      text        NOT NULL CHECK (action IN ('login', 'logout', 'requeue', 'purge',
                                                       'reconcile_check', 'reconcile_dry_run',
                                                       'reconcile_repair')),
    -- The filter the action applied to (the list's filter fields, plus the highest row id the
    -- confirmed dry run saw: rows parked after it are never swept in).
    filter      jsonb       NOT NULL DEFAULT '{}',
    -- Rows the confirmed dry run counted, and rows the action changed (findings for reconcile).
    matched     bigint,
    count       bigint,
    status      text        NOT NULL CHECK (status IN ('running', 'done', 'failed')),
    -- A short outcome note or error (bounded by the console; never a secret).
    detail      text
);

CREATE INDEX console_audit_started_idx ON console_audit (started_at DESC);
