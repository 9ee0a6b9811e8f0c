//! The fenced writes of vectors: the manifest claim every outcome starts with (it also marks
//! the run's leases of those chunks finished) and [`Store::store_batch`], the store of
//! vectors, which ingest's writers run and whose vector encoding replay's commit shares. The
//! other outcome, a park, is [`super::park`]; the intake window's lookup is
//! `crate::ingest::lease`.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;
use sqlx::postgres::{PgArgumentBuffer, PgHasArrayType, PgTypeInfo};
use sqlx::{AssertSqlSafe, Postgres, Row};

use super::dlq::DLQ_ID_OF_CHUNK;
use crate::model::ChunkStatus;
use crate::store::{Store, StoreError};

/// A chunk whose vector is ready to store.
#[derive(Debug, Clone)]
pub(crate) struct StoredChunk {
    pub doc_id: String,
    pub chunk_index: i32,
    pub content_hash: String,
    /// The text's own hash ([`crate::model::TextHash`]).
    pub text_hash: crate::model::TextHash,
    pub embedding: Vec<f32>,
    /// Position of the record in the ingest history ([`crate::store::position`]): an outcome for an older
    /// position than the manifest holds is rejected as superseded.
    pub source_seq: i64,
    /// The run claimed the chunk's lease (`lease.rs`), so the store marks it finished. A
    /// batch where no row holds one skips the lease update (a run alone, past its first
    /// windows); a lease left unmarked would only defer a concurrent run until this run ends.
    pub leased: bool,
    /// The window's lookup found no manifest row for the chunk (and the run met it only
    /// once): a batch of such chunks is first written with plain inserts
    /// ([`Store::store_batch`]), which cost Postgres half of what the upserts do.
    pub new_chunk: bool,
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

/// The columns of stored chunks as both store statements bind them.
struct StoreColumns<'a> {
    docs: Vec<&'a str>,
    idxs: Vec<i32>,
    hashes: Vec<&'a str>,
    vectors: Vec<VectorRef<'a>>,
}

