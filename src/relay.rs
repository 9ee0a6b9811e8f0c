//! Outbox relay: moves committed `dlq_outbox` rows into Redis Streams, at least once and
//! without a visible duplicate.
//!
//! The relay reads the outbox in commit order and never writes a row of it (see
//! `src/relay/sql.rs`): it takes the outbox's position (one row of `relay_position`, locked in a
//! transaction; a second relay finds it held and waits its turn, so a chunk's events keep
//! their order however many relays run), reads the next page by id within the current
//! interval of committed transactions, groups the rows by stream shard and publishes each
//! shard's rows in outbox order with one pipeline of `redis/publish.lua` calls, each call
//! carrying up to [`RelayConfig::rows_per_call`] rows (the script appends a row to its shard's
//! stream only if no dedup record of the row's event, in a hash of the same slot, exists, and
//! returns every row's entry id in order), then moves the position past the page and, every
//! [`PAGES_PER_COMMIT`] pages, commits it. A crash after the XADDs and before the commit
//! leaves the position where it was; the next pass re-runs the script on the same rows, which
//! finds the records and adds nothing. [`Relay::drain`] reads the next page while the current
//! one is published. The loop ([`Relay::run`]) wakes on `LISTEN embed_dlq_outbox` (sent at
//! commit by a trigger, only by statements that inserted outbox rows) and polls as a fallback.
//!
//! Dedup identity: the record is keyed by the row's `event_id`, a random uuid written with the
//! row (migration 0005), never by the outbox id: outbox ids repeat after a database restore, in
//! a re-created database and across deployments sharing a prefix, and a repeated id would
//! make a new event look like a duplicate of an old one and drop it.
//!
//! Maintenance on the same loop: published rows older than the retention are deleted, and the
//! replay stream is trimmed below the oldest entry still pending or undelivered in any group.
//!
//! Errors are classified ([`RelayError::is_transient`]): connection loss, restarts, failovers
//! and the like are retried with capped backoff; anything else (a missing table or column, a
//! script error, a key of the wrong type) ends [`Relay::run`] with `Err`, because retrying it
//! can never succeed and a relay that silently loops publishes nothing.

use std::time::{Duration, Instant};

use crate::streams::RedisConn;
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio_util::sync::CancellationToken;

use crate::failpoint;
use crate::shutdown::sleep_or_cancel;
use crate::store::is_transient_in_background;
use crate::streams::is_transient_redis;
pub(crate) mod sql;

use crate::store::StoreError;
use crate::streams::{StreamKeys, publish_script};
use sql as outbox;

/// Relay tuning.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// Outbox rows per page: one read, then one pipeline per stream shard.
    pub batch: usize,
    /// Longest wait between passes when no notification arrives.
    pub poll: Duration,
    /// How long a dedup record outlives the last write to its hash; must exceed the longest
    /// time a row can stay unpublished after its script ran (a relay crash plus restart, a
    /// lost asynchronous mark). Setting `[serve] relay_marker_ttl_secs` (bounds in
    /// `config::bounds`); each record costs Redis about 115 bytes for this long.
    pub marker_ttl: Duration,
    /// Approximate cap on the events stream's length (0 = unbounded).
    pub events_maxlen: usize,
    /// Exact cap on each replay stream shard's length (0 = unbounded): `serve` sets the
    /// outstanding-work cap (`[serve] replay_outstanding_max`), so a backlog never grows the
    /// replay stream past it (see `redis/publish.lua` for why the trim loses no live work).
    pub replay_maxlen: usize,
    /// Published outbox rows are deleted after this long.
    pub retention: Duration,
    /// How long a relay may sit idle in the transaction that holds the outbox's position
    /// before Postgres ends the session and so releases it
    /// (`idle_in_transaction_session_timeout` for that transaction only; clamped to
    /// [`CLAIM_IDLE_TIMEOUT_BOUNDS`]). A live relay is idle there for at most a couple of
    /// Redis reply timeouts (10 s each); a relay host that froze or dropped off the network
    /// would otherwise stop every relay until Postgres noticed the dead connection (hours
    /// with default TCP keepalives). Publication waits this long at most.
    pub claim_idle_timeout: Duration,
    /// Rows one call of the publish script carries (clamped to `1..=`[`MAX_ROWS_PER_CALL`]).
    /// More rows per call means fewer round trips and script dispatches per row, but Redis
    /// runs nothing else while a script runs, so one call must stay short.
    pub rows_per_call: usize,
}

