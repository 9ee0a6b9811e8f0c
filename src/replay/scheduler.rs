//! The scheduler: due DLQ rows → leases → replay work items, appended to the replay stream
//! by the scheduler itself before the leases commit, one entry per batch of a shard's items;
//! it trims what it issued once the leases ran out, and sweeps leases of rows that moved on.

use super::*;

/// Issues due rows as replay work: leases them in Postgres and appends their work items to
/// the replay stream itself, before the leases commit. The lease is the item's record (the
/// product's flow lets the scheduler skip the outbox for work items): a committed lease
/// always has its item in the stream, an item lost with Redis data is issued again once its
/// lease is released (a replayer finding its group gone, `serve` seeing another server) or
/// runs out, and an item appended by a pass that then failed is harmless (it takes the
/// lease if it is read first, or is skipped as an older lease's item).
pub struct Scheduler {
    store: Store,
    config: ReplayConfig,
    redis: RedisConn,
    keys: StreamKeys,
    /// The entries this scheduler appended, oldest first, with when: once one is older than
    /// a lease (and [`STALE_ENTRY_MARGIN`]), every item in it and in the entries before it
    /// has had its lease run out, so the stream is trimmed up to it ([`Scheduler::publish`]).
    appended: std::sync::Mutex<std::collections::VecDeque<(Instant, u16, String)>>,
    /// Whether the log above begins with where each shard stood when this scheduler started
    /// ([`Scheduler::note_start`]).
    started: std::sync::atomic::AtomicBool,
}

impl Scheduler {
    /// A scheduler leasing rows of `store` under `config` (lease, outstanding cap, period)
    /// and appending their items to the replay streams of `keys` on `redis`.
    pub fn new(store: Store, config: ReplayConfig, redis: RedisConn, keys: StreamKeys) -> Self {
        Scheduler { store, config, redis, keys, appended: Default::default(), started: Default::default() }
    }

    /// One pass: rows made into work items, while the outstanding cap leaves room. Each
    /// statement's items are appended to the stream before its leases commit.
    pub async fn run_once(&self) -> Result<u64, ReplayError> {
        self.note_start().await?;
        self.trim_stale().await?;
        let mut total = 0;
        loop {
            let issue = self
                .store
                .lease_due(
                    SCHEDULE_STATEMENT_ROWS,
                    self.config.lease,
                    self.config.outstanding_max,
                    SCHEDULE_IDLE_TIMEOUT,
                )
                .await?;
            let n = issue.items.len();
            if n > 0 {
                self.publish(&issue.items).await?;
                failpoint::hit!("schedule_after_publish");
            }
            issue.commit().await?;
            total += n as u64;
            if n < SCHEDULE_STATEMENT_ROWS {
                return Ok(total);
            }
        }
    }

    /// Appends `items` to their shards' replay streams, one entry per replay batch
    /// ([`ReplayConfig::batch`]) of a shard's items, so that the stream's append, read, claim
    /// and acknowledgement are paid once per batch, not once per row (BENCHMARKS.md): one
    /// pipeline per shard (a pipeline stays in one slot of a Redis Cluster), the shards at
    /// once.
    ///
    /// Each stream is capped at the outstanding cap in entries (`MAXLEN`), as the relay caps
    /// it: the entries holding a live item are never more than the live leases, and they are
    /// the newest, so what the trim removes is consumed or stale. (In items, see
    /// [`Scheduler::trim_stale`].)
    async fn publish(&self, items: &[sql::IssuedWork]) -> Result<(), redis::RedisError> {
        let cap = self.config.outstanding_max;
        let per_entry = self.config.batch.clamp(1, crate::model::MAX_ITEMS_PER_ENTRY);
        let mut of_shard: BTreeMap<u16, Vec<&sql::IssuedWork>> = BTreeMap::new();
        for work in items {
            let shard = self.keys.shard_of(&work.item.target_table, &work.doc_id, work.chunk_index);
            of_shard.entry(shard).or_default().push(work);
        }
        let mut by_shard: BTreeMap<u16, redis::Pipeline> = BTreeMap::new();
        for (shard, works) in of_shard {
            let pipe = by_shard.entry(shard).or_insert_with(redis::pipe);
            for batch in works.chunks(per_entry) {
                let xadd = pipe.cmd("XADD").arg(self.keys.replay_of(shard));
                if cap > 0 {
                    xadd.arg("MAXLEN").arg(cap);
                }
                let body = WorkItem::entry_body(
                    batch.iter().map(|w| (&w.item, w.doc_id.as_str(), w.chunk_index, w.attempts)),
                );
                xadd.arg("*").arg("event").arg("replay").arg("body").arg(body);
            }
        }
        let appends = by_shard.into_iter().map(|(shard, pipe)| {
            let mut conn = self.redis.clone();
            async move { pipe.query_async::<Vec<String>>(&mut conn).await.map(|ids| (shard, ids)) }
        });
        let appended = futures::future::try_join_all(appends).await?;
        let now = Instant::now();
        let mut log = self.appended.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for (shard, ids) in appended {
            log.extend(ids.into_iter().map(|id| (now, shard, id)));
        }
        // Bounded: entries older than a lease leave it at the next pass's `stale_entries`.
        while log.len() > MAX_APPENDED_REMEMBERED {
            log.pop_front();
        }
        Ok(())
    }

