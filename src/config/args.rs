//! The settings as the command line and the config file give them: one struct per file
//! section, serving both clap and serde, so a setting has one name everywhere. Every field is
//! an `Option` and clap carries no defaults (a clap default would shadow the file).

use super::*;

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
    /// Set, it also makes poison isolation weigh requests, not only resent inputs.
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
    pub on_newer_parked: Option<crate::store::park::OnNewerParked>,
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
    /// Work items per replay batch: one replay stream entry (the scheduler writes a batch to
    /// an entry), one read, one load, one commit transaction; provider requests are cut from
    /// it by `batch_max_inputs` and `batch_max_chars`.
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
    /// trimmed to this many entries, and to about two leases of issued work).
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
    /// How long a published event's dedup record stays in Redis, in seconds: it must outlive any outage between a publish and the commit of the relay's position (and any database restore to before it); shorter saves Redis
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
