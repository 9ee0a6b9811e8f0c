//! Postgres side of the outbox (`dlq_outbox`): how far the relay got, its retention, and
//! what the reconciler and the gauges read from it.
//!
//! Rows are written only by the statements that change the state they announce (park, store,
//! replay commits, operator actions, reconcile repairs), through `embed_dlq_event` (migration
//! 0006) for the event envelope, each with the id of the transaction that wrote it (`txid`).
//! The relay never writes a row: it reads them in commit order, interval by interval, as PgQ
//! does (migration 0022). An interval is the rows of the transactions visible in a snapshot
//! (`upper`) and not in the one before (`lower`), read by id. A relay holds the outbox's
//! position ([`take`], the `relay_position` row locked `FOR UPDATE SKIP LOCKED`) while it
//! reads, publishes and moves it ([`Lease`]); another relay finds it held and waits, a crash
//! before [`Lease::commit`] leaves the position where it was.
//!
//! Why the order holds: a chunk's later event comes from a transaction that waited for the
//! earlier event's transaction to release the chunk's row locks, and drew its outbox id after
//! that one committed (migration 0014). So the earlier event is visible in every snapshot
//! that shows the later one: it belongs to an earlier interval, or to the same one with a
//! lower id.
//! (Ordering an interval by transaction id would not hold: ids are drawn when a transaction
//! first writes, not when it commits.)

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

/// The SQL that reads an outbox row for publishing (`o` is `dlq_outbox`).
const ROW_COLUMNS: &str = "o.id, o.event_id::text AS event_id, o.event, o.stream, o.body::text AS body,
        COALESCE(o.target_table, 'public.doc_embeddings') AS target_table, o.doc_id, o.chunk_index,
        embed_dlq_dedup_hour(o.created_at) AS dedup_hour,
        o.created_at < COALESCE((SELECT since FROM embed_dlq_dedup_hashes), '-infinity') AS legacy_marker";

/// The name of the outbox's row in `relay_position` (migration 0022).
const POSITION: &str = "outbox";

/// How far the relay got, as `relay_position` records it (migration 0022): every row of a
/// transaction visible in snapshot `lower` is published; with `upper`, the rows of the
/// transactions visible in `upper` and not in `lower` (the current interval) are published up
/// to id `after_id`, and the interval ends at id `last_id`. Snapshots travel as their text
/// form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Position {
    lower: String,
    upper: Option<String>,
    after_id: i64,
    last_id: i64,
    /// Intervals finished so far.
    batches: i64,
}

impl Position {
    fn read(r: &sqlx::postgres::PgRow) -> Result<Position, sqlx::Error> {
        Ok(Position {
            lower: r.try_get("lower")?,
            upper: r.try_get("upper")?,
            after_id: r.try_get("after_id")?,
            last_id: r.try_get("last_id")?,
            batches: r.try_get("batches")?,
        })
    }

    /// The position once the current interval is published.
    fn interval_done(&self) -> Position {
        Position {
            lower: self.upper.clone().unwrap_or_else(|| self.lower.clone()),
            upper: None,
            after_id: 0,
            last_id: 0,
            batches: self.batches + 1,
        }
    }
}

/// The predicate "published at position `$1` (lower), `$2` (upper), `$3` (after id)" over
/// `dlq_outbox o`; rows an older relay published (no `txid`, migration 0022) count as
/// published.
const PUBLISHED: &str = "(o.txid IS NULL OR pg_visible_in_snapshot(o.txid, $1::pg_snapshot)
          OR ($2::pg_snapshot IS NOT NULL AND pg_visible_in_snapshot(o.txid, $2::pg_snapshot) AND o.id <= $3))";

/// The predicate "`o` waits for the relay at a position": its transaction is not visible in
/// the position's `lower`, and the row is not one of the current interval's published ones.
/// Over parameters `$1` to `$5`, bound by [`Position::bind_unpublished`] before any other.
/// The transactions not visible in `lower` are two ranges of the txid index, as narrow as
/// what committed since: those running when it was taken (`$4`, its running list as
/// `text[]`), and every one from its xmax on (`$5`). Never `txid >= pg_snapshot_xmin(lower)`:
/// a transaction left open anywhere on the server (an idle-in-transaction session, a long
/// report) holds every snapshot's xmin where it began, and that range holds every row
/// committed since. The bounds are bound, not read from `relay_position` in the statement:
/// the planner must see them to pick the index.
pub(crate) const UNPUBLISHED: &str = "((o.txid = ANY($4::text[]::xid8[]) OR o.txid >= $5::text::xid8)
          AND NOT ($2::pg_snapshot IS NOT NULL AND pg_visible_in_snapshot(o.txid, $2::pg_snapshot) AND o.id <= $3))";

