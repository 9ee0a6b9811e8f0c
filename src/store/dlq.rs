//! Postgres side of the operator actions on `embedding_dlq` (stats, list, show, requeue,
//! purge) and of the DLQ gauges: every statement, the row types they return, and the one
//! place an `error_class` column is decoded ([`ErrorClass`] as an `sqlx` type).
//!
//! Rows are selected with a [`RowFilter`], the same for every action. The paging, pacing and
//! dry-run decisions stay with the caller (`crate::dlq`); each function here is one statement
//! (and so one transaction), which writes its events to the outbox in that statement.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::postgres::{PgRow, PgTypeInfo, PgValueRef};
use sqlx::{PgConnection, PgPool, Postgres, QueryBuilder, Row};

use super::StoreError;
use crate::model::ErrorClass;

/// `error_class` columns decode straight into [`ErrorClass`]: a spelling the enum does not
/// know (a newer schema, a hand-written row) is a decode error for that query, never a panic
/// and never a string that silently matches nothing.
impl sqlx::Type<Postgres> for ErrorClass {
    fn type_info() -> PgTypeInfo {
        <str as sqlx::Type<Postgres>>::type_info()
    }

    fn compatible(ty: &PgTypeInfo) -> bool {
        <str as sqlx::Type<Postgres>>::compatible(ty)
    }
}

impl<'r> sqlx::Decode<'r, Postgres> for ErrorClass {
    fn decode(value: PgValueRef<'r>) -> Result<Self, sqlx::error::BoxDynError> {
        let s = <&str as sqlx::Decode<Postgres>>::decode(value)?;
        Ok(s.parse::<ErrorClass>()?)
    }
}

/// Which DLQ rows an action applies to. Empty filter = every row.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct RowFilter {
    pub class: Option<ErrorClass>,
    pub doc: Option<String>,
    /// Rows whose `doc_id` starts with this.
    pub doc_prefix: Option<String>,
    /// Rows first parked at least this many seconds ago.
    pub older_than_secs: Option<u64>,
    /// Rows with at least this many provider attempts.
    pub min_attempts: Option<i32>,
    /// Rows parked under this model.
    pub model: Option<String>,
    /// Only rows that automatic replay gave up on.
    pub exhausted: bool,
    /// Only this row (the console's single-row actions).
    pub id: Option<i64>,
    /// Only rows with this `error_reason` (e.g. `http_503`).
    pub reason: Option<String>,
    /// Only rows meant for this target table (its canonical name, `public.doc_embeddings`).
    pub table: Option<String>,
    /// Only rows with an id up to this: a confirmed console action applies to the rows its
    /// dry run saw, never to rows parked after it.
    pub max_id: Option<i64>,
}

impl RowFilter {
    pub(crate) fn push_where(&self, q: &mut QueryBuilder<Postgres>) {
        q.push(" WHERE true");
        if let Some(c) = self.class {
            q.push(" AND error_class = ").push_bind(c.as_str());
        }
        if let Some(d) = &self.doc {
            q.push(" AND doc_id = ").push_bind(d.clone());
        }
        if let Some(p) = &self.doc_prefix {
            q.push(" AND starts_with(doc_id, ").push_bind(p.clone()).push(")");
        }
        if let Some(s) = self.older_than_secs {
            q.push(" AND first_failed_at <= now() - make_interval(secs => ").push_bind(s as f64).push(")");
        }
        if let Some(a) = self.min_attempts {
            q.push(" AND attempts >= ").push_bind(a);
        }
        if let Some(m) = &self.model {
            q.push(" AND model = ").push_bind(m.clone());
        }
        if self.exhausted {
            q.push(" AND exhausted_at IS NOT NULL");
        }
        if let Some(id) = self.id {
            q.push(" AND id = ").push_bind(id);
        }
        if let Some(r) = &self.reason {
            q.push(" AND error_reason = ").push_bind(r.clone());
        }
        if let Some(t) = &self.table {
            q.push(" AND target_table = ").push_bind(t.clone());
        }
        if let Some(m) = self.max_id {
            q.push(" AND id <= ").push_bind(m);
        }
    }
}

