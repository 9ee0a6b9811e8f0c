//! `tail`: follow the events stream (every park, resolve, replay, re-park, exhaustion) from
//! now, from an id, or from a checkpoint file that makes it resumable without gaps (the last
//! delivered id is saved after every batch, once the sink has flushed it). The events are
//! handed to an [`EventSink`]; how they look (human lines, JSON) is the caller's business.

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
    let mut last = start_id(&mut conn, keys, opts).await;
    let mut delivered = 0u64;
    loop {
        let mut cmd = redis::cmd("XREAD");
        cmd.arg("COUNT").arg(500);
        if !opts.no_follow {
            cmd.arg("BLOCK").arg(block.as_millis() as u64);
        }
        cmd.arg("STREAMS").arg(keys.events()).arg(&last);
        let reply: StreamReadReply = tokio::select! {
            _ = cancel.cancelled() => return Ok(delivered),
            r = cmd.query_async(&mut conn) => match r {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(error = %e, "tail: read failed; reconnecting");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    conn = streams::blocking(client, block).await.map_err(TailError::Reconnect)?;
                    continue;
                }
            },
        };
        let entries: Vec<_> = reply.keys.into_iter().flat_map(|k| k.ids).collect();
        if entries.is_empty() && opts.no_follow {
            return Ok(delivered);
        }
        for e in entries {
            let event = TailEvent {
                body: field(&e.map, "body").unwrap_or_default(),
                event: field(&e.map, "event").unwrap_or_default(),
                id: e.id,
            };
            sink.event(&event).map_err(TailError::Sink)?;
            last = event.id;
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

/// Where reading starts: the checkpoint's id if it holds one, else `from`, with `$` resolved
/// to the stream's last id so that a reconnect does not skip events.
async fn start_id(conn: &mut RedisConn, keys: &StreamKeys, opts: &TailOptions) -> String {
    let mut last = match &opts.checkpoint {
        Some(p) => match std::fs::read_to_string(p) {
            Ok(s) if !s.trim().is_empty() => s.trim().to_string(),
            _ => opts.from.clone(),
        },
        None => opts.from.clone(),
    };
    if last == "$" {
        let info: redis::RedisResult<redis::streams::StreamInfoStreamReply> =
            redis::cmd("XINFO").arg("STREAM").arg(keys.events()).query_async(conn).await;
        last = info.map(|i| i.last_generated_id).unwrap_or_else(|_| "0-0".into());
    }
    last
}

/// Records the last delivered id in `path`, atomically (write aside, then rename).
fn save_checkpoint(path: &std::path::Path, last: &str) -> Result<(), TailError> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, last).and_then(|_| std::fs::rename(&tmp, path)).map_err(TailError::Checkpoint)
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
}
