//! Postgres side of the outbox (`dlq_outbox`): what the relay claims and marks, its
//! retention, and what the reconciler and the gauges read from it.
//!
//! Rows are written only by the statements that change the state they announce (park, store,
//! replay commits, operator actions, reconcile repairs), through `embed_dlq_event` (migration
//! 0006) for the event envelope. A claim holds its rows locked (`FOR UPDATE SKIP LOCKED`) in an
//! open transaction while the caller publishes them: several relays can run at once, and a
//! crash before [`Claim::mark_published`] commits leaves the rows unpublished.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{PgPool, Postgres, Row, Transaction};

use crate::store::StoreError;

/// The channel the `dlq_outbox_notify` trigger (migrations 0002, 0005) notifies at commit of
/// a statement that inserted outbox rows: what a relay LISTENs on to wake up.
pub(crate) const NOTIFY_CHANNEL: &str = "embed_dlq_outbox";

/// An unpublished outbox row, as the relay publishes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OutboxRow {
    pub id: i64,
    /// The event's identity on the Redis side (dedup record); never repeats (migration 0005).
    pub event_id: String,
    pub event: String,
    /// `events` or `replay`.
    pub stream: String,
    /// The JSON body, as text.
    pub body: String,
    /// The chunk's identity (canonical target table, doc id, chunk index): what its stream
    /// shard is derived from ([`crate::streams::StreamKeys::shard_of`]).
    pub identity: Identity,
    /// The hour the row was created (UTC, `YYYYMMDDHH`): which dedup hash records its event
    /// ([`crate::streams::StreamKeys::dedup_hash`]); fixed for the row's life, so every
    /// retry looks in the same hash.
    pub dedup_hour: String,
    /// Created before the dedup hashes (migration 0011): an older relay may have published it
    /// with a marker key of its own, which the publish script must also look at.
    pub legacy_marker: bool,
}

/// A chunk's identity as the outbox records it; rows written before migration 0004 name no
/// table and belong to the default one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Identity {
    pub target_table: String,
    pub doc_id: String,
    pub chunk_index: i32,
}

impl Identity {
    /// Reads the identity columns (`target_table` with the default table for old rows,
    /// `doc_id`, `chunk_index`) of a row.
    fn read(r: &sqlx::postgres::PgRow) -> Result<Identity, sqlx::Error> {
        Ok(Identity {
            target_table: r.try_get("target_table")?,
            doc_id: r.try_get("doc_id")?,
            chunk_index: r.try_get("chunk_index")?,
        })
    }

    /// The chunk's stream shard under `keys`.
    pub fn shard(&self, keys: &crate::streams::StreamKeys) -> u16 {
        keys.shard_of(&self.target_table, &self.doc_id, self.chunk_index)
    }
}

/// The oldest unpublished rows, locked by this claim's transaction until it is marked or
/// dropped (dropping rolls back: the rows are someone else's to publish).
pub(crate) struct Claim {
    tx: Transaction<'static, Postgres>,
    pub rows: Vec<OutboxRow>,
}