/// One error class in `dlq stats` (the seed's by-class view).
#[derive(Debug, Clone, Serialize)]
pub struct ClassStats {
    /// The class these rows were parked under.
    pub error_class: ErrorClass,
    /// Rows of this class in the DLQ.
    pub parked: i64,
    /// Earliest first failure among them.
    pub oldest: Option<DateTime<Utc>>,
    /// Latest last failure among them.
    pub newest: Option<DateTime<Utc>>,
    /// Mean provider attempts per row, rounded to one decimal.
    pub avg_attempts: f64,
}

/// `dlq stats`.
#[derive(Debug, Clone, Serialize)]
pub struct Stats {
    /// Row counts by class, largest first.
    pub by_class: Vec<ClassStats>,
    /// Transient rows due now (permanent rows are never "ready").
    pub ready_to_replay: i64,
    /// Transient rows waiting for their `next_retry_at`.
    pub still_backing_off: i64,
    /// Rows replay has given up on: only an operator's requeue or purge moves them.
    pub exhausted: i64,
    /// The earliest `next_retry_at` of any row: when replay has work next.
    pub next_due: Option<DateTime<Utc>>,
}

/// One row in `dlq list`.
#[derive(Debug, Clone, Serialize)]
pub struct Listed {
    /// The row's id, what `dlq show`, `requeue` and `purge` take.
    pub id: i64,
    /// Canonical name of the table the row is meant for.
    pub target_table: String,
    /// Document of the parked chunk.
    pub doc_id: String,
    /// Position of the chunk within its document.
    pub chunk_index: i32,
    /// Decides whether replay retries the row.
    pub error_class: ErrorClass,
    /// Bounded reason code of the last failure (e.g. `http_503`).
    pub error_reason: String,
    /// Provider attempts spent on the row, over ingest and replays.
    pub attempts: i32,
    /// Replay passes made (a count; drives the DLQ schedule).
    pub replays: i32,
    /// Changes whenever the row's content changes, on every re-park and on requeue.
    pub generation: i64,
    /// When the chunk was first parked.
    pub first_failed_at: DateTime<Utc>,
    /// When it last failed (at ingest or replay).
    pub last_failed_at: DateTime<Utc>,
    /// When replay may take it next; `None` for rows replay never takes automatically.
    pub next_retry_at: Option<DateTime<Utc>>,
    /// Whether replay has given up on the row.
    pub exhausted: bool,
}

/// `dlq show`.
#[derive(Debug, Clone, Serialize)]
pub struct Detail {
    #[serde(flatten)]
    /// The columns `dlq list` shows (flattened in JSON).
    pub row: Listed,
    /// The content the row is for; replay writes a vector only while the manifest holds it.
    pub content_hash: String,
    /// The model the row was parked under (None: parked before models were recorded).
    pub model: Option<String>,
    /// The target column's dimension when the row was parked.
    pub dimensions: Option<i32>,
    /// The `dimensions` request parameter, if any.
    pub request_dimensions: Option<i32>,
    /// Sanitised detail of the last failure.
    pub last_error: Option<String>,
    /// The last HTTP status, when the failure came from a response.
    pub last_status: Option<i32>,
    /// Why replay gave up, when it did.
    pub exhausted_reason: Option<String>,
    /// The original record (text and metadata), replayed as is.
    pub payload: serde_json::Value,
    /// The row's last failures (at most 20), oldest first, as a JSON array.
    pub error_history: serde_json::Value,
}

pub(crate) const LISTED_COLUMNS: &str = "id, target_table, doc_id, chunk_index, error_class, error_reason, attempts, replays, generation, \
     first_failed_at, last_failed_at, next_retry_at, exhausted_at IS NOT NULL AS exhausted";

