//! Outbox relay: moves committed `dlq_outbox` rows into Redis Streams, at least once and
//! without a visible duplicate.
//!
//! One pass ([`Relay::run_once`]): in a transaction, claim the oldest unpublished rows with
//! `FOR UPDATE SKIP LOCKED` (several relays can run at once, each gets different rows), run
//! `redis/publish.lua` for each in one pipeline per stream shard (the script appends to the
//! row's shard stream only if the row's dedup marker, in the same slot, is absent), then mark
//! the rows published, record the entry id each one became, and commit. A crash after the XADDs and before the commit leaves the rows
//! unpublished; the next pass re-runs the script, which finds the markers and adds nothing.
//! The loop wakes on `LISTEN embed_dlq_outbox` (sent at commit by a trigger, only by
//! statements that inserted outbox rows) and polls as a fallback.
//!
//! Dedup identity: the marker is keyed by the row's `event_id`, a random uuid written with the
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
use crate::store::{StoreError, outbox};
use crate::streams::{StreamKeys, publish_script};

/// Relay tuning.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// Outbox rows per pass (one transaction, one pipeline).
    pub batch: usize,
    /// Longest wait between passes when no notification arrives.
    pub poll: Duration,
    /// Lifetime of a dedup marker; must exceed the longest time a row can stay unpublished
    /// after its script ran (a relay crash plus restart).
    pub marker_ttl: Duration,
    /// Approximate cap on the events stream's length (0 = unbounded).
    pub events_maxlen: usize,
    /// Published outbox rows are deleted after this long.
    pub retention: Duration,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            batch: 500,
            poll: Duration::from_millis(1000),
            marker_ttl: Duration::from_secs(7 * 24 * 3600),
            events_maxlen: crate::streams::DEFAULT_EVENTS_MAXLEN,
            retention: Duration::from_secs(24 * 3600),
        }
    }
}

/// What one pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RelayCounts {
    /// Outbox rows taken in this pass (`published` + `duplicates`).
    pub claimed: u64,
    /// New stream entries.
    pub published: u64,
    /// Rows whose entry already existed (a previous pass crashed before marking them).
    pub duplicates: u64,
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
            RelayError::Db(e) | RelayError::Store(StoreError::Db(e)) => is_transient_db(e),
            RelayError::Store(_) => false,
            RelayError::Redis(e) => is_transient_redis(e),
        }
    }
}

/// Classifies a Postgres error for the background loops (relay, scheduler, replayers): by
/// `sqlx` kind and SQLSTATE. Transient: I/O, pool timeouts, protocol trouble, connection
/// exceptions (08), transaction rollbacks (40: serialization failure, deadlock), insufficient
/// resources (53), lock not available (55P03), operator intervention (57, e.g. a cancelled
/// statement or a shutting-down server, except 57P04 database dropped), system I/O errors
/// (58000, 58030) and a read-only server during failover (25006). Everything else, e.g. an
/// undefined table (42P01) or column (42703), a permission problem or a decode error, needs a
/// person and is permanent.
pub(crate) fn is_transient_db(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Protocol(_)
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|c| {
            c.starts_with("08")
                || c.starts_with("40")
                || c.starts_with("53")
                || (c.starts_with("57") && c != "57P04")
                || matches!(c.as_ref(), "55P03" | "58000" | "58030" | "25006" | "72000")
        }),
        _ => false,
    }
}

