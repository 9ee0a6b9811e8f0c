//! Deletions (migration 0018): explicit deletes from the input (`{"op": "delete"}` records)
//! and the cleanup of a corpus run (`--cleanup incremental|full`).
//!
//! A deleted chunk loses its manifest row, its vector and any DLQ row (with its replay lease)
//! in one transaction, which writes one `deleted` event per chunk through the outbox and a
//! tombstone (`ingest_tombstone`). Deletions are fenced like writes:
//!
//! - a delete removes only manifest rows older than its own position ([`super::position`];
//!   a cleanup's position is its run's first one), so it never deletes what a newer record (a
//!   later line, a newer run) wrote;
//! - its tombstone makes the manifest claim of `ingest.rs` reject any outcome of an older
//!   record of the chunk or document, so a write or park still in flight in an older run
//!   never brings the chunk back. A replay in flight finds its DLQ row gone and is skipped.
//!
//! Every store and park takes the table's deletion lock shared before its claim
//! ([`WRITE_LOCK_SQL`]), every deletion takes it exclusive: the claim's snapshot then sees every
//! tombstone committed before it, and a deletion sees every write committed before it.
//! Within a deletion, the first statement locks and deletes the manifest rows (in key order,
//! like every writer), the second (a new snapshot: it sees a replay that committed while the
//! first one waited for its lock) deletes vectors and DLQ rows and writes the events.
//!
//! The cleanup's scope is what the run met: the keys of every record of the run, written to
//! `ingest_seen` one statement per intake window (memory stays flat however long the corpus).
//! The cleanup then walks documents in `doc_id` order, a page of [`CLEANUP_PAGE_DOCS`]
//! documents per transaction, so a document's deletions commit together and a run killed in
//! the middle leaves each document either as it was or cleaned; a rerun of the same corpus
//! finishes the rest.

use sqlx::{AssertSqlSafe, PgConnection, Row};

use super::{Store, StoreError};

/// Taken by every store and park transaction before its manifest claim: waits for a deletion
/// of the table in progress (`$1`: the table's canonical name).
pub(crate) const WRITE_LOCK_SQL: &str =
    "SELECT pg_advisory_xact_lock_shared(embed_dlq_delete_lock_space(), hashtext($1::text))";

/// Taken by every deletion transaction: no store or park of the table is between its claim
/// and its commit meanwhile.
const DELETE_LOCK_SQL: &str =
    "SELECT pg_advisory_xact_lock(embed_dlq_delete_lock_space(), hashtext($1::text))";

/// Documents a cleanup transaction covers (all of each document's deletions commit together).
pub(crate) const CLEANUP_PAGE_DOCS: i64 = 500;

/// One explicit delete from the input: a whole document (`chunk_index` `None`) or one chunk,
/// at its record's position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DeleteRequest {
    pub doc_id: String,
    pub chunk_index: Option<i32>,
    /// Position of the delete record ([`super::position`]).
    pub source_seq: i64,
}

/// What a cleanup deletes besides the keys its run met.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CleanupScope {
    /// Only chunks of documents the run met.
    Documents,
    /// Every chunk of the table.
    Table,
}

/// One chunk a deletion removed (or would remove).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DeletedChunk {
    pub doc_id: String,
    pub chunk_index: i32,
}

impl Store {
    /// Applies explicit deletes (keys unique in the batch), in one transaction; returns the
    /// chunks deleted. Tombstones are written whether or not there was anything to delete:
    /// an older record still in flight must not write the chunk afterwards.
    pub(crate) async fn delete_requested(
        &self,
        requests: &[DeleteRequest],
    ) -> Result<Vec<DeletedChunk>, StoreError> {
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        let docs: Vec<&str> = requests.iter().map(|r| r.doc_id.as_str()).collect();
        let idxs: Vec<i32> = requests.iter().map(|r| r.chunk_index.unwrap_or(-1)).collect();
        let seqs: Vec<i64> = requests.iter().map(|r| r.source_seq).collect();
        let mut tx = self.pool.begin().await?;
        sqlx::query(DELETE_LOCK_SQL).bind(&self.target.name).execute(&mut *tx).await?;
        let gone = sqlx::query(REQUESTED_SQL)
            .bind(&self.target.name)
            .bind(&docs)
            .bind(&idxs)
            .bind(&seqs)
            .fetch_all(&mut *tx)
            .await?;
        let deleted = self.delete_rows(&mut tx, &gone, "input").await?;
        tx.commit().await?;
        Ok(deleted)
    }

