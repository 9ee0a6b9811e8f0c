//! The events stream in the console: the newest events (the live tail page's first rows), a
//! row's own events (its detail page, from a bounded scan of the newest entries), and the
//! live tail over Server-Sent Events.
//!
//! Each live-tail client gets its own `tail` follower (its own connection, blocked in
//! `XREAD` with a response timeout longer than the block: see `streams::blocking`), which
//! hands events to the response through a bounded channel. A client that does not keep up
//! fills the channel, its follower stops and the response ends; the browser's `EventSource`
//! reconnects with `Last-Event-ID` and resumes after the last event it received, so a slow
//! client costs a reconnect, never a gap and never unbounded memory. At most
//! `max_event_clients` are served at once; the next one gets 503 and retries.
//!
//! The SSE id of an event is its tail position (entry id and the stream's entries-added count
//! at it, [`crate::tail::Position`]), so a browser that comes back after the stream was trimmed
//! past it is told exactly how many events it missed: an `event: gap` message (JSON with
//! `shard`, `after`, `resumes_at`, `missing` and `exact`) before the events that follow. With
//! several shards the one id is applied to every shard and the count of the others is unknown:
//! the gap then says at most how many.

use std::convert::Infallible;
use std::time::Duration;

use crate::streams::RedisConn;
use axum::extract::{Query, State as AxumState};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use redis::streams::StreamRangeReply;
use serde::Deserialize;

use super::state::State;
use crate::streams::{StreamKeys, field};
use crate::tail::{EventSink, MissingEvents, OnGap, StreamGap, TailEvent, TailOptions};

/// An event as the console shows it.
#[derive(Debug, Clone)]
pub struct ShownEvent {
    /// The stream entry id.
    pub id: String,
    /// Where a live tail resumes after it (the SSE id): the entry id and, when known, the
    /// stream's count at it.
    pub resume: String,
    /// When it was added (the entry id's milliseconds).
    pub at: Option<DateTime<Utc>>,
    /// `parked`, `replayed`, ...
    pub event: String,
    /// The JSON body (`Null` if it did not parse).
    pub body: serde_json::Value,
}

impl ShownEvent {
    fn new(id: String, event: String, body: &str) -> ShownEvent {
        let ms = id.split('-').next().and_then(|ms| ms.parse::<i64>().ok());
        ShownEvent {
            resume: id.clone(),
            at: ms.and_then(DateTime::<Utc>::from_timestamp_millis),
            body: serde_json::from_str(body).unwrap_or(serde_json::Value::Null),
            id,
            event,
        }
    }

    fn from_tail(e: &TailEvent) -> ShownEvent {
        ShownEvent { resume: e.position.to_text(), ..ShownEvent::new(e.id.clone(), e.event.clone(), &e.body) }
    }

    /// A body field as text (strings as they are, other values as JSON), empty if absent.
    pub fn field(&self, name: &str) -> String {
        match self.body.get(name) {
            None | Some(serde_json::Value::Null) => String::new(),
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(v) => v.to_string(),
        }
    }

    /// The body's keys beyond the envelope, as `key=value` text (reason, attempts, ...).
    pub fn details(&self) -> String {
        // The envelope has columns of its own; hashes and the row's timestamps are on its page.
        const SHOWN_ELSEWHERE: [&str; 10] = [
            "event",
            "dlq_id",
            "table",
            "doc_id",
            "chunk_index",
            "generation",
            "at",
            "content_hash",
            "first_failed_at",
            "last_failed_at",
        ];
        match &self.body {
            serde_json::Value::Object(m) => m
                .iter()
                .filter(|(k, _)| !SHOWN_ELSEWHERE.contains(&k.as_str()))
                .map(|(k, v)| match v {
                    serde_json::Value::String(s) => format!("{k}={s}"),
                    v => format!("{k}={v}"),
                })
                .collect::<Vec<_>>()
                .join(" "),
            _ => String::new(),
        }
    }

    /// What the live tail page's script receives (it sets every value as text).
    fn json(&self) -> String {
        serde_json::json!({
            "id": self.id,
            "at": self.at.map(|t| t.format("%Y-%m-%d %H:%M:%S%.3f").to_string()),
            "event": self.event,
            "dlq_id": self.body.get("dlq_id").and_then(|v| v.as_i64()),
            "table": self.field("table"),
            "doc_id": self.field("doc_id"),
            "chunk_index": self.field("chunk_index"),
            "generation": self.field("generation"),
            "details": self.details(),
        })
        .to_string()
    }

    fn matches_row(&self, id: i64, table: &str, doc: &str, chunk: i32) -> bool {
        self.body.get("dlq_id").and_then(|v| v.as_i64()) == Some(id)
            || (self.body.get("table").and_then(|v| v.as_str()) == Some(table)
                && self.body.get("doc_id").and_then(|v| v.as_str()) == Some(doc)
                && self.body.get("chunk_index").and_then(|v| v.as_i64()) == Some(chunk as i64))
    }
}

fn shown(reply: StreamRangeReply) -> Vec<ShownEvent> {
    reply
        .ids
        .into_iter()
        .map(|e| {
            let event = field(&e.map, "event").unwrap_or_default();
            let body = field(&e.map, "body").unwrap_or_default();
            ShownEvent::new(e.id, event, &body)
        })
        .collect()
}

/// The newest `count` events, newest first.
pub async fn recent(
    redis: &mut RedisConn,
    keys: &StreamKeys,
    count: usize,
) -> redis::RedisResult<Vec<ShownEvent>> {
    let reply: StreamRangeReply = redis::cmd("XREVRANGE")
        .arg(keys.events())
        .arg("+")
        .arg("-")
        .arg("COUNT")
        .arg(count)
        .query_async(redis)
        .await?;
    Ok(shown(reply))
}