pub(crate) fn listed(r: &PgRow) -> Result<Listed, sqlx::Error> {
    Ok(Listed {
        id: r.try_get("id")?,
        target_table: r.try_get("target_table")?,
        doc_id: r.try_get("doc_id")?,
        chunk_index: r.try_get("chunk_index")?,
        error_class: r.try_get("error_class")?,
        error_reason: r.try_get("error_reason")?,
        attempts: r.try_get("attempts")?,
        replays: r.try_get("replays")?,
        generation: r.try_get("generation")?,
        first_failed_at: r.try_get("first_failed_at")?,
        last_failed_at: r.try_get("last_failed_at")?,
        next_retry_at: r.try_get("next_retry_at")?,
        exhausted: r.try_get("exhausted")?,
    })
}

/// The seed's two diagnostic queries in one report, over the rows of `table` (canonical
/// name) or of every table.
pub async fn stats(pool: &PgPool, table: Option<&str>) -> Result<Stats, StoreError> {
    let by_class = sqlx::query(
        "SELECT error_class, count(*) AS parked, min(first_failed_at) AS oldest,
                max(last_failed_at) AS newest, round(avg(attempts), 1)::float8 AS avg_attempts
           FROM embedding_dlq WHERE $1::text IS NULL OR target_table = $1
          GROUP BY error_class ORDER BY parked DESC",
    )
    .bind(table)
    .fetch_all(pool)
    .await?
    .iter()
    .map(|r| {
        Ok(ClassStats {
            error_class: r.try_get("error_class")?,
            parked: r.try_get("parked")?,
            oldest: r.try_get("oldest")?,
            newest: r.try_get("newest")?,
            avg_attempts: r.try_get("avg_attempts")?,
        })
    })
    .collect::<Result<Vec<_>, sqlx::Error>>()?;
    let r = sqlx::query(
        "SELECT count(*) FILTER (WHERE next_retry_at <= now() AND error_class = 'transient' AND exhausted_at IS NULL) AS ready,
                count(*) FILTER (WHERE next_retry_at > now() AND error_class = 'transient' AND exhausted_at IS NULL) AS backing_off,
                count(*) FILTER (WHERE exhausted_at IS NOT NULL) AS exhausted,
                min(next_retry_at) AS next_due
           FROM embedding_dlq WHERE $1::text IS NULL OR target_table = $1",
    )
    .bind(table)
    .fetch_one(pool)
    .await?;
    Ok(Stats {
        by_class,
        ready_to_replay: r.try_get("ready")?,
        still_backing_off: r.try_get("backing_off")?,
        exhausted: r.try_get("exhausted")?,
        next_due: r.try_get("next_due")?,
    })
}

/// Rows matching `filter`, oldest id first, `limit` at a time after `after_id` (paging).
pub async fn list(
    pool: &PgPool,
    filter: &RowFilter,
    limit: i64,
    after_id: i64,
) -> Result<Vec<Listed>, StoreError> {
    let mut q = QueryBuilder::new(format!("SELECT {LISTED_COLUMNS} FROM embedding_dlq"));
    filter.push_where(&mut q);
    q.push(" AND id > ").push_bind(after_id).push(" ORDER BY id LIMIT ").push_bind(limit);
    let rows = q.build().fetch_all(pool).await?;
    Ok(rows.iter().map(listed).collect::<Result<_, _>>()?)
}

/// One row with its payload and error history.
pub async fn show(pool: &PgPool, id: i64) -> Result<Option<Detail>, StoreError> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {LISTED_COLUMNS}, content_hash, model, dimensions, request_dimensions, last_error, last_status,
                exhausted_reason, payload, error_history
           FROM embedding_dlq WHERE id = $1"
    )))
    .bind(id)
    .fetch_optional(pool)
    .await?;
    let Some(r) = row else { return Ok(None) };
    Ok(Some(Detail::read(&r, r.try_get("payload")?)?))
}

