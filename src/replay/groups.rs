//! The replay stream's consumer groups: created where missing, and recreated when Redis lost
//! them, releasing at once the leases whose work lived only in the lost stream.

use super::*;

/// Creates the consumer group (and the stream) of every shard if missing.
pub async fn ensure_group(redis: &mut RedisConn, keys: &StreamKeys) -> Result<(), redis::RedisError> {
    for shard in keys.shard_ids() {
        ensure_group_of(redis, &keys.replay_of(shard)).await?;
    }
    Ok(())
}

/// Creates the consumer group of each of `shards` if missing, and returns how many were. A
/// group found missing means the stream is new or Redis lost its data (a FLUSHALL, a restart
/// without persistence, a failover to a replica that had not caught up): the leases of the
/// items that lived only there are released at once ([`release_lost_leases`]), so replay
/// resumes within a scheduler pass rather than a lease, and `data_lost` is woken (serve's
/// republisher puts the lost events back). Each shard's events stream shares its replay
/// stream's slot, so a missing group stands for both.
pub(crate) async fn recover_lost_groups(
    store: &Store,
    redis: &mut RedisConn,
    keys: &StreamKeys,
    shards: &[u16],
    data_lost: Option<&tokio::sync::Notify>,
) -> Result<usize, ReplayError> {
    let mut missing = 0;
    for &shard in shards {
        if !ensure_group_of(redis, &keys.replay_of(shard)).await? {
            continue;
        }
        missing += 1;
        if let Some(lost) = data_lost {
            lost.notify_one();
        }
        let released = release_lost_leases(store, keys, shard).await?;
        if released > 0 {
            metrics::counter!(crate::metrics::REPLAY_LEASES_RELEASED).increment(released);
            tracing::warn!(
                shard,
                released,
                "replay stream shard found without its consumer group (Redis lost its data?): \
                 released the leases of its lost work items; they are issued again"
            );
        }
    }
    Ok(missing)
}

/// Creates the consumer group (and the stream) of one replay stream if missing; true when it
/// was missing (the first start, or Redis lost the stream).
async fn ensure_group_of(redis: &mut RedisConn, stream: &str) -> Result<bool, redis::RedisError> {
    let r: redis::RedisResult<()> = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(stream)
        .arg(REPLAY_GROUP)
        .arg("0")
        .arg("MKSTREAM")
        .query_async(redis)
        .await;
    match r {
        Ok(()) => Ok(true),
        Err(e) if e.code() == Some("BUSYGROUP") => Ok(false),
        Err(e) => Err(e),
    }
}

/// Ends the leases of `shard` whose work items lived only in its replay stream (all of them
/// but items of older releases still waiting in the outbox), after the stream's consumer
/// group was found missing: those items are gone with it, and the scheduler issues them
/// again at its next pass. Returns the leases
/// ended. Leases are few (at most the outstanding cap), so they are read page by page and
/// matched to the shard here.
pub(crate) async fn release_lost_leases(
    store: &Store,
    keys: &StreamKeys,
    shard: u16,
) -> Result<u64, StoreError> {
    const PAGE: usize = 1000;
    let (mut after, mut released) = (0i64, 0u64);
    loop {
        let page = store.published_leases(after, PAGE).await?;
        let Some(last) = page.last() else { break };
        after = last.0;
        let ids: Vec<i64> = page
            .iter()
            .filter(|(_, table, doc, idx)| keys.shard_of(table, doc, *idx) == shard)
            .map(|(id, ..)| *id)
            .collect();
        if !ids.is_empty() {
            released += store.release_leases(&ids).await?;
        }
        if page.len() < PAGE {
            break;
        }
    }
    Ok(released)
}