    /// The chunks an explicit delete would remove now (a dry run).
    pub(crate) async fn delete_requested_plan(
        &self,
        requests: &[DeleteRequest],
    ) -> Result<Vec<DeletedChunk>, StoreError> {
        let docs: Vec<&str> = requests.iter().map(|r| r.doc_id.as_str()).collect();
        let idxs: Vec<i32> = requests.iter().map(|r| r.chunk_index.unwrap_or(-1)).collect();
        let seqs: Vec<i64> = requests.iter().map(|r| r.source_seq).collect();
        let rows = sqlx::query(
            "SELECT DISTINCT m.doc_id, m.chunk_index
               FROM UNNEST($2::text[], $3::int[], $4::bigint[]) AS r(doc_id, chunk_index, source_seq)
               JOIN ingest_manifest m ON m.target_table = $1::text AND m.doc_id = r.doc_id
                                     AND (r.chunk_index = -1 OR m.chunk_index = r.chunk_index)
              WHERE m.source_seq < r.source_seq
              ORDER BY 1, 2",
        )
        .bind(&self.target.name)
        .bind(&docs)
        .bind(&idxs)
        .bind(&seqs)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(deleted_chunk).collect()
    }

    /// Records keys run `run_id` met (its cleanup keeps them); returns how many were new.
    pub(crate) async fn record_seen(&self, run_id: i64, keys: &[(&str, i32)]) -> Result<u64, StoreError> {
        if keys.is_empty() {
            return Ok(0);
        }
        let docs: Vec<&str> = keys.iter().map(|k| k.0).collect();
        let idxs: Vec<i32> = keys.iter().map(|k| k.1).collect();
        let n: i64 = sqlx::query_scalar(
            "WITH ins AS (
                 INSERT INTO ingest_seen (run_id, doc_id, chunk_index)
                 SELECT $1::bigint, doc_id, chunk_index FROM UNNEST($2::text[], $3::int[]) AS k(doc_id, chunk_index)
                 ON CONFLICT DO NOTHING RETURNING 1)
             SELECT count(*) FROM ins",
        )
        .bind(run_id)
        .bind(&docs)
        .bind(&idxs)
        .fetch_one(&self.pool)
        .await?;
        Ok(n as u64)
    }

    /// How many keys `ingest_seen` holds for run `run_id` (the run compares it with what it
    /// wrote: a Postgres crash empties the unlogged table).
    pub(crate) async fn seen_count(&self, run_id: i64) -> Result<u64, StoreError> {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM ingest_seen WHERE run_id = $1")
            .bind(run_id)
            .fetch_one(&self.pool)
            .await?;
        Ok(n as u64)
    }

    /// Drops run `run_id`'s keys once its cleanup is over.
    pub(crate) async fn forget_seen(&self, run_id: i64) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM ingest_seen WHERE run_id = $1").bind(run_id).execute(&self.pool).await?;
        Ok(())
    }

    /// Sweeps what deletions left behind that nothing needs any more: the seen keys and start
    /// positions of runs that are not alive (a run killed before its cleanup ended), and
    /// tombstones older than an hour that no run still alive could need (one whose recorded
    /// start, `ingest_run_start`, is older than the tombstone) and no stream of the table could
    /// still hand on something older than (its `ingest_stream_fed` floor: a dead consumer's
    /// pending entries belong to no live run). Called at every run start.
    pub(crate) async fn sweep_deletion_state(&self, run_id: i64) -> Result<(), StoreError> {
        sqlx::query(AssertSqlSafe(format!(
            "WITH {LIVE_RUNS}, seen AS (
                 DELETE FROM ingest_seen s
                  WHERE s.run_id <> $1 AND NOT EXISTS (SELECT 1 FROM live WHERE live.run_id = s.run_id)
             )
             DELETE FROM ingest_run_start r
              WHERE r.run_id <> $1 AND NOT EXISTS (SELECT 1 FROM live WHERE live.run_id = r.run_id)"
        )))
        .bind(run_id)
        .execute(&self.pool)
        .await?;
        sqlx::query(AssertSqlSafe(format!(
            "WITH {LIVE_RUNS}
             DELETE FROM ingest_tombstone t
              WHERE t.deleted_at < now() - interval '1 hour'
                AND NOT EXISTS (SELECT 1 FROM live JOIN ingest_run_start r USING (run_id)
                                 WHERE r.first_position < t.source_seq)
                AND NOT EXISTS (SELECT 1 FROM ingest_stream_fed f
                                 WHERE f.target_table = t.target_table AND f.floor_position < t.source_seq)"
        )))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Manifest rows of the table, and how many of them a cleanup of run `run_id` (first
    /// position `first_position`) would delete with `scope`.
    pub(crate) async fn cleanup_count(
        &self,
        run_id: i64,
        first_position: i64,
        scope: CleanupScope,
    ) -> Result<(u64, u64), StoreError> {
        let row = sqlx::query(AssertSqlSafe(format!(
            "SELECT (SELECT count(*) FROM ingest_manifest WHERE target_table = $1::text) AS total,
                    (SELECT count(*) FROM ingest_manifest m WHERE {DOOMED}) AS doomed"
        )))
        .bind(&self.target.name)
        .bind(first_position)
        .bind(run_id)
        .bind(scope == CleanupScope::Documents)
        .fetch_one(&self.pool)
        .await?;
        Ok((row.try_get::<i64, _>("total")? as u64, row.try_get::<i64, _>("doomed")? as u64))
    }

    /// The next page of documents a cleanup walks, after `after` in `doc_id` order: the
    /// documents run `run_id` met (`Documents`) or every document of the table (`Table`).
    pub(crate) async fn cleanup_page(
        &self,
        run_id: i64,
        scope: CleanupScope,
        after: &str,
    ) -> Result<Vec<String>, StoreError> {
        let docs = match scope {
            CleanupScope::Documents => {
                sqlx::query_scalar(
                    "SELECT doc_id FROM ingest_seen WHERE run_id = $1 AND doc_id > $2
                      GROUP BY doc_id ORDER BY doc_id LIMIT $3",
                )
                .bind(run_id)
                .bind(after)
                .bind(CLEANUP_PAGE_DOCS)
                .fetch_all(&self.pool)
                .await?
            }
            CleanupScope::Table => {
                sqlx::query_scalar(
                    "SELECT doc_id FROM ingest_manifest WHERE target_table = $1 AND doc_id > $2
                      GROUP BY doc_id ORDER BY doc_id LIMIT $3",
                )
                .bind(&self.target.name)
                .bind(after)
                .bind(CLEANUP_PAGE_DOCS)
                .fetch_all(&self.pool)
                .await?
            }
        };
        Ok(docs)
    }

    /// The chunks of `docs` a cleanup of run `run_id` deletes: not met by the run, written
    /// before its first position `first_position` (also their tombstones' position). With
    /// `apply`, deletes them (one transaction, a `deleted` event each); else only lists them.
    pub(crate) async fn cleanup_docs(
        &self,
        run_id: i64,
        first_position: i64,
        docs: &[String],
        apply: bool,
    ) -> Result<Vec<DeletedChunk>, StoreError> {
        // Looked at first without a lock: most pages of a rerun have nothing to delete, and
        // then no writer waits for them.
        let doomed = sqlx::query(AssertSqlSafe(format!(
            "SELECT m.doc_id, m.chunk_index FROM ingest_manifest m
              WHERE m.doc_id = ANY($5::text[]) AND {DOOMED}
              ORDER BY 1, 2"
        )))
        .bind(&self.target.name)
        .bind(first_position)
        .bind(run_id)
        .bind(false)
        .bind(docs)
        .fetch_all(&self.pool)
        .await?;
        if !apply || doomed.is_empty() {
            return doomed.iter().map(deleted_chunk).collect();
        }
        let mut tx = self.pool.begin().await?;
        sqlx::query(DELETE_LOCK_SQL).bind(&self.target.name).execute(&mut *tx).await?;
        let gone = sqlx::query(AssertSqlSafe(format!(
            "WITH doomed AS (
                 SELECT m.doc_id, m.chunk_index FROM ingest_manifest m
                  WHERE m.doc_id = ANY($5::text[]) AND {DOOMED}
                  ORDER BY m.doc_id, m.chunk_index
                    FOR UPDATE OF m
             ), gone AS (
                 DELETE FROM ingest_manifest m USING doomed d
                  WHERE m.target_table = $1::text AND m.doc_id = d.doc_id AND m.chunk_index = d.chunk_index
                 RETURNING m.doc_id, m.chunk_index, m.content_hash
             ), tomb AS (
                 INSERT INTO ingest_tombstone AS t (target_table, doc_id, chunk_index, source_seq)
                 SELECT $1::text, doc_id, chunk_index, $2::bigint FROM gone ORDER BY doc_id, chunk_index
                 ON CONFLICT (target_table, doc_id, chunk_index) DO UPDATE
                     SET source_seq = GREATEST(t.source_seq, EXCLUDED.source_seq), deleted_at = now()
             )
             SELECT doc_id, chunk_index, content_hash FROM gone ORDER BY 1, 2"
        )))
        .bind(&self.target.name)
        .bind(first_position)
        .bind(run_id)
        .bind(false)
        .bind(docs)
        .fetch_all(&mut *tx)
        .await?;
        let deleted = self.delete_rows(&mut tx, &gone, "cleanup").await?;
        crate::failpoint::hit!("cleanup_delete");
        tx.commit().await?;
        Ok(deleted)
    }

    /// Second statement of a deletion: the vectors and DLQ rows (and replay leases) of the
    /// chunks whose manifest rows `gone` lists (doc_id, chunk_index, content_hash), and one
    /// `deleted` event each, `by` the input or the cleanup.
    async fn delete_rows(
        &self,
        tx: &mut PgConnection,
        gone: &[sqlx::postgres::PgRow],
        by: &str,
    ) -> Result<Vec<DeletedChunk>, StoreError> {
        if gone.is_empty() {
            return Ok(Vec::new());
        }
        let mut docs = Vec::with_capacity(gone.len());
        let mut idxs = Vec::with_capacity(gone.len());
        let mut hashes = Vec::with_capacity(gone.len());
        for r in gone {
            docs.push(r.try_get::<String, _>("doc_id")?);
            idxs.push(r.try_get::<i32, _>("chunk_index")?);
            hashes.push(r.try_get::<String, _>("content_hash")?);
        }
        let table = self.target.sql_name();
        // The DLQ rows found by key (the DLQ may be believed empty: `DLQ_ID_OF_CHUNK`).
        use super::dlq::DLQ_ID_OF_CHUNK;
        sqlx::query(AssertSqlSafe(format!(
            "WITH k AS (
                 SELECT * FROM UNNEST($2::text[], $3::int[], $4::text[]) AS k(doc_id, chunk_index, content_hash)
             ), vectors AS (
                 -- By tuple id, each found by its key (a join walks a vector table believed
                 -- empty: `store::park::withdraw_sql`); the manifest rows were deleted first, and
                 -- every writer of a vector takes its manifest row first.
                 DELETE FROM {table} e
                  WHERE e.ctid = ANY (ARRAY(
                            SELECT (SELECT v.ctid FROM {table} v
                                     WHERE v.doc_id = k.doc_id AND v.chunk_index = k.chunk_index)
                              FROM k))
                 RETURNING e.doc_id, e.chunk_index
             ), dlq AS (
                 DELETE FROM embedding_dlq d
                  WHERE d.id = ANY (ARRAY(SELECT {DLQ_ID_OF_CHUNK} FROM k i))
                 RETURNING d.id, d.doc_id, d.chunk_index, d.generation
             ), released AS (
                 DELETE FROM replay_lease l WHERE l.dlq_id = ANY (ARRAY(SELECT id FROM dlq))
             ), events AS (
                 INSERT INTO dlq_outbox (event, dlq_id, target_table, doc_id, chunk_index, body)
                 SELECT 'deleted', q.id, $1::text, k.doc_id, k.chunk_index,
                        embed_dlq_event('deleted', q.id, $1::text, k.doc_id, k.chunk_index, q.generation,
                                        jsonb_build_object('content_hash', k.content_hash,
                                                           'had_vector', v.doc_id IS NOT NULL,
                                                           'by', $5::text, 'at', now()))
                   FROM k
                   LEFT JOIN dlq q ON q.doc_id = k.doc_id AND q.chunk_index = k.chunk_index
                   LEFT JOIN vectors v ON v.doc_id = k.doc_id AND v.chunk_index = k.chunk_index
                  ORDER BY k.doc_id, k.chunk_index
                 RETURNING 1
             )
             SELECT count(*) FROM events"
        )))
        .bind(&self.target.name)
        .bind(&docs)
        .bind(&idxs)
        .bind(&hashes)
        .bind(by)
        .fetch_one(&mut *tx)
        .await?;
        Ok(docs
            .into_iter()
            .zip(idxs)
            .map(|(doc_id, chunk_index)| DeletedChunk { doc_id, chunk_index })
            .collect())
    }
}

