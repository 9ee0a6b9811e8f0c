//! The ingest side of the store: the only two ways an ingest outcome is written
//! ([`Store::store_batch`], [`Store::park_batch`]), each one transaction of two statements
//! (the manifest claim, which also marks the run's leases of those chunks finished, then the writes
//! of the rows it accepted). The intake window's lookup is in `lease.rs`.

use std::collections::HashMap;
use std::time::Duration;

use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;
use sqlx::postgres::{PgArgumentBuffer, PgHasArrayType, PgTypeInfo};
use sqlx::{AssertSqlSafe, Postgres, Row};

use super::{Store, StoreError};
use crate::model::{ChunkStatus, ErrorClass};

/// A chunk whose vector is ready to store.
#[derive(Debug, Clone)]
pub(crate) struct StoredChunk {
    pub doc_id: String,
    pub chunk_index: i32,
    pub content_hash: String,
    pub embedding: Vec<f32>,
    /// Position of the record in the ingest history ([`super::position`]): an outcome for an older
    /// position than the manifest holds is rejected as superseded.
    pub source_seq: i64,
    /// The run claimed the chunk's lease (`lease.rs`), so the store marks it finished. A
    /// batch where no row holds one skips the lease update (a run alone, past its first
    /// windows); a lease left unmarked would only defer a concurrent run until this run ends.
    pub leased: bool,
}

/// A vector bound as pgvector's binary `vector` straight from the chunk's `f32`s: the wire
/// format of `pgvector::Vector`'s encoder (dimension count, a zero, big-endian values),
/// without first copying each 3 KB vector into a `Vector` and writing it four bytes at a time.
#[derive(Debug, Clone, Copy)]
pub(crate) struct VectorRef<'a>(pub &'a [f32]);

impl sqlx::Type<Postgres> for VectorRef<'_> {
    fn type_info() -> PgTypeInfo {
        PgTypeInfo::with_name("vector")
    }
}

impl PgHasArrayType for VectorRef<'_> {
    fn array_type_info() -> PgTypeInfo {
        PgTypeInfo::with_name("_vector")
    }
}

impl sqlx::Encode<'_, Postgres> for VectorRef<'_> {
    fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
        let dimensions = u16::try_from(self.0.len())?;
        buf.extend_from_slice(&dimensions.to_be_bytes());
        buf.extend_from_slice(&0u16.to_be_bytes());
        let start = buf.len();
        buf.resize(start + 4 * self.0.len(), 0);
        for (out, v) in buf[start..].chunks_exact_mut(4).zip(self.0) {
            out.copy_from_slice(&v.to_be_bytes());
        }
        Ok(IsNull::No)
    }

    fn size_hint(&self) -> usize {
        4 + 4 * self.0.len()
    }
}

/// A chunk to park in the DLQ.
#[derive(Debug, Clone)]
pub struct ParkedChunk {
    /// Identity of the chunk (with `chunk_index`).
    pub doc_id: String,
    /// Position of the chunk within its document.
    pub chunk_index: i32,
    /// The content parked; replay only writes a vector if the manifest still holds this hash.
    pub content_hash: String,
    /// The full original record (text + metadata) — what replay needs once the source is gone.
    pub payload: serde_json::Value,
    /// Decides whether and when replay retries the row.
    pub class: ErrorClass,
    /// Bounded reason code, e.g. `http_503` or `too_long`.
    pub reason: String,
    /// Sanitised detail of the last failure, for operators.
    pub last_error: String,
    /// The last HTTP status, if the failure came from a response.
    pub last_status: Option<u16>,
    /// Provider attempts spent before parking.
    pub attempts: u32,
    /// Delay before the first replay; `None` for classes that are never replayed automatically.
    pub retry_in: Option<Duration>,
    /// Position of the record in the ingest history ([`super::position`]).
    pub source_seq: i64,
}