/// The outbox's position, held by this relay (the row is locked by its transaction) until
/// [`Lease::commit`] writes how far it got, or the lease is dropped (rolled back: the rows
/// read since are someone else's to publish again, their dedup records making that a no-op).
pub(crate) struct Lease {
    tx: Transaction<'static, Postgres>,
    /// Where the next read starts.
    read: Position,
    /// What the relay published: written at commit.
    published: Position,
    /// Whether `published` moved since the lease was taken.
    moved: bool,
}

/// A page of rows read under a [`Lease`], in publishing order, and the position once they
/// are published.
pub(crate) struct Page {
    pub rows: Vec<OutboxRow>,
    /// The position after these rows ([`Lease::published`]).
    pub then: Position,
    /// Whether a later read may find more (the page was full, or it only finished an
    /// interval whose successor has not been looked at).
    pub more: bool,
}

/// Takes the outbox's position for this relay, or `None` when another relay holds it (it
/// publishes meanwhile; a relay that froze holding it loses it after `idle_timeout`, when
/// Postgres ends its idle transaction, `idle_in_transaction_session_timeout`).
pub async fn take(pool: &PgPool, idle_timeout: Duration) -> Result<Option<Lease>, StoreError> {
    loop {
        match try_take(pool, idle_timeout).await? {
            Taking::Taken(lease) => return Ok(Some(lease)),
            Taking::HeldElsewhere => return Ok(None),
            Taking::Rebased => continue,
        }
    }
}

/// What one attempt of [`take`] came to.
enum Taking {
    Taken(Lease),
    HeldElsewhere,
    /// The position was taken in another cluster and started again ([`rebase`], committed:
    /// the rows handed back are visible to the next attempt).
    Rebased,
}

async fn try_take(pool: &PgPool, idle_timeout: Duration) -> Result<Taking, StoreError> {
    let mut tx = pool.begin().await?;
    // A page has one good plan: the primary key from where the interval's reading stands,
    // stopping at the limit. Before autovacuum analyzed the outbox after a large park, the
    // planner may guess otherwise and read and sort a whole interval; the other plans are set
    // aside for this transaction only.
    let row = sqlx::query(
        "SELECT set_config('idle_in_transaction_session_timeout', $2, true),
                set_config('enable_seqscan', 'off', true), set_config('enable_bitmapscan', 'off', true),
                set_config('enable_sort', 'off', true), set_config('synchronous_commit', 'off', true),
                lower::text AS lower, upper::text AS upper, after_id, last_id, batches, moved_at,
                system_identifier AS taken_in, embed_dlq_system_identifier() AS here,
                pg_snapshot_xmax(pg_current_snapshot()) < pg_snapshot_xmax(COALESCE(upper, lower)) AS ahead
           FROM relay_position WHERE name = $1
            FOR UPDATE SKIP LOCKED",
    )
    .bind(POSITION)
    .bind(idle_timeout.as_millis().to_string())
    .fetch_optional(&mut *tx)
    .await?;
    let Some(row) = row else {
        tx.rollback().await?;
        return Ok(Taking::HeldElsewhere);
    };
    let at = Position::read(&row)?;
    let taken_in: Option<String> = row.try_get("taken_in")?;
    let here: Option<String> = row.try_get("here")?;
    // The statement's snapshot may predate the position it locked (another relay committed
    // it in between): a position ahead of it is looked at again from a snapshot taken now.
    let ahead = row.try_get::<bool, _>("ahead")?
        && sqlx::query_scalar::<_, bool>(
            "SELECT pg_snapshot_xmax(pg_current_snapshot()) < pg_snapshot_xmax($1::pg_snapshot)",
        )
        .bind(at.upper.as_ref().unwrap_or(&at.lower))
        .fetch_one(&mut *tx)
        .await?;
    let elsewhere = matches!((&taken_in, &here), (Some(then), Some(now)) if then != now);
    if ahead || elsewhere {
        let moved_at: DateTime<Utc> = row.try_get("moved_at")?;
        let handed = rebase(&mut tx, &at, moved_at).await?;
        tx.commit().await?;
        tracing::warn!(
            handed_back = handed,
            other_cluster = elsewhere,
            position_ahead = ahead,
            "relay: the outbox's position was taken in another cluster (a logical restore?); \
             every row it cannot vouch for goes to the relay again (dedup records keep the \
             ones on the stream from being added twice)"
        );
        return Ok(Taking::Rebased);
    } else if taken_in.is_none() && here.is_some() {
        sqlx::query("UPDATE relay_position SET system_identifier = $2 WHERE name = $1")
            .bind(POSITION)
            .bind(&here)
            .execute(&mut *tx)
            .await?;
    }
    Ok(Taking::Taken(Lease { tx, read: at.clone(), published: at, moved: false }))
}

