//! Operator actions on the DLQ without writing SQL: stats, list, show, requeue, purge.
//! Every action that changes rows supports a dry run, selects rows with the same [`Filter`],
//! and writes its events to the outbox in the same statement as the change.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{Postgres, QueryBuilder, Row};

use crate::store::{Store, StoreError};

/// Which DLQ rows an action applies to. Empty filter = every row.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct Filter {
    /// Only this error class (transient, permanent_input, invalid_record, dimension_mismatch, invalid_vector).
    #[arg(long)]
    pub class: Option<String>,
    /// Only this document.
    #[arg(long)]
    pub doc: Option<String>,
    /// Only rows first parked at least this many seconds ago.
    #[arg(long)]
    pub older_than_secs: Option<u64>,
    /// Only rows with at least this many provider attempts.
    #[arg(long)]
    pub min_attempts: Option<i32>,
    /// Only rows that automatic replay gave up on.
    #[arg(long)]
    pub exhausted: bool,
}

impl Filter {
    /// Refuses an unknown error class (a typo would otherwise match nothing, silently).
    pub fn validate(&self) -> Result<(), String> {
        match &self.class {
            Some(c) if !crate::model::ErrorClass::ALL.iter().any(|k| k.as_str() == c) => Err(format!(
                "unknown error class {c:?}; one of: {}",
                crate::model::ErrorClass::ALL.map(|k| k.as_str()).join(", ")
            )),
            _ => Ok(()),
        }
    }

    fn push_where(&self, q: &mut QueryBuilder<Postgres>) {
        q.push(" WHERE true");
        if let Some(c) = &self.class {
            q.push(" AND error_class = ").push_bind(c.clone());
        }
        if let Some(d) = &self.doc {
            q.push(" AND doc_id = ").push_bind(d.clone());
        }
        if let Some(s) = self.older_than_secs {
            q.push(" AND first_failed_at <= now() - make_interval(secs => ").push_bind(s as f64).push(")");
        }
        if let Some(a) = self.min_attempts {
            q.push(" AND attempts >= ").push_bind(a);
        }
        if self.exhausted {
            q.push(" AND exhausted_at IS NOT NULL");
        }
    }
}

/// One error class in `dlq stats` (the seed's by-class view).
#[derive(Debug, Clone, Serialize)]
pub struct ClassStats {
    pub error_class: String,
    pub parked: i64,
    pub oldest: Option<DateTime<Utc>>,
    pub newest: Option<DateTime<Utc>>,
    pub avg_attempts: f64,
}

/// `dlq stats`.
#[derive(Debug, Clone, Serialize)]
pub struct Stats {
    pub by_class: Vec<ClassStats>,
    /// Transient rows due now (permanent rows are never "ready").
    pub ready_to_replay: i64,
    pub still_backing_off: i64,
    pub exhausted: i64,
    pub next_due: Option<DateTime<Utc>>,
}

/// One row in `dlq list`.
#[derive(Debug, Clone, Serialize)]
pub struct Listed {
    pub id: i64,
    /// Canonical name of the table the row is meant for.
    pub target_table: String,
    pub doc_id: String,
    pub chunk_index: i32,
    pub error_class: String,
    pub error_reason: String,
    pub attempts: i32,
    pub replays: i32,
    /// Changes whenever the row's content changes, on every re-park and on requeue.
    pub generation: i64,
    pub first_failed_at: DateTime<Utc>,
    pub last_failed_at: DateTime<Utc>,
    pub next_retry_at: Option<DateTime<Utc>>,
    pub exhausted: bool,
}

/// `dlq show`.
#[derive(Debug, Clone, Serialize)]
pub struct Detail {
    #[serde(flatten)]
    pub row: Listed,
    pub content_hash: String,
    /// The model the row was parked under (None: parked before models were recorded).
    pub model: Option<String>,
    /// The target column's dimension when the row was parked.
    pub dimensions: Option<i32>,
    /// The `dimensions` request parameter, if any.
    pub request_dimensions: Option<i32>,
    pub last_error: Option<String>,
    pub last_status: Option<i32>,
    pub exhausted_reason: Option<String>,
    pub payload: serde_json::Value,
    pub error_history: serde_json::Value,
}

const LISTED_COLUMNS: &str = "id, target_table, doc_id, chunk_index, error_class, error_reason, attempts, replays, generation, \
     first_failed_at, last_failed_at, next_retry_at, exhausted_at IS NOT NULL AS exhausted";

