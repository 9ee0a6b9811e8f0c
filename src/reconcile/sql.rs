//! Postgres side of the reconciler: the checks that compare the manifest, the target tables,
//! the DLQ and the outbox, their repairs, the run lock and the record of each run. The
//! reconciler (`crate::reconcile`) decides what to run and merges the results; the stream
//! scans stay with it, and meet Postgres here through a `WorkAudit`.
//!
//! The seed's two proofs live here once, as [`leaks`] and [`duplicates`]: the reconciler's
//! `leaks` and `duplicates` checks are built from the same predicates, and the tests and the
//! demo call the functions.
//!
//! Each table check is one counting statement over a `Scope` (every chunk, or the chunks
//! whose manifest row changed since a time) that also returns a few examples and the
//! earliest change among the rows found; a repairable check then repairs, only when
//! something was found. Leaks and stored drift share one anti-join (`gaps`); duplicates
//! are ruled out by the table's unique index when it has one. Repairs that touch a chunk's
//! DLQ row or vector lock its manifest row first, like every writer. Table names in these
//! statements come from the catalog (`TargetTable`), never from input, and the canonical
//! name is compared as a quoted literal.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{AssertSqlSafe, PgPool, Postgres, Row, Transaction};

use crate::store::dlq::{LOCK_MANIFEST_SQL, locked_manifest_tids};
use crate::store::{StoreError, TargetTable};

/// Most target tables one run (or one "every table" count) looks at: tables named by the
/// manifest or the DLQ.
pub(crate) const MAX_TABLES: usize = 1000;

/// Which chunks a table check looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scope {
    /// Every chunk of the table.
    All,
    /// The chunks whose manifest row changed (`updated_at`) at or after this instant: an
    /// index range scan (`ingest_manifest_updated_at_idx`), so the cost follows the changes.
    Since(DateTime<Utc>),
}

impl Scope {
    /// The bound of `$1` in every scoped statement (unused, and NULL, for [`Scope::All`]).
    fn since(self) -> Option<DateTime<Utc>> {
        match self {
            Scope::All => None,
            Scope::Since(t) => Some(t),
        }
    }

    /// "`subquery` (`SELECT 1 FROM ... WHERE ...`) finds no row", for this scope. Over the
    /// changed chunks, a scalar subquery a chunk (`(... LIMIT 1) IS NULL`): the one form the
    /// planner can only run as a probe per chunk. As `NOT EXISTS` it may become an anti-join
    /// or a hashed subplan, which reads all of a table the planner believes empty (rows
    /// deleted and analyzed before vacuum, then filled again): every incremental run read
    /// the whole vector table three times. Over every chunk, `NOT EXISTS`: a full sweep reads
    /// every row anyway, and an anti-join does it in one pass (run without nested loops:
    /// [`Scope::begin`]).
    fn absent(self, subquery: &str) -> String {
        match self {
            Scope::All => format!("NOT EXISTS ({subquery})"),
            Scope::Since(_) => format!("({subquery} LIMIT 1) IS NULL"),
        }
    }

    /// "`subquery` finds a row", in the forms of [`Scope::absent`].
    fn present(self, subquery: &str) -> String {
        match self {
            Scope::All => format!("EXISTS ({subquery})"),
            Scope::Since(_) => format!("({subquery} LIMIT 1) IS NOT NULL"),
        }
    }

    /// A transaction for the leak and drift check over this scope. Over every chunk, without
    /// nested loops: its anti-join of the manifest against the vectors, planned with the
    /// vector table believed empty (see [`Scope::absent`]), was a nested loop over that table
    /// kept in memory and read again for each manifest row (20,000 chunks: 200 million
    /// comparisons, 14 s; a million would not end); a hash or merge join reads each table once
    /// whatever the statistics say. Over the changed chunks, as it comes: those statements
    /// probe by key. (The other checks over every chunk start from the DLQ or from the bad
    /// vectors and look each row's partners up by key: see [`manifest_row_of`].)
    async fn begin(self, pool: &PgPool) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, StoreError> {
        let mut tx = pool.begin().await?;
        if self == Scope::All {
            sqlx::query("SET LOCAL enable_nestloop = off").execute(&mut *tx).await?;
        }
        Ok(tx)
    }

    /// The condition on the manifest row `m` (empty for [`Scope::All`]).
    fn clause(self) -> &'static str {
        match self {
            Scope::All => "",
            Scope::Since(_) => " AND m.updated_at >= $1",
        }
    }
}

/// What one check found, and what its repair changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct CheckRun {
    pub found: u64,
    /// Up to the number asked for, as `doc_id#chunk_index`.
    pub examples: Vec<String>,
    /// Rows changed by the repair (0 without repair or without findings).
    pub repaired: u64,
    /// The earliest manifest `updated_at` among the rows found (`None`: nothing found, or no
    /// manifest row). An unrepaired finding keeps the next incremental run's window open back
    /// to it, so it is reported again until it is repaired.
    pub oldest_change: Option<DateTime<Utc>>,
}

/// `s` as an SQL string literal (standard_conforming_strings: only quotes need doubling).
fn sql_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// The vector of manifest row `m` in table `t` as `e`, for a `FROM` clause after the manifest,
/// looked up chunk by chunk (a `LATERAL` subquery kept apart by `OFFSET 0`: never a join the
/// planner could run as a walk of the vector table; see [`Scope::absent`]).
fn vector_of_manifest_row(t: &str) -> String {
    format!(
        "CROSS JOIN LATERAL (SELECT e.* FROM {t} e
                              WHERE e.doc_id = m.doc_id AND e.chunk_index = m.chunk_index OFFSET 0) e"
    )
}

/// The manifest row of the chunk of row `of` (a DLQ row `d` or a vector `e` of the table whose
/// canonical name is the SQL literal `lit`) as `m`, for a `FROM` clause after it, looked up by
/// its key (`LEFT JOIN LATERAL ... OFFSET 0`, a probe a row, never a join the planner could
/// run as a walk of a manifest it believes empty, once a row: see [`Scope::absent`]); `m` is
/// all NULL where the chunk has none.
fn manifest_row_of(of: &str, lit: &str) -> String {
    format!(
        "LEFT JOIN LATERAL (SELECT m.* FROM ingest_manifest m
                             WHERE m.target_table = {lit} AND m.doc_id = {of}.doc_id
                               AND m.chunk_index = {of}.chunk_index OFFSET 0) m ON true"
    )
}