/// What a park of a chunk's new text does to the vector of its previous text (`[ingest]
/// on_newer_parked`, `--on-newer-parked`). Invariant 9 says a stored vector is the vector of
/// the chunk's current text; once newer text is parked, the old vector answers searches with
/// text that is no longer in the source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnNewerParked {
    /// Delete the previous text's vector in the park's transaction, with a `withdrawn` event:
    /// search stops returning text the source no longer holds, and the chunk is missing from
    /// search until its new text is stored (by replay, or a later ingest). The reconciler's
    /// `superseded_vectors` check reports such vectors left behind and its repair withdraws
    /// them.
    #[default]
    Withdraw,
    /// Leave the previous text's vector in place: search keeps serving the previous text until
    /// the new one is stored (which overwrites it). The reconciler counts these vectors in
    /// the `superseded_vectors` note, not as findings, and never deletes them.
    Keep,
}

impl OnNewerParked {
    /// The setting's spelling in files, flags and reports.
    pub fn as_str(self) -> &'static str {
        match self {
            OnNewerParked::Withdraw => "withdraw",
            OnNewerParked::Keep => "keep",
        }
    }
}

/// What one [`Store::store_batch`] changed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StoreCounts {
    /// Vector rows inserted or whose content changed.
    pub vectors_written: u64,
    /// DLQ rows superseded by a stored vector.
    pub dlq_resolved: u64,
    /// Rows not written because the manifest already holds a newer record for the chunk.
    pub superseded: u64,
}

/// What one [`Store::park_batch`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ParkCounts {
    /// `parked` events written: DLQ rows inserted or whose content changed. A park onto a
    /// row with the same content (a retried statement, a concurrent ingest) writes none.
    pub events: u64,
    /// Vectors of the chunks' previous text deleted with the park, each announced by a
    /// `withdrawn` event ([`OnNewerParked::Withdraw`]; always 0 under `Keep`).
    pub withdrawn: u64,
    /// Positions (in the input slice) of rows not written because the manifest already holds
    /// a newer record for the chunk, or already has this content stored.
    pub superseded: Vec<usize>,
}

/// A row an ingest writes, as its manifest claim sees it: (doc_id, chunk_index, content
/// hash, position ([`super::position`])).
trait ManifestRecord {
    fn manifest_key(&self) -> (&str, i32, &str, i64);
    /// Whether the run may hold a lease of the chunk that its outcome must mark finished.
    fn may_hold_lease(&self) -> bool;
}

impl ManifestRecord for StoredChunk {
    fn manifest_key(&self) -> (&str, i32, &str, i64) {
        (&self.doc_id, self.chunk_index, &self.content_hash, self.source_seq)
    }
    fn may_hold_lease(&self) -> bool {
        self.leased
    }
}

impl ManifestRecord for ParkedChunk {
    fn manifest_key(&self) -> (&str, i32, &str, i64) {
        (&self.doc_id, self.chunk_index, &self.content_hash, self.source_seq)
    }
    /// Parks are rare on a clean run: they always look for a lease to finish.
    fn may_hold_lease(&self) -> bool {
        true
    }
}

impl Store {
    /// A new ingest run id (from a sequence): what marks the run alive, holds its leases and
    /// names its seen keys.
    pub(crate) async fn next_run_id(&self) -> Result<i64, StoreError> {
        Ok(sqlx::query_scalar("SELECT nextval('embed_dlq_ingest_run_seq')").fetch_one(&self.pool).await?)
    }