/// Claims up to `limit` of the oldest unpublished rows that no other relay holds and whose
/// chunk has no earlier unpublished row in the same stream (so one chunk's events reach the
/// stream in outbox order even when several relays drain a backlog side by side). `None` when
/// there is nothing to publish (the transaction is already closed).
///
/// Postgres ends the claim's session if it sits idle for `idle_timeout` (the transaction's
/// `idle_in_transaction_session_timeout`), so a relay that froze or vanished mid-claim
/// releases its rows without anyone noticing the dead connection.
pub async fn claim(pool: &PgPool, limit: usize, idle_timeout: Duration) -> Result<Option<Claim>, StoreError> {
    let mut tx = pool.begin().await?;
    // The claim has one good plan: the oldest rows by `dlq_outbox_unpublished_idx`, stopping
    // at the limit. Right after a large park, before autovacuum analyzed the outbox, the
    // planner guesses a few unpublished rows and reads and sorts the whole backlog instead
    // (2.3 s a claim behind 700,000 rows, 5-8 s in the 1M scale run); the other plans are
    // set aside for this transaction only.
    sqlx::query(
        "SELECT set_config('idle_in_transaction_session_timeout', $1, true),
                set_config('enable_seqscan', 'off', true), set_config('enable_bitmapscan', 'off', true),
                set_config('enable_sort', 'off', true)",
    )
    .bind(idle_timeout.as_millis().to_string())
    .execute(&mut *tx)
    .await?;
    let rows = sqlx::query(
        "SELECT id, event_id::text AS event_id, event, stream, body::text AS body,
                COALESCE(target_table, 'public.doc_embeddings') AS target_table, doc_id, chunk_index,
                embed_dlq_dedup_hour(created_at) AS dedup_hour,
                created_at < COALESCE((SELECT since FROM embed_dlq_dedup_hashes), '-infinity') AS legacy_marker
           FROM dlq_outbox o
          WHERE published_at IS NULL
            -- Not while an earlier row of the chunk waits: it may be held by another relay
            -- (SKIP LOCKED passes over it) or be in this very claim; either way this row goes
            -- in a later batch, after that one is published. A scalar subquery, so it is one
            -- probe of dlq_outbox_unpublished_chunk_idx a row, never a join over the backlog.
            AND (SELECT true FROM dlq_outbox e
                  WHERE e.published_at IS NULL AND e.doc_id = o.doc_id
                    AND e.chunk_index = o.chunk_index AND e.id < o.id AND e.stream = o.stream
                    AND e.target_table IS NOT DISTINCT FROM o.target_table
                  LIMIT 1) IS NULL
          ORDER BY id
          LIMIT $1
          FOR UPDATE OF o SKIP LOCKED",
    )
    .bind(limit as i64)
    .fetch_all(&mut *tx)
    .await?;
    if rows.is_empty() {
        tx.rollback().await?;
        return Ok(None);
    }
    let rows = rows
        .iter()
        .map(|r| {
            Ok(OutboxRow {
                id: r.try_get("id")?,
                event_id: r.try_get("event_id")?,
                event: r.try_get("event")?,
                stream: r.try_get("stream")?,
                body: r.try_get("body")?,
                identity: Identity::read(r)?,
                dedup_hour: r.try_get("dedup_hour")?,
                legacy_marker: r.try_get("legacy_marker")?,
            })
        })
        .collect::<Result<_, sqlx::Error>>()?;
    Ok(Some(Claim { tx, rows }))
}

impl Claim {
    /// Marks the claimed rows `ids` published, each with the stream entry id it became
    /// (`entry_ids`, same order), and commits without waiting for the commit to reach disk
    /// (`synchronous_commit = off` for this transaction only): a mark lost in a database
    /// crash leaves its rows unpublished, which is the case the dedup records already cover
    /// (the next pass gets the original entry ids back and adds nothing), so waiting for the
    /// flush, the longest step of a pass on a busy disk, buys nothing.
    pub(crate) async fn mark_published(mut self, ids: &[i64], entry_ids: &[&str]) -> Result<(), StoreError> {
        sqlx::query("SET LOCAL synchronous_commit = off").execute(&mut *self.tx).await?;
        sqlx::query(
            "UPDATE dlq_outbox o SET published_at = now(), entry_id = p.entry_id
               FROM UNNEST($1::bigint[], $2::text[]) AS p(id, entry_id)
              WHERE o.id = p.id",
        )
        .bind(ids)
        .bind(entry_ids)
        .execute(&mut *self.tx)
        .await?;
        self.tx.commit().await?;
        Ok(())
    }
}

/// Deletes up to 10,000 rows published longer than `retention` ago; returns how many.
pub(crate) async fn prune(pool: &PgPool, retention: Duration) -> Result<u64, StoreError> {
    let done = sqlx::query(
        "DELETE FROM dlq_outbox WHERE id IN (
             SELECT id FROM dlq_outbox
              WHERE published_at < now() - make_interval(secs => $1)
              LIMIT 10000)",
    )
    .bind(retention.as_secs_f64())
    .execute(pool)
    .await?;
    Ok(done.rows_affected())
}

/// What is waiting for the relay.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Backlog {
    /// Unpublished rows.
    pub unpublished: i64,
    /// Unpublished rows older than the `stuck_after` asked for.
    pub stuck: i64,
    /// Age of the oldest unpublished row in seconds (0 when there is none), by the database's
    /// clock.
    pub oldest_secs: f64,
}

/// The unpublished rows, counted and aged in one aggregate.
pub async fn backlog(pool: &PgPool, stuck_after: Duration) -> Result<Backlog, StoreError> {
    let row = sqlx::query(
        "SELECT count(*) AS backlog,
                count(*) FILTER (WHERE created_at < now() - make_interval(secs => $1)) AS stuck,
                COALESCE(extract(epoch FROM now() - min(created_at)), 0)::float8 AS oldest
           FROM dlq_outbox WHERE published_at IS NULL",
    )
    .bind(stuck_after.as_secs_f64())
    .fetch_one(pool)
    .await?;
    Ok(Backlog {
        unpublished: row.try_get("backlog")?,
        stuck: row.try_get("stuck")?,
        oldest_secs: row.try_get("oldest")?,
    })
}

