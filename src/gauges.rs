//! The gauges `serve` samples every few seconds and the console shows: DLQ depth and
//! schedule, the outbox backlog, the last reconcile and each stream's length, pending and
//! lag. It reads every stage's tables and streams, so it sits above them; the metric names
//! and the exporter stay in [`crate::metrics`], which every stage records into.

use crate::metrics::*;
use crate::store::Store;
pub use crate::store::dlq::{DlqGauges, SCHEDULE_COUNT_CAP, Schedule};
use crate::streams::{REPLAY_GROUP, RedisConn, StreamKeys};
use metrics::gauge;

/// Why a sample could not be taken.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GaugesError {
    /// A sampling query failed.
    #[error("{0}")]
    Database(#[from] crate::store::StoreError),
    /// A sampling read of a stream failed.
    #[error("{0}")]
    Redis(#[from] redis::RedisError),
}

/// The DLQ gauges as `serve` exports them every 5 s, read on `conn`: counters kept by triggers, an
/// index range scan of at most [`SCHEDULE_COUNT_CAP`] rows and two index first entries, so
/// the cost is the same over 10,000 rows as over 1,000,000 (see BENCHMARKS.md).
pub async fn dlq_gauges(conn: &mut sqlx::PgConnection) -> Result<DlqGauges, GaugesError> {
    Ok(crate::store::dlq::gauges(conn).await?)
}

/// Samples the DLQ, outbox and stream gauges (statements whose cost does not grow with the
/// DLQ; the outbox's follows its unpublished backlog).
pub(crate) async fn sample(
    store: &Store,
    redis: Option<&mut RedisConn>,
    keys: &StreamKeys,
) -> Result<(), GaugesError> {
    let pool = store.pool();
    let g = dlq_gauges(&mut *pool.acquire().await.map_err(crate::store::StoreError::from)?).await?;
    for (class, n) in &g.depth {
        gauge!(DLQ_DEPTH, "error_class" => class.as_str()).set(*n as f64);
    }
    let r = g.schedule;
    gauge!(DLQ_READY).set(r.ready as f64);
    gauge!(DLQ_BACKING_OFF).set(r.backing_off as f64);
    gauge!(DLQ_EXHAUSTED).set(r.exhausted as f64);
    gauge!(DLQ_OLDEST_AGE).set(r.oldest_secs);
    gauge!(DLQ_NEXT_DUE).set(r.next_due_secs);
    // Only the count and the age are exported; what counts as stuck is the reconciler's call.
    let o = crate::relay::sql::backlog(pool, std::time::Duration::ZERO).await?;
    gauge!(OUTBOX_BACKLOG).set(o.unpublished as f64);
    gauge!(OUTBOX_OLDEST_AGE).set(o.oldest_secs);
    let last = crate::reconcile::sql::last_run_finished(pool).await?;
    if let Some(t) = last {
        gauge!(RECONCILE_LAST_SUCCESS).set(t);
    }
    // Sampled here too, not only by the follower: a follower that is down is when the lag
    // matters, and its own gauges went with it.
    match crate::store::table_source::lags(pool).await {
        Ok(lags) => {
            for (name, changes, age) in lags {
                crate::metrics::table_source_lag(&name, changes, age);
            }
        }
        Err(e) => tracing::warn!(error = %e, "table source lag not sampled"),
    }
    if let Some(redis) = redis {
        for shard in keys.shard_ids() {
            sample_shard(redis, keys, shard).await?;
        }
    }
    Ok(())
}

/// How often `serve` samples the revision gauges ([`sample_revisions`]): a coverage count
/// reads the manifests of two revisions (about a second at 1M chunks), too much for every
/// 5 s sample.
pub const REVISION_SAMPLE_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

/// Samples each revision of every target with revisions ([`crate::store::revision::numbers`]):
/// whether it is active, its chunks, its DLQ rows and how much of the active revision it
/// covers (the coverage `revision activate` requires). A retired revision's gauges read 0.
/// Returns the revisions sampled.
pub async fn sample_revisions(pool: &sqlx::PgPool) -> Result<usize, GaugesError> {
    let all = crate::store::revision::numbers(pool, None).await?;
    for n in &all {
        let r = &n.revision;
        let labels = [("target", r.target.clone()), ("revision", r.revision.to_string())];
        let set = |name: &'static str, v: f64| gauge!(name, &labels).set(v);
        let retired = r.state == "retired";
        set(REVISION_ACTIVE, if r.state == "active" { 1.0 } else { 0.0 });
        set(REVISION_CHUNKS, if retired { 0.0 } else { n.chunks as f64 });
        set(REVISION_DLQ_ROWS, if retired { 0.0 } else { n.dlq_rows as f64 });
        let (uncovered, ratio) = match &n.coverage {
            _ if retired => (0.0, 0.0),
            Some(c) => (c.uncovered() as f64, n.covered_ratio()),
            None => (0.0, 1.0),
        };
        set(REVISION_UNCOVERED, uncovered);
        set(REVISION_COVERED_RATIO, ratio);
    }
    Ok(all.len())
}

/// The stream gauges of one shard (one pipeline: one slot), labelled with its index.
async fn sample_shard(redis: &mut RedisConn, keys: &StreamKeys, shard: u16) -> Result<(), GaugesError> {
    let label = shard_label(shard);
    let (events, replay): (u64, u64) = redis::pipe()
        .cmd("XLEN")
        .arg(keys.events_of(shard))
        .cmd("XLEN")
        .arg(keys.replay_of(shard))
        .query_async(redis)
        .await?;
    gauge!(STREAM_LENGTH, "stream" => "events", "shard" => label.clone()).set(events as f64);
    gauge!(STREAM_LENGTH, "stream" => "replay", "shard" => label.clone()).set(replay as f64);
    let groups: redis::RedisResult<redis::streams::StreamInfoGroupsReply> =
        redis::cmd("XINFO").arg("GROUPS").arg(keys.replay_of(shard)).query_async(redis).await;
    let group = groups.ok().and_then(|g| g.groups.into_iter().find(|g| g.name == REPLAY_GROUP));
    let (pending, lag) = group.map_or((0, 0), |g| (g.pending, g.lag.unwrap_or(0)));
    gauge!(STREAM_PENDING, "stream" => "replay", "shard" => label.clone()).set(pending as f64);
    gauge!(STREAM_LAG, "stream" => "replay", "shard" => label).set(lag as f64);
    Ok(())
}

/// The `shard` label value: the shard's index, `0` to `stream_shards - 1` (at most 256
/// values, [`crate::streams::MAX_SHARDS`]).
fn shard_label(shard: u16) -> String {
    shard.to_string()
}

/// One stream of one shard: what the console's overview (and any per-shard view) lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamRef {
    /// The shard's label (`0` while the streams are not sharded): a small, bounded set.
    pub shard: String,
    /// `events` or `replay`.
    pub stream: &'static str,
    /// The Redis key.
    pub key: String,
}