/// Manifest rows (`m`) of table `t` (canonical name, valid SQL as it is) with neither a
/// vector nor a DLQ row: the seed's reconciliation query. `unmarked_only` leaves out rows the
/// reconciler already marked for re-ingest (its repair), which are known and no longer a
/// finding.
/// `scope` says how the two absences are tested ([`Scope::absent`]).
fn leak_predicate(identity: &str, t: &str, unmarked_only: bool, scope: Scope) -> String {
    let lit = sql_literal(identity);
    let unmarked = if unmarked_only { " AND m.status <> 'reingest'" } else { "" };
    let no_vector = scope
        .absent(&format!("SELECT 1 FROM {t} e WHERE e.doc_id = m.doc_id AND e.chunk_index = m.chunk_index"));
    let no_dlq = scope.absent(
        "SELECT 1 FROM embedding_dlq d
          WHERE d.target_table = m.target_table AND d.doc_id = m.doc_id AND d.chunk_index = m.chunk_index",
    );
    format!("m.target_table = {lit}{unmarked} AND {no_vector} AND {no_dlq}")
}

fn leaks_select(identity: &str, t: &str, unmarked_only: bool) -> String {
    format!(
        "SELECT m.doc_id || '#' || m.chunk_index FROM ingest_manifest m WHERE {}",
        leak_predicate(identity, t, unmarked_only, Scope::All)
    )
}

/// The seed's duplicate query over table `t` (canonical name): keys with more than one vector.
fn duplicates_select(t: &str) -> String {
    format!("SELECT doc_id || '#' || chunk_index FROM {t} GROUP BY doc_id, chunk_index HAVING count(*) > 1")
}

/// Reads the counting statements' common columns: `found`, `oldest`, `examples`.
fn check_run(row: &sqlx::postgres::PgRow, prefix: &str) -> Result<CheckRun, sqlx::Error> {
    Ok(CheckRun {
        found: row.try_get::<i64, _>(format!("{prefix}found").as_str())? as u64,
        examples: row.try_get(format!("{prefix}examples").as_str())?,
        repaired: 0,
        oldest_change: row.try_get(format!("{prefix}oldest").as_str())?,
    })
}

/// Counts the rows `rows` (a `FROM` clause binding `$1` to the scope's horizon) selects, with
/// the oldest manifest change among them and up to `examples` of their keys, read from the
/// table aliased `alias` (`d` for DLQ rows, `e` for vectors).
async fn findings(
    pool: &PgPool,
    alias: &str,
    rows: &str,
    scope: Scope,
    examples: usize,
) -> Result<CheckRun, StoreError> {
    let sql = format!(
        "WITH f AS MATERIALIZED (SELECT {alias}.doc_id || '#' || {alias}.chunk_index AS key, m.updated_at FROM {rows})
         SELECT count(*) AS found, min(updated_at) AS oldest, ARRAY(SELECT key FROM f LIMIT $2) AS examples
           FROM f"
    );
    Ok(check_run(&findings_row(pool, sql, scope, examples).await?, "")?)
}

/// Runs a findings statement: `$1` the scope's horizon, `$2` how many example keys to return.
async fn findings_row<'c, E>(
    executor: E,
    sql: String,
    scope: Scope,
    examples: usize,
) -> Result<sqlx::postgres::PgRow, StoreError>
where
    E: sqlx::PgExecutor<'c>,
{
    Ok(sqlx::query(AssertSqlSafe(sql))
        .bind(scope.since())
        .bind(examples as i64)
        .persistent(false)
        .fetch_one(executor)
        .await?)
}

/// Runs a repair statement: a `WITH` statement returns its own count; otherwise rows affected
/// count.
async fn run_repair<'c, E>(executor: E, sql: String, scope: Scope) -> Result<u64, StoreError>
where
    E: sqlx::PgExecutor<'c>,
{
    Ok(if sql.trim_start().starts_with("WITH") {
        sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql))
            .bind(scope.since())
            .persistent(false)
            .fetch_one(executor)
            .await? as u64
    } else {
        sqlx::query(AssertSqlSafe(sql))
            .bind(scope.since())
            .persistent(false)
            .execute(executor)
            .await?
            .rows_affected()
    })
}

