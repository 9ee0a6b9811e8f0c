//! A Postgres table as the input of ingest: `ingest --from-table NAME`, after `source
//! add-table` registered it (docs/table-source.md).
//!
//! ```text
//! user's transaction ──trigger──> embed_table_changes (keys) ──follower──> read the rows now
//!                                                                   └──> pipeline run (chunks, deletes)
//!                                         delete the changes <── every record settled
//! ```
//!
//! - **Snapshot first.** A source not yet snapshotted (just added, or truncated since) is
//!   read whole in key order, page by page, as one pipeline run; only when every row of it
//!   settled is it marked done. Changes queued meanwhile are applied after it, reading the
//!   rows again: no gap, and a row the snapshot already read at its newest is skipped as
//!   unchanged, with no provider call.
//! - **Changes in segments.** Up to `segment_changes` queued changes are collapsed by key,
//!   their rows read as they are now, and run as one pipeline run: a row present is a chunk
//!   (stored, skipped as unchanged, or parked), a row gone is a delete. The changes are
//!   deleted only once the run settled every record, so a follower killed at any point
//!   leaves them queued, and the next one reads the same rows again.
//! - **Positions.** A run's positions are taken when it starts, and every read of a row
//!   happens after the change that queued it committed: a later segment carries later
//!   positions and reads later states, so an older text never overwrites a newer one.
//! - **One follower a source** (a session advisory lock); a second one fails at once.
//! - **TRUNCATE** queues a marker: the changes before it are dropped and the table is
//!   resynced with a full cleanup (`--cleanup full`, under its guard: `--yes` to delete more
//!   than `cleanup_max_fraction`).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::cleanup::CleanupMode;
use super::reader::Record;
use super::source::{SourceTargets, SourceWriter};
use super::split::Splitter;
use super::{IngestError, IngestSummary, Pipeline};
use crate::model::Chunk;
use crate::store::StoreError;
use crate::store::table_source::{self, Change, SourceRow, TableSource, TableSourceError};

/// Rows read per snapshot page.
pub const SNAPSHOT_PAGE_ROWS: i64 = 1_000;
/// Bounds of `snapshot_part_rows`: rows a snapshot settles before it records how far it got.
pub const SNAPSHOT_PART_ROWS: std::ops::RangeInclusive<i64> = SNAPSHOT_PAGE_ROWS..=10_000_000;
/// Bounds of `segment_changes`: changes applied per pipeline run.
pub const SEGMENT_CHANGES: std::ops::RangeInclusive<i64> = 1..=100_000;
/// Bounds of the poll interval when the queue is empty, in milliseconds.
pub const POLL_MS: std::ops::RangeInclusive<u64> = 10..=60_000;

/// How a follower runs.
#[derive(Debug, Clone)]
pub struct FollowOptions {
    /// Changes applied per pipeline run ([`SEGMENT_CHANGES`]; default 5,000).
    pub segment_changes: i64,
    /// Wait between polls of an empty queue ([`POLL_MS`]; default 200 ms).
    pub poll: Duration,
    /// Stop once the queue has been empty this long (a batch run); `None`: follow forever.
    pub idle_exit: Option<Duration>,
    /// `--yes`: a TRUNCATE's resync may delete more than `cleanup_max_fraction`.
    pub confirmed: bool,
    /// Rows of a snapshot run as one pipeline run per revision, after which the snapshot
    /// records the last key it settled: a follower killed during a long snapshot resumes
    /// there ([`SNAPSHOT_PART_ROWS`]; default 50,000). A resync after a TRUNCATE is one run
    /// whatever this says (its full cleanup deletes what the run did not meet).
    pub snapshot_part_rows: i64,
}

impl Default for FollowOptions {
    fn default() -> Self {
        FollowOptions {
            segment_changes: 5_000,
            poll: Duration::from_millis(200),
            idle_exit: None,
            confirmed: false,
            snapshot_part_rows: 50_000,
        }
    }
}

impl FollowOptions {
    fn within_bounds(&self) -> FollowOptions {
        let poll = (self.poll.as_millis() as u64).clamp(*POLL_MS.start(), *POLL_MS.end());
        FollowOptions {
            segment_changes: self.segment_changes.clamp(*SEGMENT_CHANGES.start(), *SEGMENT_CHANGES.end()),
            snapshot_part_rows: self
                .snapshot_part_rows
                .clamp(*SNAPSHOT_PART_ROWS.start(), *SNAPSHOT_PART_ROWS.end()),
            poll: Duration::from_millis(poll),
            ..self.clone()
        }
    }
}

