//! What a stream source keeps in Postgres: the attempts charged to suspect entries, those
//! delivered past the Redis delivery cap (migration 0020; Redis counts every delivery, a
//! restart's or an outage's too; only an attempt begun here, alone, and never finished is the
//! entry's own fault), and the tables it feeds (migration 0025: a corpus run of such a table
//! must fence its unchanged skips against entries older than it, see
//! [`Store::note_stream_fed`]).

use super::{Store, StoreError};

/// One entry of a source stream, as the suspects table names it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct EntryRef<'a> {
    pub stream: &'a str,
    pub group: &'a str,
    pub id: &'a str,
}

impl Store {
    /// Registers `streams` of consumer group `group` as feeding the target table, before
    /// the source reads an entry (a new stream's floor is 0, the oldest of all): from then on
    /// a corpus run of the table moves the position of every unchanged line it skips
    /// (`racing` in `ingest::lease`), and a deletion's tombstone is kept while a stream could
    /// still hand on something older ([`Store::sweep_deletion_state`]), so an older entry
    /// taken over or read late loses to a newer line or deletion instead of undoing it.
    pub(crate) async fn note_stream_fed(&self, streams: &[String], group: &str) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO ingest_stream_fed (target_table, stream, group_name)
             SELECT $1, s, $3 FROM UNNEST($2::text[]) AS s
             ON CONFLICT DO NOTHING",
        )
        .bind(&self.target.name)
        .bind(streams)
        .bind(group)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Sets the oldest position each stream of `group` may still hand on (`(stream, floor)`,
    /// read from Redis at a segment start): what a tombstone of the table must outlive.
    pub(crate) async fn set_stream_floors(
        &self,
        group: &str,
        floors: &[(String, i64)],
    ) -> Result<(), StoreError> {
        let (streams, positions): (Vec<&str>, Vec<i64>) =
            floors.iter().map(|(s, p)| (s.as_str(), *p)).unzip();
        sqlx::query(
            "UPDATE ingest_stream_fed f SET floor_position = n.floor, floor_at = now()
               FROM UNNEST($2::text[], $3::bigint[]) AS n(stream, floor)
              WHERE f.target_table = $1 AND f.group_name = $4 AND f.stream = n.stream",
        )
        .bind(&self.target.name)
        .bind(&streams)
        .bind(&positions)
        .bind(group)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Charges one begun attempt to suspect entry `e`; returns the attempts charged so far
    /// (this one included).
    pub(crate) async fn charge_suspect(&self, e: EntryRef<'_>) -> Result<u32, StoreError> {
        let attempts: i32 = sqlx::query_scalar(
            "INSERT INTO source_suspect AS s (target_table, stream, group_name, entry_id, attempts)
             VALUES ($1, $2, $3, $4, 1)
             ON CONFLICT (target_table, stream, group_name, entry_id)
             DO UPDATE SET attempts = s.attempts + 1, charged_at = now()
             RETURNING s.attempts",
        )
        .bind(&self.target.name)
        .bind(e.stream)
        .bind(e.group)
        .bind(e.id)
        .fetch_one(&self.pool)
        .await?;
        Ok(attempts.max(0) as u32)
    }

    /// Forgets suspect entry `e` once it has an outcome.
    pub(crate) async fn clear_suspect(&self, e: EntryRef<'_>) -> Result<(), StoreError> {
        sqlx::query(
            "DELETE FROM source_suspect
              WHERE target_table = $1 AND stream = $2 AND group_name = $3 AND entry_id = $4",
        )
        .bind(&self.target.name)
        .bind(e.stream)
        .bind(e.group)
        .bind(e.id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Drops suspects untouched for a week (their entries were acknowledged by hand, trimmed,
    /// or their stream is gone).
    pub(crate) async fn sweep_suspects(&self) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM source_suspect WHERE charged_at < now() - interval '7 days'")
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}
