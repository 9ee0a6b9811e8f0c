//! Redis: the delivery and fan-out channel (Postgres stays the system of record).
//!
//! Structures, under one configurable prefix (default `embed-dlq`), split into
//! `stream_shards` shards (default 1). Each shard's keys share one hash tag, so every
//! multi-key step (the publish script, `XREADGROUP` on one stream) stays in one slot of a
//! Redis Cluster, while different shards land on different slots and so on different
//! masters. With one shard the tag is the prefix itself (`{embed-dlq}:...`, the names of
//! every release before sharding); with N > 1 shard `i` is tagged `{prefix:sII-k}`, where the
//! smallest `k` puts the tag's slot in the middle of the `i`-th of N equal slot ranges, so
//! the shards spread evenly over masters that own equal slot ranges (what
//! `redis-cli --cluster create` makes). The rule is fixed: key names never move.
//!
//! | key | type | written by | read by |
//! | --- | --- | --- | --- |
//! | `{tag}:events` | stream | relay (every park, resolve, replay, re-park, exhaustion) | `tail`, any consumer |
//! | `{tag}:replay` | stream | the scheduler (due replay work items, fields `event` = `replay` and `body`; the relay for items of older releases left in the outbox) | group [`REPLAY_GROUP`] |
//! | `{tag}:published:<YYYYMMDDHH>` | hash, TTL | `redis/publish.lua` (dedup records of the events of rows created that hour: `event_id` → entry id) | `redis/publish.lua`, the reconciler (deletes a record to publish again) |
//! | `{tag}:outbox:<event_id>` | string, TTL | releases before migration 0011 (dedup marker → entry id) | `redis/publish.lua`, for rows created before it |
//! | `{prefix}:meta` | hash | the first `serve`/`tail`/`reconcile` ([`check_shards`]) | every later one: `stream_shards` |
//!
//! A row maps to its shard by a stable hash of its identity (target table, doc id, chunk
//! index: [`StreamKeys::shard_of`]), so every event and work item of one chunk goes to one
//! shard, in order.
//!
//! Stream entries carry `outbox_id`, `event_id`, `event` and `body` (the compact JSON envelope
//! from the outbox: ids, error class, attempts, timestamps — never the payload or a secret).
//! `event_id` is a random uuid per outbox row: unique across database restores, re-created
//! databases and deployments sharing a prefix (the outbox id is not), so consumers can
//! deduplicate by it, and the dedup record is keyed by it.

pub mod conn;
pub mod work;

use std::time::Duration;

use redis::Script;

pub use conn::{RedisClient, RedisConn};
pub(crate) use conn::{is_lost_group, is_transient_redis};
pub use work::WorkItem;

/// The consumer group of the replayers on the replay stream.
pub const REPLAY_GROUP: &str = "replayers";

/// Default key prefix.
pub const DEFAULT_PREFIX: &str = "embed-dlq";

/// Approximate length cap of the events stream (`XADD ... MAXLEN ~`): what the relay trims
/// to, and what the reconciler treats as "trimmed by policy" rather than lost.
pub const DEFAULT_EVENTS_MAXLEN: usize = 1_000_000;

/// Default `outstanding_max` of the replay scheduler, and so the replay stream's length cap:
/// a few seconds of replay at the rates measured here, a few MB of Redis (BENCHMARKS.md).
/// Here, beside the events stream's cap, because the relay (which trims the stream) and the
/// scheduler (which fills it) both need it.
pub const DEFAULT_OUTSTANDING_MAX: usize = 10_000;

/// The dedup-and-append script (`redis/publish.lua`): publishes a batch of outbox rows of one
/// shard, each at most once, and returns every row's entry id in order.
pub(crate) fn publish_script() -> Script {
    Script::new(include_str!("../../redis/publish.lua"))
}

/// Most stream shards (`[serve] stream_shards`): each is a consumer group's stream and a
/// per-shard loop in every replayer, `tail` and gauge sampler.
pub const MAX_SHARDS: u16 = 256;

/// Redis Cluster's number of hash slots.
const CLUSTER_SLOTS: u32 = 16384;

/// Every key name, derived from one prefix and the number of shards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamKeys {
    prefix: String,
    /// One hash tag per shard (`{prefix}` alone when there is one shard).
    tags: Vec<String>,
}