/// What a follower did until it stopped.
#[derive(Debug, Default, Serialize)]
pub struct FollowSummary {
    /// Snapshots run to their end (the first one, and one per TRUNCATE).
    pub snapshots: u64,
    /// Change segments applied.
    pub segments: u64,
    /// Queued changes applied and deleted.
    pub changes_applied: u64,
    /// Changes whose segment left a record unsettled (left to a later segment).
    pub changes_retried: u64,
    /// The pipeline runs' summaries added up.
    pub ingest: IngestSummary,
}

impl Pipeline {
    /// Follows `source` into this pipeline's table alone ([`follow_table`]).
    pub async fn follow_table(
        &self,
        source: &TableSource,
        options: FollowOptions,
        cancel: CancellationToken,
    ) -> Result<FollowSummary, IngestError> {
        follow_table(self, source, options, cancel).await
    }
}

/// Follows `source` into what `targets` names for each segment (every live revision of the
/// target, the active one first: `IngestSettings::source_targets`), until `cancel` fires,
/// the queue stays empty for `idle_exit`, or a run fails. A segment's changes are deleted
/// only once every revision's run settled every record; a snapshot is done only once every
/// revision's run of it settled. While a switch asks writers to pause
/// (`revision activate --wait-secs`), no new segment starts.
pub async fn follow_table(
    targets: &dyn SourceTargets,
    source: &TableSource,
    options: FollowOptions,
    cancel: CancellationToken,
) -> Result<FollowSummary, IngestError> {
    let options = options.within_bounds();
    let writers = targets.writers().await?;
    let pool = writers.first().ok_or_else(no_writer)?.pipeline.store.pool.clone();
    let mut lock = pool.acquire().await.map_err(StoreError::from)?;
    let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtextextended($1, 0))")
        .bind(table_source::follower_lock_key(&source.name))
        .fetch_one(&mut *lock)
        .await
        .map_err(StoreError::from)?;
    if !locked {
        return Err(TableSourceError::FollowerRunning(source.name.clone()).into());
    }
    let mut summary = FollowSummary::default();
    let follower = Follower { targets, pool: &pool, name: &source.name, options: &options, cancel: &cancel };
    let result = follower.follow(&mut summary).await;
    // Closing the session releases the lock; an explicit unlock would need it healthy.
    drop(lock.detach());
    result.map(|()| summary)
}

fn no_writer() -> IngestError {
    IngestError::Source(super::source::SourceError("the table source has no target to write".into()))
}

/// One follower's loop, under the source's lock.
struct Follower<'a> {
    targets: &'a dyn SourceTargets,
    pool: &'a PgPool,
    name: &'a str,
    options: &'a FollowOptions,
    cancel: &'a CancellationToken,
}

