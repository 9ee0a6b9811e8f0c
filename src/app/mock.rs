//! `mock-provider`: runs the fault-injecting provider until a signal, with its settings
//! checked against their bounds first.

use embed_dlq::testkit::mock_provider::{MockConfig, MockProvider};
use tokio_util::sync::CancellationToken;

use super::args::MockProviderCommand;
use super::exit;

/// Runs the mock on `--listen` with `--settings` (JSON keys of [`MockConfig`]) until
/// `cancel`; returns the exit code.
pub async fn command(args: MockProviderCommand, cancel: CancellationToken) -> i32 {
    let MockProviderCommand { listen, settings, rpm_limit, tpm_limit } = args;
    let mut config: MockConfig = match serde_json::from_str(&settings) {
        Ok(c) => c,
        Err(e) => return exit::fail(exit::USAGE, &format!("--settings: {e}")),
    };
    config.rpm_limit = rpm_limit.or(config.rpm_limit);
    config.tpm_limit = tpm_limit.or(config.tpm_limit);
    if let Err(e) = check_mock_config(&config) {
        return exit::fail(exit::USAGE, &format!("--settings: {e}"));
    }
    match MockProvider::start(config, listen, cancel.clone()).await {
        Ok(mock) => {
            eprintln!("mock provider listening on {} (GET /stats for counters)", mock.base_url());
            cancel.cancelled().await;
            mock.shutdown().await;
            exit::OK
        }
        Err(e) => exit::fail(exit::FAILURE, &format!("cannot listen on {listen}: {e}")),
    }
}

/// Longest wait the mock may be told to add (latency, hold, outage, Retry-After): 1 day.
pub const MOCK_MAX_MS: u64 = 86_400_000;
/// Largest `rpm_limit`/`tpm_limit` of the mock's account (and `outage_after_inputs`).
pub const MOCK_MAX_LIMIT: u64 = 10_000_000_000;
/// Longest `limit_window_ms`: an hour's worth of a per-minute limit at once.
pub const MOCK_MAX_LIMIT_WINDOW_MS: u64 = 3_600_000;

/// Bounds of the mock provider's settings: rates are probabilities, dimensions fit pgvector,
/// waits are at most [`MOCK_MAX_MS`].
fn check_mock_config(c: &MockConfig) -> Result<(), String> {
    for (name, rate) in [
        ("rate_429", c.rate_429),
        ("rate_5xx", c.rate_5xx),
        ("rate_timeout", c.rate_timeout),
        ("rate_reset", c.rate_reset),
    ] {
        if !(0.0..=1.0).contains(&rate) {
            return Err(format!("{name} = {rate} is out of range: allowed 0..=1"));
        }
    }
    if !embed_dlq::config::bounds::DIMENSIONS.contains(&c.dimensions) {
        return Err(format!("dimensions = {} is out of range: allowed 1..=16000", c.dimensions));
    }
    for (name, ms) in [
        ("latency_ms", c.latency_ms),
        ("retry_after_ms", c.retry_after_ms),
        ("timeout_hold_ms", c.timeout_hold_ms),
        ("outage_after_ms", c.outage_after_ms.unwrap_or(0)),
        ("outage_for_ms", c.outage_for_ms),
    ] {
        if ms > MOCK_MAX_MS {
            return Err(format!("{name} = {ms} is out of range: allowed 0..={MOCK_MAX_MS}"));
        }
    }
    if c.retired_models.len() > 64 || c.retired_models.iter().any(|m| m.is_empty() || m.len() > 256) {
        return Err("retired_models: at most 64 names of 1..=256 bytes".into());
    }
    if let Some(n) = c.outage_after_inputs.filter(|&n| n > MOCK_MAX_LIMIT) {
        return Err(format!("outage_after_inputs = {n} is out of range: allowed 0..={MOCK_MAX_LIMIT}"));
    }
    for (name, limit) in [("rpm_limit", c.rpm_limit), ("tpm_limit", c.tpm_limit)] {
        if let Some(n) = limit
            && !(1..=MOCK_MAX_LIMIT).contains(&n)
        {
            return Err(format!("{name} = {n} is out of range: allowed 1..={MOCK_MAX_LIMIT}"));
        }
    }
    if !(1..=MOCK_MAX_LIMIT_WINDOW_MS).contains(&c.limit_window_ms) {
        return Err(format!(
            "limit_window_ms = {} is out of range: allowed 1..={MOCK_MAX_LIMIT_WINDOW_MS}",
            c.limit_window_ms
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mock_settings_are_bounded() {
        assert!(check_mock_config(&MockConfig::default()).is_ok());
        let bad = [
            MockConfig { rate_429: 1.5, ..MockConfig::default() },
            MockConfig { rate_5xx: f64::NAN, ..MockConfig::default() },
            MockConfig { dimensions: 0, ..MockConfig::default() },
            MockConfig { latency_ms: u64::MAX, ..MockConfig::default() },
            MockConfig { outage_after_ms: Some(MOCK_MAX_MS + 1), ..MockConfig::default() },
            MockConfig { rpm_limit: Some(0), ..MockConfig::default() },
            MockConfig { tpm_limit: Some(MOCK_MAX_LIMIT + 1), ..MockConfig::default() },
            MockConfig { outage_after_inputs: Some(MOCK_MAX_LIMIT + 1), ..MockConfig::default() },
            MockConfig { limit_window_ms: 0, ..MockConfig::default() },
            MockConfig { retired_models: vec![String::new()], ..MockConfig::default() },
            MockConfig { retired_models: vec!["m".into(); 65], ..MockConfig::default() },
        ];
        for c in bad {
            assert!(check_mock_config(&c).is_err(), "{c:?}");
        }
    }
}
