//! Replay: parked transient work goes back through the same client, classifier and retry
//! policy, in parallel, through the `replayers` consumer group on the replay stream.
//!
//! - [`Scheduler`]: due DLQ rows → leases → replay work items, appended to the replay stream
//!   by the scheduler itself before the leases commit (the lease is the item's record), a
//!   batch of a shard's items to an entry.
//! - [`Replayer`]: `XREADGROUP` (BLOCK, one entry) → re-embed → commit → `XACK` + `XDEL`,
//!   in that order.
//!   A result commits only if the DLQ row still has the generation and content hash the
//!   work item ([`WorkItem`]) carried (`sql`), so a redelivered entry whose
//!   row is gone, already replayed, or superseded by newer content is acknowledged and
//!   skipped, and a replay in flight for older content never stores its vector.
//! - One `serve` replays rows of every target table: a batch is embedded in groups of
//!   (table, model, request dimensions), each with the model the row records, checked
//!   against that table's dimension and committed into that table.
//! - Outstanding work is bounded: the scheduler hands a row out under a lease (a narrow
//!   `replay_lease` row, `sql`), at most one live lease per row and at
//!   most `outstanding_max` in all; each replay stream shard is trimmed to that many
//!   entries and, by the scheduler, to about two leases of issued work, and the replayers
//!   delete what they settle. A work item names its lease; an older item of the same row is
//!   skipped.
//! - Stuck work: entries idle longer than `min_idle` are taken over with `XAUTOCLAIM`.
//!   While a replayer works on a batch it refreshes its claim on the entries it still owns
//!   (`XCLAIM ... JUSTID`, never taking back one another replayer reclaimed), so a short
//!   `min_idle` never causes double processing.
//! - Attempts are counted in Postgres, not by Redis deliveries: loading a row for replay
//!   charges its lease in the same statement, so a database that cannot be reached charges
//!   nothing however often Redis redelivers. An item begun more than `delivery_cap` times
//!   without an outcome (an input that kills its replayer) is exhausted. Consumers idle past
//!   `dead_consumer_after` with nothing pending are removed.
//! - Lost Redis data is noticed: a replayer that finds its shard's consumer group missing
//!   (FLUSHALL, a restart without persistence, a cluster master restarted empty) creates it
//!   and releases the leases whose items lived only in that stream, so the scheduler issues
//!   them again at its next pass instead of when the leases run out.
//! - Failed passes are re-parked on the DLQ schedule; the same content failing with the same
//!   `http_500` several passes in a row is reclassified as permanent; past `max_replays` the
//!   row is exhausted. Nothing loops forever.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::Range;
use std::time::{Duration, Instant};

use futures::StreamExt;

use crate::streams::RedisConn;
use redis::streams::{StreamAutoClaimReply, StreamPendingCountReply, StreamReadReply};
use tokio_util::sync::CancellationToken;

use crate::embed::retry::DlqSchedule;
use crate::embed::{BatchStats, Embedder, Failure, ItemOutcome, Reason, Stop};
use crate::failpoint;
use crate::model::ErrorClass;
use crate::shutdown::sleep_or_cancel;
mod groups;
mod outcome;
mod replayer;
mod scheduler;
pub(crate) mod sql;

pub use groups::ensure_group;
pub(crate) use groups::{recover_lost_groups, release_lost_leases};
pub use replayer::{InFlight, Replayer};
pub use scheduler::Scheduler;

use crate::store::{Store, StoreError};
use crate::streams::{REPLAY_GROUP, StreamKeys, WorkItem};
use sql::{DlqRow, Repark, Replayed};

/// The shortest postponement of rows given up for a provider outage: a probe is due or out,
/// and its answer takes a request's time; anything shorter would only churn the rows through
/// the schedule and the stream.
pub const OUTAGE_POSTPONE_MIN: Duration = Duration::from_secs(1);