/// The txid [`rebase`] gives the rows that were published: the first normal transaction id,
/// visible in every snapshot, so they stay published and walked in order by the reconciler.
const PUBLISHED_TXID: u64 = 3;

/// How far before the position's last move a row may have been created and still be one
/// that was written after a restore: the old and the new server's clocks may disagree by
/// this much (a row written after a restore was created after the dump, which was taken
/// after the position last moved).
const REBASE_CLOCK_MARGIN: Duration = Duration::from_secs(600);

/// Starts the position again in this cluster ([`take`], after a logical restore): every row
/// the old position did not count as published ([`UNPUBLISHED`], the old cluster's ids still
/// compare among themselves) and every row created since it last moved (written in the new
/// cluster, its txid meaningless to the old position) becomes a row of this transaction,
/// which the new `lower` leaves to the relay. Rows already on the stream among them are
/// duplicates the dedup records turn into no-ops. Every other row was published: it gets
/// [`PUBLISHED_TXID`], which every snapshot of this cluster sees (its old txid may be ahead of
/// this cluster's counter: it would read as waiting, and be published again once the counter
/// passed it, maybe after its dedup record expired). Returns how many rows were handed back.
async fn rebase(
    tx: &mut Transaction<'static, Postgres>,
    old: &Position,
    moved_at: DateTime<Utc>,
) -> Result<i64, StoreError> {
    let row = old
        .bind_unpublished(sqlx::query(sqlx::AssertSqlSafe(format!(
            "WITH moved AS (
                 UPDATE dlq_outbox o
                    SET txid = CASE WHEN o.created_at >= $6::timestamptz - make_interval(secs => $7)
                                         OR {UNPUBLISHED}
                                    THEN pg_current_xact_id() ELSE '{PUBLISHED_TXID}'::xid8 END
                  WHERE o.txid IS NOT NULL
                 RETURNING o.txid = pg_current_xact_id() AS handed)
             UPDATE relay_position
                SET lower = embed_dlq_snapshot_before_own(), upper = NULL, after_id = 0, last_id = 0,
                    batches = batches + 1, moved_at = now(), system_identifier = embed_dlq_system_identifier()
              WHERE name = $8
             RETURNING (SELECT count(*) FILTER (WHERE handed) FROM moved) AS handed"
        ))))?
        .bind(moved_at)
        .bind(REBASE_CLOCK_MARGIN.as_secs_f64())
        .bind(POSITION)
        .fetch_one(&mut **tx)
        .await?;
    Ok(row.try_get("handed")?)
}

