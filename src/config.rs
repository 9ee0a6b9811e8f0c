//! Settings: command line > environment > TOML config file > defaults (all defaults live
//! here). The same option structs serve clap and the config file, so a setting has one name
//! everywhere; unknown keys in the file are rejected. Every field carries its unit.
//!
//! Secrets never travel through flags or files: the API key is read from the environment
//! variable named by `api_key_env` (default `EMBED_DLQ_API_KEY`).

use std::path::Path;
use std::time::Duration;

use clap::Args;
use serde::Deserialize;

use crate::embed::client::{ClientConfig, EncodingFormat};
use crate::embed::gate::BreakerConfig;
use crate::embed::retry::{DlqSchedule, RetryPolicy};
use crate::ingest::IngestOptions;

/// Fills every `None` field of `$a` from `$b`.
macro_rules! fill_from {
    ($a:expr, $b:expr; $($f:ident),* $(,)?) => { $( if $a.$f.is_none() { $a.$f = $b.$f.take(); } )* };
}

/// Where the services are.
#[derive(Debug, Default, Clone, Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceArgs {
    /// Postgres URL (the database must have the pgvector extension available).
    #[arg(long, env = "DATABASE_URL", global = true)]
    pub database_url: Option<String>,
    /// Redis URL (Redis >= 6.2).
    #[arg(long, env = "REDIS_URL", global = true)]
    pub redis_url: Option<String>,
}

/// The embeddings provider.
#[derive(Debug, Default, Clone, Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderArgs {
    /// OpenAI-compatible base URL, up to and excluding `/embeddings`.
    #[arg(long, env = "EMBED_DLQ_BASE_URL")]
    pub base_url: Option<String>,
    /// Model name sent with every request (part of the content hash).
    #[arg(long, env = "EMBED_DLQ_MODEL")]
    pub model: Option<String>,
    /// Ask the model for this many dimensions (the `dimensions` request field).
    #[arg(long)]
    pub request_dimensions: Option<usize>,
    /// Wire format of vectors: base64 (default, fast) or float.
    #[arg(long, value_enum)]
    pub encoding_format: Option<EncodingFormat>,
    /// Name of the environment variable holding the API key.
    #[arg(long)]
    pub api_key_env: Option<String>,
    /// Header that carries the key: `Authorization` (as `Bearer KEY`, default) or e.g. `api-key`.
    #[arg(long)]
    pub api_key_header: Option<String>,
    /// Extra request header, `Name: value` (repeatable).
    #[arg(long = "header", value_name = "NAME: VALUE")]
    #[serde(default)]
    pub headers: Vec<String>,
    /// Per-request timeout.
    #[arg(long)]
    pub request_timeout_ms: Option<u64>,
}

/// Batching, concurrency and limits.
#[derive(Debug, Default, Clone, Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IngestArgs {
    /// Target vector table (`table` or `schema.table`).
    #[arg(long)]
    pub table: Option<String>,
    /// Most inputs per provider request.
    #[arg(long)]
    pub batch_max_inputs: Option<usize>,
    /// Approximate character budget per request (~4 characters per token).
    #[arg(long)]
    pub batch_max_chars: Option<usize>,
    /// Concurrent provider requests.
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Concurrent database writers (each one connection, 512-row statements).
    #[arg(long)]
    pub writers: Option<usize>,
    /// Longer inputs are parked as permanent_input/too_long without a provider call.
    #[arg(long)]
    pub max_input_chars: Option<usize>,
    /// Longer JSONL lines are rejected without being buffered.
    #[arg(long)]
    pub max_line_bytes: Option<usize>,
}