/// Every stream of the deployment under `keys`, per shard: the one place that lists them,
/// so every view built on [`stream_stats`] shows each shard.
pub fn stream_refs(keys: &StreamKeys) -> Vec<StreamRef> {
    keys.shard_ids()
        .flat_map(|shard| {
            [
                StreamRef { shard: shard_label(shard), stream: "events", key: keys.events_of(shard) },
                StreamRef { shard: shard_label(shard), stream: "replay", key: keys.replay_of(shard) },
            ]
        })
        .collect()
}

/// The numbers of one stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamStats {
    /// Which stream.
    pub stream: StreamRef,
    /// Entries in it (`XLEN`).
    pub length: u64,
    /// For the replay stream: entries delivered to [`REPLAY_GROUP`] and not acknowledged
    /// (`None`: no group yet, or not the replay stream).
    pub pending: Option<u64>,
    /// For the replay stream: entries not yet delivered to the group (`None` as above, or a
    /// Redis too old to report it).
    pub lag: Option<u64>,
}

/// Length, pending and lag of each stream in `refs`: the one function that reads these
/// numbers from Redis for a view (a missing stream has length 0 and no group).
pub async fn stream_stats(
    redis: &mut RedisConn,
    refs: &[StreamRef],
) -> Result<Vec<StreamStats>, redis::RedisError> {
    let mut out = Vec::with_capacity(refs.len());
    for r in refs {
        let length: u64 = redis::cmd("XLEN").arg(&r.key).query_async(redis).await?;
        let (mut pending, mut lag) = (None, None);
        if r.stream == "replay" && length > 0 {
            let groups: redis::RedisResult<redis::streams::StreamInfoGroupsReply> =
                redis::cmd("XINFO").arg("GROUPS").arg(&r.key).query_async(redis).await;
            if let Ok(groups) = groups
                && let Some(g) = groups.groups.iter().find(|g| g.name == REPLAY_GROUP)
            {
                pending = Some(g.pending as u64);
                lag = g.lag.map(|l| l as u64);
            }
        }
        out.push(StreamStats { stream: r.clone(), length, pending, lag });
    }
    Ok(out)
}
