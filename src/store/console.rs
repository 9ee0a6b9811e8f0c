//! Postgres side of the operator console (`crate::console`): what its pages read beyond the
//! DLQ statements of `store::dlq` (whose [`RowFilter`] selects rows here too), and the audit
//! trail of its actions (`console_audit`, migration 0008).
//!
//! - the list page: a keyset page over `embedding_dlq` in any of a few sort orders
//!   ([`SortKey`]), with a cursor that is the database's own text form of the sort value
//!   plus the row id, so paging is exact whatever the order and never uses `OFFSET`;
//! - the overview: depth by class and reason, park and replay activity over time (from the
//!   outbox's `events` rows, which the relay keeps for a day after publishing them), the
//!   last reconcile runs;
//! - the filter form's choices (target tables, reasons), each bounded;
//! - the audit trail: an action is written as `running` before it changes anything and
//!   finished with its count.
//!
//! Every statement is bounded by a `LIMIT` or an aggregate; none takes a lock the pipeline
//! waits on.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgPool, Postgres, QueryBuilder, Row};

use super::StoreError;
use super::dlq::{LISTED_COLUMNS, Listed, RowFilter, listed};
use crate::model::ErrorClass;

/// A column the list can be sorted by; each sorts with the row id as the tie-breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SortKey {
    /// Row id: the order rows were parked in (the primary key: the cheapest order).
    #[default]
    Id,
    /// Document id, then chunk (by row id within a document).
    Doc,
    /// When the chunk first failed.
    FirstFailed,
    /// When it last failed.
    LastFailed,
    /// Provider attempts spent on it.
    Attempts,
    /// When replay takes it next (rows never replayed automatically sort last).
    NextRetry,
}

impl SortKey {
    /// Every sort key, in the order the list's header shows them.
    pub const ALL: [SortKey; 6] = [
        SortKey::Id,
        SortKey::Doc,
        SortKey::FirstFailed,
        SortKey::LastFailed,
        SortKey::Attempts,
        SortKey::NextRetry,
    ];

    /// The spelling in a URL.
    pub fn as_str(self) -> &'static str {
        match self {
            SortKey::Id => "id",
            SortKey::Doc => "doc",
            SortKey::FirstFailed => "first_failed",
            SortKey::LastFailed => "last_failed",
            SortKey::Attempts => "attempts",
            SortKey::NextRetry => "next_retry",
        }
    }

    /// Parses the URL spelling; `None` for anything else.
    pub fn parse(s: &str) -> Option<SortKey> {
        SortKey::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// The SQL expression sorted on and the type its cursor text is cast to. Constant
    /// strings: nothing from a request reaches the statement text.
    fn sql(self) -> (&'static str, &'static str) {
        match self {
            SortKey::Id => ("id", "bigint"),
            SortKey::Doc => ("doc_id", "text"),
            SortKey::FirstFailed => ("first_failed_at", "timestamptz"),
            SortKey::LastFailed => ("last_failed_at", "timestamptz"),
            SortKey::Attempts => ("attempts", "int"),
            SortKey::NextRetry => ("COALESCE(next_retry_at, 'infinity'::timestamptz)", "timestamptz"),
        }
    }
}

/// Where a page starts: after the row whose sort value (as the database prints it) and id
/// are these. Taken from the previous page's last row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    /// The sort value in the database's text form (a timestamp, a number, a doc id).
    pub key: String,
    /// The row id, the tie-breaker.
    pub id: i64,
}

/// One page of the list.
#[derive(Debug, Clone)]
pub struct Page {
    /// The rows, in the requested order.
    pub rows: Vec<Listed>,
    /// Where the next page starts; `None` on the last page.
    pub next: Option<Cursor>,
}

/// Up to `limit` rows matching `filter` in `sort` order (descending with `desc`), after
/// `after` (keyset paging). A cursor whose key does not parse as the sort column's type is
/// a database error (the caller shows it as a bad request).
pub async fn page(
    pool: &PgPool,
    filter: &RowFilter,
    sort: SortKey,
    desc: bool,
    after: Option<&Cursor>,
    limit: i64,
) -> Result<Page, StoreError> {
    let (expr, ty) = sort.sql();
    let mut q = QueryBuilder::<Postgres>::new(format!(
        "SELECT {LISTED_COLUMNS}, ({expr})::text AS sort_key FROM embedding_dlq"
    ));
    filter.push_where(&mut q);
    if let Some(c) = after {
        q.push(format!(" AND ({expr}, id) {} (", if desc { "<" } else { ">" }));
        q.push_bind(c.key.clone()).push(format!("::{ty}, ")).push_bind(c.id).push(")");
    }
    let dir = if desc { "DESC" } else { "ASC" };
    q.push(format!(" ORDER BY {expr} {dir}, id {dir} LIMIT ")).push_bind(limit + 1);
    let rows = q.build().fetch_all(pool).await?;
    let more = rows.len() as i64 > limit;
    let mut listed_rows = Vec::with_capacity(rows.len());
    let mut next = None;
    for (i, r) in rows.iter().enumerate() {
        if i as i64 == limit {
            break;
        }
        let row = listed(r)?;
        if more && i as i64 == limit - 1 {
            next = Some(Cursor { key: r.try_get("sort_key")?, id: row.id });
        }
        listed_rows.push(row);
    }
    Ok(Page { rows: listed_rows, next })
}