/// Leaks and stored drift of `target` in one scan: one anti-join of the manifest against
/// the vectors on (doc_id, chunk_index, content_hash) gives every chunk whose vector is
/// missing or holds other content (parked chunks included), and only those are then looked
/// up: their DLQ row (one hashed pass over the DLQ), and their vector by key only when they
/// have no DLQ row.
///
/// - leak: neither a vector nor a DLQ row (the seed's query), not yet marked for re-ingest;
/// - stored drift: the manifest says stored, and the vector is missing (with a DLQ row still
///   there) or holds other content. A chunk is reported by one of the two, never both.
///
/// Repair (each only when found) marks the chunks for re-ingest, leaks first; both touch the
/// manifest alone.
pub(crate) async fn gaps(
    pool: &PgPool,
    target: &TargetTable,
    scope: Scope,
    examples: usize,
    repair: bool,
) -> Result<(CheckRun, CheckRun), StoreError> {
    let t = target.sql_name();
    let lit = sql_literal(&target.name);
    let within = scope.clause();
    let no_vector_of_content = scope.absent(&format!(
        "SELECT 1 FROM {t} e
          WHERE e.doc_id = m.doc_id AND e.chunk_index = m.chunk_index AND e.content_hash = m.content_hash"
    ));
    let dlq_of_chunk = |m: &str| {
        format!(
            "SELECT 1 FROM embedding_dlq d
              WHERE d.target_table = {m}.target_table AND d.doc_id = {m}.doc_id AND d.chunk_index = {m}.chunk_index"
        )
    };
    let vector_of_chunk = |m: &str| {
        format!("SELECT 1 FROM {t} e WHERE e.doc_id = {m}.doc_id AND e.chunk_index = {m}.chunk_index")
    };
    let no_dlq = scope.absent(&dlq_of_chunk("m"));
    let no_vector = scope.absent(&vector_of_chunk("cand"));
    let sql = format!(
        "WITH cand AS MATERIALIZED (
             SELECT m.doc_id, m.chunk_index, m.status, m.updated_at,
                    {no_dlq} AS no_dlq
               FROM ingest_manifest m
              WHERE m.target_table = {lit} AND m.status <> 'reingest'{within}
                AND {no_vector_of_content}
         ), flagged AS MATERIALIZED (
             SELECT doc_id, chunk_index, status, updated_at,
                    CASE WHEN no_dlq THEN {no_vector} ELSE false END AS leak
               FROM cand
         ), f AS MATERIALIZED (
             SELECT doc_id || '#' || chunk_index AS key, updated_at, leak,
                    status = 'stored' AND NOT leak AS drift
               FROM flagged
         )
         SELECT count(*) FILTER (WHERE leak) AS leak_found,
                min(updated_at) FILTER (WHERE leak) AS leak_oldest,
                ARRAY(SELECT key FROM f WHERE leak LIMIT $2) AS leak_examples,
                count(*) FILTER (WHERE drift) AS drift_found,
                min(updated_at) FILTER (WHERE drift) AS drift_oldest,
                ARRAY(SELECT key FROM f WHERE drift LIMIT $2) AS drift_examples
           FROM f"
    );
    let mut tx = scope.begin(pool).await?;
    let row = findings_row(&mut *tx, sql, scope, examples).await?;
    tx.commit().await?;
    let mut leaks = check_run(&row, "leak_")?;
    let mut drift = check_run(&row, "drift_")?;
    if repair && leaks.found > 0 {
        let sql = format!(
            "UPDATE ingest_manifest m SET status = 'reingest', updated_at = now() WHERE {}{within}",
            leak_predicate(&target.name, t, true, scope)
        );
        let mut tx = scope.begin(pool).await?;
        leaks.repaired = run_repair(&mut *tx, sql, scope).await?;
        tx.commit().await?;
    }
    if repair && drift.found > 0 {
        let (has_vector, has_dlq) = (scope.present(&vector_of_chunk("m")), scope.present(&dlq_of_chunk("m")));
        let sql = format!(
            "UPDATE ingest_manifest m SET status = 'reingest', updated_at = now()
              WHERE m.target_table = {lit} AND m.status = 'stored'{within}
                AND {no_vector_of_content}
                AND ({has_vector} OR {has_dlq})"
        );
        let mut tx = scope.begin(pool).await?;
        drift.repaired = run_repair(&mut *tx, sql, scope).await?;
        tx.commit().await?;
    }
    Ok((leaks, drift))
}

/// Stale DLQ rows of `target`: a DLQ row for a chunk whose vector with the same content is
/// stored. Over every DLQ row of the table ([`Scope::All`], cost follows the DLQ), or over
/// the changed chunks. Repair deletes the rows, marks the chunks stored and announces each
/// `resolved` (`by: reconcile`), `page` rows a transaction, each locking the chunks'
/// manifest rows first (the lock order of every writer: manifest, then DLQ or vector).
pub(crate) async fn stale_dlq(
    pool: &PgPool,
    target: &TargetTable,
    scope: Scope,
    examples: usize,
    page: usize,
    repair: bool,
) -> Result<CheckRun, StoreError> {
    let t = target.sql_name();
    let lit = sql_literal(&target.name);
    // A scalar subquery keeps the test a probe of the vector table's unique index a row (cost
    // follows the DLQ): an `EXISTS` may be run as a semi-join or a hashed subplan, a scan of
    // the whole vector table (see `Scope::absent`).
    let stale = format!(
        "(SELECT 1 FROM {t} e WHERE e.doc_id = d.doc_id AND e.chunk_index = d.chunk_index
                                AND e.content_hash = d.content_hash LIMIT 1) IS NOT NULL"
    );
    let rows = match scope {
        Scope::All => format!(
            "embedding_dlq d {}
              WHERE d.target_table = {lit} AND {stale}",
            manifest_row_of("d", &lit)
        ),
        Scope::Since(_) => format!(
            "ingest_manifest m JOIN embedding_dlq d
                 ON d.target_table = m.target_table AND d.doc_id = m.doc_id AND d.chunk_index = m.chunk_index
              WHERE m.target_table = {lit}{} AND {stale}",
            scope.clause()
        ),
    };
    let mut run = findings(pool, "d", &rows, scope, examples).await?;
    if !(repair && run.found > 0) {
        return Ok(run);
    }
    let mut after = 0i64;
    loop {
        let mut tx = pool.begin().await?;
        let ids: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT d.id FROM {rows} AND d.id > $2 ORDER BY d.id LIMIT $3"
        )))
        .bind(scope.since())
        .bind(after)
        .bind(page as i64)
        .persistent(false)
        .fetch_all(&mut *tx)
        .await?;
        let Some(&last) = ids.last() else { break };
        sqlx::query(LOCK_MANIFEST_SQL).bind(&ids).execute(&mut *tx).await?;
        let tids = locked_manifest_tids("gone", "AND k.status <> 'stored'");
        let deleted: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "WITH gone AS (
                 DELETE FROM embedding_dlq d WHERE d.id = ANY($1) AND {stale}
                 RETURNING d.id, d.target_table, d.doc_id, d.chunk_index, d.content_hash,
                           d.generation, d.error_class, d.attempts
             ), manifest AS (
                 -- By tuple id, each found by its key: the rows are locked, and a join with
                 -- the batch walks a manifest believed empty (replay::sql's module doc).
                 UPDATE ingest_manifest m SET status = 'stored', updated_at = now()
                  WHERE m.ctid = ANY ({tids})
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
        )))
        .bind(&ids)
        .persistent(false)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        run.repaired += deleted as u64;
        after = last;
        if ids.len() < page {
            break;
        }
    }
    Ok(run)
}

