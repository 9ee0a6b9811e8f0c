//! Settings: one model for every command. Each setting is resolved the same way everywhere:
//! command line > environment > TOML config file > default.
//!
//! - The option structs ([`ServiceArgs`], [`ProviderArgs`], [`IngestArgs`], [`RetryArgs`],
//!   [`ServeArgs`]) serve both clap and the file, so a setting has one name everywhere; every
//!   field is an `Option` and clap carries **no** defaults (a clap default would shadow the
//!   file). Unknown keys in the file are rejected.
//! - [`Settings::resolve`] picks each value (flag/env, else file, else default), checks it
//!   against its documented bound ([`bounds`]) and builds the runtime values with
//!   `Duration`s. A rejected value names the setting and where it came from ([`Origin`]).
//! - Defaults live in exactly one place: the library's own `Default` impls
//!   ([`IngestOptions`], [`RetryPolicy`], [`DlqSchedule`], [`BreakerConfig`], [`ReplayConfig`],
//!   [`RelayConfig`]) and, for values no library type owns, the `DEFAULT_*` constants here.
//!
//! Secrets never travel through flags or files: the API key is read from the environment
//! variable named by `api_key_env` (default `EMBED_DLQ_API_KEY`).
//!
//! Why the layering is hand-written and not [`figment`](https://docs.rs/figment): judged in
//! 2026-11 (figment 0.10.19, still 0.x, one maintainer), it would replace only
//! `Resolver::pick` (a dozen lines). Everything else stays ours either way: the bounds
//! (some relative to another setting, e.g. `retry_cap_ms >= retry_base_ms`), the URL, header
//! and table checks, the `Duration`s. And it costs properties we keep: flags and environment
//! variables are parsed by clap (so `--help` lists each variable), and figment records the
//! source per provider, not per key, so telling `--concurrency` from `EMBED_DLQ_...` in an
//! error needs either clap's [`Origins`] walk anyway or figment's `Env` provider, which cannot
//! map our unprefixed names (`DATABASE_URL`) without a per-key table and drops the `--help`
//! display. Unknown keys and ill-typed values are already errors naming the file, key and
//! line (serde's `deny_unknown_fields` with the `toml` crate). Not adopted.

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;
use serde::Deserialize;

use crate::embed::client::{ClientConfig, EncodingFormat};
use crate::embed::gate::{BreakerConfig, OnOutage};
use crate::embed::limit::LimitConfig;
use crate::embed::retry::{DlqSchedule, RetryPolicy};
use crate::ingest::IngestOptions;
use crate::reconcile::SweepPolicy;
use crate::relay::RelayConfig;
use crate::replay::ReplayConfig;

/// Where the services are.
#[derive(Debug, Default, Clone, Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceArgs {
    /// Postgres URL (the database must have the pgvector extension available).
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    pub database_url: Option<String>,
    /// Redis URL (Redis >= 6.2); several comma-separated node URLs select Redis Cluster mode
    /// (`redis://h1:7001,redis://h2:7002`).
    #[arg(long, env = "REDIS_URL", global = true, hide_env_values = true)]
    pub redis_url: Option<String>,
    /// Treat a single Redis URL as a seed node of a Redis Cluster (a list of URLs always is).
    #[arg(long, global = true, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    pub redis_cluster: Option<bool>,
}

/// The embeddings provider.
#[derive(Debug, Default, Clone, Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderArgs {
    /// OpenAI-compatible http(s) base URL, up to and excluding `/embeddings`.
    #[arg(long, env = "EMBED_DLQ_BASE_URL", hide_env_values = true)]
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
    /// Extra request header, `Name: value` (repeatable, at most 32).
    #[arg(long = "header", value_name = "NAME: VALUE")]
    #[serde(default)]
    pub headers: Vec<String>,
    /// Per-request timeout, in milliseconds.
    #[arg(long)]
    pub request_timeout_ms: Option<u64>,
    /// Requests per minute sent to the provider, paced before sending (off by default).
    #[arg(long)]
    pub max_requests_per_minute: Option<u32>,
    /// Estimated tokens per minute (4 characters a token) sent to the provider
    /// (off by default).
    #[arg(long)]
    pub max_tokens_per_minute: Option<u32>,
    /// Keep the per-minute budgets in Redis, shared by every process using the same provider
    /// base URL and model (needs a Redis URL).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    pub shared_limits: Option<bool>,
    /// Price of a million tokens (any currency): the ingest summary then shows the
    /// estimated cost and the cost of waste.
    #[arg(long)]
    pub price_per_million_tokens: Option<f64>,
}

/// Target table, batching, concurrency and limits.
#[derive(Debug, Default, Clone, Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IngestArgs {
    /// Target vector table (`table` or `schema.table`).
    #[arg(long)]
    pub table: Option<String>,
    /// Most inputs per provider request.
    #[arg(long)]
    pub batch_max_inputs: Option<usize>,
    /// Most characters (not bytes) of input per request, ingest and replay alike (~4 a token).
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
    /// Bytes of input held in flight (read, not yet written): bounds
    /// memory whatever the size of the records.
    #[arg(long)]
    pub max_inflight_bytes: Option<u64>,
    /// While the provider's circuit breaker is open: wait (probe; exit 4 after
    /// max_outage_secs), park (park the rest as transient, no provider call, for `serve` to
    /// replay) or stop (exit 4 at once).
    #[arg(long, value_enum)]
    pub on_outage: Option<OnOutage>,
    /// How long a chunk claimed for embedding stays leased to this run, in seconds: another
    /// run of the same content leaves it alone meanwhile (a killed run's leases are taken
    /// over at once, a hung one's after this).
    #[arg(long)]
    pub lease_secs: Option<u64>,
    /// When a chunk's new text is parked: withdraw (delete the vector of its previous text in
    /// the same transaction, with a `withdrawn` event) or keep (search serves the previous
    /// text until the new one is stored). Set it in the config file so that `reconcile`
    /// and `console` judge superseded vectors by the same policy.
    #[arg(long, value_enum)]
    pub on_newer_parked: Option<crate::store::OnNewerParked>,
    /// Once the input is written, delete what the run did not contain: none (default),
    /// incremental (the chunks of each document in the input that the input no longer has)
    /// or full (every chunk of the table the input does not have; refused, exit 2, when the
    /// input was not read to its end). See docs/sources.md.
    #[arg(long, value_enum)]
    pub cleanup: Option<crate::ingest::CleanupMode>,
    /// A full cleanup that would delete more than this share of the table's chunks is
    /// refused unless --yes.
    #[arg(long)]
    pub cleanup_max_fraction: Option<f64>,
    /// A cleanup after a run with more rejected input lines than this is refused (full) or
    /// skipped (incremental): a rejected line's chunk would be deleted.
    #[arg(long)]
    pub cleanup_max_rejected_lines: Option<u64>,
}

/// In-process retries, the DLQ schedule and the circuit breaker.
#[derive(Debug, Default, Clone, Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryArgs {
    /// Attempts per request before parking (the first included).
    #[arg(long)]
    pub retry_max_attempts: Option<u32>,
    /// First in-process backoff ceiling, in milliseconds.
    #[arg(long)]
    pub retry_base_ms: Option<u64>,
    /// Longest in-process backoff and longest honoured server-given wait (which gets up to
    /// one backoff of jitter on top), in milliseconds.
    #[arg(long)]
    pub retry_cap_ms: Option<u64>,
    /// First delay of the DLQ replay schedule, in seconds.
    #[arg(long)]
    pub dlq_base_secs: Option<u64>,
    /// Longest delay of the DLQ replay schedule, in seconds.
    #[arg(long)]
    pub dlq_cap_secs: Option<u64>,
    /// Replay passes before a DLQ row is marked exhausted.
    #[arg(long)]
    pub dlq_max_replays: Option<u32>,
    /// Consecutive failed requests that open the circuit breaker.
    #[arg(long)]
    pub breaker_failure_threshold: Option<u32>,
    /// First open period of the breaker, in milliseconds.
    #[arg(long)]
    pub breaker_cooldown_ms: Option<u64>,
    /// When the breaker stays open this long, ingest gives up (exit 4) and serve puts the
    /// batch back until the breaker's next probe (seconds).
    #[arg(long)]
    pub max_outage_secs: Option<u64>,
}

/// Settings of `serve` (and the stream prefix every Redis-facing command uses).
#[derive(Debug, Default, Clone, Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeArgs {
    /// Replayer tasks in this process (0 runs only the relay and the scheduler).
    #[arg(long)]
    pub replayers: Option<usize>,
    /// Entries per replay batch (one read, one load, one commit transaction);
    /// provider requests are cut from it by `batch_max_inputs` and `batch_max_chars`.
    #[arg(long)]
    pub replay_batch: Option<usize>,
    /// Entries idle this long are taken over by another replayer, in milliseconds.
    #[arg(long)]
    pub min_idle_ms: Option<u64>,
    /// Replays of one work item begun without an outcome (its replayer died or lost the
    /// database mid-batch) before the row is exhausted; Redis deliveries do not count.
    #[arg(long)]
    pub delivery_cap: Option<u32>,
    /// How long a row handed out as replay work stays leased, in seconds: no
    /// other work item is issued for it meanwhile, and a lost item is issued again after it.
    #[arg(long)]
    pub replay_lease_secs: Option<u64>,
    /// Most replay work items outstanding at once (leased rows; each replay stream shard is
    /// trimmed to this many entries).
    #[arg(long)]
    pub replay_outstanding_max: Option<usize>,
    /// Time to finish in-flight work after SIGTERM, in milliseconds.
    #[arg(long)]
    pub grace_ms: Option<u64>,
    /// Key prefix of the streams, wrapped in a hash tag (no braces).
    #[arg(long, env = "EMBED_DLQ_STREAM_PREFIX")]
    pub stream_prefix: Option<String>,
    /// Replay and events streams split into this many shards, each in its own hash slot
    /// (spread over a Redis Cluster's masters); fixed once the streams exist.
    #[arg(long, env = "EMBED_DLQ_STREAM_SHARDS")]
    pub stream_shards: Option<u16>,
    /// Prefix of this process's consumer names [default: hostname-pid].
    #[arg(long)]
    pub consumer_name: Option<String>,
    /// Outbox rows per relay pass.
    #[arg(long)]
    pub relay_batch: Option<usize>,
    /// Relay poll interval when no notification arrives, in milliseconds.
    #[arg(long)]
    pub relay_poll_ms: Option<u64>,
    /// How long a published event's dedup record stays in Redis, in seconds: it must outlive any outage between a publish and its mark; shorter saves Redis
    /// memory (about 115 bytes per event).
    #[arg(long)]
    pub relay_marker_ttl_secs: Option<u64>,
    /// Approximate cap on each events stream shard's length (`XADD ... MAXLEN ~`):
    /// a tail that stays away longer than this many
    /// events finds its position trimmed and is told the gap; the reconciler counts older
    /// entries as trimmed by policy. About 300-500 bytes of Redis memory an entry.
    #[arg(long)]
    pub events_maxlen: Option<usize>,
    /// Serve Prometheus metrics here (e.g. 127.0.0.1:9464).
    #[arg(long)]
    pub metrics_addr: Option<SocketAddr>,
    /// Also run the reconciler (check only) every this many seconds; 0 = never.
    #[arg(long)]
    pub reconcile_every_secs: Option<u64>,
    /// A periodic reconcile run is a full sweep when none finished within this many seconds
    /// (else incremental); 0 = every run is full.
    #[arg(long)]
    pub reconcile_full_every_secs: Option<u64>,
    /// A periodic reconcile run is a deep sweep (reads every vector) when none finished
    /// within this many seconds; 0 = never.
    #[arg(long)]
    pub reconcile_deep_every_secs: Option<u64>,
}

/// `[source]`: a Redis Stream as the input of `ingest --from-stream` and of `serve`
/// (docs/sources.md).
#[derive(Debug, Default, Clone, Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceArgs {
    /// Source Redis Stream keys: entries are ingested in a
    /// consumer group and acknowledged once their store or park has committed (repeat the
    /// flag for several). Empty: no stream source (`serve` then only relays and replays).
    #[arg(long = "from-stream", value_name = "KEY")]
    pub streams: Vec<String>,
    /// With one stream KEY: read its shards KEY:0 .. KEY:N-1 instead.
    #[arg(long, value_name = "N")]
    pub source_shards: Option<u16>,
    /// Consumer group on the source streams (created at the start of each stream if missing).
    #[arg(long, value_name = "G")]
    pub group: Option<String>,
    /// This consumer's name in the group, unique per process [default: hostname-pid].
    #[arg(long, value_name = "NAME")]
    pub consumer: Option<String>,
    /// Source entries pending longer than this are taken over from their consumer
    /// (XAUTOCLAIM), in milliseconds.
    #[arg(long)]
    pub source_min_idle_ms: Option<u64>,
    /// Redis deliveries of a source entry without an outcome after which it is tried alone,
    /// attempts charged in Postgres, and parked as invalid_record once two such attempts never
    /// finished (it kills its consumer).
    #[arg(long)]
    pub source_delivery_cap: Option<u32>,
    /// Most source entries read and not yet acknowledged per consumer (backpressure).
    #[arg(long)]
    pub source_max_inflight_entries: Option<usize>,
}