fn listed(r: &sqlx::postgres::PgRow) -> Result<Listed, sqlx::Error> {
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

/// The seed's two diagnostic queries in one report.
pub async fn stats(store: &Store) -> Result<Stats, StoreError> {
    let pool = store.pool();
    let by_class = sqlx::query(
        "SELECT error_class, count(*) AS parked, min(first_failed_at) AS oldest,
                max(last_failed_at) AS newest, round(avg(attempts), 1)::float8 AS avg_attempts
           FROM embedding_dlq GROUP BY error_class ORDER BY parked DESC",
    )
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
           FROM embedding_dlq",
    )
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
    store: &Store,
    filter: &Filter,
    limit: i64,
    after_id: i64,
) -> Result<Vec<Listed>, StoreError> {
    let mut q = QueryBuilder::new(format!("SELECT {LISTED_COLUMNS} FROM embedding_dlq"));
    filter.push_where(&mut q);
    q.push(" AND id > ").push_bind(after_id).push(" ORDER BY id LIMIT ").push_bind(limit);
    let rows = q.build().fetch_all(store.pool()).await?;
    Ok(rows.iter().map(listed).collect::<Result<_, _>>()?)
}

/// One row with its payload and error history.
pub async fn show(store: &Store, id: i64) -> Result<Option<Detail>, StoreError> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {LISTED_COLUMNS}, content_hash, model, dimensions, request_dimensions, last_error, last_status,
                exhausted_reason, payload, error_history
           FROM embedding_dlq WHERE id = $1"
    )))
    .bind(id)
    .fetch_optional(store.pool())
    .await?;
    let Some(r) = row else { return Ok(None) };
    Ok(Some(Detail {
        row: listed(&r)?,
        content_hash: r.try_get("content_hash")?,
        model: r.try_get("model")?,
        dimensions: r.try_get("dimensions")?,
        request_dimensions: r.try_get("request_dimensions")?,
        last_error: r.try_get("last_error")?,
        last_status: r.try_get("last_status")?,
        exhausted_reason: r.try_get("exhausted_reason")?,
        payload: r.try_get("payload")?,
        error_history: r.try_get("error_history")?,
    }))
}

/// Rows `requeue` must not send to the provider: a broken record (`invalid_record`) or a
/// payload without a non-empty `text` string. Replaying them cannot succeed (and an empty
/// string gets a real-looking vector from some providers); they need a corrected payload,
/// i.e. a re-ingest of the fixed source line.
const NEEDS_REINGEST: &str = "(error_class = 'invalid_record'
     OR jsonb_typeof(payload -> 'text') IS DISTINCT FROM 'string'
     OR payload ->> 'text' = '')";

/// Rows per `purge` transaction: bounds its locks, its WAL burst and its event batch.
pub const PURGE_BATCH: usize = 1000;

/// Largest batch `purge_in_batches` accepts; larger values are clamped.
pub const MAX_PURGE_BATCH: usize = 10_000;

/// What `requeue` did (or would do, in a dry run).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct RequeueOutcome {
    /// Rows made due and published as replay work.
    pub requeued: u64,
    /// Matching rows left alone because replay cannot fix them: `invalid_record` rows and
    /// rows whose payload has no text. Re-ingest their corrected source lines.
    pub needs_reingest: u64,
}

/// Makes matching rows due now and publishes them as replay work through the outbox, at most
/// `rate_per_sec` rows a second. Permanent classes are requeued too (after their cause was
/// fixed): they become `transient` with reason `requeued:<class>/<reason>`, and a new
/// generation, so outstanding work items for them are void. Rows that replay can never fix
/// (`invalid_record`, no payload text) are never sent to the provider: they are counted in
/// [`RequeueOutcome::needs_reingest`] and left as they are. Rows are read in pages (keyset by
/// id), so memory does not grow with the DLQ.
pub async fn requeue(
    store: &Store,
    filter: &Filter,
    dry_run: bool,
    rate_per_sec: u32,
) -> Result<RequeueOutcome, StoreError> {
    if dry_run {
        let mut q = QueryBuilder::new(format!(
            "SELECT count(*) FILTER (WHERE NOT {NEEDS_REINGEST}) AS requeue,
                    count(*) FILTER (WHERE {NEEDS_REINGEST}) AS reingest
               FROM embedding_dlq"
        ));
        filter.push_where(&mut q);
        let r = q.build().fetch_one(store.pool()).await?;
        return Ok(RequeueOutcome {
            requeued: r.try_get::<i64, _>("requeue")? as u64,
            needs_reingest: r.try_get::<i64, _>("reingest")? as u64,
        });
    }
    let batch = (rate_per_sec.max(1) as usize).min(1000);
    let mut outcome = RequeueOutcome::default();
    let mut after = 0i64;
    loop {
        let started = std::time::Instant::now();
        let mut q =
            QueryBuilder::new(format!("SELECT id, {NEEDS_REINGEST} AS needs_reingest FROM embedding_dlq"));
        filter.push_where(&mut q);
        q.push(" AND id > ").push_bind(after).push(" ORDER BY id LIMIT ").push_bind(batch as i64);
        let rows = q.build().fetch_all(store.pool()).await?;
        let Some(last) = rows.last() else { break };
        after = last.try_get("id")?;
        let mut chunk = Vec::with_capacity(rows.len());
        for r in &rows {
            if r.try_get::<bool, _>("needs_reingest")? {
                outcome.needs_reingest += 1;
            } else {
                chunk.push(r.try_get::<i64, _>("id")?);
            }
        }
        if !chunk.is_empty() {
            sqlx::query(sqlx::AssertSqlSafe(format!(
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
                     UPDATE ingest_manifest m SET status = 'parked', updated_at = now()
                       FROM upd u
                      WHERE m.target_table = u.target_table AND m.doc_id = u.doc_id
                        AND m.chunk_index = u.chunk_index
                        AND m.content_hash = u.content_hash AND m.status <> 'parked'
                     RETURNING 1
                 )
                 INSERT INTO dlq_outbox (event, dlq_id, target_table, doc_id, chunk_index, body)
                 SELECT 'requeued', id, target_table, doc_id, chunk_index,
                        jsonb_build_object('event', 'requeued', 'dlq_id', id, 'table', target_table,
                                           'doc_id', doc_id, 'chunk_index', chunk_index,
                                           'generation', generation, 'error_reason', error_reason,
                                           'attempts', attempts, 'at', now())
                   FROM upd"
            )))
            .bind(&chunk)
            .execute(store.pool())
            .await?;
            outcome.requeued += store.enqueue_ids(&chunk, Duration::from_secs(15 * 60)).await?;
        }
        if rows.len() < batch {
            break;
        }
        let pace = Duration::from_secs_f64(rows.len() as f64 / rate_per_sec.max(1) as f64);
        if let Some(rest) = pace.checked_sub(started.elapsed()) {
            tokio::time::sleep(rest).await;
        }
    }
    Ok(outcome)
}

