//! Command line: parses arguments, builds validated settings, calls the library, prints a
//! report and maps the outcome to a documented exit code. No business logic lives here.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use crate::config::{FileConfig, IngestArgs, IngestSettings, ProviderArgs, RetryArgs, ServiceArgs};
use crate::embed::Embedder;
use crate::embed::client::EmbedClient;
use crate::embed::gate::ProviderGate;
use crate::ingest::{IngestError, IngestSummary, Pipeline};
use crate::mock_provider::{MockConfig, MockProvider};
use crate::store::{self, Store};

/// Exit codes, stable for scripts.
pub mod exit {
    /// Finished; every record is stored or parked.
    pub const OK: i32 = 0;
    /// Could not run (database unreachable, bad table, I/O error).
    pub const FAILURE: i32 = 1;
    /// Bad flags or config file.
    pub const USAGE: i32 = 2;
    /// Finished, but some input lines had no usable identity and were only reported.
    pub const REJECTED_INPUT: i32 = 3;
    /// The provider refused the run (bad key, no quota, unknown model, long outage); nothing
    /// was parked for it, rerun once fixed.
    pub const PROVIDER_STOP: i32 = 4;
    /// Stopped by SIGINT/SIGTERM after finishing or parking in-flight work; rerun to resume.
    pub const INTERRUPTED: i32 = 130;
}

#[derive(Parser, Debug)]
#[command(
    name = "embed-dlq",
    version,
    about = "Lossless embedding ingestion with a Postgres DLQ and Redis Streams"
)]
pub struct Cli {
    /// TOML config file (same keys as the flags, in [services] [provider] [ingest] [retry]).
    #[arg(long, global = true, env = "EMBED_DLQ_CONFIG")]
    pub config: Option<PathBuf>,
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value = "text")]
    pub log_format: LogFormat,
    #[command(flatten)]
    pub services: ServiceArgs,
    #[command(subcommand)]
    pub command: Command,
}

/// Settings of `serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Replayer tasks in this process (0 runs only the relay and the scheduler).
    #[arg(long, default_value_t = 2)]
    pub replayers: usize,
    /// Entries per replay batch.
    #[arg(long, default_value_t = 32)]
    pub replay_batch: usize,
    /// Entries idle this long are taken over by another replayer.
    #[arg(long, default_value_t = 60_000)]
    pub min_idle_ms: u64,
    /// Deliveries after which an entry is marked exhausted.
    #[arg(long, default_value_t = 5)]
    pub delivery_cap: u32,
    /// Time to finish in-flight work after SIGTERM.
    #[arg(long, default_value_t = 10_000)]
    pub grace_ms: u64,
    /// Key prefix of the streams (wrapped in a hash tag).
    #[arg(long, env = "EMBED_DLQ_STREAM_PREFIX", default_value = crate::streams::DEFAULT_PREFIX)]
    pub stream_prefix: String,
    /// Prefix of this process's consumer names (default: hostname-pid).
    #[arg(long)]
    pub consumer_name: Option<String>,
    /// Outbox rows per relay pass.
    #[arg(long, default_value_t = 500)]
    pub relay_batch: usize,
    /// Relay poll interval when no notification arrives.
    #[arg(long, default_value_t = 1_000)]
    pub relay_poll_ms: u64,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Apply the schema migrations (idempotent); optionally create another target table.
    Migrate {
        /// Also create this target table (if missing) with `--dimensions`.
        #[arg(long, requires = "dimensions")]
        table: Option<String>,
        #[arg(long)]
        dimensions: Option<usize>,
    },
    /// Embed a JSONL corpus (file or `-` for stdin) into the target table; park failures.
    Ingest {
        /// JSONL input: one {"doc_id","chunk_index","text","metadata"?} per line.
        #[arg(default_value = "-")]
        input: String,
        #[command(flatten)]
        provider: Box<ProviderArgs>,
        #[command(flatten)]
        ingest: Box<IngestArgs>,
        #[command(flatten)]
        retry: Box<RetryArgs>,
        /// Print the summary as JSON on stdout.
        #[arg(long)]
        json: bool,
        /// No progress bar.
        #[arg(long)]
        no_progress: bool,
    },
    /// Relay parked failures to Redis Streams and replay due work with a consumer group.
    Serve {
        #[command(flatten)]
        provider: Box<ProviderArgs>,
        #[command(flatten)]
        ingest: Box<IngestArgs>,
        #[command(flatten)]
        retry: Box<RetryArgs>,
        #[command(flatten)]
        serve: ServeArgs,
    },
    /// Follow the events stream (every park, replay, re-park, exhaustion).
    Tail {
        /// Where to start: `$` (new events only), `0` (everything kept) or an entry id.
        #[arg(long, default_value = "$")]
        from: String,
        /// One JSON object per event.
        #[arg(long)]
        json: bool,
        /// Resume from this file and save the last printed id to it.
        #[arg(long)]
        checkpoint: Option<PathBuf>,
        /// Exit after this many events.
        #[arg(long)]
        count: Option<u64>,
        /// Exit once caught up.
        #[arg(long)]
        no_follow: bool,
        /// Key prefix of the streams.
        #[arg(long, env = "EMBED_DLQ_STREAM_PREFIX", default_value = crate::streams::DEFAULT_PREFIX)]
        stream_prefix: String,
    },
    /// Run the fault-injecting OpenAI-compatible provider.
    MockProvider {
        #[arg(long, default_value = "127.0.0.1:8089")]
        listen: SocketAddr,
        /// Mock settings as JSON (keys of MockConfig, e.g. '{"rate_429":0.05}').
        #[arg(long, default_value = "{}")]
        settings: String,
    },
    /// End-to-end demo on the local services with the built-in fault-injecting provider.
    Demo {
        /// Chunks in the generated corpus.
        #[arg(long, default_value_t = 10_000)]
        chunks: usize,
        #[arg(long, default_value_t = 4)]
        concurrency: usize,
        /// Print the summaries as JSON.
        #[arg(long)]
        json: bool,
    },
}

