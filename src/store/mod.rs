//! Postgres: the system of record. Owns the manifest, the target vector table, the DLQ and
//! the outbox, and the only two ways an ingest outcome is written:
//!
//! - [`Store::store_batch`]: one statement upserts the vectors (a no-op for unchanged
//!   content, so `updated_at` does not move), marks the manifest stored, deletes any DLQ row
//!   the new vector supersedes and records a `resolved` event in the outbox;
//! - [`Store::park_batch`]: one statement upserts the DLQ rows (full payload), marks the
//!   manifest parked and writes a `parked` outbox row per chunk.
//!
//! Each is a single SQL statement over `UNNEST` arrays (binary binds, no per-row round trip),
//! so its parts commit or roll back together.

pub mod replay;

use std::collections::HashMap;
use std::time::Duration;

use pgvector::Vector;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool, Row};

use crate::model::{ChunkStatus, ErrorClass};

/// Embedded migrations (`migrations/`).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Store failures, split by what the caller can do about them.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    #[error("database error: {0}")]
    Db(#[from] sqlx::Error),
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("target table {table}: {problem}")]
    Target { table: String, problem: String },
}

impl StoreError {
    /// Whether retrying the same statement may succeed (connection loss, restart,
    /// serialization failure, deadlock) — by error kind and SQLSTATE, never by message.
    pub fn is_transient(&self) -> bool {
        match self {
            StoreError::Db(e) => is_transient_db(e),
            _ => false,
        }
    }
}

fn is_transient_db(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|c| {
            c.starts_with("08") // connection exception
                || c == "40001" // serialization_failure
                || c == "40P01" // deadlock_detected
                || c == "57P01" // admin_shutdown
                || c == "57P02" // crash_shutdown
                || c == "57P03" // cannot_connect_now
                || c == "53300" // too_many_connections
        }),
        _ => false,
    }
}

/// Opens a pool. `max_connections` should cover the workers plus the intake.
pub async fn connect(url: &str, max_connections: u32) -> Result<PgPool, StoreError> {
    let options: PgConnectOptions = url.parse()?;
    let pool = PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(options.application_name("embed-dlq"))
        .await?;
    Ok(pool)
}

/// Applies the embedded migrations (idempotent).
pub async fn migrate(pool: &PgPool) -> Result<(), StoreError> {
    MIGRATOR.run(pool).await?;
    Ok(())
}

/// A chunk whose vector is ready to store.
#[derive(Debug, Clone)]
pub struct StoredChunk {
    pub doc_id: String,
    pub chunk_index: i32,
    pub content_hash: String,
    pub embedding: Vec<f32>,
}

/// A chunk to park in the DLQ.
#[derive(Debug, Clone)]
pub struct ParkedChunk {
    pub doc_id: String,
    pub chunk_index: i32,
    pub content_hash: String,
    /// The full original record (text + metadata) — what replay needs once the source is gone.
    pub payload: serde_json::Value,
    pub class: ErrorClass,
    pub reason: String,
    pub last_error: String,
    pub last_status: Option<u16>,
    pub attempts: u32,
    /// Delay before the first replay; `None` for classes that are never replayed automatically.
    pub retry_in: Option<Duration>,
}

/// What one [`Store::store_batch`] changed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct StoreCounts {
    /// Vector rows inserted or whose content changed.
    pub vectors_written: u64,
    /// DLQ rows superseded by a stored vector.
    pub dlq_resolved: u64,
}

/// The target vector table: name and dimension as found in the catalog.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetTable {
    /// As given (e.g. `doc_embeddings` or `search.chunks`).
    pub name: String,
    /// Quoted for SQL.
    quoted: String,
    pub dimensions: usize,
}

/// Postgres access for ingest.
#[derive(Clone)]
pub struct Store {
    pool: PgPool,
    target: TargetTable,
    store_sql: String,
}

