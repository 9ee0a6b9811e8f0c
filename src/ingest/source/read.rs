//! One consumer of a stream source ([`SourceReader`], which lives across segments): reads
//! each stream in turn (`redis/source_read.lua`: `XREADGROUP` bounded by the byte budget's
//! free room as well as by a count; a blocking read of one entry only when all are empty),
//! takes over idle
//! entries (`XAUTOCLAIM`, their delivery counts from `XPENDING`), refreshes its claim on
//! those in flight, holds back while `max_inflight_entries` are unsettled, judges the
//! entries past the delivery cap (tried alone, charged in Postgres, parked as poison after
//! [`SOLO_ATTEMPTS`]), hands each record on at its entry's position, samples the group's
//! gauges and ends the source on `idle_exit`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::Value;
use tokio_util::sync::CancellationToken;

use super::acks::{Acks, Track};
use super::group::{
    RawEntry, autoclaim_reply, ensure_groups, entries_of, group_floor, group_info, pending_deliveries,
    read_reply_entries,
};
use super::parts::SourceFeed;
use super::{SOLO_ATTEMPTS, SourceCounts, SourceError, SourceOptions};
use crate::ingest::reader::{EntryOrigin, parse_entry, poison_entry};
use crate::store::source::EntryRef;
use crate::streams::{RedisClient, RedisConn};

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

/// The reader side of a stream source; lives across segments.
pub(super) struct SourceReader {
    opts: SourceOptions,
    client: RedisClient,
    /// Shared connection for claims, pending counts and group info.
    redis: RedisConn,
    /// Where suspect entries' attempts are charged (`store::source`).
    store: crate::store::Store,
    /// The blocking-read connection (opened on demand, dropped after an error).
    blocking: Option<RedisConn>,
    /// `redis/source_read.lua`: a read bounded in bytes.
    read_script: redis::Script,
    /// The largest entry (bytes of its fields) this reader has met: bounds how many entries
    /// one `XAUTOCLAIM` takes over, as the read script bounds a read.
    largest_entry: usize,
    acks: Arc<Acks>,
    /// Next stream to read (busy streams take turns).
    next: usize,
    last_reclaim: Option<Instant>,
    last_refresh: Instant,
    last_sample: Option<Instant>,
    /// When an entry last arrived (for `idle_exit`).
    last_entry: Instant,
    backoff: crate::embed::retry::Reconnect,
    pub(super) counts: SourceCounts,
    /// Set when the source is done: idle exit, or a permanent error.
    pub(super) finished: bool,
    pub(super) error: Option<SourceError>,
}

impl SourceReader {
    /// A reader of `opts`'s streams, tracking what it hands on in `acks`.
    pub(super) fn new(
        opts: SourceOptions,
        client: RedisClient,
        redis: RedisConn,
        store: crate::store::Store,
        acks: Arc<Acks>,
    ) -> SourceReader {
        SourceReader {
            opts,
            client,
            redis,
            store,
            blocking: None,
            read_script: redis::Script::new(include_str!("../../../redis/source_read.lua")),
            largest_entry: 0,
            acks,
            next: 0,
            last_reclaim: None,
            last_refresh: Instant::now(),
            last_sample: None,
            last_entry: Instant::now(),
            backoff: crate::embed::retry::Reconnect::new(Duration::from_millis(100), Duration::from_secs(5)),
            counts: SourceCounts::default(),
            finished: false,
            error: None,
        }
    }