/// One layer of settings: the TOML config file, or what the command line (with the
/// environment) gave. The same keys as the flags, in sections.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// `[services]`: database and Redis URLs.
    #[serde(default)]
    pub services: ServiceArgs,
    /// `[provider]`: endpoint, model, key and request shape.
    #[serde(default)]
    pub provider: ProviderArgs,
    /// `[ingest]`: target table, batching, concurrency and limits.
    #[serde(default)]
    pub ingest: IngestArgs,
    /// `[retry]`: in-process retries, the DLQ schedule and the breaker.
    #[serde(default)]
    pub retry: RetryArgs,
    /// `[serve]`: replayers, relay, reconcile period, metrics and the stream prefix.
    #[serde(default)]
    pub serve: ServeArgs,
    /// `[source]`: a Redis Stream as the input.
    #[serde(default)]
    pub source: SourceArgs,
}

/// A loaded config file: its settings and where they came from (for error messages).
#[derive(Debug, Clone)]
pub struct ConfigFile {
    /// The file as given, named in every error about one of its keys.
    pub path: PathBuf,
    /// Its settings, not yet resolved or checked against their bounds.
    pub layer: FileConfig,
}

impl ConfigFile {
    /// Reads and parses a config file; unknown keys and ill-typed values are errors naming
    /// the file, the key and the line.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::File { path: path.to_path_buf(), problem: e.to_string() })?;
        Self::parse(path, &text)
    }

    /// Parses config text as if read from `path`.
    pub fn parse(path: &Path, text: &str) -> Result<Self, ConfigError> {
        let layer = toml::from_str(text)
            .map_err(|e| ConfigError::File { path: path.to_path_buf(), problem: e.to_string() })?;
        Ok(ConfigFile { path: path.to_path_buf(), layer })
    }
}

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

/// The documented bound of every numeric setting (stated in each flag's help, so also in the
/// generated docs/reference/configuration.md).
/// Each keeps a value from exhausting memory, connections or time arithmetic: e.g. a huge
/// `concurrency` spawned millions of tasks (14.8 GB RSS), and a huge millisecond value
/// overflowed `Instant + Duration` (a panic).
pub mod bounds {
    use std::ops::RangeInclusive;

    pub use crate::ingest::bounds::*;

    /// pgvector's `vector(N)` holds at most 16000 dimensions.
    pub const DIMENSIONS: RangeInclusive<usize> = 1..=16_000;
    /// `request_timeout_ms`: 100 ms to 10 minutes.
    pub const REQUEST_TIMEOUT_MS: RangeInclusive<u64> = 100..=600_000;
    /// `retry_max_attempts`: attempts per input in one pass, the first included.
    pub const RETRY_MAX_ATTEMPTS: RangeInclusive<u32> = 1..=20;
    /// `retry_base_ms`: 1 ms to 1 minute.
    pub const RETRY_BASE_MS: RangeInclusive<u64> = 1..=60_000;
    /// Lower end is `retry_base_ms`.
    pub const RETRY_CAP_MS: RangeInclusive<u64> = 1..=600_000;
    /// `dlq_base_secs`: 1 second to 1 day.
    pub const DLQ_BASE_SECS: RangeInclusive<u64> = 1..=86_400;
    /// Lower end is `dlq_base_secs`; 30 days.
    pub const DLQ_CAP_SECS: RangeInclusive<u64> = 1..=2_592_000;
    /// `dlq_max_replays`: replay passes before a row is exhausted.
    pub const DLQ_MAX_REPLAYS: RangeInclusive<u32> = 1..=1000;
    /// `breaker_failure_threshold`: consecutive transient failures that open the breaker.
    pub const BREAKER_FAILURE_THRESHOLD: RangeInclusive<u32> = 1..=10_000;
    /// Up to the breaker's longest cooldown (60 s).
    pub const BREAKER_COOLDOWN_MS: RangeInclusive<u64> = 10..=60_000;
    /// 7 days.
    pub const MAX_OUTAGE_SECS: RangeInclusive<u64> = 1..=604_800;
    /// `replayers`: 0 runs only the relay and the scheduler.
    pub const REPLAYERS: RangeInclusive<usize> = 0..=64;
    /// `stream_shards`: each shard is a stream pair, a consumer group and a loop in every
    /// replayer, `tail` and gauge sampler ([`crate::streams::MAX_SHARDS`]).
    pub const STREAM_SHARDS: RangeInclusive<u16> = 1..=crate::streams::MAX_SHARDS;
    /// `replay_batch`: entries per read, load and commit transaction (the provider requests
    /// of a batch are cut by `batch_max_inputs` and `batch_max_chars`).
    pub const REPLAY_BATCH: RangeInclusive<usize> = 1..=2048;
    /// 100 ms ..= 1 day.
    pub const MIN_IDLE_MS: RangeInclusive<u64> = 100..=86_400_000;
    /// `delivery_cap`: replays of one work item begun without an outcome before the row is
    /// given up on.
    pub const DELIVERY_CAP: RangeInclusive<u32> = 1..=1000;
    /// `replay_lease_secs`: a second (tests) to a day; a lease must outlast a replay batch,
    /// since a load extends it by as much.
    pub const REPLAY_LEASE_SECS: RangeInclusive<u64> = 1..=86_400;
    /// `replay_outstanding_max`: a million work items is about 300 MB of replay stream.
    pub const REPLAY_OUTSTANDING_MAX: RangeInclusive<usize> = 1..=1_000_000;
    /// `grace_ms`: up to 10 minutes of drain after the signal.
    pub const GRACE_MS: RangeInclusive<u64> = 0..=600_000;
    /// `relay_batch`: outbox rows per relay pass.
    pub const RELAY_BATCH: RangeInclusive<usize> = 1..=10_000;
    /// `relay_poll_ms`: 10 ms to 1 minute between passes without a notification.
    pub const RELAY_POLL_MS: RangeInclusive<u64> = 10..=60_000;
    /// `relay_marker_ttl_secs`: an hour (a relay down longer than the record lives could show
    /// a re-published event twice) to 30 days.
    pub const RELAY_MARKER_TTL_SECS: RangeInclusive<u64> = 3_600..=2_592_000;
    /// `events_maxlen`: at least 1000 entries (a few relay batches: trimming must never eat
    /// a batch before a tail that keeps up has read it), at most a billion (hundreds of GB of
    /// Redis memory; there is no "unbounded": every stream has a bound).
    pub const EVENTS_MAXLEN: RangeInclusive<usize> = 1_000..=1_000_000_000;
    /// 0 = never; at most 7 days.
    pub const RECONCILE_EVERY_SECS: RangeInclusive<u64> = 0..=604_800;
    /// 0 = every run is a full sweep; at most 30 days between full sweeps.
    pub const RECONCILE_FULL_EVERY_SECS: RangeInclusive<u64> = 0..=2_592_000;
    /// 0 = never a deep sweep unless asked for; at most a year between deep sweeps.
    pub const RECONCILE_DEEP_EVERY_SECS: RangeInclusive<u64> = 0..=31_536_000;
    /// Characters of a stream prefix or consumer name.
    pub const NAME_CHARS: RangeInclusive<usize> = 1..=128;
    /// Characters of a source's consumer group or consumer name.
    pub const SOURCE_NAME_CHARS: RangeInclusive<usize> = 1..=256;
    /// Characters of a model name.
    pub const MODEL_CHARS: RangeInclusive<usize> = 1..=256;
    /// `max_requests_per_minute`: up to ten million requests a minute.
    pub const MAX_REQUESTS_PER_MINUTE: RangeInclusive<u32> = 1..=10_000_000;
    /// `max_tokens_per_minute`: up to two billion estimated tokens a minute.
    pub const MAX_TOKENS_PER_MINUTE: RangeInclusive<u32> = 1..=2_000_000_000;
    /// Extra headers.
    pub const MAX_HEADERS: usize = 32;
    /// Postgres truncates identifiers longer than 63 bytes; we refuse them instead.
    pub const IDENTIFIER_BYTES: usize = 63;
    /// Characters of a URL.
    pub const URL_CHARS: usize = 2048;
}

/// Where a value came from, named in every error about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// A command-line flag, e.g. `--concurrency`.
    Flag(String),
    /// An environment variable, e.g. `EMBED_DLQ_BASE_URL`.
    Env(String),
    /// A key of a config file.
    File {
        /// The config file.
        path: PathBuf,
        /// The section and key, as `[section] key`.
        key: String,
    },
    /// The built-in default.
    Default,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Flag(name) => write!(f, "flag {name}"),
            Origin::Env(var) => write!(f, "environment variable {var}"),
            Origin::File { path, key } => write!(f, "{} {key}", path.display()),
            Origin::Default => write!(f, "default"),
        }
    }
}

/// Which settings the command line or the environment gave, by clap argument id (the field
/// name, which is also the file key).
#[derive(Debug, Clone, Default)]
pub struct Origins {
    by_id: HashMap<String, Origin>,
}

impl Origins {
    /// Records the origin of every argument of `matches` (and its subcommands) that came from
    /// the command line or the environment. `cmd` is the command `matches` was parsed with.
    pub fn from_matches(cmd: &clap::Command, matches: &clap::ArgMatches) -> Origins {
        let mut cmd = cmd.clone();
        cmd.build();
        let mut origins = Origins::default();
        origins.walk(&cmd, matches);
        origins
    }

    fn walk(&mut self, cmd: &clap::Command, m: &clap::ArgMatches) {
        use clap::parser::ValueSource;
        for id in m.ids() {
            let id = id.as_str();
            let Some(arg) = cmd.get_arguments().find(|a| a.get_id() == id) else { continue };
            let origin = match m.value_source(id) {
                Some(ValueSource::CommandLine) => {
                    Origin::Flag(arg.get_long().map(|l| format!("--{l}")).unwrap_or_else(|| id.to_string()))
                }
                Some(ValueSource::EnvVariable) => {
                    Origin::Env(arg.get_env().map(|e| e.to_string_lossy().into_owned()).unwrap_or_default())
                }
                _ => continue,
            };
            self.by_id.insert(id.to_string(), origin);
        }
        if let Some((name, sub)) = m.subcommand()
            && let Some(sc) = cmd.find_subcommand(name)
        {
            self.walk(sc, sub);
        }
    }

    /// The origin of a value the command line layer holds for `key`.
    fn of_flag(&self, key: &str) -> Origin {
        self.by_id.get(key).cloned().unwrap_or_else(|| Origin::Flag(format!("--{}", key.replace('_', "-"))))
    }
}

/// A setting that cannot be used. Every variant names the setting and, where it has one, the
/// source of the value (flag, environment variable, or file and key).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file cannot be read or parsed (an unknown key, a value of the wrong type).
    #[error("config file {}: {problem}", path.display())]
    File {
        /// The config file.
        path: PathBuf,
        /// Why it cannot be read or parsed.
        problem: String,
    },
    /// `allowed` is the documented range, e.g. `1..=256`.
    #[error("{setting} = {value} (from {origin}) is out of range: allowed {allowed}")]
    OutOfRange {
        /// The setting's key, e.g. `concurrency`.
        setting: &'static str,
        /// The value given, as given.
        value: String,
        /// Where the value came from.
        origin: Origin,
        /// The documented range.
        allowed: String,
    },
    /// A value of the right type that cannot work (e.g. a base URL that is not http(s)).
    #[error("{setting} (from {origin}): {problem}")]
    Invalid {
        /// The setting's key.
        setting: &'static str,
        /// Where the value came from.
        origin: Origin,
        /// Why the value cannot work.
        problem: String,
    },
    /// A setting the command needs was given nowhere.
    #[error("no {setting}: {hint}")]
    Missing {
        /// The setting's key.
        setting: &'static str,
        /// How to give it (flag, variable or key).
        hint: &'static str,
    },
}

/// Picks each value from the command line layer, then the file, then the default, and
/// checks it against its bound.
#[derive(Clone, Copy)]
struct Resolver<'a> {
    origins: &'a Origins,
    file_path: Option<&'a Path>,
    /// The file section of the keys being resolved, e.g. `retry` (named in file origins).
    section: &'static str,
    /// Where the bound each key is checked against is written down, when asked
    /// ([`help_bounds`]): the help and the reference show the very bound that is enforced.
    noted: Option<&'a std::cell::RefCell<Vec<(&'static str, String)>>>,
}

