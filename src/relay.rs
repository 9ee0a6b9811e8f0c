//! Outbox relay: moves committed `dlq_outbox` rows into Redis Streams, at least once and
//! without a visible duplicate.
//!
//! One pass ([`Relay::run_once`]): in a transaction, claim the oldest unpublished rows with
//! `FOR UPDATE SKIP LOCKED` (several relays can run at once, each gets different rows), run
//! `redis/publish.lua` for each in one pipeline (the script appends to the stream only if the
//! row's dedup marker is absent), then mark the rows published and commit. A crash after the
//! XADDs and before the commit leaves the rows unpublished; the next pass re-runs the script,
//! which finds the markers and adds nothing. The loop wakes on `LISTEN embed_dlq_outbox`
//! (sent by a trigger at commit) and polls as a fallback.
//!
//! Maintenance on the same loop: published rows older than the retention are deleted, and the
//! replay stream is trimmed below the oldest entry still pending or undelivered in any group.

use std::time::{Duration, Instant};

use redis::aio::ConnectionManager;
use sqlx::postgres::PgListener;
use sqlx::{PgPool, Row};
use tokio_util::sync::CancellationToken;

use crate::failpoint;
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
            events_maxlen: 1_000_000,
            retention: Duration::from_secs(24 * 3600),
        }
    }
}

/// What one pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RelayCounts {
    pub claimed: u64,
    /// New stream entries.
    pub published: u64,
    /// Rows whose entry already existed (a previous pass crashed before marking them).
    pub duplicates: u64,
}

/// Why a pass failed (the loop backs off and retries).
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("postgres: {0}")]
    Db(#[from] sqlx::Error),
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
}

/// One relay; run as many as you like.
pub struct Relay {
    pool: PgPool,
    redis: ConnectionManager,
    keys: StreamKeys,
    config: RelayConfig,
    script: redis::Script,
}

impl Relay {
    pub fn new(pool: PgPool, redis: ConnectionManager, keys: StreamKeys, config: RelayConfig) -> Self {
        Relay { pool, redis, keys, config, script: publish_script() }
    }

    /// Publishes one batch of unpublished outbox rows.
    pub async fn run_once(&mut self) -> Result<RelayCounts, RelayError> {
        let mut tx = self.pool.begin().await?;
        let rows = sqlx::query(
            "SELECT id, event, stream, body::text AS body FROM dlq_outbox
              WHERE published_at IS NULL
              ORDER BY id
              LIMIT $1
              FOR UPDATE SKIP LOCKED",
        )
        .bind(self.config.batch as i64)
        .fetch_all(&mut *tx)
        .await?;
        if rows.is_empty() {
            tx.rollback().await?;
            return Ok(RelayCounts::default());
        }
        let mut pipe = redis::pipe();
        pipe.load_script(&self.script).ignore();
        let mut ids = Vec::with_capacity(rows.len());
        let ttl = self.config.marker_ttl.as_secs().max(1);
        for r in &rows {
            let id: i64 = r.try_get("id")?;
            let stream: String = r.try_get("stream")?;
            let maxlen = if stream == "events" { self.config.events_maxlen } else { 0 };
            let mut invocation = self.script.key(self.keys.outbox_marker(id));
            invocation
                .key(self.keys.for_outbox_stream(&stream))
                .arg(ttl)
                .arg(maxlen)
                .arg("outbox_id")
                .arg(id)
                .arg("event")
                .arg(r.try_get::<String, _>("event")?)
                .arg("body")
                .arg(r.try_get::<String, _>("body")?);
            pipe.invoke_script(&invocation);
            ids.push(id);
        }
        let replies: Vec<(String, i64)> = pipe.query_async(&mut self.redis).await?;
        failpoint::hit("relay_after_publish");
        sqlx::query("UPDATE dlq_outbox SET published_at = now() WHERE id = ANY($1)")
            .bind(&ids)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        let published = replies.iter().filter(|(_, added)| *added == 1).count() as u64;
        metrics::counter!(crate::metrics::RELAY_PUBLISHED).increment(published);
        metrics::counter!(crate::metrics::RELAY_DUPLICATES).increment(ids.len() as u64 - published);
        Ok(RelayCounts { claimed: ids.len() as u64, published, duplicates: ids.len() as u64 - published })
    }

    /// Deletes published rows past the retention; returns how many.
    pub async fn prune(&self) -> Result<u64, RelayError> {
        let done = sqlx::query(
            "DELETE FROM dlq_outbox WHERE id IN (
                 SELECT id FROM dlq_outbox
                  WHERE published_at < now() - make_interval(secs => $1)
                  LIMIT 10000)",
        )
        .bind(self.config.retention.as_secs_f64())
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }

    /// Trims the replay stream below the oldest entry any group still needs (pending, or not
    /// yet delivered); returns the entries removed.
    pub async fn trim_replay(&mut self) -> Result<u64, RelayError> {
        trim_below_group_needs(&mut self.redis, &self.keys.replay()).await
    }

    /// Runs until `cancel`: passes back to back while there is work, otherwise waits for a
    /// notification or the poll interval; errors are logged and retried with backoff.
    pub async fn run(mut self, cancel: CancellationToken) {
        let mut listener = None;
        let mut backoff = Duration::from_millis(100);
        let mut last_maintenance = Instant::now() - Duration::from_secs(3600);
        while !cancel.is_cancelled() {
            if listener.is_none() {
                match PgListener::connect_with(&self.pool).await {
                    Ok(mut l) => match l.listen("embed_dlq_outbox").await {
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
                Err(e) => {
                    tracing::warn!(error = %e, "relay pass failed; retrying");
                    sleep_or_cancel(backoff, &cancel).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
            }
            if last_maintenance.elapsed() > Duration::from_secs(30) {
                last_maintenance = Instant::now();
                if let Err(e) = self.prune().await {
                    tracing::warn!(error = %e, "relay: pruning published outbox rows failed");
                }
                if let Err(e) = self.trim_replay().await {
                    tracing::warn!(error = %e, "relay: trimming the replay stream failed");
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
    }
}

/// Sleeps, or returns early on cancellation.
pub async fn sleep_or_cancel(d: Duration, cancel: &CancellationToken) {
    tokio::select! {
        _ = cancel.cancelled() => {}
        _ = tokio::time::sleep(d) => {}
    }
}

/// XTRIM MINID at the smallest id that some group still needs: its oldest pending entry, or
/// the entry after its last delivered one. Never trims anything a group has not acked.
pub async fn trim_below_group_needs(redis: &mut ConnectionManager, stream: &str) -> Result<u64, RelayError> {
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