/// The highest row id matching `filter`: what a dry run saw, so that the confirmed action
/// can be limited to it ([`RowFilter::max_id`]).
pub async fn max_id(pool: &PgPool, filter: &RowFilter) -> Result<Option<i64>, StoreError> {
    let mut q = QueryBuilder::<Postgres>::new("SELECT max(id) FROM embedding_dlq");
    filter.push_where(&mut q);
    Ok(q.build_query_scalar().fetch_one(pool).await?)
}

/// DLQ rows of one class and reason.
#[derive(Debug, Clone, Serialize)]
pub struct ReasonDepth {
    /// The rows' error class.
    pub error_class: ErrorClass,
    /// Their bounded reason code.
    pub error_reason: String,
    /// How many rows.
    pub rows: i64,
}

/// Most (class, reason) pairs the overview lists; the rest are summed in the class totals.
pub const MAX_REASONS: i64 = 50;

/// DLQ depth by class and reason, largest first, at most [`MAX_REASONS`] pairs.
pub async fn depth_by_reason(pool: &PgPool) -> Result<Vec<ReasonDepth>, StoreError> {
    let rows = sqlx::query(
        "SELECT error_class, error_reason, count(*) AS n FROM embedding_dlq
          GROUP BY 1, 2 ORDER BY n DESC, 1, 2 LIMIT $1",
    )
    .bind(MAX_REASONS)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(ReasonDepth {
                error_class: r.try_get("error_class")?,
                error_reason: r.try_get("error_reason")?,
                rows: r.try_get("n")?,
            })
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(StoreError::from)
}

/// Most choices a filter select offers (target tables, reasons).
pub const MAX_CHOICES: i64 = 200;

/// The target tables DLQ rows are meant for, at most [`MAX_CHOICES`] (a loose index scan
/// over the identity key, so it costs one probe per table, not a scan of the DLQ).
pub async fn tables(pool: &PgPool) -> Result<Vec<String>, StoreError> {
    Ok(sqlx::query_scalar(
        "WITH RECURSIVE t(name, n) AS (
             (SELECT target_table, 1 FROM embedding_dlq ORDER BY target_table LIMIT 1)
             UNION ALL
             SELECT (SELECT d.target_table FROM embedding_dlq d WHERE d.target_table > t.name
                      ORDER BY d.target_table LIMIT 1), n + 1
               FROM t WHERE t.name IS NOT NULL AND n < $1)
         SELECT name FROM t WHERE name IS NOT NULL",
    )
    .bind(MAX_CHOICES)
    .fetch_all(pool)
    .await?)
}

/// The reasons DLQ rows carry, most frequent first, at most [`MAX_CHOICES`].
pub async fn reasons(pool: &PgPool) -> Result<Vec<String>, StoreError> {
    Ok(sqlx::query_scalar(
        "SELECT error_reason FROM embedding_dlq GROUP BY 1 ORDER BY count(*) DESC, 1 LIMIT $1",
    )
    .bind(MAX_CHOICES)
    .fetch_all(pool)
    .await?)
}

/// Parks and replays in one time bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Bucket {
    /// Start of the bucket.
    pub start: DateTime<Utc>,
    /// Chunks parked or re-parked (`parked` and `reparked` events).
    pub parked: i64,
    /// Chunks stored by a replay (`replayed` events).
    pub replayed: i64,
}