/// Deletes matching rows for good (and their manifest rows, so a later ingest of the same
/// chunk starts fresh), announcing each as `purged`, in transactions of [`PURGE_BATCH`] rows.
/// Returns the rows purged (or that would be, with `dry_run`).
pub async fn purge(store: &Store, filter: &Filter, dry_run: bool) -> Result<u64, StoreError> {
    purge_in_batches(store, filter, dry_run, PURGE_BATCH).await
}

/// [`purge`] with a given batch size (clamped to `1..=`[`MAX_PURGE_BATCH`]): each batch is one
/// statement, so one transaction with its own `purged` events, and a large purge never holds
/// locks on the whole DLQ nor builds one huge transaction. Batches walk the ids upwards, so a
/// purge ends even while new rows keep matching.
pub async fn purge_in_batches(
    store: &Store,
    filter: &Filter,
    dry_run: bool,
    batch: usize,
) -> Result<u64, StoreError> {
    if dry_run {
        let mut q = QueryBuilder::new("SELECT count(*) FROM embedding_dlq");
        filter.push_where(&mut q);
        let n: i64 = q.build_query_scalar().fetch_one(store.pool()).await?;
        return Ok(n as u64);
    }
    let batch = batch.clamp(1, MAX_PURGE_BATCH);
    let mut total = 0u64;
    let mut after = 0i64;
    loop {
        let mut q = QueryBuilder::new(
            "WITH batch AS (
                 SELECT id FROM embedding_dlq",
        );
        filter.push_where(&mut q);
        q.push(" AND id > ").push_bind(after).push(" ORDER BY id LIMIT ").push_bind(batch as i64);
        q.push(
            " FOR UPDATE
             ), gone AS (
                 DELETE FROM embedding_dlq d USING batch b WHERE d.id = b.id
                 RETURNING d.id, d.target_table, d.doc_id, d.chunk_index, d.content_hash, d.generation,
                           d.error_class, d.error_reason, d.attempts
             ), manifest AS (
                 DELETE FROM ingest_manifest m USING gone g
                  WHERE m.target_table = g.target_table AND m.doc_id = g.doc_id
                    AND m.chunk_index = g.chunk_index AND m.content_hash = g.content_hash
                 RETURNING 1
             ), events AS (
                 INSERT INTO dlq_outbox (event, dlq_id, target_table, doc_id, chunk_index, body)
                 SELECT 'purged', id, target_table, doc_id, chunk_index,
                        jsonb_build_object('event', 'purged', 'dlq_id', id, 'table', target_table,
                                           'doc_id', doc_id, 'chunk_index', chunk_index,
                                           'generation', generation, 'error_class', error_class,
                                           'error_reason', error_reason, 'attempts', attempts, 'at', now())
                   FROM gone
                 RETURNING 1
             )
             SELECT (SELECT count(*) FROM batch) AS selected, (SELECT count(*) FROM gone) AS purged,
                    (SELECT max(id) FROM batch) AS last_id",
        );
        let r = q.build().fetch_one(store.pool()).await?;
        let selected: i64 = r.try_get("selected")?;
        total += r.try_get::<i64, _>("purged")? as u64;
        match r.try_get::<Option<i64>, _>("last_id")? {
            Some(last) if selected as usize >= batch => after = last,
            _ => return Ok(total),
        }
    }
}