impl Detail {
    /// The detail of the row `r` (the columns of [`listed`] and the detail's own) with
    /// `payload`: the whole payload, or nothing where the caller reads bounded excerpts.
    pub(crate) fn read(r: &sqlx::postgres::PgRow, payload: serde_json::Value) -> Result<Detail, sqlx::Error> {
        Ok(Detail {
            row: listed(r)?,
            content_hash: r.try_get("content_hash")?,
            model: r.try_get("model")?,
            dimensions: r.try_get("dimensions")?,
            request_dimensions: r.try_get("request_dimensions")?,
            last_error: r.try_get("last_error")?,
            last_status: r.try_get("last_status")?,
            exhausted_reason: r.try_get("exhausted_reason")?,
            payload,
            error_history: r.try_get("error_history")?,
        })
    }
}

/// Rows `requeue` must not send to the provider: a broken record (`invalid_record`) or a
/// payload without a non-empty `text` string. Replaying them cannot succeed (and an empty
/// string gets a real-looking vector from some providers); they need a corrected payload,
/// i.e. a re-ingest of the fixed source line.
const NEEDS_REINGEST: &str = "(error_class = 'invalid_record'
     OR jsonb_typeof(payload -> 'text') IS DISTINCT FROM 'string'
     OR payload ->> 'text' = '')";

/// Matching rows a requeue would make due, and matching rows it would leave for a re-ingest
/// (see [`requeue_candidates`]), counted without changing anything (the dry run).
pub(crate) async fn count_requeue(pool: &PgPool, filter: &RowFilter) -> Result<(u64, u64), StoreError> {
    let mut q = QueryBuilder::new(format!(
        "SELECT count(*) FILTER (WHERE NOT {NEEDS_REINGEST}) AS requeue,
                count(*) FILTER (WHERE {NEEDS_REINGEST}) AS reingest
           FROM embedding_dlq"
    ));
    filter.push_where(&mut q);
    let r = q.build().fetch_one(pool).await?;
    Ok((r.try_get::<i64, _>("requeue")? as u64, r.try_get::<i64, _>("reingest")? as u64))
}

/// A matching row as `requeue` pages through them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RequeueCandidate {
    pub id: i64,
    /// Replay cannot fix the row (`invalid_record`, or no payload text): leave it.
    pub needs_reingest: bool,
}

/// Up to `limit` matching rows after `after_id`, by id (keyset paging, so memory does not
/// grow with the DLQ).
pub(crate) async fn requeue_candidates(
    pool: &PgPool,
    filter: &RowFilter,
    after_id: i64,
    limit: usize,
) -> Result<Vec<RequeueCandidate>, StoreError> {
    let mut q =
        QueryBuilder::new(format!("SELECT id, {NEEDS_REINGEST} AS needs_reingest FROM embedding_dlq"));
    filter.push_where(&mut q);
    q.push(" AND id > ").push_bind(after_id).push(" ORDER BY id LIMIT ").push_bind(limit as i64);
    let rows = q.build().fetch_all(pool).await?;
    rows.iter()
        .map(|r| Ok(RequeueCandidate { id: r.try_get("id")?, needs_reingest: r.try_get("needs_reingest")? }))
        .collect::<Result<_, sqlx::Error>>()
        .map_err(StoreError::from)
}

