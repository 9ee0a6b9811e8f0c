//! Redis: the delivery and fan-out channel (Postgres stays the system of record).
//!
//! Structures, all under one configurable prefix wrapped in a hash tag so they share a slot
//! on Redis Cluster (default prefix `embed-dlq` → keys `{embed-dlq}:...`):
//!
//! | key | type | written by | read by |
//! | --- | --- | --- | --- |
//! | `{p}:events` | stream | relay (every park, resolve, replay, re-park, exhaustion) | `tail`, any consumer |
//! | `{p}:replay` | stream | relay (due replay work items) | group [`REPLAY_GROUP`] |
//! | `{p}:outbox:<event_id>` | string, TTL | `redis/publish.lua` (dedup marker → entry id) | `redis/publish.lua` |
//!
//! Stream entries carry `outbox_id`, `event_id`, `event` and `body` (the compact JSON envelope
//! from the outbox: ids, error class, attempts, timestamps — never the payload or a secret).
//! `event_id` is a random uuid per outbox row: unique across database restores, re-created
//! databases and deployments sharing a prefix (the outbox id is not), so consumers can
//! deduplicate by it, and the dedup marker is keyed by it.

pub mod conn;
pub mod work;

use std::time::Duration;

use redis::Script;

pub use conn::{RedisClient, RedisConn};
pub use work::WorkItem;

/// The consumer group of the replayers on the replay stream.
pub const REPLAY_GROUP: &str = "replayers";

/// Default key prefix.
pub const DEFAULT_PREFIX: &str = "embed-dlq";

/// Approximate length cap of the events stream (`XADD ... MAXLEN ~`): what the relay trims
/// to, and what the reconciler treats as "trimmed by policy" rather than lost.
pub const DEFAULT_EVENTS_MAXLEN: usize = 1_000_000;

/// The dedup-and-append script (`redis/publish.lua`).
pub(crate) fn publish_script() -> Script {
    Script::new(include_str!("../../redis/publish.lua"))
}

/// Every key name, derived from one prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamKeys {
    tag: String,
}

impl StreamKeys {
    /// `prefix` is wrapped in a hash tag: `{prefix}`.
    pub fn new(prefix: &str) -> Self {
        StreamKeys { tag: format!("{{{prefix}}}") }
    }

    /// Stream of every DLQ event.
    pub fn events(&self) -> String {
        format!("{}:events", self.tag)
    }

    /// Stream of due replay work, read by [`REPLAY_GROUP`].
    pub fn replay(&self) -> String {
        format!("{}:replay", self.tag)
    }

    /// Dedup marker of one outbox row, keyed by its `event_id` (never by the outbox id, which
    /// repeats across restores, re-created databases and deployments sharing a prefix).
    pub(crate) fn outbox_marker(&self, event_id: &str) -> String {
        format!("{}:outbox:{event_id}", self.tag)
    }

    /// The stream an outbox row's `stream` column names.
    pub(crate) fn for_outbox_stream(&self, stream: &str) -> String {
        match stream {
            "replay" => self.replay(),
            _ => self.events(),
        }
    }
}

impl Default for StreamKeys {
    fn default() -> Self {
        StreamKeys::new(DEFAULT_PREFIX)
    }
}

/// Opens a client for `url`: a single node, or a Redis Cluster when `url` lists several
/// comma-separated node URLs (use [`open`] to treat one seed URL as a cluster).
pub fn client(url: &str) -> redis::RedisResult<RedisClient> {
    RedisClient::open(url, false)
}

/// Opens a client for `urls`, in cluster mode if `cluster` is set or `urls` lists several
/// nodes (see [`RedisClient::open`]).
pub fn open(urls: &str, cluster: bool) -> redis::RedisResult<RedisClient> {
    RedisClient::open(urls, cluster)
}

/// A shared connection for ordinary (non-blocking) commands ([`RedisClient::managed`]).
pub async fn managed(client: &RedisClient) -> redis::RedisResult<RedisConn> {
    client.managed().await
}

/// A dedicated connection for blocking reads (`XREAD(GROUP) BLOCK`) whose response timeout
/// outlasts `block` ([`RedisClient::blocking`]): redis-rs gives every reply a 500 ms timeout
/// by default, which would cut a blocking read short, and a blocking read on a shared
/// connection would stall every other command on it.
pub async fn blocking(client: &RedisClient, block: Duration) -> redis::RedisResult<RedisConn> {
    client.blocking(block).await
}

/// Reads a field of a stream entry as a string.
pub fn field(map: &std::collections::HashMap<String, redis::Value>, name: &str) -> Option<String> {
    match map.get(name)? {
        redis::Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        redis::Value::SimpleString(s) => Some(s.clone()),
        redis::Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

/// A stream entry id as (milliseconds, sequence), for ordering comparisons.
pub fn parse_entry_id(id: &str) -> (u64, u64) {
    let (ms, seq) = id.split_once('-').unwrap_or((id, "0"));
    (ms.parse().unwrap_or(0), seq.parse().unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_share_one_hash_tag() {
        let k = StreamKeys::new("prod");
        assert_eq!(k.events(), "{prod}:events");
        assert_eq!(k.replay(), "{prod}:replay");
        assert_eq!(
            k.outbox_marker("0b6f0c52-8a56-4e0e-9b43-4c3f8e8d1a2b"),
            "{prod}:outbox:0b6f0c52-8a56-4e0e-9b43-4c3f8e8d1a2b"
        );
        assert_eq!(k.for_outbox_stream("replay"), k.replay());
        assert_eq!(k.for_outbox_stream("events"), k.events());
    }

    #[test]
    fn entry_ids_order_numerically() {
        assert!(parse_entry_id("1700000000000-10") > parse_entry_id("1700000000000-9"));
        assert!(parse_entry_id("1700000000001-0") > parse_entry_id("1700000000000-99"));
        assert_eq!(parse_entry_id("0-0"), (0, 0));
    }
}