/// Park and replay counts in `buckets` consecutive buckets of `bucket_secs` ending now
/// (oldest first, empty buckets included), from the outbox's `events` rows. The relay
/// deletes published rows a day after publishing them (`RelayConfig::retention`), so
/// windows longer than that undercount their oldest part.
pub async fn activity(pool: &PgPool, bucket_secs: u32, buckets: u32) -> Result<Vec<Bucket>, StoreError> {
    let bucket_secs = bucket_secs.clamp(1, 86_400) as f64;
    let buckets = buckets.clamp(1, 1000) as i32;
    let rows = sqlx::query(
        "WITH edges AS (
             SELECT to_timestamp(floor(extract(epoch FROM now()) / $1) * $1) AS last_start),
         series AS (
             SELECT last_start - make_interval(secs => $1 * k) AS start
               FROM edges, generate_series(0, $2 - 1) AS k),
         counted AS (
             SELECT to_timestamp(floor(extract(epoch FROM o.created_at) / $1) * $1) AS start,
                    count(*) FILTER (WHERE o.event IN ('parked', 'reparked')) AS parked,
                    count(*) FILTER (WHERE o.event = 'replayed') AS replayed
               FROM dlq_outbox o, edges
              WHERE o.stream = 'events' AND o.event IN ('parked', 'reparked', 'replayed')
                AND o.created_at >= edges.last_start - make_interval(secs => $1 * ($2 - 1))
              GROUP BY 1)
         SELECT s.start, COALESCE(c.parked, 0) AS parked, COALESCE(c.replayed, 0) AS replayed
           FROM series s LEFT JOIN counted c USING (start)
          ORDER BY s.start",
    )
    .bind(bucket_secs)
    .bind(buckets)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(Bucket {
                start: r.try_get("start")?,
                parked: r.try_get("parked")?,
                replayed: r.try_get("replayed")?,
            })
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(StoreError::from)
}

/// A recorded reconcile run (`reconcile_runs`).
#[derive(Debug, Clone, Serialize)]
pub struct ReconcileRun {
    /// The run's id.
    pub id: i64,
    /// When it started.
    pub started_at: DateTime<Utc>,
    /// When it finished.
    pub finished_at: DateTime<Utc>,
    /// Whether it repaired (a check or dry run did not).
    pub repaired: bool,
    /// Its findings as recorded: `{check: {found, repaired, examples, note}}`.
    pub findings: serde_json::Value,
}

/// The newest `limit` reconcile runs, newest first.
pub async fn reconcile_runs(pool: &PgPool, limit: i64) -> Result<Vec<ReconcileRun>, StoreError> {
    let rows = sqlx::query(
        "SELECT id, started_at, finished_at, repaired, findings FROM reconcile_runs
          ORDER BY id DESC LIMIT $1",
    )
    .bind(limit.clamp(1, 100))
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(ReconcileRun {
                id: r.try_get("id")?,
                started_at: r.try_get("started_at")?,
                finished_at: r.try_get("finished_at")?,
                repaired: r.try_get("repaired")?,
                findings: r.try_get("findings")?,
            })
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(StoreError::from)
}

/// One row of the audit trail.
#[derive(Debug, Clone, Serialize)]
pub struct AuditEntry {
    /// The entry's id (what the action's result page shows).
    pub id: i64,
    /// When the action started.
    pub started_at: DateTime<Utc>,
    /// When it finished (`None` while running, or if the console died during it).
    pub finished_at: Option<DateTime<Utc>>,
    /// Who: the name given at login.
    pub actor: String,
    /// The peer address of the request.
    pub remote: Option<String>,
    /// `login`, `logout`, `requeue`, `purge`, `reconcile_check`, `reconcile_dry_run`,
    /// `reconcile_repair`.
    pub action: String,
    /// The filter it applied to.
    pub filter: serde_json::Value,
    /// Rows the confirmed dry run counted.
    pub matched: Option<i64>,
    /// Rows changed so far (findings for reconcile).
    pub count: Option<i64>,
    /// `running`, `done` or `failed`.
    pub status: String,
    /// A short outcome note or error.
    pub detail: Option<String>,
}

/// Longest audit `detail` stored, in characters.
pub const MAX_AUDIT_DETAIL: usize = 1000;

/// Writes a new audit entry (`running` unless `done` is given) and returns its id.
#[allow(clippy::too_many_arguments)]
pub async fn audit_start(
    pool: &PgPool,
    actor: &str,
    remote: Option<&str>,
    action: &str,
    filter: &serde_json::Value,
    matched: Option<i64>,
    done: Option<(i64, &str)>,
) -> Result<i64, StoreError> {
    let (count, detail, status) = match done {
        Some((n, d)) => (Some(n), Some(bounded(d)), "done"),
        None => (None, None, "running"),
    };
    Ok(sqlx::query_scalar(
        "INSERT INTO console_audit (actor, remote, action, filter, matched, count, status, detail, finished_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, CASE WHEN $7 = 'running' THEN NULL ELSE now() END)
         RETURNING id",
    )
    .bind(actor)
    .bind(remote)
    .bind(action)
    .bind(filter)
    .bind(matched)
    .bind(count)
    .bind(status)
    .bind(detail)
    .fetch_one(pool)
    .await?)
}

