-- Poison entries of a stream source are judged by attempts recorded here, not by Redis's
-- delivery count alone (issue 21): every restart, takeover and database outage adds a Redis
-- delivery, none of them the entry's fault. An entry past the Redis delivery cap is a suspect:
-- it is processed alone, after one begun attempt is charged to it here (which an outage
-- cannot do); its row is deleted once it has an outcome. Only a suspect whose attempts alone
-- never finished `SOLO_ATTEMPTS` times is parked as poison (`src/ingest/source.rs`).
--
-- Bound: one row per suspect entry without an outcome yet; rows untouched for 7 days are
-- swept when a source segment starts.
CREATE TABLE IF NOT EXISTS source_suspect (
    target_table text        NOT NULL,
    stream       text        NOT NULL,
    group_name   text        NOT NULL,
    entry_id     text        NOT NULL,
    attempts     int         NOT NULL,
    charged_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (target_table, stream, group_name, entry_id)
);
CREATE INDEX IF NOT EXISTS source_suspect_charged_at_idx ON source_suspect (charged_at);