impl Follower<'_> {
    async fn follow(&self, summary: &mut FollowSummary) -> Result<(), IngestError> {
        let (pool, name, options, cancel) = (self.pool, self.name, self.options, self.cancel);
        let mut idle_since = Instant::now();
        while !cancel.is_cancelled() {
            let source = table_source::load(pool, name).await?;
            if !source.snapshot_done {
                let writers = self.writers().await?;
                self.snapshot(&writers, &source, summary).await?;
                if cancel.is_cancelled() {
                    break;
                }
                continue;
            }
            let (pending, age) = table_source::lag(pool, name).await?;
            crate::metrics::table_source_lag(name, pending, age);
            let changes = table_source::pending_changes(pool, name, options.segment_changes).await?;
            if changes.is_empty() {
                if options.idle_exit.is_some_and(|idle| idle_since.elapsed() >= idle) {
                    break;
                }
                self.sleep(options.poll).await;
                continue;
            }
            idle_since = Instant::now();
            if let Some(truncate) = changes.iter().find(|c| c.key.is_none()) {
                tracing::info!(
                    source = name,
                    "a TRUNCATE of the source table: resyncing it with a full cleanup"
                );
                table_source::start_resync(pool, name, truncate.id).await?;
                continue;
            }
            let writers = self.writers().await?;
            if self.targets.paused(&writers).await {
                self.sleep(options.poll).await;
                continue;
            }
            self.apply_changes(&writers, &source, changes, summary).await?;
        }
        Ok(())
    }

    async fn writers(&self) -> Result<Vec<SourceWriter>, IngestError> {
        let writers = self.targets.writers().await?;
        if writers.is_empty() {
            return Err(no_writer());
        }
        Ok(writers)
    }

    async fn sleep(&self, wait: Duration) {
        tokio::select! {
            _ = self.cancel.cancelled() => {}
            _ = tokio::time::sleep(wait) => {}
        }
    }

    /// Reads the table in key order, a part at a time (each part one run per revision),
    /// from where an earlier follower's snapshot got to; records after each part the last
    /// key every revision settled, and marks the snapshot done after the last part. A
    /// resync after a TRUNCATE is one run over the whole table, from its first row.
    async fn snapshot(
        &self,
        writers: &[SourceWriter],
        source: &TableSource,
        summary: &mut FollowSummary,
    ) -> Result<(), IngestError> {
        let whole = source.resync_full;
        let mut after = if whole { None } else { source.snapshot_after.clone() };
        if after.is_some() {
            tracing::info!(source = %source.name, after = ?after, "resuming the snapshot where it got to");
        }
        let mut rows = 0;
        loop {
            let mut all_settled = true;
            // The first revision's read sets the part: up to so many rows; the others read
            // the same key range (rows inserted meanwhile are queued changes anyway).
            let mut part = SnapshotPart {
                after: after.clone(),
                until: None,
                max_rows: (!whole).then_some(self.options.snapshot_part_rows),
            };
            let mut ended = false;
            for (n, writer) in writers.iter().enumerate() {
                let mut pipeline = writer.pipeline.clone();
                if whole {
                    pipeline.options.cleanup.mode = CleanupMode::Full;
                    pipeline.options.cleanup.confirmed = self.options.confirmed;
                }
                let read: Arc<Mutex<PartRead>> = Arc::default();
                let target = pipeline.store.target().name.clone();
                let pages =
                    snapshot_rows(self.pool.clone(), source.clone(), target, part.clone(), read.clone());
                let run = pipeline.run_records(pages, self.cancel.clone()).await;
                let read = std::mem::take(&mut *read.lock().unwrap());
                let run = absorb(summary, run)?;
                if let Some(e) = read.failed {
                    return Err(e.into());
                }
                if self.cancel.is_cancelled() {
                    return Ok(());
                }
                all_settled &= settled(&run);
                if n == 0 {
                    rows += read.rows;
                    ended = read.ended;
                    if read.last.is_some() {
                        part = SnapshotPart { until: read.last.clone(), max_rows: None, ..part };
                    }
                }
            }
            if !all_settled {
                // Leased by another run, or a shutdown: the part is read again shortly.
                self.sleep(Duration::from_millis(200)).await;
                return Ok(());
            }
            match part.until {
                Some(last) if !ended => {
                    table_source::snapshot_reached(self.pool, &source.name, &last).await?;
                    after = Some(last);
                }
                _ => break,
            }
        }
        table_source::snapshot_done(self.pool, &source.name).await?;
        summary.snapshots += 1;
        tracing::info!(source = %source.name, rows, revisions = writers.len(), "snapshot done");
        Ok(())
    }

    /// One segment: the changes' rows as they are now, as one run per revision; the changes
    /// are deleted once every run settled every record.
    async fn apply_changes(
        &self,
        writers: &[SourceWriter],
        source: &TableSource,
        changes: Vec<Change>,
        summary: &mut FollowSummary,
    ) -> Result<(), IngestError> {
        let keys: Vec<(String, i32)> = changes
            .iter()
            .filter_map(|c| c.key.clone())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        let mut docs: Vec<String> = keys.iter().map(|k| k.0.clone()).collect();
        docs.dedup();
        let rows = source.read_rows(self.pool, &docs).await?;
        let splitter = splitter_of(source)?;
        let mut all_settled = true;
        for writer in writers {
            let mut records = Vec::with_capacity(keys.len());
            let mut counts = Vec::new();
            for key in &keys {
                let line = records.len() as u64 + 1;
                match rows.get(key) {
                    Some(row) => {
                        let (doc, n) = row_records(splitter.as_ref(), line, row.clone(), &mut records);
                        if splitter.is_some() {
                            counts.push((doc, n));
                        }
                    }
                    None => records.push(Record::Delete {
                        line,
                        doc_id: key.0.clone(),
                        chunk_index: source.chunk_column.as_ref().map(|_| key.1),
                    }),
                }
            }
            let target = &writer.pipeline.store.target().name;
            trailing_deletes(self.pool, target, &counts, 0, &mut records).await?;
            let run = writer.pipeline.run_records(futures::stream::iter(records), self.cancel.clone()).await;
            let run = absorb(summary, run)?;
            all_settled &= settled(&run);
        }
        summary.segments += 1;
        if all_settled {
            let ids: Vec<i64> = changes.iter().map(|c| c.id).collect();
            table_source::delete_changes(self.pool, &source.name, &ids).await?;
            summary.changes_applied += ids.len() as u64;
        } else {
            summary.changes_retried += changes.len() as u64;
            if !self.cancel.is_cancelled() {
                // Leased by another run, or a shutdown: try again shortly, not in a hot loop.
                self.sleep(Duration::from_millis(200)).await;
            }
        }
        Ok(())
    }
}