impl StreamKeys {
    /// The unsharded layout: `prefix` is wrapped in a hash tag, `{prefix}`.
    pub fn new(prefix: &str) -> Self {
        StreamKeys::with_shards(prefix, 1)
    }

    /// `shards` shards (clamped to `1..=`[`MAX_SHARDS`]) under `prefix`; one shard is
    /// [`StreamKeys::new`]'s layout.
    pub fn with_shards(prefix: &str, shards: u16) -> Self {
        let shards = shards.clamp(1, MAX_SHARDS);
        let tags = if shards == 1 {
            vec![format!("{{{prefix}}}")]
        } else {
            (0..shards).map(|i| format!("{{{}}}", shard_tag(prefix, i, shards))).collect()
        };
        StreamKeys { prefix: prefix.to_string(), tags }
    }

    /// The prefix the keys derive from.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Number of shards.
    pub fn shards(&self) -> u16 {
        self.tags.len() as u16
    }

    /// Every shard index, `0..shards`.
    pub fn shard_ids(&self) -> std::ops::Range<u16> {
        0..self.shards()
    }

    /// The events stream: the only one when unsharded, else shard 0's (see
    /// [`StreamKeys::events_of`]).
    pub fn events(&self) -> String {
        self.events_of(0)
    }

    /// The replay stream: the only one when unsharded, else shard 0's (see
    /// [`StreamKeys::replay_of`]).
    pub fn replay(&self) -> String {
        self.replay_of(0)
    }

    /// Stream of every DLQ event of shard `shard`.
    pub fn events_of(&self, shard: u16) -> String {
        format!("{}:events", self.tag(shard))
    }

    /// Stream of due replay work of shard `shard`, read by [`REPLAY_GROUP`].
    pub fn replay_of(&self, shard: u16) -> String {
        format!("{}:replay", self.tag(shard))
    }

    /// The hash recording the shard count these streams were set up with ([`check_shards`]);
    /// in the unsharded tag's slot.
    pub fn meta(&self) -> String {
        format!("{{{}}}:meta", self.prefix)
    }

    /// The hash recording which events of shard `shard` created in hour `hour` (UTC,
    /// `YYYYMMDDHH`) were published: field = `event_id` (never the outbox id, which repeats
    /// across restores, re-created databases and deployments sharing a prefix), value = the
    /// entry id. In the shard's slot: the publish script writes it and the streams together.
    /// An hour bounds one hash (and the work of freeing it when it expires).
    pub(crate) fn dedup_hash(&self, shard: u16, hour: &str) -> String {
        format!("{}:published:{hour}", self.tag(shard))
    }

    /// The dedup marker an older relay (before migration 0011) wrote per event: still looked
    /// at for rows created before the upgrade, and deleted with the hash field on a republish.
    pub(crate) fn legacy_marker(&self, shard: u16, event_id: &str) -> String {
        format!("{}:outbox:{event_id}", self.tag(shard))
    }

    /// The shard of a chunk: a stable hash (the first 8 bytes of SHA-256) of its identity
    /// (canonical target table, doc id, chunk index), modulo the shard count. Every event and
    /// work item of one chunk maps to one shard, whatever process publishes it.
    pub fn shard_of(&self, table: &str, doc_id: &str, chunk_index: i32) -> u16 {
        let shards = self.shards();
        if shards == 1 {
            return 0;
        }
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(table.as_bytes());
        h.update([0u8]);
        h.update(doc_id.as_bytes());
        h.update([0u8]);
        h.update(chunk_index.to_be_bytes());
        let d = h.finalize();
        let n = u64::from_be_bytes(d[..8].try_into().expect("8 bytes"));
        (n % u64::from(shards)) as u16
    }

    fn tag(&self, shard: u16) -> &str {
        &self.tags[usize::from(shard).min(self.tags.len() - 1)]
    }
}

impl Default for StreamKeys {
    fn default() -> Self {
        StreamKeys::new(DEFAULT_PREFIX)
    }
}

/// The hash tag (without braces) of shard `i` of `n`: `prefix:sII-k` with the smallest `k`
/// whose slot lies in the middle half of the `i`-th of `n` equal slot ranges.
fn shard_tag(prefix: &str, i: u16, n: u16) -> String {
    let width = CLUSTER_SLOTS / u32::from(n);
    let lo = u32::from(i) * width + width / 4;
    let hi = lo + (width / 2).max(1);
    (0u32..)
        .map(|k| format!("{prefix}:s{i:02}-{k}"))
        .find(|tag| (lo..hi).contains(&u32::from(slot(tag.as_bytes()))))
        .expect("some suffix lands in any range of at least 32 slots")
}

