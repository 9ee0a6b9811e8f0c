//! A Redis Stream as the input of ingest: `ingest --from-stream KEY` (and `serve` with a
//! `[source]`).
//!
//! ```text
//! producer ──XADD──> source stream(s) ──XREADGROUP (group, consumer)──> records ──> the ingest
//!                                  ↑                                    pipeline (unchanged)
//!   XAUTOCLAIM (idle > min_idle) ──┘         XACK <── acker <── outcome committed / skipped as done
//! ```
//!
//! The source only produces records (`reader::Record`): batching, the manifest filter, leases, retries,
//! parking, limits and budgets are the pipeline's, as for a corpus line. What it adds:
//!
//! - **Positioned by its id.** A record's position, which fences its writes and deletes
//!   (`store::position`), comes from the entry id, not from the moment a consumer read it:
//!   an older version taken over late loses to a newer one already stored, and to a delete
//!   or corpus run that came after it.
//! - **Acknowledged after commit.** Every entry read is tracked by its position (`Acks`); the pipeline tells `Acks::settled` the records whose store or park
//!   transaction returned, or that were skipped because the same content is already stored
//!   or parked. Only those are acknowledged (`XACK`, batched by the acker task). A record not
//!   attempted (a stop, a failed write) or left to another run's lease stays pending. A crash
//!   between commit and `XACK` redelivers an entry whose write is then skipped as unchanged.
//! - **Takeover.** Entries pending longer than `min_idle` (a consumer that died, or this one
//!   after a restart) are taken over with `XAUTOCLAIM` and processed again. While an entry is
//!   in flight its consumer refreshes its claim (`XCLAIM ... JUSTID`), so a slow provider
//!   does not make other consumers take live work.
//! - **Poison.** An entry delivered more than `delivery_cap` times without an outcome is a
//!   suspect, not yet poison (Redis counts restarts' and outages' deliveries too): it is
//!   tried alone, one attempt charged in Postgres first (`store::source`), and parked as
//!   `invalid_record` (reason `delivery_cap`, raw entry in the payload) and acknowledged only
//!   when [`SOLO_ATTEMPTS`] such attempts never finished — never looped on.
//! - **Malformed entries** are parked as `invalid_record` with the raw entry preserved
//!   (`reader::parse_entry`); one without a usable identity under
//!   `source:<stream>/<entry id>`. Then acknowledged like any outcome.
//! - **Bounded.** At most `max_inflight_entries` entries are read and not yet settled; the
//!   pipeline's byte budget bounds their size. A slow provider slows the reads, never
//!   buffers the stream.
//! - **Segments.** The pipeline remembers the keys of its run (a key met twice is always
//!   embedded again); a continuous source therefore runs in segments of at most
//!   `segment_entries` entries or `segment_time`, each one pipeline run, so that memory stays
//!   bounded and the unchanged-content skip keeps working for keys published again.
//! - **Several streams.** `streams` may name several keys (shards: on a cluster, give them
//!   different hash tags so they live on different masters); each `XREADGROUP` reads one
//!   (a read across slots would fail on a cluster). Versions of one chunk belong on one
//!   stream, in order.
//!
//! Redis structures: the source streams (written by the producers), and the consumer group
//! `group` on each (created at `0` with `MKSTREAM` if missing, so entries published before
//! the first start are read).
//!
//! The files: this one holds the source's options and counts, and its run in segments
//! ([`Pipeline::run_source`]); `read` is the consumer (reads, takeover, claim refresh,
//! backpressure, suspects and poison, idle exit); `acks` the entries in flight and their
//! acknowledgement after commit; `group` the consumer group's commands and replies; `parts`
//! a segment written into every live revision of a target ([`SourceTargets`]).

mod acks;
mod group;
mod parts;
mod read;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::reader::MAX_SOURCE_KEY_BYTES;
use super::{IngestError, IngestSummary, Pipeline};
use crate::store::revision::Revision;
use crate::streams::RedisClient;
pub(crate) use acks::AckPart;
use acks::Acks;
use acks::acker;
use group::ensure_groups;
pub(crate) use group::group_info;
pub use parts::{SourceTargets, SourceWriter, WATCH_EVERY};
use read::SourceReader;

