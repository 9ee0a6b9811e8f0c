//! A consumer of the events stream (every park, resolve, replay, re-park, exhaustion) with a
//! consumer group of its own: each group gets every event once, and within a group the
//! consumers share the work. It reads with `XREADGROUP`, handles each event (here: prints
//! it) and `XACK`s what it handled. On start it takes over entries another consumer of the
//! group read but never acknowledged (it crashed) with `XAUTOCLAIM`.
//!
//! ```sh
//! eval "$(scripts/services.sh up)"      # sets REDIS_URL
//! cargo run --example events_consumer -- my-group      # group name, default `example-consumers`
//! ```
//!
//! `EMBED_DLQ_STREAM_PREFIX` selects the deployment's key prefix (default `embed-dlq`) and
//! `EMBED_DLQ_STREAM_SHARDS` its shard count (default 1: the group then covers every shard's
//! events stream, read in turn). Run
//! `embed-dlq serve` (it relays the outbox to the stream) and ingest something that parks.
//!
//! The events' format and its versioning rule: `docs/events.md` and `docs/events.schema.json`;
//! the same consumer in Python: `examples/events_consumer.py`.

use std::time::Duration;

use embed_dlq::model::ErrorClass;
use embed_dlq::streams::{self, RedisConn, StreamKeys};
use embed_dlq::tail::TailEvent;
use redis::AsyncCommands;
use redis::streams::{
    StreamAutoClaimOptions, StreamAutoClaimReply, StreamId, StreamReadOptions, StreamReadReply,
};
use tokio_util::sync::CancellationToken;

/// The body of an event, as the relay publishes it (the envelope of migration 0006). The
/// fields every event has are typed; the rest (`content_hash`, `at`, ...) stays in `extra`.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct DlqEvent {
    /// `parked`, `resolved`, `replayed`, `reparked`, `exhausted`, `requeued`, `purged`,
    /// `withdrawn` (a vector of the chunk's previous text deleted; `withdrawn_hash`, `by`),
    /// `deleted` (the chunk deleted by an ingest: `by` `input` or `cleanup`, `content_hash`,
    /// `had_vector`).
    pub event: String,
    /// The DLQ row the event is about (none for a `deleted` chunk that had no DLQ row).
    pub dlq_id: Option<i64>,
    /// The target table (canonical name, e.g. `public.doc_embeddings`).
    pub table: String,
    /// The chunk's document, as given in the input.
    pub doc_id: String,
    /// The chunk's position in its document.
    pub chunk_index: i32,
    /// The DLQ row's generation: a newer one supersedes what an older event said (none for a
    /// `deleted` chunk that had no DLQ row).
    pub generation: Option<i64>,
    /// Why the chunk is parked (park and re-park events).
    #[serde(default)]
    pub error_class: Option<ErrorClass>,
    /// Every other field of the body, untouched.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// One delivered entry: the library's view of a stream entry and its parsed body (`None`
/// when the body is not an event this consumer understands).
#[derive(Debug, Clone)]
pub struct Delivered {
    /// Stream entry id, event name and raw body.
    pub entry: TailEvent,
    /// The body, parsed.
    pub body: Option<DlqEvent>,
}

impl Delivered {
    fn from_entry(e: &StreamId) -> Delivered {
        let entry = TailEvent::new(
            e.id.clone(),
            streams::field(&e.map, "event").unwrap_or_default(),
            streams::field(&e.map, "body").unwrap_or_default(),
        );
        let body = serde_json::from_str(&entry.body).ok();
        Delivered { entry, body }
    }
}

/// A member of a consumer group on the events stream.
pub struct EventsConsumer {
    /// A connection of its own: a blocking read needs a response timeout longer than its
    /// BLOCK (redis-rs's default of 500 ms would cut it short) and would stall other commands.
    conn: RedisConn,
    /// The events stream of every shard (one with unsharded streams); a group read covers
    /// one stream, so the consumer reads them in turn.
    streams: Vec<String>,
    /// The shard read next.
    next: usize,
    group: String,
    consumer: String,
    block: Duration,
}

impl EventsConsumer {
    /// Connects and creates `group` on the events stream of every shard if it is missing
    /// (`MKSTREAM`: the stream may not exist yet). A new group starts with events published
    /// from now on.
    pub async fn connect(
        redis_url: &str,
        keys: &StreamKeys,
        group: &str,
        consumer: &str,
    ) -> redis::RedisResult<Self> {
        let block = Duration::from_secs(2);
        let conn = streams::blocking(&streams::client(redis_url)?, block).await?;
        let streams: Vec<String> = keys.shard_ids().map(|s| keys.events_of(s)).collect();
        let block = block / streams.len() as u32;
        let mut me =
            EventsConsumer { conn, streams, next: 0, group: group.into(), consumer: consumer.into(), block };
        for stream in &me.streams {
            let created: redis::RedisResult<()> =
                me.conn.xgroup_create_mkstream(stream, &me.group, "$").await;
            match created {
                Err(e) if e.code() != Some("BUSYGROUP") => return Err(e),
                _ => {}
            }
        }
        Ok(me)
    }