/// Vectors of `target` of the wrong dimension, with NaN or of zero norm: every vector
/// ([`Scope::All`], a deep sweep: it reads every vector's contents), or those of the changed
/// chunks. (pgvector refuses a wrong dimension for a `vector(N)` column and NaN or infinite
/// values on every input path; zero norm is what a hand-made vector can still be.) Repair
/// deletes them and marks the chunks for re-ingest, `page` vectors a transaction, each
/// locking the chunks' manifest rows first.
pub(crate) async fn bad_vectors(
    pool: &PgPool,
    target: &TargetTable,
    scope: Scope,
    examples: usize,
    page: usize,
    repair: bool,
) -> Result<CheckRun, StoreError> {
    let t = target.sql_name();
    let lit = sql_literal(&target.name);
    let dims = target.dimensions.min(i32::MAX as usize) as i32;
    let bad = format!(
        "(vector_dims(e.embedding) <> {dims} OR vector_norm(e.embedding) = 0
          OR vector_norm(e.embedding) IN ('NaN'::float8, 'Infinity'::float8))"
    );
    let rows = match scope {
        Scope::All => format!("{t} e {} WHERE {bad}", manifest_row_of("e", &lit)),
        Scope::Since(_) => format!(
            "ingest_manifest m {}
              WHERE m.target_table = {lit}{} AND {bad}",
            vector_of_manifest_row(t),
            scope.clause()
        ),
    };
    let mut run = findings(pool, "e", &rows, scope, examples).await?;
    if !(repair && run.found > 0) {
        return Ok(run);
    }
    // Each vector and manifest row found by its key and changed by tuple id (a join with the
    // page walks a table the planner believes empty: `park::withdraw_sql`). `{bad}` is
    // checked again on the row the delete reads: a vector with no manifest row has no lock
    // protecting it, and Postgres re-checks ordinary conditions, not tuple ids, on a row
    // changed meanwhile. The manifest rows are locked (`lock_next_keys`).
    let repair_sql = format!(
        "WITH k AS (SELECT * FROM UNNEST($2::text[], $3::int[]) AS k(doc_id, chunk_index)
             ), gone AS (
                 DELETE FROM {t} e
                  WHERE e.ctid = ANY (ARRAY(
                            SELECT (SELECT e.ctid FROM {t} e
                                     WHERE e.doc_id = k.doc_id AND e.chunk_index = k.chunk_index AND {bad})
                              FROM k))
                    AND {bad}
                 RETURNING e.doc_id, e.chunk_index
             ), manifest AS (
                 UPDATE ingest_manifest m SET status = 'reingest', updated_at = now()
                  WHERE m.ctid = ANY (ARRAY(
                            SELECT (SELECT x.ctid FROM ingest_manifest x
                                     WHERE x.target_table = $1 AND x.doc_id = g.doc_id
                                       AND x.chunk_index = g.chunk_index)
                              FROM gone g))
                 RETURNING 1
             )
             SELECT count(*) FROM gone"
    );
    run.repaired += repair_in_locked_pages(pool, target, &rows, &scope, page, &repair_sql).await?;
    Ok(run)
}

/// Vectors of `target` superseded by parked content: the chunk's manifest row holds newer
/// content that is parked or exhausted (its DLQ row holds that content), while the vector is
/// of another content, its previous text. Under [`OnNewerParked::Withdraw`] a park deletes
/// that vector in its own transaction, so one left behind was made under `keep`, by an older
/// release or by hand; the caller decides what a finding means under `keep`.
///
/// Over every DLQ row of the table ([`Scope::All`]: cost follows the DLQ, like `stale_dlq`),
/// or over the changed chunks. Repair (`repair`) withdraws the vectors like a park does
/// (deleted, one `withdrawn` event each, `by: reconcile`), `page` vectors a transaction, each
/// locking the chunks' manifest rows first and checking the condition again under the lock.
///
/// [`OnNewerParked::Withdraw`]: crate::store::park::OnNewerParked::Withdraw
pub(crate) async fn superseded_vectors(
    pool: &PgPool,
    target: &TargetTable,
    scope: Scope,
    examples: usize,
    page: usize,
    repair: bool,
) -> Result<CheckRun, StoreError> {
    let t = target.sql_name();
    let lit = sql_literal(&target.name);
    let rows = match scope {
        // From the DLQ, each row's manifest row and vector looked up by key (see
        // `manifest_row_of`).
        Scope::All => format!(
            "embedding_dlq d {}
               CROSS JOIN LATERAL (SELECT e.doc_id, e.chunk_index, e.content_hash FROM {t} e
                                    WHERE e.doc_id = d.doc_id AND e.chunk_index = d.chunk_index OFFSET 0) e
              WHERE d.target_table = {lit} AND m.content_hash = d.content_hash
                AND m.status IN ('parked', 'exhausted') AND e.content_hash <> m.content_hash",
            manifest_row_of("d", &lit)
        ),
        Scope::Since(_) => format!(
            "ingest_manifest m
               JOIN embedding_dlq d
                 ON d.target_table = m.target_table AND d.doc_id = m.doc_id AND d.chunk_index = m.chunk_index
                AND d.content_hash = m.content_hash
               {}
              WHERE m.target_table = {lit}{} AND m.status IN ('parked', 'exhausted')
                AND e.content_hash <> m.content_hash",
            vector_of_manifest_row(t),
            scope.clause()
        ),
    };
    let mut run = findings(pool, "e", &rows, scope, examples).await?;
    if !(repair && run.found > 0) {
        return Ok(run);
    }
    // Under the manifest locks, the keys are taken again from what the manifest and the DLQ
    // hold now: a chunk stored or re-parked meanwhile is left alone.
    let withdraw = crate::store::park::withdraw_sql(
        t,
        // Key by key (a subquery kept apart by `OFFSET 0`, a scalar probe of the DLQ): the
        // manifest and the DLQ may be believed empty, and a join would walk them.
        "SELECT m.doc_id, m.chunk_index, m.content_hash
           FROM UNNEST($2::text[], $3::int[]) AS u(doc_id, chunk_index)
          CROSS JOIN LATERAL (SELECT m.* FROM ingest_manifest m
                               WHERE m.target_table = $1::text AND m.doc_id = u.doc_id
                                 AND m.chunk_index = u.chunk_index OFFSET 0) m
          WHERE m.status IN ('parked', 'exhausted')
            AND (SELECT true FROM embedding_dlq d
                  WHERE d.target_table = m.target_table AND d.doc_id = m.doc_id
                    AND d.chunk_index = m.chunk_index AND d.content_hash = m.content_hash)",
        "reconcile",
    );
    run.repaired += repair_in_locked_pages(pool, target, &rows, &scope, page, &withdraw).await?;
    Ok(run)
}