impl Lease {
    /// Reads the next up to `limit` rows to publish, by id within the current interval, or
    /// opens the next interval (the transactions that committed since) when the current one
    /// is read. Moves only the read position: the caller publishes the rows, then hands
    /// [`Page::then`] to [`Lease::published`].
    pub async fn read(&mut self, limit: usize) -> Result<Page, StoreError> {
        let mut opened = false;
        if self.read.upper.is_none() {
            // The next interval: what committed since `lower`, up to now. Its first id is
            // where the page reads start: rows of a long transaction can have ids far below
            // the rest, so it is the smallest first id of the interval's transactions, one
            // probe of the txid index per transaction (a skip scan), never a read of the
            // interval's rows. Its last: the highest id there is now (every row of the
            // interval is visible to this statement).
            let row = sqlx::query(
                "WITH RECURSIVE s AS (SELECT pg_current_snapshot() AS upper),
                      -- Running when `lower` was taken: each one's first row.
                      running AS (
                        SELECT (SELECT o.id FROM dlq_outbox o WHERE o.txid = x ORDER BY o.id LIMIT 1) AS id
                          FROM pg_snapshot_xip($1::pg_snapshot) x, s
                         WHERE pg_visible_in_snapshot(x, s.upper)),
                      -- Begun since: each one's first row, transaction after transaction.
                      later AS (
                        (SELECT o.txid, o.id FROM dlq_outbox o, s
                          WHERE o.txid >= pg_snapshot_xmax($1::pg_snapshot) AND o.txid < pg_snapshot_xmax(s.upper)
                          ORDER BY o.txid, o.id LIMIT 1)
                        UNION ALL
                        SELECT n.txid, n.id
                          FROM later l, s,
                               LATERAL (SELECT o.txid, o.id FROM dlq_outbox o
                                         WHERE o.txid > l.txid AND o.txid < pg_snapshot_xmax(s.upper)
                                         ORDER BY o.txid, o.id LIMIT 1) n)
                 SELECT (SELECT upper::text FROM s) AS upper,
                        LEAST((SELECT min(id) FROM running),
                              (SELECT min(l.id) FROM later l, s WHERE pg_visible_in_snapshot(l.txid, s.upper)))
                          AS first_id,
                        (SELECT max(id) FROM dlq_outbox) AS last_id",
            )
            .bind(&self.read.lower)
            .fetch_one(&mut *self.tx)
            .await?;
            let upper: String = row.try_get("upper")?;
            let first: Option<i64> = row.try_get("first_id")?;
            let last: Option<i64> = row.try_get("last_id")?;
            match (first, last) {
                (Some(first), Some(last)) => {
                    self.read.upper = Some(upper);
                    self.read.after_id = first - 1;
                    self.read.last_id = last;
                    opened = true;
                }
                // Nothing committed since: the new snapshot becomes `lower`, so the next
                // interval starts from here (and `lower`'s list of running transactions
                // stays short).
                _ => {
                    self.read = Position { upper: Some(upper), ..self.read.clone() }.interval_done();
                    return Ok(Page { rows: vec![], then: self.read.clone(), more: false });
                }
            }
        }
        let upper = self.read.upper.clone().expect("an interval is open");
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {ROW_COLUMNS}
               FROM dlq_outbox o
              WHERE o.id > $3 AND o.id <= $4
                AND NOT pg_visible_in_snapshot(o.txid, $1::pg_snapshot)
                AND pg_visible_in_snapshot(o.txid, $2::pg_snapshot)
              ORDER BY o.id
              LIMIT $5"
        )))
        .bind(&self.read.lower)
        .bind(&upper)
        .bind(self.read.after_id)
        .bind(self.read.last_id)
        .bind(limit as i64)
        .fetch_all(&mut *self.tx)
        .await?;
        let rows: Vec<OutboxRow> = rows.iter().map(OutboxRow::read).collect::<Result<_, sqlx::Error>>()?;
        let full = rows.len() >= limit;
        match rows.last() {
            Some(last) if full && last.id < self.read.last_id => self.read.after_id = last.id,
            _ => self.read = self.read.interval_done(),
        }
        // A short page that opened its interval found everything that committed before it
        // began; one that finished an interval opened earlier leaves the rows committed
        // meanwhile to the next read.
        let more = full || (!opened && !rows.is_empty());
        Ok(Page { rows, then: self.read.clone(), more })
    }

    /// Records that the rows up to `then` (a [`Page::then`] of this lease) are published:
    /// written at [`Lease::commit`].
    pub fn published(&mut self, then: Position) {
        self.moved |= then != self.published;
        self.published = then;
    }

    /// Writes the published position and commits without waiting for the flush (a position
    /// lost in a database crash only republishes rows the dedup records turn into no-ops);
    /// releases the position for the next relay.
    pub async fn commit(mut self) -> Result<(), StoreError> {
        if self.moved {
            let p = &self.published;
            sqlx::query(
                "UPDATE relay_position
                    SET lower = $2::pg_snapshot, upper = $3::pg_snapshot, after_id = $4, last_id = $5,
                        batches = $6, moved_at = now()
                  WHERE name = $1",
            )
            .bind(POSITION)
            .bind(&p.lower)
            .bind(&p.upper)
            .bind(p.after_id)
            .bind(p.last_id)
            .bind(p.batches)
            .execute(&mut *self.tx)
            .await?;
        }
        self.tx.commit().await?;
        Ok(())
    }
}