/// The default consumer group of a source stream.
pub const DEFAULT_GROUP: &str = "embed-dlq-ingest";

/// Most source streams one consumer reads.
pub const MAX_SOURCE_STREAMS: usize = 64;

/// How a stream source is read.
#[derive(Debug, Clone)]
pub struct SourceOptions {
    /// The source stream keys (at least one, at most [`MAX_SOURCE_STREAMS`], each at most
    /// 512 bytes).
    pub streams: Vec<String>,
    /// Consumer group on every source stream.
    pub group: String,
    /// This consumer's name in the group; unique per process (a reused name inherits its
    /// pending entries).
    pub consumer: String,
    /// Entries per `XREADGROUP` (`COUNT`), 1..=10000.
    pub read_count: usize,
    /// `XREADGROUP ... BLOCK` time.
    pub block: Duration,
    /// Entries pending longer than this are taken over with `XAUTOCLAIM`.
    pub min_idle: Duration,
    /// Redis deliveries without an outcome after which an entry is tried alone and judged by
    /// the attempts charged in Postgres (see [`SOLO_ATTEMPTS`]).
    pub delivery_cap: u32,
    /// Most entries read and not yet settled (backpressure), 1..=1000000.
    pub max_inflight_entries: usize,
    /// Longest segment (one pipeline run), in entries.
    pub segment_entries: u64,
    /// Longest segment, in time.
    pub segment_time: Duration,
    /// Stop once nothing new has arrived for this long, nothing is in flight and the group
    /// has nothing pending (a batch run over what the stream holds; `None`: run until
    /// cancelled).
    pub idle_exit: Option<Duration>,
    /// How long a stop waits for the acknowledgements of committed outcomes.
    pub ack_grace: Duration,
}

impl Default for SourceOptions {
    fn default() -> Self {
        SourceOptions {
            streams: Vec::new(),
            group: DEFAULT_GROUP.into(),
            consumer: default_consumer_name(),
            read_count: 256,
            block: Duration::from_secs(2),
            min_idle: Duration::from_secs(60),
            delivery_cap: 10,
            max_inflight_entries: 4096,
            segment_entries: 100_000,
            segment_time: Duration::from_secs(300),
            idle_exit: None,
            ack_grace: Duration::from_secs(10),
        }
    }
}

/// `<hostname>-<pid>`: unique per process on a host.
pub fn default_consumer_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "ingest".into());
    format!("{host}-{}", std::process::id())
}

impl SourceOptions {
    /// Why these options cannot be used, if they cannot.
    pub fn problem(&self) -> Option<String> {
        if self.streams.is_empty() {
            return Some("no source stream".into());
        }
        if self.streams.len() > MAX_SOURCE_STREAMS {
            return Some(format!("at most {MAX_SOURCE_STREAMS} source streams"));
        }
        if let Some(s) = self.streams.iter().find(|s| s.is_empty() || s.len() > MAX_SOURCE_KEY_BYTES) {
            return Some(format!("source stream key of {} bytes (1..={MAX_SOURCE_KEY_BYTES})", s.len()));
        }
        let unique: HashSet<&String> = self.streams.iter().collect();
        if unique.len() != self.streams.len() {
            return Some("a source stream is named twice".into());
        }
        for (what, name) in [("group", &self.group), ("consumer", &self.consumer)] {
            if name.is_empty() || name.len() > 256 || name.chars().any(char::is_control) {
                return Some(format!("{what} name must be 1..=256 bytes without control characters"));
            }
        }
        None
    }

    /// These options held to their bounds (a zero cannot stall the source, a huge value
    /// cannot make it read the whole stream).
    fn within_bounds(&self) -> SourceOptions {
        SourceOptions {
            read_count: self.read_count.clamp(1, 10_000),
            block: self.block.clamp(Duration::from_millis(10), Duration::from_secs(60)),
            min_idle: self.min_idle.clamp(Duration::from_millis(100), Duration::from_secs(86_400)),
            delivery_cap: self.delivery_cap.clamp(1, 1000),
            max_inflight_entries: self.max_inflight_entries.clamp(1, 1_000_000),
            segment_entries: self.segment_entries.clamp(1, 1 << 30),
            segment_time: self.segment_time.clamp(Duration::from_secs(1), Duration::from_secs(86_400)),
            ack_grace: self.ack_grace.min(Duration::from_secs(600)),
            ..self.clone()
        }
    }
}