/// Locks the manifest rows of `table`'s chunks (`docs`, `idxs`) in key order: what every
/// writer of a chunk does first.
/// Runs `repair` (binding `$1` the table's name and `$2`, `$3` a page's doc ids and chunk
/// indexes; returning one count) over the keys of `rows`, `page` keys a transaction, each
/// page's manifest rows locked first ([`lock_next_keys`]). Returns the sum of the counts.
async fn repair_in_locked_pages(
    pool: &PgPool,
    target: &TargetTable,
    rows: &str,
    scope: &Scope,
    page: usize,
    repair: &str,
) -> Result<u64, StoreError> {
    let mut repaired = 0u64;
    let mut after: Option<(String, i32)> = None;
    loop {
        let mut tx = pool.begin().await?;
        let keys = lock_next_keys(&mut tx, rows, scope, after.as_ref(), page, &target.name).await?;
        let Some(last) = keys.last().cloned() else { break };
        let (docs, idxs): (Vec<&str>, Vec<i32>) = keys.iter().map(|(d, i)| (d.as_str(), *i)).unzip();
        let n: i64 = sqlx::query_scalar(AssertSqlSafe(repair))
            .bind(&target.name)
            .bind(&docs)
            .bind(&idxs)
            .persistent(false)
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        repaired += n as u64;
        if keys.len() < page {
            break;
        }
        after = Some(last);
    }
    Ok(repaired)
}

/// The next page of at most `page` keys of `rows` (a `FROM ... WHERE` over the vector table
/// `e`, binding `$1` to the scope's start) after `after`, in key order, with their manifest
/// rows locked in `tx` (as every writer locks them) before a repair touches them.
async fn lock_next_keys(
    tx: &mut sqlx::PgConnection,
    rows: &str,
    scope: &Scope,
    after: Option<&(String, i32)>,
    page: usize,
    table: &str,
) -> Result<Vec<(String, i32)>, StoreError> {
    let keys: Vec<(String, i32)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT e.doc_id, e.chunk_index FROM {rows}
            AND ($2::text IS NULL OR (e.doc_id, e.chunk_index) > ($2::text, $3::int))
          ORDER BY e.doc_id, e.chunk_index LIMIT $4"
    )))
    .bind(scope.since())
    .bind(after.map(|k| k.0.as_str()))
    .bind(after.map_or(0, |k| k.1))
    .bind(page as i64)
    .persistent(false)
    .fetch_all(&mut *tx)
    .await?;
    let (docs, idxs): (Vec<&str>, Vec<i32>) = keys.iter().map(|(d, i)| (d.as_str(), *i)).unzip();
    lock_manifest_keys(tx, table, &docs, &idxs).await?;
    Ok(keys)
}

async fn lock_manifest_keys(
    tx: &mut sqlx::PgConnection,
    table: &str,
    docs: &[&str],
    idxs: &[i32],
) -> Result<(), StoreError> {
    sqlx::query(
        "SELECT 1 FROM ingest_manifest m
          WHERE m.target_table = $1
            AND (m.doc_id, m.chunk_index) IN (SELECT * FROM UNNEST($2::text[], $3::int[]))
          ORDER BY m.doc_id, m.chunk_index
            FOR UPDATE",
    )
    .bind(table)
    .bind(docs)
    .bind(idxs)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Vectors of `target` with no manifest row at all: what a `dlq purge` of a chunk whose
/// previous text's vector was kept leaves behind, but also every vector written by another
/// writer than this tool (a table filled before it was adopted). The two cannot be told
/// apart, so this is counted for the report's note and never repaired. One anti-join of the
/// whole vector table against the manifest: run in full and deep sweeps only.
pub(crate) async fn vectors_without_manifest(
    pool: &PgPool,
    target: &TargetTable,
    examples: usize,
) -> Result<CheckRun, StoreError> {
    let t = target.sql_name();
    let lit = sql_literal(&target.name);
    let select = format!(
        "SELECT e.doc_id || '#' || e.chunk_index FROM {t} e
          WHERE NOT EXISTS (SELECT 1 FROM ingest_manifest m
                             WHERE m.target_table = {lit} AND m.doc_id = e.doc_id
                               AND m.chunk_index = e.chunk_index)"
    );
    run_check(pool, &select, None, examples).await
}

/// Whether `table` (canonical name) has a valid unique index on exactly (doc_id, chunk_index),
/// both `NOT NULL`: then no key can hold two vectors, and the duplicates check needs no scan.
async fn has_unique_key(pool: &PgPool, table: &str) -> Result<bool, StoreError> {
    Ok(sqlx::query_scalar(
        "SELECT EXISTS (
             SELECT 1 FROM pg_index i
              WHERE i.indrelid = to_regclass($1) AND i.indisunique AND i.indisvalid
                AND i.indpred IS NULL AND i.indexprs IS NULL AND i.indnkeyatts = 2
                AND (SELECT array_agg(a.attname::text ORDER BY a.attname) FROM pg_attribute a
                      WHERE a.attrelid = i.indrelid AND a.attnum IN (i.indkey[0], i.indkey[1])
                        AND a.attnotnull)
                    = ARRAY['chunk_index', 'doc_id'])",
    )
    .bind(table)
    .fetch_one(pool)
    .await?)
}