/// A published event and where the relay put it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PublishedEvent {
    pub id: i64,
    pub event_id: String,
    /// The stream entry id recorded at publish time.
    pub entry_id: String,
    /// `doc_id#chunk_index`, for reports.
    pub key: String,
    /// The chunk's identity: which stream shard the event went to.
    pub identity: Identity,
    /// Which dedup hash records the event ([`OutboxRow::dedup_hour`]).
    pub dedup_hour: String,
    /// When the relay marked it published (where an incremental walk resumes).
    pub published_at: DateTime<Utc>,
}

/// Which published `events` rows a page of [`published_events`] holds: the reconciler's
/// walks over the outbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EventsPage {
    /// The rows published at or after a time (the window of an incremental walk; the epoch
    /// for a full one) and before the walk began, by `(published_at, id)` after this cursor:
    /// the `published_at` index, so a page reads its own rows, however many rows wait
    /// unpublished between them (a relay draining a backlog: walked by id, a page of a
    /// 1M-row backlog read up to 8 s), and a walk ends even while a relay keeps publishing
    /// (what it publishes after the walk began goes to the stream as it is now).
    PublishedFrom { at: DateTime<Utc>, after_id: i64, until: DateTime<Utc> },
    /// The rows with the highest ids among those published before a time (the witnesses that
    /// the events before an incremental window are still on the stream).
    PublishedBefore(DateTime<Utc>),
}

/// The database's clock now: where a walk over published events stops ([`EventsPage`]).
pub(crate) async fn clock(pool: &PgPool) -> Result<DateTime<Utc>, StoreError> {
    Ok(sqlx::query_scalar("SELECT clock_timestamp()").fetch_one(pool).await?)
}

/// Up to `limit` published `events` rows of `page` that recorded their entry id (rows
/// published before migration 0005 did not).
pub(crate) async fn published_events(
    pool: &PgPool,
    page: EventsPage,
    limit: usize,
) -> Result<Vec<PublishedEvent>, StoreError> {
    const COLUMNS: &str =
        "SELECT id, event_id::text AS event_id, entry_id, doc_id || '#' || chunk_index AS key,
                COALESCE(target_table, 'public.doc_embeddings') AS target_table, doc_id, chunk_index,
                embed_dlq_dedup_hour(created_at) AS dedup_hour, published_at
           FROM dlq_outbox
          WHERE stream = 'events' AND published_at IS NOT NULL AND entry_id IS NOT NULL";
    let (condition, at, after, until) = match page {
        // `published_at >= $1` is what the index scan starts at; the row comparison breaks
        // the ties of one relay batch (one `now()`) by id.
        EventsPage::PublishedFrom { at, after_id, until } => (
            "AND published_at >= $1 AND (published_at, id) > ($1, $2) AND published_at < $4
             ORDER BY published_at, id",
            Some(at),
            after_id,
            Some(until),
        ),
        // The highest ids before the window: the primary key walked down from the top skips
        // the window's rows and stops at the limit, and the rows are neighbours on the stream
        // (one range read). By `published_at` the rows of one timestamp (a relay batch, or
        // many) came in any order, spread over the stream, and with `id` as a tie-break all
        // of that timestamp's rows were sorted first.
        EventsPage::PublishedBefore(at) => ("AND published_at < $1 ORDER BY id DESC", Some(at), 0, None),
    };
    // Only the constant strings above are spliced in.
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!("{COLUMNS} {condition} LIMIT $3")))
        .bind(at)
        .bind(after)
        .bind(limit as i64)
        .bind(until)
        .fetch_all(pool)
        .await?;
    rows.iter()
        .map(|r| {
            Ok(PublishedEvent {
                id: r.try_get("id")?,
                event_id: r.try_get("event_id")?,
                entry_id: r.try_get("entry_id")?,
                key: r.try_get("key")?,
                identity: Identity::read(r)?,
                dedup_hour: r.try_get("dedup_hour")?,
                published_at: r.try_get("published_at")?,
            })
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(StoreError::from)
}

/// Marks published rows `ids` unpublished again, so the relay publishes them once more (with
/// the same `event_id`); returns how many were marked.
pub(crate) async fn mark_unpublished(pool: &PgPool, ids: &[i64]) -> Result<u64, StoreError> {
    Ok(sqlx::query(
        "UPDATE dlq_outbox SET published_at = NULL, entry_id = NULL
          WHERE id = ANY($1) AND published_at IS NOT NULL",
    )
    .bind(ids)
    .execute(pool)
    .await?
    .rows_affected())
}