/// What a stream source did, besides the records' outcomes.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct SourceCounts {
    /// Entries read (new, and taken over).
    pub entries_read: u64,
    /// Of those, entries taken over from idle consumers (`XAUTOCLAIM`).
    pub entries_reclaimed: u64,
    /// Entries acknowledged (their outcome committed, or they were skipped as done).
    pub entries_acked: u64,
    /// Entries parked for exceeding the delivery cap.
    pub entries_poison: u64,
    /// Entries taken over that the stream had trimmed away meanwhile (acknowledged: their
    /// content is gone; the producer trimmed below the group's pending entries).
    pub entries_trimmed: u64,
    /// Entries read and left pending at the stop (in flight, not attempted, or left to
    /// another run's lease): another consumer, or this one after `min_idle`, takes them over.
    pub left_pending: u64,
    /// Pipeline runs (segments) the source ran.
    pub segments: u64,
}

/// One entry of a source stream: the stream's index in [`SourceOptions::streams`] and the
/// entry id.
type EntryKey = (u16, String);

/// Attempts alone, each charged in Postgres, that an entry past the Redis delivery cap may
/// begin without an outcome before it is parked as poison.
pub const SOLO_ATTEMPTS: u32 = 2;

/// Why a stream source stopped for good.
#[derive(Debug, thiserror::Error)]
#[error("source stream: {0}")]
pub struct SourceError(
    /// What went wrong.
    pub String,
);

impl IngestSummary {
    /// Adds a later segment's summary to this one.
    pub(super) fn absorb(&mut self, o: IngestSummary) {
        self.lines_read += o.lines_read;
        self.records += o.records;
        self.stored += o.stored;
        self.vectors_written += o.vectors_written;
        self.unchanged += o.unchanged;
        self.already_parked += o.already_parked;
        for (k, v) in o.parked {
            *self.parked.entry(k).or_default() += v;
        }
        self.dlq_resolved += o.dlq_resolved;
        self.vectors_withdrawn += o.vectors_withdrawn;
        self.superseded += o.superseded;
        self.rejected_lines += o.rejected_lines;
        for r in o.rejected_examples {
            if self.rejected_examples.len() < 20 {
                self.rejected_examples.push(r);
            }
        }
        self.not_attempted += o.not_attempted;
        for (k, v) in o.retries {
            *self.retries.entry(k).or_default() += v;
        }
        self.provider_calls += o.provider_calls;
        self.provider_inputs += o.provider_inputs;
        self.reported_tokens += o.reported_tokens;
        self.batch_splits += o.batch_splits;
        self.breaker_opened = self.breaker_opened.max(o.breaker_opened);
        self.stopped = o.stopped.or(self.stopped.take());
        self.tokens_stored += o.tokens_stored;
        self.tokens_wasted += o.tokens_wasted;
        self.leased_elsewhere += o.leased_elsewhere;
        for u in o.unfinished_examples {
            if self.unfinished_examples.len() < super::MAX_UNFINISHED_EXAMPLES {
                self.unfinished_examples.push(u);
            }
        }
        self.delete_requests += o.delete_requests;
        self.chunks_deleted += o.chunks_deleted;
        for d in o.deleted_examples {
            if self.deleted_examples.len() < super::cleanup::DELETED_EXAMPLES {
                self.deleted_examples.push(d);
            }
        }
    }
}

/// What one revision's part of a stream source did, over every segment that wrote it.
#[derive(Debug, Clone)]
pub struct SourceRevisionRun {
    /// The revision (`None`: a table without revisions).
    pub revision: Option<Revision>,
    /// Its records' outcomes, over every segment; `source` holds the entries' counts.
    pub summary: IngestSummary,
    /// Why its run stopped in a segment, if it did (the source went on without it).
    pub stopped: Option<String>,
}