impl Resolver<'_> {
    /// Writes down `key`'s bound (a later note of the same key wins).
    fn note(&self, key: &'static str, bound: impl FnOnce() -> String) {
        if let Some(noted) = self.noted {
            noted.borrow_mut().push((key, bound()));
        }
    }

    /// The same layers, resolving the keys of file section `section`.
    fn section(self, section: &'static str) -> Self {
        Resolver { section, ..self }
    }

    fn pick<T>(&self, key: &str, flag: Option<T>, file: Option<T>) -> Option<(T, Origin)> {
        if let Some(v) = flag {
            return Some((v, self.origins.of_flag(key)));
        }
        let v = file?;
        let path = self.file_path.map(Path::to_path_buf).unwrap_or_default();
        Some((v, Origin::File { path, key: format!("[{}] {key}", self.section) }))
    }

    /// A number within `range` (which the default is in, by the unit tests).
    fn num<T: PartialOrd + fmt::Display + Copy>(
        &self,
        key: &'static str,
        flag: Option<T>,
        file: Option<T>,
        default: T,
        range: RangeInclusive<T>,
    ) -> Result<T, ConfigError> {
        self.note(key, || format!("{}..={}", range.start(), range.end()));
        match self.pick(key, flag, file) {
            None => Ok(default),
            Some((v, _)) if range.contains(&v) => Ok(v),
            Some((v, origin)) => Err(ConfigError::OutOfRange {
                setting: key,
                value: v.to_string(),
                origin,
                allowed: format!("{}..={}", range.start(), range.end()),
            }),
        }
    }

    /// An optional number within `range`.
    fn num_opt<T: PartialOrd + fmt::Display + Copy>(
        &self,
        key: &'static str,
        flag: Option<T>,
        file: Option<T>,
        range: RangeInclusive<T>,
    ) -> Result<Option<T>, ConfigError> {
        self.note(key, || format!("{}..={}", range.start(), range.end()));
        match self.pick(key, flag, file) {
            None => Ok(None),
            Some((v, _)) if range.contains(&v) => Ok(Some(v)),
            Some((v, origin)) => Err(ConfigError::OutOfRange {
                setting: key,
                value: v.to_string(),
                origin,
                allowed: format!("{}..={}", range.start(), range.end()),
            }),
        }
    }

    /// A string accepted by `check` (which says what is wrong otherwise).
    fn text(
        &self,
        key: &'static str,
        flag: Option<String>,
        file: Option<String>,
        check: impl Fn(&str) -> Result<(), String>,
    ) -> Result<Option<(String, Origin)>, ConfigError> {
        match self.pick(key, flag, file) {
            None => Ok(None),
            Some((v, origin)) => match check(&v) {
                Ok(()) => Ok(Some((v, origin))),
                Err(problem) => Err(ConfigError::Invalid { setting: key, origin, problem }),
            },
        }
    }
}

/// Every setting of every command, resolved and validated. Its `Debug` hides the passwords
/// of the service URLs.
#[derive(Clone)]
pub struct Settings {
    /// Postgres URL (may hold a password).
    pub database_url: Option<String>,
    /// Redis URL (may hold a password), or several comma-separated node URLs of a cluster.
    pub redis_url: Option<String>,
    /// Redis Cluster mode (a list of URLs, or `redis_cluster` with one seed URL).
    pub redis_cluster: bool,
    /// Target vector table.
    pub table: String,
    /// Key prefix of the streams.
    pub stream_prefix: String,
    /// Shards of the replay and events streams.
    pub stream_shards: u16,
    /// The provider client (its `Debug` hides the key).
    pub client: ClientConfig,
    /// The environment variable the key was read from (`api_key_env`), so that a command can
    /// say which one is unset: a gateway may answer a missing key with a plain 500, which
    /// reads as an outage, not as a missing key.
    pub api_key_env: String,
    /// Batching, concurrency and memory bounds of an ingest.
    pub options: IngestOptions,
    /// The stream source (`[source]`), if any streams are configured.
    pub source: Option<crate::ingest::source::SourceOptions>,
    /// In-process retries before a chunk is parked.
    pub retry: RetryPolicy,
    /// Circuit breaker and outage limit, shared by every request of a process.
    pub breaker: BreakerConfig,
    /// What `serve` runs besides the shared settings.
    pub serve: ServeSettings,
    /// Provider budgets (requests and tokens per minute), local or shared through Redis.
    pub limits: LimitConfig,
}

impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settings")
            .field("database_url", &self.database_url.as_deref().map(redact_password))
            .field("redis_url", &self.redis_url.as_deref().map(redact_password))
            .field("redis_cluster", &self.redis_cluster)
            .field("table", &self.table)
            .field("stream_prefix", &self.stream_prefix)
            .field("stream_shards", &self.stream_shards)
            .field("client", &self.client)
            .field("options", &self.options)
            .field("retry", &self.retry)
            .field("breaker", &self.breaker)
            .field("serve", &self.serve)
            .field("limits", &self.limits)
            .finish()
    }
}

/// `url` with its password (if any) replaced, for debug output; each URL of a
/// comma-separated list (a Redis Cluster's seed nodes) on its own.
pub(crate) fn redact_password(url: &str) -> String {
    if url.contains(',') {
        return url.split(',').map(|u| redact_one(u.trim())).collect::<Vec<_>>().join(",");
    }
    redact_one(url)
}

fn redact_one(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(mut u) if u.password().is_some() => {
            let _ = u.set_password(Some("[redacted]"));
            u.to_string()
        }
        Ok(_) => url.to_string(),
        Err(_) => "[unparsable URL]".to_string(),
    }
}

/// The runtime settings of `serve`.
#[derive(Debug, Clone)]
pub struct ServeSettings {
    /// Replayer tasks (0 runs only the relay and the scheduler).
    pub replayers: usize,
    /// Replayer settings; the DLQ schedule is the one of [`Settings::options`].
    pub replay: ReplayConfig,
    /// Outbox relay tuning; the stream length cap comes from here too.
    pub relay: RelayConfig,
    /// Time to finish in-flight work after SIGTERM.
    pub grace: Duration,
    /// Consumer name prefix; `None` means host and pid.
    pub consumer_prefix: Option<String>,
    /// Where to serve Prometheus metrics, if anywhere.
    pub metrics_addr: Option<SocketAddr>,
    /// Run the reconciler (check only) this often; `None` = never.
    pub reconcile_every: Option<Duration>,
    /// How each reconcile run (of `serve` or of `reconcile`) picks its sweep.
    pub reconcile_sweeps: SweepPolicy,
}

impl Settings {
    /// Resolves every setting: `flags` (the command line, environment values included, as
    /// clap parsed them) over `file` over the defaults; checks every value against its
    /// bound. `origins` tells flags from environment variables in error messages.
    pub fn resolve(
        flags: FileConfig,
        file: Option<&ConfigFile>,
        origins: &Origins,
    ) -> Result<Self, ConfigError> {
        Settings::resolve_noting(flags, file, origins, None)
    }