impl<'a> StoreColumns<'a> {
    fn of(rows: impl ExactSizeIterator<Item = &'a StoredChunk> + Clone) -> Self {
        StoreColumns {
            docs: rows.clone().map(|r| r.doc_id.as_str()).collect(),
            idxs: rows.clone().map(|r| r.chunk_index).collect(),
            hashes: rows.clone().map(|r| r.content_hash.as_str()).collect(),
            vectors: rows.map(|r| VectorRef(&r.embedding)).collect(),
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

/// A row an ingest writes, as its manifest claim sees it: (doc_id, chunk_index, content
/// hash, position ([`crate::store::position`]), text hash).
pub(crate) trait ManifestRecord {
    fn manifest_key(&self) -> (&str, i32, &str, i64, &[u8]);
    /// Whether the run may hold a lease of the chunk that its outcome must mark finished.
    fn may_hold_lease(&self) -> bool;
}

impl ManifestRecord for StoredChunk {
    fn manifest_key(&self) -> (&str, i32, &str, i64, &[u8]) {
        (&self.doc_id, self.chunk_index, &self.content_hash, self.source_seq, self.text_hash.as_bytes())
    }
    fn may_hold_lease(&self) -> bool {
        self.leased
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
    pub(crate) async fn begin_claimed<'r, R: ManifestRecord>(
        &self,
        rows: &'r [R],
        status: ChunkStatus,
    ) -> Result<(sqlx::Transaction<'static, sqlx::Postgres>, Vec<&'r R>, Vec<usize>), StoreError> {
        let mut tx = self.begin_write().await?;
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

    /// Opens the transaction of a store or park: before its first statement's snapshot, a
    /// deletion of this table in progress finishes first, so that statement sees its
    /// tombstones (`store/delete.rs`).
    async fn begin_write(&self) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, StoreError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(crate::store::delete::WRITE_LOCK_SQL).bind(&self.target.name).execute(&mut *tx).await?;
        Ok(tx)
    }

    /// Upserts the manifest rows of a batch (first statement of a store or park transaction)
    /// and returns the positions of the rows it accepted. Taking the row locks here, before
    /// anything else, serialises racing writers of one chunk, and the statements after it see
    /// whatever the previous holder committed. Without `leases` (no row of the batch may hold
    /// one) the statement leaves the lease table alone.
    async fn claim_manifest<'k>(
        &self,
        tx: &mut sqlx::PgConnection,
        keys: impl Iterator<Item = (&'k str, i32, &'k str, i64, &'k [u8])>,
        status: ChunkStatus,
        leases: bool,
    ) -> Result<Vec<bool>, StoreError> {
        let (mut docs, mut idxs, mut hashes, mut seqs, mut texts) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (d, i, h, s, t) in keys {
            docs.push(d);
            idxs.push(i);
            hashes.push(h);
            seqs.push(s);
            texts.push(t);
        }
        let accepted = sqlx::query(if leases { MANIFEST_SQL } else { MANIFEST_NO_LEASE_SQL })
            .bind(&self.target.name)
            .bind(&docs)
            .bind(&idxs)
            .bind(&hashes)
            .bind(&seqs)
            .bind(status.as_str())
            .bind(&texts)
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
            // A park of content already stored only moved the row's position: not accepted.
            if status == ChunkStatus::Parked
                && r.try_get::<&str, _>("status")? == ChunkStatus::Stored.as_str()
            {
                continue;
            }
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
    ///
    /// A batch of new chunks holding no lease ([`StoredChunk::new_chunk`], a fresh corpus)
    /// is first written by plain inserts ([`Store::store_new`]); where one of its rows turns
    /// out not to be new (a concurrent writer, a deletion's tombstone, a vector without a
    /// manifest row) that transaction is rolled back and the upserts below decide, and the
    /// next [`NEW_CHUNK_PAUSE`] batches go straight to them.
    pub(crate) async fn store_batch(&self, rows: &[StoredChunk]) -> Result<StoreCounts, StoreError> {
        if rows.is_empty() {
            return Ok(StoreCounts::default());
        }
        if rows.iter().all(|r| r.new_chunk && !r.leased) && self.new_chunk_inserts_allowed() {
            match self.store_new(rows).await {
                Ok(Some(counts)) => return Ok(counts),
                Ok(None) => {}
                Err(StoreError::Db(e)) if is_not_new(&e) => {}
                Err(e) => return Err(e),
            }
            self.new_chunk_pause.store(NEW_CHUNK_PAUSE, Ordering::Relaxed);
            tracing::debug!(
                rows = rows.len(),
                "a batch of new chunks met a row that was not new: upserting it"
            );
        }
        let (mut tx, keep, superseded) = self.begin_claimed(rows, ChunkStatus::Stored).await?;
        let mut counts = StoreCounts { superseded: superseded.len() as u64, ..Default::default() };
        if !keep.is_empty() {
            let c = StoreColumns::of(keep.iter().copied());
            let row = sqlx::query(AssertSqlSafe(self.target.store_sql.as_str()))
                .bind(&self.target.name)
                .bind(&c.docs)
                .bind(&c.idxs)
                .bind(&c.hashes)
                .bind(&c.vectors)
                .fetch_one(&mut *tx)
                .await?;
            counts.vectors_written = row.try_get::<i64, _>("vectors_written")? as u64;
            counts.dlq_resolved = row.try_get::<i64, _>("dlq_resolved")? as u64;
        }
        tx.commit().await?;
        Ok(counts)
    }

    /// Whether this batch may try [`Store::store_new`]: not within [`NEW_CHUNK_PAUSE`]
    /// batches of one that found a row not new.
    fn new_chunk_inserts_allowed(&self) -> bool {
        self.new_chunk_pause
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |left| left.checked_sub(1))
            .is_err()
    }

    /// [`Store::store_batch`] of chunks the manifest had no row for, by plain inserts in one
    /// statement ([`new_store_sql`]): the manifest rows first (taking their keys in key
    /// order, as every writer does), then the vectors, the DLQ resolve as usual. `None` (the
    /// transaction rolled back) when a row was not inserted because a deletion's tombstone is
    /// newer; an insert that meets an existing row fails with a unique violation
    /// ([`is_not_new`]). Either way the caller writes the batch again through the upserts.
    pub(crate) async fn store_new(&self, rows: &[StoredChunk]) -> Result<Option<StoreCounts>, StoreError> {
        let mut tx = self.begin_write().await?;
        let c = StoreColumns::of(rows.iter());
        let seqs: Vec<i64> = rows.iter().map(|r| r.source_seq).collect();
        let texts: Vec<&[u8]> = rows.iter().map(|r| r.text_hash.as_bytes()).collect();
        let row = sqlx::query(AssertSqlSafe(self.target.new_store_sql.as_str()))
            .bind(&self.target.name)
            .bind(&c.docs)
            .bind(&c.idxs)
            .bind(&c.hashes)
            .bind(&seqs)
            .bind(&c.vectors)
            .bind(&texts)
            // Planned with the tombstones as they are now (as the manifest claim is).
            .persistent(false)
            .fetch_one(&mut *tx)
            .await?;
        if row.try_get::<i64, _>("claimed")? != rows.len() as i64 {
            tx.rollback().await?;
            return Ok(None);
        }
        // Every vector was inserted (a plain insert writes each row or fails the statement).
        let counts = StoreCounts {
            vectors_written: rows.len() as u64,
            dlq_resolved: row.try_get::<i64, _>("dlq_resolved")? as u64,
            superseded: 0,
        };
        tx.commit().await?;
        Ok(Some(counts))
    }
}

/// Batches that go straight to the upserts after a [`Store::store_new`] met a row that was
/// not new: a corpus that overlaps what the tables hold (or a concurrent run) pays for the
/// failed attempt once in this many batches, not every time.
pub(crate) const NEW_CHUNK_PAUSE: u32 = 64;

/// Whether `e` is what a plain insert of [`Store::store_new`] raises for a row that exists
/// (unique violation), or Postgres's way out of two writers that met (deadlock): the batch
/// goes to the upserts, which decide.
fn is_not_new(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().is_some_and(|c| c == "23505" || c == "40P01"))
}

// The parts of the manifest claim shared by its two forms below.
macro_rules! manifest_input {
    () => {
        r#"
WITH input AS (
    SELECT * FROM UNNEST($2::text[], $3::int[], $4::text[], $5::bigint[], $7::bytea[])
        AS t(doc_id, chunk_index, content_hash, source_seq, text_hash)
)
"#
    };
}

/// The condition every manifest write of a record (alias `i`, `$1` the table) is under: no
/// deletion of its chunk or document (`ingest_tombstone`, `store/delete.rs`) newer than it.
macro_rules! no_newer_tombstone {
    () => {
        r#"WHERE NOT EXISTS (SELECT 1 FROM ingest_tombstone t
                    WHERE t.target_table = $1::text AND t.doc_id = i.doc_id
                      AND t.chunk_index IN (i.chunk_index, -1) AND t.source_seq > i.source_seq)"#
    };
}

/// The `no_newer_tombstone!` condition, for the statements built at run time.
const NO_NEWER_TOMBSTONE: &str = no_newer_tombstone!();

macro_rules! manifest_upsert {
    () => {
        concat!(
            r#"INSERT INTO ingest_manifest AS m (target_table, doc_id, chunk_index, content_hash, status, source_seq, text_hash)
SELECT $1::text, doc_id, chunk_index, content_hash, $6::text, source_seq, text_hash
  FROM input i
 "#,
            no_newer_tombstone!(),
            r#"
 ORDER BY doc_id, chunk_index
ON CONFLICT (target_table, doc_id, chunk_index) DO UPDATE SET
    status       = CASE WHEN m.content_hash = EXCLUDED.content_hash AND m.status IN ('exhausted', 'stored')
                             AND EXCLUDED.status = 'parked'
                        THEN m.status ELSE EXCLUDED.status END,
    updated_at   = CASE WHEN m.content_hash = EXCLUDED.content_hash
                             AND (m.status = EXCLUDED.status
                                  OR (m.status IN ('exhausted', 'stored') AND EXCLUDED.status = 'parked'))
                        THEN m.updated_at ELSE now() END,
    content_hash = EXCLUDED.content_hash,
    source_seq   = EXCLUDED.source_seq,
    text_hash    = EXCLUDED.text_hash
  WHERE m.source_seq <= EXCLUDED.source_seq
RETURNING m.doc_id, m.chunk_index, m.status
"#
        )
    };
}

/// First statement of a store or park: the manifest upsert, accepted only for a record at
/// least as new as the one the manifest holds ($6 is the new status) and newer than any
/// deletion of its chunk or document (`ingest_tombstone`, see `store/delete.rs`). A park of
/// content that is already stored is not accepted either, but its row still takes the park's
/// position (status and `updated_at` unchanged, returned as `stored`): the record is the
/// chunk's newest, and an older record of other content still in flight (a draft a dead
/// stream consumer held) must lose to it (issue 44). Keys are locked in key order (no
/// deadlock between writers whose batches overlap). Returns the keys written, with the status
/// each row holds.
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

/// The `resolved` event of every DLQ row a store's `resolved` CTE deleted (the outbox rows
/// the relay publishes), shared by both store statements.
const RESOLVED_EVENTS: &str = r#"events AS (
    INSERT INTO dlq_outbox (event, dlq_id, target_table, doc_id, chunk_index, body)
    SELECT 'resolved', id, target_table, doc_id, chunk_index,
           embed_dlq_event('resolved', id, target_table, doc_id, chunk_index, generation,
                           jsonb_build_object('error_class', error_class, 'attempts', attempts, 'at', now()))
      FROM resolved
    RETURNING 1
)"#;