/// Replay tuning.
#[derive(Debug, Clone)]
pub struct ReplayConfig {
    /// Work items per replay stream entry the scheduler writes, and so per read (one entry),
    /// load and commit transaction (`replay_batch`, bounded by
    /// `crate::config::bounds::REPLAY_BATCH`): the stream's append, read, claim and
    /// acknowledgement and the batch's round trips (load, lock, commit) are paid once for
    /// all of its items. Provider requests are cut from it by `request_inputs` and
    /// `request_chars`.
    pub batch: usize,
    /// Most inputs in one provider request. `serve` takes `[ingest] batch_max_inputs`: a
    /// provider's limits are the same whoever sends.
    pub request_inputs: usize,
    /// Most characters in one provider request (a single longer input is sent alone).
    /// `serve` takes `[ingest] batch_max_chars`.
    pub request_chars: usize,
    /// Provider requests of one batch in flight at once (at least 1). `serve` takes
    /// `[ingest] concurrency`.
    pub requests_in_flight: usize,
    /// XREADGROUP BLOCK time.
    pub block: Duration,
    /// Entries idle longer than this are taken over by another replayer.
    pub min_idle: Duration,
    /// Replays of one work item begun without an outcome (counted in Postgres when the
    /// replayer loads the row: a replayer that died, or lost the database, mid-batch) after
    /// which the row is exhausted: the guard against an input that kills its replayer every
    /// time. Redis deliveries are not counted.
    pub delivery_cap: u32,
    /// Consumers idle this long with nothing pending are removed from the group.
    pub dead_consumer_after: Duration,
    /// Passes failing with the same `http_500` before the row is reclassified as permanent.
    pub deterministic_failures: i32,
    /// Backoff of a row that fails again (its next `next_retry_at`) and its replay limit.
    pub schedule: DlqSchedule,
    /// How long a row handed out as work stays leased (`[serve] replay_lease_secs`): no
    /// other work item is issued for it meanwhile, and a lost item is issued again when the
    /// lease runs out. A replayer's load renews it in full once less than half of it is left.
    pub lease: Duration,
    /// Most live leases, and so most work items outstanding in the replay streams
    /// (`[serve] replay_outstanding_max`); each replay stream shard is trimmed to this many
    /// entries (and by the scheduler to about two leases of issued work, in items).
    pub outstanding_max: usize,
    /// How often the scheduler looks for due rows.
    pub schedule_every: Duration,
    /// How long a replayer pauses after the provider refused the run (bad key, no quota).
    pub systemic_pause: Duration,
    /// Told when this replayer finds a replay stream's consumer group missing (the stream is
    /// new, or Redis lost its data): `serve` then republishes the lost events at once
    /// ([`crate::reconcile::Reconciler::republish_lost_events`]). `None`: nobody listens.
    pub data_lost: Option<std::sync::Arc<tokio::sync::Notify>>,
    /// Work the replayers settled since the scheduler's last pass: once a quarter of the
    /// cap is free, the scheduler of the same configuration issues the next work then, not at
    /// its next tick (on ticks alone replay would go at most `outstanding_max` rows per
    /// `schedule_every`). Clones of a configuration share it; replayers of other processes
    /// wake their own scheduler.
    pub settled: std::sync::Arc<SettledWork>,
    /// The stream shards a replayer reads (each `XREADGROUP` reads one: a read across
    /// shards would cross slots); empty means every shard of its keys. `serve` hands each
    /// replayer its share ([`shares`]).
    pub shards: Vec<u16>,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        let provider = crate::ingest::IngestOptions::default();
        ReplayConfig {
            batch: 256,
            request_inputs: provider.batch_max_inputs,
            request_chars: provider.batch_max_chars,
            requests_in_flight: provider.concurrency,
            block: Duration::from_secs(2),
            min_idle: Duration::from_secs(60),
            delivery_cap: 5,
            dead_consumer_after: Duration::from_secs(3600),
            deterministic_failures: 3,
            schedule: DlqSchedule::default(),
            lease: Duration::from_secs(15 * 60),
            outstanding_max: DEFAULT_OUTSTANDING_MAX,
            schedule_every: Duration::from_secs(1),
            systemic_pause: Duration::from_secs(60),
            data_lost: None,
            settled: Default::default(),
            shards: Vec::new(),
        }
    }
}

/// Rows the replayers of one process settled (their leases ended) since the scheduler's last
/// pass, and the bell that wakes it. A pass walks every live lease (up to the cap), so the
/// bell rings once a quarter of the cap is free, not for every batch.
#[derive(Debug, Default)]
pub struct SettledWork {
    rows: std::sync::atomic::AtomicUsize,
    bell: tokio::sync::Notify,
}