const REQUIRED_COLUMNS: [&str; 5] = ["doc_id", "chunk_index", "content_hash", "embedding", "updated_at"];

impl Store {
    /// Binds to `table`, reading its `embedding vector(N)` dimension from the catalog and
    /// checking that it has the columns and unique key the upserts rely on.
    pub async fn open(pool: PgPool, table: &str) -> Result<Store, StoreError> {
        let target = inspect_target(&pool, table).await?;
        let store_sql = store_sql(&target.quoted);
        Ok(Store { pool, target, store_sql })
    }

    /// The pool, for callers that run their own queries (reports, tests).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The target table.
    pub fn target(&self) -> &TargetTable {
        &self.target
    }

    /// The target table's name, quoted for SQL.
    pub(crate) fn target_sql_name(&self) -> &str {
        &self.target.quoted
    }

    /// Manifest rows for `keys`: content hash and status of each chunk that has finished an
    /// ingest before. One round trip.
    pub async fn manifest_lookup(
        &self,
        keys: &[(String, i32)],
    ) -> Result<HashMap<(String, i32), (String, ChunkStatus)>, StoreError> {
        let (docs, idxs): (Vec<&str>, Vec<i32>) = keys.iter().map(|(d, i)| (d.as_str(), *i)).unzip();
        let rows = sqlx::query(
            "SELECT m.doc_id, m.chunk_index, m.content_hash, m.status
               FROM ingest_manifest m
               JOIN UNNEST($1::text[], $2::int[]) AS k(doc_id, chunk_index)
                 ON m.doc_id = k.doc_id AND m.chunk_index = k.chunk_index",
        )
        .bind(&docs)
        .bind(&idxs)
        .fetch_all(&self.pool)
        .await?;
        let mut out = HashMap::with_capacity(rows.len());
        for r in rows {
            let status: String = r.try_get("status")?;
            let status = ChunkStatus::parse(&status).ok_or_else(|| {
                StoreError::Db(sqlx::Error::Decode(format!("unknown manifest status {status:?}").into()))
            })?;
            out.insert(
                (r.try_get("doc_id")?, r.try_get("chunk_index")?),
                (r.try_get("content_hash")?, status),
            );
        }
        Ok(out)
    }

    /// Stores a batch of vectors and everything that goes with them, atomically. Keys must be
    /// unique within the batch.
    pub async fn store_batch(&self, rows: &[StoredChunk]) -> Result<StoreCounts, StoreError> {
        if rows.is_empty() {
            return Ok(StoreCounts::default());
        }
        let docs: Vec<&str> = rows.iter().map(|r| r.doc_id.as_str()).collect();
        let idxs: Vec<i32> = rows.iter().map(|r| r.chunk_index).collect();
        let hashes: Vec<&str> = rows.iter().map(|r| r.content_hash.as_str()).collect();
        let vectors: Vec<Vector> = rows.iter().map(|r| Vector::from(r.embedding.clone())).collect();
        let row = sqlx::query(AssertSqlSafe(self.store_sql.as_str()))
            .bind(&docs)
            .bind(&idxs)
            .bind(&hashes)
            .bind(&vectors)
            .fetch_one(&self.pool)
            .await?;
        Ok(StoreCounts {
            vectors_written: row.try_get::<i64, _>("vectors_written")? as u64,
            dlq_resolved: row.try_get::<i64, _>("dlq_resolved")? as u64,
        })
    }

