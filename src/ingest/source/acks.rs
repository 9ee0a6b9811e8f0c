//! The entries of a stream source in flight and their acknowledgement after commit: [`Acks`]
//! tracks every entry handed on under its record's position, takes the settled ones (their
//! outcome committed, or skipped as done) into the queue and releases those left to another
//! run's lease; the [`acker`] task acknowledges the queue (`XACK`), retrying with backoff.
//! What is never settled stays pending in Redis, for a takeover.
//!
//! A source that feeds several revisions of a target (issue 46) hands each entry to one
//! pipeline per revision, its *parts*: an entry is settled when every part still writing has
//! settled it ([`AckPart`]), so it is acknowledged only once each revision's outcome for it
//! is committed. A part whose run stops on its own while the others go on is let go
//! ([`Acks::drop_part`]): the active revision is never held up by a shadow, and what the
//! shadow missed shows in its coverage.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::EntryKey;
use crate::streams::RedisConn;

/// What [`Acks::track`] made of an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Track {
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
    pub(super) floor: std::sync::atomic::AtomicI64,
    /// Woken when an entry is settled (room for the reader) or queued (work for the acker).
    pub(super) changed: tokio::sync::Notify,
}

#[derive(Default)]
pub(super) struct AckState {
    /// Position → entry, and the parts that have not settled it yet (one bit a part).
    inflight: HashMap<i64, (EntryKey, u64)>,
    /// The parts of the segment still writing: what a newly tracked entry waits for.
    live: u64,
    /// The entries in `inflight`, to skip one taken over while this process still has it.
    pub(super) ids: HashSet<EntryKey>,
    /// Settled, to acknowledge.
    queue: Vec<EntryKey>,
    /// Entries of an `XACK` under way (taken from the queue).
    acking: usize,
    pub(super) acked: u64,
    /// Released unacknowledged in this segment ([`Acks::release`]).
    released: u64,
}