    /// Takes over entries that other consumers of the group read and left unacknowledged for
    /// at least `min_idle`, handles them and acknowledges them. Returns how many were handled.
    pub async fn claim_stale<F>(&mut self, min_idle: Duration, handle: &mut F) -> redis::RedisResult<u64>
    where
        F: FnMut(&Delivered) -> bool,
    {
        let mut handled = 0;
        for stream in self.streams.clone() {
            let mut start = "0-0".to_string();
            loop {
                let reply: StreamAutoClaimReply = self
                    .conn
                    .xautoclaim_options(
                        &stream,
                        &self.group,
                        &self.consumer,
                        min_idle.as_millis() as u64,
                        &start,
                        StreamAutoClaimOptions::default().count(100),
                    )
                    .await?;
                handled += self.handle_and_ack(&stream, &reply.claimed, handle).await?;
                if reply.next_stream_id == "0-0" {
                    break;
                }
                start = reply.next_stream_id;
            }
        }
        Ok(handled)
    }

    /// Reads new events of the next shard (waiting up to its share of the BLOCK time),
    /// handles and acknowledges them.
    pub async fn read_once<F>(&mut self, handle: &mut F) -> redis::RedisResult<u64>
    where
        F: FnMut(&Delivered) -> bool,
    {
        let stream = self.streams[self.next].clone();
        self.next = (self.next + 1) % self.streams.len();
        let options = StreamReadOptions::default()
            .group(&self.group, &self.consumer)
            .count(100)
            .block(self.block.as_millis().max(10) as usize);
        let reply: Option<StreamReadReply> = self.conn.xread_options(&[&stream], &[">"], &options).await?;
        let entries: Vec<StreamId> = reply.into_iter().flat_map(|r| r.keys).flat_map(|k| k.ids).collect();
        self.handle_and_ack(&stream, &entries, handle).await
    }

    /// Hands each entry to `handle`; acknowledges those it handled (returned `true`). The
    /// others stay pending: this or another consumer claims them again after `min_idle`.
    async fn handle_and_ack<F>(
        &mut self,
        stream: &str,
        entries: &[StreamId],
        handle: &mut F,
    ) -> redis::RedisResult<u64>
    where
        F: FnMut(&Delivered) -> bool,
    {
        let handled: Vec<&str> =
            entries.iter().filter(|e| handle(&Delivered::from_entry(e))).map(|e| e.id.as_str()).collect();
        if !handled.is_empty() {
            let _: usize = self.conn.xack(stream, &self.group, &handled).await?;
        }
        Ok(handled.len() as u64)
    }

    /// Claims stale entries, then reads until `cancel` fires; returns how many it handled.
    pub async fn run<F>(
        &mut self,
        min_idle: Duration,
        mut handle: F,
        cancel: CancellationToken,
    ) -> redis::RedisResult<u64>
    where
        F: FnMut(&Delivered) -> bool,
    {
        let mut handled = self.claim_stale(min_idle, &mut handle).await?;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return Ok(handled),
                n = self.read_once(&mut handle) => handled += n?,
            }
        }
    }
}

/// The example's handler: prints each event as one line. An entry whose body is not an event
/// is reported and acknowledged too (it would never become readable by waiting).
pub fn print_event(d: &Delivered) -> bool {
    match &d.body {
        Some(e) => {
            let class = e.error_class.map(|c| format!(" ({c})")).unwrap_or_default();
            let row = match (e.dlq_id, e.generation) {
                (Some(id), Some(g)) => format!(", dlq row {id} generation {g}"),
                _ => String::new(),
            };
            println!("{} {} {}#{} in {}{class}{row}", d.entry.id, e.event, e.doc_id, e.chunk_index, e.table);
        }
        None => eprintln!("{} {}: body is not an event: {:?}", d.entry.id, d.entry.event, d.entry.body),
    }
    true
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let redis_url = std::env::var("REDIS_URL").map_err(|_| anyhow::anyhow!("set REDIS_URL"))?;
    let prefix = std::env::var("EMBED_DLQ_STREAM_PREFIX").unwrap_or_else(|_| streams::DEFAULT_PREFIX.into());
    let group = std::env::args().nth(1).unwrap_or_else(|| "example-consumers".into());
    let consumer = format!("{}-{}", hostname(), std::process::id());
    let shards = std::env::var("EMBED_DLQ_STREAM_SHARDS").ok().and_then(|n| n.parse().ok()).unwrap_or(1);
    let keys = StreamKeys::with_shards(&prefix, shards);
    let mut consumer = EventsConsumer::connect(&redis_url, &keys, &group, &consumer).await?;
    let cancel = embed_dlq::shutdown::on_signal().graceful;
    eprintln!(
        "consuming the events of {} shard(s) under {prefix} as group {group:?}; Ctrl-C to stop",
        keys.shards()
    );
    let handled = consumer.run(Duration::from_secs(60), print_event, cancel).await?;
    eprintln!("handled {handled} events");
    Ok(())
}

fn hostname() -> String {
    std::fs::read_to_string("/etc/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "consumer".into())
}