    /// Parks a batch: DLQ rows, manifest status and outbox events, atomically. Attempts add
    /// up across passes for the same content and restart when the content changed.
    pub async fn park_batch(&self, rows: &[ParkedChunk]) -> Result<(), StoreError> {
        if rows.is_empty() {
            return Ok(());
        }
        let docs: Vec<&str> = rows.iter().map(|r| r.doc_id.as_str()).collect();
        let idxs: Vec<i32> = rows.iter().map(|r| r.chunk_index).collect();
        let hashes: Vec<&str> = rows.iter().map(|r| r.content_hash.as_str()).collect();
        let payloads: Vec<&serde_json::Value> = rows.iter().map(|r| &r.payload).collect();
        let classes: Vec<&str> = rows.iter().map(|r| r.class.as_str()).collect();
        let reasons: Vec<&str> = rows.iter().map(|r| r.reason.as_str()).collect();
        let errors: Vec<&str> = rows.iter().map(|r| r.last_error.as_str()).collect();
        let statuses: Vec<Option<i32>> = rows.iter().map(|r| r.last_status.map(i32::from)).collect();
        let attempts: Vec<i32> = rows.iter().map(|r| r.attempts.min(i32::MAX as u32) as i32).collect();
        let retry_in: Vec<Option<f64>> = rows.iter().map(|r| r.retry_in.map(|d| d.as_secs_f64())).collect();
        sqlx::query(PARK_SQL)
            .bind(&docs)
            .bind(&idxs)
            .bind(&hashes)
            .bind(sqlx::types::Json(&payloads))
            .bind(&classes)
            .bind(&reasons)
            .bind(&errors)
            .bind(&statuses)
            .bind(&attempts)
            .bind(&retry_in)
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}

/// Payloads travel as one JSON array (`jsonb_array_elements` keeps their order with the
/// other arrays via `WITH ORDINALITY`), which avoids a jsonb[] round of per-element encoding.
const PARK_SQL: &str = r#"
WITH input AS (
    SELECT k.doc_id, k.chunk_index, k.content_hash, p.payload, k.error_class, k.error_reason,
           k.last_error, k.last_status, k.attempts, k.retry_in
      FROM UNNEST($1::text[], $2::int[], $3::text[], $5::text[], $6::text[], $7::text[],
                  $8::int[], $9::int[], $10::float8[])
           WITH ORDINALITY AS k(doc_id, chunk_index, content_hash, error_class, error_reason,
                                last_error, last_status, attempts, retry_in, n)
      JOIN jsonb_array_elements($4::jsonb) WITH ORDINALITY AS p(payload, n) USING (n)
), dlq AS (
    INSERT INTO embedding_dlq AS q
        (doc_id, chunk_index, content_hash, payload, error_class, error_reason, last_error,
         last_status, attempts, next_retry_at, error_history)
    SELECT doc_id, chunk_index, content_hash, payload, error_class, error_reason, last_error,
           last_status, attempts,
           CASE WHEN retry_in IS NULL THEN NULL ELSE now() + make_interval(secs => retry_in) END,
           jsonb_build_array(jsonb_build_object('at', now(), 'pass', 'ingest', 'error_class', error_class,
                                                'error_reason', error_reason, 'status', last_status,
                                                'attempts', attempts, 'error', last_error))
      FROM input
    ON CONFLICT (doc_id, chunk_index) DO UPDATE SET
        payload         = EXCLUDED.payload,
        error_class     = EXCLUDED.error_class,
        error_reason    = EXCLUDED.error_reason,
        last_error      = EXCLUDED.last_error,
        last_status     = EXCLUDED.last_status,
        attempts        = CASE WHEN q.content_hash = EXCLUDED.content_hash
                               THEN q.attempts + EXCLUDED.attempts ELSE EXCLUDED.attempts END,
        replays         = CASE WHEN q.content_hash = EXCLUDED.content_hash THEN q.replays ELSE 0 END,
        first_failed_at = CASE WHEN q.content_hash = EXCLUDED.content_hash
                               THEN q.first_failed_at ELSE now() END,
        content_hash    = EXCLUDED.content_hash,
        last_failed_at  = now(),
        next_retry_at   = EXCLUDED.next_retry_at,
        exhausted_at    = NULL,
        error_history   = jsonb_path_query_array(
                              CASE WHEN q.content_hash = EXCLUDED.content_hash THEN q.error_history
                                   ELSE '[]'::jsonb END || EXCLUDED.error_history,
                              '$[last-19 to last]')
    RETURNING q.id, q.doc_id, q.chunk_index, q.error_class, q.error_reason, q.attempts,
              q.first_failed_at, q.last_failed_at, q.next_retry_at
), events AS (
    INSERT INTO dlq_outbox (event, dlq_id, doc_id, chunk_index, body)
    SELECT 'parked', id, doc_id, chunk_index,
           jsonb_build_object('event', 'parked', 'dlq_id', id, 'doc_id', doc_id,
                              'chunk_index', chunk_index, 'error_class', error_class,
                              'error_reason', error_reason, 'attempts', attempts,
                              'first_failed_at', first_failed_at, 'last_failed_at', last_failed_at,
                              'next_retry_at', next_retry_at)
      FROM dlq
    RETURNING 1
)
INSERT INTO ingest_manifest AS m (doc_id, chunk_index, content_hash, status)
SELECT doc_id, chunk_index, content_hash, 'parked' FROM input
ON CONFLICT (doc_id, chunk_index) DO UPDATE
    SET content_hash = EXCLUDED.content_hash, status = 'parked', updated_at = now()
"#;

fn store_sql(table: &str) -> String {
    format!(
        r#"
WITH input AS (
    SELECT * FROM UNNEST($1::text[], $2::int[], $3::text[], $4::vector[])
        AS t(doc_id, chunk_index, content_hash, embedding)
), vectors AS (
    INSERT INTO {table} AS e (doc_id, chunk_index, content_hash, embedding)
    SELECT doc_id, chunk_index, content_hash, embedding FROM input
    ON CONFLICT (doc_id, chunk_index) DO UPDATE
        SET embedding = EXCLUDED.embedding, content_hash = EXCLUDED.content_hash, updated_at = now()
        WHERE e.content_hash IS DISTINCT FROM EXCLUDED.content_hash
    RETURNING 1
), manifest AS (
    INSERT INTO ingest_manifest AS m (doc_id, chunk_index, content_hash, status)
    SELECT doc_id, chunk_index, content_hash, 'stored' FROM input
    ON CONFLICT (doc_id, chunk_index) DO UPDATE
        SET content_hash = EXCLUDED.content_hash, status = 'stored', updated_at = now()
        WHERE (m.content_hash, m.status) IS DISTINCT FROM (EXCLUDED.content_hash, 'stored')
    RETURNING 1
), resolved AS (
    DELETE FROM embedding_dlq d USING input i
     WHERE d.doc_id = i.doc_id AND d.chunk_index = i.chunk_index
    RETURNING d.id, d.doc_id, d.chunk_index, d.error_class, d.attempts
), events AS (
    INSERT INTO dlq_outbox (event, dlq_id, doc_id, chunk_index, body)
    SELECT 'resolved', id, doc_id, chunk_index,
           jsonb_build_object('event', 'resolved', 'dlq_id', id, 'doc_id', doc_id,
                              'chunk_index', chunk_index, 'error_class', error_class,
                              'attempts', attempts, 'at', now())
      FROM resolved
    RETURNING 1
)
SELECT (SELECT count(*) FROM vectors) AS vectors_written,
       (SELECT count(*) FROM resolved) AS dlq_resolved,
       (SELECT count(*) FROM manifest) AS manifest_changed,
       (SELECT count(*) FROM events) AS events_written
"#
    )
}

/// Quotes a possibly schema-qualified identifier (`a.b` → `"a"."b"`).
pub fn quote_table_name(name: &str) -> Result<String, String> {
    let parts: Vec<&str> = name.split('.').collect();
    if parts.is_empty() || parts.len() > 2 || parts.iter().any(|p| p.is_empty()) {
        return Err(format!("{name:?} is not a table name (use `table` or `schema.table`)"));
    }
    Ok(parts.iter().map(|p| format!("\"{}\"", p.replace('"', "\"\""))).collect::<Vec<_>>().join("."))
}

async fn inspect_target(pool: &PgPool, table: &str) -> Result<TargetTable, StoreError> {
    let err = |problem: String| StoreError::Target { table: table.to_string(), problem };
    let quoted = quote_table_name(table).map_err(err)?;
    let oid: Option<i64> =
        sqlx::query_scalar("SELECT to_regclass($1)::oid::bigint").bind(&quoted).fetch_one(pool).await?;
    let oid = oid.ok_or_else(|| err("does not exist (run `embed-dlq migrate`, or create it)".into()))?;
    let cols = sqlx::query(
        "SELECT a.attname::text AS name, format_type(a.atttypid, a.atttypmod) AS type, a.atttypmod AS typmod
           FROM pg_attribute a
          WHERE a.attrelid = $1::bigint::oid AND a.attnum > 0 AND NOT a.attisdropped",
    )
    .bind(oid)
    .fetch_all(pool)
    .await?;
    let mut dims = None;
    for col in REQUIRED_COLUMNS {
        let found = cols.iter().find(|r| r.get::<String, _>("name") == col);
        let Some(found) = found else {
            return Err(err(format!("missing column {col} (needs {})", REQUIRED_COLUMNS.join(", "))));
        };
        if col == "embedding" {
            let ty: String = found.get("type");
            let typmod: i32 = found.get("typmod");
            if !ty.starts_with("vector(") || typmod <= 0 {
                return Err(err(format!(
                    "column embedding is {ty}, expected vector(N) with a fixed dimension"
                )));
            }
            dims = Some(typmod as usize);
        }
    }
    // The upserts need a unique constraint or index on exactly (doc_id, chunk_index).
    let has_key: bool = sqlx::query_scalar(
        "SELECT EXISTS (
             SELECT 1 FROM pg_index i
              WHERE i.indrelid = $1::bigint::oid AND i.indisunique AND i.indpred IS NULL
                AND (SELECT array_agg(a.attname::text ORDER BY a.attname)
                       FROM pg_attribute a
                      WHERE a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey))
                    = ARRAY['chunk_index', 'doc_id'])",
    )
    .bind(oid)
    .fetch_one(pool)
    .await?;
    if !has_key {
        return Err(err(
            "needs a UNIQUE (doc_id, chunk_index) constraint: without it replays duplicate vectors".into(),
        ));
    }
    Ok(TargetTable { name: table.to_string(), quoted, dimensions: dims.expect("embedding checked") })
}

