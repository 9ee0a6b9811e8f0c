//! `tail`: follow the events stream (every park, resolve, replay, re-park, exhaustion), as
//! human lines or JSON, from now, from an id, or from a checkpoint file that makes it
//! resumable without gaps (the last printed id is saved after every batch).

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use redis::streams::StreamReadReply;
use tokio_util::sync::CancellationToken;

use crate::streams::{self, StreamKeys, field};

/// What to follow and how to print it.
#[derive(Debug, Clone)]
pub struct TailOptions {
    /// `$` (only new events), `0` (from the beginning) or an entry id (exclusive).
    pub from: String,
    pub json: bool,
    /// Resume from (and save to) this file.
    pub checkpoint: Option<PathBuf>,
    /// Stop after this many events.
    pub count: Option<u64>,
    /// Stop once caught up instead of waiting for more.
    pub no_follow: bool,
}

/// Checks a `--from` value: `$`, `0`, or a stream entry id (`ms` or `ms-seq`), so a typo is a
/// usage error rather than a Redis error on every read.
pub fn check_from(from: &str) -> Result<(), String> {
    let digits = |s: &str| {
        !s.is_empty() && s.len() <= 20 && s.bytes().all(|b| b.is_ascii_digit()) && s.parse::<u64>().is_ok()
    };
    let ok = from == "$"
        || match from.split_once('-') {
            Some((ms, seq)) => digits(ms) && digits(seq),
            None => digits(from),
        };
    if ok {
        Ok(())
    } else {
        Err(format!("{from:?} is not `$`, `0` or a stream entry id like 1700000000000-0"))
    }
}

/// Prints events to `out` until cancelled, caught up (`no_follow`) or `count` is reached;
/// returns how many were printed.
pub async fn tail(
    redis_url: &str,
    keys: &StreamKeys,
    opts: &TailOptions,
    out: &mut (dyn Write + Send),
    cancel: CancellationToken,
) -> Result<u64, String> {
    let client = streams::client(redis_url).map_err(|e| format!("bad Redis URL: {e}"))?;
    let block = Duration::from_secs(2);
    let mut conn =
        streams::blocking(&client, block).await.map_err(|e| format!("cannot connect to Redis: {e}"))?;
    let mut last = match &opts.checkpoint {
        Some(p) => match std::fs::read_to_string(p) {
            Ok(s) if !s.trim().is_empty() => s.trim().to_string(),
            _ => opts.from.clone(),
        },
        None => opts.from.clone(),
    };
    if last == "$" {
        // Resolve "now" to a concrete id so a reconnect does not skip events.
        let info: redis::RedisResult<redis::streams::StreamInfoStreamReply> =
            redis::cmd("XINFO").arg("STREAM").arg(keys.events()).query_async(&mut conn).await;
        last = info.map(|i| i.last_generated_id).unwrap_or_else(|_| "0-0".into());
    }
    let mut printed = 0u64;
    loop {
        let mut cmd = redis::cmd("XREAD");
        cmd.arg("COUNT").arg(500);
        if !opts.no_follow {
            cmd.arg("BLOCK").arg(block.as_millis() as u64);
        }
        cmd.arg("STREAMS").arg(keys.events()).arg(&last);
        let reply: StreamReadReply = tokio::select! {
            _ = cancel.cancelled() => return Ok(printed),
            r = cmd.query_async(&mut conn) => match r {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(error = %e, "tail: read failed; reconnecting");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    conn = streams::blocking(&client, block).await.map_err(|e| format!("cannot reconnect to Redis: {e}"))?;
                    continue;
                }
            },
        };
        let entries: Vec<_> = reply.keys.into_iter().flat_map(|k| k.ids).collect();
        if entries.is_empty() && opts.no_follow {
            return Ok(printed);
        }
        for e in entries {
            let body = field(&e.map, "body").unwrap_or_default();
            let event = field(&e.map, "event").unwrap_or_default();
            if opts.json {
                let mut v: serde_json::Value = serde_json::from_str(&body).unwrap_or(serde_json::Value::Null);
                if let Some(o) = v.as_object_mut() {
                    o.insert("stream_id".into(), e.id.clone().into());
                    o.entry("event").or_insert_with(|| event.clone().into());
                }
                writeln!(out, "{v}").map_err(|e| e.to_string())?;
            } else {
                writeln!(out, "{}", human_line(&e.id, &event, &body)).map_err(|e| e.to_string())?;
            }
            last = e.id;
            printed += 1;
            if opts.count.is_some_and(|c| printed >= c) {
                break;
            }
        }
        out.flush().map_err(|e| e.to_string())?;
        if let Some(p) = &opts.checkpoint {
            let tmp = p.with_extension("tmp");
            std::fs::write(&tmp, &last).and_then(|_| std::fs::rename(&tmp, p)).map_err(|e| e.to_string())?;
        }
        if opts.count.is_some_and(|c| printed >= c) {
            return Ok(printed);
        }
    }
}

/// One event as a human line.
pub fn human_line(id: &str, event: &str, body: &str) -> String {
    let v: serde_json::Value = serde_json::from_str(body).unwrap_or(serde_json::Value::Null);
    // Values come from stream entries (doc ids are user data): control characters are
    // escaped so an entry cannot forge lines or send terminal escape sequences.
    let s = |k: &str| match &v[k] {
        serde_json::Value::Null => None,
        serde_json::Value::String(s) => Some(escape_controls(s)),
        other => Some(escape_controls(&other.to_string())),
    };
    let (id, event) = (escape_controls(id), escape_controls(event));
    let mut line = format!(
        "{id} {event:<9} {}#{}",
        s("doc_id").unwrap_or_else(|| "?".into()),
        s("chunk_index").unwrap_or_else(|| "?".into())
    );
    for k in ["error_class", "error_reason", "attempts", "replays", "next_retry_at", "exhausted_reason"] {
        if let Some(val) = s(k) {
            line.push_str(&format!(" {k}={val}"));
        }
    }
    line
}

/// `s` with every control character (newline, ESC, ...) written as a Rust escape.
fn escape_controls(s: &str) -> String {
    if !s.chars().any(char::is_control) {
        return s.to_string();
    }
    s.chars().map(|c| if c.is_control() { c.escape_default().to_string() } else { c.to_string() }).collect()
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
    fn human_lines_escape_control_characters() {
        let body = serde_json::json!({"doc_id": "evil\n1-0 parked    forged#0\u{1b}[31m", "chunk_index": 1})
            .to_string();
        let line = human_line("1-0", "parked", &body);
        assert!(!line.contains('\n') && !line.contains('\u{1b}'), "{line:?}");
        assert!(line.contains("evil\\n1-0") && line.contains("\\u{1b}[31m"), "{line:?}");
        assert_eq!(human_line("1-0", "parked", r#"{"doc_id":"d","chunk_index":2}"#), "1-0 parked    d#2");
    }
}