/// In-process retries, the DLQ schedule and the circuit breaker.
#[derive(Debug, Default, Clone, Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryArgs {
    /// Attempts per request before parking (the first included).
    #[arg(long)]
    pub retry_max_attempts: Option<u32>,
    #[arg(long)]
    pub retry_base_ms: Option<u64>,
    #[arg(long)]
    pub retry_cap_ms: Option<u64>,
    /// First delay of the DLQ replay schedule.
    #[arg(long)]
    pub dlq_base_secs: Option<u64>,
    #[arg(long)]
    pub dlq_cap_secs: Option<u64>,
    /// Replay passes before a DLQ row is marked exhausted.
    #[arg(long)]
    pub dlq_max_replays: Option<u32>,
    /// Consecutive failed requests that open the circuit breaker.
    #[arg(long)]
    pub breaker_failure_threshold: Option<u32>,
    #[arg(long)]
    pub breaker_cooldown_ms: Option<u64>,
    /// Give up the run when the breaker stays open this long.
    #[arg(long)]
    pub max_outage_secs: Option<u64>,
}

/// Settings of `serve`; every default is in the accessors below.
#[derive(Debug, Default, Clone, Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeArgs {
    /// Replayer tasks in this process (0 runs only the relay and the scheduler) [default: 2].
    #[arg(long)]
    pub replayers: Option<usize>,
    /// Entries per replay batch [default: 32].
    #[arg(long)]
    pub replay_batch: Option<usize>,
    /// Entries idle this long are taken over by another replayer [default: 60000].
    #[arg(long)]
    pub min_idle_ms: Option<u64>,
    /// Deliveries after which an entry is marked exhausted [default: 5].
    #[arg(long)]
    pub delivery_cap: Option<u32>,
    /// Time to finish in-flight work after SIGTERM [default: 10000].
    #[arg(long)]
    pub grace_ms: Option<u64>,
    /// Key prefix of the streams, wrapped in a hash tag [default: embed-dlq].
    #[arg(long, env = "EMBED_DLQ_STREAM_PREFIX")]
    pub stream_prefix: Option<String>,
    /// Prefix of this process's consumer names [default: hostname-pid].
    #[arg(long)]
    pub consumer_name: Option<String>,
    /// Outbox rows per relay pass [default: 500].
    #[arg(long)]
    pub relay_batch: Option<usize>,
    /// Relay poll interval when no notification arrives [default: 1000].
    #[arg(long)]
    pub relay_poll_ms: Option<u64>,
    /// Serve Prometheus metrics here (e.g. 127.0.0.1:9464).
    #[arg(long)]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Also run the reconciler (check only) every this many seconds; 0 = never [default: 0].
    #[arg(long)]
    pub reconcile_every_secs: Option<u64>,
}

impl ServeArgs {
    /// Fills every unset field from the config file's `[serve]` section.
    pub fn fill_from(&mut self, mut f: ServeArgs) {
        fill_from!(self, f; replayers, replay_batch, min_idle_ms, delivery_cap, grace_ms, stream_prefix,
            consumer_name, relay_batch, relay_poll_ms, metrics_addr, reconcile_every_secs);
    }

    pub fn replayers(&self) -> usize {
        self.replayers.unwrap_or(2)
    }

    pub fn replay_batch(&self) -> usize {
        self.replay_batch.unwrap_or(32).max(1)
    }

    pub fn min_idle(&self) -> Duration {
        Duration::from_millis(self.min_idle_ms.unwrap_or(60_000).max(100))
    }

    pub fn delivery_cap(&self) -> u32 {
        self.delivery_cap.unwrap_or(5).max(1)
    }

    pub fn grace(&self) -> Duration {
        Duration::from_millis(self.grace_ms.unwrap_or(10_000))
    }

    pub fn stream_prefix(&self) -> String {
        self.stream_prefix.clone().unwrap_or_else(|| crate::streams::DEFAULT_PREFIX.to_string())
    }

    pub fn relay_batch(&self) -> usize {
        self.relay_batch.unwrap_or(500).max(1)
    }

    pub fn relay_poll(&self) -> Duration {
        Duration::from_millis(self.relay_poll_ms.unwrap_or(1_000).max(10))
    }

    pub fn reconcile_every(&self) -> Option<Duration> {
        self.reconcile_every_secs.filter(|s| *s > 0).map(Duration::from_secs)
    }
}

/// The TOML config file: the same keys as the flags, in sections.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    #[serde(default)]
    pub services: ServiceArgs,
    #[serde(default)]
    pub provider: ProviderArgs,
    #[serde(default)]
    pub ingest: IngestArgs,
    #[serde(default)]
    pub retry: RetryArgs,
    #[serde(default)]
    pub serve: ServeArgs,
}

