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

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use redis::Value;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::reader::{EntryOrigin, MAX_SOURCE_KEY_BYTES, parse_entry, poison_entry};
use super::{Feed, IngestError, IngestSummary, Pipeline};
use crate::store::source::EntryRef;
use crate::streams::{RedisClient, RedisConn};

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

/// What [`SourceReader::judge_suspect`] decided for an entry past the Redis delivery cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    /// Charged: hand it on, alone.
    TryAlone,
    /// Its attempts alone never finished: park it (the attempts charged, this one included).
    Poison(u32),
    /// The charge failed (the database is away): not its fault; taken over again later.
    LeavePending,
    /// The run halts.
    Halted,
}

/// What [`Acks::track`] made of an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Track {
    Tracked,
    /// In flight here already (taken over from ourselves).
    AlreadyHere,
    /// Another entry in flight has the same position: this one stays pending, unclaimed, and
    /// is taken over after the min-idle time.
    PositionTaken,
}

/// The entries of a stream source in flight, and the queue of those to acknowledge.
///
/// The reader tracks every entry it hands on, under the record's position (the entry's own,
/// `store::position::entry_position`: unique within a consumer); the pipeline calls [`Acks::settled`] with the `source_seq` of each record once its
/// outcome is committed (or it was skipped as already done); the acker task acknowledges
/// the queue. An entry never settled stays pending in Redis.
pub(crate) struct Acks {
    state: Mutex<AckState>,
    /// The oldest position the current segment may hand on (see [`Acks::floor`]).
    floor: std::sync::atomic::AtomicI64,
    /// Woken when an entry is settled (room for the reader) or queued (work for the acker).
    changed: tokio::sync::Notify,
}

#[derive(Default)]
struct AckState {
    /// Position → entry.
    inflight: HashMap<i64, EntryKey>,
    /// The entries in `inflight`, to skip one taken over while this process still has it.
    ids: HashSet<EntryKey>,
    /// Settled, to acknowledge.
    queue: Vec<EntryKey>,
    /// Entries of an `XACK` under way (taken from the queue).
    acking: usize,
    acked: u64,
    /// Released unacknowledged in this segment ([`Acks::release`]).
    released: u64,
}

impl Acks {
    fn new() -> Arc<Acks> {
        Arc::new(Acks {
            state: Mutex::default(),
            floor: std::sync::atomic::AtomicI64::new(0),
            changed: tokio::sync::Notify::new(),
        })
    }

