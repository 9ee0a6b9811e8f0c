//! Postgres side of replay: scheduling due DLQ rows as replay work, loading them, and the two
//! ways a replay result is committed (both in one transaction per batch).
//!
//! Handing a row out is a narrow `replay_lease` row (migration 0013), not a rewrite of the DLQ
//! row: at most one live lease per row, at most `outstanding_max` live leases in all, and the
//! work item names its lease (`lease_no`) so an older item of the same row is skipped. A
//! replayer's load counts the attempt in the lease (`loads`) in the same statement that reads
//! the row: what could not reach Postgres was never charged. Every outcome deletes the lease.
//!
//! Every commit is fenced by the row's `generation` (a number from a sequence that changes
//! whenever the row's content changes, on every re-park and on requeue, and never goes back)
//! and by the content hash the replayer actually embedded: a result applies only while the
//! DLQ row still has both and the manifest still holds that hash. So a redelivered or stolen
//! work item applies at most once, and a replay still in flight for older content can never
//! resolve newer content or store its vector under the newer hash. The vector is stored under
//! the hash that was embedded, never the row's current one.
//!
//! The batch's commit first locks the chunks' manifest rows in key order, like ingest does, so a
//! replay commit and an ingest of the same chunk are serialised instead of deadlocking.
//!
//! The DLQ and the lease table swing between empty and a backlog, and an `ANALYZE` that finds
//! their pages but no live row (autovacuum's, after a drain) leaves the planner believing a
//! table of any size holds one row until the next one. Planned from that belief, a join of a
//! batch with either table put the table outside: every row of it walked for each batch
//! (the replay commit read 150,000 DLQ rows to replay 3,000:
//! docs/perf-notes/2026-12-04-tables-believed-empty.md). So no statement
//! here joins a batch with them without a condition on the batch's own keys first: the DLQ by
//! `id = ANY(<the batch's ids>)`, the leases deleted by `dlq_id = ANY(ARRAY(...))` (a scan
//! of one table, never a join), or each row looked up by key in a `LATERAL` subquery. The
//! worst plan left reads a batch's rows once for each row of the batch.
//!
//! The manifest meets the same belief after a mass deletion (a corpus deleted, analyzed before
//! its pages were vacuumed away, then ingested again): joined with a batch, its update walked
//! the whole manifest for each batch. Every statement here that updates manifest rows runs
//! after [`LOCK_MANIFEST_SQL`] locked them in the same transaction, so it updates them by
//! tuple id, each found by its key in a subquery of its own (a probe of the primary key), with
//! no join: nobody else can change a row this transaction holds locked, so the tuple id found
//! is the row's current version when the update reads it.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use crate::store::dlq::{LOCK_MANIFEST_SQL, locked_manifest_tids};
use crate::store::write::VectorRef;
use sqlx::{AssertSqlSafe, Row};

use crate::model::ErrorClass;
use crate::model::WorkItem;
use crate::store::{Store, StoreError};

/// A DLQ row as replay needs it.
#[derive(Debug, Clone)]
pub(crate) struct DlqRow {
    pub id: i64,
    /// Canonical name of the table the row is meant for.
    pub target_table: String,
    pub doc_id: String,
    pub chunk_index: i32,
    pub content_hash: String,
    /// The model the row was parked under (its content hash covers it); `None` for rows
    /// parked before models were recorded: replay uses the configured model.
    pub model: Option<String>,
    /// The `dimensions` request parameter the row was embedded with, if any.
    pub request_dimensions: Option<i32>,
    /// The chunk's text (the payload's `text`, read out in Postgres: the rest of the payload
    /// is not needed to replay it); empty when the payload has none.
    pub text: String,
    /// Replay passes made (drives the DLQ schedule).
    pub replays: i32,
    /// The fence of every replay commit.
    pub generation: i64,
    #[allow(dead_code, reason = "loaded with the row, read by no replay step yet")]
    pub attempts: i32,
    pub error_class: ErrorClass,
    pub error_reason: String,
    pub last_error: Option<String>,
    pub last_status: Option<i32>,
    pub exhausted: bool,
    pub last_error_signature: Option<String>,
    pub same_error_count: i32,
    /// The manifest's hash for this chunk (None: no manifest row).
    pub manifest_hash: Option<String>,
    /// Replays of this work item begun without an outcome, this load included (a row is
    /// loaded only when its item was charged).
    pub loads: i32,
}