/// Makes the rows `ids` due now under a new generation, as `transient` (a permanent class is
/// kept in the reason: `requeued:<class>/<reason>`), moves their manifest rows back to
/// `parked` and writes a `requeued` event per row, in one statement. Rows that need a
/// re-ingest are left alone even if listed. Their replay leases end (work issued for the old
/// generation is stale): the scheduler issues them at its next pass, within the outstanding
/// cap. Returns the rows requeued.
pub(crate) async fn mark_requeued(pool: &PgPool, ids: &[i64]) -> Result<u64, StoreError> {
    let mut tx = pool.begin().await?;
    sqlx::query(LOCK_MANIFEST_SQL).bind(ids).execute(&mut *tx).await?;
    let tids = locked_manifest_tids("upd", "AND k.status <> 'parked'");
    let requeued: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "WITH upd AS (
             UPDATE embedding_dlq d SET
                    error_reason = CASE WHEN d.error_class = 'transient' AND d.exhausted_at IS NULL
                                        THEN d.error_reason
                                        ELSE 'requeued:' || d.error_class || '/' || d.error_reason END,
                    error_class = 'transient',
                    exhausted_at = NULL, exhausted_reason = NULL,
                    generation = nextval('embed_dlq_generation_seq'), same_error_count = 0,
                    next_retry_at = now()
              WHERE d.id = ANY($1) AND NOT {NEEDS_REINGEST}
             RETURNING d.id, d.target_table, d.doc_id, d.chunk_index, d.content_hash, d.generation,
                       d.error_reason, d.attempts
         ), manifest AS (
             -- By tuple id, each found by its key: the rows are locked, and a join with the
             -- batch walks a manifest believed empty (replay::sql's module doc).
             UPDATE ingest_manifest m SET status = 'parked', updated_at = now()
              WHERE m.ctid = ANY ({tids})
             RETURNING 1
         ), released AS (
             DELETE FROM replay_lease l WHERE l.dlq_id = ANY (ARRAY(SELECT id FROM upd))
         ), events AS (
             INSERT INTO dlq_outbox (event, dlq_id, target_table, doc_id, chunk_index, body)
             SELECT 'requeued', id, target_table, doc_id, chunk_index,
                    embed_dlq_event('requeued', id, target_table, doc_id, chunk_index, generation,
                                    jsonb_build_object('error_reason', error_reason, 'attempts', attempts,
                                                       'at', now()))
               FROM upd
             RETURNING 1
         )
         SELECT count(*) FROM upd"
    )))
    .bind(ids)
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(requeued as u64)
}

/// Matching rows, counted (the dry run of a purge).
pub async fn count(pool: &PgPool, filter: &RowFilter) -> Result<u64, StoreError> {
    let mut q = QueryBuilder::new("SELECT count(*) FROM embedding_dlq");
    filter.push_where(&mut q);
    let n: i64 = q.build_query_scalar().fetch_one(pool).await?;
    Ok(n as u64)
}

/// What one [`purge_batch`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PurgedBatch {
    /// Rows the batch selected (fewer than asked: this was the last batch).
    pub selected: u64,
    /// Rows deleted (selected rows another transaction deleted first are not counted).
    pub purged: u64,
    /// Highest id selected: where the next batch starts.
    pub last_id: Option<i64>,
}

/// Deletes up to `batch` matching rows after `after_id` (by id), their manifest rows, and
/// announces each as `purged`, in one transaction: the batch's ids are read first, their
/// manifest rows locked (the lock order of every writer: manifest, then DLQ), then one
/// statement deletes the rows that still match.
pub(crate) async fn purge_batch(
    pool: &PgPool,
    filter: &RowFilter,
    after_id: i64,
    batch: usize,
) -> Result<PurgedBatch, StoreError> {
    let mut tx = pool.begin().await?;
    let mut q = QueryBuilder::new("SELECT id FROM embedding_dlq");
    filter.push_where(&mut q);
    q.push(" AND id > ").push_bind(after_id).push(" ORDER BY id LIMIT ").push_bind(batch as i64);
    let ids: Vec<i64> = q.build_query_scalar().fetch_all(&mut *tx).await?;
    if ids.is_empty() {
        return Ok(PurgedBatch { selected: 0, purged: 0, last_id: None });
    }
    sqlx::query(LOCK_MANIFEST_SQL).bind(&ids).execute(&mut *tx).await?;
    let mut q = QueryBuilder::new(
        "WITH batch AS (
             SELECT id FROM embedding_dlq",
    );
    filter.push_where(&mut q);
    q.push(" AND id = ANY(").push_bind(ids.clone()).push(")");
    q.push(format!(
        " FOR UPDATE
         ), gone AS (
             DELETE FROM embedding_dlq d WHERE d.id = ANY (ARRAY(SELECT id FROM batch))
             RETURNING d.id, d.target_table, d.doc_id, d.chunk_index, d.content_hash, d.generation,
                       d.error_class, d.error_reason, d.attempts
         ), manifest AS (
             -- By tuple id, each found by its key: the rows are locked, and a join with the
             -- batch walks a manifest believed empty (replay::sql's module doc).
             DELETE FROM ingest_manifest m WHERE m.ctid = ANY ({tids})
             RETURNING 1
         ), released AS (
             DELETE FROM replay_lease l WHERE l.dlq_id = ANY (ARRAY(SELECT id FROM gone))
         ), events AS (
             INSERT INTO dlq_outbox (event, dlq_id, target_table, doc_id, chunk_index, body)
             SELECT 'purged', id, target_table, doc_id, chunk_index,
                    embed_dlq_event('purged', id, target_table, doc_id, chunk_index, generation,
                                    jsonb_build_object('error_class', error_class,
                                                       'error_reason', error_reason, 'attempts', attempts,
                                                       'at', now()))
               FROM gone
             RETURNING 1
         )
         SELECT count(*) FROM gone",
        tids = locked_manifest_tids("gone", "")
    ));
    let purged: i64 = q.build_query_scalar().fetch_one(&mut *tx).await?;
    tx.commit().await?;
    Ok(PurgedBatch { selected: ids.len() as u64, purged: purged as u64, last_id: ids.last().copied() })
}