impl OutboxRow {
    fn read(r: &sqlx::postgres::PgRow) -> Result<OutboxRow, sqlx::Error> {
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
    }
}

/// The outbox's position now (what a walk over published rows stops at).
pub(crate) async fn position(pool: &PgPool) -> Result<Position, StoreError> {
    let row = sqlx::query(
        "SELECT lower::text AS lower, upper::text AS upper, after_id, last_id, batches
           FROM relay_position WHERE name = $1",
    )
    .bind(POSITION)
    .fetch_one(pool)
    .await?;
    Ok(Position::read(&row)?)
}

/// Deletes up to 10,000 published rows created longer than `retention` ago, oldest first;
/// returns how many. Published at the position read first: one the relay moves past
/// meanwhile waits for the next prune.
pub(crate) async fn prune(pool: &PgPool, retention: Duration) -> Result<u64, StoreError> {
    let at = position(pool).await?;
    let done = sqlx::query(sqlx::AssertSqlSafe(format!(
        "DELETE FROM dlq_outbox WHERE id IN (
             SELECT o.id FROM dlq_outbox o
              WHERE o.created_at < now() - make_interval(secs => $4) AND {PUBLISHED}
              ORDER BY o.created_at
              LIMIT 10000)"
    )))
    .bind(&at.lower)
    .bind(&at.upper)
    .bind(at.after_id)
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

/// The unpublished rows ([`UNPUBLISHED`]), counted and aged in one aggregate.
pub async fn backlog(pool: &PgPool, stuck_after: Duration) -> Result<Backlog, StoreError> {
    let at = position(pool).await?;
    let row = at
        .bind_unpublished(sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) AS backlog,
                    count(*) FILTER (WHERE o.created_at < now() - make_interval(secs => $6)) AS stuck,
                    COALESCE(extract(epoch FROM now() - min(o.created_at)), 0)::float8 AS oldest
               FROM dlq_outbox o WHERE {UNPUBLISHED}"
        ))))?
        .bind(stuck_after.as_secs_f64())
        .fetch_one(pool)
        .await?;
    Ok(Backlog {
        unpublished: row.try_get("backlog")?,
        stuck: row.try_get("stuck")?,
        oldest_secs: row.try_get("oldest")?,
    })
}

/// A published event, as the reconciler checks it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PublishedEvent {
    pub id: i64,
    /// The transaction that wrote it (where an incremental walk resumes).
    pub txid: i64,
    pub event_id: String,
    /// `doc_id#chunk_index`, for reports.
    pub key: String,
    /// The chunk's identity: which stream shard the event went to.
    pub identity: Identity,
    /// Which dedup hash records the event and the entry it became ([`OutboxRow::dedup_hour`]).
    pub dedup_hour: String,
    /// Created before the dedup hashes: its record may be an old-format marker key.
    pub legacy_marker: bool,
    /// When it was written: a record older than the dedup records live may have expired.
    pub created_at: DateTime<Utc>,
}

/// Which published `events` rows a page of [`published_events`] holds: the reconciler's
/// walks over the outbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum EventsPage {
    /// The rows of the transactions not visible in snapshot `since` (every row with a txid
    /// when `None`: a full walk), published at position `at` (taken when the walk began, so a
    /// walk ends even while a relay keeps publishing; what it publishes after the walk began
    /// goes to the stream as it is now), by `(txid, id)` after `after`: the txid index, so a
    /// page reads its own rows.
    Published { since: Option<String>, after: (i64, i64), at: Position },
    /// The rows with the highest ids among those of the transactions visible in a snapshot
    /// (published when the previous walk began): the witnesses that the events before an
    /// incremental window are still on the stream. Neighbours on the stream, one range read.
    PublishedBefore(String),
}

