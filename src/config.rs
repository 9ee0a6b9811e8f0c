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
use crate::redact::redact_password;
use crate::relay::RelayConfig;
use crate::replay::ReplayConfig;

mod args;
pub mod bounds;
mod checks;
mod defaults;
mod ingest;
mod origin;
mod resolve;
#[cfg(test)]
mod tests;

pub use args::{
    ConfigFile, FileConfig, IngestArgs, ProviderArgs, RetryArgs, ServeArgs, ServiceArgs, SourceArgs,
};
pub use checks::check_stream_prefix;
use checks::*;
pub use defaults::*;
pub use ingest::{IngestSettings, PipelineError, RevisionTargets};
pub use origin::{ConfigError, Origin, Origins};
use resolve::*;

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
            dedup_ttl: self.serve.relay.marker_ttl,
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