    /// Opens the transaction of a store or park and claims the manifest rows of `rows` in it:
    /// the transaction, the rows accepted, and the positions of those superseded by a newer
    /// record (not to be written).
    async fn begin_claimed<'r, R: ManifestRecord>(
        &self,
        rows: &'r [R],
        status: ChunkStatus,
    ) -> Result<(sqlx::Transaction<'static, sqlx::Postgres>, Vec<&'r R>, Vec<usize>), StoreError> {
        let mut tx = self.pool.begin().await?;
        // Before the claim's snapshot: a deletion of this table in progress finishes first, so
        // the claim sees its tombstones (`delete.rs`).
        sqlx::query(super::delete::WRITE_LOCK_SQL).bind(&self.target.name).execute(&mut *tx).await?;
        let leases = rows.iter().any(R::may_hold_lease);
        let accepted = self.claim_manifest(&mut tx, rows.iter().map(R::manifest_key), status, leases).await?;
        let (mut keep, mut superseded) = (Vec::with_capacity(rows.len()), Vec::new());
        for (n, (row, accepted)) in rows.iter().zip(accepted).enumerate() {
            if accepted {
                keep.push(row);
            } else {
                superseded.push(n);
            }
        }
        Ok((tx, keep, superseded))
    }

    /// Upserts the manifest rows of a batch (first statement of a store or park transaction)
    /// and returns the positions of the rows it accepted. Taking the row locks here, before
    /// anything else, serialises racing writers of one chunk, and the statements after it see
    /// whatever the previous holder committed. Without `leases` (no row of the batch may hold
    /// one) the statement leaves the lease table alone.
    async fn claim_manifest(
        &self,
        tx: &mut sqlx::PgConnection,
        keys: impl Iterator<Item = (&str, i32, &str, i64)>,
        status: ChunkStatus,
        leases: bool,
    ) -> Result<Vec<bool>, StoreError> {
        let (mut docs, mut idxs, mut hashes, mut seqs) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (d, i, h, s) in keys {
            docs.push(d);
            idxs.push(i);
            hashes.push(h);
            seqs.push(s);
        }
        let accepted = sqlx::query(if leases { MANIFEST_SQL } else { MANIFEST_NO_LEASE_SQL })
            .bind(&self.target.name)
            .bind(&docs)
            .bind(&idxs)
            .bind(&hashes)
            .bind(&seqs)
            .bind(status.as_str())
            // Planned for each batch with its real keys and the tables as they are now: with
            // a cached plan, the bench's second round stalled for 9 s in two writers scanning
            // a table once per key (the lease update's join, most likely, planned while the
            // lease table was empty).
            .persistent(false)
            .fetch_all(&mut *tx)
            .await?;
        let position: HashMap<(&str, i32), usize> =
            docs.iter().zip(&idxs).enumerate().map(|(n, (d, i))| ((*d, *i), n)).collect();
        let mut out = vec![false; docs.len()];
        for r in &accepted {
            let key: (String, i32) = (r.try_get("doc_id")?, r.try_get("chunk_index")?);
            if let Some(&n) = position.get(&(key.0.as_str(), key.1)) {
                out[n] = true;
            }
        }
        Ok(out)
    }

    /// Stores a batch of vectors and everything that goes with them, atomically: manifest
    /// `stored`, vector upsert (a no-op for unchanged content), any DLQ row of the chunk
    /// resolved with a `resolved` event. A row whose chunk already holds a newer record is
    /// not written (counted as superseded). Keys must be unique within the batch.
    pub(crate) async fn store_batch(&self, rows: &[StoredChunk]) -> Result<StoreCounts, StoreError> {
        if rows.is_empty() {
            return Ok(StoreCounts::default());
        }
        let (mut tx, keep, superseded) = self.begin_claimed(rows, ChunkStatus::Stored).await?;
        let mut counts = StoreCounts { superseded: superseded.len() as u64, ..Default::default() };
        if !keep.is_empty() {
            let docs: Vec<&str> = keep.iter().map(|r| r.doc_id.as_str()).collect();
            let idxs: Vec<i32> = keep.iter().map(|r| r.chunk_index).collect();
            let hashes: Vec<&str> = keep.iter().map(|r| r.content_hash.as_str()).collect();
            let vectors: Vec<VectorRef<'_>> = keep.iter().map(|r| VectorRef(&r.embedding)).collect();
            let row = sqlx::query(AssertSqlSafe(self.target.store_sql.as_str()))
                .bind(&self.target.name)
                .bind(&docs)
                .bind(&idxs)
                .bind(&hashes)
                .bind(&vectors)
                .fetch_one(&mut *tx)
                .await?;
            counts.vectors_written = row.try_get::<i64, _>("vectors_written")? as u64;
            counts.dlq_resolved = row.try_get::<i64, _>("dlq_resolved")? as u64;
        }
        tx.commit().await?;
        Ok(counts)
    }

    /// Parks a batch: manifest status, DLQ rows and `parked` events, atomically; under
    /// [`OnNewerParked::Withdraw`] (the store's policy) the same transaction deletes each
    /// chunk's vector of other content (its previous text) with a `withdrawn` event, so no
    /// search returns text the chunk no longer holds. Idempotent
    /// per content: a park onto a DLQ row that already holds the same content changes nothing
    /// and announces nothing (a retried statement, a concurrent ingest of the same corpus); a
    /// park of changed content restarts the row (attempts, replays, history) under a new
    /// generation. Rows whose chunk already holds a newer record, or already has this content
    /// stored, are not written (`superseded`). Keys must be unique within the batch.
    pub async fn park_batch(&self, rows: &[ParkedChunk]) -> Result<ParkCounts, StoreError> {
        if rows.is_empty() {
            return Ok(ParkCounts::default());
        }
        let (mut tx, keep, superseded) = self.begin_claimed(rows, ChunkStatus::Parked).await?;
        let mut counts = ParkCounts { events: 0, withdrawn: 0, superseded };
        if !keep.is_empty() {
            let docs: Vec<&str> = keep.iter().map(|r| r.doc_id.as_str()).collect();
            let idxs: Vec<i32> = keep.iter().map(|r| r.chunk_index).collect();
            let hashes: Vec<&str> = keep.iter().map(|r| r.content_hash.as_str()).collect();
            let payloads: Vec<&serde_json::Value> = keep.iter().map(|r| &r.payload).collect();
            let classes: Vec<&str> = keep.iter().map(|r| r.class.as_str()).collect();
            let reasons: Vec<&str> = keep.iter().map(|r| r.reason.as_str()).collect();
            let errors: Vec<&str> = keep.iter().map(|r| r.last_error.as_str()).collect();
            let statuses: Vec<Option<i32>> = keep.iter().map(|r| r.last_status.map(i32::from)).collect();
            let attempts: Vec<i32> = keep.iter().map(|r| r.attempts.min(i32::MAX as u32) as i32).collect();
            let retry_in: Vec<Option<f64>> =
                keep.iter().map(|r| r.retry_in.map(|d| d.as_secs_f64())).collect();
            let events: i64 = sqlx::query_scalar(PARK_SQL)
                .bind(&self.target.name)
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
                .bind(self.space.as_ref().map(|s| s.model.as_str()))
                .bind(self.target.dimensions.min(i32::MAX as usize) as i32)
                .bind(self.space.as_ref().and_then(|s| s.request_dimensions))
                .fetch_one(&mut *tx)
                .await?;
            counts.events = events as u64;
            if self.on_newer_parked() == OnNewerParked::Withdraw {
                let withdrawn: i64 = sqlx::query_scalar(AssertSqlSafe(self.target.withdraw_sql.as_str()))
                    .bind(&self.target.name)
                    .bind(&docs)
                    .bind(&idxs)
                    .bind(&hashes)
                    .fetch_one(&mut *tx)
                    .await?;
                counts.withdrawn = withdrawn as u64;
            }
        }
        tx.commit().await?;
        Ok(counts)
    }
}