/// A window of the reconciler's walk as a snapshot: the rows of the transactions not
/// visible in it. Kept as its parts, so the transactions of unrepaired findings can be
/// added to it ([`Window::hold`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Window {
    xmin: u64,
    xmax: u64,
    xip: std::collections::BTreeSet<u64>,
}

impl Window {
    /// Reads a snapshot's text form (`xmin:xmax:xip,...`); `None` if it is not one.
    pub fn parse(text: &str) -> Option<Window> {
        let mut parts = text.split(':');
        let xmin = parts.next()?.parse().ok()?;
        let xmax = parts.next()?.parse().ok()?;
        let xip = match parts.next()? {
            "" => Default::default(),
            list => list.split(',').map(|x| x.parse().ok()).collect::<Option<_>>()?,
        };
        (parts.next().is_none() && xmin <= xmax).then_some(Window { xmin, xmax, xip })
    }

    /// The transactions running when the snapshot was taken, each as the text of an `xid8`
    /// (bound as `text[]`, cast to `xid8[]`): with [`Window::xmax`], the two ranges of the
    /// txid index that hold the rows not visible in it ([`UNPUBLISHED`]).
    pub fn running(&self) -> Vec<String> {
        self.xip.iter().map(u64::to_string).collect()
    }

    /// The first transaction the snapshot saw as not yet begun.
    pub fn xmax(&self) -> u64 {
        self.xmax
    }

    /// Whether this snapshot saw transactions that had not begun when `other` was taken:
    /// never for an earlier snapshot of the same cluster (xmax only grows), so a window ahead
    /// of the relay's position was taken in another cluster (a logical restore).
    pub fn is_ahead_of(&self, other: &Window) -> bool {
        self.xmax > other.xmax
    }

    /// Makes the rows of transactions `txids` fall inside the window (not visible).
    pub fn hold(&mut self, txids: impl IntoIterator<Item = i64>) {
        for t in txids {
            let t = t as u64;
            if t < self.xmax {
                self.xip.insert(t);
                self.xmin = self.xmin.min(t);
            }
        }
    }
}

impl std::fmt::Display for Window {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}:", self.xmin, self.xmax)?;
        for (n, x) in self.xip.iter().enumerate() {
            if n > 0 {
                f.write_str(",")?;
            }
            write!(f, "{x}")?;
        }
        Ok(())
    }
}

impl Position {
    /// The snapshot every published row's transaction is visible in (text form).
    pub fn lower(&self) -> &str {
        &self.lower
    }

    /// Binds the position as the parameters `$1` to `$5` of [`UNPUBLISHED`].
    pub fn bind_unpublished<'q>(
        &'q self,
        q: sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>, StoreError> {
        let lower = Window::parse(&self.lower).ok_or_else(|| {
            StoreError::Db(sqlx::Error::Decode(
                format!("relay_position.lower is not a snapshot: {:?}", self.lower).into(),
            ))
        })?;
        Ok(q.bind(&self.lower)
            .bind(&self.upper)
            .bind(self.after_id)
            .bind(lower.running())
            .bind(lower.xmax().to_string()))
    }
}

