//! # embed-dlq
//!
//! Lossless embedding ingestion. Chunks of documents are embedded through an
//! OpenAI-compatible API and upserted into a pgvector table. Nothing is dropped: a chunk the
//! provider cannot embed is classified, retried in process with capped exponential backoff
//! and full jitter, then parked in a Postgres dead-letter table (the DLQ). Every change of
//! the DLQ is written to a transactional outbox in the same transaction, and a relay
//! publishes it to Redis Streams. Replay workers take due rows from there and try again.
//! Postgres is the system of record; Redis only carries work and events.
//!
//! Use the library to ingest from your own Rust program, to run the relay and replayers
//! inside your own service, or to consume the events stream. The `embed-dlq` binary is a thin
//! layer over it.
//!
//! # Data flow
//!
//! A chunk passes through the modules in this order:
//!
//! 1. [`ingest`]: reads records (JSONL, bounded line length and in-flight bytes), skips
//!    what the manifest already holds, batches the rest and runs the workers and writers
//!    ([`ingest::Pipeline`]).
//! 2. [`embed`]: the provider client, the classifier (*whether* to retry), the retry policy
//!    (*when*), and the gate shared by every worker (rate-limit pause, circuit breaker).
//! 3. [`store`]: Postgres, where every SQL statement lives. A batch's vectors, DLQ rows,
//!    manifest updates and outbox rows are committed together; also the migrations and
//!    the target-table checks.
//! 4. [`relay`]: outbox → Redis Streams, deduplicated by `redis/publish.lua`, so a crash
//!    between publishing and marking never publishes an event twice.
//! 5. [`streams`]: stream key names, connections and the entry layout (the events stream and
//!    the replay work stream).
//! 6. [`replay`]: the scheduler turns due DLQ rows into work; replayers in a consumer group
//!    embed them again and commit or re-park, taking over idle entries with `XAUTOCLAIM`.
//! 7. [`reconcile`]: checks that manifest, vectors, DLQ, outbox and streams agree, and
//!    repairs what they can.
//! 8. [`metrics`] and [`telemetry`]: Prometheus names and gauges; logging.
//!
//! Around that flow:
//!
//! - [`model`]: the shared vocabulary (chunk, manifest state, error class, content hash).
//! - [`config`]: settings resolved from flags, environment, file and defaults, and the
//!   pipeline they describe ([`config::IngestSettings::pipeline`]).
//! - [`serve`] runs the relay, the scheduler, the replayers and the periodic reconcile as
//!   one service; [`tail`] follows the events stream; [`dlq`] holds the operator actions
//!   (stats, list, show, requeue, purge); [`console`] is the operator console in the browser
//!   (the same actions, the streams and the reconciler, with an audit trail).
//! - [`supervise`] names the ways a task of a run can fail; [`shutdown`] turns signals into
//!   cancellation tokens.
//! - [`mod@reference`] renders the pages of `docs/reference/` (every setting, every metric) from
//!   the code.
//! - [`testkit`]: the mock provider, a synthetic corpus and throwaway test databases, for
//!   the demo, the tests, the benchmark and your own tests (not on the production path).
//!
//! The library never prints and never exits the process: it returns typed outcomes and
//! errors. The `embed-dlq` binary (`src/main.rs`, `src/app/`) parses the command line,
//! renders outcomes (human or `--json`) and maps them to exit codes.
//!
//! # Example
//!
//! Ingest two records into the default table and look at the DLQ afterwards. The database
//! is migrated by [`config::IngestSettings::pipeline`]; a failing chunk ends up in the DLQ
//! and in the summary, not in an error.
//!
//! ```no_run
//! use embed_dlq::config::{IngestArgs, IngestSettings, ProviderArgs, RetryArgs, ServiceArgs};
//! use tokio_util::sync::CancellationToken;
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let settings = IngestSettings::resolve(
//!     ServiceArgs { database_url: Some("postgres://localhost/embeddings".into()), redis_url: None, ..Default::default() },
//!     ProviderArgs { base_url: Some("http://127.0.0.1:8089/v1".into()), ..Default::default() },
//!     IngestArgs::default(),
//!     RetryArgs::default(),
//!     None,
//! )?;
//! let pipeline = settings.pipeline().await?;
//!
//! let corpus: &[u8] = b"{\"doc_id\": \"a\", \"chunk_index\": 0, \"text\": \"first\"}
//! {\"doc_id\": \"a\", \"chunk_index\": 1, \"text\": \"second\"}
//! ";
//! let summary = pipeline.run(corpus, CancellationToken::new()).await?;
//! eprintln!("{} stored, {} parked", summary.stored, summary.parked_total());
//!
//! let dlq = embed_dlq::dlq::stats(&pipeline.store).await?;
//! for class in &dlq.by_class {
//!     eprintln!("{}: {} parked", class.error_class.as_str(), class.parked);
//! }
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

pub mod config;
pub mod console;
pub mod dlq;
pub mod embed;
pub(crate) mod failpoint;
pub mod gauges;
pub mod http;
pub mod ingest;
pub mod metrics;
pub mod model;
pub mod reconcile;
pub(crate) mod redact;
pub mod reference;
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