/// Creates a target table of another dimension with the required shape (for `migrate
/// --table NAME --dimensions N`).
pub async fn create_target_table(pool: &PgPool, table: &str, dimensions: usize) -> Result<(), StoreError> {
    let quoted = quote_table_name(table)
        .map_err(|problem| StoreError::Target { table: table.to_string(), problem })?;
    let sql = format!(
        "CREATE TABLE IF NOT EXISTS {quoted} (
            doc_id       text        NOT NULL,
            chunk_index  int         NOT NULL,
            content_hash text        NOT NULL,
            embedding    vector({dimensions}) NOT NULL,
            created_at   timestamptz NOT NULL DEFAULT now(),
            updated_at   timestamptz NOT NULL DEFAULT now(),
            UNIQUE (doc_id, chunk_index))"
    );
    sqlx::query(AssertSqlSafe(sql)).execute(pool).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting() {
        assert_eq!(quote_table_name("doc_embeddings").unwrap(), "\"doc_embeddings\"");
        assert_eq!(quote_table_name("s.t").unwrap(), "\"s\".\"t\"");
        assert_eq!(quote_table_name("we\"ird").unwrap(), "\"we\"\"ird\"");
        assert!(quote_table_name("a.b.c").is_err());
        assert!(quote_table_name("").is_err());
        assert!(quote_table_name("a.").is_err());
    }
}