/// Up to `limit` published `events` rows of `page`.
pub(crate) async fn published_events(
    pool: &PgPool,
    page: &EventsPage,
    limit: usize,
) -> Result<Vec<PublishedEvent>, StoreError> {
    const COLUMNS: &str = "SELECT o.id, o.txid::text::bigint AS txid, o.event_id::text AS event_id,
                o.doc_id || '#' || o.chunk_index AS key,
                COALESCE(o.target_table, 'public.doc_embeddings') AS target_table, o.doc_id, o.chunk_index,
                embed_dlq_dedup_hour(o.created_at) AS dedup_hour,
                o.created_at < COALESCE((SELECT since FROM embed_dlq_dedup_hashes), '-infinity') AS legacy_marker,
                o.created_at
           FROM dlq_outbox o
          WHERE o.stream = 'events' AND o.txid IS NOT NULL";
    // Published at the walk's position, and committed before it was taken.
    let at_position =
        format!("AND o.txid < pg_snapshot_xmax(COALESCE($2::pg_snapshot, $1::pg_snapshot)) AND {PUBLISHED}");
    let rows =
        match page {
            EventsPage::Published { since, after, at } => {
                // The transactions of the window, in two parts merged by `(txid, id)`: each
                // running one's rows by its own index range, then every one from the xmax on.
                // A full walk (no window): every transaction from the first. Each part's
                // start is one `(txid, id)` bound: beside a second lower bound on `txid` alone,
                // the index scan started from the row bound and read every entry before the
                // other (the whole outbox, for an incremental run's first page).
                let window = since.as_deref().and_then(Window::parse);
                let (running, xmax) = window.map_or((vec![], 0), |w| (w.running(), w.xmax()));
                let (txid, id) = (after.0.max(0) as u64, after.1);
                let from = if txid >= xmax { (txid, id) } else { (xmax, i64::MIN) };
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "SELECT * FROM (
                       (SELECT c.* FROM unnest($4::text[]::xid8[]) x
                          CROSS JOIN LATERAL ({COLUMNS}
                              AND (o.txid, o.id) > (x, CASE WHEN x = $6::text::xid8 THEN $7 ELSE 0 END)
                              AND (o.txid, o.id) < (x, 9223372036854775807) {at_position}
                            ORDER BY o.txid, o.id LIMIT $8) c
                         WHERE x >= $6::text::xid8)
                       UNION ALL
                       ({COLUMNS} AND (o.txid, o.id) > ($5::text::xid8, $9) {at_position}
                         ORDER BY o.txid, o.id LIMIT $8)
                     ) w
                     ORDER BY txid, id LIMIT $8"
                )))
                .bind(&at.lower)
                .bind(&at.upper)
                .bind(at.after_id)
                .bind(running)
                .bind(from.0.to_string())
                .bind(txid.to_string())
                .bind(id)
                .bind(limit as i64)
                .bind(from.1)
                .fetch_all(pool)
                .await?
            }
            EventsPage::PublishedBefore(window) => sqlx::query(sqlx::AssertSqlSafe(format!(
                "{COLUMNS} AND pg_visible_in_snapshot(o.txid, $1::pg_snapshot) ORDER BY o.id DESC LIMIT $2"
            )))
            .bind(window)
            .bind(limit as i64)
            .fetch_all(pool)
            .await?,
        };
    rows.iter()
        .map(|r| {
            Ok(PublishedEvent {
                id: r.try_get("id")?,
                txid: r.try_get("txid")?,
                event_id: r.try_get("event_id")?,
                key: r.try_get("key")?,
                identity: Identity::read(r)?,
                dedup_hour: r.try_get("dedup_hour")?,
                legacy_marker: r.try_get("legacy_marker")?,
                created_at: r.try_get("created_at")?,
            })
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(StoreError::from)
}

/// Has the relay publish rows `ids` again (with the same `event_id`): each becomes a row of
/// this transaction, which no position has seen yet; returns how many.
pub(crate) async fn mark_unpublished(pool: &PgPool, ids: &[i64]) -> Result<u64, StoreError> {
    Ok(sqlx::query("UPDATE dlq_outbox SET txid = pg_current_xact_id() WHERE id = ANY($1)")
        .bind(ids)
        .execute(pool)
        .await?
        .rows_affected())
}

#[cfg(test)]
mod tests {
    use super::Window;

    #[test]
    fn a_window_reads_and_writes_the_snapshot_text_form() {
        for text in ["10:20:", "10:20:10,15,19", "3:3:"] {
            assert_eq!(Window::parse(text).unwrap().to_string(), text);
        }
        for bad in ["", "10", "10:20", "20:10:", "10:20:x", "10:20:1:2", "-1:5:"] {
            assert_eq!(Window::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn holding_a_transaction_puts_its_rows_back_inside_the_window() {
        let mut w = Window::parse("10:20:12").unwrap();
        // 5 was visible (below xmin), 15 visible (not running), 25 never was.
        w.hold([15, 5, 25]);
        assert_eq!(w.to_string(), "5:20:5,12,15");
    }
}
