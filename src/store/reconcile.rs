//! Postgres side of the reconciler: the checks that compare the manifest, the target tables,
//! the DLQ and the outbox, their repairs, and the record of each run. The reconciler
//! (`crate::reconcile`) decides what to run and merges the results; the stream scans stay
//! with it, and meet Postgres here through a `WorkAudit`.
//!
//! The seed's two proofs live here once, as [`leaks`] and [`duplicates`]: the reconciler's
//! `leaks` and `duplicates` checks are built from the same predicates, and the tests and the
//! demo call the functions.
//!
//! Each check is a `SELECT` of example keys (counted with `count(*)` over it) and, for
//! repairable checks, one repair statement over the same predicate, run only when something
//! was found. Table names in these statements come from the catalog (`TargetTable`), never
//! from input, and the canonical name is compared as a quoted literal.

use std::collections::HashMap;
use std::time::Duration;

use sqlx::{AssertSqlSafe, PgPool, Postgres, Row, Transaction};

use super::{StoreError, TargetTable};

/// Most target tables one run (or one "every table" count) looks at: tables named by the
/// manifest or the DLQ.
pub(crate) const MAX_TABLES: usize = 1000;

/// The checks made per target table, each one set-based statement (plus its repair).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum TableCheck {
    /// Manifest rows with neither a vector nor a DLQ row, not yet marked for re-ingest.
    /// Repair marks them for re-ingest.
    Leaks,
    /// More than one vector for a (doc_id, chunk_index). Repair keeps the newest row.
    Duplicates,
    /// Manifest says stored, but the vector is missing or has another content hash. Repair
    /// marks the chunk for re-ingest.
    StoredDrift,
    /// A DLQ row for a chunk whose vector with the same content is stored. Repair deletes the
    /// row, marks the chunk stored and announces it `resolved` (`by: reconcile`).
    StaleDlq,
    /// Vectors of the wrong dimension, with NaN, or of zero norm. Repair deletes them and
    /// marks the chunks for re-ingest.
    BadVectors,
}

/// What one check found, and what its repair changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct CheckRun {
    pub found: u64,
    /// Up to the number asked for, as `doc_id#chunk_index`.
    pub examples: Vec<String>,
    /// Rows changed by the repair (0 without repair or without findings).
    pub repaired: u64,
}

/// `s` as an SQL string literal (standard_conforming_strings: only quotes need doubling).
fn sql_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// Manifest rows (`m`) of table `t` (canonical name, valid SQL as it is) with neither a
/// vector nor a DLQ row: the seed's reconciliation query. `unmarked_only` leaves out rows the
/// reconciler already marked for re-ingest (its repair), which are known and no longer a
/// finding.
fn leak_predicate(t: &str, unmarked_only: bool) -> String {
    let lit = sql_literal(t);
    let unmarked = if unmarked_only { " AND m.status <> 'reingest'" } else { "" };
    format!(
        "m.target_table = {lit}{unmarked}
         AND NOT EXISTS (SELECT 1 FROM {t} e WHERE e.doc_id = m.doc_id AND e.chunk_index = m.chunk_index)
         AND NOT EXISTS (SELECT 1 FROM embedding_dlq d
                          WHERE d.target_table = m.target_table AND d.doc_id = m.doc_id
                            AND d.chunk_index = m.chunk_index)"
    )
}

fn leaks_select(t: &str, unmarked_only: bool) -> String {
    format!(
        "SELECT m.doc_id || '#' || m.chunk_index FROM ingest_manifest m WHERE {}",
        leak_predicate(t, unmarked_only)
    )
}

/// The seed's duplicate query over table `t` (canonical name): keys with more than one vector.
fn duplicates_select(t: &str) -> String {
    format!("SELECT doc_id || '#' || chunk_index FROM {t} GROUP BY doc_id, chunk_index HAVING count(*) > 1")
}