fn deleted_chunk(r: &sqlx::postgres::PgRow) -> Result<DeletedChunk, StoreError> {
    Ok(DeletedChunk { doc_id: r.try_get("doc_id")?, chunk_index: r.try_get("chunk_index")? })
}

/// Ingest runs alive now (holding their advisory lock, see `ingest/lease.rs`), as a CTE `live`.
const LIVE_RUNS: &str = "live AS MATERIALIZED (
    SELECT objid::bigint AS run_id FROM pg_locks
     WHERE locktype = 'advisory' AND granted AND objsubid = 2
       AND classid = embed_dlq_lease_lock_space()::oid
       AND database = (SELECT oid FROM pg_database WHERE datname = current_database()))";

/// The manifest rows (`m`) a cleanup deletes: of the table `$1`, written before the run's
/// first position `$2`, not met by run `$3`; with `$4`, only of documents the run met.
const DOOMED: &str = "m.target_table = $1::text AND m.source_seq < $2::bigint
    AND NOT EXISTS (SELECT 1 FROM ingest_seen s
                     WHERE s.run_id = $3::bigint AND s.doc_id = m.doc_id AND s.chunk_index = m.chunk_index)
    AND (NOT $4::bool OR EXISTS (SELECT 1 FROM ingest_seen s
                                  WHERE s.run_id = $3::bigint AND s.doc_id = m.doc_id))";

