//! Prometheus metrics: names in `embed_dlq_<thing>_<unit>` form, label values from small fixed
//! sets only (error class, reason, outcome, check, stream — never ids or messages). Counters
//! are bumped where things happen; gauges that describe the database and the streams are
//! sampled by `sample` (serve does it every few seconds, reconcile after every run).
//! A retried attempt is counted in `retries_total`, never as parked or dropped.

use std::net::SocketAddr;

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};

use crate::model::ErrorClass;

pub(crate) const CHUNKS_STORED: &str = "embed_dlq_chunks_stored_total";
pub(crate) const CHUNKS_SKIPPED: &str = "embed_dlq_chunks_skipped_total";
pub(crate) const CHUNKS_PARKED: &str = "embed_dlq_chunks_parked_total";
pub(crate) const CHUNKS_DELETED: &str = "embed_dlq_chunks_deleted_total";
pub(crate) const LINES_REJECTED: &str = "embed_dlq_input_lines_rejected_total";
pub(crate) const RETRIES: &str = "embed_dlq_retries_total";
pub(crate) const PROVIDER_REQUESTS: &str = "embed_dlq_provider_requests_total";
pub(crate) const PROVIDER_DURATION: &str = "embed_dlq_provider_request_duration_seconds";
pub(crate) const BREAKER_STATE: &str = "embed_dlq_breaker_state";
pub(crate) const BREAKER_OPENED: &str = "embed_dlq_breaker_opened_total";
pub(crate) const RELAY_PUBLISHED: &str = "embed_dlq_relay_published_total";
pub(crate) const RELAY_DUPLICATES: &str = "embed_dlq_relay_duplicates_total";
pub(crate) const REPLAY_OUTCOMES: &str = "embed_dlq_replay_outcomes_total";
pub(crate) const REPLAY_LEASES_RELEASED: &str = "embed_dlq_replay_leases_released_total";
pub(crate) const DLQ_DEPTH: &str = "embed_dlq_dlq_depth";
pub(crate) const DLQ_READY: &str = "embed_dlq_dlq_ready";
pub(crate) const DLQ_BACKING_OFF: &str = "embed_dlq_dlq_backing_off";
pub(crate) const DLQ_EXHAUSTED: &str = "embed_dlq_dlq_exhausted";
pub(crate) const DLQ_OLDEST_AGE: &str = "embed_dlq_dlq_oldest_age_seconds";
pub(crate) const DLQ_NEXT_DUE: &str = "embed_dlq_dlq_next_due_seconds";
pub(crate) const OUTBOX_BACKLOG: &str = "embed_dlq_outbox_backlog";
pub(crate) const OUTBOX_OLDEST_AGE: &str = "embed_dlq_outbox_oldest_age_seconds";
pub(crate) const STREAM_LENGTH: &str = "embed_dlq_stream_length";
pub(crate) const STREAM_PENDING: &str = "embed_dlq_stream_pending";
pub(crate) const STREAM_LAG: &str = "embed_dlq_stream_lag";
pub(crate) const RECONCILE_FINDINGS: &str = "embed_dlq_reconcile_findings";
pub(crate) const RECONCILE_LAST_SUCCESS: &str = "embed_dlq_reconcile_last_success_timestamp_seconds";
pub(crate) const RECONCILE_DURATION: &str = "embed_dlq_reconcile_duration_seconds";
pub(crate) const LIMITER_DELAYED: &str = "embed_dlq_limiter_delayed_requests_total";
pub(crate) const LIMITER_WAIT: &str = "embed_dlq_limiter_wait_seconds";
pub(crate) const LIMITER_HEADER_PAUSES: &str = "embed_dlq_limiter_header_pauses_total";
pub(crate) const LIMITER_FACTOR: &str = "embed_dlq_limiter_factor";
pub(crate) const TOKENS: &str = "embed_dlq_tokens_total";
pub(crate) const SOURCE_READ: &str = "embed_dlq_source_entries_read_total";
pub(crate) const SOURCE_ACKED: &str = "embed_dlq_source_entries_acked_total";
pub(crate) const SOURCE_RECLAIMED: &str = "embed_dlq_source_entries_reclaimed_total";
pub(crate) const SOURCE_POISON: &str = "embed_dlq_source_entries_poison_total";
pub(crate) const SOURCE_REVISION_DROPPED: &str = "embed_dlq_source_revision_dropped_total";
pub(crate) const REVISION_ACTIVE: &str = "embed_dlq_revision_active";
pub(crate) const REVISION_CHUNKS: &str = "embed_dlq_revision_chunks";
pub(crate) const REVISION_DLQ_ROWS: &str = "embed_dlq_revision_dlq_rows";
pub(crate) const REVISION_UNCOVERED: &str = "embed_dlq_revision_uncovered";
pub(crate) const REVISION_COVERED_RATIO: &str = "embed_dlq_revision_covered_ratio";
pub(crate) const SOURCE_PENDING: &str = "embed_dlq_source_pending";
pub(crate) const SOURCE_LAG: &str = "embed_dlq_source_lag";
pub(crate) const TABLE_SOURCE_CHANGES: &str = "embed_dlq_table_source_changes";
pub(crate) const TABLE_SOURCE_LAG: &str = "embed_dlq_table_source_lag_seconds";