impl DlqRow {
    /// Whether `work` is still this row's current work: same generation, same content, and
    /// the manifest still holds that content.
    pub(crate) fn is_current(&self, work: &WorkItem) -> bool {
        self.generation == work.generation
            && self.content_hash == work.content_hash
            && self.target_table == work.target_table
            && self.manifest_hash.as_deref() == Some(self.content_hash.as_str())
    }
}

/// A successful replay: the vector for row `id`, computed from the content `content_hash`
/// while the row had generation `generation`.
#[derive(Debug, Clone)]
pub(crate) struct Replayed {
    pub id: i64,
    pub target_table: String,
    /// The chunk's key, as its loaded row named it (a row's identity never changes).
    pub doc_id: String,
    pub chunk_index: i32,
    pub generation: i64,
    pub content_hash: String,
    pub embedding: Vec<f32>,
}

impl Replayed {
    /// The result for `row` (its generation and the hash of the payload that was embedded).
    pub fn of(row: &DlqRow, embedding: Vec<f32>) -> Replayed {
        Replayed {
            id: row.id,
            target_table: row.target_table.clone(),
            doc_id: row.doc_id.clone(),
            chunk_index: row.chunk_index,
            generation: row.generation,
            content_hash: row.content_hash.clone(),
            embedding,
        }
    }
}

/// Leases taken by one scheduling statement and not committed yet ([`Store::lease_due`]):
/// their work items are published, then [`Issue::commit`] makes the leases real. Dropped
/// without a commit, the leases are gone (the transaction rolls back).
pub(crate) struct Issue {
    tx: sqlx::Transaction<'static, sqlx::Postgres>,
    /// One work item per new lease, by row id.
    pub items: Vec<IssuedWork>,
}

impl Issue {
    /// Commits the leases (and releases the scheduling lock).
    pub(crate) async fn commit(self) -> Result<(), StoreError> {
        self.tx.commit().await?;
        Ok(())
    }
}

/// A work item as the scheduler publishes it: the item, and what its entry's body says
/// besides (the chunk, for the shard and for people reading the stream).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct IssuedWork {
    pub item: WorkItem,
    pub doc_id: String,
    pub chunk_index: i32,
    /// Provider attempts the row has spent so far.
    pub attempts: i32,
}

/// A failed replay pass (or a give-up) for row `id` at generation `generation` with content
/// `content_hash`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Repark {
    pub id: i64,
    pub generation: i64,
    pub content_hash: String,
    pub error_class: ErrorClass,
    pub error_reason: String,
    pub last_error: Option<String>,
    pub last_status: Option<i32>,
    /// Provider attempts spent in this pass.
    pub attempts: i32,
    /// Delay to the next pass; None: not scheduled again.
    pub retry_in: Option<Duration>,
    /// Set when automatic replay gives up: the row becomes `exhausted`.
    pub exhausted_reason: Option<String>,
    pub signature: Option<String>,
    pub same_error_count: i32,
}

