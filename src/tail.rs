//! `tail`: follow the events stream (every park, resolve, replay, re-park, exhaustion) from
//! now, from an id, or from a checkpoint file that makes it resumable (the last delivered
//! position is saved after every batch, once the sink has flushed it). The events are handed
//! to an [`EventSink`]; how they look (human lines, JSON) is the caller's business.
//!
//! With sharded streams it follows every shard (one read per shard: a read across shards
//! would cross slots) and merges each round's entries by entry id; the events of one chunk
//! are in one shard, so their order holds. The checkpoint holds one position per shard: a
//! bare line with one shard (the format of every release before sharding), else a
//! `stream_shards N` line and N lines in shard order.
//!
//! # Gaps
//!
//! The events stream is capped (`[serve] events_maxlen`): a reader that stays away (or falls
//! behind) longer than the stream holds finds its position trimmed. Every read is one call of
//! `redis/tail_read.lua`, which returns the entries after the position together with the
//! stream's `XINFO STREAM` bookkeeping at that moment (Redis 7: `entries-added`, the first
//! entry, `max-deleted-entry-id`), so no trim can slip between the check and the read. A
//! position is an entry id plus, when known, the stream's `entries-added` count at that entry
//! ([`Position::count`], saved in the checkpoint); with it the number of entries trimmed past
//! the position is exact: `entries-added - length - count`. Without it (an explicit `--from`
//! id, a checkpoint of an older release, the console's shared id over several shards) only an
//! upper bound is known. Either way the gap is handed to [`EventSink::gap`] as a
//! [`StreamGap`] before any later event, and [`OnGap::Fail`] stops the tail there
//! ([`TailError::Gap`]) without moving the checkpoint. Entries removed with `XDEL` from inside
//! the stream (the reconciler deletes orphan entries) are not gaps: only trimming is.
//!
//! # Order within a chunk
//!
//! Every event body carries `seq` (migration 0014): the outbox row's id, drawn while the
//! statement that records the event holds the chunk's DLQ row, so it grows with every event
//! of a chunk in the order they happened, and a republished event keeps its own. The tail
//! remembers the highest `seq` it delivered per chunk (for the last [`ORDER_MEMORY`] chunks)
//! and marks an event whose `seq` is not above it as late ([`TailEvent::late_after_seq`])
//! instead of passing it off as the chunk's newest state.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::time::Duration;

use redis::Script;
use redis::streams::{StreamId, StreamRangeReply, StreamReadReply};
use tokio_util::sync::CancellationToken;

use crate::streams::{self, RedisClient, RedisConn, StreamKeys, field};

/// What a tail does when its position was trimmed from the stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum OnGap {
    /// Report the gap ([`EventSink::gap`]) and go on with the oldest entry still held.
    #[default]
    Warn,
    /// Report the gap and stop with [`TailError::Gap`], leaving the checkpoint where it was,
    /// so nothing after the gap is consumed before someone looked at it.
    Fail,
}

/// What to follow.
#[derive(Debug, Clone)]
pub struct TailOptions {
    /// `$` (only new events), `0` (from the oldest entry still held, never a gap) or a
    /// position (exclusive): an entry id, optionally followed by a space and its
    /// `entries-added` count ([`Position`]).
    pub from: String,
    /// Resume from (and save to) this file.
    pub checkpoint: Option<PathBuf>,
    /// Stop after this many events.
    pub count: Option<u64>,
    /// Stop once caught up instead of waiting for more.
    pub no_follow: bool,
    /// What to do when the position was trimmed.
    pub on_gap: OnGap,
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
    /// Where a reader resumes right after this event (its id and, when known, the stream's
    /// count at it): what the console hands the browser as the SSE id.
    pub position: Position,
    /// `Some(s)` when an event of the same chunk with sequence `s`, not below this one's, was
    /// already delivered: this event happened before it (a republish appended it late, or it
    /// is delivered twice) and is not the chunk's newest state.
    pub late_after_seq: Option<i64>,
}