/// Most rows the ready and backing-off gauges count by index range scan in one sample. With
/// fewer than this many rows due, `ready` is counted and `backing_off` is the exact number of
/// scheduled rows minus it; otherwise `backing_off` is counted the same way and `ready`
/// derived; only when both reach the cap do both read the cap (a lower bound, and
/// [`Schedule::capped`] says so). What bounds a sample's cost, whatever the DLQ holds.
pub const SCHEDULE_COUNT_CAP: i64 = 10_000;

/// The DLQ gauges of one sample, read in one statement (one snapshot), with what it costs:
/// [`crate::gauges::dlq_gauges`].
#[derive(Debug, Clone, PartialEq)]
pub struct DlqGauges {
    /// Rows per class, every class listed (0 for a class with no row).
    pub depth: Vec<(ErrorClass, i64)>,
    /// The schedule gauges.
    pub schedule: Schedule,
}

/// The DLQ's schedule as the gauges show it, ages measured by the database's clock.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Schedule {
    /// Transient rows replay has not given up on that are due now.
    pub ready: i64,
    /// Transient rows replay has not given up on that wait for their next pass.
    pub backing_off: i64,
    /// Rows replay gave up on.
    pub exhausted: i64,
    /// Seconds since the oldest row first failed (0 with an empty DLQ).
    pub oldest_secs: f64,
    /// Seconds until the next row is due (0 if one is due already, or none is scheduled).
    pub next_due_secs: f64,
    /// Both `ready` and `backing_off` reached [`SCHEDULE_COUNT_CAP`]: each reads the cap.
    pub capped: bool,
}

/// Folds the count deltas the triggers of migration 0016 appended into the base counts, in
/// one statement. One folder at a time: the statement tries a transaction-level advisory lock
/// and folds nothing without it (the folder holding it takes those deltas). Keeps
/// `embedding_dlq_count_delta` at the deltas of the statements since the last fold.
pub(crate) async fn fold_counts(conn: &mut PgConnection) -> Result<u64, StoreError> {
    let folded = sqlx::query(
        "WITH lock AS MATERIALIZED (
             SELECT pg_try_advisory_xact_lock(embed_dlq_count_fold_lock_key()) AS held
         ), taken AS (
             DELETE FROM embedding_dlq_count_delta WHERE (SELECT held FROM lock)
             RETURNING error_class, exhausted, scheduled, n
         )
         INSERT INTO embedding_dlq_counts AS c (error_class, exhausted, scheduled, n)
         SELECT error_class, exhausted, scheduled, sum(n) FROM taken
          GROUP BY 1, 2, 3 HAVING sum(n) <> 0
         ON CONFLICT (error_class, exhausted, scheduled) DO UPDATE SET n = c.n + EXCLUDED.n",
    )
    .execute(&mut *conn)
    .await?;
    Ok(folded.rows_affected())
}