/// The Redis Cluster slot of a key (CRC16/XMODEM of its hash tag, or of the whole key, modulo
/// 16384), as `CLUSTER KEYSLOT` computes it.
pub fn slot(key: &[u8]) -> u16 {
    let tagged = key.iter().position(|&b| b == b'{').and_then(|open| {
        let close = key[open + 1..].iter().position(|&b| b == b'}')?;
        (close > 0).then(|| &key[open + 1..open + 1 + close])
    });
    crc16::State::<crc16::XMODEM>::calculate(tagged.unwrap_or(key)) % (CLUSTER_SLOTS as u16)
}

/// The shard count of `keys` differs from the one its streams were set up with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the streams under prefix {prefix:?} were set up with {recorded} shard(s) (recorded in {meta}); \
     this process is configured with stream_shards = {configured}. The shard count cannot change \
     while the streams are in use: keep {recorded}, or switch to a new stream_prefix with the new \
     count and run `embed-dlq reconcile --repair` once (see docs/SCALING.md, \"Sharded streams\")"
)]
pub struct ShardMismatch {
    /// The stream prefix.
    pub prefix: String,
    /// The meta key holding the recorded count.
    pub meta: String,
    /// The count the streams were set up with.
    pub recorded: u16,
    /// The count this process was given.
    pub configured: u16,
}

/// Why [`check_shards`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShardsError {
    /// The recorded shard count is another one.
    #[error(transparent)]
    Mismatch(#[from] ShardMismatch),
    /// Redis could not be asked.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
}

/// Checks that the streams under `keys`'s prefix are laid out with `keys`'s shard count, and
/// records it on first use (`HSETNX {prefix}:meta stream_shards N`). Streams from before
/// the count was recorded are unsharded: if the unsharded replay or events stream exists, the
/// recorded count is 1. Every `serve`, `tail` and `reconcile` runs this at start, so a
/// process with another count refuses to run instead of publishing to, or reading from,
/// streams nobody else uses.
pub async fn check_shards(conn: &mut RedisConn, keys: &StreamKeys) -> Result<(), ShardsError> {
    let meta = keys.meta();
    let recorded: Option<u16> = redis::cmd("HGET").arg(&meta).arg("stream_shards").query_async(conn).await?;
    let recorded = match recorded {
        Some(n) => n,
        None => {
            let legacy = StreamKeys::new(keys.prefix());
            let mut old = 0;
            for key in [legacy.replay(), legacy.events()] {
                old += redis::cmd("EXISTS").arg(key).query_async::<u64>(conn).await?;
            }
            let count = if old > 0 { 1 } else { keys.shards() };
            let _: bool =
                redis::cmd("HSETNX").arg(&meta).arg("stream_shards").arg(count).query_async(conn).await?;
            redis::cmd("HGET")
                .arg(&meta)
                .arg("stream_shards")
                .query_async::<Option<u16>>(conn)
                .await?
                .unwrap_or(count)
        }
    };
    if recorded != keys.shards() {
        return Err(ShardMismatch {
            prefix: keys.prefix().to_string(),
            meta,
            recorded,
            configured: keys.shards(),
        }
        .into());
    }
    Ok(())
}

/// Identifies the server holding each shard's streams (`redis/server_id.lua`: the run id of
/// the server the shard's key routes to), in shard order; `None` where the server gave none.
/// Another id under a shard than the one seen before means a failover or a restart put
/// another copy of the data there, possibly older: serve compares them to find lost Redis
/// data whose consumer groups survived (a replica that had not caught up). One call per
/// shard.
pub async fn shard_servers(
    conn: &mut RedisConn,
    keys: &StreamKeys,
) -> redis::RedisResult<Vec<Option<String>>> {
    let script = server_id_script();
    let mut ids = Vec::with_capacity(keys.shards() as usize);
    for shard in keys.shard_ids() {
        let id: Option<String> = script.key(keys.replay_of(shard)).invoke_async(conn).await?;
        // A run id is 40 hex characters; whatever a server sends, at most this much is kept.
        ids.push(id.map(|id| id.chars().take(MAX_SERVER_ID_CHARS).collect()));
    }
    Ok(ids)
}