/// Events of one DLQ row (by its id, or by its chunk's identity: earlier rows of the same
/// chunk too) among the newest `scan` events, newest first; also how many were scanned.
pub async fn of_row(
    redis: &mut RedisConn,
    keys: &StreamKeys,
    (id, table, doc, chunk): (i64, &str, &str, i32),
    scan: usize,
) -> redis::RedisResult<(Vec<ShownEvent>, usize)> {
    const PAGE: usize = 500;
    let mut found = Vec::new();
    let mut scanned = 0;
    let mut end = "+".to_string();
    while scanned < scan && found.len() < 200 {
        let want = PAGE.min(scan - scanned);
        let reply: StreamRangeReply = redis::cmd("XREVRANGE")
            .arg(keys.events())
            .arg(&end)
            .arg("-")
            .arg("COUNT")
            .arg(want)
            .query_async(redis)
            .await?;
        let page = shown(reply);
        let Some(last) = page.last() else { break };
        end = format!("({}", last.id);
        scanned += page.len();
        let short = page.len() < want;
        found.extend(page.into_iter().filter(|e| e.matches_row(id, table, doc, chunk)));
        if short {
            break;
        }
    }
    Ok((found, scanned))
}

/// What a live-tail follower hands its response.
enum Live {
    /// An event.
    Event(ShownEvent),
    /// Events were trimmed past the client's position.
    Gap(StreamGap),
}

/// The `gap` SSE message's data: what the page shows, and what a script can act on.
fn gap_json(gap: &StreamGap) -> String {
    let (missing, exact) = match gap.missing {
        MissingEvents::Exactly(n) => (n, true),
        MissingEvents::AtMost(n) => (n, false),
    };
    serde_json::json!({
        "shard": gap.shard,
        "after": gap.after,
        "resumes_at": gap.resumes_at,
        "missing": missing,
        "exact": exact,
        "message": gap.to_string(),
    })
    .to_string()
}

/// Hands a follower's events to one live-tail response, never waiting: a full channel (a
/// client that does not keep up) stops the follower.
struct ChannelSink(tokio::sync::mpsc::Sender<Live>);

impl ChannelSink {
    fn send(&mut self, live: Live) -> std::io::Result<()> {
        self.0.try_send(live).map_err(|e| match e {
            tokio::sync::mpsc::error::TrySendError::Full(_) => {
                std::io::Error::new(std::io::ErrorKind::WouldBlock, "live-tail client too slow")
            }
            tokio::sync::mpsc::error::TrySendError::Closed(_) => {
                std::io::Error::new(std::io::ErrorKind::BrokenPipe, "live-tail client gone")
            }
        })
    }
}

impl EventSink for ChannelSink {
    fn event(&mut self, event: &TailEvent) -> std::io::Result<()> {
        self.send(Live::Event(ShownEvent::from_tail(event)))
    }

    fn gap(&mut self, gap: &StreamGap) -> std::io::Result<()> {
        self.send(Live::Gap(gap.clone()))
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Events buffered per live-tail client before it counts as too slow.
const CLIENT_BUFFER: usize = 1000;

/// `?from=` of the live tail (when the browser has no `Last-Event-ID` yet).
#[derive(Debug, Deserialize)]
pub struct StreamQuery {
    from: Option<String>,
}

/// `GET /events/stream`: the live tail as Server-Sent Events (`event: dlq`, `id:` the entry
/// id, `data:` the event as JSON). Resumes after `Last-Event-ID`, else after `?from=`, else
/// from now.
pub async fn stream(
    AxumState(state): AxumState<State>,
    headers: HeaderMap,
    Query(q): Query<StreamQuery>,
) -> Response {
    let Some(client) = state.console.redis.clone() else {
        return (StatusCode::SERVICE_UNAVAILABLE, "Redis is not configured").into_response();
    };
    let from = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or(q.from)
        .unwrap_or_else(|| "$".into());
    if crate::tail::check_resume(&from).is_err() {
        return (StatusCode::BAD_REQUEST, "bad event id").into_response();
    }
    let Ok(permit) = state.event_slots.clone().try_acquire_owned() else {
        return (StatusCode::SERVICE_UNAVAILABLE, "too many live-tail clients; retrying").into_response();
    };
    let (tx, rx) = tokio::sync::mpsc::channel(CLIENT_BUFFER);
    let cancel = state.cancel.child_token();
    let guard = cancel.clone().drop_guard();
    let keys = state.console.keys.clone();
    state.tasks.spawn(async move {
        let opts = TailOptions { from, checkpoint: None, count: None, no_follow: false, on_gap: OnGap::Warn };
        let mut sink = ChannelSink(tx);
        if let Err(e) = crate::tail::tail(&client, &keys, &opts, &mut sink, cancel).await {
            tracing::debug!(error = %e, "console: a live tail ended");
        }
    });
    let events = futures::stream::unfold((rx, guard, permit), |(mut rx, guard, permit)| async move {
        let event = match rx.recv().await? {
            Live::Event(e) => Event::default().id(e.resume.clone()).event("dlq").data(e.json()),
            Live::Gap(gap) => Event::default().event("gap").data(gap_json(&gap)),
        };
        Some((Ok::<_, Infallible>(event), (rx, guard, permit)))
    });
    let retry = futures::stream::once(async { Ok(Event::default().retry(Duration::from_secs(3))) });
    Sse::new(futures::StreamExt::chain(retry, events))
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}