impl TailEvent {
    /// An event read by other means than [`tail`] (e.g. a consumer group): its position is its
    /// id (no count) and it is not known to be late.
    pub fn new(id: String, event: String, body: String) -> TailEvent {
        TailEvent { position: Position::at(&id), id, event, body, late_after_seq: None }
    }

    /// The event as one JSON object: its body, with the stream id, the event name and (for a
    /// late event) `late_after_seq` added (an unparsable body becomes `null`).
    pub fn to_json(&self) -> serde_json::Value {
        let mut v: serde_json::Value = serde_json::from_str(&self.body).unwrap_or(serde_json::Value::Null);
        if let Some(o) = v.as_object_mut() {
            o.insert("stream_id".into(), self.id.clone().into());
            o.entry("event").or_insert_with(|| self.event.clone().into());
            if let Some(s) = self.late_after_seq {
                o.insert("late_after_seq".into(), s.into());
            }
        }
        v
    }
}

/// A reader's place in one shard: the last entry id it delivered and, when known, the
/// stream's `entries-added` count at that entry (the entry's ordinal among every entry ever
/// added), which makes the number of entries trimmed past it exact.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Position {
    /// The entry id (`ms-seq`), or `0`/`0-0` before the first entry.
    pub id: String,
    /// `entries-added` at `id`, if known.
    pub count: Option<u64>,
}

impl Position {
    /// Parses `id` or `id count` (what [`Position::to_text`] writes); `None` if it is neither.
    pub fn parse(text: &str) -> Option<Position> {
        let mut parts = text.split_whitespace();
        let id = parts.next()?;
        let count = match parts.next() {
            Some(c) => Some(c.parse::<u64>().ok()?),
            None => None,
        };
        if parts.next().is_some() || id == "$" || check_from(id).is_err() {
            return None;
        }
        Some(Position { id: id.to_string(), count })
    }

    /// `id`, or `id count` when the count is known: one line of a checkpoint, and the SSE id
    /// of the console's live events.
    pub fn to_text(&self) -> String {
        match self.count {
            Some(c) => format!("{} {c}", self.id),
            None => self.id.clone(),
        }
    }

    fn at(id: &str) -> Position {
        Position { id: id.to_string(), count: None }
    }
}

/// How many events a reader missed in a gap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissingEvents {
    /// Exactly this many (the position carried its count).
    Exactly(u64),
    /// Between 0 and this many: entries were trimmed past some point, and the position has no
    /// count to tell how many of them came after it.
    AtMost(u64),
}

impl std::fmt::Display for MissingEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MissingEvents::Exactly(n) => write!(f, "{n} events missed"),
            MissingEvents::AtMost(n) => write!(
                f,
                "up to {n} events may have been missed (the position has no entries-added count, \
                 so how many of the trimmed entries came after it is unknown)"
            ),
        }
    }
}

/// Entries a reader never saw were trimmed from a shard of the events stream: where it was,
/// where it goes on, and how many it missed. Handed to [`EventSink::gap`] before any later
/// event of that shard.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "events stream shard {shard} ({stream}): the position {after} was trimmed; {missing}; \
     the oldest entry still held is {resumes_at}"
)]
pub struct StreamGap {
    /// The shard index.
    pub shard: u16,
    /// The shard's stream key.
    pub stream: String,
    /// The position the reader resumed from.
    pub after: String,
    /// The first entry still held (where reading goes on), or `(empty)`.
    pub resumes_at: String,
    /// How many entries the reader missed.
    pub missing: MissingEvents,
}

/// Where [`tail`] delivers events. The checkpoint is saved only after [`EventSink::flush`]
/// succeeded, so a restart neither skips nor repeats what the sink received.
pub trait EventSink {
    /// Receives one event, in stream order.
    fn event(&mut self, event: &TailEvent) -> std::io::Result<()>;
    /// Receives a gap, before the events that follow it.
    fn gap(&mut self, gap: &StreamGap) -> std::io::Result<()>;
    /// Makes every event received so far durable or visible (called after each batch).
    fn flush(&mut self) -> std::io::Result<()>;
}