/// Why the exporter could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MetricsError {
    /// The exporter rejected its own configuration (the histogram buckets).
    #[error("{0}")]
    Exporter(#[source] metrics_exporter_prometheus::BuildError),
    /// The listener could not be bound, or a recorder was already installed.
    #[error("cannot serve metrics on {addr}: {source}")]
    Install {
        /// The address asked for.
        addr: SocketAddr,
        /// The exporter's reason.
        #[source]
        source: metrics_exporter_prometheus::BuildError,
    },
}

/// Starts the `/metrics` endpoint on `addr` (inside the tokio runtime) and describes every
/// metric.
pub fn install(addr: SocketAddr) -> Result<(), MetricsError> {
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets_for_metric(
            Matcher::Full(PROVIDER_DURATION.into()),
            &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0],
        )
        .map_err(MetricsError::Exporter)?
        .set_buckets_for_metric(
            Matcher::Full(LIMITER_WAIT.into()),
            &[0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0],
        )
        .map_err(MetricsError::Exporter)?
        .install()
        .map_err(|source| MetricsError::Install { addr, source })?;
    describe();
    initialise();
    Ok(())
}

/// How the reference describes the `revision` label of the counters that carry it.
pub(crate) const REVISION_LABEL: &str =
    "`revision` = the number of the target's revision written (1 for a table without revisions)";

/// Labels of the gauges that get theirs when sampled, not from [`initialise`] (for the
/// generated reference, `docs/reference/metrics.md`).
pub(crate) const SAMPLED_LABELS: &[(&str, &str)] = &[
    (DLQ_DEPTH, "`error_class`"),
    (STREAM_LENGTH, "`stream` = events, replay; `shard` = 0..N-1"),
    (STREAM_PENDING, "`stream` = replay; `shard` = 0..N-1"),
    (STREAM_LAG, "`stream` = replay; `shard` = 0..N-1"),
    (RECONCILE_FINDINGS, "`check` (the reconciler's checks, summed over every target table)"),
    (SOURCE_PENDING, "`stream` = the configured source stream keys (at most 64)"),
    (SOURCE_LAG, "`stream` = the configured source stream keys (at most 64)"),
    (TABLE_SOURCE_CHANGES, "`source` = the followed table source's name"),
    (TABLE_SOURCE_LAG, "`source` = the followed table source's name"),
    (REVISION_ACTIVE, REVISION_LABELS),
    (REVISION_CHUNKS, REVISION_LABELS),
    (REVISION_DLQ_ROWS, REVISION_LABELS),
    (REVISION_UNCOVERED, REVISION_LABELS),
    (REVISION_COVERED_RATIO, REVISION_LABELS),
];

/// The labels of the revision gauges: bounded by the revisions the registry holds.
const REVISION_LABELS: &str = "`target` = each target with revisions (canonical name); `revision` = its revisions' numbers (a retired one reads 0)";