/// Classifies a Redis error for the background loops: by redis-rs kind and server error code.
/// Transient: I/O (connection refused, dropped, timed out), a server loading its data set,
/// cluster redirections and failovers (`TRYAGAIN`, `CLUSTERDOWN`, `MASTERDOWN`, `READONLY`,
/// `MOVED`, `ASK`), a busy script (`BUSY`), memory or persistence trouble (`OOM`, `MISCONF`),
/// missing replicas (`NOREPLICAS`) and a consumer group that vanished with its stream
/// (`NOGROUP`: the replayer recreates it). Permanent: everything else, e.g. `WRONGTYPE`, a
/// script error, `NOPERM`, failed authentication, a reply of an unexpected type.
pub(crate) fn is_transient_redis(e: &redis::RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal() {
        return true;
    }
    match e.kind() {
        ErrorKind::Parse
        | ErrorKind::ClusterConnectionNotFound
        | ErrorKind::MasterNameNotFoundBySentinel
        | ErrorKind::NoValidReplicasFoundBySentinel => true,
        ErrorKind::Server(kind) => matches!(
            kind,
            ServerErrorKind::BusyLoading
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::MasterDown
                | ServerErrorKind::ReadOnly
                | ServerErrorKind::Moved
                | ServerErrorKind::Ask
        ),
        ErrorKind::Extension => {
            matches!(e.code(), Some("BUSY" | "OOM" | "MISCONF" | "NOREPLICAS" | "NOGROUP" | "LOADING"))
        }
        _ => false,
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
    /// run against one database: rows are claimed with `SKIP LOCKED` and deduplicated by the
    /// publish script.
    pub fn new(pool: PgPool, redis: RedisConn, keys: StreamKeys, config: RelayConfig) -> Self {
        Relay { pool, redis, keys, config, script: publish_script() }
    }

    /// Publishes one batch of unpublished outbox rows: one pipeline per stream shard (a
    /// pipeline stays in one slot of a Redis Cluster), the shards' pipelines at once, each
    /// in outbox order.
    pub async fn run_once(&mut self) -> Result<RelayCounts, RelayError> {
        let Some(claim) = outbox::claim(&self.pool, self.config.batch).await? else {
            return Ok(RelayCounts::default());
        };
        // Rows by shard, in outbox order within each.
        let mut by_shard: std::collections::BTreeMap<u16, Vec<usize>> = Default::default();
        for (n, r) in claim.rows.iter().enumerate() {
            by_shard.entry(r.identity.shard(&self.keys)).or_default().push(n);
        }
        let publishes = by_shard.iter().map(|(&shard, rows)| {
            let pipe = self.pipeline(shard, rows.iter().map(|&n| &claim.rows[n]));
            let mut conn = self.redis.clone();
            async move { pipe.query_async::<Vec<(String, i64)>>(&mut conn).await }
        });
        let per_shard = futures::future::try_join_all(publishes).await?;
        let mut replies: Vec<(String, i64)> = vec![(String::new(), 0); claim.rows.len()];
        for (rows, shard_replies) in by_shard.values().zip(per_shard) {
            for (&n, reply) in rows.iter().zip(shard_replies) {
                replies[n] = reply;
            }
        }
        let ids: Vec<i64> = claim.rows.iter().map(|r| r.id).collect();
        failpoint::hit!("relay_after_publish");
        let entry_ids: Vec<&str> = replies.iter().map(|(entry, _)| entry.as_str()).collect();
        claim.mark_published(&ids, &entry_ids).await?;
        let published = replies.iter().filter(|(_, added)| *added == 1).count() as u64;
        metrics::counter!(crate::metrics::RELAY_PUBLISHED).increment(published);
        metrics::counter!(crate::metrics::RELAY_DUPLICATES).increment(ids.len() as u64 - published);
        Ok(RelayCounts { claimed: ids.len() as u64, published, duplicates: ids.len() as u64 - published })
    }

    /// The publish script for each of `rows` (all of shard `shard`), in one pipeline.
    fn pipeline<'r>(&self, shard: u16, rows: impl Iterator<Item = &'r outbox::OutboxRow>) -> redis::Pipeline {
        let mut pipe = redis::pipe();
        pipe.load_script(&self.script).ignore();
        let ttl = self.config.marker_ttl.as_secs().max(1);
        for r in rows {
            let maxlen = if r.stream == "events" { self.config.events_maxlen } else { 0 };
            let mut invocation = self.script.key(self.keys.outbox_marker(shard, &r.event_id));
            invocation
                .key(self.keys.for_outbox_stream(&r.stream, shard))
                .arg(ttl)
                .arg(maxlen)
                .arg("outbox_id")
                .arg(r.id)
                .arg("event_id")
                .arg(&r.event_id)
                .arg("event")
                .arg(&r.event)
                .arg("body")
                .arg(&r.body);
            pipe.invoke_script(&invocation);
        }
        pipe
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
        let mut backoff = Duration::from_millis(100);
        let mut last_maintenance = Instant::now() - Duration::from_secs(3600);
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
            match self.run_once().await {
                Ok(c) => {
                    backoff = Duration::from_millis(100);
                    if c.claimed > 0 {
                        tracing::debug!(published = c.published, duplicates = c.duplicates, "relay pass");
                        if c.claimed as usize >= self.config.batch {
                            continue;
                        }
                    }
                }
                Err(e) if !e.is_transient() => return Err(e),
                Err(e) => {
                    tracing::warn!(error = %e, "relay pass failed; retrying");
                    sleep_or_cancel(backoff, &cancel).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
            }
            if last_maintenance.elapsed() > Duration::from_secs(30) {
                last_maintenance = Instant::now();
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

/// Sleeps, or returns early on cancellation.
pub(crate) async fn sleep_or_cancel(d: Duration, cancel: &CancellationToken) {
    tokio::select! {
        _ = cancel.cancelled() => {}
        _ = tokio::time::sleep(d) => {}
    }
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