/// The gauges' statement. The counts are the base plus the deltas not yet folded; `ready`
/// (and, when it reaches the cap, `backing_off`) an index range scan of
/// `embedding_dlq_ready_idx` stopped at `$1` rows (`ORDER BY` its key, so the scan is an
/// ordered one that stops at the limit, never a bitmap that reads every match first); the
/// oldest row the first entry of `embedding_dlq_first_failed_idx`, the next due row the first
/// entry of `embedding_dlq_ready_idx`. That index holds exactly the rows the filters below
/// select (migration 0016), so they reject no entry.
const GAUGES_SQL: &str = "WITH c AS (
         SELECT error_class, exhausted, scheduled, sum(n)::bigint AS n
           FROM (SELECT error_class, exhausted, scheduled, n FROM embedding_dlq_counts
                 UNION ALL
                 SELECT error_class, exhausted, scheduled, n FROM embedding_dlq_count_delta) u
          GROUP BY 1, 2, 3
     ), ready AS MATERIALIZED (
         SELECT count(*) AS n FROM (
             SELECT 1 FROM embedding_dlq
              WHERE next_retry_at <= now() AND error_class = 'transient' AND exhausted_at IS NULL
              ORDER BY next_retry_at LIMIT $1) r
     )
     SELECT ARRAY(SELECT error_class FROM c GROUP BY 1 ORDER BY 1) AS classes,
            ARRAY(SELECT sum(n)::bigint FROM c GROUP BY error_class ORDER BY error_class) AS depths,
            COALESCE((SELECT sum(n) FROM c WHERE exhausted), 0)::bigint AS exhausted,
            COALESCE((SELECT sum(n) FROM c WHERE scheduled), 0)::bigint AS scheduled,
            (SELECT n FROM ready) AS ready,
            CASE WHEN (SELECT n FROM ready) < $1 THEN NULL ELSE (
                SELECT count(*) FROM (
                    SELECT 1 FROM embedding_dlq
                     WHERE next_retry_at > now() AND error_class = 'transient' AND exhausted_at IS NULL
                     ORDER BY next_retry_at LIMIT $1) b)
            END AS backing_off,
            COALESCE(extract(epoch FROM now() - (SELECT min(first_failed_at) FROM embedding_dlq)), 0)::float8
                AS oldest,
            COALESCE(greatest(extract(epoch FROM (
                SELECT min(next_retry_at) FROM embedding_dlq
                 WHERE error_class = 'transient' AND exhausted_at IS NULL) - now()), 0), 0)::float8
                AS next_due";

/// The DLQ gauges, at a cost that does not grow with the DLQ: exact counts by class and
/// exhausted from the counters the triggers of migration 0016 keep (deltas folded first, see
/// [`fold_counts`]), the schedule split by an index range scan of at most
/// [`SCHEDULE_COUNT_CAP`] rows, and two index first entries. Replaces two aggregates over
/// every row, which `serve` ran every 5 s.
pub async fn gauges(conn: &mut PgConnection) -> Result<DlqGauges, StoreError> {
    fold_counts(conn).await?;
    let r = sqlx::query(GAUGES_SQL).bind(SCHEDULE_COUNT_CAP).fetch_one(&mut *conn).await?;
    let classes: Vec<String> = r.try_get("classes")?;
    let depths: Vec<i64> = r.try_get("depths")?;
    let mut depth: Vec<(ErrorClass, i64)> = ErrorClass::ALL.iter().map(|c| (*c, 0)).collect();
    for (class, n) in classes.iter().zip(depths) {
        // A class this build does not know (a newer schema) has no gauge: skipped, as the
        // aggregate's decode would have refused it.
        if let Ok(class) = class.parse::<ErrorClass>()
            && let Some(slot) = depth.iter_mut().find(|(c, _)| *c == class)
        {
            slot.1 = n;
        }
    }
    let scheduled: i64 = r.try_get("scheduled")?;
    let ready: i64 = r.try_get("ready")?;
    let counted_backing_off: Option<i64> = r.try_get("backing_off")?;
    let (ready, backing_off, capped) = match counted_backing_off {
        None => (ready, (scheduled - ready).max(0), false),
        Some(b) if b < SCHEDULE_COUNT_CAP => ((scheduled - b).max(0), b, false),
        Some(_) => (SCHEDULE_COUNT_CAP, SCHEDULE_COUNT_CAP, true),
    };
    Ok(DlqGauges {
        depth,
        schedule: Schedule {
            ready,
            backing_off,
            exhausted: r.try_get("exhausted")?,
            oldest_secs: r.try_get("oldest")?,
            next_due_secs: r.try_get("next_due")?,
            capped,
        },
    })
}