impl FileConfig {
    /// Reads and parses a config file; unknown keys are errors.
    pub fn load(path: &Path) -> Result<Self, String> {
        let text =
            std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    }
}

/// Validated runtime settings of an ingest.
#[derive(Debug, Clone)]
pub struct IngestSettings {
    pub database_url: String,
    pub table: String,
    pub client: ClientConfig,
    pub options: IngestOptions,
    pub retry: RetryPolicy,
    pub breaker: BreakerConfig,
}

/// Default OpenAI-compatible endpoint: the mock provider's default address.
pub const DEFAULT_BASE_URL: &str = "http://127.0.0.1:8089/v1";
pub const DEFAULT_MODEL: &str = "text-embedding-3-small";
pub const DEFAULT_API_KEY_ENV: &str = "EMBED_DLQ_API_KEY";
pub const DEFAULT_TABLE: &str = "doc_embeddings";

impl IngestSettings {
    /// Merges flags (already holding env values) over the file, then applies defaults and
    /// validates.
    pub fn resolve(
        mut services: ServiceArgs,
        mut provider: ProviderArgs,
        mut ingest: IngestArgs,
        mut retry: RetryArgs,
        file: Option<FileConfig>,
    ) -> Result<Self, String> {
        if let Some(mut f) = file {
            fill_from!(services, f.services; database_url, redis_url);
            fill_from!(provider, f.provider; base_url, model, request_dimensions, encoding_format,
                api_key_env, api_key_header, request_timeout_ms);
            if provider.headers.is_empty() {
                provider.headers = std::mem::take(&mut f.provider.headers);
            }
            fill_from!(ingest, f.ingest; table, batch_max_inputs, batch_max_chars, concurrency,
                writers, max_input_chars, max_line_bytes);
            fill_from!(retry, f.retry; retry_max_attempts, retry_base_ms, retry_cap_ms, dlq_base_secs,
                dlq_cap_secs, dlq_max_replays, breaker_failure_threshold, breaker_cooldown_ms, max_outage_secs);
        }
        let database_url = services
            .database_url
            .ok_or("no database: set DATABASE_URL or --database-url (scripts/services.sh env prints one)")?;
        let key_env = provider.api_key_env.unwrap_or_else(|| DEFAULT_API_KEY_ENV.to_string());
        let api_key = std::env::var(&key_env).ok().filter(|k| !k.is_empty());
        let mut extra_headers = Vec::new();
        for h in &provider.headers {
            let (name, value) =
                h.split_once(':').ok_or_else(|| format!("header {h:?} is not `Name: value`"))?;
            extra_headers.push((name.trim().to_string(), value.trim().to_string()));
        }
        let defaults = IngestOptions::default();
        let positive =
            |name: &str, v: usize| if v == 0 { Err(format!("{name} must be at least 1")) } else { Ok(v) };
        let options = IngestOptions {
            batch_max_inputs: positive(
                "batch_max_inputs",
                ingest.batch_max_inputs.unwrap_or(defaults.batch_max_inputs),
            )?,
            batch_max_chars: positive(
                "batch_max_chars",
                ingest.batch_max_chars.unwrap_or(defaults.batch_max_chars),
            )?,
            concurrency: positive("concurrency", ingest.concurrency.unwrap_or(defaults.concurrency))?,
            writers: positive("writers", ingest.writers.unwrap_or(defaults.writers))?,
            max_input_chars: positive(
                "max_input_chars",
                ingest.max_input_chars.unwrap_or(defaults.max_input_chars),
            )?,
            max_line_bytes: positive(
                "max_line_bytes",
                ingest.max_line_bytes.unwrap_or(defaults.max_line_bytes),
            )?,
            dlq_schedule: DlqSchedule {
                base: Duration::from_secs(
                    retry.dlq_base_secs.unwrap_or(DlqSchedule::default().base.as_secs()),
                ),
                cap: Duration::from_secs(retry.dlq_cap_secs.unwrap_or(DlqSchedule::default().cap.as_secs())),
                max_replays: retry.dlq_max_replays.unwrap_or(DlqSchedule::default().max_replays),
                ..DlqSchedule::default()
            },
            ..defaults
        };
        let rp = RetryPolicy::default();
        let retry_policy = RetryPolicy {
            max_attempts: retry.retry_max_attempts.unwrap_or(rp.max_attempts).max(1),
            base: retry.retry_base_ms.map(Duration::from_millis).unwrap_or(rp.base),
            cap: retry.retry_cap_ms.map(Duration::from_millis).unwrap_or(rp.cap),
            ..rp
        };
        let bd = BreakerConfig::default();
        let breaker = BreakerConfig {
            failure_threshold: retry.breaker_failure_threshold.unwrap_or(bd.failure_threshold).max(1),
            cooldown: retry.breaker_cooldown_ms.map(Duration::from_millis).unwrap_or(bd.cooldown),
            max_outage: retry.max_outage_secs.map(Duration::from_secs).unwrap_or(bd.max_outage),
            ..bd
        };
        let client = ClientConfig {
            base_url: provider.base_url.unwrap_or_else(|| DEFAULT_BASE_URL.to_string()),
            model: provider.model.unwrap_or_else(|| DEFAULT_MODEL.to_string()),
            request_dimensions: provider.request_dimensions,
            encoding: provider.encoding_format.unwrap_or(EncodingFormat::Base64),
            api_key,
            api_key_header: provider.api_key_header,
            extra_headers,
            timeout: Duration::from_millis(provider.request_timeout_ms.unwrap_or(60_000)),
        };
        Ok(IngestSettings {
            database_url,
            table: ingest.table.unwrap_or_else(|| DEFAULT_TABLE.to_string()),
            client,
            options,
            retry: retry_policy,
            breaker,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_keys_are_rejected() {
        let err = toml::from_str::<FileConfig>("[provider]\nmodle = \"x\"\n").unwrap_err();
        assert!(err.to_string().contains("modle"), "{err}");
        assert!(toml::from_str::<FileConfig>("[nope]\n").is_err());
    }

    #[test]
    fn flags_win_over_file_and_file_over_defaults() {
        let file: FileConfig = toml::from_str(
            "[services]\ndatabase_url = \"postgres://file\"\n[provider]\nmodel = \"file-model\"\nrequest_timeout_ms = 1234\n[ingest]\nconcurrency = 9\n",
        )
        .unwrap();
        let provider = ProviderArgs { model: Some("flag-model".into()), ..Default::default() };
        let s = IngestSettings::resolve(
            ServiceArgs::default(),
            provider,
            IngestArgs::default(),
            RetryArgs::default(),
            Some(file),
        )
        .unwrap();
        assert_eq!(s.database_url, "postgres://file");
        assert_eq!(s.client.model, "flag-model");
        assert_eq!(s.client.timeout, Duration::from_millis(1234));
        assert_eq!(s.options.concurrency, 9);
        assert_eq!(s.options.batch_max_inputs, IngestOptions::default().batch_max_inputs);
        assert_eq!(s.table, DEFAULT_TABLE);
    }

    #[test]
    fn serve_section_fills_unset_flags() {
        let file: FileConfig = toml::from_str("[serve]\nreplayers = 6\nmin_idle_ms = 5000\n").unwrap();
        let mut flags = ServeArgs { replayers: Some(3), ..Default::default() };
        flags.fill_from(file.serve);
        assert_eq!(flags.replayers(), 3, "the flag wins");
        assert_eq!(flags.min_idle(), Duration::from_secs(5));
        assert_eq!(flags.relay_batch(), 500, "default");
        assert!(toml::from_str::<FileConfig>("[serve]\nreplayer = 1\n").is_err());
    }

    #[test]
    fn zero_concurrency_is_refused() {
        let err = IngestSettings::resolve(
            ServiceArgs { database_url: Some("postgres://x".into()), redis_url: None },
            ProviderArgs::default(),
            IngestArgs { concurrency: Some(0), ..Default::default() },
            RetryArgs::default(),
            None,
        )
        .unwrap_err();
        assert!(err.contains("concurrency"), "{err}");
    }
}