/// Runs the parsed command; returns the process exit code.
pub async fn run(cli: Cli) -> i32 {
    let cancel = crate::shutdown::on_signal();
    let file = match &cli.config {
        Some(p) => match FileConfig::load(p) {
            Ok(f) => Some(f),
            Err(e) => return fail(exit::USAGE, &e),
        },
        None => None,
    };
    match cli.command {
        Command::Migrate { table, dimensions } => {
            let url = match cli.services.database_url.or(file.and_then(|f| f.services.database_url)) {
                Some(u) => u,
                None => return fail(exit::USAGE, "no database: set DATABASE_URL or --database-url"),
            };
            match migrate(&url, table.as_deref(), dimensions).await {
                Ok(()) => {
                    println!("migrations applied");
                    exit::OK
                }
                Err(e) => fail(exit::FAILURE, &e.to_string()),
            }
        }
        Command::Ingest { input, provider, ingest, retry, json, no_progress } => {
            let settings = match IngestSettings::resolve(cli.services, *provider, *ingest, *retry, file) {
                Ok(s) => s,
                Err(e) => return fail(exit::USAGE, &e),
            };
            ingest_command(settings, &input, json, !no_progress, cancel).await
        }
        Command::Serve { provider, ingest, retry, serve } => {
            let redis_url =
                cli.services.redis_url.clone().or(file.as_ref().and_then(|f| f.services.redis_url.clone()));
            let Some(redis_url) = redis_url else {
                return fail(exit::USAGE, "no Redis: set REDIS_URL or --redis-url");
            };
            let settings = match IngestSettings::resolve(cli.services, *provider, *ingest, *retry, file) {
                Ok(s) => s,
                Err(e) => return fail(exit::USAGE, &e),
            };
            serve_command(settings, &redis_url, serve, cancel).await
        }
        Command::Tail { from, json, checkpoint, count, no_follow, stream_prefix } => {
            let redis_url = cli.services.redis_url.or(file.and_then(|f| f.services.redis_url));
            let Some(redis_url) = redis_url else {
                return fail(exit::USAGE, "no Redis: set REDIS_URL or --redis-url");
            };
            let opts = crate::tail::TailOptions { from, json, checkpoint, count, no_follow };
            let keys = crate::streams::StreamKeys::new(&stream_prefix);
            let mut out = std::io::stdout();
            match crate::tail::tail(&redis_url, &keys, &opts, &mut out, cancel).await {
                Ok(_) => exit::OK,
                Err(e) => fail(exit::FAILURE, &e),
            }
        }
        Command::MockProvider { listen, settings } => {
            let config: MockConfig = match serde_json::from_str(&settings) {
                Ok(c) => c,
                Err(e) => return fail(exit::USAGE, &format!("--settings: {e}")),
            };
            match MockProvider::start(config, listen, cancel.clone()).await {
                Ok(mock) => {
                    eprintln!("mock provider listening on {} (GET /stats for counters)", mock.base_url());
                    cancel.cancelled().await;
                    mock.shutdown().await;
                    exit::OK
                }
                Err(e) => fail(exit::FAILURE, &format!("cannot listen on {listen}: {e}")),
            }
        }
        Command::Demo { chunks, concurrency, json } => {
            let Some(url) = cli.services.database_url else {
                return fail(exit::USAGE, "no database: run scripts/demo.sh, or set DATABASE_URL");
            };
            let Some(redis_url) = cli.services.redis_url else {
                return fail(exit::USAGE, "no Redis: run scripts/demo.sh, or set REDIS_URL");
            };
            match crate::demo::run(&url, &redis_url, chunks, concurrency, json, cancel).await {
                Ok(code) => code,
                Err(e) => fail(exit::FAILURE, &format!("{e:#}")),
            }
        }
    }
}