/// Updates a running entry's count (progress of a bulk action).
pub async fn audit_progress(pool: &PgPool, id: i64, count: i64) -> Result<(), StoreError> {
    sqlx::query("UPDATE console_audit SET count = $2 WHERE id = $1 AND status = 'running'")
        .bind(id)
        .bind(count)
        .execute(pool)
        .await?;
    Ok(())
}

/// Finishes a running entry with its final count, `done` or `failed`, and a note.
pub async fn audit_finish(
    pool: &PgPool,
    id: i64,
    count: i64,
    ok: bool,
    detail: &str,
) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE console_audit SET count = $2, status = $3, detail = $4, finished_at = now()
          WHERE id = $1 AND status = 'running'",
    )
    .bind(id)
    .bind(count)
    .bind(if ok { "done" } else { "failed" })
    .bind(bounded(detail))
    .execute(pool)
    .await?;
    Ok(())
}

/// One audit entry.
pub async fn audit_get(pool: &PgPool, id: i64) -> Result<Option<AuditEntry>, StoreError> {
    let r = sqlx::query(AUDIT_SELECT_ONE).bind(id).fetch_optional(pool).await?;
    r.as_ref().map(audit_entry).transpose().map_err(StoreError::from)
}

/// The newest `limit` audit entries, newest first.
pub async fn audit_recent(pool: &PgPool, limit: i64) -> Result<Vec<AuditEntry>, StoreError> {
    let rows = sqlx::query(AUDIT_SELECT_RECENT).bind(limit.clamp(1, 500)).fetch_all(pool).await?;
    rows.iter().map(audit_entry).collect::<Result<_, sqlx::Error>>().map_err(StoreError::from)
}

const AUDIT_SELECT_ONE: &str =
    "SELECT id, started_at, finished_at, actor, remote, action, filter, matched, count, status, detail
       FROM console_audit WHERE id = $1";
const AUDIT_SELECT_RECENT: &str =
    "SELECT id, started_at, finished_at, actor, remote, action, filter, matched, count, status, detail
       FROM console_audit ORDER BY started_at DESC, id DESC LIMIT $1";

fn audit_entry(r: &sqlx::postgres::PgRow) -> Result<AuditEntry, sqlx::Error> {
    Ok(AuditEntry {
        id: r.try_get("id")?,
        started_at: r.try_get("started_at")?,
        finished_at: r.try_get("finished_at")?,
        actor: r.try_get("actor")?,
        remote: r.try_get("remote")?,
        action: r.try_get("action")?,
        filter: r.try_get("filter")?,
        matched: r.try_get("matched")?,
        count: r.try_get("count")?,
        status: r.try_get("status")?,
        detail: r.try_get("detail")?,
    })
}

fn bounded(s: &str) -> String {
    s.chars().take(MAX_AUDIT_DETAIL).collect()
}

/// Characters of a row's text, of its metadata and of its other payload fields (as JSON
/// text) that its detail page reads. A row's payload is as big as its source line allowed
/// (up to 64 MiB): the page reads this much of each part, never the whole payload, so its
/// memory does not grow with the row.
pub const DETAIL_TEXT_CHARS: i32 = 64 * 1024;

/// The start of one part of a payload, and how long the whole part is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Excerpt {
    /// At most [`DETAIL_TEXT_CHARS`] characters: the string itself for a JSON string, else
    /// the compact JSON text.
    pub head: String,
    /// Characters of the whole part.
    pub chars: i64,
    /// The part is a JSON string (else `head` is JSON text).
    pub is_string: bool,
}

impl Excerpt {
    /// The part is longer than its `head`.
    pub fn truncated(&self) -> bool {
        self.chars > self.head.chars().count() as i64
    }
}

/// What a row's detail page shows: the row's columns and excerpts of its payload.
#[derive(Debug, Clone)]
pub struct RowView {
    /// The row's columns; `payload` is `null` here (see the excerpts).
    pub detail: super::dlq::Detail,
    /// The payload's `text`, if it has one.
    pub text: Option<Excerpt>,
    /// The payload's `metadata`, if it has any.
    pub metadata: Option<Excerpt>,
    /// The payload's other fields (besides `text`, `metadata`, `doc_id`, `chunk_index`) as
    /// a JSON object, if there are any.
    pub rest: Option<Excerpt>,
}