// The parts of the manifest claim shared by its two forms below.
macro_rules! manifest_input {
    () => {
        r#"
WITH input AS (
    SELECT * FROM UNNEST($2::text[], $3::int[], $4::text[], $5::bigint[])
        AS t(doc_id, chunk_index, content_hash, source_seq)
)
"#
    };
}

macro_rules! manifest_upsert {
    () => {
        r#"INSERT INTO ingest_manifest AS m (target_table, doc_id, chunk_index, content_hash, status, source_seq)
SELECT $1::text, doc_id, chunk_index, content_hash, $6::text, source_seq
  FROM input i
 WHERE NOT EXISTS (SELECT 1 FROM ingest_tombstone t
                    WHERE t.target_table = $1::text AND t.doc_id = i.doc_id
                      AND t.chunk_index IN (i.chunk_index, -1) AND t.source_seq > i.source_seq)
 ORDER BY doc_id, chunk_index
ON CONFLICT (target_table, doc_id, chunk_index) DO UPDATE SET
    status       = CASE WHEN m.content_hash = EXCLUDED.content_hash AND m.status = 'exhausted'
                             AND EXCLUDED.status = 'parked'
                        THEN m.status ELSE EXCLUDED.status END,
    updated_at   = CASE WHEN m.content_hash = EXCLUDED.content_hash
                             AND (m.status = EXCLUDED.status
                                  OR (m.status = 'exhausted' AND EXCLUDED.status = 'parked'))
                        THEN m.updated_at ELSE now() END,
    content_hash = EXCLUDED.content_hash,
    source_seq   = EXCLUDED.source_seq
  WHERE m.source_seq <= EXCLUDED.source_seq
    AND NOT (EXCLUDED.status = 'parked' AND m.status = 'stored' AND m.content_hash = EXCLUDED.content_hash)
RETURNING m.doc_id, m.chunk_index
"#
    };
}

