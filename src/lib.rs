//! # embed-dlq
//!
//! Lossless embedding ingestion: chunks are embedded through an OpenAI-compatible API and
//! upserted into pgvector; failures are classified, retried with capped exponential backoff
//! and full jitter, and parked in a Postgres dead-letter table whose changes are announced
//! through a transactional outbox (relayed to Redis Streams). Postgres is the system of
//! record.
//!
//! # Layout
//!
//! The modules follow the flow of a chunk:
//!
//! - [`ingest`]: JSONL reader and the pipeline (batching, manifest filter, workers).
//! - [`embed`]: the provider client, the failure classifier, the retry policy and the shared
//!   gate (rate-limit pause and circuit breaker).
//! - [`store`]: Postgres — manifest, vector table, DLQ and outbox; the atomic store and park
//!   statements; migrations.
//! - [`relay`]: outbox → Redis Streams, deduplicated by `redis/publish.lua`.
//! - [`streams`]: key names, connections and the stream layout.
//! - [`replay`]: scheduler (due rows → work), replayers (consumer group, XAUTOCLAIM).
//! - [`reconcile`]: checks that manifest, vectors, DLQ, outbox and streams agree; repairs.
//! - [`serve`], [`tail`]: the long-running service (and the periodic reconcile loop) and the
//!   event follower.
//! - [`model`]: the shared vocabulary (chunk, manifest state, error class, content hash).
//! - [`testkit`]: the mock provider, the synthetic corpus and throwaway test databases, for the
//!   demo, the tests, the benches and users' own tests (not on the production path).
//! - [`dlq`]: operator actions (stats, list, show, requeue, purge).
//! - [`metrics`]: Prometheus names, the exporter and the sampled gauges.
//! - [`supervise`]: named, joined tasks whose panics and failures stop their run.
//! - [`config`]: settings resolved from flags, environment, file and defaults, and the
//!   pipeline they describe ([`config::IngestSettings::pipeline`]).
//! - [`shutdown`], [`telemetry`]: signals as cancellation tokens; logging.
//!
//! The library never prints and never exits the process: it returns typed outcomes and
//! errors. The `embed-dlq` binary (`src/main.rs`, `src/app/`) parses the command line,
//! renders outcomes (human or `--json`) and maps them to exit codes.

#![warn(missing_docs)]

pub mod config;
pub mod dlq;
pub mod embed;
pub(crate) mod failpoint;
pub mod ingest;
pub mod metrics;
pub mod model;
pub mod reconcile;
pub mod relay;
pub mod replay;
pub mod serve;
pub mod shutdown;
pub mod store;
pub mod streams;
pub mod supervise;
pub mod tail;
pub mod telemetry;
pub mod testkit;