/// One row for its detail page, with at most [`DETAIL_TEXT_CHARS`] of each payload part
/// (cut by Postgres: the rest never leaves the database).
pub async fn row_view(pool: &PgPool, id: i64) -> Result<Option<RowView>, StoreError> {
    let sql = format!(
        "WITH p AS (
           SELECT {LISTED_COLUMNS}, content_hash, model, dimensions, request_dimensions, last_error,
                  last_status, exhausted_reason, error_history,
                  jsonb_typeof(payload -> 'text') = 'string' AS text_is_string,
                  CASE WHEN jsonb_typeof(payload -> 'text') = 'string' THEN payload ->> 'text'
                       ELSE (payload -> 'text')::text END AS text,
                  (payload -> 'metadata')::text AS metadata,
                  CASE WHEN jsonb_typeof(payload) = 'object'
                       THEN NULLIF(payload - ARRAY['text', 'metadata', 'doc_id', 'chunk_index'], '{{}}'::jsonb)::text
                  END AS rest
             FROM embedding_dlq WHERE id = $1)
         SELECT id, target_table, doc_id, chunk_index, error_class, error_reason, attempts, replays,
                generation, first_failed_at, last_failed_at, next_retry_at, exhausted, content_hash,
                model, dimensions, request_dimensions, last_error, last_status, exhausted_reason,
                error_history, text_is_string,
                left(text, $2) AS text_head, length(text) AS text_chars,
                left(metadata, $2) AS metadata_head, length(metadata) AS metadata_chars,
                left(rest, $2) AS rest_head, length(rest) AS rest_chars
           FROM p"
    );
    // Only the excerpts are read back (no `p.*`): the full parts stay in the CTE.
    let row =
        sqlx::query(sqlx::AssertSqlSafe(sql)).bind(id).bind(DETAIL_TEXT_CHARS).fetch_optional(pool).await;
    let Some(r) = row? else { return Ok(None) };
    let excerpt = |part: &str, is_string: bool| -> Result<Option<Excerpt>, sqlx::Error> {
        let head: Option<String> = r.try_get(format!("{part}_head").as_str())?;
        let chars: Option<i32> = r.try_get(format!("{part}_chars").as_str())?;
        Ok(head.map(|head| Excerpt { head, chars: chars.unwrap_or(0).into(), is_string }))
    };
    let text_is_string: Option<bool> = r.try_get("text_is_string")?;
    Ok(Some(RowView {
        text: excerpt("text", text_is_string == Some(true))?,
        metadata: excerpt("metadata", false)?,
        rest: excerpt("rest", false)?,
        detail: super::dlq::Detail::read(&r, serde_json::Value::Null)?,
    }))
}

/// Characters of a row's text read per statement while it is downloaded (at most 1 MiB of
/// UTF-8): a download holds one such piece at a time, whatever the text's size.
pub const TEXT_PIECE_CHARS: i32 = 256 * 1024;

/// What a download of a row's text needs to start: the row's generation (each piece is
/// read only while it is unchanged) and the text's size in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TextSize {
    /// The row's generation when the download started.
    pub generation: i64,
    /// Bytes of the text (UTF-8).
    pub bytes: i64,
}

/// The size of a row's text, if the row exists and its payload's `text` is a string.
pub async fn text_size(pool: &PgPool, id: i64) -> Result<Option<TextSize>, StoreError> {
    let r = sqlx::query(
        "SELECT generation, octet_length(payload ->> 'text') AS bytes
           FROM embedding_dlq WHERE id = $1 AND jsonb_typeof(payload -> 'text') = 'string'",
    )
    .bind(id)
    .fetch_optional(pool)
    .await?;
    match r {
        Some(r) => Ok(Some(TextSize {
            generation: r.try_get("generation")?,
            bytes: r.try_get::<i32, _>("bytes")?.into(),
        })),
        None => Ok(None),
    }
}

/// Up to [`TEXT_PIECE_CHARS`] characters of a row's text from character `from` (0-based),
/// if the row still has the `generation` the download started with.
pub async fn text_piece(
    pool: &PgPool,
    id: i64,
    generation: i64,
    from: i64,
) -> Result<Option<String>, StoreError> {
    let piece = sqlx::query_scalar(
        "SELECT substr(payload ->> 'text', $3::int + 1, $4)
           FROM embedding_dlq WHERE id = $1 AND generation = $2",
    )
    .bind(id)
    .bind(generation)
    .bind(i32::try_from(from).unwrap_or(i32::MAX))
    .bind(TEXT_PIECE_CHARS)
    .fetch_optional(pool)
    .await?;
    Ok(piece)
}