/// Keys of `target` with more than one vector: none by construction while a valid unique
/// index on (doc_id, chunk_index) exists (read from the catalog, no scan), unless `scan`
/// (a deep sweep) asks for the seed's `GROUP BY` anyway. Without such an index the table is
/// scanned and the note says why. Repair keeps the newest row of each key (vector rows only:
/// no other table is touched).
pub(crate) async fn duplicates_check(
    pool: &PgPool,
    target: &TargetTable,
    examples: usize,
    scan: bool,
    repair: bool,
) -> Result<(CheckRun, Option<String>), StoreError> {
    let keyed = has_unique_key(pool, target.sql_name()).await?;
    if keyed && !scan {
        return Ok((CheckRun::default(), None));
    }
    let t = target.sql_name();
    let repair_sql = format!(
        "DELETE FROM {t} a USING {t} b
          WHERE a.doc_id = b.doc_id AND a.chunk_index = b.chunk_index
            AND (a.updated_at, a.ctid) < (b.updated_at, b.ctid)"
    );
    let run = run_check(pool, &duplicates_select(t), repair.then_some(repair_sql), examples).await?;
    let note =
        (!keyed).then(|| "no valid unique index on (doc_id, chunk_index): checked by scanning".to_string());
    Ok((run, note))
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
            AND d.next_retry_at < now() - make_interval(secs => {stall})
            -- The row's own lease by its key (see the scheduler's statement: as a
            -- `NOT EXISTS` the planner may walk every live lease for every row).
            AND NOT COALESCE((SELECT l.generation = d.generation AND l.leased_until > now()
                                FROM replay_lease l WHERE l.dlq_id = d.id), false)"
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
    Ok(CheckRun { found: found as u64, examples, repaired, oldest_change: None })
}

/// The canonical (identity, relation) of the tables `table` names: that one (as a user writes
/// it: `table` or `schema.table`), or with `None` every table the manifest names. Only the name is looked
/// up: the seed's queries must run on a table that lost its unique key, which is exactly when
/// duplicates can appear (a bound [`TargetTable`] refuses such a table).
async fn canonical_names(pool: &PgPool, table: Option<&str>) -> Result<Vec<(String, String)>, StoreError> {
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
        let lookup = if canonical { name.clone() } else { crate::store::lookup_name(&name).map_err(err)? };
        // (identity, relation): a revision's query name or relation stands for its identity
        // and its relation (migration 0026), anything else for itself.
        let found: Option<(String, String)> = sqlx::query_as(
            "WITH n AS (SELECT embed_dlq_table_name(to_regclass($1)) AS name)
             SELECT COALESCE(r.identity, n.name), COALESCE(r.relation, n.name)
               FROM n LEFT JOIN LATERAL (
                    SELECT identity, relation FROM embed_dlq_revision
                     WHERE state <> 'retired' AND (identity = n.name OR relation = n.name)
                     ORDER BY identity = n.name DESC LIMIT 1) r ON true
              WHERE n.name IS NOT NULL",
        )
        .bind(&lookup)
        .fetch_optional(pool)
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
    for (identity, t) in canonical_names(pool, table).await? {
        n += count_rows(pool, &leaks_select(&identity, &t, false)).await?;
    }
    Ok(n)
}

/// The seed's duplicate query: (doc_id, chunk_index) keys with more than one vector in `table`
/// (`None`: summed over every table the manifest names). Zero is invariant 2.
pub async fn duplicates(pool: &PgPool, table: Option<&str>) -> Result<i64, StoreError> {
    let mut n = 0;
    for (_, t) in canonical_names(pool, table).await? {
        n += count_rows(pool, &duplicates_select(&t)).await?;
    }
    Ok(n)
}

/// When the last recorded run finished, as Unix seconds (`None`: never).
pub(crate) async fn last_run_finished(pool: &PgPool) -> Result<Option<f64>, StoreError> {
    Ok(sqlx::query_scalar("SELECT extract(epoch FROM max(finished_at))::float8 FROM reconcile_runs")
        .fetch_one(pool)
        .await?)
}

/// Margin below the horizon: covers a transaction whose start is not yet shown in
/// `pg_stat_activity` when the horizon is read (microseconds), and small steps of the
/// server's clock. A run re-checks the changes of this long before its predecessor's horizon.
pub(crate) const HORIZON_MARGIN: Duration = Duration::from_secs(2);
/// Margin used instead when some transactions of this database cannot be seen (sessions of
/// other roles without `pg_read_all_stats`, prepared transactions): changes of a transaction
/// older than this that commits later are found by the next full sweep, not incrementally.
pub(crate) const UNSEEN_MARGIN: Duration = Duration::from_secs(3600);

/// What the runs before this one left: how long ago the last full (or deep) and deep sweeps
/// finished, and the latest run's resume points (check name → start of the next incremental
/// window; empty when the latest run recorded none).
#[derive(Debug, Clone, Default)]
pub(crate) struct Previous {
    pub secs_since_full: Option<f64>,
    pub secs_since_deep: Option<f64>,
    pub resume: HashMap<String, DateTime<Utc>>,
    /// Where the missing-events check resumes: the outbox rows of the transactions not
    /// visible in this snapshot (text form; `None`: every retained row).
    pub events_window: Option<String>,
}

/// One reconcile run's hold on the database: a transaction holding the reconcile advisory
/// lock (`embed_dlq_reconcile_lock_key()`), so runs of one database (from any process) go
/// one after another, and the record of the run written in it. Dropped without
/// [`RunLock::finish`] (an error, a cancelled run), the transaction rolls back: the lock is
/// released and nothing is recorded, so the next run starts from the same resume points.
pub(crate) struct RunLock {
    tx: Transaction<'static, Postgres>,
    /// Every change committed after this run's statements took their snapshots carries an
    /// `updated_at` at or after this instant.
    pub horizon: DateTime<Utc>,
    /// Why the horizon fell back to [`UNSEEN_MARGIN`], if it did.
    pub horizon_note: Option<String>,
    pub previous: Previous,
}