/// Whether every record of a run has its outcome written (stored, skipped, parked, deleted).
fn settled(run: &IngestSummary) -> bool {
    run.not_attempted == 0 && run.leased_elsewhere == 0 && run.stopped.is_none()
}

/// Adds a run's summary to the follower's; a failed run's error is returned as it is.
fn absorb(
    summary: &mut FollowSummary,
    run: Result<IngestSummary, IngestError>,
) -> Result<IngestSummary, IngestError> {
    let run = run?;
    summary.ingest.absorb(run.clone());
    Ok(run)
}

/// The cut of a source whose rows hold whole documents.
fn splitter_of(source: &TableSource) -> Result<Option<Splitter>, TableSourceError> {
    source
        .chunking
        .as_ref()
        .map(Splitter::new)
        .transpose()
        .map_err(|problem| TableSourceError::Invalid { name: source.name.clone(), problem })
}

/// A source row's chunks: the row itself, or the chunks `splitter` cuts its text into,
/// chunk 0 first.
fn row_chunks(splitter: Option<&Splitter>, row: SourceRow) -> Vec<Chunk> {
    let (doc_id, chunk_index) = row.key;
    let Some(splitter) = splitter else {
        return vec![Chunk { doc_id, chunk_index, text: row.text, metadata: row.metadata }];
    };
    let chunks = splitter.split(&row.text);
    // More chunks than an index holds cannot come from a bounded text; capped all the same.
    let n = chunks.len().min(i32::MAX as usize);
    chunks
        .into_iter()
        .take(n)
        .enumerate()
        .map(|(i, text)| Chunk {
            doc_id: doc_id.clone(),
            chunk_index: i as i32,
            text,
            metadata: row.metadata.clone(),
        })
        .collect()
}

/// A source row as the pipeline's records, numbered from `line` ([`row_chunks`]; a key that
/// is no valid id is rejected by the pipeline). Returns the document id and how many chunks
/// it has now.
fn row_records(
    splitter: Option<&Splitter>,
    line: u64,
    row: SourceRow,
    out: &mut Vec<Record>,
) -> (String, i32) {
    let doc_id = row.key.0.clone();
    let chunks = row_chunks(splitter, row);
    let n = chunks.len() as i32;
    for (i, chunk) in chunks.into_iter().enumerate() {
        out.push(Record::from_chunk(line + i as u64, chunk));
    }
    (doc_id, n)
}

/// Deletes of the chunks the manifest holds past each document's count now (a document cut
/// into fewer chunks than before), appended to `out`, whose first record is line `base + 1`.
async fn trailing_deletes(
    pool: &PgPool,
    target: &str,
    counts: &[(String, i32)],
    base: u64,
    out: &mut Vec<Record>,
) -> Result<(), TableSourceError> {
    for (doc_id, chunk_index) in table_source::trailing_chunks(pool, target, counts).await? {
        let line = base + out.len() as u64 + 1;
        out.push(Record::Delete { line, doc_id, chunk_index: Some(chunk_index) });
    }
    Ok(())
}

/// A snapshot page's records, numbered after `line`: its rows' chunks, and the deletes of
/// chunks a document no longer has (left by an earlier cut of this target).
async fn page_records(
    pool: &PgPool,
    source: &TableSource,
    target: &str,
    page: Vec<SourceRow>,
    line: u64,
) -> Result<Vec<Record>, TableSourceError> {
    let splitter = splitter_of(source)?;
    let mut records = Vec::with_capacity(page.len());
    let mut counts = Vec::new();
    for row in page {
        let next = line + records.len() as u64 + 1;
        let (doc, n) = row_records(splitter.as_ref(), next, row, &mut records);
        if splitter.is_some() {
            counts.push((doc, n));
        }
    }
    trailing_deletes(pool, target, &counts, line, &mut records).await?;
    Ok(records)
}