/// The example query and the repair statement of `check` on `target`.
fn table_check_sql(target: &TargetTable, check: TableCheck) -> (String, String) {
    let t = target.sql_name();
    let lit = sql_literal(&target.name);
    match check {
        TableCheck::Leaks => (
            leaks_select(t, true),
            format!(
                "UPDATE ingest_manifest m SET status = 'reingest', updated_at = now() WHERE {}",
                leak_predicate(t, true)
            ),
        ),
        TableCheck::Duplicates => (
            duplicates_select(t),
            format!(
                "DELETE FROM {t} a USING {t} b
                  WHERE a.doc_id = b.doc_id AND a.chunk_index = b.chunk_index
                    AND (a.updated_at, a.ctid) < (b.updated_at, b.ctid)"
            ),
        ),
        TableCheck::StoredDrift => {
            let drift_pred = format!(
                "m.target_table = {lit} AND m.status = 'stored' AND NOT EXISTS (
                     SELECT 1 FROM {t} e WHERE e.doc_id = m.doc_id AND e.chunk_index = m.chunk_index
                                           AND e.content_hash = m.content_hash)"
            );
            (
                format!("SELECT m.doc_id || '#' || m.chunk_index FROM ingest_manifest m WHERE {drift_pred}"),
                format!(
                    "UPDATE ingest_manifest m SET status = 'reingest', updated_at = now() WHERE {drift_pred}"
                ),
            )
        }
        TableCheck::StaleDlq => {
            let stale_pred = format!(
                "d.target_table = {lit}
                 AND EXISTS (SELECT 1 FROM {t} e WHERE e.doc_id = d.doc_id AND e.chunk_index = d.chunk_index
                                                   AND e.content_hash = d.content_hash)"
            );
            (
                format!("SELECT d.doc_id || '#' || d.chunk_index FROM embedding_dlq d WHERE {stale_pred}"),
                format!(
                    "WITH gone AS (
                         DELETE FROM embedding_dlq d WHERE {stale_pred}
                         RETURNING d.id, d.target_table, d.doc_id, d.chunk_index, d.content_hash,
                                   d.generation, d.error_class, d.attempts
                     ), manifest AS (
                         UPDATE ingest_manifest m SET status = 'stored', updated_at = now()
                           FROM gone g
                          WHERE m.target_table = g.target_table AND m.doc_id = g.doc_id
                            AND m.chunk_index = g.chunk_index
                            AND m.content_hash = g.content_hash AND m.status <> 'stored'
                         RETURNING 1
                     ), events AS (
                         INSERT INTO dlq_outbox (event, dlq_id, target_table, doc_id, chunk_index, body)
                         SELECT 'resolved', id, target_table, doc_id, chunk_index,
                                embed_dlq_event('resolved', id, target_table, doc_id, chunk_index, generation,
                                                jsonb_build_object('error_class', error_class,
                                                                   'attempts', attempts, 'by', 'reconcile',
                                                                   'at', now()))
                           FROM gone
                         RETURNING 1
                     )
                     SELECT count(*) FROM gone"
                ),
            )
        }
        TableCheck::BadVectors => {
            let dims = target.dimensions as i32;
            let bad_pred = format!(
                "(vector_dims(e.embedding) <> {dims} OR vector_norm(e.embedding) = 0
                  OR vector_norm(e.embedding) = 'NaN'::float8)"
            );
            (
                format!("SELECT e.doc_id || '#' || e.chunk_index FROM {t} e WHERE {bad_pred}"),
                format!(
                    "WITH gone AS (DELETE FROM {t} e WHERE {bad_pred} RETURNING e.doc_id, e.chunk_index),
                          manifest AS (
                              UPDATE ingest_manifest m SET status = 'reingest', updated_at = now()
                                FROM gone g
                               WHERE m.target_table = {lit} AND m.doc_id = g.doc_id
                                 AND m.chunk_index = g.chunk_index
                              RETURNING 1)
                     SELECT count(*) FROM gone"
                ),
            )
        }
    }
}

/// Runs `check` on `target`: counts, takes up to `examples` examples and, with `repair` and
/// a finding, runs the repair.
pub(crate) async fn table_check(
    pool: &PgPool,
    target: &TargetTable,
    check: TableCheck,
    examples: usize,
    repair: bool,
) -> Result<CheckRun, StoreError> {
    let (select, repair_sql) = table_check_sql(target, check);
    run_check(pool, &select, repair.then_some(repair_sql), examples).await
}

/// Transient rows due for replay for longer than `after`: the replayers are not draining.
/// Nothing to repair (a finding for a person).
pub(crate) async fn replay_stalled(
    pool: &PgPool,
    after: Duration,
    examples: usize,
) -> Result<CheckRun, StoreError> {
    let stall = after.as_secs_f64();
    let select = format!(
        "SELECT d.doc_id || '#' || d.chunk_index FROM embedding_dlq d
          WHERE d.error_class = 'transient' AND d.exhausted_at IS NULL
            AND d.next_retry_at < now() - make_interval(secs => {stall})"
    );
    run_check(pool, &select, None, examples).await
}