/// Registers every counter at zero for each of its fixed label values, and the breaker and
/// limiter gauges at their resting values, so a scrape shows every family from the start:
/// `rate()` and `increase()` see the first event, dashboards have no gaps, and an alert on
/// a counter does not depend on its first increment.
pub(crate) fn initialise() {
    counter!(CHUNKS_STORED, "revision" => "1").increment(0);
    for c in [LINES_REJECTED, BREAKER_OPENED, RELAY_PUBLISHED, RELAY_DUPLICATES] {
        counter!(c).increment(0);
    }
    for c in [LIMITER_DELAYED, LIMITER_HEADER_PAUSES] {
        counter!(c).increment(0);
    }
    for reason in ["unchanged", "already_parked", "leased_elsewhere", "differs_from_active"] {
        counter!(CHUNKS_SKIPPED, "reason" => reason, "revision" => "1").increment(0);
    }
    for class in ErrorClass::ALL {
        counter!(CHUNKS_PARKED, "error_class" => class.as_str(), "revision" => "1").increment(0);
    }
    for by in ["input", "cleanup"] {
        counter!(CHUNKS_DELETED, "by" => by).increment(0);
    }
    for reason in crate::model::Reason::RETRIED {
        counter!(RETRIES, "reason" => reason.as_str()).increment(0);
    }
    for outcome in ["ok", "retry", "reject", "systemic"] {
        counter!(PROVIDER_REQUESTS, "outcome" => outcome, "revision" => "1").increment(0);
    }
    for outcome in ["replayed", "reparked", "exhausted", "skipped"] {
        counter!(REPLAY_OUTCOMES, "outcome" => outcome).increment(0);
    }
    counter!(REPLAY_LEASES_RELEASED).increment(0);
    for c in [SOURCE_READ, SOURCE_ACKED, SOURCE_RECLAIMED, SOURCE_POISON, SOURCE_REVISION_DROPPED] {
        counter!(c).increment(0);
    }
    for outcome in ["stored", "wasted"] {
        counter!(TOKENS, "outcome" => outcome, "revision" => "1").increment(0);
    }
    // Registered, never recorded: the exporter serves their (empty) buckets.
    let _ = metrics::histogram!(PROVIDER_DURATION);
    let _ = metrics::histogram!(LIMITER_WAIT);
    gauge!(BREAKER_STATE).set(0.0);
    gauge!(LIMITER_FACTOR).set(1.0);
}