    /// Notes, once, each shard's newest entry as this scheduler starts, first in its log of
    /// appended entries: what schedulers before it appended (the process it replaces after a
    /// restart or a deploy, another process) is trimmed below it once it is a lease (and the
    /// margin) old, as what this scheduler appends itself is. Without it, the last two lease
    /// periods of items issued before a restart stayed on the stream until this scheduler's
    /// own entries aged past them, and for good where it appended none (nothing due any more).
    async fn note_start(&self) -> Result<(), redis::RedisError> {
        use std::sync::atomic::Ordering;
        if self.started.load(Ordering::Relaxed) {
            return Ok(());
        }
        let now = Instant::now();
        let mut newest = Vec::new();
        for shard in self.keys.shard_ids() {
            let last: redis::streams::StreamRangeReply = redis::cmd("XREVRANGE")
                .arg(self.keys.replay_of(shard))
                .arg("+")
                .arg("-")
                .arg("COUNT")
                .arg(1)
                .query_async(&mut self.redis.clone())
                .await?;
            newest.extend(last.ids.into_iter().map(|entry| (now, shard, entry.id)));
        }
        let mut log = self.appended.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // Older than anything this scheduler appends: at the front.
        for start in newest.into_iter().rev() {
            log.push_front(start);
        }
        self.started.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Trims each shard's stream below the newest entry this scheduler appended (or found
    /// newest as it started) more than a lease (plus [`STALE_ENTRY_MARGIN`]) ago
    /// (`XTRIM MINID`): every item in the entries before it has had its lease run out, so its
    /// row was issued again or will be at the next pass. Replayers delete the entries they settle; with this trim what stays is
    /// unread or unsettled work of about the last lease period, so a stream holds at most
    /// about twice the outstanding cap in items even with no replayer running for days (the
    /// `MAXLEN` trim alone would let it hold the cap in entries of a batch each). Returns
    /// the entries removed.
    async fn trim_stale(&self) -> Result<u64, redis::RedisError> {
        let stale = self.stale_entries();
        let mut removed = 0;
        for (shard, id) in stale {
            let n: u64 = redis::cmd("XTRIM")
                .arg(self.keys.replay_of(shard))
                .arg("MINID")
                .arg(id)
                .query_async(&mut self.redis.clone())
                .await?;
            removed += n;
        }
        Ok(removed)
    }

    /// Per shard, the newest entry this scheduler appended more than a lease (plus
    /// [`STALE_ENTRY_MARGIN`]) ago, forgotten here once returned.
    /// A threshold is dropped when an entry appended after it has a lower id: the stream was
    /// lost and begun again by a Redis whose clock is behind (a failover, a restore), and
    /// the remembered ids no longer say what is old.
    fn stale_entries(&self) -> BTreeMap<u16, String> {
        let mut log = self.appended.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut stale = BTreeMap::new();
        while let Some((at, shard, _)) = log.front() {
            if at.elapsed() <= self.config.lease + self.config.lease.min(STALE_ENTRY_MARGIN) {
                break;
            }
            let shard = *shard;
            if let Some((_, _, id)) = log.pop_front() {
                stale.insert(shard, id);
            }
        }
        stale.retain(|shard, id| {
            let below = crate::streams::parse_entry_id(id);
            log.iter()
                .filter(|(_, s, _)| s == shard)
                .all(|(_, _, later)| crate::streams::parse_entry_id(later) > below)
        });
        stale
    }

    /// Runs a pass every `schedule_every`, and soon after a replayer settled work
    /// ([`ReplayConfig::settled`]), until `cancel`. Transient errors are logged and
    /// retried on the next tick; a permanent one ends the loop.
    ///
    /// Returns `Ok(())` once cancelled, `Err` on a permanent error (the caller logs it at
    /// ERROR and stops the process: nothing would be replayed until someone fixes it).
    pub async fn run(self, cancel: CancellationToken) -> Result<(), ReplayError> {
        let mut last_sweep: Option<Instant> = None;
        while !cancel.is_cancelled() {
            if last_sweep.is_none_or(|t| t.elapsed() >= LEASE_SWEEP_EVERY) {
                last_sweep = Some(Instant::now());
                if let Err(e) = self.store.sweep_stale_leases().await {
                    tracing::warn!(error = %e, "sweeping stale replay leases failed; retrying later");
                }
            }
            self.config.settled.reset();
            if let Err(e) = self.run_once().await {
                if !e.is_transient() {
                    return Err(e);
                }
                tracing::warn!(error = %e, "scheduler pass failed; retrying");
            }
            tokio::select! {
                _ = cancel.cancelled() => {}
                _ = tokio::time::sleep(self.config.schedule_every) => {}
                _ = self.config.settled.bell.notified() => {
                    // The batches settled meanwhile share the next pass.
                    sleep_or_cancel(SCHEDULE_WAKE_GAP.min(self.config.schedule_every), &cancel).await;
                }
            }
        }
        Ok(())
    }
}

/// Most rows one scheduling statement hands out. Each statement walks the due index past
/// the rows already leased (at most the outstanding cap), so fewer, bigger statements keep
/// that walk to about one per pass (with the default cap, exactly one); a statement of this
/// many rows runs in well under a second (EXPLAIN ANALYZE on this machine: 36 ms for 5,000
/// rows behind 5,000 leases), and its items are one pipeline of appends, about 3 MB.
const SCHEDULE_STATEMENT_ROWS: usize = 10_000;

/// How long a scheduling transaction may sit idle before Postgres ends its session: a live
/// scheduler holds it open for one pipeline of appends (at most a Redis reply timeout); a
/// host that froze mid-pass would otherwise hold the scheduling lock, and so all issuing,
/// until Postgres noticed the dead connection.
const SCHEDULE_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Least time between two passes woken by settled work: commits that free the cap's quarter
/// at once (a small cap, big batches) share one pass.
const SCHEDULE_WAKE_GAP: Duration = Duration::from_millis(50);

/// How much longer than a lease (at most: a lease shorter than this is kept twice its length)
/// an entry is kept before the scheduler trims it away: the leases of its items may have been
/// renewed by a replayer's load meanwhile (a trimmed entry
/// already delivered is still replayed; only its redelivery after a crash is lost, and its
/// rows are issued again when their leases run out).
const STALE_ENTRY_MARGIN: Duration = Duration::from_secs(60);

/// Most appended entries a scheduler remembers for its trim by age: far more than a lease's
/// worth at any real pace (an entry holds a batch); past it the oldest are forgotten, and
/// only the `MAXLEN` trim covers them.
const MAX_APPENDED_REMEMBERED: usize = 100_000;

/// How often the scheduler deletes leases left by rows that moved on.
const LEASE_SWEEP_EVERY: Duration = Duration::from_secs(10);