/// First statement of a store or park: the manifest upsert, accepted only for a record at
/// least as new as the one the manifest holds ($6 is the new status) and newer than any
/// deletion of its chunk or document (`ingest_tombstone`, see `delete.rs`). A park of content that
/// is already stored is not accepted either. Keys are locked in key order (no deadlock between
/// writers whose batches overlap). Returns the accepted keys.
///
/// It also marks finished the leases (`lease.rs`) held for the record (its position and
/// content), whether the row is accepted or superseded: the outcome is decided either way.
/// Lease rows are locked in key order, as every lease claim does.
const MANIFEST_SQL: &str = concat!(
    manifest_input!(),
    r#", released AS (
    UPDATE ingest_lease l SET finished_at = now(), finished_xact = pg_current_xact_id()
     WHERE (l.target_table, l.doc_id, l.chunk_index) IN (
           SELECT x.target_table, x.doc_id, x.chunk_index
             FROM ingest_lease x
             JOIN input i ON x.doc_id = i.doc_id AND x.chunk_index = i.chunk_index
                         AND x.content_hash = i.content_hash AND x.source_seq = i.source_seq
            WHERE x.target_table = $1::text
            ORDER BY x.doc_id, x.chunk_index
              FOR UPDATE OF x)
)
"#,
    manifest_upsert!()
);

/// [`MANIFEST_SQL`] for a batch where no row holds a lease: the same upsert without the lease
/// update, which would look up every key in the lease table for nothing.
const MANIFEST_NO_LEASE_SQL: &str = concat!(manifest_input!(), manifest_upsert!());