async fn serve_command(
    settings: IngestSettings,
    redis_url: &str,
    args: ServeArgs,
    cancel: CancellationToken,
) -> i32 {
    let pipeline = match build_pipeline(&settings).await {
        Ok(p) => p,
        Err(e) => return fail(exit::FAILURE, &e),
    };
    let replay = crate::replay::ReplayConfig {
        batch: args.replay_batch.max(1),
        min_idle: std::time::Duration::from_millis(args.min_idle_ms.max(100)),
        delivery_cap: args.delivery_cap.max(1),
        schedule: settings.options.dlq_schedule,
        ..Default::default()
    };
    let relay = crate::relay::RelayConfig {
        batch: args.relay_batch.max(1),
        poll: std::time::Duration::from_millis(args.relay_poll_ms.max(10)),
        ..Default::default()
    };
    let config = crate::serve::ServeConfig {
        replayers: args.replayers,
        relay,
        replay,
        keys: crate::streams::StreamKeys::new(&args.stream_prefix),
        grace: std::time::Duration::from_millis(args.grace_ms),
        consumer_prefix: args.consumer_name.unwrap_or_else(crate::serve::default_consumer_prefix),
    };
    let client = match crate::streams::client(redis_url) {
        Ok(c) => c,
        Err(e) => return fail(exit::USAGE, &format!("bad Redis URL: {e}")),
    };
    match crate::serve::serve(pipeline.store, pipeline.embedder, client, config, cancel.clone()).await {
        Ok(()) if cancel.is_cancelled() => exit::OK,
        Ok(()) => exit::OK,
        Err(e) => fail(exit::FAILURE, &e),
    }
}

async fn migrate(url: &str, table: Option<&str>, dimensions: Option<usize>) -> Result<(), store::StoreError> {
    let pool = store::connect(url, 2).await?;
    store::migrate(&pool).await?;
    if let (Some(t), Some(d)) = (table, dimensions) {
        store::create_target_table(&pool, t, d).await?;
    }
    Ok(())
}

/// Builds the pipeline for `settings` (store bound to its table, client, gate).
pub async fn build_pipeline(settings: &IngestSettings) -> Result<Pipeline, String> {
    let pool = store::connect(&settings.database_url, settings.options.concurrency as u32 + 2)
        .await
        .map_err(|e| format!("cannot connect to Postgres: {e}"))?;
    store::migrate(&pool).await.map_err(|e| e.to_string())?;
    let store = Store::open(pool, &settings.table).await.map_err(|e| e.to_string())?;
    let client = EmbedClient::new(settings.client.clone())?;
    let embedder = Embedder {
        client,
        gate: Arc::new(ProviderGate::new(settings.breaker)),
        policy: settings.retry,
        dimensions: store.target().dimensions,
    };
    Ok(Pipeline { store, embedder, options: settings.options.clone() })
}