async fn count_rows(pool: &PgPool, select: &str) -> Result<i64, StoreError> {
    Ok(sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM ({select}) f")))
        .fetch_one(pool)
        .await?)
}

/// Runs a counting/example query and, when given and something was found, the repair
/// statement (a `WITH` statement returns its own count; otherwise rows affected count).
async fn run_check(
    pool: &PgPool,
    select: &str,
    repair: Option<String>,
    examples: usize,
) -> Result<CheckRun, StoreError> {
    let found = count_rows(pool, select).await?;
    let examples: Vec<String> = if found > 0 {
        sqlx::query_scalar(AssertSqlSafe(format!("{select} LIMIT {examples}"))).fetch_all(pool).await?
    } else {
        vec![]
    };
    let mut repaired = 0;
    if let Some(sql) = repair.filter(|_| found > 0) {
        repaired = if sql.trim_start().starts_with("WITH") {
            sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql)).fetch_one(pool).await? as u64
        } else {
            sqlx::query(AssertSqlSafe(sql)).execute(pool).await?.rows_affected()
        };
    }
    Ok(CheckRun { found: found as u64, examples, repaired })
}

/// The canonical names of the tables `table` names: that one (as a user writes it: `table`
/// or `schema.table`), or with `None` every table the manifest names. Only the name is looked
/// up: the seed's queries must run on a table that lost its unique key, which is exactly when
/// duplicates can appear (a bound [`TargetTable`] refuses such a table).
async fn canonical_names(pool: &PgPool, table: Option<&str>) -> Result<Vec<String>, StoreError> {
    let (names, canonical) = match table {
        Some(t) => (vec![t.to_string()], false),
        None => {
            let names: Vec<String> =
                sqlx::query_scalar("SELECT target_table FROM ingest_manifest GROUP BY 1 ORDER BY 1 LIMIT $1")
                    .bind(MAX_TABLES as i64)
                    .fetch_all(pool)
                    .await?;
            (names, true)
        }
    };
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        let err = |problem: String| StoreError::Target { table: name.clone(), problem };
        let lookup = if canonical { name.clone() } else { super::quote_table_name(&name).map_err(err)? };
        let found: Option<String> = sqlx::query_scalar("SELECT embed_dlq_table_name(to_regclass($1))")
            .bind(&lookup)
            .fetch_one(pool)
            .await?;
        out.push(found.ok_or_else(|| err("does not exist".into()))?);
    }
    Ok(out)
}

/// The seed's reconciliation query: manifest rows with neither a vector nor a DLQ row, in
/// `table` (`None`: summed over every table the manifest names). Zero after any run, crash or
/// fault is invariant 1; rows the reconciler marked for re-ingest still count until they are
/// re-ingested.
pub async fn leaks(pool: &PgPool, table: Option<&str>) -> Result<i64, StoreError> {
    let mut n = 0;
    for t in canonical_names(pool, table).await? {
        n += count_rows(pool, &leaks_select(&t, false)).await?;
    }
    Ok(n)
}

/// The seed's duplicate query: (doc_id, chunk_index) keys with more than one vector in `table`
/// (`None`: summed over every table the manifest names). Zero is invariant 2.
pub async fn duplicates(pool: &PgPool, table: Option<&str>) -> Result<i64, StoreError> {
    let mut n = 0;
    for t in canonical_names(pool, table).await? {
        n += count_rows(pool, &duplicates_select(&t)).await?;
    }
    Ok(n)
}

/// Records a finished run in `reconcile_runs` (what the "reconcile not run recently" alert
/// reads, whatever process ran it).
pub(crate) async fn record_run(
    pool: &PgPool,
    started_at: chrono::DateTime<chrono::Utc>,
    repaired: bool,
    findings: serde_json::Value,
) -> Result<(), StoreError> {
    sqlx::query("INSERT INTO reconcile_runs (started_at, repaired, findings) VALUES ($1, $2, $3)")
        .bind(started_at)
        .bind(repaired)
        .bind(findings)
        .execute(pool)
        .await?;
    Ok(())
}

/// When the last recorded run finished, as Unix seconds (`None`: never).
pub(crate) async fn last_run_finished(pool: &PgPool) -> Result<Option<f64>, StoreError> {
    Ok(sqlx::query_scalar("SELECT extract(epoch FROM max(finished_at))::float8 FROM reconcile_runs")
        .fetch_one(pool)
        .await?)
}