/// Second statement of a park (rows the manifest accepted). Payloads travel as one JSON array
/// (`jsonb_array_elements` keeps their order with the other arrays via `WITH ORDINALITY`),
/// which avoids a jsonb[] round of per-element encoding. The DLQ upsert changes a row only
/// when its content changed, so a repeated park is a no-op without an event.
const PARK_SQL: &str = r#"
WITH input AS (
    SELECT k.doc_id, k.chunk_index, k.content_hash, p.payload, k.error_class, k.error_reason,
           k.last_error, k.last_status, k.attempts, k.retry_in
      FROM UNNEST($2::text[], $3::int[], $4::text[], $6::text[], $7::text[], $8::text[],
                  $9::int[], $10::int[], $11::float8[])
           WITH ORDINALITY AS k(doc_id, chunk_index, content_hash, error_class, error_reason,
                                last_error, last_status, attempts, retry_in, n)
      JOIN jsonb_array_elements($5::jsonb) WITH ORDINALITY AS p(payload, n) USING (n)
), dlq AS (
    INSERT INTO embedding_dlq AS q
        (target_table, doc_id, chunk_index, content_hash, model, dimensions, request_dimensions,
         payload, error_class, error_reason, last_error, last_status, attempts, next_retry_at,
         error_history)
    SELECT $1::text, doc_id, chunk_index, content_hash, $12::text, $13::int, $14::int,
           payload, error_class, error_reason, last_error, last_status, attempts,
           CASE WHEN retry_in IS NULL THEN NULL ELSE now() + make_interval(secs => retry_in) END,
           jsonb_build_array(jsonb_build_object('at', now(), 'pass', 'ingest', 'error_class', error_class,
                                                'error_reason', error_reason, 'status', last_status,
                                                'attempts', attempts, 'error', last_error))
      FROM input ORDER BY doc_id, chunk_index
    ON CONFLICT (target_table, doc_id, chunk_index) DO UPDATE SET
        content_hash         = EXCLUDED.content_hash,
        model                = EXCLUDED.model,
        dimensions           = EXCLUDED.dimensions,
        request_dimensions   = EXCLUDED.request_dimensions,
        generation           = nextval('embed_dlq_generation_seq'),
        payload              = EXCLUDED.payload,
        error_class          = EXCLUDED.error_class,
        error_reason         = EXCLUDED.error_reason,
        last_error           = EXCLUDED.last_error,
        last_status          = EXCLUDED.last_status,
        attempts             = EXCLUDED.attempts,
        replays              = 0,
        first_failed_at      = now(),
        last_failed_at       = now(),
        next_retry_at        = EXCLUDED.next_retry_at,
        enqueued_at          = NULL,
        exhausted_at         = NULL,
        exhausted_reason     = NULL,
        last_error_signature = NULL,
        same_error_count     = 0,
        error_history        = EXCLUDED.error_history
      WHERE q.content_hash IS DISTINCT FROM EXCLUDED.content_hash
    RETURNING q.id, q.target_table, q.doc_id, q.chunk_index, q.generation, q.content_hash,
              q.error_class, q.error_reason, q.attempts, q.first_failed_at, q.last_failed_at,
              q.next_retry_at
), events AS (
    INSERT INTO dlq_outbox (event, dlq_id, target_table, doc_id, chunk_index, body)
    SELECT 'parked', id, target_table, doc_id, chunk_index,
           embed_dlq_event('parked', id, target_table, doc_id, chunk_index, generation,
                           jsonb_build_object('content_hash', content_hash,
                                              'error_class', error_class, 'error_reason', error_reason,
                                              'attempts', attempts, 'first_failed_at', first_failed_at,
                                              'last_failed_at', last_failed_at, 'next_retry_at', next_retry_at))
      FROM dlq
    RETURNING 1
)
SELECT count(*) FROM events
"#;

/// The keys of a park's withdraw ([`withdraw_sql`]): the accepted rows' (doc_id, chunk_index,
/// content hash just parked), `$2..=$4`.
const PARKED_KEYS: &str =
    "SELECT * FROM UNNEST($2::text[], $3::int[], $4::text[]) AS k(doc_id, chunk_index, content_hash)";

/// Third statement of a park under [`OnNewerParked::Withdraw`], for one table (its canonical
/// name): deletes the vectors of the parked chunks whose content differs from what was just
/// parked, with one `withdrawn` event each (`by: ingest`). Binds the table's name `$1` and the
/// keys `$2..=$4`. Runs after the DLQ upsert (its own statement, so it sees the rows that upsert
/// wrote) and never deletes a vector of the parked content itself.
pub(super) fn park_withdraw_sql(table: &str) -> String {
    withdraw_sql(table, PARKED_KEYS, "ingest")
}