/// Most rows one call of `redis/publish.lua` may carry ([`RelayConfig::rows_per_call`]).
/// The script costs the server about 6 µs a row of ordinary envelopes (a few hundred bytes) on
/// a quiet 2-core machine and up to 16 µs under load (BENCHMARKS.md), so a call of this many
/// rows blocks it for 3-8 ms, and the default of 100 for about a millisecond.
pub const MAX_ROWS_PER_CALL: usize = 500;

/// Bounds of [`RelayConfig::claim_idle_timeout`]: from a second (tests) to an hour.
pub const CLAIM_IDLE_TIMEOUT_BOUNDS: std::ops::RangeInclusive<Duration> =
    Duration::from_secs(1)..=Duration::from_secs(3600);

/// Pages one relay publishes under one hold of the outbox's position before it commits the
/// position and lets go (another relay may take it then): bounds what a crash republishes
/// (as no-ops) and how long one transaction stays open, at a commit per this many pages.
pub const PAGES_PER_COMMIT: usize = 8;

/// Default [`RelayConfig::rows_per_call`].
pub const DEFAULT_ROWS_PER_CALL: usize = 100;

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            batch: 500,
            poll: Duration::from_millis(1000),
            marker_ttl: Duration::from_secs(7 * 24 * 3600),
            events_maxlen: crate::streams::DEFAULT_EVENTS_MAXLEN,
            replay_maxlen: crate::streams::DEFAULT_OUTSTANDING_MAX,
            retention: Duration::from_secs(24 * 3600),
            rows_per_call: DEFAULT_ROWS_PER_CALL,
            claim_idle_timeout: Duration::from_secs(60),
        }
    }
}

/// What one pass (or several, [`Relay::drain`]) did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RelayCounts {
    /// Outbox rows taken in this pass (`published` + `duplicates`).
    pub claimed: u64,
    /// New stream entries.
    pub published: u64,
    /// Rows whose entry already existed (a previous pass crashed before marking them).
    pub duplicates: u64,
}

impl std::ops::AddAssign for RelayCounts {
    fn add_assign(&mut self, other: RelayCounts) {
        self.claimed += other.claimed;
        self.published += other.published;
        self.duplicates += other.duplicates;
    }
}