pub(crate) fn describe() {
    describe_counter!(CHUNKS_STORED, "Chunks whose vector was stored (ingest and replay).");
    describe_counter!(
        CHUNKS_SKIPPED,
        "Chunks skipped because the same content is already stored or parked, leased to a concurrent run, or (a backfill) not what the active revision holds."
    );
    describe_counter!(CHUNKS_PARKED, "Chunks parked in the DLQ, by error class.");
    describe_counter!(
        CHUNKS_DELETED,
        "Chunks deleted by an ingest (vector, manifest row, any DLQ row), by an input delete or the run's cleanup."
    );
    describe_counter!(LINES_REJECTED, "Input lines without a usable identity (reported, not stored).");
    describe_counter!(RETRIES, "In-process retries of provider requests, by reason.");
    describe_counter!(PROVIDER_REQUESTS, "Provider requests, by outcome (ok, retry, reject, systemic).");
    describe_histogram!(PROVIDER_DURATION, metrics::Unit::Seconds, "Provider request latency.");
    describe_gauge!(BREAKER_STATE, "Circuit breaker: 0 closed, 1 half-open, 2 open.");
    describe_counter!(BREAKER_OPENED, "Times the circuit breaker opened.");
    describe_counter!(RELAY_PUBLISHED, "Outbox rows published to Redis Streams.");
    describe_counter!(
        RELAY_DUPLICATES,
        "Outbox rows whose entry already existed (republished after a crash)."
    );
    describe_counter!(REPLAY_OUTCOMES, "Replay work items, by outcome.");
    describe_counter!(
        REPLAY_LEASES_RELEASED,
        "Replay leases released because their work items were lost with a replay stream's data."
    );
    describe_gauge!(DLQ_DEPTH, "DLQ rows, by error class.");
    describe_gauge!(DLQ_READY, "Transient DLQ rows due for replay (permanent rows never count).");
    describe_gauge!(DLQ_BACKING_OFF, "Transient DLQ rows waiting for their next replay.");
    describe_gauge!(DLQ_EXHAUSTED, "DLQ rows automatic replay gave up on.");
    describe_gauge!(DLQ_OLDEST_AGE, metrics::Unit::Seconds, "Age of the oldest DLQ row.");
    describe_gauge!(
        DLQ_NEXT_DUE,
        metrics::Unit::Seconds,
        "Seconds until the next scheduled replay (0 if due)."
    );
    describe_gauge!(OUTBOX_BACKLOG, "Outbox rows not yet published.");
    describe_gauge!(OUTBOX_OLDEST_AGE, metrics::Unit::Seconds, "Age of the oldest unpublished outbox row.");
    describe_gauge!(STREAM_LENGTH, "Entries in a stream.");
    describe_gauge!(
        STREAM_PENDING,
        "Replay entries (a batch of work items each) delivered to the replayers and not yet acknowledged."
    );
    describe_gauge!(
        STREAM_LAG,
        "Replay entries (a batch of work items each) not yet delivered to the replayers."
    );
    describe_gauge!(RECONCILE_FINDINGS, "Findings of the last reconcile run, by check.");
    describe_gauge!(
        RECONCILE_LAST_SUCCESS,
        metrics::Unit::Seconds,
        "Unix time of the last finished reconcile run."
    );
    describe_gauge!(RECONCILE_DURATION, metrics::Unit::Seconds, "Duration of the last reconcile run.");
    describe_counter!(
        LIMITER_DELAYED,
        "Provider requests held back by the rate/token limiter or rate-limit headers."
    );
    describe_histogram!(
        LIMITER_WAIT,
        metrics::Unit::Seconds,
        "How long each held-back provider request waited for the limiter (its sum: the time waited in all)."
    );
    describe_counter!(
        LIMITER_HEADER_PAUSES,
        "Pauses set because rate-limit headers said the provider was nearly out."
    );
    describe_gauge!(
        LIMITER_FACTOR,
        "AIMD factor of the provider budget (1 = as configured; lower after 429s)."
    );
    describe_counter!(
        TOKENS,
        "Provider tokens (estimated from characters, or the plausible reported usage), by outcome: stored (a usable vector) or wasted (failed requests, unusable vectors, canaries, re-sent inputs)."
    );
    describe_counter!(SOURCE_READ, "Source stream entries read (new, and taken over from idle consumers).");
    describe_counter!(
        SOURCE_ACKED,
        "Source stream entries acknowledged: their store or park committed, or they were skipped as done."
    );
    describe_counter!(SOURCE_RECLAIMED, "Source stream entries taken over from idle consumers (XAUTOCLAIM).");
    describe_counter!(
        SOURCE_REVISION_DROPPED,
        "Times a stream source let a revision other than the active one go for the rest of a segment, its run having stopped: that revision misses writes until a backfill."
    );
    describe_counter!(
        SOURCE_POISON,
        "Source stream entries parked as invalid_record after the delivery cap (they killed their consumer)."
    );
    describe_gauge!(
        SOURCE_PENDING,
        "Source stream entries delivered to the ingest group and not yet acknowledged, by stream (XINFO GROUPS)."
    );
    describe_gauge!(
        SOURCE_LAG,
        "Source stream entries not yet delivered to the ingest group, by stream (XINFO GROUPS lag)."
    );
    describe_gauge!(
        TABLE_SOURCE_CHANGES,
        "Changes a table source's triggers queued that its follower has not applied yet, up to 1,000,000 (sampled by the follower each poll and by serve)."
    );
    describe_gauge!(
        TABLE_SOURCE_LAG,
        metrics::Unit::Seconds,
        "Age of a table source's oldest change not yet applied: the follower's lag (0 when the queue is empty)."
    );
    describe_gauge!(
        REVISION_ACTIVE,
        "1 for the revision a target's query name answers, 0 for its others (sampled every minute by serve)."
    );
    describe_gauge!(REVISION_CHUNKS, "Chunks a revision's manifest holds (stored, parked or in flight).");
    describe_gauge!(REVISION_DLQ_ROWS, "DLQ rows parked under a revision's identity (its backlog).");
    describe_gauge!(
        REVISION_UNCOVERED,
        "Chunks of the active revision a revision does not cover (missing, of other text, unresolved, without a vector, or extra): revision activate refuses a switch while this is above its --allow-missing. 0 for the active revision."
    );
    describe_gauge!(
        REVISION_COVERED_RATIO,
        "Share of the active revision's chunks a revision covers (1 for the active revision; 1 when the active one is empty)."
    );
}

