//! Defaults no library type owns, and every setting's default and bound as `--help` and the
//! generated reference show them (read from the resolver, so they cannot disagree with what
//! runs).

use super::*;

/// The mock provider's default address, written once for both constants below.
macro_rules! default_mock_addr {
    () => {
        "127.0.0.1:8089"
    };
}
/// Default listen address of `mock-provider`, so that the default base URL reaches it.
pub const DEFAULT_MOCK_ADDR: &str = default_mock_addr!();
/// Default OpenAI-compatible endpoint: the mock provider's default address.
pub const DEFAULT_BASE_URL: &str = concat!("http://", default_mock_addr!(), "/v1");
/// Default model name.
pub const DEFAULT_MODEL: &str = "text-embedding-3-small";
/// Default name of the variable holding the API key.
pub const DEFAULT_API_KEY_ENV: &str = "EMBED_DLQ_API_KEY";
/// Default target table (created by the migrations).
pub const DEFAULT_TABLE: &str = "doc_embeddings";
/// Default stream key prefix.
pub const DEFAULT_STREAM_PREFIX: &str = crate::streams::DEFAULT_PREFIX;
/// Default per-request timeout.
pub const DEFAULT_REQUEST_TIMEOUT_MS: u64 = 60_000;
/// Default replayer tasks in one `serve`.
pub const DEFAULT_REPLAYERS: usize = 2;
/// Default `stream_shards`: one stream of each kind, the key names of every release before
/// sharding (no migration for existing deployments).
pub const DEFAULT_STREAM_SHARDS: u16 = 1;
/// Default time to drain after SIGTERM.
pub const DEFAULT_GRACE_MS: u64 = 10_000;
/// Default periodic reconcile in `serve`: never.
pub const DEFAULT_RECONCILE_EVERY_SECS: u64 = 0;

/// Every setting's default as shown in `--help`, by key, read from the resolved defaults (so
/// the help can never disagree with what runs).
pub fn help_defaults() -> Vec<(&'static str, String)> {
    let s =
        Settings::resolve(FileConfig::default(), None, &Origins::default()).expect("the defaults are valid");
    let o = &s.options;
    let v = &s.serve;
    let src = crate::ingest::source::SourceOptions::default();
    let SweepPolicy::Scheduled { full_every, deep_every } = v.reconcile_sweeps else {
        unreachable!("settings always schedule sweeps")
    };
    vec![
        ("base_url", s.client.base_url.clone()),
        ("model", s.client.model.clone()),
        ("encoding_format", format!("{:?}", s.client.encoding).to_lowercase()),
        ("api_key_env", DEFAULT_API_KEY_ENV.to_string()),
        ("request_timeout_ms", millis(s.client.timeout).to_string()),
        ("shared_limits", s.limits.shared.to_string()),
        ("table", s.table.clone()),
        ("batch_max_inputs", o.batch_max_inputs.to_string()),
        ("batch_max_chars", o.batch_max_chars.to_string()),
        ("concurrency", o.concurrency.to_string()),
        ("writers", o.writers.to_string()),
        ("max_input_chars", o.max_input_chars.to_string()),
        ("max_line_bytes", o.max_line_bytes.to_string()),
        ("max_inflight_bytes", o.max_inflight_bytes.to_string()),
        ("on_outage", format!("{:?}", o.on_outage).to_lowercase()),
        ("lease_secs", o.lease.as_secs().to_string()),
        ("cleanup", o.cleanup.mode.as_str().to_string()),
        ("cleanup_max_fraction", o.cleanup.max_fraction.to_string()),
        ("cleanup_max_rejected_lines", o.cleanup.max_rejected_lines.to_string()),
        ("retry_max_attempts", s.retry.max_attempts.to_string()),
        ("retry_base_ms", millis(s.retry.base).to_string()),
        ("retry_cap_ms", millis(s.retry.cap).to_string()),
        ("dlq_base_secs", o.dlq_schedule.base.as_secs().to_string()),
        ("dlq_cap_secs", o.dlq_schedule.cap.as_secs().to_string()),
        ("dlq_max_replays", o.dlq_schedule.max_replays.to_string()),
        ("breaker_failure_threshold", s.breaker.failure_threshold.to_string()),
        ("breaker_cooldown_ms", millis(s.breaker.cooldown).to_string()),
        ("max_outage_secs", s.breaker.max_outage.as_secs().to_string()),
        ("group", crate::ingest::source::DEFAULT_GROUP.to_string()),
        ("source_shards", "1".to_string()),
        ("source_min_idle_ms", millis(src.min_idle).to_string()),
        ("source_delivery_cap", src.delivery_cap.to_string()),
        ("source_max_inflight_entries", src.max_inflight_entries.to_string()),
        ("replayers", v.replayers.to_string()),
        ("replay_batch", v.replay.batch.to_string()),
        ("min_idle_ms", millis(v.replay.min_idle).to_string()),
        ("delivery_cap", v.replay.delivery_cap.to_string()),
        ("replay_lease_secs", v.replay.lease.as_secs().to_string()),
        ("replay_outstanding_max", v.replay.outstanding_max.to_string()),
        ("grace_ms", millis(v.grace).to_string()),
        ("stream_prefix", s.stream_prefix.clone()),
        ("stream_shards", s.stream_shards.to_string()),
        ("relay_batch", v.relay.batch.to_string()),
        ("relay_poll_ms", millis(v.relay.poll).to_string()),
        ("relay_marker_ttl_secs", v.relay.marker_ttl.as_secs().to_string()),
        ("events_maxlen", v.relay.events_maxlen.to_string()),
        ("reconcile_every_secs", v.reconcile_every.map_or(0, |d| d.as_secs()).to_string()),
        ("reconcile_full_every_secs", full_every.as_secs().to_string()),
        ("reconcile_deep_every_secs", deep_every.map_or(0, |d| d.as_secs()).to_string()),
        ("price_per_million_tokens", o.price_per_million_tokens.map_or("none".into(), |p| p.to_string())),
    ]
}

/// Every setting's bound as shown in `--help` and the reference, by key: written down by the
/// resolver as it checks the defaults, so the documented bound is the enforced one.
pub fn help_bounds() -> Vec<(&'static str, String)> {
    let noted = std::cell::RefCell::new(Vec::new());
    Settings::resolve_noting(FileConfig::default(), None, &Origins::default(), Some(&noted))
        .expect("the defaults are valid");
    let last: std::collections::BTreeMap<&'static str, String> = noted.into_inner().into_iter().collect();
    last.into_iter().collect()
}