impl Acks {
    pub(super) fn new() -> Arc<Acks> {
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

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, AckState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Begins a segment written by `parts` pipelines (1..=[`MAX_PARTS`]): each entry tracked
    /// from now on is settled once every one of them has settled it.
    pub(super) fn begin_parts(&self, parts: usize) {
        let parts = parts.clamp(1, MAX_PARTS);
        self.lock().live = if parts == MAX_PARTS { u64::MAX } else { (1u64 << parts) - 1 };
    }

    /// The handle part `part` of the segment settles its records through.
    pub(super) fn part(self: &Arc<Self>, part: usize) -> AckPart {
        AckPart { acks: self.clone(), bit: 1u64 << part.min(MAX_PARTS - 1) }
    }

    /// Part `part` stopped writing while the others go on: no entry waits for it any more
    /// (those only it had not settled are acknowledged now), and none tracked later will.
    pub(super) fn drop_part(&self, part: usize) {
        let bit = 1u64 << part.min(MAX_PARTS - 1);
        let mut s = self.lock();
        s.live &= !bit;
        let done: Vec<i64> = s
            .inflight
            .iter_mut()
            .filter_map(|(seq, (_, waiting))| {
                *waiting &= !bit;
                (*waiting == 0).then_some(*seq)
            })
            .collect();
        let any = !done.is_empty();
        for seq in done {
            if let Some((key, _)) = s.inflight.remove(&seq) {
                s.ids.remove(&key);
                s.queue.push(key);
            }
        }
        drop(s);
        if any {
            self.changed.notify_waiters();
        }
    }

    /// The records at `seqs` (their `source_seq`) are settled by the parts in `bit`: the
    /// entries no part waits for any more are acknowledged.
    fn settled_by(&self, bit: u64, seqs: impl IntoIterator<Item = i64>) {
        let mut s = self.lock();
        let mut any = false;
        for seq in seqs {
            let Some((_, waiting)) = s.inflight.get_mut(&seq) else { continue };
            *waiting &= !bit;
            if *waiting != 0 {
                continue;
            }
            if let Some((key, _)) = s.inflight.remove(&seq) {
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

    /// The records at `seqs` are left to another run (its lease), by any part: their entries
    /// stay pending in Redis, unacknowledged, and stop counting against
    /// `max_inflight_entries` and the claim refresh, so they go idle and are taken over (then
    /// found done, by the parts that did them) after `min_idle`.
    fn release(&self, seqs: impl IntoIterator<Item = i64>) {
        let mut s = self.lock();
        let mut any = false;
        for seq in seqs {
            if let Some((key, _)) = s.inflight.remove(&seq) {
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
    pub(super) fn track(&self, position: i64, key: EntryKey) -> Track {
        let mut s = self.lock();
        if s.ids.contains(&key) {
            return Track::AlreadyHere;
        }
        if s.inflight.contains_key(&position) {
            return Track::PositionTaken;
        }
        s.ids.insert(key.clone());
        let waiting = s.live.max(1);
        s.inflight.insert(position, (key, waiting));
        Track::Tracked
    }

    /// Entries read and not yet acknowledged in Redis: in flight, settled and queued, or
    /// being acknowledged (what `max_inflight_entries` bounds, so the group's pending count
    /// stays within it, leaving aside entries left to another run's lease).
    pub(super) fn inflight(&self) -> usize {
        let s = self.lock();
        s.inflight.len() + s.queue.len() + s.acking
    }

    /// Entries in flight, by stream (for refreshing the claim on them).
    pub(super) fn inflight_ids(&self) -> HashMap<u16, Vec<String>> {
        let mut out: HashMap<u16, Vec<String>> = HashMap::new();
        for (stream, id) in self.lock().ids.iter() {
            out.entry(*stream).or_default().push(id.clone());
        }
        out
    }

    /// Ends a segment: waits (up to `grace`) until every settled entry is acknowledged, then
    /// forgets what is still in flight (it stays pending in Redis). Returns the entries left
    /// pending: in flight, plus any whose acknowledgement did not go through in time.
    pub(super) async fn end_segment(&self, grace: Duration) -> u64 {
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

/// Most pipelines one segment of a source writes (one a live revision of its target).
pub(crate) const MAX_PARTS: usize = 64;

/// What one pipeline of a segment (one revision) tells of its records: settled, or left to
/// another run. With one pipeline, the entry's settlement; with several, its share of it.
pub(crate) struct AckPart {
    acks: Arc<Acks>,
    bit: u64,
}

impl AckPart {
    /// The records at `seqs` (their `source_seq`) are settled for this part: their outcome
    /// is committed, or they were skipped as already done.
    pub(crate) fn settled(&self, seqs: impl IntoIterator<Item = i64>) {
        self.acks.settled_by(self.bit, seqs);
    }

    /// The records at `seqs` are left to another run's lease: their entries stay pending.
    pub(crate) fn release(&self, seqs: impl IntoIterator<Item = i64>) {
        self.acks.release(seqs);
    }

    /// [`Acks::floor`].
    pub(crate) fn floor(&self) -> i64 {
        self.acks.floor()
    }
}

/// Acknowledges settled entries until `stop`, in batches of up to 1000 per `XACK` (one per
/// stream: a cluster routes by key), retrying a failed one with backoff.
pub(super) async fn acker(
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

#[cfg(test)]
mod tests {
    use super::*;

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
        acks.part(0).settled([2]);
        assert_eq!(acks.take(10), vec![(0, "2-0".to_string())]);
        acks.acked(1, Vec::new());
        assert_eq!(acks.end_segment(Duration::from_millis(10)).await, 1, "1-0 stays pending");
        assert_eq!(acks.inflight(), 0);
    }

    #[tokio::test]
    async fn an_entry_fed_to_several_revisions_waits_for_each_still_writing() {
        let acks = Acks::new();
        acks.begin_parts(3);
        for n in 1..=3 {
            assert_eq!(acks.track(n, (0, format!("{n}-0"))), Track::Tracked);
        }
        acks.part(0).settled([1, 2, 3]);
        acks.part(1).settled([1, 2]);
        assert_eq!(acks.take(10), Vec::<EntryKey>::new(), "nothing is settled until every part settled it");
        acks.part(2).settled([1, 3]);
        assert_eq!(acks.take(10), vec![(0, "1-0".to_string())]);
        acks.acked(1, Vec::new());
        // Part 1 stops writing: entry 3, which only it had left, is settled; entry 2 still
        // waits for part 2.
        acks.drop_part(1);
        assert_eq!(acks.take(10), vec![(0, "3-0".to_string())]);
        acks.acked(1, Vec::new());
        assert_eq!(acks.track(4, (0, "4-0".into())), Track::Tracked);
        acks.part(0).settled([4]);
        assert_eq!(acks.take(10), Vec::<EntryKey>::new(), "a later entry waits for the parts still writing");
        acks.part(2).settled([4, 2]);
        assert_eq!(acks.take(10).len(), 2);
        acks.acked(2, Vec::new());
        // Any part leaving an entry to another run's lease leaves it pending.
        assert_eq!(acks.track(5, (0, "5-0".into())), Track::Tracked);
        acks.part(2).release([5]);
        acks.part(0).settled([5]);
        assert_eq!(acks.take(10), Vec::<EntryKey>::new());
        assert_eq!(acks.end_segment(Duration::from_millis(10)).await, 1, "5-0 stays pending");
    }
}