impl RunLock {
    /// Waits for the lock, then reads the horizon and what the previous runs left.
    ///
    /// The horizon: a writer stamps `updated_at = now()`, its transaction's start, and may
    /// commit much later. Read before any check takes a snapshot, the oldest transaction
    /// start among this database's other client sessions (server processes such as
    /// autovacuum write no rows of ours) bounds every change this run cannot see:
    /// such a change belongs to a transaction running now (started no earlier than that) or
    /// to one starting later (no earlier than the clock now).
    pub(crate) async fn begin(pool: &PgPool) -> Result<RunLock, StoreError> {
        let mut tx = pool.begin().await?;
        // The lock is held by an open transaction for the whole run: a server-side idle limit
        // must not end it.
        sqlx::query(
            "SELECT set_config('idle_in_transaction_session_timeout', '0', true),
                    pg_advisory_xact_lock(embed_dlq_reconcile_lock_key())",
        )
        .execute(&mut *tx)
        .await?;
        // Only once the lock is held: the horizon, then what the previous runs left.
        let row = sqlx::query(
            "SELECT clock_timestamp() AS now,
                    min(a.xact_start) AS oldest,
                    count(*) FILTER (WHERE a.query = '<insufficient privilege>') AS hidden,
                    (SELECT min(p.prepared) FROM pg_prepared_xacts p
                      WHERE p.database = current_database()) AS prepared,
                    extract(epoch FROM clock_timestamp() - (SELECT max(finished_at) FROM reconcile_runs
                                                            WHERE sweep IN ('full', 'deep')))::float8 AS full,
                    extract(epoch FROM clock_timestamp() - (SELECT max(finished_at) FROM reconcile_runs
                                                            WHERE sweep = 'deep'))::float8 AS deep,
                    (SELECT resume FROM reconcile_runs ORDER BY id DESC LIMIT 1) AS resume,
                    (SELECT events_window::text FROM reconcile_runs ORDER BY id DESC LIMIT 1) AS events_window
               FROM pg_stat_activity a
              WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
                -- Only sessions can stamp `updated_at`: an autovacuum of a big table runs
                -- in one transaction for minutes and would hold every window open to it.
                AND a.backend_type = 'client backend'",
        )
        .fetch_one(&mut *tx)
        .await?;
        let now: DateTime<Utc> = row.try_get("now")?;
        let oldest: Option<DateTime<Utc>> = row.try_get("oldest")?;
        let hidden: i64 = row.try_get("hidden")?;
        let prepared: Option<DateTime<Utc>> = row.try_get("prepared")?;
        let margin = chrono::Duration::from_std(HORIZON_MARGIN).expect("small");
        let unseen = chrono::Duration::from_std(UNSEEN_MARGIN).expect("small");
        let mut horizon = oldest.map_or(now, |o| o.min(now)) - margin;
        let mut notes = Vec::new();
        if hidden > 0 {
            horizon = horizon.min(now - unseen);
            notes.push(format!("{hidden} sessions of other roles are not visible (grant pg_read_all_stats)"));
        }
        if let Some(p) = prepared {
            horizon = horizon.min(p - unseen);
            notes.push("prepared transactions are open".to_string());
        }
        let horizon_note = (!notes.is_empty()).then(|| {
            format!(
                "{}: the incremental window keeps {} s of margin",
                notes.join("; "),
                UNSEEN_MARGIN.as_secs()
            )
        });
        let resume: Option<serde_json::Value> = row.try_get("resume")?;
        let previous = Previous {
            secs_since_full: row.try_get("full")?,
            secs_since_deep: row.try_get("deep")?,
            // Unreadable resume points only widen the next window (to everything).
            resume: resume.and_then(|v| serde_json::from_value(v).ok()).unwrap_or_default(),
            events_window: row.try_get("events_window")?,
        };
        Ok(RunLock { tx, horizon, horizon_note, previous })
    }

    /// Records the finished run in `reconcile_runs` (what the "reconcile not run recently"
    /// alert reads, whatever process ran it, and where the next run resumes) and releases
    /// the lock.
    pub(crate) async fn finish(mut self, run: RunRecord) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO reconcile_runs (started_at, finished_at, repaired, findings, sweep, scope_from, resume,
                                         events_window)
             VALUES ($1, clock_timestamp(), $2, $3, $4, $5, $6, $7::pg_snapshot)",
        )
        .bind(run.started_at)
        .bind(run.repaired)
        .bind(run.findings)
        .bind(run.sweep)
        .bind(run.scope_from)
        .bind(serde_json::to_value(&run.resume).expect("timestamps serialize"))
        .bind(run.events_window)
        .execute(&mut *self.tx)
        .await?;
        // The retention, a bounded page per run (a first run after an upgrade meets years of
        // runs; the next runs take the rest). The latest run of each sweep stays whatever
        // its age: the schedule and the next window read them.
        sqlx::query(
            "DELETE FROM reconcile_runs WHERE id IN (
                 SELECT id FROM reconcile_runs
                  WHERE finished_at < clock_timestamp() - make_interval(secs => $1)
                    -- One index probe per sweep (reconcile_runs_sweep_idx); a sweep
                    -- never run has none (a NULL would make NOT IN match nothing).
                    AND id NOT IN (SELECT latest FROM (
                                       SELECT (SELECT l.id FROM reconcile_runs l WHERE l.sweep = s
                                                ORDER BY l.finished_at DESC LIMIT 1) AS latest
                                         FROM unnest(ARRAY['incremental', 'full', 'deep']) s) k
                                    WHERE latest IS NOT NULL)
                  ORDER BY finished_at LIMIT $2)",
        )
        .bind(RUNS_RETENTION.as_secs_f64())
        .bind(RUNS_PRUNED_PER_RUN)
        .execute(&mut *self.tx)
        .await?;
        self.tx.commit().await?;
        Ok(())
    }
}