    /// One segment: reads, tracks and hands on entries until the segment is full, the run
    /// halts, or the source is done.
    pub(super) async fn read_segment(&mut self, feed: SourceFeed) {
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
    async fn step(&mut self, feed: &SourceFeed, position: &mut u64) -> redis::RedisResult<()> {
        let now = Instant::now();
        if self.last_sample.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(5)) {
            self.last_sample = Some(now);
            self.sample().await;
        }
        // A switch between revisions under way: nothing new is read (nor taken over) while the
        // work in flight commits in every revision; the claim on it is kept.
        if feed.is_paused() {
            if now.duration_since(self.last_refresh) >= self.opts.min_idle / 3 {
                self.last_refresh = now;
                self.refresh_claims().await;
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                _ = feed.halt.cancelled() => {}
            }
            self.last_entry = Instant::now();
            return Ok(());
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
        let entries = self.read_next(count, feed.budget_available(), &feed.halt).await?;
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
        feed: &SourceFeed,
        position: &mut u64,
        stream: u16,
        id: String,
        fields: Vec<(Vec<u8>, Vec<u8>)>,
        deliveries: Option<u64>,
    ) -> bool {
        let at = crate::store::position::entry_position(&id, stream);
        self.largest_entry = self.largest_entry.max(fields.iter().map(|(k, v)| k.len() + v.len()).sum());
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
        feed.lines_read().fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let origin = EntryOrigin { stream: &self.opts.streams[stream as usize], id: &id };
        let max_bytes = feed.budget_capacity() as usize;
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
        if !feed.hand_on(rec, at).await {
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

    /// The next entries of one stream, starting at `self.next`: one read of each stream that
    /// does not block (the first with entries wins), at most `count` entries and, past
    /// `bytes`, no further one; a blocking read of one entry only when all are empty (as the
    /// replayers read their shards). So a reply holds at most `bytes` plus one entry,
    /// whatever the entries' sizes.
    async fn read_next(
        &mut self,
        count: usize,
        bytes: u64,
        halt: &CancellationToken,
    ) -> redis::RedisResult<Vec<(u16, Vec<RawEntry>)>> {
        if self.blocking.is_none() {
            self.blocking = Some(self.client.blocking(self.opts.block).await?);
        }
        let n = self.opts.streams.len();
        for k in 0..n {
            let i = (self.next + k) % n;
            let entries = self.read_bounded(i, count, bytes).await?;
            if !entries.is_empty() {
                self.next = (i + 1) % n;
                return Ok(vec![(i as u16, entries)]);
            }
        }
        let i = self.next % n;
        self.next = (i + 1) % n;
        let block = (self.opts.block / n as u32).max(Duration::from_millis(10));
        let read = tokio::select! {
            r = self.read_blocking(i, block) => r,
            _ = halt.cancelled() => {
                // Whatever the dropped read delivered stays pending and is taken over later.
                self.blocking = None;
                return Ok(Vec::new());
            }
        };
        Ok(vec![(i as u16, read?)])
    }

    /// New entries of stream `i` without blocking: at most `count`, and none after the
    /// entries read hold `bytes` (`redis/source_read.lua`).
    async fn read_bounded(
        &mut self,
        i: usize,
        count: usize,
        bytes: u64,
    ) -> redis::RedisResult<Vec<RawEntry>> {
        let conn = self.blocking.as_mut().expect("opened by read_next");
        let reply: Value = self
            .read_script
            .key(&self.opts.streams[i])
            .arg(&self.opts.group)
            .arg(&self.opts.consumer)
            .arg(count.max(1))
            .arg(bytes.max(1))
            .invoke_async(conn)
            .await?;
        Ok(entries_of(reply))
    }

    /// One new entry of stream `i`, waiting up to `block` for it: one, so that the reply is
    /// bounded whatever its size.
    async fn read_blocking(&mut self, i: usize, block: Duration) -> redis::RedisResult<Vec<RawEntry>> {
        let conn = self.blocking.as_mut().expect("opened by read_next");
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP").arg(&self.opts.group).arg(&self.opts.consumer).arg("COUNT").arg(1);
        cmd.arg("BLOCK").arg(block.as_millis() as u64);
        cmd.arg("STREAMS").arg(&self.opts.streams[i]).arg(">");
        let reply: Value = cmd.query_async(conn).await?;
        Ok(read_reply_entries(reply))
    }

    /// Takes over the entries of every stream idle longer than `min_idle` (`XAUTOCLAIM`),
    /// each one's delivery count read with `XPENDING`, and hands them on; returns how many.
    async fn reclaim(&mut self, feed: &SourceFeed, position: &mut u64) -> redis::RedisResult<u64> {
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
                    .arg(room.min(self.opts.read_count).min(self.claim_count_within(feed.budget_available())))
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

    /// How many entries one `XAUTOCLAIM` may take over with `bytes` of the budget free: as
    /// many of the largest entry met so far as fit, at least one (`XAUTOCLAIM` has no byte
    /// bound of its own; a new read has, `redis/source_read.lua`).
    fn claim_count_within(&self, bytes: u64) -> usize {
        match self.largest_entry {
            0 => usize::MAX,
            largest => usize::try_from(bytes / largest as u64).unwrap_or(usize::MAX).max(1),
        }
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
    pub(super) async fn stream_floors(&mut self) -> Option<Vec<(String, i64)>> {
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
