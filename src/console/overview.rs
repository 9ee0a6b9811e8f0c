//! What the overview shows, gathered: the DLQ's depth and schedule, activity over the last
//! hour and day, the outbox backlog, the streams per shard, the last reconcile run, the
//! provider breaker's state (of this process, and read from the metrics endpoints given) and
//! the revisions of targets that have them.

use std::time::Duration;

use crate::gauges::StreamStats;
use crate::relay::sql::Backlog;
use crate::store::StoreError;
use crate::store::console::{self as sql, Bucket, ReasonDepth, ReconcileRun};
use crate::store::dlq::{Schedule, Stats};

use super::state::State;

/// Everything on the overview.
#[derive(Debug)]
pub struct Overview {
    pub stats: Stats,
    pub reasons: Vec<ReasonDepth>,
    pub schedule: Schedule,
    pub backlog: Backlog,
    /// 12 buckets of 5 minutes.
    pub hour: Vec<Bucket>,
    /// 24 buckets of an hour.
    pub day: Vec<Bucket>,
    /// Per shard and stream, or why they could not be read.
    pub streams: Result<Vec<StreamStats>, String>,
    pub reconcile: Option<ReconcileRun>,
    pub breakers: Vec<BreakerReading>,
    /// The stream source's streams (none configured: empty), or why they could not be read.
    pub sources: Result<Vec<SourceStats>, String>,
    /// Every revision of the targets with revisions (none: empty), with its chunks, DLQ rows
    /// and coverage of its target's active revision, or why they could not be read.
    pub revisions: Result<Vec<crate::store::revision::RevisionNumbers>, String>,
    /// Every Postgres table source with its queue and lag (none registered: empty), or why
    /// they could not be read.
    pub table_sources: Result<Vec<TableSourceStats>, String>,
}

/// One Postgres table source as the overview shows it.
#[derive(Debug, Clone)]
pub struct TableSourceStats {
    pub name: String,
    pub table: String,
    pub target: String,
    pub snapshot_done: bool,
    /// Queued changes (capped at `table_source::LAG_COUNT_CAP`).
    pub changes: i64,
    /// Age of the oldest queued change, seconds.
    pub lag_secs: f64,
    /// Capture triggers missing or disabled: changes are not captured.
    pub missing_triggers: Vec<String>,
}

/// Every table source's numbers (a database without the migration has none).
async fn table_sources(pool: &sqlx::PgPool) -> Result<Vec<TableSourceStats>, String> {
    use crate::store::table_source;
    let names = table_source::list(pool).await.map_err(|e| e.to_string())?;
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        let s = table_source::load(pool, &name).await.map_err(|e| e.to_string())?;
        let (changes, lag_secs) = table_source::lag(pool, &name).await.map_err(|e| e.to_string())?;
        let missing_triggers = table_source::missing_triggers(pool, &s).await.map_err(|e| e.to_string())?;
        out.push(TableSourceStats {
            name: s.name,
            table: s.table,
            target: s.target_table,
            snapshot_done: s.snapshot_done,
            changes,
            lag_secs,
            missing_triggers,
        });
    }
    Ok(out)
}

/// One source stream as its consumer group sees it.
#[derive(Debug, Clone)]
pub struct SourceStats {
    pub stream: String,
    pub group: String,
    /// Entries in the stream (`XLEN`), clamped.
    pub length: u64,
    /// Delivered and not acknowledged; `None` without the group.
    pub pending: Option<u64>,
    /// Not yet delivered; `None` when Redis cannot tell.
    pub lag: Option<u64>,
}

/// The configured source streams' numbers.
async fn sources(state: &State) -> Result<Vec<SourceStats>, String> {
    let Some((streams, group)) = &state.console.config.source else { return Ok(Vec::new()) };
    let mut redis = state.redis().await?;
    let mut out = Vec::new();
    for stream in streams {
        let length: i64 = redis::cmd("XLEN")
            .arg(stream)
            .query_async(&mut redis)
            .await
            .map_err(|e| format!("Redis: {e}"))?;
        let info = crate::ingest::source::group_info(&mut redis, stream, group)
            .await
            .or_else(|e| if e.code() == Some("ERR") { Ok(None) } else { Err(format!("Redis: {e}")) })?;
        out.push(SourceStats {
            stream: stream.clone(),
            group: group.clone(),
            length: length.clamp(0, 1 << 48) as u64,
            pending: info.map(|(p, _)| p),
            lag: info.and_then(|(_, l)| l),
        });
    }
    Ok(out)
}

/// The breaker state one source reports.
#[derive(Debug, Clone)]
pub struct BreakerReading {
    /// "this process" or a metrics URL without credentials.
    pub source: String,
    /// `closed`, `half-open`, `open`, or why it could not be read.
    pub state: Result<&'static str, String>,
    /// Times the breaker opened, as reported.
    pub opened: Option<u64>,
}