/// How long `reconcile_runs` keeps a run (the console's history, the findings of the past):
/// 90 days. The latest run of each sweep is kept whatever its age.
pub const RUNS_RETENTION: Duration = Duration::from_secs(90 * 86_400);
/// Runs past [`RUNS_RETENTION`] deleted per run, at most: a run's cost stays bounded after
/// an upgrade that meets years of runs.
const RUNS_PRUNED_PER_RUN: i64 = 1_000;

/// A finished run as `reconcile_runs` records it.
pub(crate) struct RunRecord {
    pub started_at: DateTime<Utc>,
    /// Whether the run repaired (mode repair).
    pub repaired: bool,
    pub findings: serde_json::Value,
    /// `incremental`, `full` or `deep`.
    pub sweep: &'static str,
    /// An incremental run's earliest change looked at.
    pub scope_from: Option<DateTime<Utc>>,
    /// Check name → start of the next incremental window.
    pub resume: HashMap<String, DateTime<Utc>>,
    /// Where the next run's missing-events check resumes ([`Previous::events_window`]).
    pub events_window: Option<String>,
}

/// The target tables of a run: every table the manifest or the DLQ names (`since`: `None`),
/// or those with manifest changes at or after `since`, at most `limit`. A loose index scan
/// over the tables' leading key columns (a few index probes per table), not a scan of the
/// manifest.
pub(crate) async fn tables_named(
    pool: &PgPool,
    since: Option<DateTime<Utc>>,
    limit: usize,
) -> Result<Vec<String>, StoreError> {
    if let Some(since) = since {
        return Ok(sqlx::query_scalar(
            "SELECT DISTINCT target_table FROM ingest_manifest WHERE updated_at >= $1 ORDER BY 1 LIMIT $2",
        )
        .bind(since)
        .bind(limit as i64)
        .persistent(false)
        .fetch_all(pool)
        .await?);
    }
    Ok(sqlx::query_scalar(
        "WITH RECURSIVE
           m(t, n) AS (
               (SELECT target_table, 1 FROM ingest_manifest ORDER BY target_table LIMIT 1)
               UNION ALL
               SELECT (SELECT target_table FROM ingest_manifest WHERE target_table > m.t
                        ORDER BY target_table LIMIT 1), n + 1
                 FROM m WHERE m.t IS NOT NULL AND n <= $1),
           d(t, n) AS (
               (SELECT target_table, 1 FROM embedding_dlq ORDER BY target_table LIMIT 1)
               UNION ALL
               SELECT (SELECT target_table FROM embedding_dlq WHERE target_table > d.t
                        ORDER BY target_table LIMIT 1), n + 1
                 FROM d WHERE d.t IS NOT NULL AND n <= $1)
         SELECT t FROM (SELECT t FROM m UNION SELECT t FROM d) u WHERE t IS NOT NULL ORDER BY t LIMIT $1",
    )
    .bind(limit as i64)
    .fetch_all(pool)
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
        // At the position read first: a row the relay publishes meanwhile still counts as
        // unpublished work, never the other way round.
        let at = crate::relay::sql::position(pool).await?;
        let mut tx = pool.begin().await?;
        sqlx::query("CREATE TEMP TABLE reconcile_unpublished_work (dlq_id bigint) ON COMMIT DROP")
            .execute(&mut *tx)
            .await?;
        at.bind_unpublished(sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO reconcile_unpublished_work
             SELECT DISTINCT o.dlq_id FROM dlq_outbox o
              WHERE o.stream = 'replay' AND o.dlq_id IS NOT NULL AND {}",
            crate::relay::sql::UNPUBLISHED
        ))))?
        .execute(&mut *tx)
        .await?;
        // Read by key, lease by lease, in `lost_work` (see there).
        sqlx::raw_sql(
            "CREATE INDEX ON reconcile_unpublished_work (dlq_id); ANALYZE reconcile_unpublished_work",
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

    /// Up to `limit` rows after `after_id` (by id) whose live replay lease was issued more
    /// than `grace` before the audit began, with no outstanding work item (neither
    /// unpublished in the outbox nor recorded from the stream): `(id, "doc_id#chunk_index")`.
    /// Read from the leases (at most the outstanding cap of them), not from the DLQ. Both lists
    /// are indexed by row id: the leases' statistics age into the past (see the scheduler's
    /// statement), and planned from them as one lease the lists were scanned once a lease,
    /// 20,000 x 20,000 rows for a backlog at that cap.
    pub(crate) async fn lost_work(
        &mut self,
        grace: Duration,
        after_id: i64,
        limit: usize,
    ) -> Result<Vec<(i64, String)>, StoreError> {
        let rows = sqlx::query(
            "SELECT d.id, d.doc_id || '#' || d.chunk_index AS key
               FROM replay_lease l
               -- By id, lease by lease (a join may hash the whole DLQ).
               CROSS JOIN LATERAL (SELECT d.* FROM embedding_dlq d
                                    WHERE d.id = l.dlq_id AND d.generation = l.generation OFFSET 0) d
              WHERE d.error_class = 'transient' AND d.exhausted_at IS NULL
                AND l.leased_until > now()
                AND l.leased_at < now() - make_interval(secs => $1)
                AND NOT EXISTS (SELECT 1 FROM reconcile_unpublished_work u WHERE u.dlq_id = d.id)
                AND NOT EXISTS (SELECT 1 FROM reconcile_outstanding_work o
                                 WHERE o.dlq_id = d.id AND o.generation = d.generation)
                AND l.dlq_id > $2
              ORDER BY l.dlq_id LIMIT $3",
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

    /// Indexes the recorded items and refreshes the planner's statistics on them (after the
    /// last page, before [`WorkAudit::lost_work`]).
    pub(crate) async fn analyze(&mut self) -> Result<(), StoreError> {
        sqlx::raw_sql(
            "CREATE INDEX ON reconcile_outstanding_work (dlq_id, generation); ANALYZE reconcile_outstanding_work",
        )
        .execute(&mut *self.tx)
        .await?;
        Ok(())
    }

    /// Ends the audit (the temporary tables go with it).
    pub async fn finish(self) -> Result<(), StoreError> {
        self.tx.commit().await?;
        Ok(())
    }
}
