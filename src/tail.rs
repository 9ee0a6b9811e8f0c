//! `tail`: follow the events stream (every park, resolve, replay, re-park, exhaustion) from
//! now, from an id, or from a checkpoint file that makes it resumable without gaps (the last
//! delivered id is saved after every batch, once the sink has flushed it). The events are
//! handed to an [`EventSink`]; how they look (human lines, JSON) is the caller's business.
//!
//! With sharded streams it follows every shard (one `XREAD` per shard: a read across shards
//! would cross slots) and merges each round's entries by entry id; the events of one chunk
//! are in one shard, so their order holds. The checkpoint holds one last id per shard: a
//! bare id with one shard (the format of every release before sharding), else a
//! `stream_shards N` line and N ids in shard order.

use std::path::PathBuf;
use std::time::Duration;

use redis::streams::StreamReadReply;
use tokio_util::sync::CancellationToken;

use crate::streams::{self, RedisClient, RedisConn, StreamKeys, field};

/// What to follow.
#[derive(Debug, Clone)]
pub struct TailOptions {
    /// `$` (only new events), `0` (from the beginning) or an entry id (exclusive).
    pub from: String,
    /// Resume from (and save to) this file.
    pub checkpoint: Option<PathBuf>,
    /// Stop after this many events.
    pub count: Option<u64>,
    /// Stop once caught up instead of waiting for more.
    pub no_follow: bool,
}

/// One entry of the events stream, as published by the relay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TailEvent {
    /// The stream entry id (`ms-seq`): where a resumed tail continues.
    pub id: String,
    /// The event name (`parked`, `replayed`, ...).
    pub event: String,
    /// The event's JSON body as published (it carries user data such as doc ids).
    pub body: String,
}

impl TailEvent {
    /// The event as one JSON object: its body, with the stream id and the event name added
    /// (an unparsable body becomes `null`).
    pub fn to_json(&self) -> serde_json::Value {
        let mut v: serde_json::Value = serde_json::from_str(&self.body).unwrap_or(serde_json::Value::Null);
        if let Some(o) = v.as_object_mut() {
            o.insert("stream_id".into(), self.id.clone().into());
            o.entry("event").or_insert_with(|| self.event.clone().into());
        }
        v
    }
}

/// Where [`tail`] delivers events. The checkpoint is saved only after [`EventSink::flush`]
/// succeeded, so a restart neither skips nor repeats what the sink received.
pub trait EventSink {
    /// Receives one event, in stream order.
    fn event(&mut self, event: &TailEvent) -> std::io::Result<()>;
    /// Makes every event received so far durable or visible (called after each batch).
    fn flush(&mut self) -> std::io::Result<()>;
}

