//! Parking: a chunk that cannot be embedded becomes a DLQ row, its `parked` event in the
//! outbox and its manifest state, in one transaction with the manifest claim
//! ([`Store::park_batch`]); under [`OnNewerParked::Withdraw`] the same transaction withdraws
//! the vector of the chunk's previous text. Ingest's writers, the stream source and the
//! reconciler's superseded-vector repair (`withdraw_sql`) write through here; replay's
//! re-park of a row it already holds is `crate::replay::sql`.

use std::time::Duration;

use sqlx::AssertSqlSafe;

use super::write::ManifestRecord;
use crate::model::{ChunkStatus, ErrorClass};
use crate::store::{Store, StoreError};

/// A chunk to park in the DLQ.
#[derive(Debug, Clone)]
pub struct ParkedChunk {
    /// Identity of the chunk (with `chunk_index`).
    pub doc_id: String,
    /// Position of the chunk within its document.
    pub chunk_index: i32,
    /// The content parked; replay only writes a vector if the manifest still holds this hash.
    pub content_hash: String,
    /// The text's own hash ([`crate::model::TextHash::of`]; of the raw line's hash for a
    /// record that could not be parsed).
    pub text_hash: crate::model::TextHash,
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
    /// Position of the record in the ingest history ([`crate::store::position`]).
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

impl ManifestRecord for ParkedChunk {
    fn manifest_key(&self) -> (&str, i32, &str, i64, &[u8]) {
        (&self.doc_id, self.chunk_index, &self.content_hash, self.source_seq, self.text_hash.as_bytes())
    }
    /// Parks are rare on a clean run: they always look for a lease to finish.
    fn may_hold_lease(&self) -> bool {
        true
    }
}

impl Store {
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
pub(crate) fn park_withdraw_sql(table: &str) -> String {
    withdraw_sql(table, PARKED_KEYS, "ingest")
}

/// Deletes the vectors of `table` (canonical name) for the chunks `keys` selects (a query
/// giving doc_id, chunk_index and the chunk's current content_hash) that hold other content,
/// and announces each with a `withdrawn` event carrying the chunk's DLQ row (the one holding its
/// current content), the withdrawn hash and `by` (a constant: `ingest` or `reconcile`).
/// Returns one row: how many vectors were deleted. The caller holds the chunks' manifest rows
/// locked (every writer locks the manifest first).
pub(crate) fn withdraw_sql(table: &str, keys: &str, by: &str) -> String {
    format!(
        r#"
WITH k AS ({keys}
), gone AS (
    -- By tuple id, each vector found by its key: joined with the batch, a vector table the
    -- planner believed empty (emptied by deletes and analyzed, then filled again) was walked
    -- for each batch. The chunks' manifest rows are locked, and every writer of a vector
    -- takes them first, so nobody changes one of these vectors before the delete reads it.
    DELETE FROM {table} e
     WHERE e.ctid = ANY (ARRAY(
               SELECT (SELECT v.ctid FROM {table} v
                        WHERE v.doc_id = k.doc_id AND v.chunk_index = k.chunk_index
                          AND v.content_hash <> k.content_hash)
                 FROM k))
    RETURNING e.doc_id, e.chunk_index, e.content_hash AS withdrawn_hash
), kept AS (
    -- The content each chunk keeps, once a chunk (batch-sized, no table).
    SELECT DISTINCT ON (doc_id, chunk_index) doc_id, chunk_index, content_hash
      FROM k ORDER BY doc_id, chunk_index, content_hash
), events AS (
    INSERT INTO dlq_outbox (event, dlq_id, target_table, doc_id, chunk_index, body)
    SELECT 'withdrawn', d.id, d.target_table, d.doc_id, d.chunk_index,
           embed_dlq_event('withdrawn', d.id, d.target_table, d.doc_id, d.chunk_index, d.generation,
                           jsonb_build_object('content_hash', g.content_hash,
                                              'withdrawn_hash', g.withdrawn_hash,
                                              'by', '{by}', 'at', now()))
      FROM (SELECT g.doc_id, g.chunk_index, g.withdrawn_hash, kept.content_hash
              FROM gone g JOIN kept USING (doc_id, chunk_index)) g
      -- By key, chunk by chunk: the DLQ may be believed empty (`DLQ_ID_OF_CHUNK`), and a join
      -- would then walk it for each batch.
      CROSS JOIN LATERAL (SELECT d.* FROM embedding_dlq d
                           WHERE d.target_table = $1::text AND d.doc_id = g.doc_id
                             AND d.chunk_index = g.chunk_index AND d.content_hash = g.content_hash
                          OFFSET 0) d
     ORDER BY g.doc_id, g.chunk_index
    RETURNING 1
)
SELECT count(*) FROM gone
"#
    )
}