/// Longest server id kept from [`shard_servers`] (Redis run ids are 40 characters).
const MAX_SERVER_ID_CHARS: usize = 64;

fn server_id_script() -> &'static Script {
    static SCRIPT: std::sync::OnceLock<Script> = std::sync::OnceLock::new();
    SCRIPT.get_or_init(|| Script::new(include_str!("../../redis/server_id.lua")))
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
            k.legacy_marker(0, "0b6f0c52-8a56-4e0e-9b43-4c3f8e8d1a2b"),
            "{prod}:outbox:0b6f0c52-8a56-4e0e-9b43-4c3f8e8d1a2b"
        );
        assert_eq!(k.dedup_hash(0, "2026113014"), "{prod}:published:2026113014");
        assert_eq!(k.meta(), "{prod}:meta");
        assert_eq!((k.shards(), k.shard_of("public.t", "doc", 3)), (1, 0));
        assert_eq!(StreamKeys::with_shards("prod", 1), k, "one shard is the unsharded layout");
    }

    #[test]
    fn slots_match_cluster_keyslot() {
        // Values from `CLUSTER KEYSLOT` on Redis 7.
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"123456789"), 12739);
        assert_eq!(slot(b"{user1000}.following"), slot(b"{user1000}.followers"));
        assert_eq!(slot(b"foo{}{bar}"), slot(b"foo{}{bar}"), "an empty tag hashes the whole key");
        assert_eq!(slot(b"{prod}:events"), slot(b"prod"));
    }

    #[test]
    fn shards_spread_evenly_over_the_slot_space_and_never_move() {
        let k = StreamKeys::with_shards("prod", 4);
        assert_eq!(k.shards(), 4);
        let slots: Vec<u16> = k.shard_ids().map(|i| slot(k.replay_of(i).as_bytes())).collect();
        for (i, s) in slots.iter().enumerate() {
            let quarter = 16384 / 4;
            let lo = i as u16 * quarter + quarter / 4;
            assert!((lo..lo + quarter / 2).contains(s), "shard {i} on slot {s}");
            assert_eq!(slot(k.events_of(i as u16).as_bytes()), *s);
            assert_eq!(slot(k.legacy_marker(i as u16, "e").as_bytes()), *s);
            assert_eq!(slot(k.dedup_hash(i as u16, "2026113014").as_bytes()), *s);
        }
        // Three masters owning 0-5460, 5461-10922, 10923-16383 all get a shard.
        let masters: std::collections::HashSet<u16> = slots.iter().map(|s| s / 5461).collect();
        assert_eq!(masters.len(), 3, "{slots:?}");
        // Fixed names: a change here moves every deployment's streams.
        assert_eq!(k.replay_of(0), StreamKeys::with_shards("prod", 4).replay_of(0));
        assert!(k.replay_of(2).starts_with("{prod:s02-") && k.replay_of(2).ends_with("}:replay"));
        let many = StreamKeys::with_shards("p", MAX_SHARDS);
        assert_eq!(many.shards(), MAX_SHARDS);
        assert_eq!(StreamKeys::with_shards("p", 10_000).shards(), MAX_SHARDS);
        assert_eq!(StreamKeys::with_shards("p", 0).shards(), 1);
    }

    #[test]
    fn a_chunk_always_maps_to_the_same_shard_and_chunks_spread() {
        let k = StreamKeys::with_shards("prod", 8);
        let s = k.shard_of("public.doc_embeddings", "handbook", 3);
        assert_eq!(s, k.shard_of("public.doc_embeddings", "handbook", 3));
        assert!(s < 8);
        let mut counts = [0u32; 8];
        for i in 0..8000 {
            counts[usize::from(k.shard_of("public.doc_embeddings", &format!("d{}", i / 10), i % 10))] += 1;
        }
        assert!(counts.iter().all(|&c| (800..1200).contains(&c)), "{counts:?}");
        assert_ne!(
            k.shard_of("public.a", "x", 1),
            k.shard_of("public.b", "x", 1),
            "the table is part of the identity (these two differ)"
        );
    }

    #[test]
    fn entry_ids_order_numerically() {
        assert!(parse_entry_id("1700000000000-10") > parse_entry_id("1700000000000-9"));
        assert!(parse_entry_id("1700000000001-0") > parse_entry_id("1700000000000-99"));
        assert_eq!(parse_entry_id("0-0"), (0, 0));
    }
}