    /// [`Settings::resolve`], writing down every key's bound in `noted` if given.
    fn resolve_noting(
        flags: FileConfig,
        file: Option<&ConfigFile>,
        origins: &Origins,
        noted: Option<&std::cell::RefCell<Vec<(&'static str, String)>>>,
    ) -> Result<Self, ConfigError> {
        let r = Resolver { origins, file_path: file.map(|f| f.path.as_path()), section: "", noted };
        let empty = FileConfig::default();
        let f = file.map(|f| &f.layer).unwrap_or(&empty);
        // Exhaustive destructuring here and in each section: a new field that is not resolved
        // does not compile (or warns as unused), so no setting can be silently ignored.
        let FileConfig { services, provider, ingest, retry, serve, source } = flags;
        let (database_url, redis_url, redis_cluster) =
            resolve_services(&r.section("services"), services, &f.services)?;
        let (client, api_key_env, limits, price_per_million_tokens) =
            resolve_provider(&r.section("provider"), provider, &f.provider)?;
        if limits.shared && redis_url.is_none() {
            return Err(ConfigError::Missing {
                setting: "redis_url",
                hint: "shared_limits keeps the provider budget in Redis: set REDIS_URL, --redis-url or [services] redis_url",
            });
        }
        let (table, options) = resolve_ingest(&r.section("ingest"), ingest, &f.ingest)?;
        let RetryParts { retry, breaker, dlq_schedule } =
            resolve_retry(&r.section("retry"), retry, &f.retry)?;
        let options = IngestOptions { dlq_schedule, price_per_million_tokens, ..options };
        let (stream_prefix, stream_shards, mut serve) =
            resolve_serve(&r.section("serve"), serve, &f.serve, dlq_schedule)?;
        // Replay's provider requests obey the same provider limits as ingest's.
        serve.replay.request_inputs = options.batch_max_inputs;
        serve.replay.request_chars = options.batch_max_chars;
        serve.replay.requests_in_flight = options.concurrency;
        let source = resolve_source(&r.section("source"), source, &f.source)?;
        Ok(Settings {
            source,
            database_url,
            redis_url,
            redis_cluster,
            table,
            stream_prefix,
            stream_shards,
            client,
            api_key_env,
            options,
            retry,
            breaker,
            serve,
            limits,
        })
    }

    /// The variable named by `api_key_env` when it is unset or empty: requests then carry no
    /// key. Right for servers without authentication (the mock, TEI, vLLM or Ollama started
    /// without a key); a gateway that needs one may answer 401, 400 or a plain-text 500.
    pub fn missing_api_key(&self) -> Option<&str> {
        self.client.api_key.is_none().then_some(self.api_key_env.as_str())
    }

    /// The Postgres URL, required by every command that touches the database.
    pub fn database_url(&self) -> Result<&str, ConfigError> {
        self.database_url.as_deref().ok_or(ConfigError::Missing {
            setting: "database_url",
            hint: "set DATABASE_URL, --database-url or [services] database_url (scripts/services.sh env prints one)",
        })
    }

    /// The Redis URL, required by every command that touches the streams.
    pub fn redis_url(&self) -> Result<&str, ConfigError> {
        self.redis_url.as_deref().ok_or(ConfigError::Missing {
            setting: "redis_url",
            hint: "set REDIS_URL, --redis-url or [services] redis_url",
        })
    }

    /// A client for the configured Redis (single node or cluster; nothing is connected yet).
    pub fn redis_client(&self) -> Result<crate::streams::RedisClient, ConfigError> {
        redis_client(self.redis_url()?, self.redis_cluster)
    }

    /// The stream keys under the configured prefix.
    pub fn stream_keys(&self) -> crate::streams::StreamKeys {
        crate::streams::StreamKeys::with_shards(&self.stream_prefix, self.stream_shards)
    }

    /// The reconciler's settings: its defaults with the sweep policy of `serve` and the
    /// events stream cap the relay trims to (so trimmed entries count as trimmed by policy,
    /// not as lost, by the same number everywhere).
    pub fn reconcile_config(&self) -> crate::reconcile::ReconcileConfig {
        crate::reconcile::ReconcileConfig {
            sweeps: self.serve.reconcile_sweeps,
            events_maxlen: self.serve.relay.events_maxlen,
            ..Default::default()
        }
    }

    /// The settings of an ingest (which needs a database).
    pub fn ingest(&self) -> Result<IngestSettings, ConfigError> {
        Ok(IngestSettings {
            database_url: self.database_url()?.to_string(),
            table: self.table.clone(),
            client: self.client.clone(),
            options: self.options.clone(),
            retry: self.retry,
            breaker: self.breaker,
            limits: self.limits,
            redis_url: self.redis_url.clone(),
            redis_cluster: self.redis_cluster,
        })
    }
}

/// A client for `url` (one URL, or a comma-separated list of cluster nodes), in cluster mode
/// if `cluster` is set or the list has several URLs. `url` was checked by
/// [`Settings::resolve`]; the error never repeats it (it may hold a password).
fn redis_client(url: &str, cluster: bool) -> Result<crate::streams::RedisClient, ConfigError> {
    crate::streams::open(url, cluster).map_err(|e| ConfigError::Invalid {
        setting: "redis_url",
        origin: Origin::Default,
        problem: format!("cannot be used: {}", e.category()),
    })
}

/// `[source]`: the stream source, `None` without streams.
fn resolve_source(
    r: &Resolver<'_>,
    flags: SourceArgs,
    file: &SourceArgs,
) -> Result<Option<crate::ingest::source::SourceOptions>, ConfigError> {
    use crate::ingest::source::{DEFAULT_GROUP, SourceOptions};
    let SourceArgs {
        streams,
        source_shards,
        group,
        consumer,
        source_min_idle_ms,
        source_delivery_cap,
        source_max_inflight_entries,
    } = flags;
    let d = SourceOptions::default();
    r.note("streams", || {
        use crate::ingest::{reader::MAX_SOURCE_KEY_BYTES, source::MAX_SOURCE_STREAMS};
        format!("at most {MAX_SOURCE_STREAMS} keys of 1..={MAX_SOURCE_KEY_BYTES} bytes")
    });
    let streams = r.pick(
        "streams",
        Some(streams).filter(|s| !s.is_empty()),
        Some(file.streams.clone()).filter(|s| !s.is_empty()),
    );
    let shards = r.num("source_shards", source_shards, file.source_shards, 1, 1..=64)?;
    let name = |n: &str| check_len(n, bounds::SOURCE_NAME_CHARS).and(no_control(n));
    r.note("group", || chars(bounds::SOURCE_NAME_CHARS));
    r.note("consumer", || chars(bounds::SOURCE_NAME_CHARS));
    let group = r
        .text("group", group, file.group.clone(), name)?
        .map_or_else(|| DEFAULT_GROUP.to_string(), |(v, _)| v);
    let consumer =
        r.text("consumer", consumer, file.consumer.clone(), name)?.map_or(d.consumer.clone(), |(v, _)| v);
    let min_idle_ms = r.num(
        "source_min_idle_ms",
        source_min_idle_ms,
        file.source_min_idle_ms,
        millis(d.min_idle),
        bounds::MIN_IDLE_MS,
    )?;
    let delivery_cap = r.num(
        "source_delivery_cap",
        source_delivery_cap,
        file.source_delivery_cap,
        d.delivery_cap,
        bounds::DELIVERY_CAP,
    )?;
    let max_inflight = r.num(
        "source_max_inflight_entries",
        source_max_inflight_entries,
        file.source_max_inflight_entries,
        d.max_inflight_entries,
        1..=1_000_000,
    )?;
    let Some((streams, origin)) = streams else { return Ok(None) };
    let streams = match shards {
        1 => streams,
        n if streams.len() == 1 => (0..n).map(|i| format!("{}:{i}", streams[0])).collect(),
        _ => {
            return Err(ConfigError::Invalid {
                setting: "source_shards",
                origin,
                problem: "shards take exactly one stream key".into(),
            });
        }
    };
    let opts = SourceOptions {
        streams,
        group,
        consumer,
        min_idle: Duration::from_millis(min_idle_ms),
        delivery_cap,
        max_inflight_entries: max_inflight,
        ..d
    };
    if let Some(problem) = opts.problem() {
        return Err(ConfigError::Invalid { setting: "streams", origin, problem });
    }
    Ok(Some(opts))
}

/// `[services]`: the Postgres and Redis URLs (no defaults: a command that needs one says so)
/// and whether Redis is a cluster.
fn resolve_services(
    r: &Resolver<'_>,
    flags: ServiceArgs,
    file: &ServiceArgs,
) -> Result<(Option<String>, Option<String>, bool), ConfigError> {
    let ServiceArgs { database_url, redis_url, redis_cluster } = flags;
    let database_url = r
        .text("database_url", database_url, file.database_url.clone(), |u| {
            check_scheme(u, &["postgres", "postgresql"])
        })?
        .map(|(v, _)| v);
    let redis_url = r.text("redis_url", redis_url, file.redis_url.clone(), check_redis_urls)?;
    let redis_cluster = r.pick("redis_cluster", redis_cluster, file.redis_cluster);
    if let (Some((true, origin)), Some((url, _))) = (&redis_cluster, &redis_url)
        && crate::streams::conn::split_urls(url).iter().any(|u| is_unix_socket(u))
    {
        return Err(ConfigError::Invalid {
            setting: "redis_cluster",
            origin: origin.clone(),
            problem: "a Redis Cluster is reached over TCP, not a unix socket".into(),
        });
    }
    let redis_cluster = redis_cluster.is_some_and(|(c, _)| c);
    Ok((database_url, redis_url.map(|(v, _)| v), redis_cluster))
}

/// `[provider]`: the provider client, with the API key read from the variable it names (and
/// that name), the provider budgets, and the price of a million tokens (for the summary's
/// cost figures).
fn resolve_provider(
    r: &Resolver<'_>,
    flags: ProviderArgs,
    file: &ProviderArgs,
) -> Result<(ClientConfig, String, LimitConfig, Option<f64>), ConfigError> {
    let ProviderArgs {
        base_url,
        model,
        request_dimensions,
        encoding_format,
        api_key_env,
        api_key_header,
        headers,
        request_timeout_ms,
        max_requests_per_minute,
        max_tokens_per_minute,
        shared_limits,
        price_per_million_tokens,
    } = flags;
    let base_url = r
        .text("base_url", base_url, file.base_url.clone(), check_base_url)?
        .map_or_else(|| DEFAULT_BASE_URL.to_string(), |(v, _)| v);
    r.note("model", || chars(bounds::MODEL_CHARS));
    let model = r
        .text("model", model, file.model.clone(), |m| check_len(m, bounds::MODEL_CHARS).and(no_control(m)))?
        .map_or_else(|| DEFAULT_MODEL.to_string(), |(v, _)| v);
    let request_dimensions =
        r.num_opt("request_dimensions", request_dimensions, file.request_dimensions, bounds::DIMENSIONS)?;
    let encoding = r
        .pick("encoding_format", encoding_format, file.encoding_format)
        .map_or(EncodingFormat::Base64, |(v, _)| v);
    let key_env = r
        .text("api_key_env", api_key_env, file.api_key_env.clone(), check_env_name)?
        .map_or_else(|| DEFAULT_API_KEY_ENV.to_string(), |(v, _)| v);
    let api_key = std::env::var(&key_env).ok().filter(|k| !k.is_empty());
    let api_key_header = r
        .text("api_key_header", api_key_header, file.api_key_header.clone(), check_header_name)?
        .map(|(v, _)| v);
    let headers = r.pick(
        "headers",
        Some(headers).filter(|h| !h.is_empty()),
        Some(file.headers.clone()).filter(|h| !h.is_empty()),
    );
    let extra_headers = match headers {
        Some((headers, origin)) => parse_headers(&headers, &origin)?,
        None => Vec::new(),
    };
    let timeout_ms = r.num(
        "request_timeout_ms",
        request_timeout_ms,
        file.request_timeout_ms,
        DEFAULT_REQUEST_TIMEOUT_MS,
        bounds::REQUEST_TIMEOUT_MS,
    )?;
    let limits = resolve_limits(r, (max_requests_per_minute, max_tokens_per_minute, shared_limits), file)?;
    let price = r.num_opt(
        "price_per_million_tokens",
        price_per_million_tokens,
        file.price_per_million_tokens,
        bounds::PRICE_PER_MILLION_TOKENS,
    )?;
    let client = ClientConfig {
        base_url,
        model,
        request_dimensions,
        encoding,
        api_key,
        api_key_header,
        extra_headers,
        timeout: Duration::from_millis(timeout_ms),
    };
    Ok((client, key_env, limits, price))
}

/// The `[provider]` budgets: off unless set; shared only with a budget to share.
fn resolve_limits(
    r: &Resolver<'_>,
    (rpm, tpm, shared): (Option<u32>, Option<u32>, Option<bool>),
    file: &ProviderArgs,
) -> Result<LimitConfig, ConfigError> {
    let max_requests_per_minute = r.num_opt(
        "max_requests_per_minute",
        rpm,
        file.max_requests_per_minute,
        bounds::MAX_REQUESTS_PER_MINUTE,
    )?;
    let max_tokens_per_minute =
        r.num_opt("max_tokens_per_minute", tpm, file.max_tokens_per_minute, bounds::MAX_TOKENS_PER_MINUTE)?;
    let limits = LimitConfig { max_requests_per_minute, max_tokens_per_minute, shared: false };
    match r.pick("shared_limits", shared, file.shared_limits) {
        Some((true, origin)) if !limits.any() => Err(ConfigError::Invalid {
            setting: "shared_limits",
            origin,
            problem: "there is no budget to share: set max_requests_per_minute or max_tokens_per_minute"
                .into(),
        }),
        Some((shared, _)) => Ok(LimitConfig { shared, ..limits }),
        None => Ok(limits),
    }
}

/// The extra `Name: value` headers, checked here so that a bad one fails the command instead
/// of every request.
fn parse_headers(headers: &[String], origin: &Origin) -> Result<Vec<(String, String)>, ConfigError> {
    let invalid =
        |problem: String| ConfigError::Invalid { setting: "headers", origin: origin.clone(), problem };
    if headers.len() > bounds::MAX_HEADERS {
        return Err(invalid(format!("{} headers; at most {}", headers.len(), bounds::MAX_HEADERS)));
    }
    let mut parsed = Vec::with_capacity(headers.len());
    for h in headers {
        let (name, value) =
            h.split_once(':').ok_or_else(|| invalid(format!("{h:?} is not `Name: value`")))?;
        let (name, value) = (name.trim(), value.trim());
        check_header_name(name).map_err(&invalid)?;
        reqwest::header::HeaderValue::from_str(value).map_err(|_| {
            invalid(format!("the value of header {name:?} has characters not allowed in a header"))
        })?;
        parsed.push((name.to_string(), value.to_string()));
    }
    Ok(parsed)
}

/// `[ingest]`: the target table and the ingest options (with the default DLQ schedule, which
/// `[retry]` sets).
fn resolve_ingest(
    r: &Resolver<'_>,
    flags: IngestArgs,
    file: &IngestArgs,
) -> Result<(String, IngestOptions), ConfigError> {
    let IngestArgs {
        table,
        batch_max_inputs,
        batch_max_chars,
        concurrency,
        writers,
        max_input_chars,
        max_line_bytes,
        max_inflight_bytes,
        on_outage,
        lease_secs,
        on_newer_parked,
        cleanup,
        cleanup_max_fraction,
        cleanup_max_rejected_lines,
    } = flags;
    let table = r
        .text("table", table, file.table.clone(), check_table)?
        .map_or_else(|| DEFAULT_TABLE.to_string(), |(v, _)| v);
    let d = IngestOptions::default();
    let batch_max_inputs = r.num(
        "batch_max_inputs",
        batch_max_inputs,
        file.batch_max_inputs,
        d.batch_max_inputs,
        bounds::BATCH_MAX_INPUTS,
    )?;
    let batch_max_chars = r.num(
        "batch_max_chars",
        batch_max_chars,
        file.batch_max_chars,
        d.batch_max_chars,
        bounds::BATCH_MAX_CHARS,
    )?;
    let concurrency =
        r.num("concurrency", concurrency, file.concurrency, d.concurrency, bounds::CONCURRENCY)?;
    let writers = r.num("writers", writers, file.writers, d.writers, bounds::WRITERS)?;
    let max_input_chars = r.num(
        "max_input_chars",
        max_input_chars,
        file.max_input_chars,
        d.max_input_chars,
        bounds::MAX_INPUT_CHARS,
    )?;
    let max_line_bytes = r.num(
        "max_line_bytes",
        max_line_bytes,
        file.max_line_bytes,
        d.max_line_bytes,
        bounds::MAX_LINE_BYTES,
    )?;
    let max_inflight_bytes = r.num(
        "max_inflight_bytes",
        max_inflight_bytes,
        file.max_inflight_bytes,
        d.max_inflight_bytes,
        bounds::MAX_INFLIGHT_BYTES,
    )?;
    // An enum: serde and clap reject anything but wait, park or stop.
    let on_outage = r.pick("on_outage", on_outage, file.on_outage).map_or(d.on_outage, |(v, _)| v);
    let lease_secs =
        r.num("lease_secs", lease_secs, file.lease_secs, d.lease.as_secs(), bounds::LEASE_SECS)?;
    // An enum: serde and clap reject anything but withdraw or keep.
    let on_newer_parked = r
        .pick("on_newer_parked", on_newer_parked, file.on_newer_parked)
        .map_or(d.on_newer_parked, |(v, _)| v);
    // An enum: serde and clap reject anything but none, incremental or full.
    let cleanup_mode = r.pick("cleanup", cleanup, file.cleanup).map_or(d.cleanup.mode, |(v, _)| v);
    let max_fraction = r.num(
        "cleanup_max_fraction",
        cleanup_max_fraction,
        file.cleanup_max_fraction,
        d.cleanup.max_fraction,
        bounds::CLEANUP_MAX_FRACTION,
    )?;
    let max_rejected_lines = r.num(
        "cleanup_max_rejected_lines",
        cleanup_max_rejected_lines,
        file.cleanup_max_rejected_lines,
        d.cleanup.max_rejected_lines,
        bounds::CLEANUP_MAX_REJECTED_LINES,
    )?;
    let options = IngestOptions {
        batch_max_inputs,
        batch_max_chars,
        concurrency,
        writers,
        max_input_chars,
        max_line_bytes,
        max_inflight_bytes,
        on_outage,
        lease: Duration::from_secs(lease_secs),
        on_newer_parked,
        cleanup: crate::ingest::CleanupOptions {
            mode: cleanup_mode,
            max_fraction,
            max_rejected_lines,
            ..d.cleanup.clone()
        },
        ..d
    };
    Ok((table, options))
}

/// What `[retry]` resolves to: the in-process policy, the breaker, and the DLQ schedule that
/// both the ingest and the replayers follow.
struct RetryParts {
    retry: RetryPolicy,
    breaker: BreakerConfig,
    dlq_schedule: DlqSchedule,
}

/// `[retry]`: in-process retries, the DLQ schedule and the circuit breaker.
fn resolve_retry(r: &Resolver<'_>, flags: RetryArgs, file: &RetryArgs) -> Result<RetryParts, ConfigError> {
    let RetryArgs {
        retry_max_attempts,
        retry_base_ms,
        retry_cap_ms,
        dlq_base_secs,
        dlq_cap_secs,
        dlq_max_replays,
        breaker_failure_threshold,
        breaker_cooldown_ms,
        max_outage_secs,
    } = flags;
    let retry = resolve_retry_policy(r, file, retry_max_attempts, retry_base_ms, retry_cap_ms)?;
    let dlq_schedule = resolve_dlq_schedule(r, file, dlq_base_secs, dlq_cap_secs, dlq_max_replays)?;
    let breaker = resolve_breaker(r, file, breaker_failure_threshold, breaker_cooldown_ms, max_outage_secs)?;
    Ok(RetryParts { retry, breaker, dlq_schedule })
}

/// The in-process retry policy. The cap's lower bound is the base, so the base comes first.
fn resolve_retry_policy(
    r: &Resolver<'_>,
    file: &RetryArgs,
    retry_max_attempts: Option<u32>,
    retry_base_ms: Option<u64>,
    retry_cap_ms: Option<u64>,
) -> Result<RetryPolicy, ConfigError> {
    let rp = RetryPolicy::default();
    let retry_max_attempts = r.num(
        "retry_max_attempts",
        retry_max_attempts,
        file.retry_max_attempts,
        rp.max_attempts,
        bounds::RETRY_MAX_ATTEMPTS,
    )?;
    let retry_base_ms =
        r.num("retry_base_ms", retry_base_ms, file.retry_base_ms, millis(rp.base), bounds::RETRY_BASE_MS)?;
    let retry_cap_ms = r.num(
        "retry_cap_ms",
        retry_cap_ms,
        file.retry_cap_ms,
        millis(rp.cap),
        retry_base_ms..=*bounds::RETRY_CAP_MS.end(),
    )?;
    r.note("retry_cap_ms", || format!("retry_base_ms..={}", bounds::RETRY_CAP_MS.end()));
    Ok(RetryPolicy {
        max_attempts: retry_max_attempts,
        base: Duration::from_millis(retry_base_ms),
        cap: Duration::from_millis(retry_cap_ms),
        ..rp
    })
}

/// The DLQ replay schedule. The cap's lower bound is the base, so the base comes first.
fn resolve_dlq_schedule(
    r: &Resolver<'_>,
    file: &RetryArgs,
    dlq_base_secs: Option<u64>,
    dlq_cap_secs: Option<u64>,
    dlq_max_replays: Option<u32>,
) -> Result<DlqSchedule, ConfigError> {
    let ds = DlqSchedule::default();
    let dlq_base_secs =
        r.num("dlq_base_secs", dlq_base_secs, file.dlq_base_secs, ds.base.as_secs(), bounds::DLQ_BASE_SECS)?;
    let dlq_cap_secs = r.num(
        "dlq_cap_secs",
        dlq_cap_secs,
        file.dlq_cap_secs,
        ds.cap.as_secs(),
        dlq_base_secs..=*bounds::DLQ_CAP_SECS.end(),
    )?;
    r.note("dlq_cap_secs", || format!("dlq_base_secs..={}", bounds::DLQ_CAP_SECS.end()));
    let dlq_max_replays = r.num(
        "dlq_max_replays",
        dlq_max_replays,
        file.dlq_max_replays,
        ds.max_replays,
        bounds::DLQ_MAX_REPLAYS,
    )?;
    Ok(DlqSchedule {
        base: Duration::from_secs(dlq_base_secs),
        cap: Duration::from_secs(dlq_cap_secs),
        max_replays: dlq_max_replays,
        ..ds
    })
}

/// The circuit breaker shared by every request of a process.
fn resolve_breaker(
    r: &Resolver<'_>,
    file: &RetryArgs,
    breaker_failure_threshold: Option<u32>,
    breaker_cooldown_ms: Option<u64>,
    max_outage_secs: Option<u64>,
) -> Result<BreakerConfig, ConfigError> {
    let bd = BreakerConfig::default();
    let breaker_failure_threshold = r.num(
        "breaker_failure_threshold",
        breaker_failure_threshold,
        file.breaker_failure_threshold,
        bd.failure_threshold,
        bounds::BREAKER_FAILURE_THRESHOLD,
    )?;
    let breaker_cooldown_ms = r.num(
        "breaker_cooldown_ms",
        breaker_cooldown_ms,
        file.breaker_cooldown_ms,
        millis(bd.cooldown),
        bounds::BREAKER_COOLDOWN_MS,
    )?;
    let max_outage_secs = r.num(
        "max_outage_secs",
        max_outage_secs,
        file.max_outage_secs,
        bd.max_outage.as_secs(),
        bounds::MAX_OUTAGE_SECS,
    )?;
    Ok(BreakerConfig {
        failure_threshold: breaker_failure_threshold,
        cooldown: Duration::from_millis(breaker_cooldown_ms),
        max_outage: Duration::from_secs(max_outage_secs),
        ..bd
    })
}

/// `[serve]`: the stream prefix and shard count (which every Redis-facing command uses) and the settings of
/// `serve`, whose replayers follow `dlq_schedule`.
fn resolve_serve(
    r: &Resolver<'_>,
    flags: ServeArgs,
    file: &ServeArgs,
    dlq_schedule: DlqSchedule,
) -> Result<(String, u16, ServeSettings), ConfigError> {
    let ServeArgs {
        replayers,
        replay_batch,
        min_idle_ms,
        delivery_cap,
        replay_lease_secs,
        replay_outstanding_max,
        grace_ms,
        stream_prefix,
        stream_shards,
        consumer_name,
        relay_batch,
        relay_poll_ms,
        relay_marker_ttl_secs,
        events_maxlen,
        metrics_addr,
        reconcile_every_secs,
        reconcile_full_every_secs,
        reconcile_deep_every_secs,
    } = flags;
    let rd = ReplayConfig::default();
    let ld = RelayConfig::default();
    let stream_prefix = r
        .text("stream_prefix", stream_prefix, file.stream_prefix.clone(), check_stream_prefix)?
        .map_or_else(|| DEFAULT_STREAM_PREFIX.to_string(), |(v, _)| v);
    let stream_shards = r.num(
        "stream_shards",
        stream_shards,
        file.stream_shards,
        DEFAULT_STREAM_SHARDS,
        bounds::STREAM_SHARDS,
    )?;
    r.note("consumer_name", || chars(bounds::NAME_CHARS));
    r.note("stream_prefix", || chars(bounds::NAME_CHARS));
    let consumer_prefix = r
        .text("consumer_name", consumer_name, file.consumer_name.clone(), |n| {
            check_len(n, bounds::NAME_CHARS).and(no_control(n))
        })?
        .map(|(v, _)| v);
    let replayers = r.num("replayers", replayers, file.replayers, DEFAULT_REPLAYERS, bounds::REPLAYERS)?;
    let replay_batch =
        r.num("replay_batch", replay_batch, file.replay_batch, rd.batch, bounds::REPLAY_BATCH)?;
    let min_idle_ms =
        r.num("min_idle_ms", min_idle_ms, file.min_idle_ms, millis(rd.min_idle), bounds::MIN_IDLE_MS)?;
    let delivery_cap =
        r.num("delivery_cap", delivery_cap, file.delivery_cap, rd.delivery_cap, bounds::DELIVERY_CAP)?;
    let replay_lease_secs = r.num(
        "replay_lease_secs",
        replay_lease_secs,
        file.replay_lease_secs,
        rd.lease.as_secs(),
        bounds::REPLAY_LEASE_SECS,
    )?;
    let replay_outstanding_max = r.num(
        "replay_outstanding_max",
        replay_outstanding_max,
        file.replay_outstanding_max,
        rd.outstanding_max,
        bounds::REPLAY_OUTSTANDING_MAX,
    )?;
    let grace_ms = r.num("grace_ms", grace_ms, file.grace_ms, DEFAULT_GRACE_MS, bounds::GRACE_MS)?;
    let relay_batch = r.num("relay_batch", relay_batch, file.relay_batch, ld.batch, bounds::RELAY_BATCH)?;
    let relay_poll_ms =
        r.num("relay_poll_ms", relay_poll_ms, file.relay_poll_ms, millis(ld.poll), bounds::RELAY_POLL_MS)?;
    let marker_ttl_secs = r.num(
        "relay_marker_ttl_secs",
        relay_marker_ttl_secs,
        file.relay_marker_ttl_secs,
        ld.marker_ttl.as_secs(),
        bounds::RELAY_MARKER_TTL_SECS,
    )?;
    let events_maxlen =
        r.num("events_maxlen", events_maxlen, file.events_maxlen, ld.events_maxlen, bounds::EVENTS_MAXLEN)?;
    let metrics_addr = r.pick("metrics_addr", metrics_addr, file.metrics_addr).map(|(v, _)| v);
    let reconcile_every_secs = r.num(
        "reconcile_every_secs",
        reconcile_every_secs,
        file.reconcile_every_secs,
        DEFAULT_RECONCILE_EVERY_SECS,
        bounds::RECONCILE_EVERY_SECS,
    )?;
    let full_every = r.num(
        "reconcile_full_every_secs",
        reconcile_full_every_secs,
        file.reconcile_full_every_secs,
        crate::reconcile::DEFAULT_FULL_EVERY.as_secs(),
        bounds::RECONCILE_FULL_EVERY_SECS,
    )?;
    let deep_every = r.num(
        "reconcile_deep_every_secs",
        reconcile_deep_every_secs,
        file.reconcile_deep_every_secs,
        crate::reconcile::DEFAULT_DEEP_EVERY.as_secs(),
        bounds::RECONCILE_DEEP_EVERY_SECS,
    )?;
    let serve = ServeSettings {
        replayers,
        replay: ReplayConfig {
            batch: replay_batch,
            min_idle: Duration::from_millis(min_idle_ms),
            delivery_cap,
            lease: Duration::from_secs(replay_lease_secs),
            outstanding_max: replay_outstanding_max,
            schedule: dlq_schedule,
            ..rd
        },
        relay: RelayConfig {
            batch: relay_batch,
            replay_maxlen: replay_outstanding_max,
            poll: Duration::from_millis(relay_poll_ms),
            marker_ttl: Duration::from_secs(marker_ttl_secs),
            events_maxlen,
            ..ld
        },
        grace: Duration::from_millis(grace_ms),
        consumer_prefix,
        metrics_addr,
        reconcile_every: (reconcile_every_secs > 0).then(|| Duration::from_secs(reconcile_every_secs)),
        reconcile_sweeps: SweepPolicy::Scheduled {
            full_every: Duration::from_secs(full_every),
            deep_every: (deep_every > 0).then(|| Duration::from_secs(deep_every)),
        },
    };
    Ok((stream_prefix, stream_shards, serve))
}

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

/// A length bound in characters, as the help shows it.
fn chars(range: RangeInclusive<usize>) -> String {
    format!("{}..={} characters", range.start(), range.end())
}

/// Validated runtime settings of an ingest. Its `Debug` hides the database password.
#[derive(Clone)]
pub struct IngestSettings {
    /// Postgres URL (may hold a password).
    pub database_url: String,
    /// Target vector table; [`IngestSettings::pipeline`] checks that it exists and fits.
    pub table: String,
    /// How to reach the provider.
    pub client: ClientConfig,
    /// Batching, concurrency and memory bounds.
    pub options: IngestOptions,
    /// In-process retries before a chunk is parked.
    pub retry: RetryPolicy,
    /// Circuit breaker and outage limit.
    pub breaker: BreakerConfig,
    /// Provider budgets; [`IngestSettings::pipeline`] puts one limiter in front of the client.
    pub limits: LimitConfig,
    /// Redis URL (may hold a password), needed only by shared limits.
    pub redis_url: Option<String>,
    /// Redis Cluster mode (see [`Settings::redis_cluster`]).
    pub redis_cluster: bool,
}

impl fmt::Debug for IngestSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IngestSettings")
            .field("database_url", &redact_password(&self.database_url))
            .field("table", &self.table)
            .field("client", &self.client)
            .field("options", &self.options)
            .field("retry", &self.retry)
            .field("breaker", &self.breaker)
            .field("limits", &self.limits)
            .field("redis_url", &self.redis_url.as_deref().map(redact_password))
            .field("redis_cluster", &self.redis_cluster)
            .finish()
    }
}