impl Pipeline {
    /// Ingests from Redis Stream(s) in a consumer group until `cancel` fires (or, with
    /// [`SourceOptions::idle_exit`], the streams are drained), acknowledging each entry only
    /// once its outcome is committed (see the module doc). The summary adds up every
    /// segment; its `source` counts the entries. On an error the entries not settled stay
    /// pending, for another consumer or a restart to take over. Writes this pipeline's table
    /// alone; [`run_source_into`] follows a target's revisions.
    pub async fn run_source(
        &self,
        client: &RedisClient,
        opts: SourceOptions,
        cancel: CancellationToken,
    ) -> Result<IngestSummary, IngestError> {
        let runs = run_source_into(Arc::new(self.clone()), client, opts, cancel).await?;
        Ok(runs.into_iter().next().map(|r| r.summary).unwrap_or_default())
    }
}

/// [`Pipeline::run_source`] into every pipeline `targets` names for each segment (one per
/// live revision of a target: see [`SourceTargets`]): each entry is acknowledged once every revision
/// still writing has committed its outcome. Returns each revision's run, the active
/// revision's first (the one of the last segment); an error is the active revision's (its
/// summary in it), or the source's.
pub async fn run_source_into(
    targets: Arc<dyn SourceTargets>,
    client: &RedisClient,
    opts: SourceOptions,
    cancel: CancellationToken,
) -> Result<Vec<SourceRevisionRun>, IngestError> {
    if let Some(problem) = opts.problem() {
        return Err(IngestError::Source(SourceError(problem)));
    }
    let mut writers = targets.writers().await?;
    if writers.is_empty() || writers.len() > acks::MAX_PARTS {
        return Err(IngestError::Source(SourceError(format!(
            "a stream source writes 1..={} revisions, not {}",
            acks::MAX_PARTS,
            writers.len()
        ))));
    }
    // Each segment is a pipeline run: a cleanup after one would delete every chunk the
    // segment happened not to contain.
    if writers.iter().any(|w| {
        w.pipeline.options.cleanup.mode != super::CleanupMode::None || w.pipeline.options.cleanup.dry_run
    }) {
        return Err(IngestError::Source(SourceError(
            "cleanup and dry runs apply to a corpus run: a stream source has no end to clean up after \
             (set cleanup = \"none\" for it)"
                .into(),
        )));
    }
    let opts = opts.within_bounds();
    let source_err = |e: redis::RedisError| IngestError::Source(SourceError(e.to_string()));
    let mut redis = client.managed().await.map_err(source_err)?;
    ensure_groups(&mut redis, &opts).await.map_err(source_err)?;
    let started = Instant::now();
    let acks = Acks::new();
    let stop_acker = CancellationToken::new();
    // Dropping this run (an aborted task) stops its acker too.
    let _acker_guard = stop_acker.clone().drop_guard();
    let acker_task = tokio::spawn(acker(
        acks.clone(),
        redis.clone(),
        Arc::new(opts.streams.clone()),
        opts.group.clone(),
        stop_acker.clone(),
    ));
    let active_store = writers[0].pipeline.store.clone();
    if let Err(e) = active_store.sweep_suspects().await {
        tracing::debug!(error = %e, "could not sweep old suspect entries");
    }
    let reader = Arc::new(tokio::sync::Mutex::new(SourceReader::new(
        opts.clone(),
        client.clone(),
        redis,
        active_store,
        acks.clone(),
    )));
    let mut runs: Vec<SourceRevisionRun> = Vec::new();
    let mut left_pending = 0;
    let mut failed = None;
    let mut first = true;
    while !cancel.is_cancelled() {
        if !first {
            writers = match targets.writers().await {
                Ok(w) if !w.is_empty() && w.len() <= acks::MAX_PARTS => w,
                Ok(w) => {
                    failed =
                        Some(IngestError::Source(SourceError(format!("{} revisions to write", w.len()))));
                    break;
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            };
        }
        first = false;
        // Before an entry of the segment is read: a corpus run from now on fences its
        // unchanged skips against this source's older entries, in every revision.
        for w in &writers {
            if let Err(e) =
                super::with_db_retry(|| w.pipeline.store.note_stream_fed(&opts.streams, &opts.group)).await
            {
                failed = Some(e.into());
                break;
            }
        }
        if failed.is_some() {
            break;
        }
        // The oldest position this consumer could still hand on: the group's oldest
        // pending entry or the last one it delivered, over every stream; 0 (the oldest of
        // all) when Redis cannot tell. Recorded for the tombstone sweep too: a stale floor
        // (this write failing) only keeps tombstones longer.
        let floors = reader.lock().await.stream_floors().await;
        let floor = floors.as_ref().map_or(0, |f| f.iter().map(|(_, p)| *p).min().unwrap_or(i64::MAX));
        if let Some(floors) = &floors {
            for w in &writers {
                if let Err(e) = w.pipeline.store.set_stream_floors(&opts.group, floors).await {
                    tracing::warn!(error = %e, "could not record the source streams' oldest positions; old tombstones stay longer");
                }
            }
        }
        acks.floor.store(floor, std::sync::atomic::Ordering::Relaxed);
        let r = reader.clone();
        let results = parts::run_segment(&writers, targets.clone(), &acks, &cancel, move |feed| async move {
            r.lock().await.read_segment(feed).await;
        })
        .await;
        left_pending += acks.end_segment(opts.ack_grace).await;
        for (n, (writer, result)) in writers.iter().zip(results).enumerate() {
            let at = runs.iter().position(|r| same_part(r, writer));
            let run = match at {
                Some(i) => &mut runs[i],
                None => {
                    runs.push(SourceRevisionRun {
                        revision: writer.revision.clone(),
                        summary: IngestSummary::default(),
                        stopped: None,
                    });
                    runs.last_mut().expect("pushed")
                }
            };
            match result {
                Ok(summary) => run.summary.absorb(summary),
                Err(IngestError::Provider { stop, summary }) if n == 0 => {
                    run.summary.absorb(*summary);
                    failed = Some(IngestError::Provider { stop, summary: Box::default() });
                }
                Err(e) if n == 0 => {
                    failed = Some(e);
                }
                Err(e) => {
                    tracing::warn!(error = %e, revision = ?writer.revision.as_ref().map(|r| r.revision),
                        "a revision's part of the stream source stopped; the source went on without it");
                    run.stopped = Some(e.to_string());
                }
            }
        }
        // The active revision first, as the last segment had it.
        if let Some(i) = runs.iter().position(|r| same_part(r, &writers[0])) {
            runs.swap(0, i);
        }
        if failed.is_some() {
            break;
        }
        let mut r = reader.lock().await;
        r.counts.segments += 1;
        if r.finished {
            if let Some(e) = r.error.take() {
                failed = Some(IngestError::Source(e));
            }
            break;
        }
    }
    stop_acker.cancel();
    let _ = acker_task.await;
    let mut counts = reader.lock().await.counts.clone();
    counts.entries_acked = acks.lock().acked;
    counts.left_pending = left_pending;
    if left_pending > 0 {
        tracing::warn!(
            left_pending,
            "source entries left pending at the stop: another consumer, or this one \
            after min_idle, takes them over"
        );
    }
    tracing::info!(
        read = counts.entries_read,
        acked = counts.entries_acked,
        left_pending,
        "stream source stopped"
    );
    if runs.is_empty() {
        runs.push(SourceRevisionRun {
            revision: writers[0].revision.clone(),
            summary: IngestSummary::default(),
            stopped: None,
        });
    }
    let price = writers[0].pipeline.options.price_per_million_tokens;
    for run in &mut runs {
        run.summary.elapsed_secs = started.elapsed().as_secs_f64();
        run.summary.price(price);
        run.summary.source = Some(counts.clone());
    }
    match failed {
        Some(IngestError::Provider { stop, summary: _ }) => {
            Err(IngestError::Provider { stop, summary: Box::new(runs.swap_remove(0).summary) })
        }
        Some(e) => Err(e),
        None => Ok(runs),
    }
}

/// Whether `run` is the run of `writer`'s revision (or of the one table).
fn same_part(run: &SourceRevisionRun, writer: &SourceWriter) -> bool {
    match (&run.revision, &writer.revision) {
        (Some(a), Some(b)) => a.identity == b.identity,
        (None, None) => true,
        _ => false,
    }
}