/// Why a pass failed. [`RelayError::is_transient`] tells the loop whether to back off and
/// retry or to stop.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// Reading or marking the outbox failed.
    #[error("postgres: {0}")]
    Db(#[from] sqlx::Error),
    /// A statement of the outbox store failed.
    #[error("postgres: {0}")]
    Store(#[from] StoreError),
    /// Publishing (the dedup script or XADD) failed.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
}

impl RelayError {
    /// Whether the same step may succeed later without anyone changing anything (connection
    /// loss, restart, failover, lock or resource trouble), by error kind and code, never by
    /// message text.
    pub fn is_transient(&self) -> bool {
        match self {
            RelayError::Db(e) | RelayError::Store(StoreError::Db(e)) => is_transient_in_background(e),
            RelayError::Store(_) => false,
            RelayError::Redis(e) => is_transient_redis(e),
        }
    }
}

/// One relay; run as many as you like.
pub struct Relay {
    pool: PgPool,
    redis: RedisConn,
    keys: StreamKeys,
    config: RelayConfig,
    script: redis::Script,
}

impl Relay {
    /// A relay over the outbox of `pool`, publishing to the streams of `keys`. Several relays may
    /// run against one database: one at a time holds the outbox's position and publishes,
    /// and the publish script deduplicates what a crashed one left half done.
    pub fn new(pool: PgPool, redis: RedisConn, keys: StreamKeys, config: RelayConfig) -> Self {
        Relay { pool, redis, keys, config, script: publish_script() }
    }

    /// Publishes the next page of the outbox (up to [`RelayConfig::batch`] rows): one
    /// pipeline per stream shard (a pipeline stays in one slot of a Redis Cluster), the
    /// shards' pipelines at once, each in outbox order and made of calls of
    /// `redis/publish.lua` that publish up to [`RelayConfig::rows_per_call`] rows each; then
    /// moves the outbox's position past them and commits. Does nothing while another relay
    /// holds the position.
    pub async fn run_once(&mut self) -> Result<RelayCounts, RelayError> {
        self.pass(1, &CancellationToken::new()).await
    }

    /// Publishes pages back to back, as [`Relay::run_once`] does, until one is not full
    /// (nothing more is waiting), [`PAGES_PER_COMMIT`] pages went out, or `cancel` fires;
    /// then commits the position once for all of them and returns what they did together.
    ///
    /// The next page is read while the current one is published (one Postgres read and one
    /// Redis pipeline at a time, side by side). Publishing stays strictly sequential, page
    /// after page, so each shard's stream keeps outbox order. A failed publish or commit
    /// drops the position where it was: the next pass publishes the same rows again and
    /// their dedup records make that a no-op for every row that reached the stream.
    pub async fn drain(&mut self, cancel: &CancellationToken) -> Result<RelayCounts, RelayError> {
        self.pass(PAGES_PER_COMMIT, cancel).await
    }

    /// Up to `max_pages` pages under one hold of the position ([`Relay::drain`]).
    async fn pass(
        &mut self,
        max_pages: usize,
        cancel: &CancellationToken,
    ) -> Result<RelayCounts, RelayError> {
        let batch = self.config.batch;
        let Some(mut lease) = outbox::take(&self.pool, self.claim_idle_timeout()).await? else {
            return Ok(RelayCounts::default());
        };
        let mut total = RelayCounts::default();
        let mut page = lease.read(batch).await?;
        let mut pages = 1;
        loop {
            if page.rows.is_empty() {
                lease.published(page.then);
                break;
            }
            let more = page.more && pages < max_pages && !cancel.is_cancelled();
            let read_next = async {
                match more {
                    true => lease.read(batch).await.map(Some),
                    false => Ok(None),
                }
            };
            let (published, next) = tokio::join!(self.publish(&page.rows), read_next);
            let replies = published?;
            failpoint::hit!("relay_after_publish");
            total += count(&replies);
            lease.published(page.then);
            match next? {
                Some(n) => page = n,
                None => break,
            }
            pages += 1;
        }
        lease.commit().await?;
        Ok(total)
    }

    /// Publishes `rows` (one page, in outbox order) and returns each row's (entry id,
    /// added) in the same order.
    async fn publish(&self, rows: &[outbox::OutboxRow]) -> Result<Vec<(String, i64)>, RelayError> {
        // Rows by shard, in outbox order within each.
        let mut by_shard: std::collections::BTreeMap<u16, Vec<usize>> = Default::default();
        for (n, r) in rows.iter().enumerate() {
            by_shard.entry(r.identity.shard(&self.keys)).or_default().push(n);
        }
        let publishes = by_shard.iter().map(|(&shard, of_shard)| {
            let of_shard: Vec<&outbox::OutboxRow> = of_shard.iter().map(|&n| &rows[n]).collect();
            let pipe = self.pipeline(shard, &of_shard);
            let mut conn = self.redis.clone();
            async move { pipe.query_async::<Vec<Vec<(String, i64)>>>(&mut conn).await }
        });
        let per_shard = futures::future::try_join_all(publishes).await?;
        let mut replies: Vec<(String, i64)> = vec![(String::new(), 0); rows.len()];
        for (of_shard, calls) in by_shard.values().zip(per_shard) {
            let shard_replies: Vec<(String, i64)> = calls.into_iter().flatten().collect();
            if shard_replies.len() != of_shard.len() {
                return Err(redis::RedisError::from((
                    redis::ErrorKind::UnexpectedReturnType,
                    "publish.lua returned another number of entries than rows it was given",
                    format!("{} entries for {} rows", shard_replies.len(), of_shard.len()),
                ))
                .into());
            }
            for (&n, reply) in of_shard.iter().zip(shard_replies) {
                replies[n] = reply;
            }
        }
        Ok(replies)
    }

    /// The pipeline publishing `rows` (all of shard `shard`, in outbox order): the script
    /// (loaded first, so a server that lost its script cache runs it), then one call per
    /// [`RelayConfig::rows_per_call`] consecutive rows of one dedup hour (every row of a call
    /// is recorded in one hash, see `redis/publish.lua`).
    fn pipeline(&self, shard: u16, rows: &[&outbox::OutboxRow]) -> redis::Pipeline {
        let mut pipe = redis::pipe();
        pipe.load_script(&self.script).ignore();
        let ttl = self.config.marker_ttl.as_secs().max(1);
        let per_call = self.config.rows_per_call.clamp(1, MAX_ROWS_PER_CALL);
        for of_hour in rows.chunk_by(|a, b| a.dedup_hour == b.dedup_hour) {
            for call in of_hour.chunks(per_call) {
                let mut invocation = self.script.prepare_invoke();
                invocation
                    .key(self.keys.dedup_hash(shard, &call[0].dedup_hour))
                    .key(self.keys.events_of(shard))
                    .key(self.keys.replay_of(shard))
                    .arg(ttl)
                    .arg(self.config.events_maxlen)
                    .arg(self.config.replay_maxlen);
                let mut legacy_keys = 3;
                for r in call {
                    let legacy = match r.legacy_marker {
                        true => {
                            invocation.key(self.keys.legacy_marker(shard, &r.event_id));
                            legacy_keys += 1;
                            legacy_keys
                        }
                        false => 0,
                    };
                    let stream = if r.stream == "replay" { 2 } else { 1 };
                    invocation.arg(stream).arg(legacy).arg(&r.event_id).arg(r.id).arg(&r.event).arg(&r.body);
                }
                pipe.invoke_script(&invocation);
            }
        }
        pipe
    }

    /// [`RelayConfig::claim_idle_timeout`] within its bounds.
    fn claim_idle_timeout(&self) -> Duration {
        self.config
            .claim_idle_timeout
            .clamp(*CLAIM_IDLE_TIMEOUT_BOUNDS.start(), *CLAIM_IDLE_TIMEOUT_BOUNDS.end())
    }

    /// Deletes published rows past the retention; returns how many.
    pub(crate) async fn prune(&self) -> Result<u64, RelayError> {
        Ok(outbox::prune(&self.pool, self.config.retention).await?)
    }

    /// Trims every shard's replay stream below the oldest entry any group still needs
    /// (pending, or not yet delivered); returns the entries removed.
    pub(crate) async fn trim_replay(&mut self) -> Result<u64, RelayError> {
        let mut removed = 0;
        for shard in self.keys.shard_ids() {
            removed += trim_below_group_needs(&mut self.redis, &self.keys.replay_of(shard)).await?;
        }
        Ok(removed)
    }

    /// Runs until `cancel`: passes back to back while there is work, otherwise waits for a
    /// notification or the poll interval. Transient errors are logged and retried with capped
    /// backoff; a permanent one ends the loop.
    ///
    /// Returns `Ok(())` once cancelled, `Err` on a permanent error (the caller logs it at
    /// ERROR and stops the process: nothing would be published until someone fixes it).
    pub async fn run(mut self, cancel: CancellationToken) -> Result<(), RelayError> {
        let mut listener = None;
        let mut backoff =
            crate::embed::retry::Reconnect::new(Duration::from_millis(100), Duration::from_secs(5));
        // `None`: never done, due at once (`Instant::now() - 1h` panics early after boot on
        // platforms whose monotonic clock starts at zero).
        let mut last_maintenance = Instant::now().checked_sub(Duration::from_secs(3600));
        while !cancel.is_cancelled() {
            if listener.is_none() {
                match PgListener::connect_with(&self.pool).await {
                    Ok(mut l) => match l.listen(outbox::NOTIFY_CHANNEL).await {
                        Ok(()) => listener = Some(l),
                        Err(e) => tracing::warn!(error = %e, "relay: LISTEN failed; polling"),
                    },
                    Err(e) => tracing::warn!(error = %e, "relay: cannot open a LISTEN connection; polling"),
                }
            }
            // A drain stops after a bounded number of pages, and rows committed while it
            // published are the next interval's: after a drain that published anything,
            // look again at once instead of waiting for a notification.
            let mut busy = false;
            match self.drain(&cancel).await {
                Ok(c) => {
                    backoff.reset();
                    if c.claimed > 0 {
                        busy = true;
                        tracing::debug!(published = c.published, duplicates = c.duplicates, "relay passes");
                    }
                }
                Err(e) if !e.is_transient() => return Err(e),
                Err(e) => {
                    tracing::warn!(error = %e, "relay pass failed; retrying");
                    sleep_or_cancel(backoff.next_delay(), &cancel).await;
                    continue;
                }
            }
            if last_maintenance.is_none_or(|t| t.elapsed() > Duration::from_secs(30)) {
                last_maintenance = Some(Instant::now());
                match self.prune().await {
                    Err(e) if !e.is_transient() => return Err(e),
                    Err(e) => tracing::warn!(error = %e, "relay: pruning published outbox rows failed"),
                    Ok(_) => {}
                }
                match self.trim_replay().await {
                    Err(e) if !e.is_transient() => return Err(e),
                    Err(e) => tracing::warn!(error = %e, "relay: trimming the replay stream failed"),
                    Ok(_) => {}
                }
            }
            if busy {
                continue;
            }
            match listener.as_mut() {
                Some(l) => {
                    tokio::select! {
                        _ = cancel.cancelled() => break,
                        r = tokio::time::timeout(self.config.poll, l.recv()) => {
                            if let Ok(Err(e)) = r {
                                tracing::warn!(error = %e, "relay: LISTEN connection lost; reconnecting");
                                listener = None;
                            }
                        }
                    }
                }
                None => sleep_or_cancel(self.config.poll, &cancel).await,
            }
        }
        Ok(())
    }
}

/// Counts a page's publish replies (`(entry id, added)` per row) and records them in the
/// relay's metrics.
fn count(replies: &[(String, i64)]) -> RelayCounts {
    let rows = replies.len() as u64;
    let published = replies.iter().filter(|(_, added)| *added == 1).count() as u64;
    metrics::counter!(crate::metrics::RELAY_PUBLISHED).increment(published);
    metrics::counter!(crate::metrics::RELAY_DUPLICATES).increment(rows - published);
    RelayCounts { claimed: rows, published, duplicates: rows - published }
}

/// XTRIM MINID at the smallest id that some group still needs: its oldest pending entry, or
/// the entry after its last delivered one. Never trims anything a group has not acked.
pub async fn trim_below_group_needs(redis: &mut RedisConn, stream: &str) -> Result<u64, RelayError> {
    let exists: bool = redis::cmd("EXISTS").arg(stream).query_async(redis).await?;
    if !exists {
        return Ok(0);
    }
    let groups: redis::streams::StreamInfoGroupsReply =
        redis::cmd("XINFO").arg("GROUPS").arg(stream).query_async(redis).await?;
    if groups.groups.is_empty() {
        return Ok(0);
    }
    let mut floor: Option<(u64, u64)> = None;
    for g in &groups.groups {
        let (ms, seq) = crate::streams::parse_entry_id(&g.last_delivered_id);
        let mut need = (ms, seq.saturating_add(1));
        if g.pending > 0 {
            let summary: redis::streams::StreamPendingReply =
                redis::cmd("XPENDING").arg(stream).arg(&g.name).query_async(redis).await?;
            if let redis::streams::StreamPendingReply::Data(d) = summary {
                need = need.min(crate::streams::parse_entry_id(&d.start_id));
            }
        }
        floor = Some(floor.map_or(need, |f| f.min(need)));
    }
    let (ms, seq) = floor.expect("at least one group");
    let removed: u64 =
        redis::cmd("XTRIM").arg(stream).arg("MINID").arg(format!("{ms}-{seq}")).query_async(redis).await?;
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_trouble_is_transient() {
        let io = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert!(RelayError::from(sqlx::Error::Io(io)).is_transient());
        assert!(RelayError::from(sqlx::Error::PoolTimedOut).is_transient());
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert!(RelayError::from(redis::RedisError::from(refused)).is_transient());
        let timeout = std::io::Error::from(std::io::ErrorKind::TimedOut);
        assert!(RelayError::from(redis::RedisError::from(timeout)).is_transient());
    }

    #[test]
    fn mistakes_that_need_a_person_are_permanent() {
        assert!(!RelayError::from(sqlx::Error::RowNotFound).is_transient());
        assert!(!RelayError::from(sqlx::Error::ColumnNotFound("entry_id".into())).is_transient());
        let decode = redis::RedisError::from((redis::ErrorKind::UnexpectedReturnType, "not a stream"));
        assert!(!RelayError::from(decode).is_transient());
        let auth = redis::RedisError::from((redis::ErrorKind::AuthenticationFailed, "WRONGPASS"));
        assert!(!RelayError::from(auth).is_transient());
    }
}