impl SettledWork {
    /// Counts `rows` settled; rings once a quarter of `outstanding_max` is free.
    fn add(&self, rows: usize, outstanding_max: usize) {
        let total = self.rows.fetch_add(rows, std::sync::atomic::Ordering::Relaxed) + rows;
        if total >= (outstanding_max / 4).max(1) {
            self.bell.notify_one();
        }
    }

    /// A pass starts: what was settled so far is its room.
    fn reset(&self) {
        self.rows.store(0, std::sync::atomic::Ordering::Relaxed);
    }
}

/// What one batch did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ReplayCounts {
    /// Rows whose vector was stored (the DLQ row is resolved).
    pub replayed: u64,
    /// Rows that failed again and went back on the schedule.
    pub reparked: u64,
    /// Rows given up on (replay limit, delivery cap, a permanent failure): left for an operator.
    pub exhausted: u64,
    /// Work items settled without work (row gone, already replayed, superseded), and
    /// unreadable entries.
    pub skipped: u64,
    /// Work items left pending with their entry (shutdown before the first attempt).
    pub left_pending: u64,
    /// Rows put back on the schedule uncharged because the provider refused the run.
    pub postponed: u64,
    /// Work items taken over from other consumers (in the entries reclaimed).
    pub reclaimed: u64,
}

impl ReplayCounts {
    fn add(&mut self, o: ReplayCounts) {
        self.replayed += o.replayed;
        self.reparked += o.reparked;
        self.exhausted += o.exhausted;
        self.skipped += o.skipped;
        self.left_pending += o.left_pending;
        self.postponed += o.postponed;
        self.reclaimed += o.reclaimed;
    }
}

/// Why a replay step failed. [`ReplayError::is_transient`] tells the loops whether to back
/// off and retry or to stop.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// A store statement (load, commit, repark) failed.
    #[error("{0}")]
    Store(#[from] StoreError),
    /// Reading, acknowledging or claiming stream entries failed.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
}

impl ReplayError {
    /// Whether the same step may succeed later without anyone changing anything; classified
    /// like the relay's errors (`store::is_transient_in_background`,
    /// `streams::is_transient_redis`), by kind and code, never by message text.
    pub fn is_transient(&self) -> bool {
        match self {
            ReplayError::Store(StoreError::Db(e)) => crate::store::is_transient_in_background(e),
            ReplayError::Store(e) => e.is_transient(),
            ReplayError::Redis(e) => crate::streams::is_transient_redis(e),
        }
    }
}

pub use crate::streams::DEFAULT_OUTSTANDING_MAX;

/// Which shards each of `replayers` replayers reads, so that every shard is read even with
/// fewer replayers than shards: replayer `r` reads shards `r`, `r + replayers`, ... (cycling
/// through them), or, with more replayers than shards, shard `r % shards` alone (several
/// replayers share a shard through the consumer group).
pub fn shares(replayers: usize, shards: u16) -> Vec<Vec<u16>> {
    let shards = usize::from(shards.max(1));
    (0..replayers)
        .map(|r| {
            if replayers >= shards {
                vec![(r % shards) as u16]
            } else {
                (r..shards).step_by(replayers).map(|s| s as u16).collect()
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shard_is_read_whatever_the_number_of_replayers() {
        for shards in 1..=20u16 {
            for replayers in 1..=10usize {
                let shares = shares(replayers, shards);
                assert_eq!(shares.len(), replayers);
                let covered: HashSet<u16> = shares.iter().flatten().copied().collect();
                assert_eq!(covered, (0..shards).collect(), "{replayers} replayers, {shards} shards");
                assert!(shares.iter().all(|s| !s.is_empty() && s.iter().all(|&x| x < shards)));
                if replayers <= usize::from(shards) {
                    let total: usize = shares.iter().map(Vec::len).sum();
                    assert_eq!(total, usize::from(shards), "each shard read by one replayer");
                }
            }
        }
        assert_eq!(shares(2, 4), vec![vec![0, 2], vec![1, 3]]);
        assert_eq!(shares(3, 1), vec![vec![0], vec![0], vec![0]]);
        assert!(shares(0, 4).is_empty());
    }
}