/// Second statement of a store (rows the manifest accepted) for one table ($1 is its
/// canonical name): vector upsert, DLQ rows of the chunks resolved, `resolved` events.
pub(crate) fn store_sql(table: &str) -> String {
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
    DELETE FROM embedding_dlq d
     WHERE d.id = ANY (ARRAY(SELECT {DLQ_ID_OF_CHUNK} FROM input i))
    RETURNING d.id, d.target_table, d.doc_id, d.chunk_index, d.generation, d.error_class, d.attempts
), {RESOLVED_EVENTS}
SELECT (SELECT count(*) FROM vectors) AS vectors_written,
       (SELECT count(*) FROM resolved) AS dlq_resolved,
       (SELECT count(*) FROM events) AS events_written
"#
    )
}

/// The one statement of [`Store::store_new`] for one table ($1 is its canonical name): plain
/// inserts of the manifest rows (status `stored`, none where a deletion's tombstone is newer:
/// `claimed` counts those written) and, only once all of them are in (the scalar subquery
/// runs the manifest insert to its end first), of the vectors; then the DLQ resolve and its
/// events as in [`store_sql`]. Each part reads the arrays it needs itself: the vectors are
/// never copied into a shared row set or sorted (the manifest insert already took the keys in
/// key order; a writer of any of them meets those rows first).
pub(crate) fn new_store_sql(table: &str) -> String {
    format!(
        r#"
WITH claimed AS (
    INSERT INTO ingest_manifest (target_table, doc_id, chunk_index, content_hash, status, source_seq, text_hash)
    SELECT $1::text, doc_id, chunk_index, content_hash, 'stored', source_seq, text_hash
      FROM UNNEST($2::text[], $3::int[], $4::text[], $5::bigint[], $7::bytea[])
           AS i(doc_id, chunk_index, content_hash, source_seq, text_hash)
     {NO_NEWER_TOMBSTONE}
     ORDER BY doc_id, chunk_index
    RETURNING 1
), vectors AS (
    INSERT INTO {table} (doc_id, chunk_index, content_hash, embedding)
    SELECT * FROM UNNEST($2::text[], $3::int[], $4::text[], $6::vector[])
     WHERE (SELECT count(*) FROM claimed) = cardinality($2::text[])
), resolved AS (
    DELETE FROM embedding_dlq d
     WHERE d.id = ANY (ARRAY(SELECT {DLQ_ID_OF_CHUNK}
                               FROM UNNEST($2::text[], $3::int[]) AS i(doc_id, chunk_index)))
       AND (SELECT count(*) FROM claimed) = cardinality($2::text[])
    RETURNING d.id, d.target_table, d.doc_id, d.chunk_index, d.generation, d.error_class, d.attempts
), {RESOLVED_EVENTS}
SELECT (SELECT count(*) FROM claimed) AS claimed,
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