/// Deletes the vectors of `table` (canonical name) for the chunks `keys` selects (a query
/// giving doc_id, chunk_index and the chunk's current content_hash) that hold other content,
/// and announces each with a `withdrawn` event carrying the chunk's DLQ row (the one holding its
/// current content), the withdrawn hash and `by` (a constant: `ingest` or `reconcile`).
/// Returns one row: how many vectors were deleted. The caller holds the chunks' manifest rows
/// locked (every writer locks the manifest first).
pub(super) fn withdraw_sql(table: &str, keys: &str, by: &str) -> String {
    format!(
        r#"
WITH k AS ({keys}
), gone AS (
    DELETE FROM {table} e USING k
     WHERE e.doc_id = k.doc_id AND e.chunk_index = k.chunk_index AND e.content_hash <> k.content_hash
    RETURNING e.doc_id, e.chunk_index, e.content_hash AS withdrawn_hash, k.content_hash
), events AS (
    INSERT INTO dlq_outbox (event, dlq_id, target_table, doc_id, chunk_index, body)
    SELECT 'withdrawn', d.id, d.target_table, d.doc_id, d.chunk_index,
           embed_dlq_event('withdrawn', d.id, d.target_table, d.doc_id, d.chunk_index, d.generation,
                           jsonb_build_object('content_hash', g.content_hash,
                                              'withdrawn_hash', g.withdrawn_hash,
                                              'by', '{by}', 'at', now()))
      FROM gone g
      JOIN embedding_dlq d ON d.target_table = $1::text AND d.doc_id = g.doc_id
                          AND d.chunk_index = g.chunk_index AND d.content_hash = g.content_hash
     ORDER BY g.doc_id, g.chunk_index
    RETURNING 1
)
SELECT count(*) FROM gone
"#
    )
}

/// Second statement of a store (rows the manifest accepted) for one table ($1 is its
/// canonical name): vector upsert, DLQ rows of the chunks resolved, `resolved` events.
pub(super) fn store_sql(table: &str) -> String {
    format!(
        r#"
WITH input AS (
    SELECT * FROM UNNEST($2::text[], $3::int[], $4::text[], $5::vector[])
        AS t(doc_id, chunk_index, content_hash, embedding)
), vectors AS (
    INSERT INTO {table} AS e (doc_id, chunk_index, content_hash, embedding)
    SELECT doc_id, chunk_index, content_hash, embedding FROM input ORDER BY doc_id, chunk_index
    ON CONFLICT (doc_id, chunk_index) DO UPDATE
        SET embedding = EXCLUDED.embedding, content_hash = EXCLUDED.content_hash, updated_at = now()
        WHERE e.content_hash IS DISTINCT FROM EXCLUDED.content_hash
    RETURNING 1
), resolved AS (
    DELETE FROM embedding_dlq d USING input i
     WHERE d.target_table = $1::text AND d.doc_id = i.doc_id AND d.chunk_index = i.chunk_index
    RETURNING d.id, d.target_table, d.doc_id, d.chunk_index, d.generation, d.error_class, d.attempts
), events AS (
    INSERT INTO dlq_outbox (event, dlq_id, target_table, doc_id, chunk_index, body)
    SELECT 'resolved', id, target_table, doc_id, chunk_index,
           embed_dlq_event('resolved', id, target_table, doc_id, chunk_index, generation,
                           jsonb_build_object('error_class', error_class, 'attempts', attempts, 'at', now()))
      FROM resolved
    RETURNING 1
)
SELECT (SELECT count(*) FROM vectors) AS vectors_written,
       (SELECT count(*) FROM resolved) AS dlq_resolved,
       (SELECT count(*) FROM events) AS events_written
"#
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_borrowed_vector_is_encoded_exactly_like_pgvector_encodes_it() {
        let values: Vec<f32> =
            (0..768).map(|i| (i as f32 - 300.0) / 7.0).chain([f32::MIN_POSITIVE, -0.0]).collect();
        let (mut ours, mut theirs) = (PgArgumentBuffer::default(), PgArgumentBuffer::default());
        assert!(matches!(
            sqlx::Encode::<Postgres>::encode_by_ref(&VectorRef(&values), &mut ours),
            Ok(IsNull::No)
        ));
        let reference = pgvector::Vector::from(values.clone());
        assert!(matches!(sqlx::Encode::<Postgres>::encode_by_ref(&reference, &mut theirs), Ok(IsNull::No)));
        assert_eq!(&ours[..], &theirs[..]);
        assert_eq!(sqlx::Encode::<Postgres>::size_hint(&VectorRef(&values)), ours.len());
    }
}