/// Collects events in memory (for library callers and tests); gaps are dropped, so use
/// [`Collected`] or [`OnGap::Fail`] to see them.
impl EventSink for Vec<TailEvent> {
    fn event(&mut self, event: &TailEvent) -> std::io::Result<()> {
        self.push(event.clone());
        Ok(())
    }

    fn gap(&mut self, _: &StreamGap) -> std::io::Result<()> {
        Ok(())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Collects events and gaps in memory, in the order they were delivered.
#[derive(Debug, Default)]
pub struct Collected {
    /// Every event delivered.
    pub events: Vec<TailEvent>,
    /// Every gap reported.
    pub gaps: Vec<StreamGap>,
}

impl EventSink for Collected {
    fn event(&mut self, event: &TailEvent) -> std::io::Result<()> {
        self.events.push(event.clone());
        Ok(())
    }

    fn gap(&mut self, gap: &StreamGap) -> std::io::Result<()> {
        self.gaps.push(gap.clone());
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
    /// The position was trimmed and [`OnGap::Fail`] was asked for (the gap was also handed
    /// to the sink); the checkpoint still holds the position before the gap.
    #[error(transparent)]
    Gap(StreamGap),
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

/// Checks a resume value: what [`check_from`] accepts, or a [`Position`] (`id count`).
pub fn check_resume(from: &str) -> Result<(), InvalidFrom> {
    if from == "$" || Position::parse(from).is_some() { Ok(()) } else { Err(InvalidFrom(from.to_string())) }
}

/// Chunks whose highest delivered `seq` a tail remembers (to mark late events): bounds its
/// memory (about 100 bytes a chunk) whatever the number of chunks it sees.
pub const ORDER_MEMORY: usize = 100_000;

/// Entries one read returns at most.
const READ_COUNT: usize = 500;

/// The read script (`redis/tail_read.lua`).
fn read_script() -> Script {
    Script::new(include_str!("../redis/tail_read.lua"))
}

/// Delivers events to `sink` until cancelled, caught up (`no_follow`) or `count` is reached;
/// returns how many were delivered. A trimmed position is reported to the sink (and, with
/// [`OnGap::Fail`], ends the tail with [`TailError::Gap`]).
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
    let mut last = start_positions(&mut conn, keys, opts).await?;
    // Several shards: a read of each, then (nothing anywhere) a blocking wait on one in turn
    // for its share of `block`, so a new event waits at most about `block`.
    let block_one = (block / u32::from(shards)).max(Duration::from_millis(10));
    let mut idle_turn = 0u16;
    let mut delivered = 0u64;
    let mut order = ChunkOrder::new(ORDER_MEMORY);
    let script = read_script();
    loop {
        let read = async {
            let mut reads = Vec::new();
            for shard in keys.shard_ids() {
                reads.push(read_shard(&mut conn, &script, keys, shard, &last[usize::from(shard)]).await?);
            }
            if reads.iter().all(|r| r.entries.is_empty() && r.gap.is_none()) && !opts.no_follow {
                // A wake-up only: whatever arrives is read (with its bookkeeping) next round.
                let shard = idle_turn % shards;
                idle_turn = idle_turn.wrapping_add(1);
                let wait = if shards > 1 { block_one } else { block };
                wait_for_entries(&mut conn, keys, shard, &last[usize::from(shard)].id, wait).await?;
            }
            Ok::<_, redis::RedisError>(reads)
        };
        let reads = tokio::select! {
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
        let mut entries = Vec::new();
        for (shard, r) in keys.shard_ids().zip(reads) {
            if let Some(gap) = r.gap {
                sink.gap(&gap).map_err(TailError::Sink)?;
                if opts.on_gap == OnGap::Fail {
                    // Events already taken this round are flushed; the checkpoint keeps the
                    // positions before this round, so a rerun reports the gap again.
                    sink.flush().map_err(TailError::Sink)?;
                    return Err(TailError::Gap(gap));
                }
            }
            entries.extend(r.entries.into_iter().map(|(e, position)| (shard, e, position)));
        }
        if entries.is_empty() {
            if opts.no_follow {
                return Ok(delivered);
            }
            continue;
        }
        // Merged by entry id (the shards' ids come from their masters' clocks: the order
        // across shards is by time, approximately; within a shard it is exact).
        entries.sort_by_key(|(shard, e, _)| (streams::parse_entry_id(&e.id), *shard));
        for (shard, e, position) in entries {
            let body = field(&e.map, "body").unwrap_or_default();
            let late_after_seq = order.observe(&body);
            let event = TailEvent {
                event: field(&e.map, "event").unwrap_or_default(),
                body,
                id: e.id,
                position: position.clone(),
                late_after_seq,
            };
            sink.event(&event).map_err(TailError::Sink)?;
            last[usize::from(shard)] = position;
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

/// One read of one shard: its entries after the position, each with the position right
/// after it, and the gap before them if the position was trimmed.
struct ShardRead {
    entries: Vec<(StreamId, Position)>,
    gap: Option<StreamGap>,
}

/// The `XINFO STREAM` values a read needs, taken atomically with it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Bookkeeping {
    length: u64,
    entries_added: u64,
    first: Option<(u64, u64)>,
    first_id: String,
    max_deleted: (u64, u64),
    last_generated: (u64, u64),
}

/// Up to [`READ_COUNT`] entries of shard `shard` after `after`, with the gap before them.
async fn read_shard(
    conn: &mut RedisConn,
    script: &Script,
    keys: &StreamKeys,
    shard: u16,
    after: &Position,
) -> redis::RedisResult<ShardRead> {
    let stream = keys.events_of(shard);
    let reply: redis::Value = script.key(&stream).arg(&after.id).arg(READ_COUNT).invoke_async(conn).await?;
    let parts = match reply {
        redis::Value::Array(parts) if !parts.is_empty() => parts,
        _ => return Ok(ShardRead { entries: Vec::new(), gap: None }),
    };
    let (length, entries_added, first_id, max_deleted, last_generated, range): (
        u64,
        u64,
        String,
        String,
        String,
        StreamRangeReply,
    ) = redis::from_redis_value(redis::Value::Array(parts))?;
    let book = Bookkeeping {
        length,
        entries_added,
        first: (!first_id.is_empty()).then(|| streams::parse_entry_id(&first_id)),
        first_id,
        max_deleted: streams::parse_entry_id(&max_deleted),
        last_generated: streams::parse_entry_id(&last_generated),
    };
    let ids: Vec<(u64, u64)> = range.ids.iter().map(|e| streams::parse_entry_id(&e.id)).collect();
    let (missing, counts) = account(&book, after, &ids);
    let gap = missing.map(|missing| StreamGap {
        shard,
        stream,
        after: after.to_text(),
        resumes_at: if book.first_id.is_empty() { "(empty)".into() } else { book.first_id.clone() },
        missing,
    });
    let entries = range
        .ids
        .into_iter()
        .zip(counts)
        .map(|(e, count)| {
            let position = Position { id: e.id.clone(), count };
            (e, position)
        })
        .collect();
    Ok(ShardRead { entries, gap })
}

/// The gap (if any) between `after` and what the stream holds, and the `entries-added` count
/// of each entry read (`ids`, the entries right after `after`), where it can be known.
///
/// Trimming removes entries from the front, so entries were trimmed past `after` only if the
/// first entry held is after it (or the stream is empty while ids past it were generated).
/// Then, with `after`'s count `c`, the entries trimmed past it are `entries-added - length -
/// c` (every entry up to `after` is gone, every entry held is after it); without it, at most
/// `entries-added - length`. `after` = `0` without a count (`--from 0`) asks for the oldest
/// entry held and is never a gap. Every server value is used with saturating arithmetic: a count that does
/// not fit (the stream was re-created under the reader) makes the count unknown, never a
/// panic.
fn account(
    book: &Bookkeeping,
    after: &Position,
    ids: &[(u64, u64)],
) -> (Option<MissingEvents>, Vec<Option<u64>>) {
    let at = streams::parse_entry_id(&after.id);
    // A count from another incarnation of the stream (it was deleted and re-created, or the
    // position is from the future) says nothing about this one.
    let count = after.count.filter(|&c| c <= book.entries_added && at <= book.last_generated);
    let removed = book.entries_added.saturating_sub(book.length);
    let trimmed_past = match book.first {
        Some(first) => first > at,
        None => book.last_generated > at,
    };
    // `--from 0` (no count) asks for the oldest entry held; a `$` start on a stream that did
    // not exist yet is `0-0` with count 0, and a trim past it is a gap like any other.
    // More entries held than ever added: the reply does not add up; count nothing on it.
    let consistent = book.length <= book.entries_added;
    let missing = if !consistent || (at == (0, 0) && count.is_none()) || !trimmed_past || removed == 0 {
        None
    } else {
        match count {
            Some(c) => Some(removed.saturating_sub(c)).filter(|&n| n > 0).map(MissingEvents::Exactly),
            None => Some(MissingEvents::AtMost(removed)),
        }
    };
    // Counts of the entries read. Past a trim the first entry read is the first held, whose
    // count is `removed + 1` if nothing held was deleted from inside; otherwise the entries
    // follow `after` with no deletion between when `max-deleted-entry-id` is not past it.
    let first_count = if !consistent {
        None
    } else if trimmed_past && book.first.is_some() && ids.first() == book.first.as_ref() {
        (book.max_deleted < book.first.unwrap_or_default()).then_some(removed.saturating_add(1))
    } else if !trimmed_past && book.max_deleted <= at {
        count.map(|c| c.saturating_add(1))
    } else {
        None
    };
    let counts = (0..ids.len() as u64).map(|i| first_count.map(|c| c.saturating_add(i))).collect();
    (missing, counts)
}

/// Blocks up to `wait` until shard `shard` has an entry after `after` (a wake-up: the entries
/// are read by the next [`read_shard`], with the bookkeeping that tells a gap).
async fn wait_for_entries(
    conn: &mut RedisConn,
    keys: &StreamKeys,
    shard: u16,
    after: &str,
    wait: Duration,
) -> redis::RedisResult<()> {
    let _: StreamReadReply = redis::cmd("XREAD")
        .arg("COUNT")
        .arg(1)
        .arg("BLOCK")
        .arg(wait.as_millis() as u64)
        .arg("STREAMS")
        .arg(keys.events_of(shard))
        .arg(after)
        .query_async(conn)
        .await?;
    Ok(())
}

/// The highest `seq` delivered per chunk, for the last `capacity` chunks seen.
struct ChunkOrder {
    highest: HashMap<(String, String, i64), i64>,
    seen: VecDeque<(String, String, i64)>,
    capacity: usize,
}

impl ChunkOrder {
    fn new(capacity: usize) -> ChunkOrder {
        ChunkOrder { highest: HashMap::new(), seen: VecDeque::new(), capacity: capacity.max(1) }
    }

    /// Records an event body; returns the chunk's highest `seq` delivered before if this
    /// event's is not above it (a late event). Bodies without `seq` (published before
    /// migration 0014) or without an identity are never late.
    fn observe(&mut self, body: &str) -> Option<i64> {
        let v: serde_json::Value = serde_json::from_str(body).ok()?;
        let seq = v.get("seq")?.as_i64()?;
        let key = (
            v.get("table")?.as_str().unwrap_or_default().to_string(),
            v.get("doc_id")?.as_str()?.to_string(),
            v.get("chunk_index")?.as_i64()?,
        );
        match self.highest.get_mut(&key) {
            Some(highest) if *highest >= seq => Some(*highest),
            Some(highest) => {
                *highest = seq;
                None
            }
            None => {
                if self.seen.len() >= self.capacity
                    && let Some(old) = self.seen.pop_front()
                {
                    self.highest.remove(&old);
                }
                self.seen.push_back(key.clone());
                self.highest.insert(key, seq);
                None
            }
        }
    }
}

/// Where reading starts, per shard: the checkpoint's positions if it holds some, else `from`
/// for every shard, with `$` resolved to each stream's last id (and its count) so that a
/// reconnect does not skip events.
async fn start_positions(
    conn: &mut RedisConn,
    keys: &StreamKeys,
    opts: &TailOptions,
) -> Result<Vec<Position>, TailError> {
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
    let from = if opts.from == "$" { None } else { Position::parse(&opts.from) };
    let mut last = saved.unwrap_or_else(|| vec![from.clone().unwrap_or_else(|| Position::at("$")); shards]);
    for (shard, position) in keys.shard_ids().zip(last.iter_mut()) {
        if position.id == "$" {
            // A missing stream is an error here: nothing was ever added, the count is 0.
            let info: redis::RedisResult<HashMap<String, redis::Value>> =
                redis::cmd("XINFO").arg("STREAM").arg(keys.events_of(shard)).query_async(conn).await;
            let info = info.unwrap_or_default();
            let id =
                info.get("last-generated-id").and_then(|v| redis::from_redis_value_ref::<String>(v).ok());
            let count = info.get("entries-added").and_then(|v| redis::from_redis_value_ref::<u64>(v).ok());
            *position = match id {
                Some(id) => Position { id, count },
                None => Position { id: "0-0".into(), count: Some(0) },
            };
        }
    }
    Ok(last)
}

/// The per-shard positions of a checkpoint written for `shards` shards.
fn parse_checkpoint(text: &str, shards: usize) -> Result<Vec<Position>, String> {
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    let first = lines.next().unwrap_or_default();
    let lines: Vec<&str> = match first.strip_prefix("stream_shards ") {
        None => vec![first],
        Some(n) => {
            let n: usize = n.trim().parse().map_err(|_| format!("bad header {first:?}"))?;
            let lines: Vec<&str> = lines.collect();
            if lines.len() != n {
                return Err(format!("header says {n} shards but it holds {} ids", lines.len()));
            }
            lines
        }
    };
    if lines.len() != shards {
        return Err(format!(
            "it was written for {} shard(s), the streams have {shards}: resuming from it could skip or repeat events \
             (start a new checkpoint file, with --from)",
            lines.len()
        ));
    }
    lines
        .into_iter()
        .map(|l| Position::parse(l).ok_or_else(|| format!("{l:?} is not a stream entry id (with its count)")))
        .collect()
}

/// The checkpoint text of `last`: the bare position with one shard, else a header and the
/// positions.
fn checkpoint_text(last: &[Position]) -> String {
    match last {
        [one] => one.to_text(),
        many => format!(
            "stream_shards {}\n{}\n",
            many.len(),
            many.iter().map(Position::to_text).collect::<Vec<_>>().join("\n")
        ),
    }
}

/// Records the last delivered position of every shard in `path`, atomically (write aside,
/// then rename).
fn save_checkpoint(path: &std::path::Path, last: &[Position]) -> Result<(), TailError> {
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
        let one = vec![Position::at("1700000000000-3")];
        assert_eq!(
            checkpoint_text(&one),
            "1700000000000-3",
            "one shard, no count: the format of every release"
        );
        assert_eq!(parse_checkpoint("1700000000000-3\n", 1).unwrap(), one);
        let counted = vec![Position { id: "1700000000000-3".into(), count: Some(300) }];
        assert_eq!(checkpoint_text(&counted), "1700000000000-3 300");
        assert_eq!(parse_checkpoint("1700000000000-3 300\n", 1).unwrap(), counted);
        assert!(parse_checkpoint("1700000000000-3 -1", 1).is_err());
        let four: Vec<Position> = ["1-0", "0-0", "5-2", "7-1"].map(Position::at).to_vec();
        assert_eq!(parse_checkpoint(&checkpoint_text(&four), 4).unwrap(), four);
        assert!(parse_checkpoint(&checkpoint_text(&four), 2).unwrap_err().contains("written for 4 shard(s)"));
        assert!(parse_checkpoint("1700000000000-3", 4).unwrap_err().contains("written for 1 shard(s)"));
        assert!(parse_checkpoint("stream_shards 2\n1-0\n", 2).is_err());
        assert!(parse_checkpoint("garbage", 1).is_err());
    }

    fn book(length: u64, added: u64, first: Option<(u64, u64)>, last: (u64, u64)) -> Bookkeeping {
        Bookkeeping {
            length,
            entries_added: added,
            first,
            first_id: first.map(|(m, s)| format!("{m}-{s}")).unwrap_or_default(),
            max_deleted: (0, 0),
            last_generated: last,
        }
    }

    #[test]
    fn a_trim_past_the_position_is_a_gap_counted_exactly_with_the_position_count() {
        // 2300 added, 1000 held (1301..=2300), the reader delivered the 300th.
        let b = book(1000, 2300, Some((1301, 0)), (2300, 0));
        let ids: Vec<(u64, u64)> = (1301..1304).map(|m| (m, 0)).collect();
        let at = Position { id: "300-0".into(), count: Some(300) };
        let (gap, counts) = account(&b, &at, &ids);
        assert_eq!(gap, Some(MissingEvents::Exactly(1000)), "301..=1300: 1300 removed, 300 of them read");
        assert_eq!(
            counts,
            vec![Some(1301), Some(1302), Some(1303)],
            "past the trim the count is known again"
        );
        // Without a count: at most what was removed.
        let (gap, _) = account(&b, &Position::at("300-0"), &ids);
        assert_eq!(gap, Some(MissingEvents::AtMost(1300)));
        // The reader had everything up to the first entry trimmed: no gap.
        let (gap, _) = account(&b, &Position { id: "1300-0".into(), count: Some(1300) }, &ids);
        assert_eq!(gap, None);
        // `--from 0` asks for the oldest held; a counted 0-0 (`$` on a new stream) is a real gap.
        assert_eq!(account(&b, &Position::at("0"), &ids).0, None);
        assert_eq!(
            account(&b, &Position { id: "0-0".into(), count: Some(0) }, &ids).0,
            Some(MissingEvents::Exactly(1000 + 300))
        );
        // Inside the stream: no gap, counts follow the position's.
        let (gap, counts) = account(&b, &Position { id: "1300-5".into(), count: Some(1300) }, &ids[..1]);
        assert_eq!((gap, counts), (None, vec![Some(1301)]));
    }

    #[test]
    fn server_values_that_do_not_add_up_never_panic_and_make_the_count_unknown() {
        // A count larger than entries-added (the stream was re-created under the reader).
        let b = book(5, 3, Some((10, 0)), (12, 0));
        let (gap, counts) = account(&b, &Position { id: "5-0".into(), count: Some(u64::MAX) }, &[(10, 0)]);
        assert_eq!(gap, None, "length above entries-added: nothing removed");
        assert_eq!(counts, vec![None]);
        let b = book(0, u64::MAX, None, (u64::MAX, u64::MAX));
        let (gap, _) = account(&b, &Position { id: "1-0".into(), count: Some(1) }, &[]);
        assert_eq!(gap, Some(MissingEvents::Exactly(u64::MAX - 1)));
    }

    #[test]
    fn an_event_not_above_its_chunks_highest_seq_is_late() {
        let mut order = ChunkOrder::new(2);
        let ev =
            |doc: &str, seq: i64| format!(r#"{{"table":"t","doc_id":"{doc}","chunk_index":0,"seq":{seq}}}"#);
        assert_eq!(order.observe(&ev("a", 5)), None);
        assert_eq!(order.observe(&ev("a", 9)), None);
        assert_eq!(order.observe(&ev("a", 7)), Some(9), "republished parked after resolved");
        assert_eq!(order.observe(&ev("a", 9)), Some(9), "the same event twice");
        assert_eq!(order.observe(&ev("b", 1)), None, "another chunk");
        assert_eq!(order.observe(r#"{"doc_id":"a","chunk_index":0}"#), None, "no seq: unordered");
        order.observe(&ev("c", 1));
        assert_eq!(order.observe(&ev("a", 1)), None, "memory is bounded: the oldest chunk was forgotten");
    }
}