impl Store {
    /// Leases up to `limit` due transient rows, oldest due first, while fewer than
    /// `outstanding_max` leases are live: each gets a lease of `lease` (a narrow
    /// `replay_lease` row), and its work item comes back to be published. The leases are not
    /// committed yet: the caller appends the items to the replay stream first and then
    /// commits ([`Issue::commit`]), so a committed lease always has its item in the stream,
    /// and a failure before the commit leaves no lease (an item already appended is replayed
    /// if it is read first, or skipped). A row whose current generation holds a live lease
    /// is skipped: its work is outstanding. One pass at a time per database (a tried advisory
    /// lock: a concurrent pass issues nothing), so processes side by side never overshoot
    /// the cap.
    ///
    /// Live leases are counted against the rows they are for (a lease left by a row that
    /// was resolved, re-parked or purged since does not count), at most `outstanding_max`
    /// index probes. Postgres ends the transaction's session if it sits idle for
    /// `idle_timeout` (a scheduler host that froze mid-publish releases the lock and the
    /// leases).
    pub(crate) async fn lease_due(
        &self,
        limit: usize,
        lease: Duration,
        outstanding_max: usize,
        idle_timeout: Duration,
    ) -> Result<Issue, StoreError> {
        let mut tx = self.pool().begin().await?;
        sqlx::query("SELECT set_config('idle_in_transaction_session_timeout', $1, true)")
            .bind(idle_timeout.as_millis().to_string())
            .execute(&mut *tx)
            .await?;
        let rows = sqlx::query(SCHEDULE_SQL)
            .bind(limit as i64)
            .bind(lease.as_secs_f64())
            .bind(outstanding_max as i64)
            // Planned with the tables as they are now: a plan cached while the DLQ was small
            // took 5 s instead of 0.8 for 20,000 due rows (the replay bench, same run).
            .persistent(false)
            .fetch_all(&mut *tx)
            .await?;
        let items = rows
            .iter()
            .map(|r| {
                Ok(IssuedWork {
                    item: WorkItem {
                        dlq_id: r.try_get("id")?,
                        generation: r.try_get("generation")?,
                        content_hash: r.try_get("content_hash")?,
                        target_table: r.try_get("target_table")?,
                        lease: Some(r.try_get("lease_no")?),
                    },
                    doc_id: r.try_get("doc_id")?,
                    chunk_index: r.try_get("chunk_index")?,
                    attempts: r.try_get("attempts")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()?;
        Ok(Issue { tx, items })
    }

    /// Ends the leases of `ids`, so the scheduler issues their work again at its next pass
    /// (within the cap) instead of when the lease runs out: used when their work items are
    /// known to be lost (the reconciler found none outstanding, Redis lost the stream).
    /// Returns the leases ended.
    pub(crate) async fn release_leases(&self, ids: &[i64]) -> Result<u64, StoreError> {
        let done = sqlx::query("DELETE FROM replay_lease WHERE dlq_id = ANY($1)")
            .bind(ids)
            .execute(self.pool())
            .await?;
        Ok(done.rows_affected())
    }

    /// The live leases whose work item lives only in Redis (every lease the scheduler issued;
    /// not an item of an older release still waiting in the outbox): `(dlq_id, target table,
    /// doc_id, chunk_index)`, at most `limit`, by id after `after_id`. What a replay stream
    /// that lost its data held.
    pub(crate) async fn published_leases(
        &self,
        after_id: i64,
        limit: usize,
    ) -> Result<Vec<(i64, String, String, i32)>, StoreError> {
        // At the position read first: work the relay publishes meanwhile still counts as
        // waiting in the outbox (the next pass finds it on the stream).
        let at = crate::relay::sql::position(self.pool()).await?;
        let rows = at
            .bind_unpublished(sqlx::query(sqlx::AssertSqlSafe(format!(
                "SELECT l.dlq_id, d.target_table, d.doc_id, d.chunk_index
                   FROM replay_lease l
                   -- By id, lease by lease (a join may hash the whole DLQ).
                   CROSS JOIN LATERAL (SELECT d.* FROM embedding_dlq d
                                        WHERE d.id = l.dlq_id AND d.generation = l.generation OFFSET 0) d
                  WHERE l.leased_until > now() AND l.dlq_id > $6
                    AND NOT EXISTS (SELECT 1 FROM dlq_outbox o
                                     WHERE o.stream = 'replay' AND o.doc_id = d.doc_id
                                       AND o.chunk_index = d.chunk_index AND o.dlq_id = d.id
                                       AND {})
                  ORDER BY l.dlq_id LIMIT $7",
                crate::relay::sql::UNPUBLISHED
            ))))?
            .bind(after_id)
            .bind(limit as i64)
            .fetch_all(self.pool())
            .await?;
        rows.iter()
            .map(|r| {
                Ok((
                    r.try_get("dlq_id")?,
                    r.try_get("target_table")?,
                    r.try_get("doc_id")?,
                    r.try_get("chunk_index")?,
                ))
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(StoreError::from)
    }

    /// Deletes leases that no longer stand for a row's current generation (the row was
    /// resolved, re-parked, purged or changed by an ingest since): their items are void, and
    /// every scheduling statement walks the live leases. Leases of current rows are kept
    /// even when expired: their `loads` is the poison-pill count of the next item.
    pub(crate) async fn sweep_stale_leases(&self) -> Result<u64, StoreError> {
        let done = sqlx::query(
            "DELETE FROM replay_lease l
              WHERE NOT EXISTS (SELECT 1 FROM embedding_dlq d
                                 WHERE d.id = l.dlq_id AND d.generation = l.generation
                                   AND d.exhausted_at IS NULL AND d.error_class = 'transient')",
        )
        .execute(self.pool())
        .await?;
        Ok(done.rows_affected())
    }

    /// Puts rows back on the schedule `delay` from now without charging them (same
    /// generation, same attempts): used when the provider refused the run, not the rows.
    /// The work item was consumed, so the lease ends with it (the reconciler must not take
    /// the pause for lost work), and so does its `loads` count.
    pub(crate) async fn postpone(
        &self,
        ids: &[i64],
        generations: &[i64],
        delay: Duration,
    ) -> Result<u64, StoreError> {
        let done: i64 = sqlx::query_scalar(
            "WITH upd AS (
                 UPDATE embedding_dlq d SET next_retry_at = now() + make_interval(secs => $3)
                   FROM UNNEST($1::bigint[], $2::bigint[]) AS i(id, generation)
                  WHERE d.id = ANY($1::bigint[]) AND d.id = i.id AND d.generation = i.generation
                    AND d.exhausted_at IS NULL
                 RETURNING d.id
             ), released AS (
                 DELETE FROM replay_lease l WHERE l.dlq_id = ANY (ARRAY(SELECT id FROM upd))
             )
             SELECT count(*) FROM upd",
        )
        .bind(ids)
        .bind(generations)
        .bind(delay.as_secs_f64())
        .fetch_one(self.pool())
        .await?;
        Ok(done as u64)
    }

    /// Loads the DLQ rows of `items` (with their manifest hash) for replay and, in the same
    /// statement, charges each item that is its row's current work: its lease's `loads` goes
    /// up by one, and once less than half of the lease is left it is extended to `lease`
    /// from now (an item whose lease was
    /// released, or that was issued before leases were numbered, takes the lease). An item
    /// of an older lease of the row, or of another generation, is not charged, and its row is
    /// not returned (its work is another item's, or the row moved on); missing rows are
    /// simply absent.
    ///
    /// Nothing is charged when the statement fails: a database that cannot be reached
    /// never counts against a row.
    pub(crate) async fn load_for_replay(
        &self,
        items: &[&WorkItem],
        lease: Duration,
    ) -> Result<Vec<DlqRow>, StoreError> {
        let ids: Vec<i64> = items.iter().map(|w| w.dlq_id).collect();
        let gens: Vec<i64> = items.iter().map(|w| w.generation).collect();
        // -1: an item from before leases were numbered.
        let leases: Vec<i64> = items.iter().map(|w| w.lease.unwrap_or(-1)).collect();
        let rows = sqlx::query(LOAD_FOR_REPLAY_SQL)
            .bind(&ids)
            .bind(&gens)
            .bind(&leases)
            .bind(lease.as_secs_f64())
            .fetch_all(self.pool())
            .await?;
        rows.into_iter()
            .map(|r| {
                Ok(DlqRow {
                    id: r.try_get("id")?,
                    target_table: r.try_get("target_table")?,
                    doc_id: r.try_get("doc_id")?,
                    chunk_index: r.try_get("chunk_index")?,
                    content_hash: r.try_get("content_hash")?,
                    model: r.try_get("model")?,
                    request_dimensions: r.try_get("request_dimensions")?,
                    text: r.try_get::<Option<String>, _>("text")?.unwrap_or_default(),
                    replays: r.try_get("replays")?,
                    generation: r.try_get("generation")?,
                    attempts: r.try_get("attempts")?,
                    error_class: r.try_get("error_class")?,
                    error_reason: r.try_get("error_reason")?,
                    last_error: r.try_get("last_error")?,
                    last_status: r.try_get("last_status")?,
                    exhausted: r.try_get("exhausted")?,
                    last_error_signature: r.try_get("last_error_signature")?,
                    same_error_count: r.try_get("same_error_count")?,
                    manifest_hash: r.try_get("manifest_hash")?,
                    loads: r.try_get("loads")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(StoreError::from)
    }

    /// Commits a replay batch's results in one transaction: the manifest rows of every row
    /// in it locked in key order (one statement, which also says what content each holds:
    /// a success whose manifest row no longer holds the replayed content is not applied),
    /// then one fenced statement per target table of the other successful replays
    /// ([`replayed_sql`]: DLQ delete fenced by generation and embedded hash, vector upsert
    /// under the embedded hash, manifest `stored`, `replayed` event), then one for the
    /// failed passes and give-ups ([`REPARK_SQL`]), then the commit. Each statement after the lock takes
    /// a new snapshot, so it sees whatever the previous holder of those locks committed.
    ///
    /// Returns the ids applied, replayed and re-parked; the others were already handled by
    /// someone else or superseded. An empty batch costs nothing.
    pub(crate) async fn commit_settled(
        &self,
        replayed: &[Replayed],
        reparked: &[Repark],
    ) -> Result<(Vec<i64>, Vec<i64>), StoreError> {
        if replayed.is_empty() && reparked.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        let mut tables: Vec<&str> = replayed.iter().map(|r| r.target_table.as_str()).collect();
        tables.sort_unstable();
        tables.dedup();
        // Resolved before the transaction: a catalog lookup (cached) holds no lock.
        let mut targets = Vec::with_capacity(tables.len());
        for table in &tables {
            targets.push(self.target_for(table).await?);
        }
        let all_ids: Vec<i64> = replayed.iter().map(|r| r.id).chain(reparked.iter().map(|r| r.id)).collect();
        let mut tx = self.pool().begin().await?;
        let locked: Vec<(i64, String)> =
            sqlx::query_as(LOCK_MANIFEST_SQL).bind(&all_ids).fetch_all(&mut *tx).await?;
        // What the manifest holds for each row, as locked: only a success whose chunk still
        // holds the replayed content goes on to its table's statement.
        let manifest_hash: HashMap<i64, String> = locked.into_iter().collect();
        let mut by_table: BTreeMap<&str, Vec<&Replayed>> = tables.iter().map(|&t| (t, Vec::new())).collect();
        for r in replayed {
            if manifest_hash.get(&r.id) == Some(&r.content_hash) {
                by_table.entry(r.target_table.as_str()).or_default().push(r);
            }
        }
        let mut applied = Vec::with_capacity(replayed.len());
        for (rows, target) in by_table.values().zip(&targets) {
            if rows.is_empty() {
                continue;
            }
            let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
            let gens: Vec<i64> = rows.iter().map(|r| r.generation).collect();
            let hashes: Vec<&str> = rows.iter().map(|r| r.content_hash.as_str()).collect();
            let vectors: Vec<VectorRef<'_>> = rows.iter().map(|r| VectorRef(&r.embedding)).collect();
            let docs: Vec<&str> = rows.iter().map(|r| r.doc_id.as_str()).collect();
            let idxs: Vec<i32> = rows.iter().map(|r| r.chunk_index).collect();
            let done: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(replayed_sql(target.sql_name())))
                .bind(&ids)
                .bind(&gens)
                .bind(&hashes)
                .bind(&vectors)
                .bind(&docs)
                .bind(&idxs)
                .fetch_all(&mut *tx)
                .await?;
            applied.extend(done);
        }
        let reparked_applied = if reparked.is_empty() {
            Vec::new()
        } else {
            let rows = reparked;
            let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
            let gens: Vec<i64> = rows.iter().map(|r| r.generation).collect();
            let hashes: Vec<&str> = rows.iter().map(|r| r.content_hash.as_str()).collect();
            let classes: Vec<&str> = rows.iter().map(|r| r.error_class.as_str()).collect();
            let reasons: Vec<&str> = rows.iter().map(|r| r.error_reason.as_str()).collect();
            let errors: Vec<Option<&str>> = rows.iter().map(|r| r.last_error.as_deref()).collect();
            let statuses: Vec<Option<i32>> = rows.iter().map(|r| r.last_status).collect();
            let attempts: Vec<i32> = rows.iter().map(|r| r.attempts).collect();
            let retry_in: Vec<Option<f64>> =
                rows.iter().map(|r| r.retry_in.map(|d| d.as_secs_f64())).collect();
            let exhausted: Vec<Option<&str>> = rows.iter().map(|r| r.exhausted_reason.as_deref()).collect();
            let sigs: Vec<Option<&str>> = rows.iter().map(|r| r.signature.as_deref()).collect();
            let same: Vec<i32> = rows.iter().map(|r| r.same_error_count).collect();
            sqlx::query_scalar(REPARK_SQL)
                .bind(&ids)
                .bind(&gens)
                .bind(&classes)
                .bind(&reasons)
                .bind(&errors)
                .bind(&statuses)
                .bind(&attempts)
                .bind(&retry_in)
                .bind(&exhausted)
                .bind(&sigs)
                .bind(&same)
                .bind(&hashes)
                .fetch_all(&mut *tx)
                .await?
        };
        tx.commit().await?;
        Ok((applied, reparked_applied))
    }
}

/// The re-park statement of [`Store::commit_settled`]: DLQ row updated (attempts, a new generation,
/// schedule or exhaustion, error history) when it still has the generation and content the
/// pass was for, manifest `parked`/`exhausted`, `reparked` or `exhausted` event. Binds the
/// columns of the rows, `$1..=$12`.
const REPARK_SQL: &str = "WITH input AS (
         SELECT * FROM UNNEST($1::bigint[], $2::bigint[], $3::text[], $4::text[], $5::text[],
                              $6::int[], $7::int[], $8::float8[], $9::text[], $10::text[], $11::int[],
                              $12::text[])
             AS t(id, generation, error_class, error_reason, last_error, last_status, attempts,
                  retry_in, exhausted_reason, signature, same_count, content_hash)
     ), upd AS (
         UPDATE embedding_dlq d SET
                attempts = d.attempts + i.attempts,
                replays = d.replays + 1,
                generation = nextval('embed_dlq_generation_seq'),
                error_class = i.error_class,
                error_reason = i.error_reason,
                last_error = i.last_error,
                last_status = i.last_status,
                last_failed_at = now(),
                next_retry_at = CASE WHEN i.retry_in IS NULL THEN NULL
                                     ELSE now() + make_interval(secs => i.retry_in) END,
                exhausted_at = CASE WHEN i.exhausted_reason IS NULL THEN NULL ELSE now() END,
                exhausted_reason = i.exhausted_reason,
                last_error_signature = i.signature,
                same_error_count = i.same_count,
                error_history = jsonb_path_query_array(
                    d.error_history || jsonb_build_array(jsonb_build_object(
                        'at', now(), 'pass', 'replay ' || (d.replays + 1), 'error_class', i.error_class,
                        'error_reason', i.error_reason, 'status', i.last_status,
                        'attempts', i.attempts, 'error', i.last_error,
                        'exhausted_reason', i.exhausted_reason)),
                    '$[last-19 to last]')
           FROM input i
          WHERE d.id = ANY($1::bigint[]) AND d.id = i.id AND d.generation = i.generation
            AND d.content_hash = i.content_hash AND d.exhausted_at IS NULL
         RETURNING d.id, d.target_table, d.doc_id, d.chunk_index, d.content_hash, d.generation,
                   d.error_class, d.error_reason, d.attempts, d.replays, d.next_retry_at,
                   d.exhausted_reason,
                   CASE WHEN d.exhausted_reason IS NULL THEN 'parked' ELSE 'exhausted' END AS status
     ), found AS (
         -- Each row's manifest row by its key (module doc: the manifest believed empty).
         SELECT (SELECT k.ctid FROM ingest_manifest k
                  WHERE k.target_table = u.target_table AND k.doc_id = u.doc_id
                    AND k.chunk_index = u.chunk_index AND k.content_hash = u.content_hash
                    AND k.status <> u.status) AS tid,
                u.status
           FROM upd u
     ), manifest AS (
         UPDATE ingest_manifest m
            SET status = CASE WHEN m.ctid = ANY (ARRAY(SELECT tid FROM found WHERE status = 'exhausted'))
                              THEN 'exhausted' ELSE 'parked' END,
                updated_at = now()
          WHERE m.ctid = ANY (ARRAY(SELECT tid FROM found))
         RETURNING 1
     ), released AS (
         DELETE FROM replay_lease l WHERE l.dlq_id = ANY (ARRAY(SELECT id FROM upd))
     ), events AS (
         INSERT INTO dlq_outbox (event, dlq_id, target_table, doc_id, chunk_index, body)
         SELECT CASE WHEN status = 'parked' THEN 'reparked' ELSE 'exhausted' END,
                id, target_table, doc_id, chunk_index,
                embed_dlq_event(CASE WHEN status = 'parked' THEN 'reparked' ELSE 'exhausted' END,
                                id, target_table, doc_id, chunk_index, generation,
                                jsonb_build_object('error_class', error_class, 'error_reason', error_reason,
                                                   'attempts', attempts, 'replays', replays,
                                                   'next_retry_at', next_retry_at,
                                                   'exhausted_reason', exhausted_reason, 'at', now()))
           FROM upd
         RETURNING 1
     )
     SELECT id FROM upd";

/// The replay statement of [`Store::commit_settled`] for one target table (its quoted name): DLQ
/// delete fenced by generation and embedded hash (the caller passes only rows whose manifest
/// row, locked by [`LOCK_MANIFEST_SQL`], holds that hash), vector upsert under the embedded
/// hash (a no-op for unchanged content), manifest `stored`, `replayed` event. Binds the
/// rows' ids, generations, embedded hashes, vectors, doc ids and chunk indexes `$1..=$6`; the
/// caller passes only rows whose loaded version named `table`.
fn replayed_sql(table: &str) -> String {
    let tids = locked_manifest_tids("claimed", "");
    format!(
        "WITH claimed AS (
             -- The batch's rows by key before the join (module doc: believed empty), and by
             -- key alone: no other indexed column is compared (the row's table, in the
             -- identity key, is the one its loaded version named). The join carries no vector:
             -- if the planner re-reads the batch for each row, it re-reads ids and hashes.
             DELETE FROM embedding_dlq d
              USING UNNEST($1::bigint[], $2::bigint[], $3::text[]) AS i(id, generation, content_hash)
              WHERE d.id = ANY($1::bigint[]) AND d.id = i.id AND d.generation = i.generation
                AND d.content_hash = i.content_hash AND d.exhausted_at IS NULL
             RETURNING d.id, d.target_table, d.doc_id, d.chunk_index, i.content_hash, d.attempts,
                       d.replays, d.generation, d.error_class
         ), vectors AS (
             -- The vectors of the rows claimed, by a filter on the batch (never a join): the
             -- chunk's key as its loaded row named it, the vector under the embedded hash;
             -- once a chunk, like the rows `claimed` returns.
             INSERT INTO {table} AS e (doc_id, chunk_index, content_hash, embedding)
             SELECT DISTINCT ON (v.doc_id, v.chunk_index) v.doc_id, v.chunk_index, v.content_hash, v.embedding
               FROM UNNEST($1::bigint[], $5::text[], $6::int[], $3::text[], $4::vector[])
                    AS v(id, doc_id, chunk_index, content_hash, embedding)
              WHERE v.id = ANY (ARRAY(SELECT id FROM claimed))
              ORDER BY v.doc_id, v.chunk_index
             ON CONFLICT (doc_id, chunk_index) DO UPDATE
                 SET embedding = EXCLUDED.embedding, content_hash = EXCLUDED.content_hash,
                     updated_at = now()
                 WHERE e.content_hash IS DISTINCT FROM EXCLUDED.content_hash
             RETURNING 1
         ), manifest AS (
             -- By tuple id, each found by its key (module doc: the manifest believed empty).
             UPDATE ingest_manifest m SET status = 'stored', updated_at = now()
              WHERE m.ctid = ANY ({tids})
             RETURNING 1
         ), released AS (
             DELETE FROM replay_lease l WHERE l.dlq_id = ANY (ARRAY(SELECT id FROM claimed))
         ), events AS (
             INSERT INTO dlq_outbox (event, dlq_id, target_table, doc_id, chunk_index, body)
             SELECT 'replayed', id, target_table, doc_id, chunk_index,
                    embed_dlq_event('replayed', id, target_table, doc_id, chunk_index, generation,
                                    jsonb_build_object('error_class', error_class, 'attempts', attempts,
                                                       'replays', replays + 1, 'at', now()))
               FROM claimed
             RETURNING 1
         )
         SELECT id FROM claimed",
    )
}

/// The scheduler's statement ([`Store::lease_due`]): `$1` most rows, `$2` lease seconds,
/// `$3` most live leases. `room`: how many more leases fit under the cap, 0 while another
/// pass holds the lock. `due`: oldest due first, in the order of `embedding_dlq_ready_idx`,
/// skipping rows whose current generation holds a live lease (at most the cap of them).
/// `leased`: a new lease per row (an expired lease of the same generation keeps its
/// `loads`: the poison-pill count survives a lost item); then each lease's work item, read
/// from its row by id.
const SCHEDULE_SQL: &str = "WITH room AS MATERIALIZED (
         SELECT CASE WHEN pg_try_advisory_xact_lock(embed_dlq_schedule_lock_key())
                     THEN GREATEST(LEAST($1::bigint, $3::bigint - (
                              SELECT count(*) FROM replay_lease l
                               WHERE l.leased_until > now()
                                 -- Looked up by id, lease by lease: as a join the planner
                                 -- hashed the whole DLQ.
                                 AND (SELECT d.generation FROM embedding_dlq d
                                       WHERE d.id = l.dlq_id AND d.exhausted_at IS NULL) = l.generation)), 0)
                     ELSE 0 END AS n
     ), due AS (
         SELECT d.id, d.generation, d.target_table, d.doc_id, d.chunk_index, d.content_hash,
                d.attempts
           FROM embedding_dlq d
          WHERE d.next_retry_at <= now() AND d.error_class = 'transient' AND d.exhausted_at IS NULL
            -- The row's own lease, read by its key: written as a `NOT EXISTS` with
            -- `leased_until > now()`, the planner (whose statistics of `leased_until` age
            -- into the past within a lease length of any analyze, so it expects no live
            -- lease) walked every live lease for every due row: 9.7 s instead of 0.08.
            AND NOT COALESCE((SELECT l.generation = d.generation AND l.leased_until > now()
                                FROM replay_lease l WHERE l.dlq_id = d.id), false)
          ORDER BY d.next_retry_at
          LIMIT (SELECT n FROM room)
     ), leased AS (
         INSERT INTO replay_lease AS l (dlq_id, generation, leased_until)
         SELECT id, generation, now() + make_interval(secs => $2::float8) FROM due ORDER BY id
         ON CONFLICT (dlq_id) DO UPDATE
            SET generation = EXCLUDED.generation, lease_no = nextval('embed_dlq_lease_seq'),
                leased_at = now(), leased_until = EXCLUDED.leased_until,
                loads = CASE WHEN l.generation = EXCLUDED.generation THEN l.loads ELSE 0 END
          WHERE l.leased_until <= now() OR l.generation <> EXCLUDED.generation
         RETURNING l.dlq_id, l.lease_no
     )
     SELECT upd.id, upd.generation, upd.target_table, upd.doc_id, upd.chunk_index, upd.content_hash,
            upd.attempts, leased.lease_no
       FROM leased
       -- By id, lease by lease: a join of the two CTEs (no statistics) was planned as a
       -- nested loop, 5,000 x 5,000 comparisons, 2-3 s a statement (the replay bench).
       CROSS JOIN LATERAL (SELECT d.id, d.generation, d.target_table, d.doc_id, d.chunk_index,
                                  d.content_hash, d.attempts
                             FROM embedding_dlq d WHERE d.id = leased.dlq_id OFFSET 0) upd
      ORDER BY upd.id";

/// The replayer's load ([`Store::load_for_replay`]): `$1..$3` the items' row ids,
/// generations and lease numbers (-1: an item from before leases were numbered), `$4` lease
/// seconds. `current`: items of their row's current generation. `charged`: the lease of
/// each such row gets one more load (and a full lease again once less than half of it is
/// left), when the item is the lease's (same
/// number), or from before numbered leases, or the lease is gone or stale (the item takes
/// it over); an item of an older lease of the row is not charged. Only the rows of charged
/// items are returned.
const LOAD_FOR_REPLAY_SQL: &str = "WITH input AS (
         SELECT * FROM UNNEST($1::bigint[], $2::bigint[], $3::bigint[]) AS t(id, generation, lease_no)
     ), current AS (
         SELECT DISTINCT ON (i.id) i.id, i.generation, i.lease_no
           FROM input i
          -- By id, item by item (a join may hash the whole DLQ).
          WHERE (SELECT d.generation FROM embedding_dlq d
                  WHERE d.id = i.id AND d.exhausted_at IS NULL AND d.error_class = 'transient')
                = i.generation
          ORDER BY i.id, i.lease_no DESC
     ), charged AS (
         INSERT INTO replay_lease AS l (dlq_id, generation, lease_no, leased_until, loads)
         SELECT id, generation, lease_no, now() + make_interval(secs => $4::float8), 1
           FROM current ORDER BY id
         ON CONFLICT (dlq_id) DO UPDATE
            SET loads = CASE WHEN l.generation = EXCLUDED.generation THEN l.loads + 1 ELSE 1 END,
                lease_no = CASE WHEN l.generation = EXCLUDED.generation THEN l.lease_no
                                ELSE EXCLUDED.lease_no END,
                generation = EXCLUDED.generation,
                -- Extended only when less than half of it is left: otherwise the charge
                -- changes `loads` alone and is a heap-only update (migration 0021).
                leased_until = CASE WHEN l.leased_until < now() + make_interval(secs => $4::float8 / 2)
                                    THEN GREATEST(l.leased_until, EXCLUDED.leased_until)
                                    ELSE l.leased_until END
          WHERE l.generation <> EXCLUDED.generation OR EXCLUDED.lease_no IN (-1, l.lease_no)
         RETURNING l.dlq_id, l.loads
     )
     SELECT d.id, d.target_table, d.doc_id, d.chunk_index, d.content_hash, d.model,
            d.request_dimensions, d.payload->>'text' AS text, d.replays, d.generation, d.attempts,
            d.error_class, d.error_reason, d.last_error, d.last_status,
            d.exhausted_at IS NOT NULL AS exhausted, d.last_error_signature,
            d.same_error_count,
            -- By key, row by row: as a join the planner hashed the whole manifest.
            (SELECT m.content_hash FROM ingest_manifest m
              WHERE m.target_table = d.target_table AND m.doc_id = d.doc_id
                AND m.chunk_index = d.chunk_index) AS manifest_hash,
            c.loads
       FROM charged c
       -- Row by row, by id: joined to the DLQ on `d.id = c.dlq_id`, the planner (which
       -- expects one charged row) compared every row with every charged row, 256 x 256 for
       -- a full batch, half of the statement's time (EXPLAIN ANALYZE,
       -- docs/perf-notes/2026-12-03-replay-items-straight-to-the-stream.md).
       CROSS JOIN LATERAL (SELECT * FROM embedding_dlq d WHERE d.id = c.dlq_id OFFSET 0) d";
