//! `tail`: the follower's output. The library delivers events; this renders each one as a
//! human line or one JSON object on stdout.

use std::io::Write;

use embed_dlq::config::{FileConfig, ServeArgs};
use embed_dlq::streams::{RedisClient, StreamKeys};
use embed_dlq::tail::{EventSink, StreamGap, TailError, TailEvent, TailOptions};
use tokio_util::sync::CancellationToken;

use super::args::TailCommand;
use super::{Resolver, exit};

/// Runs `tail`; returns the exit code.
pub async fn command(resolver: &Resolver, args: TailCommand, cancel: CancellationToken) -> i32 {
    let TailCommand { from, on_gap, json, checkpoint, count, no_follow, stream_prefix, stream_shards } = args;
    let flags = FileConfig {
        serve: ServeArgs { stream_prefix, stream_shards, ..Default::default() },
        ..Default::default()
    };
    let (redis, settings) = match resolver.settings(flags).and_then(|s| Ok((s.redis_client()?, s))) {
        Ok(r) => r,
        Err(e) => return exit::usage(&e),
    };
    let keys = settings.stream_keys();
    if let Ok(url) = settings.database_url()
        && let Err(code) = check_prefix(url, keys.prefix()).await
    {
        return code;
    }
    let opts = TailOptions { from, checkpoint, count, no_follow, on_gap };
    follow(&redis, &keys, opts, json, cancel).await
}

/// How long `tail` waits for the database to check the stream prefix.
const PREFIX_CHECK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// With a database configured, `tail` refuses one relayed under another prefix (it would
/// follow streams nobody writes to). The events are in Redis, so a database that cannot be
/// reached only costs the check (a warning), not the tail.
async fn check_prefix(url: &str, prefix: &str) -> Result<(), i32> {
    let pool = match tokio::time::timeout(PREFIX_CHECK_TIMEOUT, embed_dlq::store::connect(url, 1)).await {
        Ok(Ok(pool)) => pool,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "tail: cannot check the database's stream prefix; following {prefix:?} unchecked");
            return Ok(());
        }
        Err(_) => {
            tracing::warn!("tail: the database did not answer; following stream prefix {prefix:?} unchecked");
            return Ok(());
        }
    };
    let checked = super::refuse_other_prefix(&pool, prefix).await;
    pool.close().await;
    checked
}

/// Follows the events stream of `keys` on stdout.
async fn follow(
    redis: &RedisClient,
    keys: &StreamKeys,
    opts: TailOptions,
    json: bool,
    cancel: CancellationToken,
) -> i32 {
    if let Err(e) = embed_dlq::tail::check_from(&opts.from) {
        return exit::fail(exit::USAGE, &format!("--from: {e}"));
    }
    let mut sink = LineSink { out: std::io::stdout(), json };
    match embed_dlq::tail::tail(redis, keys, &opts, &mut sink, cancel).await {
        Ok(_) => exit::OK,
        // Already on stderr (the sink's gap line).
        Err(TailError::Gap(_)) => exit::TAIL_GAP,
        Err(e @ TailError::Shards(embed_dlq::streams::ShardsError::Mismatch(_))) => {
            exit::fail(exit::USAGE, &e.to_string())
        }
        Err(e) => exit::fail(exit::FAILURE, &e.to_string()),
    }
}

/// Writes each event as a line to `out`.
pub struct LineSink<W: Write> {
    /// Where the lines go (stdout for the command).
    pub out: W,
    /// One JSON object per event instead of a human line.
    pub json: bool,
}

impl<W: Write> EventSink for LineSink<W> {
    fn event(&mut self, e: &TailEvent) -> std::io::Result<()> {
        if self.json {
            writeln!(self.out, "{}", e.to_json())
        } else {
            let mut line = human_line(&e.id, &e.event, &e.body);
            if let Some(seq) = e.late_after_seq {
                line.push_str(&format!(" LATE(after seq {seq})"));
            }
            writeln!(self.out, "{line}")
        }
    }

    /// A gap goes to stderr (so it never mixes with the events of stdout), whatever the
    /// output format.
    fn gap(&mut self, gap: &StreamGap) -> std::io::Result<()> {
        self.out.flush()?;
        eprintln!("embed-dlq: tail: gap: {gap}");
        Ok(())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

/// One event as a human line.
fn human_line(id: &str, event: &str, body: &str) -> String {
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
    for k in [
        "error_class",
        "error_reason",
        "attempts",
        "replays",
        "next_retry_at",
        "exhausted_reason",
        "withdrawn_hash",
        "by",
    ] {
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
    fn human_lines_escape_control_characters() {
        let body = serde_json::json!({"doc_id": "evil\n1-0 parked    forged#0\u{1b}[31m", "chunk_index": 1})
            .to_string();
        let line = human_line("1-0", "parked", &body);
        assert!(!line.contains('\n') && !line.contains('\u{1b}'), "{line:?}");
        assert!(line.contains("evil\\n1-0") && line.contains("\\u{1b}[31m"), "{line:?}");
        assert_eq!(human_line("1-0", "parked", r#"{"doc_id":"d","chunk_index":2}"#), "1-0 parked    d#2");
    }

    #[test]
    fn a_deleted_event_shows_by_whom() {
        let body = r#"{"doc_id":"d","chunk_index":2,"content_hash":"h","had_vector":true,"by":"cleanup"}"#;
        assert_eq!(human_line("1-0", "deleted", body), "1-0 deleted   d#2 by=cleanup");
    }

    #[test]
    fn a_withdrawn_event_shows_which_text_was_withdrawn_and_by_whom() {
        let body =
            r#"{"doc_id":"d","chunk_index":2,"content_hash":"new","withdrawn_hash":"old","by":"ingest"}"#;
        assert_eq!(human_line("1-0", "withdrawn", body), "1-0 withdrawn d#2 withdrawn_hash=old by=ingest");
    }
}