    /// The oldest position the current segment may hand on: what the group had pending, or
    /// delivered last, when the segment began (every entry delivered later has a later id).
    /// Recorded as the run's start, so the tombstone sweep keeps what an older entry taken
    /// over late still needs.
    pub(crate) fn floor(&self) -> i64 {
        self.floor.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, AckState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The records at `seqs` (their `source_seq`) are settled: their entries are acknowledged.
    pub(crate) fn settled(&self, seqs: impl IntoIterator<Item = i64>) {
        let mut s = self.lock();
        let mut any = false;
        for seq in seqs {
            if let Some(key) = s.inflight.remove(&seq) {
                s.ids.remove(&key);
                s.queue.push(key);
                any = true;
            }
        }
        drop(s);
        if any {
            self.changed.notify_waiters();
        }
    }

    /// The records at `seqs` are left to another run (its lease): their entries stay pending
    /// in Redis, unacknowledged, and stop counting against `max_inflight_entries` and the
    /// claim refresh, so they go idle and are taken over (then found done) after `min_idle`.
    pub(crate) fn release(&self, seqs: impl IntoIterator<Item = i64>) {
        let mut s = self.lock();
        let mut any = false;
        for seq in seqs {
            if let Some(key) = s.inflight.remove(&seq) {
                s.ids.remove(&key);
                s.released += 1;
                any = true;
            }
        }
        drop(s);
        if any {
            self.changed.notify_waiters();
        }
    }

    /// Tracks `key` at `position`. `Busy` if this process already has it in flight, or
    /// another entry at the same position (ids past the scale of positions, which only a
    /// producer choosing its own ids can make): that one is left pending for now.
    fn track(&self, position: i64, key: EntryKey) -> Track {
        let mut s = self.lock();
        if s.ids.contains(&key) {
            return Track::AlreadyHere;
        }
        if s.inflight.contains_key(&position) {
            return Track::PositionTaken;
        }
        s.ids.insert(key.clone());
        s.inflight.insert(position, key);
        Track::Tracked
    }

    /// Entries read and not yet acknowledged in Redis: in flight, settled and queued, or
    /// being acknowledged (what `max_inflight_entries` bounds, so the group's pending count
    /// stays within it, leaving aside entries left to another run's lease).
    fn inflight(&self) -> usize {
        let s = self.lock();
        s.inflight.len() + s.queue.len() + s.acking
    }

    /// Entries in flight, by stream (for refreshing the claim on them).
    fn inflight_ids(&self) -> HashMap<u16, Vec<String>> {
        let mut out: HashMap<u16, Vec<String>> = HashMap::new();
        for (stream, id) in self.lock().ids.iter() {
            out.entry(*stream).or_default().push(id.clone());
        }
        out
    }

    /// Ends a segment: waits (up to `grace`) until every settled entry is acknowledged, then
    /// forgets what is still in flight (it stays pending in Redis). Returns the entries left
    /// pending: in flight, plus any whose acknowledgement did not go through in time.
    async fn end_segment(&self, grace: Duration) -> u64 {
        let deadline = tokio::time::Instant::now() + grace;
        loop {
            let notified = self.changed.notified();
            {
                let s = self.lock();
                if s.queue.is_empty() && s.acking == 0 {
                    break;
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                break;
            }
        }
        let mut s = self.lock();
        let left = (s.inflight.len() + s.queue.len()) as u64 + std::mem::take(&mut s.released);
        s.inflight.clear();
        s.ids.clear();
        s.queue.clear();
        left
    }

    /// Takes up to `n` entries to acknowledge, marking an `XACK` under way.
    fn take(&self, n: usize) -> Vec<EntryKey> {
        let mut s = self.lock();
        let take = s.queue.len().min(n);
        let batch: Vec<EntryKey> = s.queue.drain(..take).collect();
        s.acking = batch.len();
        batch
    }

    /// An `XACK` ended: `done` acknowledged, `failed` put back in the queue.
    fn acked(&self, done: u64, failed: Vec<EntryKey>) {
        let mut s = self.lock();
        s.acked += done;
        s.acking = 0;
        s.queue.extend(failed);
        drop(s);
        self.changed.notify_waiters();
    }
}

/// Acknowledges settled entries until `stop`, in batches of up to 1000 per `XACK` (one per
/// stream: a cluster routes by key), retrying a failed one with backoff.
async fn acker(
    acks: Arc<Acks>,
    mut redis: RedisConn,
    streams: Arc<Vec<String>>,
    group: String,
    stop: CancellationToken,
) {
    let mut backoff = crate::embed::retry::Reconnect::new(Duration::from_millis(50), Duration::from_secs(2));
    loop {
        let notified = acks.changed.notified();
        let batch = acks.take(1000);
        if batch.is_empty() {
            tokio::select! {
                _ = notified => continue,
                _ = stop.cancelled() => return,
            }
        }
        let mut by_stream: HashMap<u16, Vec<String>> = HashMap::new();
        for (s, id) in batch {
            by_stream.entry(s).or_default().push(id);
        }
        let (mut done, mut failed) = (0u64, Vec::new());
        for (s, ids) in by_stream {
            crate::failpoint::hit!("source_before_ack");
            let mut cmd = redis::cmd("XACK");
            cmd.arg(&streams[s as usize]).arg(&group).arg(&ids);
            match cmd.query_async::<i64>(&mut redis).await {
                Ok(_) => {
                    metrics::counter!(crate::metrics::SOURCE_ACKED).increment(ids.len() as u64);
                    done += ids.len() as u64;
                }
                Err(e) => {
                    tracing::warn!(error = %e, entries = ids.len(), "could not acknowledge source entries; retrying");
                    failed.extend(ids.into_iter().map(|id| (s, id)));
                }
            }
        }
        let retry = !failed.is_empty();
        acks.acked(done, failed);
        if retry {
            crate::shutdown::sleep_or_cancel(backoff.next_delay(), &stop).await;
        } else {
            backoff.reset();
        }
    }
}

/// Why a stream source stopped for good.
#[derive(Debug, thiserror::Error)]
#[error("source stream: {0}")]
pub struct SourceError(
    /// What went wrong.
    pub String,
);

/// The reader side of a stream source; lives across segments.
struct SourceReader {
    opts: SourceOptions,
    client: RedisClient,
    /// Shared connection for claims, pending counts and group info.
    redis: RedisConn,
    /// Where suspect entries' attempts are charged (`store::source`).
    store: crate::store::Store,
    /// The blocking-read connection (opened on demand, dropped after an error).
    blocking: Option<RedisConn>,
    acks: Arc<Acks>,
    /// Next stream to read (busy streams take turns).
    next: usize,
    last_reclaim: Option<Instant>,
    last_refresh: Instant,
    last_sample: Option<Instant>,
    /// When an entry last arrived (for `idle_exit`).
    last_entry: Instant,
    backoff: crate::embed::retry::Reconnect,
    counts: SourceCounts,
    /// Set when the source is done: idle exit, or a permanent error.
    finished: bool,
    error: Option<SourceError>,
}

/// One entry as read: id and fields in order (`None`: deleted while pending).
type RawEntry = (String, Option<Vec<(Vec<u8>, Vec<u8>)>>);

impl SourceReader {
    /// One segment: reads, tracks and hands on entries until the segment is full, the run
    /// halts, or the source is done.
    async fn read_segment(&mut self, feed: Feed) {
        let started = Instant::now();
        let mut position = 0u64;
        while !feed.halt.is_cancelled() && !self.finished {
            if position >= self.opts.segment_entries || started.elapsed() >= self.opts.segment_time {
                break;
            }
            match self.step(&feed, &mut position).await {
                Ok(()) => self.backoff.reset(),
                Err(e) if crate::streams::is_transient_redis(&e) || crate::streams::is_lost_group(&e) => {
                    tracing::warn!(error = %e, "source stream read failed; retrying");
                    self.blocking = None;
                    if crate::streams::is_lost_group(&e) {
                        let _ = ensure_groups(&mut self.redis, &self.opts).await;
                    }
                    crate::shutdown::sleep_or_cancel(self.backoff.next_delay(), &feed.halt).await;
                }
                Err(e) => {
                    tracing::error!(error = %e, "source stream cannot be read; stopping");
                    self.error = Some(SourceError(e.to_string()));
                    self.finished = true;
                }
            }
        }
    }

    /// One step: take over idle entries when due, refresh the claim on those in flight, then
    /// one read (waiting first for room under `max_inflight_entries`).
    async fn step(&mut self, feed: &Feed, position: &mut u64) -> redis::RedisResult<()> {
        let now = Instant::now();
        if self.last_sample.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(5)) {
            self.last_sample = Some(now);
            self.sample().await;
        }
        let mut reclaimed = 0;
        if self.last_reclaim.is_none_or(|t| now.duration_since(t) >= self.opts.min_idle / 2) {
            self.last_reclaim = Some(now);
            reclaimed = self.reclaim(feed, position).await?;
        }
        if now.duration_since(self.last_refresh) >= self.opts.min_idle / 3 {
            self.last_refresh = now;
            self.refresh_claims().await;
        }
        // Backpressure: no read while the in-flight entries fill their cap.
        let room = loop {
            let notified = self.acks.changed.notified();
            let inflight = self.acks.inflight();
            if inflight < self.opts.max_inflight_entries {
                break self.opts.max_inflight_entries - inflight;
            }
            tokio::select! {
                _ = notified => {}
                _ = feed.halt.cancelled() => return Ok(()),
                _ = tokio::time::sleep(self.opts.min_idle / 3) => return Ok(()),
            }
        };
        let count = room.min(self.opts.read_count);
        let entries = self.read_next(count, &feed.halt).await?;
        if entries.iter().all(|(_, e)| e.is_empty()) && reclaimed == 0 {
            self.check_idle_exit().await?;
            return Ok(());
        }
        for (stream, entries) in entries {
            for (id, fields) in entries {
                // A new entry always has its fields (nil only in a history read).
                let Some(fields) = fields else { continue };
                if !self.hand_on(feed, position, stream, id, fields, None).await {
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// Tracks one entry and hands its record to the pipeline; false once the run halts.
    async fn hand_on(
        &mut self,
        feed: &Feed,
        position: &mut u64,
        stream: u16,
        id: String,
        fields: Vec<(Vec<u8>, Vec<u8>)>,
        deliveries: Option<u64>,
    ) -> bool {
        let at = crate::store::position::entry_position(&id, stream);
        // Past the Redis delivery cap: a suspect, judged by attempts alone charged in Postgres.
        let suspect = deliveries.filter(|&n| n > u64::from(self.opts.delivery_cap));
        let mut poison = None;
        // Judged only once: an entry this process already has in flight is not charged again.
        if suspect.is_some() && !self.acks.lock().ids.contains(&(stream, id.clone())) {
            match self.judge_suspect(stream, &id, &feed.halt).await {
                Verdict::TryAlone => {}
                Verdict::Poison(attempts) => poison = Some(attempts),
                Verdict::LeavePending => return true,
                Verdict::Halted => return false,
            }
        }
        match self.acks.track(at, (stream, id.clone())) {
            Track::Tracked => {}
            Track::AlreadyHere => return true, // taken over from ourselves
            Track::PositionTaken => {
                tracing::warn!(stream = %self.opts.streams[stream as usize], id = %id,
                    "source entry at the same position as one in flight (an id past the scale of \
                     positions): left pending, taken over after the min-idle time");
                return true;
            }
        }
        *position += 1;
        self.counts.entries_read += 1;
        self.last_entry = Instant::now();
        metrics::counter!(crate::metrics::SOURCE_READ).increment(1);
        feed.lines_read.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let origin = EntryOrigin { stream: &self.opts.streams[stream as usize], id: &id };
        let max_bytes = feed.budget.capacity() as usize;
        let rec = match (poison, suspect) {
            (Some(attempts), Some(n)) => {
                self.counts.entries_poison += 1;
                metrics::counter!(crate::metrics::SOURCE_POISON).increment(1);
                tracing::warn!(stream = %origin.stream, id = %id, deliveries = n, attempts,
                    "source entry never finished, alone, {attempts} times past the delivery cap: parking it");
                let why = format!(
                    "delivered {n} times without an outcome (delivery cap {}), then {} attempts \
                     alone that never finished",
                    self.opts.delivery_cap,
                    attempts - 1
                );
                poison_entry(*position, origin, &fields, max_bytes, why)
            }
            _ => parse_entry(*position, origin, &fields, max_bytes),
        };
        drop(fields);
        // The record's own size stands in for the line, like a chunk handed over by Rust.
        let Some(charge) = feed.charge(rec.approx_bytes()).await else { return false };
        if !feed.hand_on_at(rec, Some(at), charge).await {
            return false;
        }
        if suspect.is_some() {
            // Alone: its outcome comes before anything else is read, so a crash now is its own.
            let key = (stream, id);
            if !self.wait_until(&feed.halt, |acks| !acks.lock().ids.contains(&key)).await {
                return false;
            }
            let entry =
                EntryRef { stream: &self.opts.streams[stream as usize], group: &self.opts.group, id: &key.1 };
            if let Err(e) = self.store.clear_suspect(entry).await {
                tracing::debug!(error = %e, "could not clear a suspect entry (swept after a week)");
            }
        }
        true
    }

    /// Judges an entry delivered past the Redis delivery cap. Redis counts every delivery
    /// (restarts, takeovers, the deliveries of a database outage), so it is not the entry's
    /// fault until proven: once nothing else is in flight, one attempt is charged to it in
    /// Postgres (impossible while the database is away: then it is left pending) and it is
    /// tried alone. Only when [`SOLO_ATTEMPTS`] such attempts never finished is it poison.
    async fn judge_suspect(&mut self, stream: u16, id: &str, halt: &CancellationToken) -> Verdict {
        if !self.wait_until(halt, |acks| acks.inflight() == 0).await {
            return Verdict::Halted;
        }
        let entry = EntryRef { stream: &self.opts.streams[stream as usize], group: &self.opts.group, id };
        match self.store.charge_suspect(entry).await {
            Ok(attempts) if attempts > SOLO_ATTEMPTS => Verdict::Poison(attempts),
            Ok(_) => Verdict::TryAlone,
            Err(e) => {
                tracing::warn!(error = %e, stream = %entry.stream, id = %id,
                    "could not charge an attempt to a source entry past the delivery cap: left pending");
                Verdict::LeavePending
            }
        }
    }

    /// Waits until `done` holds of the in-flight entries; false if the run halts first.
    async fn wait_until(&self, halt: &CancellationToken, done: impl Fn(&Acks) -> bool) -> bool {
        loop {
            let notified = self.acks.changed.notified();
            if done(&self.acks) {
                return true;
            }
            tokio::select! {
                _ = notified => {}
                _ = halt.cancelled() => return false,
                // `changed` is a wake-up, not a guarantee: look again now and then.
                _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
        }
    }

    /// The next entries of one stream, starting at `self.next`: with several streams, one
    /// read of each that does not block (the first with entries wins); a blocking read only
    /// when all are empty (as the replayers read their shards).
    async fn read_next(
        &mut self,
        count: usize,
        halt: &CancellationToken,
    ) -> redis::RedisResult<Vec<(u16, Vec<RawEntry>)>> {
        if self.blocking.is_none() {
            self.blocking = Some(self.client.blocking(self.opts.block).await?);
        }
        let n = self.opts.streams.len();
        if n > 1 {
            for k in 0..n {
                let i = (self.next + k) % n;
                let entries = self.read_stream(i, count, None).await?;
                if !entries.is_empty() {
                    self.next = (i + 1) % n;
                    return Ok(vec![(i as u16, entries)]);
                }
            }
        }
        let i = self.next % n;
        self.next = (i + 1) % n;
        let block = (self.opts.block / n as u32).max(Duration::from_millis(10));
        let read = tokio::select! {
            r = self.read_stream(i, count, Some(block)) => r,
            _ = halt.cancelled() => {
                // Whatever the dropped read delivered stays pending and is taken over later.
                self.blocking = None;
                return Ok(Vec::new());
            }
        };
        Ok(vec![(i as u16, read?)])
    }

    async fn read_stream(
        &mut self,
        i: usize,
        count: usize,
        block: Option<Duration>,
    ) -> redis::RedisResult<Vec<RawEntry>> {
        let conn = self.blocking.as_mut().expect("opened by read_next");
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP").arg(&self.opts.group).arg(&self.opts.consumer).arg("COUNT").arg(count);
        if let Some(block) = block {
            cmd.arg("BLOCK").arg(block.as_millis() as u64);
        }
        cmd.arg("STREAMS").arg(&self.opts.streams[i]).arg(">");
        let reply: Value = cmd.query_async(conn).await?;
        Ok(read_reply_entries(reply))
    }

    /// Takes over the entries of every stream idle longer than `min_idle` (`XAUTOCLAIM`),
    /// each one's delivery count read with `XPENDING`, and hands them on; returns how many.
    async fn reclaim(&mut self, feed: &Feed, position: &mut u64) -> redis::RedisResult<u64> {
        let mut total = 0;
        for i in 0..self.opts.streams.len() {
            let mut cursor = "0-0".to_string();
            loop {
                if feed.halt.is_cancelled() {
                    return Ok(total);
                }
                let room = self.opts.max_inflight_entries.saturating_sub(self.acks.inflight());
                if room == 0 {
                    return Ok(total);
                }
                let stream = self.opts.streams[i].clone();
                let reply: Value = redis::cmd("XAUTOCLAIM")
                    .arg(&stream)
                    .arg(&self.opts.group)
                    .arg(&self.opts.consumer)
                    .arg(self.opts.min_idle.as_millis() as u64)
                    .arg(&cursor)
                    .arg("COUNT")
                    .arg(room.min(self.opts.read_count))
                    .query_async(&mut self.redis)
                    .await?;
                let (next, entries, deleted) = autoclaim_reply(reply);
                if !deleted.is_empty() {
                    tracing::warn!(stream = %stream, entries = deleted.len(),
                        "source entries trimmed from the stream while pending: their content is gone");
                    self.counts.entries_trimmed += deleted.len() as u64;
                    let _: i64 = redis::cmd("XACK")
                        .arg(&stream)
                        .arg(&self.opts.group)
                        .arg(&deleted)
                        .query_async(&mut self.redis)
                        .await?;
                }
                if !entries.is_empty() {
                    let deliveries = self.deliveries(&stream, &entries).await?;
                    total += entries.len() as u64;
                    self.counts.entries_reclaimed += entries.len() as u64;
                    metrics::counter!(crate::metrics::SOURCE_RECLAIMED).increment(entries.len() as u64);
                    tracing::info!(stream = %stream, entries = entries.len(), "took over idle source entries");
                    for (id, fields) in entries {
                        let Some(fields) = fields else { continue };
                        let n = deliveries.get(&id).copied();
                        if !self.hand_on(feed, position, i as u16, id, fields, n).await {
                            return Ok(total);
                        }
                    }
                }
                if next == "0-0" || next.is_empty() {
                    break;
                }
                cursor = next;
            }
        }
        Ok(total)
    }

    /// Delivery counts of `entries` (pending in `stream`), from `XPENDING`.
    async fn deliveries(
        &mut self,
        stream: &str,
        entries: &[RawEntry],
    ) -> redis::RedisResult<HashMap<String, u64>> {
        let ids: Vec<&String> = entries.iter().map(|(id, _)| id).collect();
        let (Some(first), Some(last)) = (
            ids.iter().min_by_key(|id| crate::streams::parse_entry_id(id)),
            ids.iter().max_by_key(|id| crate::streams::parse_entry_id(id)),
        ) else {
            return Ok(HashMap::new());
        };
        let reply: Value = redis::cmd("XPENDING")
            .arg(stream)
            .arg(&self.opts.group)
            .arg(*first)
            .arg(*last)
            .arg(ids.len() * 4 + 10)
            .arg(&self.opts.consumer)
            .query_async(&mut self.redis)
            .await?;
        Ok(pending_deliveries(reply))
    }

    /// Refreshes this consumer's claim on its entries in flight (idle for a third of
    /// `min_idle` or more), so that no other consumer takes over live work. `JUSTID` leaves
    /// the delivery count alone. Errors only delay the refresh.
    async fn refresh_claims(&mut self) {
        let idle = (self.opts.min_idle / 3).as_millis() as u64;
        for (stream, ids) in self.acks.inflight_ids() {
            for ids in ids.chunks(1000) {
                let mut cmd = redis::cmd("XCLAIM");
                cmd.arg(&self.opts.streams[stream as usize])
                    .arg(&self.opts.group)
                    .arg(&self.opts.consumer)
                    .arg(idle);
                cmd.arg(ids).arg("JUSTID");
                if let Err(e) = cmd.query_async::<Value>(&mut self.redis).await {
                    tracing::warn!(error = %e, "could not refresh the claim on source entries in flight");
                }
            }
        }
    }

    /// Samples the group's pending count and lag on every stream into the metrics.
    async fn sample(&mut self) {
        for stream in self.opts.streams.clone() {
            match group_info(&mut self.redis, &stream, &self.opts.group).await {
                Ok(Some((pending, lag))) => {
                    metrics::gauge!(crate::metrics::SOURCE_PENDING, "stream" => stream.clone())
                        .set(pending as f64);
                    if let Some(lag) = lag {
                        metrics::gauge!(crate::metrics::SOURCE_LAG, "stream" => stream.clone())
                            .set(lag as f64);
                    }
                }
                Ok(None) => {}
                Err(e) => tracing::debug!(error = %e, "could not sample the source group"),
            }
        }
    }

    /// Each stream's oldest position its group may still hand on (see [`group_floor`]);
    /// `None` when Redis cannot tell for one of them.
    async fn stream_floors(&mut self) -> Option<Vec<(String, i64)>> {
        let mut floors = Vec::with_capacity(self.opts.streams.len());
        for stream in self.opts.streams.clone() {
            match group_floor(&mut self.redis, &stream, &self.opts.group).await {
                Ok(p) => floors.push((stream, p)),
                Err(e) => {
                    tracing::debug!(error = %e, stream = %stream, "could not read the source group's oldest entry");
                    return None;
                }
            }
        }
        Some(floors)
    }

    /// Ends the source (`idle_exit`) once nothing has arrived for that long, nothing is in
    /// flight here and no stream's group has anything pending.
    async fn check_idle_exit(&mut self) -> redis::RedisResult<()> {
        let Some(idle) = self.opts.idle_exit else { return Ok(()) };
        if self.last_entry.elapsed() < idle || self.acks.inflight() > 0 {
            return Ok(());
        }
        for stream in self.opts.streams.clone() {
            if let Some((pending, _)) = group_info(&mut self.redis, &stream, &self.opts.group).await?
                && pending > 0
            {
                return Ok(());
            }
        }
        self.finished = true;
        Ok(())
    }
}

/// The pending count and lag (`None` when Redis cannot tell) of `group` on `stream`, from
/// `XINFO GROUPS`; clamped to what a stream can hold. `None` without the group.
pub(crate) async fn group_info(
    redis: &mut RedisConn,
    stream: &str,
    group: &str,
) -> redis::RedisResult<Option<(u64, Option<u64>)>> {
    let reply: Value = redis::cmd("XINFO").arg("GROUPS").arg(stream).query_async(redis).await?;
    let groups = match reply {
        Value::Array(a) => a,
        _ => return Ok(None),
    };
    for g in groups {
        let fields = pairs(g);
        let name = fields.iter().find(|(k, _)| k == "name").and_then(|(_, v)| text(v));
        if name.as_deref() != Some(group) {
            continue;
        }
        let num = |key: &str| fields.iter().find(|(k, _)| k == key).and_then(|(_, v)| clamp_count(v));
        return Ok(Some((num("pending").unwrap_or(0), num("lag"))));
    }
    Ok(None)
}

/// The position of the oldest entry of `stream` that `group` may still hand to a consumer:
/// its oldest pending entry (`XPENDING`) or, with none pending, its last delivered one
/// (`XINFO GROUPS`). 0 when the group does not exist yet (everything is still to come).
async fn group_floor(redis: &mut RedisConn, stream: &str, group: &str) -> redis::RedisResult<i64> {
    use crate::store::position::entry_position;
    let reply: Value = redis::cmd("XINFO").arg("GROUPS").arg(stream).query_async(redis).await?;
    let Value::Array(groups) = reply else { return Ok(0) };
    let mut delivered = None;
    for g in groups {
        let fields = pairs(g);
        let field = |key: &str| fields.iter().find(|(k, _)| k == key).and_then(|(_, v)| text(v));
        if field("name").as_deref() == Some(group) {
            delivered = Some(field("last-delivered-id").unwrap_or_default());
        }
    }
    let Some(delivered) = delivered else { return Ok(0) };
    let summary: Value = redis::cmd("XPENDING").arg(stream).arg(group).query_async(redis).await?;
    let oldest_pending = match summary {
        Value::Array(parts) => parts.get(1).and_then(text),
        _ => None,
    };
    let floor = entry_position(&delivered, 0);
    Ok(oldest_pending.map_or(floor, |id| floor.min(entry_position(&id, 0))))
}

/// Largest count taken from a server reply: what a stream can hold in practice.
const MAX_COUNT: u64 = 1 << 48;

/// A non-negative count from a reply, clamped to [`MAX_COUNT`]; `None` for nil or garbage.
fn clamp_count(v: &Value) -> Option<u64> {
    let n = match v {
        Value::Int(i) => *i,
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok()?,
        _ => return None,
    };
    Some(n.clamp(0, MAX_COUNT as i64) as u64)
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

fn bytes(v: Value) -> Vec<u8> {
    match v {
        Value::BulkString(b) => b,
        Value::SimpleString(s) => s.into_bytes(),
        Value::Int(i) => i.to_string().into_bytes(),
        _ => Vec::new(),
    }
}

/// The key/value pairs of a flat array or a map reply.
fn pairs(v: Value) -> Vec<(String, Value)> {
    match v {
        Value::Map(m) => m.into_iter().filter_map(|(k, v)| Some((text(&k)?, v))).collect(),
        Value::Array(a) => {
            let mut out = Vec::new();
            let mut it = a.into_iter();
            while let (Some(k), Some(v)) = (it.next(), it.next()) {
                if let Some(k) = text(&k) {
                    out.push((k, v));
                }
            }
            out
        }
        _ => Vec::new(),
    }
}

/// An entry `[id, [field, value, ...]]` (fields `None` when the entry was deleted).
fn entry_of(v: Value) -> Option<RawEntry> {
    let Value::Array(parts) = v else { return None };
    let mut parts = parts.into_iter();
    let id = text(&parts.next()?)?;
    let fields = match parts.next() {
        Some(Value::Array(kv)) => {
            let mut out = Vec::with_capacity(kv.len() / 2);
            let mut it = kv.into_iter();
            while let (Some(k), Some(v)) = (it.next(), it.next()) {
                out.push((bytes(k), bytes(v)));
            }
            Some(out)
        }
        Some(Value::Map(m)) => Some(m.into_iter().map(|(k, v)| (bytes(k), bytes(v))).collect()),
        _ => None,
    };
    Some((id, fields))
}

fn entries_of(v: Value) -> Vec<RawEntry> {
    match v {
        Value::Array(a) => a.into_iter().filter_map(entry_of).collect(),
        _ => Vec::new(),
    }
}

/// The entries of an `XREADGROUP` reply (one stream), fields in order, repeated ones kept.
fn read_reply_entries(reply: Value) -> Vec<RawEntry> {
    match reply {
        Value::Array(streams) => streams
            .into_iter()
            .flat_map(|s| match s {
                Value::Array(kv) => kv.into_iter().nth(1).map(entries_of).unwrap_or_default(),
                _ => Vec::new(),
            })
            .collect(),
        Value::Map(m) => m.into_iter().flat_map(|(_, v)| entries_of(v)).collect(),
        _ => Vec::new(),
    }
}

/// `XAUTOCLAIM` reply: next cursor, entries claimed, ids deleted meanwhile.
fn autoclaim_reply(reply: Value) -> (String, Vec<RawEntry>, Vec<String>) {
    let Value::Array(parts) = reply else { return ("0-0".into(), Vec::new(), Vec::new()) };
    let mut parts = parts.into_iter();
    let next = parts.next().as_ref().and_then(text).unwrap_or_else(|| "0-0".into());
    let entries = parts.next().map(entries_of).unwrap_or_default();
    let deleted = match parts.next() {
        Some(Value::Array(ids)) => ids.iter().filter_map(text).collect(),
        _ => Vec::new(),
    };
    // An entry whose fields are nil was deleted too (Redis 6.2 reports it that way).
    let (entries, gone): (Vec<RawEntry>, Vec<RawEntry>) = entries.into_iter().partition(|(_, f)| f.is_some());
    let deleted = deleted.into_iter().chain(gone.into_iter().map(|(id, _)| id)).collect();
    (next, entries, deleted)
}

/// Delivery counts from an extended `XPENDING` reply (`[id, consumer, idle, deliveries]`).
fn pending_deliveries(reply: Value) -> HashMap<String, u64> {
    let Value::Array(rows) = reply else { return HashMap::new() };
    rows.into_iter()
        .filter_map(|row| {
            let Value::Array(cols) = row else { return None };
            let id = text(cols.first()?)?;
            let n = clamp_count(cols.get(3)?)?;
            Some((id, n))
        })
        .collect()
}

/// Creates the group on every source stream if missing (at `0`, with `MKSTREAM`).
async fn ensure_groups(redis: &mut RedisConn, opts: &SourceOptions) -> redis::RedisResult<()> {
    for stream in &opts.streams {
        let r: redis::RedisResult<()> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(stream)
            .arg(&opts.group)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(redis)
            .await;
        match r {
            Ok(()) => {
                tracing::info!(stream = %stream, group = %opts.group, "created the source consumer group")
            }
            Err(e) if e.code() == Some("BUSYGROUP") => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl IngestSummary {
    /// Adds a later segment's summary to this one.
    fn absorb(&mut self, o: IngestSummary) {
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

impl Pipeline {
    /// Ingests from Redis Stream(s) in a consumer group until `cancel` fires (or, with
    /// [`SourceOptions::idle_exit`], the streams are drained), acknowledging each entry only
    /// once its outcome is committed (see the module doc). The summary adds up every
    /// segment; its `source` counts the entries. On an error the entries not settled stay
    /// pending, for another consumer or a restart to take over.
    pub async fn run_source(
        &self,
        client: &RedisClient,
        opts: SourceOptions,
        cancel: CancellationToken,
    ) -> Result<IngestSummary, IngestError> {
        if let Some(problem) = opts.problem() {
            return Err(IngestError::Source(SourceError(problem)));
        }
        // Each segment is a pipeline run: a cleanup after one would delete every chunk the
        // segment happened not to contain.
        if self.options.cleanup.mode != super::CleanupMode::None || self.options.cleanup.dry_run {
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
        // Before the first entry is read: a corpus run from now on fences its unchanged skips
        // against this source's older entries.
        super::with_db_retry(|| self.store.note_stream_fed(&opts.streams, &opts.group)).await?;
        if let Err(e) = self.store.sweep_suspects().await {
            tracing::debug!(error = %e, "could not sweep old suspect entries");
        }
        let reader = Arc::new(tokio::sync::Mutex::new(SourceReader {
            opts: opts.clone(),
            client: client.clone(),
            redis,
            store: self.store.clone(),
            blocking: None,
            acks: acks.clone(),
            next: 0,
            last_reclaim: None,
            last_refresh: Instant::now(),
            last_sample: None,
            last_entry: Instant::now(),
            backoff: crate::embed::retry::Reconnect::new(Duration::from_millis(100), Duration::from_secs(5)),
            counts: SourceCounts::default(),
            finished: false,
            error: None,
        }));
        let mut total = IngestSummary::default();
        let mut left_pending = 0;
        let mut failed = None;
        while !cancel.is_cancelled() {
            // The oldest position this consumer could still hand on: the group's oldest
            // pending entry or the last one it delivered, over every stream; 0 (the oldest of
            // all) when Redis cannot tell. Recorded for the tombstone sweep too: a stale floor
            // (this write failing) only keeps tombstones longer.
            let floors = reader.lock().await.stream_floors().await;
            let floor = floors.as_ref().map_or(0, |f| f.iter().map(|(_, p)| *p).min().unwrap_or(i64::MAX));
            if let Some(floors) = &floors
                && let Err(e) = self.store.set_stream_floors(&opts.group, floors).await
            {
                tracing::warn!(error = %e, "could not record the source streams' oldest positions; old tombstones stay longer");
            }
            acks.floor.store(floor, std::sync::atomic::Ordering::Relaxed);
            let r = reader.clone();
            let result = self
                .execute_with(cancel.clone(), Some(acks.clone()), move |feed| async move {
                    r.lock().await.read_segment(feed).await;
                })
                .await;
            left_pending += acks.end_segment(opts.ack_grace).await;
            total.absorb(match result {
                Ok(summary) => summary,
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            });
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
        total.elapsed_secs = started.elapsed().as_secs_f64();
        total.price(self.options.price_per_million_tokens);
        total.source = Some(counts);
        match failed {
            Some(IngestError::Provider { stop, summary: _ }) => {
                Err(IngestError::Provider { stop, summary: Box::new(total) })
            }
            Some(e) => Err(e),
            None => Ok(total),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn replies_keep_fields_in_order_and_clamp_counts() {
        let reply = Value::Array(vec![Value::Array(vec![
            bulk("src"),
            Value::Array(vec![Value::Array(vec![
                bulk("1-0"),
                Value::Array(vec![bulk("text"), bulk("a"), bulk("text"), bulk("b")]),
            ])]),
        ])]);
        let entries = read_reply_entries(reply);
        assert_eq!(entries.len(), 1);
        let fields = entries[0].1.as_ref().unwrap();
        assert_eq!(fields.len(), 2, "a repeated field is kept, not merged");
        assert_eq!(clamp_count(&Value::Int(-5)), Some(0));
        assert_eq!(clamp_count(&Value::Int(i64::MAX)), Some(MAX_COUNT));
        assert_eq!(clamp_count(&Value::Nil), None);
        let claim = Value::Array(vec![
            bulk("0-0"),
            Value::Array(vec![Value::Array(vec![bulk("2-0"), Value::Nil])]),
            Value::Array(vec![bulk("3-0")]),
        ]);
        let (next, entries, deleted) = autoclaim_reply(claim);
        assert_eq!((next.as_str(), entries.len()), ("0-0", 0));
        assert_eq!(deleted, vec!["3-0".to_string(), "2-0".to_string()]);
    }

    #[tokio::test]
    async fn only_settled_entries_are_queued_for_acknowledgement() {
        let acks = Acks::new();
        assert_eq!(acks.track(1, (0, "1-0".into())), Track::Tracked);
        assert_eq!(acks.track(2, (0, "2-0".into())), Track::Tracked);
        assert_eq!(
            acks.track(3, (0, "2-0".into())),
            Track::AlreadyHere,
            "an entry already in flight is not taken twice"
        );
        assert_eq!(acks.track(2, (1, "2-0".into())), Track::PositionTaken, "nor one at a position in flight");
        acks.settled([2]);
        assert_eq!(acks.take(10), vec![(0, "2-0".to_string())]);
        acks.acked(1, Vec::new());
        assert_eq!(acks.end_segment(Duration::from_millis(10)).await, 1, "1-0 stays pending");
        assert_eq!(acks.inflight(), 0);
    }
}