/// Collects events in memory (for library callers and tests).
impl EventSink for Vec<TailEvent> {
    fn event(&mut self, event: &TailEvent) -> std::io::Result<()> {
        self.push(event.clone());
        Ok(())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Why `tail` stopped before its end.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TailError {
    /// The Redis URL does not parse.
    #[error("bad Redis URL: {0}")]
    BadUrl(#[source] redis::RedisError),
    /// The first connection failed.
    #[error("cannot connect to Redis: {0}")]
    Connect(#[source] redis::RedisError),
    /// A read failed and the connection could not be re-established.
    #[error("cannot reconnect to Redis: {0}")]
    Reconnect(#[source] redis::RedisError),
    /// The sink failed to take or flush events.
    #[error("{0}")]
    Sink(#[source] std::io::Error),
    /// The checkpoint file could not be written.
    #[error("{0}")]
    Checkpoint(#[source] std::io::Error),
    /// The checkpoint file holds something else than this tail's positions (another shard
    /// count, or garbage): resuming from it could skip or repeat events.
    #[error("checkpoint {path}: {problem}")]
    BadCheckpoint {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        problem: String,
    },
    /// The streams were set up with another shard count, or Redis failed while checking it.
    #[error("{0}")]
    Shards(#[source] crate::streams::ShardsError),
}

/// A `--from` value that is not `$`, `0` or a stream entry id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not `$`, `0` or a stream entry id like 1700000000000-0")]
pub struct InvalidFrom(pub String);

/// Checks a `--from` value: `$`, `0`, or a stream entry id (`ms` or `ms-seq`), so a typo is a
/// usage error rather than a Redis error on every read.
pub fn check_from(from: &str) -> Result<(), InvalidFrom> {
    let digits = |s: &str| {
        !s.is_empty() && s.len() <= 20 && s.bytes().all(|b| b.is_ascii_digit()) && s.parse::<u64>().is_ok()
    };
    let ok = from == "$"
        || match from.split_once('-') {
            Some((ms, seq)) => digits(ms) && digits(seq),
            None => digits(from),
        };
    if ok { Ok(()) } else { Err(InvalidFrom(from.to_string())) }
}

/// Delivers events to `sink` until cancelled, caught up (`no_follow`) or `count` is reached;
/// returns how many were delivered.
pub async fn tail(
    client: &RedisClient,
    keys: &StreamKeys,
    opts: &TailOptions,
    sink: &mut (dyn EventSink + Send),
    cancel: CancellationToken,
) -> Result<u64, TailError> {
    let block = Duration::from_secs(2);
    let mut conn = streams::blocking(client, block).await.map_err(TailError::Connect)?;
    streams::check_shards(&mut conn, keys).await.map_err(TailError::Shards)?;
    let shards = keys.shards();
    let mut last = start_ids(&mut conn, keys, opts).await?;
    // Several shards: a non-blocking read of each, then (nothing anywhere) a blocking read of
    // one in turn for its share of `block`, so a new event waits at most about `block`.
    let block_one = (block / u32::from(shards)).max(Duration::from_millis(10));
    let mut idle_turn = 0u16;
    let mut delivered = 0u64;
    loop {
        let read = async {
            let mut entries = Vec::new();
            if shards > 1 {
                for shard in keys.shard_ids() {
                    entries.extend(read_shard(&mut conn, keys, shard, &last, None).await?);
                }
            }
            if entries.is_empty() && !opts.no_follow {
                let shard = idle_turn % shards;
                idle_turn = idle_turn.wrapping_add(1);
                entries = read_shard(
                    &mut conn,
                    keys,
                    shard,
                    &last,
                    Some(if shards > 1 { block_one } else { block }),
                )
                .await?;
            } else if entries.is_empty() && shards == 1 {
                entries = read_shard(&mut conn, keys, 0, &last, None).await?;
            }
            Ok::<_, redis::RedisError>(entries)
        };
        let mut entries = tokio::select! {
            _ = cancel.cancelled() => return Ok(delivered),
            r = read => match r {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(error = %e, "tail: read failed; reconnecting");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    conn = streams::blocking(client, block).await.map_err(TailError::Reconnect)?;
                    continue;
                }
            },
        };
        if entries.is_empty() && opts.no_follow {
            return Ok(delivered);
        }
        // Merged by entry id (the shards' ids come from their masters' clocks: the order
        // across shards is by time, approximately; within a shard it is exact).
        entries.sort_by_key(|(shard, e)| (streams::parse_entry_id(&e.id), *shard));
        for (shard, e) in entries {
            let event = TailEvent {
                body: field(&e.map, "body").unwrap_or_default(),
                event: field(&e.map, "event").unwrap_or_default(),
                id: e.id,
            };
            sink.event(&event).map_err(TailError::Sink)?;
            last[usize::from(shard)] = event.id;
            delivered += 1;
            if opts.count.is_some_and(|c| delivered >= c) {
                break;
            }
        }
        sink.flush().map_err(TailError::Sink)?;
        if let Some(p) = &opts.checkpoint {
            save_checkpoint(p, &last)?;
        }
        if opts.count.is_some_and(|c| delivered >= c) {
            return Ok(delivered);
        }
    }
}

/// Up to 500 entries of shard `shard` after its last delivered id, blocking up to `block`
/// if given.
async fn read_shard(
    conn: &mut RedisConn,
    keys: &StreamKeys,
    shard: u16,
    last: &[String],
    block: Option<Duration>,
) -> redis::RedisResult<Vec<(u16, redis::streams::StreamId)>> {
    let mut cmd = redis::cmd("XREAD");
    cmd.arg("COUNT").arg(500);
    if let Some(block) = block {
        cmd.arg("BLOCK").arg(block.as_millis() as u64);
    }
    cmd.arg("STREAMS").arg(keys.events_of(shard)).arg(&last[usize::from(shard)]);
    let reply: StreamReadReply = cmd.query_async(conn).await?;
    Ok(reply.keys.into_iter().flat_map(|k| k.ids).map(|e| (shard, e)).collect())
}

/// Where reading starts, per shard: the checkpoint's ids if it holds some, else `from` for
/// every shard, with `$` resolved to each stream's last id so that a reconnect does not skip
/// events.
async fn start_ids(
    conn: &mut RedisConn,
    keys: &StreamKeys,
    opts: &TailOptions,
) -> Result<Vec<String>, TailError> {
    let shards = usize::from(keys.shards());
    let saved = match &opts.checkpoint {
        Some(p) => match std::fs::read_to_string(p) {
            Ok(s) if !s.trim().is_empty() => Some(
                parse_checkpoint(&s, shards)
                    .map_err(|problem| TailError::BadCheckpoint { path: p.clone(), problem })?,
            ),
            _ => None,
        },
        None => None,
    };
    let mut last = saved.unwrap_or_else(|| vec![opts.from.clone(); shards]);
    for (shard, id) in keys.shard_ids().zip(last.iter_mut()) {
        if id == "$" {
            let info: redis::RedisResult<redis::streams::StreamInfoStreamReply> =
                redis::cmd("XINFO").arg("STREAM").arg(keys.events_of(shard)).query_async(conn).await;
            *id = info.map(|i| i.last_generated_id).unwrap_or_else(|_| "0-0".into());
        }
    }
    Ok(last)
}

/// The per-shard ids of a checkpoint written for `shards` shards.
fn parse_checkpoint(text: &str, shards: usize) -> Result<Vec<String>, String> {
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    let first = lines.next().unwrap_or_default();
    let ids: Vec<String> = match first.strip_prefix("stream_shards ") {
        None => vec![first.to_string()],
        Some(n) => {
            let n: usize = n.trim().parse().map_err(|_| format!("bad header {first:?}"))?;
            let ids: Vec<String> = lines.map(str::to_string).collect();
            if ids.len() != n {
                return Err(format!("header says {n} shards but it holds {} ids", ids.len()));
            }
            ids
        }
    };
    if ids.len() != shards {
        return Err(format!(
            "it was written for {} shard(s), the streams have {shards}: resuming from it could skip or repeat events \
             (start a new checkpoint file, with --from)",
            ids.len()
        ));
    }
    if let Some(bad) = ids.iter().find(|id| check_from(id).is_err() || *id == "$") {
        return Err(format!("{bad:?} is not a stream entry id"));
    }
    Ok(ids)
}

/// The checkpoint text of `last`: the bare id with one shard, else a header and the ids.
fn checkpoint_text(last: &[String]) -> String {
    match last {
        [one] => one.clone(),
        many => format!("stream_shards {}\n{}\n", many.len(), many.join("\n")),
    }
}

/// Records the last delivered id of every shard in `path`, atomically (write aside, then
/// rename).
fn save_checkpoint(path: &std::path::Path, last: &[String]) -> Result<(), TailError> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, checkpoint_text(last))
        .and_then(|_| std::fs::rename(&tmp, path))
        .map_err(TailError::Checkpoint)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_values() {
        for ok in ["$", "0", "0-0", "1700000000000-3", "18446744073709551615-18446744073709551615"] {
            assert!(check_from(ok).is_ok(), "{ok}");
        }
        for bad in ["", "now", "-1", "1-", "1-2-3", "18446744073709551616", "$$"] {
            assert!(check_from(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn checkpoints_hold_one_id_per_shard_and_refuse_another_count() {
        let one = vec!["1700000000000-3".to_string()];
        assert_eq!(checkpoint_text(&one), "1700000000000-3", "one shard: the format of every release");
        assert_eq!(parse_checkpoint("1700000000000-3\n", 1).unwrap(), one);
        let four: Vec<String> = ["1-0", "0-0", "5-2", "7-1"].map(String::from).to_vec();
        assert_eq!(parse_checkpoint(&checkpoint_text(&four), 4).unwrap(), four);
        assert!(parse_checkpoint(&checkpoint_text(&four), 2).unwrap_err().contains("written for 4 shard(s)"));
        assert!(parse_checkpoint("1700000000000-3", 4).unwrap_err().contains("written for 1 shard(s)"));
        assert!(parse_checkpoint("stream_shards 2\n1-0\n", 2).is_err());
        assert!(parse_checkpoint("garbage", 1).is_err());
    }
}