impl IngestSettings {
    /// For library callers (tests, demo, benchmarks): the given groups over `file` over the
    /// defaults, validated like the command line.
    pub fn resolve(
        services: ServiceArgs,
        provider: ProviderArgs,
        ingest: IngestArgs,
        retry: RetryArgs,
        file: Option<FileConfig>,
    ) -> Result<Self, ConfigError> {
        let flags = FileConfig {
            services,
            provider,
            ingest,
            retry,
            serve: ServeArgs::default(),
            source: SourceArgs::default(),
        };
        let file = file.map(|layer| ConfigFile { path: PathBuf::from("<config>"), layer });
        Settings::resolve(flags, file.as_ref(), &Origins::default())?.ingest()
    }
}

/// Why a pipeline could not be built from valid settings: the services or the target table,
/// never the settings themselves (those are checked by [`Settings::resolve`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PipelineError {
    /// Postgres did not accept a connection.
    #[error("cannot connect to Postgres: {0}")]
    Connect(#[source] crate::store::StoreError),
    /// The migrations failed, or the target table is missing or does not fit.
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    /// The provider client could not be built (e.g. its TLS stack).
    #[error("{0}")]
    Client(String),
}

impl IngestSettings {
    /// The pipeline these settings describe: a pool sized for the workers and writers, the
    /// migrated store bound to its table and model, the provider client, one shared gate.
    /// Every ingest (the command, `serve`, the demo, the tests, the benchmark) starts here,
    /// so they all run the same wiring.
    pub async fn pipeline(&self) -> Result<crate::ingest::Pipeline, PipelineError> {
        use crate::store;
        let options = self.options.within_bounds();
        let connections = (options.concurrency + options.writers) as u32 + 2;
        let pool = store::connect(&self.database_url, connections).await.map_err(PipelineError::Connect)?;
        store::migrate(&pool).await?;
        let store = store::Store::open(pool, &self.table)
            .await?
            .with_model(&self.client.model, self.client.request_dimensions)
            .with_on_newer_parked(options.on_newer_parked);
        let client = crate::embed::client::EmbedClient::new(self.client.clone())
            .map_err(PipelineError::Client)?
            .with_limiter(std::sync::Arc::new(self.limiter().await?));
        let embedder = crate::embed::Embedder {
            client,
            gate: std::sync::Arc::new(crate::embed::gate::ProviderGate::new(self.breaker)),
            policy: self.retry,
            dimensions: store.target().dimensions,
            // Replay waits out an outage; an ingest's workers apply `options.on_outage`.
            on_outage: crate::embed::gate::OnOutage::Wait,
            isolation: Default::default(),
        };
        Ok(crate::ingest::Pipeline { store, embedder, options: self.options.clone() })
    }
}