/// First statement of an explicit delete: locks (in key order) and deletes the manifest rows
/// older than the requests (`$2..=$4`: doc ids, chunk indexes with -1 for a whole document,
/// positions), writes the requests' tombstones, returns the rows deleted.
const REQUESTED_SQL: &str = r#"
WITH req AS (
    SELECT * FROM UNNEST($2::text[], $3::int[], $4::bigint[]) AS r(doc_id, chunk_index, source_seq)
), doomed AS (
    SELECT m.doc_id, m.chunk_index FROM ingest_manifest m
      JOIN req r ON m.doc_id = r.doc_id AND (r.chunk_index = -1 OR m.chunk_index = r.chunk_index)
     WHERE m.target_table = $1::text AND m.source_seq < r.source_seq
     ORDER BY m.doc_id, m.chunk_index
       FOR UPDATE OF m
), gone AS (
    DELETE FROM ingest_manifest m USING (SELECT DISTINCT doc_id, chunk_index FROM doomed) d
     WHERE m.target_table = $1::text AND m.doc_id = d.doc_id AND m.chunk_index = d.chunk_index
    RETURNING m.doc_id, m.chunk_index, m.content_hash
), tomb AS (
    INSERT INTO ingest_tombstone AS t (target_table, doc_id, chunk_index, source_seq)
    SELECT $1::text, doc_id, chunk_index, source_seq FROM req ORDER BY doc_id, chunk_index
    ON CONFLICT (target_table, doc_id, chunk_index) DO UPDATE
        SET source_seq = GREATEST(t.source_seq, EXCLUDED.source_seq), deleted_at = now()
)
SELECT doc_id, chunk_index, content_hash FROM gone ORDER BY 1, 2
"#;