/// One audit of replay work against the DLQ, in one transaction (so `now()` is its start):
/// the outbox's unpublished work is snapshotted when it begins, the caller then records the
/// work items still outstanding on the stream page by page, and [`WorkAudit::lost_work`]
/// finds the leased rows that have neither. Memory is bounded by the page: the outstanding
/// items go into a temporary table, dropped at the end.
pub(crate) struct WorkAudit {
    tx: Transaction<'static, Postgres>,
}

impl WorkAudit {
    /// Begins the audit: snapshots the unpublished replay work of the outbox.
    pub(crate) async fn begin(pool: &PgPool) -> Result<WorkAudit, StoreError> {
        let mut tx = pool.begin().await?;
        sqlx::query(
            "CREATE TEMP TABLE reconcile_unpublished_work ON COMMIT DROP AS
             SELECT DISTINCT dlq_id FROM dlq_outbox
              WHERE stream = 'replay' AND published_at IS NULL AND dlq_id IS NOT NULL",
        )
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "CREATE TEMP TABLE reconcile_outstanding_work (dlq_id bigint, generation bigint) ON COMMIT DROP",
        )
        .execute(&mut *tx)
        .await?;
        Ok(WorkAudit { tx })
    }

    /// Records work items still outstanding on the stream (row id and generation, same order).
    pub(crate) async fn record_outstanding(
        &mut self,
        ids: &[i64],
        generations: &[i64],
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO reconcile_outstanding_work SELECT * FROM UNNEST($1::bigint[], $2::bigint[])",
        )
        .bind(ids)
        .bind(generations)
        .execute(&mut *self.tx)
        .await?;
        Ok(())
    }

    /// The current generation of each of `ids` that is still replay work (transient, not
    /// exhausted); other ids are absent.
    pub(crate) async fn live_generations(&mut self, ids: &[i64]) -> Result<HashMap<i64, i64>, StoreError> {
        let rows = sqlx::query(
            "SELECT id, generation FROM embedding_dlq
              WHERE id = ANY($1) AND exhausted_at IS NULL AND error_class = 'transient'",
        )
        .bind(ids)
        .fetch_all(&mut *self.tx)
        .await?;
        rows.iter()
            .map(|r| Ok((r.try_get("id")?, r.try_get("generation")?)))
            .collect::<Result<_, sqlx::Error>>()
            .map_err(StoreError::from)
    }

    /// Up to `limit` rows after `after_id` (by id) handed out as replay work more than `grace`
    /// before the audit began, with no outstanding work item (neither unpublished in the
    /// outbox nor recorded from the stream): `(id, "doc_id#chunk_index")`.
    pub(crate) async fn lost_work(
        &mut self,
        grace: Duration,
        after_id: i64,
        limit: usize,
    ) -> Result<Vec<(i64, String)>, StoreError> {
        let rows = sqlx::query(
            "SELECT d.id, d.doc_id || '#' || d.chunk_index AS key FROM embedding_dlq d
              WHERE d.error_class = 'transient' AND d.exhausted_at IS NULL
                AND d.enqueued_at IS NOT NULL AND d.enqueued_at > d.last_failed_at
                AND d.enqueued_at < now() - make_interval(secs => $1)
                AND d.next_retry_at > now()
                AND NOT EXISTS (SELECT 1 FROM reconcile_unpublished_work u WHERE u.dlq_id = d.id)
                AND NOT EXISTS (SELECT 1 FROM reconcile_outstanding_work o
                                 WHERE o.dlq_id = d.id AND o.generation = d.generation)
                AND d.id > $2
              ORDER BY d.id LIMIT $3",
        )
        .bind(grace.as_secs_f64())
        .bind(after_id)
        .bind(limit as i64)
        .fetch_all(&mut *self.tx)
        .await?;
        rows.iter()
            .map(|r| Ok((r.try_get("id")?, r.try_get("key")?)))
            .collect::<Result<_, sqlx::Error>>()
            .map_err(StoreError::from)
    }

    /// Refreshes the planner's statistics on the recorded items (after the last page, before
    /// [`WorkAudit::lost_work`]).
    pub(crate) async fn analyze(&mut self) -> Result<(), StoreError> {
        sqlx::query("ANALYZE reconcile_outstanding_work").execute(&mut *self.tx).await?;
        Ok(())
    }

    /// Ends the audit (the temporary tables go with it).
    pub async fn finish(self) -> Result<(), StoreError> {
        self.tx.commit().await?;
        Ok(())
    }
}