impl IngestSettings {
    /// The provider limiter of this pipeline: shared through Redis with `shared_limits`, else
    /// local to the process.
    async fn limiter(&self) -> Result<crate::embed::limit::ProviderLimiter, PipelineError> {
        use crate::embed::limit::ProviderLimiter;
        match (&self.redis_url, self.limits.shared) {
            (Some(url), true) => {
                let redis = redis_client(url, self.redis_cluster).map_err(|e| {
                    PipelineError::Client(format!("cannot set up the shared rate limit: {e}"))
                })?;
                ProviderLimiter::with_redis(self.limits, &redis, &self.client.base_url, &self.client.model)
                    .await
                    .map_err(|e| {
                        PipelineError::Client(format!("cannot set up the shared rate limit in Redis: {e}"))
                    })
            }
            _ => Ok(ProviderLimiter::local(self.limits)),
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A service URL of one of `schemes`. The message never repeats the URL (it may hold a
/// password).
fn check_scheme(url: &str, schemes: &[&str]) -> Result<(), String> {
    let scheme = url.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
    match scheme {
        Some(s) if schemes.contains(&s.as_str()) => Ok(()),
        _ => Err(format!("not a URL of scheme {}", schemes.join(", "))),
    }
}

/// A Redis URL, or several comma-separated ones (a cluster's seed nodes, at most
/// [`crate::streams::conn::MAX_SEED_NODES`], TCP only). The message never repeats a URL (it
/// may hold a password).
fn check_redis_urls(urls: &str) -> Result<(), String> {
    let nodes = crate::streams::conn::split_urls(urls);
    let max = crate::streams::conn::MAX_SEED_NODES;
    if nodes.is_empty() {
        return Err("no URL".into());
    }
    if nodes.len() > max {
        return Err(format!("{} URLs; a cluster's seed list takes at most {max}", nodes.len()));
    }
    for (i, u) in nodes.iter().enumerate() {
        let which = if nodes.len() > 1 { format!("URL {} of the list: ", i + 1) } else { String::new() };
        check_scheme(u, &["redis", "rediss", "redis+unix", "unix"]).map_err(|p| format!("{which}{p}"))?;
        if nodes.len() > 1 && is_unix_socket(u) {
            return Err(format!("{which}a Redis Cluster is reached over TCP, not a unix socket"));
        }
    }
    Ok(())
}

fn is_unix_socket(url: &str) -> bool {
    let scheme = url.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
    matches!(scheme.as_deref(), Some("redis+unix" | "unix"))
}

fn no_control(s: &str) -> Result<(), String> {
    if s.chars().any(char::is_control) { Err("must not contain control characters".into()) } else { Ok(()) }
}

fn check_len(s: &str, range: RangeInclusive<usize>) -> Result<(), String> {
    let n = s.chars().count();
    if range.contains(&n) {
        Ok(())
    } else {
        Err(format!("{n} characters; allowed {}..={}", range.start(), range.end()))
    }
}

/// An absolute http(s) URL with a host: anything else would fail every request (and park the
/// corpus as transient) instead of failing the command.
fn check_base_url(s: &str) -> Result<(), String> {
    if s.len() > bounds::URL_CHARS {
        return Err(format!("longer than {} characters", bounds::URL_CHARS));
    }
    let url =
        reqwest::Url::parse(s).map_err(|e| format!("not a URL ({e}); e.g. https://api.openai.com/v1"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!("scheme {:?} is not http or https", url.scheme()));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err("has no host".into());
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err("must not have a query or fragment (`/embeddings` is appended to it)".into());
    }
    Ok(())
}

fn check_env_name(s: &str) -> Result<(), String> {
    if s.is_empty() || s.len() > 256 || s.contains(['=', '\0']) || s.chars().any(char::is_whitespace) {
        Err("not a valid environment variable name".into())
    } else {
        Ok(())
    }
}

fn check_header_name(s: &str) -> Result<(), String> {
    reqwest::header::HeaderName::from_bytes(s.as_bytes())
        .map(drop)
        .map_err(|_| format!("{s:?} is not a valid header name"))
}

fn check_table(s: &str) -> Result<(), String> {
    crate::store::quote_table_name(s)?;
    if s.split('.').any(|p| p.len() > bounds::IDENTIFIER_BYTES) {
        return Err(format!("each part of a table name has at most {} bytes", bounds::IDENTIFIER_BYTES));
    }
    no_control(s)
}

/// Checks a stream prefix against its bounds (length, no control characters, no braces or
/// whitespace: it is wrapped in a Redis hash tag), as every setting of it is checked.
pub fn check_stream_prefix(s: &str) -> Result<(), String> {
    check_len(s, bounds::NAME_CHARS)?;
    no_control(s)?;
    if s.contains(['{', '}']) || s.chars().any(char::is_whitespace) {
        return Err("must not contain braces or whitespace (it is wrapped in a hash tag)".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::OnNewerParked;

    fn file(text: &str) -> ConfigFile {
        ConfigFile::parse(Path::new("/etc/e.toml"), text).unwrap()
    }

    fn resolve(flags: FileConfig, file: Option<&ConfigFile>) -> Result<Settings, ConfigError> {
        Settings::resolve(flags, file, &Origins::default())
    }

    #[test]
    fn unknown_keys_are_rejected_naming_file_and_key() {
        let err = ConfigFile::parse(Path::new("/etc/e.toml"), "[provider]\nmodle = \"x\"\n").unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("modle") && msg.contains("/etc/e.toml"), "{msg}");
        assert!(ConfigFile::parse(Path::new("x"), "[nope]\n").is_err());
        assert!(ConfigFile::parse(Path::new("x"), "[serve]\nreplayer = 1\n").is_err());
    }

    #[test]
    fn the_events_stream_cap_is_a_bounded_setting_the_relay_and_reconciler_share() {
        let s = resolve(FileConfig::default(), Some(&file("[serve]\nevents_maxlen = 5000\n"))).unwrap();
        assert_eq!(s.serve.relay.events_maxlen, 5000);
        assert_eq!(s.reconcile_config().events_maxlen, 5000, "the reconciler judges trims by the same cap");
        let d = resolve(FileConfig::default(), None).unwrap();
        assert_eq!(d.serve.relay.events_maxlen, crate::streams::DEFAULT_EVENTS_MAXLEN);
        for bad in ["0", "999", "1000000001"] {
            let err =
                resolve(FileConfig::default(), Some(&file(&format!("[serve]\nevents_maxlen = {bad}\n"))))
                    .unwrap_err()
                    .to_string();
            assert!(err.contains("events_maxlen"), "{bad}: {err}");
        }
    }

    #[test]
    fn flags_win_over_file_and_file_over_defaults() {
        let f = file(
            "[services]\ndatabase_url = \"postgres://file\"\n[provider]\nmodel = \"file-model\"\nrequest_timeout_ms = 1234\n[ingest]\nconcurrency = 9\ntable = \"t_file\"\n[serve]\nstream_prefix = \"p-file\"\nreplayers = 6\nmin_idle_ms = 5000\n",
        );
        let flags = FileConfig {
            provider: ProviderArgs { model: Some("flag-model".into()), ..Default::default() },
            serve: ServeArgs { replayers: Some(3), ..Default::default() },
            ..Default::default()
        };
        let s = resolve(flags, Some(&f)).unwrap();
        assert_eq!(s.database_url.as_deref(), Some("postgres://file"));
        assert_eq!(s.client.model, "flag-model");
        assert_eq!(s.client.timeout, Duration::from_millis(1234));
        assert_eq!(s.options.concurrency, 9);
        assert_eq!(s.options.batch_max_inputs, IngestOptions::default().batch_max_inputs);
        assert_eq!(s.table, "t_file");
        assert_eq!(s.stream_prefix, "p-file");
        assert_eq!(s.serve.replayers, 3, "the flag wins");
        assert_eq!(s.serve.replay.min_idle, Duration::from_secs(5));
        assert_eq!(s.serve.relay.batch, RelayConfig::default().batch, "default");
    }

    #[test]
    fn defaults_come_from_the_library_and_are_within_bounds() {
        let s = resolve(FileConfig::default(), None).unwrap();
        assert_eq!(s.table, DEFAULT_TABLE);
        assert_eq!(s.stream_prefix, DEFAULT_STREAM_PREFIX);
        assert_eq!(s.client.base_url, DEFAULT_BASE_URL);
        assert_eq!(s.retry, RetryPolicy::default());
        assert_eq!(s.breaker, BreakerConfig::default());
        assert_eq!(s.options.dlq_schedule, DlqSchedule::default());
        assert_eq!(s.serve.replay.batch, ReplayConfig::default().batch);
        assert_eq!(s.serve.replay.min_idle, ReplayConfig::default().min_idle);
        assert_eq!(s.serve.relay.poll, RelayConfig::default().poll);
        assert_eq!(s.serve.reconcile_every, None);
        assert!(s.database_url().is_err() && s.redis_url().is_err());
        // Every default must itself pass validation when given explicitly.
        let d = IngestOptions::default();
        assert!(bounds::CONCURRENCY.contains(&d.concurrency));
        assert!(bounds::WRITERS.contains(&d.writers));
        assert!(bounds::BATCH_MAX_INPUTS.contains(&d.batch_max_inputs));
        assert!(bounds::BATCH_MAX_CHARS.contains(&d.batch_max_chars));
        assert!(bounds::MAX_INPUT_CHARS.contains(&d.max_input_chars));
        assert!(bounds::MAX_LINE_BYTES.contains(&d.max_line_bytes));
        assert!(bounds::MIN_IDLE_MS.contains(&millis(ReplayConfig::default().min_idle)));
        assert!(bounds::RELAY_POLL_MS.contains(&millis(RelayConfig::default().poll)));
        assert!(bounds::RELAY_MARKER_TTL_SECS.contains(&RelayConfig::default().marker_ttl.as_secs()));
        assert!(bounds::BREAKER_COOLDOWN_MS.contains(&millis(BreakerConfig::default().cooldown)));
        assert!(bounds::DLQ_CAP_SECS.contains(&DlqSchedule::default().cap.as_secs()));
    }

    /// Each config-file key with its section, from the command-line definition.
    fn keys_by_section() -> Vec<(&'static str, String, clap::Arg)> {
        use clap::Command;
        let sections = [
            ("services", ServiceArgs::augment_args(Command::new("s"))),
            ("provider", ProviderArgs::augment_args(Command::new("p"))),
            ("ingest", IngestArgs::augment_args(Command::new("i"))),
            ("retry", RetryArgs::augment_args(Command::new("r"))),
            ("serve", ServeArgs::augment_args(Command::new("v"))),
            ("source", SourceArgs::augment_args(Command::new("o"))),
        ];
        let mut keys = Vec::new();
        for (section, cmd) in sections {
            for arg in cmd.get_arguments() {
                keys.push((section, arg.get_id().to_string(), arg.clone()));
            }
        }
        keys
    }

    /// The bound the help and the reference show is the one a value is checked against:
    /// each end passes, one step beyond it is refused naming the key and that end, and no
    /// help text restates a bound of its own (one place defines it).
    #[test]
    fn the_documented_bound_is_the_enforced_one() {
        let bounds: HashMap<&str, String> = help_bounds().into_iter().collect();
        let defaults: HashMap<&str, String> = help_defaults().into_iter().collect();
        let optional_numbers = [
            "request_dimensions",
            "max_requests_per_minute",
            "max_tokens_per_minute",
            "price_per_million_tokens",
        ];
        let mut checked = 0;
        for (section, key, arg) in keys_by_section() {
            let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
            assert!(!help.contains("..="), "{key}: its help restates a bound: {help}");
            let numeric = defaults.get(key.as_str()).is_some_and(|d| d.parse::<f64>().is_ok())
                || optional_numbers.contains(&key.as_str());
            let Some(bound) = bounds.get(key.as_str()) else {
                assert!(!numeric, "{key}: a number without a documented bound");
                continue;
            };
            let set = |value: String| {
                // A `[source]` section names its streams.
                let streams =
                    if section == "source" && key != "streams" { "streams = [\"s\"]\n" } else { "" };
                let text = format!("[{section}]\n{streams}{key} = {value}\n");
                resolve(FileConfig::default(), Some(&file(&text)))
            };
            let refused_naming = |r: Result<Settings, ConfigError>, end: &str| match r {
                Err(ConfigError::OutOfRange { setting, allowed, .. }) => {
                    setting == key && allowed.ends_with(end)
                }
                Err(ConfigError::Invalid { setting, .. }) => setting == key,
                _ => false,
            };
            if key == "streams" {
                let list = |n: usize, bytes: usize| {
                    let keys: Vec<String> = (0..n).map(|i| format!("\"{i:0>bytes$}\"")).collect();
                    format!("[{}]", keys.join(", "))
                };
                assert_eq!(bound, "at most 64 keys of 1..=512 bytes");
                assert!(set(list(64, 512)).is_ok(), "64 keys of 512 bytes");
                assert!(refused_naming(set(list(65, 8)), ""), "65 keys");
                assert!(refused_naming(set(list(1, 513)), ""), "a key of 513 bytes");
                checked += 1;
                continue;
            }
            if let Some(chars) = bound.strip_suffix(" characters") {
                let (_, end) = chars.split_once("..=").unwrap();
                let end: usize = end.parse().unwrap();
                assert!(set(format!("\"{}\"", "x".repeat(end))).is_ok(), "{key}: {end} characters");
                assert!(refused_naming(set(format!("\"{}\"", "x".repeat(end + 1))), ""), "{key}: {end} + 1");
                checked += 1;
                continue;
            }
            let (start, end) = bound.split_once("..=").unwrap_or_else(|| panic!("{key}: {bound}"));
            let float =
                end.contains('.') || key == "cleanup_max_fraction" || key == "price_per_million_tokens";
            let beyond = |v: &str, step: i128| -> String {
                if float {
                    (v.parse::<f64>().unwrap() + step as f64).to_string()
                } else {
                    (v.parse::<i128>().unwrap() + step).to_string()
                }
            };
            let end_value =
                if float { format!("{:?}", end.parse::<f64>().unwrap()) } else { end.to_string() };
            assert!(set(end_value).is_ok(), "{key}: its upper end {end} is refused");
            assert!(refused_naming(set(beyond(end, 1)), end), "{key}: above {end} is not refused");
            if let Ok(lower) = start.parse::<f64>()
                && lower >= 1.0
            {
                let lower_value = if float { format!("{lower:?}") } else { start.to_string() };
                assert!(set(lower_value).is_ok(), "{key}: its lower end {start} is refused");
                assert!(refused_naming(set(beyond(start, -1)), end), "{key}: below {start} is not refused");
            }
            checked += 1;
        }
        assert!(checked >= 45, "only {checked} bounds checked");
    }

    #[test]
    fn on_outage_defaults_to_wait_and_rejects_other_words() {
        let s = resolve(FileConfig::default(), None).unwrap();
        assert_eq!(s.options.on_outage, OnOutage::Wait);
        let flags = FileConfig {
            ingest: IngestArgs { on_outage: Some(OnOutage::Stop), ..Default::default() },
            ..Default::default()
        };
        let s = resolve(flags, Some(&file("[ingest]\non_outage = \"park\"\n"))).unwrap();
        assert_eq!(s.options.on_outage, OnOutage::Stop, "the flag wins over the file");
        let err =
            ConfigFile::parse(Path::new("/etc/e.toml"), "[ingest]\non_outage = \"retry\"\n").unwrap_err();
        assert!(err.to_string().contains("on_outage"), "{err}");
    }

    #[test]
    fn on_newer_parked_defaults_to_withdraw_and_rejects_other_words() {
        let s = resolve(FileConfig::default(), None).unwrap();
        assert_eq!(s.options.on_newer_parked, OnNewerParked::Withdraw);
        let s =
            resolve(FileConfig::default(), Some(&file("[ingest]\non_newer_parked = \"keep\"\n"))).unwrap();
        assert_eq!(s.options.on_newer_parked, OnNewerParked::Keep);
        let flags = FileConfig {
            ingest: IngestArgs { on_newer_parked: Some(OnNewerParked::Withdraw), ..Default::default() },
            ..Default::default()
        };
        let s = resolve(flags, Some(&file("[ingest]\non_newer_parked = \"keep\"\n"))).unwrap();
        assert_eq!(s.options.on_newer_parked, OnNewerParked::Withdraw, "the flag wins over the file");
        let err = ConfigFile::parse(Path::new("/etc/e.toml"), "[ingest]\non_newer_parked = \"delete\"\n")
            .unwrap_err();
        assert!(err.to_string().contains("on_newer_parked"), "{err}");
    }

    /// A file that sets every key: after resolution nothing may still be the default, so a
    /// key the resolver forgets is caught here.
    #[test]
    fn every_file_key_is_used() {
        let f = file(
            r#"
[services]
database_url = "postgres://f"
redis_url = "redis://f"
redis_cluster = true
[provider]
base_url = "https://example.test/v1"
model = "m"
request_dimensions = 64
encoding_format = "float"
api_key_env = "SOME_KEY_VAR_THAT_IS_UNSET"
api_key_header = "api-key"
headers = ["X-A: 1"]
request_timeout_ms = 1000
[ingest]
table = "s.t"
batch_max_inputs = 7
batch_max_chars = 700
concurrency = 3
writers = 3
max_input_chars = 77
max_line_bytes = 7777
on_outage = "park"
on_newer_parked = "keep"
[retry]
retry_max_attempts = 7
retry_base_ms = 7
retry_cap_ms = 70
dlq_base_secs = 7
dlq_cap_secs = 70
dlq_max_replays = 7
breaker_failure_threshold = 7
breaker_cooldown_ms = 77
max_outage_secs = 7
[serve]
replayers = 7
replay_batch = 7
min_idle_ms = 777
delivery_cap = 7
grace_ms = 7
stream_prefix = "sp"
stream_shards = 7
consumer_name = "c"
relay_batch = 7
relay_poll_ms = 77
relay_marker_ttl_secs = 7777
metrics_addr = "127.0.0.1:1"
reconcile_every_secs = 7
"#,
        );
        let s = resolve(FileConfig::default(), Some(&f)).unwrap();
        assert_eq!(s.redis_url.as_deref(), Some("redis://f"));
        assert!(s.redis_cluster);
        assert_eq!(s.client.base_url, "https://example.test/v1");
        assert_eq!(s.client.request_dimensions, Some(64));
        assert_eq!(s.client.encoding, EncodingFormat::Float);
        assert_eq!(s.client.api_key_header.as_deref(), Some("api-key"));
        assert_eq!(s.client.extra_headers, vec![("X-A".to_string(), "1".to_string())]);
        assert_eq!(s.client.timeout, Duration::from_secs(1));
        assert_eq!(s.table, "s.t");
        let o = &s.options;
        assert_eq!(
            (
                o.batch_max_inputs,
                o.batch_max_chars,
                o.concurrency,
                o.writers,
                o.max_input_chars,
                o.max_line_bytes
            ),
            (7, 700, 3, 3, 77, 7777)
        );
        assert_eq!(s.retry.max_attempts, 7);
        assert_eq!((s.retry.base, s.retry.cap), (Duration::from_millis(7), Duration::from_millis(70)));
        assert_eq!(o.dlq_schedule.base, Duration::from_secs(7));
        assert_eq!(o.dlq_schedule.cap, Duration::from_secs(70));
        assert_eq!(o.dlq_schedule.max_replays, 7);
        assert_eq!(s.breaker.failure_threshold, 7);
        assert_eq!(s.breaker.cooldown, Duration::from_millis(77));
        assert_eq!(s.breaker.max_outage, Duration::from_secs(7));
        assert_eq!(o.on_outage, OnOutage::Park);
        assert_eq!(o.on_newer_parked, OnNewerParked::Keep);
        let v = &s.serve;
        assert_eq!((v.replayers, v.replay.batch, v.replay.delivery_cap, v.relay.batch), (7, 7, 7, 7));
        assert_eq!(v.replay.min_idle, Duration::from_millis(777));
        assert_eq!(v.relay.marker_ttl, Duration::from_secs(7777));
        assert_eq!(v.replay.schedule, o.dlq_schedule);
        assert_eq!(v.grace, Duration::from_millis(7));
        assert_eq!(s.stream_prefix, "sp");
        assert_eq!((s.stream_shards, s.stream_keys().shards()), (7, 7));
        assert_eq!(v.consumer_prefix.as_deref(), Some("c"));
        assert_eq!(v.relay.poll, Duration::from_millis(77));
        assert_eq!(v.metrics_addr, Some("127.0.0.1:1".parse().unwrap()));
        assert_eq!(v.reconcile_every, Some(Duration::from_secs(7)));
    }

    #[test]
    fn out_of_range_numbers_name_the_setting_and_its_source() {
        let flags = FileConfig {
            ingest: IngestArgs { concurrency: Some(10_000_000), ..Default::default() },
            ..Default::default()
        };
        let err = resolve(flags, None).unwrap_err();
        assert!(
            matches!(&err, ConfigError::OutOfRange { setting: "concurrency", origin: Origin::Flag(f), .. } if f == "--concurrency"),
            "{err:?}"
        );
        assert!(err.to_string().contains("1..=256"), "{err}");

        let f = file("[retry]\nbreaker_cooldown_ms = 18446744073709551615\n");
        let err = resolve(FileConfig::default(), Some(&f)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "breaker_cooldown_ms = 18446744073709551615 (from /etc/e.toml [retry] breaker_cooldown_ms) is out of range: allowed 10..=60000"
        );

        // The first value past each end of a bound is refused; the ends are accepted.
        type Set = fn(&mut FileConfig, u64);
        let cases: &[(&str, Set, u64, u64)] = &[
            ("concurrency", |c, v| c.ingest.concurrency = Some(v as usize), 1, 256),
            ("writers", |c, v| c.ingest.writers = Some(v as usize), 1, 32),
            ("batch_max_inputs", |c, v| c.ingest.batch_max_inputs = Some(v as usize), 1, 2048),
            ("batch_max_chars", |c, v| c.ingest.batch_max_chars = Some(v as usize), 1, 10_000_000),
            ("max_input_chars", |c, v| c.ingest.max_input_chars = Some(v as usize), 1, 1_000_000),
            ("max_line_bytes", |c, v| c.ingest.max_line_bytes = Some(v as usize), 64, 64 << 20),
            ("max_inflight_bytes", |c, v| c.ingest.max_inflight_bytes = Some(v), 1 << 20, u32::MAX as u64),
            ("lease_secs", |c, v| c.ingest.lease_secs = Some(v), 1, 3600),
            ("request_timeout_ms", |c, v| c.provider.request_timeout_ms = Some(v), 100, 600_000),
            ("request_dimensions", |c, v| c.provider.request_dimensions = Some(v as usize), 1, 16_000),
            ("retry_max_attempts", |c, v| c.retry.retry_max_attempts = Some(v as u32), 1, 20),
            ("retry_base_ms", |c, v| c.retry.retry_base_ms = Some(v), 1, 60_000),
            ("retry_cap_ms", |c, v| c.retry.retry_cap_ms = Some(v), 500, 600_000),
            ("dlq_base_secs", |c, v| c.retry.dlq_base_secs = Some(v), 1, 86_400),
            ("dlq_cap_secs", |c, v| c.retry.dlq_cap_secs = Some(v), 60, 2_592_000),
            ("dlq_max_replays", |c, v| c.retry.dlq_max_replays = Some(v as u32), 1, 1000),
            (
                "breaker_failure_threshold",
                |c, v| c.retry.breaker_failure_threshold = Some(v as u32),
                1,
                10_000,
            ),
            ("breaker_cooldown_ms", |c, v| c.retry.breaker_cooldown_ms = Some(v), 10, 60_000),
            ("max_outage_secs", |c, v| c.retry.max_outage_secs = Some(v), 1, 604_800),
            ("replay_batch", |c, v| c.serve.replay_batch = Some(v as usize), 1, 2048),
            ("min_idle_ms", |c, v| c.serve.min_idle_ms = Some(v), 100, 86_400_000),
            ("delivery_cap", |c, v| c.serve.delivery_cap = Some(v as u32), 1, 1000),
            ("replay_lease_secs", |c, v| c.serve.replay_lease_secs = Some(v), 1, 86_400),
            (
                "replay_outstanding_max",
                |c, v| c.serve.replay_outstanding_max = Some(v as usize),
                1,
                1_000_000,
            ),
            ("relay_batch", |c, v| c.serve.relay_batch = Some(v as usize), 1, 10_000),
            ("relay_poll_ms", |c, v| c.serve.relay_poll_ms = Some(v), 10, 60_000),
            ("relay_marker_ttl_secs", |c, v| c.serve.relay_marker_ttl_secs = Some(v), 3_600, 2_592_000),
        ];
        for (name, set, lo, hi) in cases {
            for (v, ok) in [(lo - 1, false), (*lo, true), (*hi, true), (hi + 1, false)] {
                let mut c = FileConfig::default();
                set(&mut c, v);
                match resolve(c, None) {
                    Ok(_) => assert!(ok, "{name} = {v} was accepted"),
                    Err(e) => {
                        assert!(!ok, "{name} = {v} was refused: {e}");
                        assert!(
                            matches!(e, ConfigError::OutOfRange { setting, .. } if setting == *name),
                            "{e:?}"
                        );
                    }
                }
            }
        }
        // Upper-only bounds (0 is a meaningful value).
        for (name, set, hi) in [
            ("replayers", (|c: &mut FileConfig, v: u64| c.serve.replayers = Some(v as usize)) as Set, 64),
            ("grace_ms", |c, v| c.serve.grace_ms = Some(v), 600_000),
            ("reconcile_every_secs", |c, v| c.serve.reconcile_every_secs = Some(v), 604_800),
            ("reconcile_full_every_secs", |c, v| c.serve.reconcile_full_every_secs = Some(v), 2_592_000),
            ("reconcile_deep_every_secs", |c, v| c.serve.reconcile_deep_every_secs = Some(v), 31_536_000),
        ] {
            for (v, ok) in [(0, true), (hi, true), (hi + 1, false), (u64::MAX, false)] {
                let mut c = FileConfig::default();
                set(&mut c, v);
                assert_eq!(resolve(c, None).is_ok(), ok, "{name} = {v}");
            }
        }
    }

    #[test]
    fn debug_output_hides_service_passwords() {
        let services = ServiceArgs {
            database_url: Some("postgres://u:pg-pw-1@h/db".into()),
            redis_url: Some("redis://:redis-pw-2@h:1/".into()),
            redis_cluster: None,
        };
        let s = resolve(FileConfig { services, ..Default::default() }, None).unwrap();
        let all = format!("{s:?} {:?}", s.ingest().unwrap());
        assert!(!all.contains("pg-pw-1") && !all.contains("redis-pw-2"), "{all}");
        // Every node of a cluster's seed list too.
        let services = ServiceArgs {
            database_url: Some("postgres://h/db".into()),
            redis_url: Some("redis://:redis-pw-3@h:7001/,redis://:redis-pw-3@h:7002/".into()),
            ..Default::default()
        };
        let s = resolve(FileConfig { services, ..Default::default() }, None).unwrap();
        let all = format!("{s:?} {:?} {:?}", s.ingest().unwrap(), s.redis_client().unwrap());
        assert!(!all.contains("redis-pw-3"), "{all}");
        assert!(s.redis_cluster || s.redis_client().unwrap().is_cluster());
        assert!(all.contains("postgres://u:[redacted]@h/db") || all.contains("%5Bredacted%5D"), "{all}");
    }

    #[test]
    fn caps_below_their_base_are_refused() {
        let flags = FileConfig {
            retry: RetryArgs { retry_base_ms: Some(1000), retry_cap_ms: Some(999), ..Default::default() },
            ..Default::default()
        };
        let err = resolve(flags, None).unwrap_err();
        assert!(matches!(err, ConfigError::OutOfRange { setting: "retry_cap_ms", .. }), "{err:?}");
        let flags = FileConfig {
            retry: RetryArgs { dlq_base_secs: Some(100), dlq_cap_secs: Some(99), ..Default::default() },
            ..Default::default()
        };
        assert!(resolve(flags, None).is_err());
    }

    #[test]
    fn strings_are_validated() {
        let with_provider = |p: ProviderArgs| resolve(FileConfig { provider: p, ..Default::default() }, None);
        for bad in [
            "not a url",
            "127.0.0.1:8089/v1",
            "ftp://h/v1",
            "file:///etc/passwd",
            "http://",
            "http://h/v1?x=1",
        ] {
            let err =
                with_provider(ProviderArgs { base_url: Some(bad.into()), ..Default::default() }).unwrap_err();
            assert!(matches!(err, ConfigError::Invalid { setting: "base_url", .. }), "{bad}: {err:?}");
        }
        for good in
            ["http://127.0.0.1:8089/v1", "https://api.openai.com/v1", "https://u:p@gw.example/openai/"]
        {
            with_provider(ProviderArgs { base_url: Some(good.into()), ..Default::default() }).unwrap();
        }
        assert!(with_provider(ProviderArgs { model: Some(String::new()), ..Default::default() }).is_err());
        assert!(
            with_provider(ProviderArgs { headers: vec!["nocolon".into()], ..Default::default() }).is_err()
        );
        assert!(
            with_provider(ProviderArgs { headers: vec!["Bad Name: v".into()], ..Default::default() })
                .is_err()
        );
        assert!(
            with_provider(ProviderArgs { headers: vec!["X: a\u{7}b".into()], ..Default::default() }).is_err()
        );
        let many = (0..33).map(|i| format!("X-{i}: v")).collect();
        assert!(with_provider(ProviderArgs { headers: many, ..Default::default() }).is_err());
        assert!(
            with_provider(ProviderArgs { api_key_header: Some("a b".into()), ..Default::default() }).is_err()
        );
        assert!(
            with_provider(ProviderArgs { api_key_env: Some("A=B".into()), ..Default::default() }).is_err()
        );

        let with_services = |d: &str, r: &str| {
            let services =
                ServiceArgs { database_url: Some(d.into()), redis_url: Some(r.into()), redis_cluster: None };
            resolve(FileConfig { services, ..Default::default() }, None)
        };
        assert!(with_services("postgres://u@h/db", "redis://h:1/").is_ok());
        assert!(with_services("postgresql://u@h/db", "rediss://h:1/").is_ok());
        let err = with_services("mysql://u:pw@h/db", "redis://h/").unwrap_err();
        assert!(!err.to_string().contains("pw"), "{err}");
        assert!(with_services("postgres://u@h/db", "").is_err());
        // A cluster's seed list: each URL checked, none repeated in the message, TCP only.
        let seeds = with_services("postgres://u@h/db", "redis://h:7001, redis://h:7002/").unwrap();
        assert!(seeds.redis_client().unwrap().is_cluster() && !seeds.redis_cluster);
        let err = with_services("postgres://u@h/db", "redis://:pw@h:7001,http://:pw@h:7002").unwrap_err();
        assert!(err.to_string().contains("URL 2 of the list") && !err.to_string().contains("pw"), "{err}");
        assert!(with_services("postgres://u@h/db", "redis://h:7001,unix:///tmp/r.sock").is_err());
        let many = vec!["redis://h:7001"; 65].join(",");
        assert!(with_services("postgres://u@h/db", &many).is_err());
        let one_seed = |url: &str| {
            let services = ServiceArgs {
                database_url: Some("postgres://h/db".into()),
                redis_url: Some(url.into()),
                redis_cluster: Some(true),
            };
            resolve(FileConfig { services, ..Default::default() }, None)
        };
        let s = one_seed("redis://h:7001/").unwrap();
        assert!(
            s.redis_cluster && s.redis_client().unwrap().is_cluster() && s.ingest().unwrap().redis_cluster
        );
        let err = one_seed("unix:///tmp/r.sock").unwrap_err();
        assert!(err.to_string().contains("redis_cluster"), "{err}");

        let with_table = |t: &str| {
            resolve(
                FileConfig {
                    ingest: IngestArgs { table: Some(t.into()), ..Default::default() },
                    ..Default::default()
                },
                None,
            )
        };
        assert!(with_table("a.b").is_ok());
        for bad in ["", "a.b.c", "a.", &"x".repeat(64)] {
            assert!(with_table(bad).is_err(), "{bad:?}");
        }
        let with_prefix = |p: &str| {
            resolve(
                FileConfig {
                    serve: ServeArgs { stream_prefix: Some(p.into()), ..Default::default() },
                    ..Default::default()
                },
                None,
            )
        };
        assert!(with_prefix("team-a").is_ok());
        for bad in ["", "a}b", "a b", &"p".repeat(129)] {
            assert!(with_prefix(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn origins_tell_flags_from_environment() {
        use clap::{CommandFactory, FromArgMatches, Parser};
        #[derive(Parser)]
        struct T {
            #[command(flatten)]
            ingest: IngestArgs,
            #[command(flatten)]
            serve: ServeArgs,
        }
        let cmd = T::command();
        let m =
            cmd.clone().try_get_matches_from(["t", "--concurrency", "0", "--stream-prefix", "x"]).unwrap();
        let t = T::from_arg_matches(&m).unwrap();
        let origins = Origins::from_matches(&cmd, &m);
        assert_eq!(origins.of_flag("concurrency"), Origin::Flag("--concurrency".into()));
        assert_eq!(origins.of_flag("stream_prefix"), Origin::Flag("--stream-prefix".into()));
        let err = Settings::resolve(
            FileConfig { ingest: t.ingest, serve: t.serve, ..Default::default() },
            None,
            &origins,
        )
        .unwrap_err();
        assert!(err.to_string().contains("from flag --concurrency"), "{err}");
    }

    #[test]
    fn provider_limits_are_bounded_and_sharing_needs_redis_and_a_budget() {
        let s = resolve(FileConfig::default(), None).unwrap();
        assert_eq!(s.limits, LimitConfig::default(), "off by default");
        let f = file(
            "[services]\ndatabase_url = \"postgres://d\"\nredis_url = \"redis://r\"\n[provider]\nmax_requests_per_minute = 3000\nmax_tokens_per_minute = 90000\nshared_limits = true\n",
        );
        let s = resolve(FileConfig::default(), Some(&f)).unwrap();
        assert_eq!(
            s.limits,
            LimitConfig {
                max_requests_per_minute: Some(3000),
                max_tokens_per_minute: Some(90000),
                shared: true
            }
        );
        let ingest = s.ingest().unwrap();
        assert_eq!((ingest.limits, ingest.redis_url.as_deref()), (s.limits, Some("redis://r")));
        let bad = |text: &str| resolve(FileConfig::default(), Some(&file(text))).unwrap_err().to_string();
        let err = bad("[provider]\nmax_requests_per_minute = 0\n");
        assert!(err.contains("max_requests_per_minute") && err.contains("1..=10000000"), "{err}");
        let err = bad("[provider]\nmax_tokens_per_minute = 3000000000\n");
        assert!(err.contains("max_tokens_per_minute"), "{err}");
        let err = bad("[provider]\nmax_requests_per_minute = 10\nshared_limits = true\n");
        assert!(err.contains("redis_url"), "sharing needs Redis: {err}");
        let err = bad("[services]\nredis_url = \"redis://r\"\n[provider]\nshared_limits = true\n");
        assert!(err.contains("no budget to share"), "{err}");
    }
}