async fn ingest_command(
    mut settings: IngestSettings,
    input: &str,
    json: bool,
    progress: bool,
    cancel: CancellationToken,
) -> i32 {
    use std::io::IsTerminal;
    settings.options.progress = progress && !json && std::io::stderr().is_terminal();
    let reader: Box<dyn tokio::io::AsyncBufRead + Unpin + Send> = if input == "-" {
        Box::new(tokio::io::BufReader::with_capacity(256 * 1024, tokio::io::stdin()))
    } else {
        match tokio::fs::File::open(input).await {
            Ok(f) => {
                settings.options.total_bytes = f.metadata().await.ok().map(|m| m.len());
                Box::new(tokio::io::BufReader::with_capacity(256 * 1024, f))
            }
            Err(e) => return fail(exit::FAILURE, &format!("cannot open {input}: {e}")),
        }
    };
    let pipeline = match build_pipeline(&settings).await {
        Ok(p) => p,
        Err(e) => return fail(exit::FAILURE, &e),
    };
    match pipeline.run(reader, cancel.clone()).await {
        Ok(summary) => {
            print_summary(&summary, json);
            summary_exit_code(&summary, cancel.is_cancelled())
        }
        Err(IngestError::Provider { stop, summary }) => {
            print_summary(&summary, json);
            fail(
                exit::PROVIDER_STOP,
                &format!("{stop}. Nothing was parked for this; fix it and rerun the same corpus."),
            )
        }
        Err(e) => fail(exit::FAILURE, &e.to_string()),
    }
}

/// The exit code a finished run deserves.
pub fn summary_exit_code(summary: &IngestSummary, interrupted: bool) -> i32 {
    if interrupted {
        exit::INTERRUPTED
    } else if summary.rejected_lines > 0 {
        exit::REJECTED_INPUT
    } else {
        exit::OK
    }
}

/// Prints a summary: human lines, or one JSON object.
pub fn print_summary(s: &IngestSummary, json: bool) {
    let mut out = std::io::stdout().lock();
    if json {
        let _ = writeln!(out, "{}", serde_json::to_string(s).expect("summary serializes"));
        return;
    }
    let _ = write_human_summary(&mut out, s);
}

/// The human form of a summary, written to any writer.
pub fn write_human_summary(out: &mut dyn Write, s: &IngestSummary) -> std::io::Result<()> {
    let rate = if s.elapsed_secs > 0.0 { s.records as f64 / s.elapsed_secs } else { 0.0 };
    writeln!(
        out,
        "records read        {:>10}  ({} lines, {:.1}s, {:.0} records/s)",
        s.records, s.lines_read, s.elapsed_secs, rate
    )?;
    writeln!(out, "stored              {:>10}  ({} vector rows written)", s.stored, s.vectors_written)?;
    writeln!(out, "skipped unchanged   {:>10}", s.unchanged)?;
    writeln!(out, "skipped, in DLQ     {:>10}", s.already_parked)?;
    writeln!(out, "parked              {:>10}", s.parked_total())?;
    for (class, n) in &s.parked {
        writeln!(out, "  {:<18}{:>10}", class.as_str(), n)?;
    }
    if s.dlq_resolved > 0 {
        writeln!(out, "DLQ rows resolved   {:>10}", s.dlq_resolved)?;
    }
    let retries: u64 = s.retries.values().sum();
    writeln!(out, "retries             {:>10}", retries)?;
    for (reason, n) in &s.retries {
        writeln!(out, "  {:<18}{:>10}", reason, n)?;
    }
    writeln!(
        out,
        "provider calls      {:>10}  ({} inputs, {} batch splits)",
        s.provider_calls, s.provider_inputs, s.batch_splits
    )?;
    writeln!(out, "tokens (reported)   {:>10}", s.reported_tokens)?;
    if s.breaker_opened > 0 {
        writeln!(out, "breaker opened      {:>10}", s.breaker_opened)?;
    }
    if s.rejected_lines > 0 {
        writeln!(
            out,
            "rejected lines      {:>10}  (no usable doc_id/chunk_index; not stored anywhere)",
            s.rejected_lines
        )?;
        for r in &s.rejected_examples {
            writeln!(out, "  line {}: {}", r.line, r.problem)?;
        }
    }
    if s.not_attempted > 0 {
        writeln!(out, "not attempted       {:>10}  (rerun the same corpus to finish them)", s.not_attempted)?;
    }
    if let Some(why) = &s.stopped {
        writeln!(out, "stopped early: {why}")?;
    }
    Ok(())
}

fn fail(code: i32, msg: &str) -> i32 {
    eprintln!("embed-dlq: error: {msg}");
    code
}