/// The `revision` label's value: the number of the revision of a target written (a table
/// without revisions is its revision 1, as it becomes when adopted), so that a backfill's
/// calls, tokens and outcomes read apart from the active revision's.
fn revision_label(revision: i32) -> metrics::SharedString {
    match revision {
        1 => metrics::SharedString::const_str("1"),
        n => n.to_string().into(),
    }
}

/// Samples a table source's queue: changes pending and the oldest one's age.
pub(crate) fn table_source_lag(source: &str, changes: i64, age_secs: f64) {
    gauge!(TABLE_SOURCE_CHANGES, "source" => source.to_string()).set(changes as f64);
    gauge!(TABLE_SOURCE_LAG, "source" => source.to_string()).set(age_secs);
}

/// Counts provider tokens spent for `revision`: those that produced a usable vector and
/// those sent for nothing.
pub(crate) fn tokens(revision: i32, stored: u64, wasted: u64) {
    if stored > 0 {
        counter!(TOKENS, "outcome" => "stored", "revision" => revision_label(revision)).increment(stored);
    }
    if wasted > 0 {
        counter!(TOKENS, "outcome" => "wasted", "revision" => revision_label(revision)).increment(wasted);
    }
}

/// Counts one provider request made for `revision`.
pub(crate) fn provider_request(revision: i32, outcome: &'static str, seconds: f64) {
    counter!(PROVIDER_REQUESTS, "outcome" => outcome, "revision" => revision_label(revision)).increment(1);
    metrics::histogram!(PROVIDER_DURATION).record(seconds);
}

/// Counts parks of `revision`'s chunks by class.
pub(crate) fn parked(revision: i32, class: ErrorClass, n: u64) {
    counter!(CHUNKS_PARKED, "error_class" => class.as_str(), "revision" => revision_label(revision))
        .increment(n);
}

/// Counts `revision`'s chunks whose vector was stored.
pub(crate) fn stored(revision: i32, n: u64) {
    counter!(CHUNKS_STORED, "revision" => revision_label(revision)).increment(n);
}

/// Counts `revision`'s chunks skipped for `reason`.
pub(crate) fn skipped(revision: i32, reason: &'static str, n: u64) {
    counter!(CHUNKS_SKIPPED, "reason" => reason, "revision" => revision_label(revision)).increment(n);
}

#[cfg(test)]
mod tests {
    use crate::embed::classify::{Verdict, classify, classify_status};

    #[test]
    fn every_retry_reason_is_initialised() {
        let mut reasons = std::collections::BTreeSet::new();
        for status in 100..=599u16 {
            for error_type in [None, Some("insufficient_quota")] {
                if let Verdict::Retry { reason, .. } = classify_status(status, error_type, None) {
                    reasons.insert(reason);
                }
            }
        }
        for err in [
            crate::embed::client::EmbedError::Timeout,
            crate::embed::client::EmbedError::Decode("x".into()),
            crate::embed::client::EmbedError::TooLarge { limit: 1 },
            crate::embed::client::EmbedError::Connect("x".into()),
            crate::embed::client::EmbedError::Transport("x".into()),
        ] {
            if let Verdict::Retry { reason, .. } = classify(&err) {
                reasons.insert(reason);
            }
        }
        for r in &reasons {
            assert!(
                crate::model::Reason::RETRIED.contains(r),
                "retry reason {r} is not initialised in Reason::RETRIED"
            );
        }
    }
}