/// The schedule gauges alone (the console's overview), as [`gauges`] reads them.
pub async fn schedule(pool: &PgPool) -> Result<Schedule, StoreError> {
    let mut conn = pool.acquire().await?;
    Ok(gauges(&mut conn).await?.schedule)
}

/// Locks the manifest rows of the given DLQ rows (`$1`: their ids), in key order: the first
/// statement of every transaction that changes DLQ rows of existing chunks (replay commits,
/// requeue, purge), so that every writer takes a chunk's manifest row before its DLQ row, as
/// ingest's store and park do, and none deadlocks against another.
///
/// Each manifest row is looked up by its key, one DLQ row after the other in key order (a
/// `LATERAL ... FOR UPDATE` is never flattened into a join, and the ordered subquery is
/// never pulled up): as a plain join the planner hashed the whole manifest for a batch of a
/// few hundred rows.
///
/// Returns each locked row's DLQ id and the manifest's content hash as locked: the latest
/// committed version, which nobody else can change before this transaction ends, so a
/// replay commit checks "the manifest still holds the replayed content" from it instead of
/// probing the manifest again.
pub(crate) const LOCK_MANIFEST_SQL: &str = "SELECT d.id, locked.content_hash
      FROM (SELECT id, target_table, doc_id, chunk_index FROM embedding_dlq WHERE id = ANY($1)
             ORDER BY target_table, doc_id, chunk_index) d
     CROSS JOIN LATERAL (SELECT m.content_hash FROM ingest_manifest m
                          WHERE m.target_table = d.target_table AND m.doc_id = d.doc_id
                            AND m.chunk_index = d.chunk_index
                            FOR UPDATE) locked";

/// SQL: the tuple ids of the manifest rows of `rows` (a CTE or subquery with the chunks'
/// `target_table`, `doc_id`, `chunk_index` and `content_hash`), each found by its key (one probe
/// of the primary key, a subquery of its own: no join the planner could turn into a walk of a
/// manifest it believes empty), as an array for `m.ctid = ANY (...)`; `condition` adds to
/// each probe (`AND k.status <> 'parked'`), a row failing it gives NULL, which matches nothing.
/// Only for rows this transaction has locked ([`LOCK_MANIFEST_SQL`]): Postgres does not check a
/// TID condition again when an update meets a row changed meanwhile.
pub(crate) fn locked_manifest_tids(rows: &str, condition: &str) -> String {
    format!(
        "ARRAY(SELECT (SELECT k.ctid FROM ingest_manifest k
                        WHERE k.target_table = r.target_table AND k.doc_id = r.doc_id
                          AND k.chunk_index = r.chunk_index AND k.content_hash = r.content_hash
                          {condition})
                 FROM {rows} r)"
    )
}

/// The id of the DLQ row of chunk `i` (`i.doc_id`, `i.chunk_index`) of table `$1`, if any,
/// looked up by its key: the DLQ rows a write batch resolves are found one key at a time and
/// then deleted by id, never by a join of the batch with the DLQ. The DLQ swings between empty
/// and a backlog, and after an `ANALYZE` that found its pages but no live row (autovacuum's,
/// after a drain) the planner believes it holds one row: a join then walked every DLQ row of
/// the table for each batch (`src/replay/sql.rs`,
/// docs/perf-notes/2026-12-04-tables-believed-empty.md).
pub(crate) const DLQ_ID_OF_CHUNK: &str = "(SELECT x.id FROM embedding_dlq x
          WHERE x.target_table = $1::text AND x.doc_id = i.doc_id AND x.chunk_index = i.chunk_index)";