/// Gathers the overview (the database parts fail the page; Redis and metrics endpoints
/// only their sections).
pub async fn gather(state: &State) -> Result<Overview, StoreError> {
    let pool = state.console.store.pool();
    let stats = crate::store::dlq::stats(pool, None).await?;
    let reasons = sql::depth_by_reason(pool).await?;
    let schedule = crate::store::dlq::schedule(pool).await?;
    let backlog = crate::relay::sql::backlog(pool, Duration::ZERO).await?;
    let hour = sql::activity(pool, 300, 12).await?;
    let day = sql::activity(pool, 3600, 24).await?;
    let reconcile = sql::reconcile_runs(pool, 1).await?.into_iter().next();
    let streams = match state.redis().await {
        Ok(mut redis) => {
            let refs = crate::gauges::stream_refs(&state.console.keys);
            crate::gauges::stream_stats(&mut redis, &refs).await.map_err(|e| format!("Redis: {e}"))
        }
        Err(e) => Err(e),
    };
    let breakers = breakers(state).await;
    let sources = sources(state).await;
    let revisions = crate::store::revision::numbers(pool, None).await.map_err(|e| e.to_string());
    let table_sources = table_sources(pool).await;
    Ok(Overview {
        stats,
        reasons,
        schedule,
        backlog,
        hour,
        day,
        streams,
        reconcile,
        breakers,
        sources,
        revisions,
        table_sources,
    })
}

fn state_name(v: f64) -> Result<&'static str, String> {
    // A value a server sends is clamped to what it can mean.
    match v.round() as i64 {
        0 => Ok("closed"),
        1 => Ok("half-open"),
        2 => Ok("open"),
        _ => Err(format!("unexpected value {v}")),
    }
}

/// The breaker of this process (inside `serve`) and of every metrics endpoint configured.
async fn breakers(state: &State) -> Vec<BreakerReading> {
    let mut out = Vec::new();
    if let Some(gate) = &state.console.gate {
        let v = match gate.breaker_state() {
            crate::embed::gate::BreakerState::Closed => 0.0,
            crate::embed::gate::BreakerState::HalfOpen => 1.0,
            crate::embed::gate::BreakerState::Open => 2.0,
        };
        out.push(BreakerReading {
            source: "this process (serve)".into(),
            state: state_name(v),
            opened: Some(gate.times_opened()),
        });
    }
    let reads = state.console.config.metrics_urls.iter().map(|u| scrape_breaker(&state.http, u));
    out.extend(futures::future::join_all(reads).await);
    out
}

/// Longest metrics body read from an endpoint.
const MAX_SCRAPE_BYTES: usize = 4 << 20;

async fn scrape_breaker(http: &reqwest::Client, url: &str) -> BreakerReading {
    let source = redact_url(url);
    let body = async {
        let mut resp = http.get(url).send().await.map_err(short_error)?;
        if !resp.status().is_success() {
            return Err(format!("HTTP {}", resp.status().as_u16()));
        }
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(short_error)? {
            if body.len() + chunk.len() > MAX_SCRAPE_BYTES {
                return Err(format!("metrics longer than {MAX_SCRAPE_BYTES} bytes"));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(String::from_utf8_lossy(&body).into_owned())
    };
    match body.await {
        Ok(text) => {
            let state = sample(&text, crate::metrics::BREAKER_STATE)
                .map(state_name)
                .unwrap_or_else(|| Err("no breaker gauge yet (no provider call)".into()));
            let opened = sample(&text, crate::metrics::BREAKER_OPENED).map(|v| v.clamp(0.0, 1e15) as u64);
            BreakerReading { source, state, opened }
        }
        Err(e) => BreakerReading { source, state: Err(e), opened: None },
    }
}

/// The value of the first sample of `name` (any labels) in Prometheus text.
fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?;
        let rest = match rest.as_bytes().first()? {
            b' ' => rest,
            b'{' => &rest[rest.rfind('}')? + 1..],
            _ => return None,
        };
        rest.split_whitespace().next()?.parse::<f64>().ok().filter(|v| v.is_finite())
    })
}

/// An error's message without the URL reqwest puts in it (it may carry credentials).
fn short_error(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut s = e.to_string();
    s.truncate(200);
    s
}

/// `url` without credentials, query or fragment, for display.
pub fn redact_url(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(mut u) => {
            let _ = u.set_username("");
            let _ = u.set_password(None);
            u.set_query(None);
            u.set_fragment(None);
            u.to_string()
        }
        Err(_) => "(not a URL)".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_read_and_clamped() {
        let text = "# HELP embed_dlq_breaker_state x\nembed_dlq_breaker_state_other 5\nembed_dlq_breaker_state 2\n\
                    embed_dlq_breaker_opened_total{a=\"}\"} 3\n";
        assert_eq!(sample(text, crate::metrics::BREAKER_STATE), Some(2.0));
        assert_eq!(state_name(2.0), Ok("open"));
        assert!(state_name(1e300).is_err());
        assert_eq!(sample("embed_dlq_breaker_state NaN\n", crate::metrics::BREAKER_STATE), None);
    }

    #[test]
    fn urls_lose_their_credentials() {
        assert_eq!(redact_url("http://user:secret@host:9464/metrics?token=x"), "http://host:9464/metrics");
        assert_eq!(redact_url("::"), "(not a URL)");
    }
}