/// The key range of a snapshot part.
#[derive(Debug, Clone)]
struct SnapshotPart {
    /// Rows after this key (`None`: from the first).
    after: Option<(String, i32)>,
    /// Rows up to this key, inclusive (`None`: no upper key).
    until: Option<(String, i32)>,
    /// At most this many rows (`None`: every row in range).
    max_rows: Option<i64>,
}

/// What reading a snapshot part met.
#[derive(Debug, Default)]
struct PartRead {
    /// Why reading stopped early (the part is then not done).
    failed: Option<TableSourceError>,
    /// The key of the last row read.
    last: Option<(String, i32)>,
    /// Rows read.
    rows: u64,
    /// Whether the table ended within the part (a page came back short).
    ended: bool,
}

/// The rows of `part` in key order, one page per statement, as records; what was read is
/// kept in `read` (a read that fails ends the stream there).
fn snapshot_rows(
    pool: PgPool,
    source: TableSource,
    target: String,
    part: SnapshotPart,
    read: Arc<Mutex<PartRead>>,
) -> impl futures::Stream<Item = Record> + Send + 'static {
    use futures::StreamExt;
    let state = (pool, source, part.after.clone(), false, 0u64);
    futures::stream::unfold(state, move |(pool, source, after, done, line)| {
        let (read, target, part) = (read.clone(), target.clone(), part.clone());
        async move {
            if done {
                return None;
            }
            let so_far = read.lock().unwrap().rows as i64;
            let limit = part.max_rows.map_or(SNAPSHOT_PAGE_ROWS, |m| (m - so_far).min(SNAPSHOT_PAGE_ROWS));
            if limit <= 0 {
                return None;
            }
            let page = match source.page(&pool, after.as_ref(), part.until.as_ref(), limit).await {
                Ok(page) => page,
                Err(e) => {
                    read.lock().unwrap().failed = Some(e);
                    return None;
                }
            };
            let last = page.last().map(|r| r.key.clone());
            let done = (page.len() as i64) < limit;
            {
                let mut read = read.lock().unwrap();
                read.rows += page.len() as u64;
                read.ended = done;
                if last.is_some() {
                    read.last = last.clone();
                }
            }
            let records = match page_records(&pool, &source, &target, page, line).await {
                Ok(records) => records,
                Err(e) => {
                    read.lock().unwrap().failed = Some(e);
                    return None;
                }
            };
            let line = line + records.len() as u64;
            Some((futures::stream::iter(records), (pool, source, last.or(after), done, line)))
        }
    })
    .flatten()
}

/// Rows of a table source read per statement by [`table_as_jsonl`].
const JSONL_PAGE_ROWS: i64 = 1_000;

/// The source's rows in key order as JSONL chunk records (a document cut as the source
/// says), written into a pipe a page at a time: the input of `revision backfill
/// --from-table`, which copies them into the shadow revisions as it would a corpus. The
/// task returns the rows read, or why reading stopped: the pipe then ends early, so a run
/// over it did not see the whole table. It stops when the reader is dropped.
pub fn table_as_jsonl(
    pool: PgPool,
    source: TableSource,
) -> (tokio::io::DuplexStream, tokio::task::JoinHandle<Result<u64, TableSourceError>>) {
    use tokio::io::AsyncWriteExt;
    let (mut writer, reader) = tokio::io::duplex(256 * 1024);
    let task = tokio::spawn(async move {
        let splitter = splitter_of(&source)?;
        let (mut after, mut rows) = (None, 0u64);
        loop {
            let page = source.page(&pool, after.as_ref(), None, JSONL_PAGE_ROWS).await?;
            let mut out = Vec::with_capacity(page.len() * 256);
            let full = page.len() as i64 == JSONL_PAGE_ROWS;
            rows += page.len() as u64;
            for row in page {
                after = Some(row.key.clone());
                for chunk in row_chunks(splitter.as_ref(), row) {
                    serde_json::to_writer(&mut out, &chunk).expect("a chunk serializes");
                    out.push(b'\n');
                }
            }
            if writer.write_all(&out).await.is_err() {
                // The run stopped reading: nothing more is wanted.
                return Ok(rows);
            }
            if !full {
                let _ = writer.shutdown().await;
                return Ok(rows);
            }
        }
    });
    (reader, task)
}
