-- A replayer's load charges its item's lease (`loads` + 1) in the statement that reads the
-- row. It used to push `leased_until` forward on every load: a new version of the lease row
-- with an entry in each of its two indexes. The load now extends the lease only when less
-- than half of it is left (src/replay/sql.rs), so the usual charge changes `loads` alone,
-- which no index covers, and with room on the row's page Postgres updates it in place (a
-- heap-only update: no index entry, a third of the WAL). Half of every page of this small,
-- short-lived table (at most `replay_outstanding_max` rows) is kept free for that.
ALTER TABLE replay_lease SET (fillfactor = 50);
