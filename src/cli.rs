//! Command line: parses arguments, builds validated settings, calls the library, prints a
//! report and maps the outcome to a documented exit code. No business logic lives here.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use crate::config::{
    ConfigError, ConfigFile, FileConfig, IngestArgs, IngestSettings, Origins, ProviderArgs, RetryArgs,
    ServeArgs, ServiceArgs, Settings,
};
use crate::embed::Embedder;
use crate::embed::client::EmbedClient;
use crate::embed::gate::ProviderGate;
use crate::ingest::{IngestError, IngestSummary, Pipeline};
use crate::store::{self, Store};
use crate::testkit::mock_provider::{MockConfig, MockProvider};

/// Exit codes, stable for scripts.
pub mod exit {
    /// Finished; every record is stored or parked.
    pub const OK: i32 = 0;
    /// Could not run (database unreachable, bad table, I/O error).
    pub const FAILURE: i32 = 1;
    /// Bad flags, environment or config file (unknown key, value out of its documented bound,
    /// a base URL that is not http(s)), or a destructive command that needs `--all`/a terminal.
    pub const USAGE: i32 = 2;
    /// Finished, but some input lines had no usable identity and were only reported.
    pub const REJECTED_INPUT: i32 = 3;
    /// The provider refused the run (bad key, no quota, unknown model, long outage); nothing
    /// was parked for it, rerun once fixed.
    pub const PROVIDER_STOP: i32 = 4;
    /// `reconcile` found something (repaired or not; a second run tells whether it is clean).
    pub const FINDINGS: i32 = 5;
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
    /// TOML config file (same keys as the flags, in [services] [provider] [ingest] [retry] [serve]).
    #[arg(long, global = true, env = "EMBED_DLQ_CONFIG")]
    pub config: Option<PathBuf>,
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value = "text")]
    pub log_format: LogFormat,
    #[command(flatten)]
    pub services: ServiceArgs,
    #[command(subcommand)]
    pub command: Command,
    /// Which settings came from flags and which from environment variables (for messages).
    #[arg(skip)]
    pub origins: Origins,
}

impl Cli {
    /// The command line definition, with every setting's default appended to its help
    /// (read from [`crate::config::help_defaults`]; clap itself holds no defaults, which would
    /// shadow the config file).
    pub fn command_with_defaults() -> clap::Command {
        use clap::CommandFactory;
        fn annotate(mut cmd: clap::Command, defaults: &[(&'static str, String)]) -> clap::Command {
            for (key, value) in defaults {
                // Only options without a clap default of their own (command-only flags keep theirs).
                let Some(help) = cmd
                    .get_arguments()
                    .find(|a| a.get_id() == *key && a.get_default_values().is_empty())
                    .and_then(|a| a.get_help())
                else {
                    continue;
                };
                let help = format!("{help} [default: {value}]");
                cmd = cmd.mut_arg(*key, |a| a.help(help));
            }
            let names: Vec<String> = cmd.get_subcommands().map(|c| c.get_name().to_string()).collect();
            for name in names {
                cmd = cmd.mut_subcommand(name, |sc| annotate(sc, defaults));
            }
            cmd
        }
        annotate(Cli::command(), &crate::config::help_defaults())
    }

    /// Builds the command from parsed matches, remembering where each value came from.
    /// (`main` calls `Cli::command().get_matches()`, which prints help and exits on errors.)
    pub fn from_matches(matches: &clap::ArgMatches) -> Result<Cli, clap::Error> {
        use clap::{CommandFactory, FromArgMatches};
        let mut cli = <Cli as FromArgMatches>::from_arg_matches(matches)?;
        cli.origins = Origins::from_matches(&Cli::command(), matches);
        Ok(cli)
    }
}

/// `dlq` actions.
#[derive(Subcommand, Debug)]
pub enum DlqAction {
    /// Rows by error class, plus ready / still backing off / exhausted / next due.
    Stats,
    /// List rows (oldest first), with filters and paging.
    List {
        #[command(flatten)]
        filter: crate::dlq::Filter,
        /// Rows per page, 1..=10000.
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(i64).range(1..=10_000))]
        limit: i64,
        /// Show rows after this id (the last id of the previous page).
        #[arg(long, default_value_t = 0)]
        after_id: i64,
    },
    /// One row: payload, last error and error history.
    Show { id: i64 },
    /// Make matching rows due now and publish them for replay (permanent classes too).
    /// Without a filter it asks for confirmation, or needs `--all`.
    Requeue {
        #[command(flatten)]
        filter: crate::dlq::Filter,
        #[arg(long)]
        dry_run: bool,
        /// Requeue every row (required without a filter when stdin is not a terminal).
        #[arg(long)]
        all: bool,
        /// Rows per second, 1..=100000.
        #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=100_000))]
        rate: u32,
    },
    /// Delete matching rows for good (and their manifest rows).
    Purge {
        #[command(flatten)]
        filter: crate::dlq::Filter,
        #[arg(long)]
        dry_run: bool,
        /// Do not ask for confirmation.
        #[arg(long)]
        yes: bool,
    },
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Apply the schema migrations (idempotent); with `--dimensions`, also create the target
    /// table (`--table`, else `[ingest] table`) if it is missing.
    Migrate {
        /// The target table to create (default: the configured one).
        #[arg(long, requires = "dimensions")]
        table: Option<String>,
        /// Dimensions of the table's `vector(N)` column, 1..=16000.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=16_000))]
        dimensions: Option<u64>,
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
        /// Serve Prometheus metrics here while ingesting (e.g. 127.0.0.1:9466).
        #[arg(long)]
        metrics_addr: Option<SocketAddr>,
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
        /// Exit after this many events (at least 1).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        count: Option<u64>,
        /// Exit once caught up.
        #[arg(long)]
        no_follow: bool,
        /// Key prefix of the streams (else `[serve] stream_prefix` of the config file).
        #[arg(long, env = "EMBED_DLQ_STREAM_PREFIX")]
        stream_prefix: Option<String>,
    },
    /// Check that manifest, vectors, DLQ, outbox and streams agree; optionally repair.
    /// Exits 5 when something was found.
    Reconcile {
        /// Fix what can be fixed safely.
        #[arg(long)]
        repair: bool,
        /// With --repair: show what would be done, change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Run periodically, every this many seconds (a long-running job), 1..=604800.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=604_800))]
        every_secs: Option<u64>,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        /// Serve Prometheus metrics here while running (e.g. 127.0.0.1:9465).
        #[arg(long)]
        metrics_addr: Option<SocketAddr>,
        /// Target vector table (else `[ingest] table` of the config file).
        #[arg(long)]
        table: Option<String>,
        /// Key prefix of the streams (else `[serve] stream_prefix` of the config file).
        #[arg(long, env = "EMBED_DLQ_STREAM_PREFIX")]
        stream_prefix: Option<String>,
    },
    /// Inspect and act on the DLQ.
    Dlq {
        #[command(subcommand)]
        action: DlqAction,
        /// JSON output.
        #[arg(long, global = true)]
        json: bool,
        /// Target vector table (else `[ingest] table` of the config file).
        #[arg(long, global = true)]
        table: Option<String>,
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
        /// Chunks in the generated corpus, 1..=10000000.
        #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
        chunks: u64,
        /// Concurrent provider requests, 1..=256.
        #[arg(
            long,
            default_value_t = crate::ingest::IngestOptions::default().concurrency as u64,
            value_parser = clap::value_parser!(u64).range(1..=256)
        )]
        concurrency: u64,
        /// Print the summaries as JSON.
        #[arg(long)]
        json: bool,
    },
}

/// Runs the parsed command; returns the process exit code.
///
/// Every command resolves its settings the same way ([`Settings::resolve`]): its flags
/// (environment values included) over the config file over the defaults.
pub async fn run(cli: Cli) -> i32 {
    let cancel = crate::shutdown::on_signal();
    let file = match &cli.config {
        Some(p) => match ConfigFile::load(p) {
            Ok(f) => Some(f),
            Err(e) => return usage(&e),
        },
        None => None,
    };
    let origins = cli.origins;
    let services = cli.services;
    let resolve = |flags: FileConfig| Settings::resolve(flags, file.as_ref(), &origins);
    // Commands that need a database: the settings and the database URL they name.
    let resolve_with_database = |flags: FileConfig| {
        resolve(flags).and_then(|s| {
            let url = s.database_url()?.to_string();
            Ok((s, url))
        })
    };
    match cli.command {
        Command::Migrate { table, dimensions } => {
            let flags = FileConfig {
                services,
                ingest: IngestArgs { table, ..Default::default() },
                ..Default::default()
            };
            let (settings, url) = match resolve_with_database(flags) {
                Ok(r) => r,
                Err(e) => return usage(&e),
            };
            let create = dimensions.map(|d| (settings.table.as_str(), d as usize));
            match migrate(&url, create).await {
                Ok(()) => {
                    match create {
                        Some((t, d)) => println!("migrations applied; table {t} ready (vector({d}))"),
                        None => println!("migrations applied"),
                    }
                    exit::OK
                }
                Err(e) => fail(exit::FAILURE, &e.to_string()),
            }
        }
        Command::Ingest { input, provider, ingest, retry, json, no_progress, metrics_addr } => {
            let flags = FileConfig {
                services,
                provider: *provider,
                ingest: *ingest,
                retry: *retry,
                ..Default::default()
            };
            let settings = match resolve(flags).and_then(|s| s.ingest()) {
                Ok(s) => s,
                Err(e) => return usage(&e),
            };
            if let Some(addr) = metrics_addr
                && let Err(e) = crate::metrics::install(addr)
            {
                return fail(exit::FAILURE, &e);
            }
            ingest_command(settings, &input, json, !no_progress, cancel).await
        }
        Command::Serve { provider, ingest, retry, serve } => {
            let flags = FileConfig { services, provider: *provider, ingest: *ingest, retry: *retry, serve };
            let (settings, ingest, redis_url) =
                match resolve(flags).and_then(|s| Ok((s.ingest()?, s.redis_url()?.to_string(), s))) {
                    Ok((ingest, redis_url, s)) => (s, ingest, redis_url),
                    Err(e) => return usage(&e),
                };
            serve_command(&settings, ingest, &redis_url, cancel).await
        }
        Command::Tail { from, json, checkpoint, count, no_follow, stream_prefix } => {
            let flags = FileConfig {
                services,
                serve: ServeArgs { stream_prefix, ..Default::default() },
                ..Default::default()
            };
            let (settings, redis_url) = match resolve(flags).and_then(|s| Ok((s.redis_url()?.to_string(), s)))
            {
                Ok((url, s)) => (s, url),
                Err(e) => return usage(&e),
            };
            if let Err(e) = crate::tail::check_from(&from) {
                return fail(exit::USAGE, &format!("--from: {e}"));
            }
            let opts = crate::tail::TailOptions { from, json, checkpoint, count, no_follow };
            let mut out = std::io::stdout();
            match crate::tail::tail(&redis_url, &settings.stream_keys(), &opts, &mut out, cancel).await {
                Ok(_) => exit::OK,
                Err(e) => fail(exit::FAILURE, &e),
            }
        }
        Command::Reconcile { repair, dry_run, every_secs, json, metrics_addr, table, stream_prefix } => {
            let flags = FileConfig {
                services,
                ingest: IngestArgs { table, ..Default::default() },
                serve: ServeArgs { stream_prefix, ..Default::default() },
                ..Default::default()
            };
            let (settings, url) = match resolve_with_database(flags) {
                Ok(r) => r,
                Err(e) => return usage(&e),
            };
            let mode = match (repair, dry_run) {
                (true, true) => crate::reconcile::Mode::DryRun,
                (true, false) => crate::reconcile::Mode::Repair,
                (false, _) => crate::reconcile::Mode::Check,
            };
            reconcile_command(
                &url,
                settings.redis_url.as_deref(),
                &settings.table,
                &settings.stream_prefix,
                mode,
                every_secs,
                json,
                metrics_addr,
                cancel,
            )
            .await
        }
        Command::Dlq { action, json, table } => {
            let flags = FileConfig {
                services,
                ingest: IngestArgs { table, ..Default::default() },
                ..Default::default()
            };
            let (settings, url) = match resolve_with_database(flags) {
                Ok(r) => r,
                Err(e) => return usage(&e),
            };
            dlq_command(&url, &settings.table, action, json).await
        }
        Command::MockProvider { listen, settings } => {
            let config: MockConfig = match serde_json::from_str(&settings) {
                Ok(c) => c,
                Err(e) => return fail(exit::USAGE, &format!("--settings: {e}")),
            };
            if let Err(e) = check_mock_config(&config) {
                return fail(exit::USAGE, &format!("--settings: {e}"));
            }
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
            let urls = resolve(FileConfig { services, ..Default::default() })
                .and_then(|s| Ok((s.database_url()?.to_string(), s.redis_url()?.to_string())));
            let (url, redis_url) = match urls {
                Ok(u) => u,
                Err(e) => return fail(exit::USAGE, &format!("{e} (or run scripts/demo.sh)")),
            };
            match crate::demo::run(&url, &redis_url, chunks as usize, concurrency as usize, json, cancel)
                .await
            {
                Ok(code) => code,
                Err(e) => fail(exit::FAILURE, &format!("{e:#}")),
            }
        }
    }
}

async fn serve_command(
    settings: &Settings,
    mut ingest: IngestSettings,
    redis_url: &str,
    cancel: CancellationToken,
) -> i32 {
    let args = &settings.serve;
    // The pool is sized from `concurrency`: give every replayer, the relay, the scheduler and
    // the sampler a connection of their own.
    ingest.options.concurrency = ingest.options.concurrency.max(args.replayers + 3);
    let pipeline = match build_pipeline(&ingest).await {
        Ok(p) => p,
        Err(e) => return fail(exit::FAILURE, &e),
    };
    if let Some(addr) = args.metrics_addr
        && let Err(e) = crate::metrics::install(addr)
    {
        return fail(exit::FAILURE, &e);
    }
    let config = crate::serve::ServeConfig {
        reconcile_every: args.reconcile_every,
        metrics: args.metrics_addr.is_some(),
        replayers: args.replayers,
        relay: args.relay.clone(),
        replay: args.replay.clone(),
        keys: settings.stream_keys(),
        grace: args.grace,
        consumer_prefix: args.consumer_prefix.clone().unwrap_or_else(crate::serve::default_consumer_prefix),
    };
    let client = match crate::streams::client(redis_url) {
        Ok(c) => c,
        Err(e) => return fail(exit::USAGE, &format!("bad Redis URL: {e}")),
    };
    match crate::serve::serve(pipeline.store, pipeline.embedder, client, config, cancel.clone()).await {
        Ok(()) => exit::OK,
        Err(e) => fail(exit::FAILURE, &e.to_string()),
    }
}

#[allow(clippy::too_many_arguments)]
async fn reconcile_command(
    url: &str,
    redis_url: Option<&str>,
    table: &str,
    prefix: &str,
    mode: crate::reconcile::Mode,
    every_secs: Option<u64>,
    json: bool,
    metrics_addr: Option<SocketAddr>,
    cancel: CancellationToken,
) -> i32 {
    if let Some(addr) = metrics_addr
        && let Err(e) = crate::metrics::install(addr)
    {
        return fail(exit::FAILURE, &e);
    }
    let store = match async {
        let pool = store::connect(url, 4).await?;
        store::migrate(&pool).await?;
        Store::open(pool, table).await
    }
    .await
    {
        Ok(s) => s,
        Err(e) => return fail(exit::FAILURE, &e.to_string()),
    };
    let redis = match redis_url {
        Some(u) => match crate::streams::client(u) {
            Ok(c) => match crate::streams::managed(&c).await {
                Ok(m) => Some(m),
                Err(e) => return fail(exit::FAILURE, &format!("cannot connect to Redis: {e}")),
            },
            Err(e) => return fail(exit::USAGE, &format!("bad Redis URL: {e}")),
        },
        None => None,
    };
    let keys = crate::streams::StreamKeys::new(prefix);
    let mut reconciler = crate::reconcile::Reconciler {
        store: store.clone(),
        redis: redis.clone(),
        keys: keys.clone(),
        config: Default::default(),
    };
    crate::metrics::zero_findings();
    loop {
        let code = match reconciler.run_once(mode).await {
            Ok(report) => {
                crate::metrics::reconcile_report(&report);
                let mut redis = redis.clone();
                if let Err(e) = crate::metrics::sample(&store, redis.as_mut(), &keys).await {
                    tracing::warn!(error = %e, "sampling gauges failed");
                }
                let mut out = std::io::stdout().lock();
                if json {
                    let _ = writeln!(out, "{}", serde_json::to_string(&report).expect("report serializes"));
                } else {
                    let _ = crate::reconcile::write_report(&mut out, &report);
                }
                if report.total_found() > 0 { exit::FINDINGS } else { exit::OK }
            }
            Err(e) => fail(exit::FAILURE, &format!("reconcile failed: {e}")),
        };
        let Some(every) = every_secs else { return code };
        tokio::select! {
            _ = cancel.cancelled() => return exit::OK,
            _ = tokio::time::sleep(std::time::Duration::from_secs(every)) => {}
        }
    }
}

async fn dlq_command(url: &str, table: &str, action: DlqAction, json: bool) -> i32 {
    use std::io::IsTerminal;
    if let DlqAction::List { filter, .. }
    | DlqAction::Requeue { filter, .. }
    | DlqAction::Purge { filter, .. } = &action
        && let Err(e) = check_filter_bounds(filter)
    {
        return fail(exit::USAGE, &e);
    }
    // Requeueing the whole DLQ sends every row to the provider again: it needs `--all`, or a
    // confirmation on a terminal.
    let mut confirm_requeue_all = false;
    if let DlqAction::Requeue { filter, dry_run, all, .. } = &action {
        let unfiltered = filter_is_empty(filter);
        if *all && !unfiltered {
            return fail(exit::USAGE, "--all means every row; drop it or the filter");
        }
        if unfiltered && !*all && !*dry_run {
            if !std::io::stdin().is_terminal() {
                return fail(
                    exit::USAGE,
                    "refusing to requeue every DLQ row without --all (stdin is not a terminal); \
                     give a filter (--class, --doc, ...) or --all",
                );
            }
            confirm_requeue_all = true;
        }
    }
    let store = match async {
        let pool = store::connect(url, 2).await?;
        store::migrate(&pool).await?;
        Store::open(pool, table).await
    }
    .await
    {
        Ok(s) => s,
        Err(e) => return fail(exit::FAILURE, &e.to_string()),
    };
    let mut out = std::io::stdout().lock();
    let result: Result<(), String> = async {
        match action {
            DlqAction::Stats => {
                let s = crate::dlq::stats(&store).await.map_err(|e| e.to_string())?;
                if json {
                    let _ = writeln!(out, "{}", serde_json::to_string(&s).unwrap());
                } else {
                    let ts = |t: Option<chrono::DateTime<chrono::Utc>>| {
                        t.map(|t| t.format("%Y-%m-%d %H:%M:%S").to_string()).unwrap_or_else(|| "-".into())
                    };
                    let _ = writeln!(
                        out,
                        "{:<20}{:>8}  {:<21}{:<21}{:>12}",
                        "error_class", "parked", "oldest", "newest", "avg_attempts"
                    );
                    for c in &s.by_class {
                        let _ = writeln!(
                            out,
                            "{:<20}{:>8}  {:<21}{:<21}{:>12.1}",
                            c.error_class,
                            c.parked,
                            ts(c.oldest),
                            ts(c.newest),
                            c.avg_attempts
                        );
                    }
                    let _ = writeln!(
                        out,
                        "ready to replay {}  still backing off {}  exhausted {}  next due {}",
                        s.ready_to_replay,
                        s.still_backing_off,
                        s.exhausted,
                        ts(s.next_due)
                    );
                }
            }
            DlqAction::List { filter, limit, after_id } => {
                let rows = crate::dlq::list(&store, &filter, limit.clamp(1, 10_000), after_id)
                    .await
                    .map_err(|e| e.to_string())?;
                if json {
                    let _ = writeln!(out, "{}", serde_json::to_string(&rows).unwrap());
                } else {
                    for r in &rows {
                        let _ = writeln!(
                            out,
                            "{:>8} {}#{} {} {} attempts={} replays={} first={} next={}{}",
                            r.id,
                            r.doc_id,
                            r.chunk_index,
                            r.error_class,
                            r.error_reason,
                            r.attempts,
                            r.replays,
                            r.first_failed_at.to_rfc3339(),
                            r.next_retry_at.map(|t| t.to_rfc3339()).unwrap_or_else(|| "never".into()),
                            if r.exhausted { " EXHAUSTED" } else { "" }
                        );
                    }
                    if let Some(last) = rows.last() {
                        let _ = writeln!(out, "next page: --after-id {}", last.id);
                    }
                }
            }
            DlqAction::Show { id } => match crate::dlq::show(&store, id).await.map_err(|e| e.to_string())? {
                Some(d) => {
                    let _ = writeln!(
                        out,
                        "{}",
                        if json { serde_json::to_string(&d) } else { serde_json::to_string_pretty(&d) }
                            .unwrap()
                    );
                }
                None => return Err(format!("no DLQ row with id {id}")),
            },
            DlqAction::Requeue { filter, dry_run, rate, all: _ } => {
                if confirm_requeue_all {
                    let n = crate::dlq::requeue(&store, &filter, true, rate)
                        .await
                        .map_err(|e| e.to_string())?
                        .requeued;
                    if n == 0 {
                        let _ = if json { writeln!(out, "{{\"requeued\":0}}") } else { writeln!(out, "requeued 0 rows") };
                        return Ok(());
                    }
                    eprint!("requeue all {n} DLQ rows for replay (they will be sent to the provider again)? type 'yes': ");
                    let mut answer = String::new();
                    let _ = std::io::stdin().read_line(&mut answer);
                    if answer.trim() != "yes" {
                        return Err("not confirmed; nothing requeued".into());
                    }
                }
                let o =
                    crate::dlq::requeue(&store, &filter, dry_run, rate).await.map_err(|e| e.to_string())?;
                let (n, reingest) = (o.requeued, o.needs_reingest);
                let verb = if dry_run { "would requeue" } else { "requeued" };
                let _ = if json {
                    writeln!(out, "{{\"{}\":{n},\"needs_reingest\":{reingest}}}", verb.replace(' ', "_"))
                } else {
                    writeln!(out, "{verb} {n} rows")
                };
                if reingest > 0 && !json {
                    let _ = writeln!(out, "{reingest} rows need a corrected payload: re-ingest them");
                }
            }
            DlqAction::Purge { filter, dry_run, yes } => {
                let n = crate::dlq::purge(&store, &filter, true).await.map_err(|e| e.to_string())?;
                if dry_run || n == 0 {
                    let _ = if json {
                        writeln!(out, "{{\"would_purge\":{n}}}")
                    } else {
                        writeln!(out, "would purge {n} rows")
                    };
                    return Ok(());
                }
                if !yes {
                    if !std::io::stdin().is_terminal() {
                        return Err(format!(
                            "refusing to purge {n} rows without --yes (stdin is not a terminal)"
                        ));
                    }
                    eprint!("purge {n} DLQ rows for good? type 'yes': ");
                    let mut answer = String::new();
                    let _ = std::io::stdin().read_line(&mut answer);
                    if answer.trim() != "yes" {
                        return Err("not confirmed; nothing purged".into());
                    }
                }
                let n = crate::dlq::purge(&store, &filter, false).await.map_err(|e| e.to_string())?;
                let _ =
                    if json { writeln!(out, "{{\"purged\":{n}}}") } else { writeln!(out, "purged {n} rows") };
            }
        }
        Ok(())
    }
    .await;
    match result {
        Ok(()) => exit::OK,
        Err(e) => fail(exit::FAILURE, &e),
    }
}

async fn migrate(url: &str, create: Option<(&str, usize)>) -> Result<(), store::StoreError> {
    let pool = store::connect(url, 2).await?;
    store::migrate(&pool).await?;
    if let Some((t, d)) = create {
        store::create_target_table(&pool, t, d).await?;
    }
    Ok(())
}

/// Longest `--older-than-secs` (100 years): larger values overflow Postgres intervals.
pub const MAX_OLDER_THAN_SECS: u64 = 100 * 365 * 24 * 3600;

fn check_filter_bounds(filter: &crate::dlq::Filter) -> Result<(), String> {
    match filter.older_than_secs {
        Some(s) if s > MAX_OLDER_THAN_SECS => {
            Err(format!("--older-than-secs {s} is out of range: allowed 0..={MAX_OLDER_THAN_SECS}"))
        }
        _ => Ok(()),
    }
}

/// Whether `filter` selects every row. Destructured exhaustively: a new filter field must be
/// considered here, or an unfiltered requeue could slip past the confirmation.
fn filter_is_empty(filter: &crate::dlq::Filter) -> bool {
    let crate::dlq::Filter { class, doc, older_than_secs, min_attempts, exhausted } = filter;
    class.is_none() && doc.is_none() && older_than_secs.is_none() && min_attempts.is_none() && !exhausted
}

/// Builds the pipeline for `settings` (store bound to its table, client, gate).
pub async fn build_pipeline(settings: &IngestSettings) -> Result<Pipeline, String> {
    let pool = store::connect(
        &settings.database_url,
        (settings.options.concurrency + settings.options.writers) as u32 + 2,
    )
    .await
    .map_err(|e| format!("cannot connect to Postgres: {e}"))?;
    store::migrate(&pool).await.map_err(|e| e.to_string())?;
    let store = Store::open(pool, &settings.table)
        .await
        .map_err(|e| e.to_string())?
        .with_model(&settings.client.model, settings.client.request_dimensions);
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
    if s.superseded > 0 {
        writeln!(
            out,
            "superseded          {:>10}  (a later line or run of the same chunk won)",
            s.superseded
        )?;
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

/// Longest wait the mock may be told to add (latency, hold, outage, Retry-After): 1 day.
pub const MOCK_MAX_MS: u64 = 86_400_000;

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
    if !crate::config::bounds::DIMENSIONS.contains(&c.dimensions) {
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
    Ok(())
}

fn usage(e: &ConfigError) -> i32 {
    fail(exit::USAGE, &e.to_string())
}

fn fail(code: i32, msg: &str) -> i32 {
    eprintln!("embed-dlq: error: {msg}");
    code
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn help_shows_the_resolved_defaults() {
        let mut cmd = Cli::command_with_defaults();
        let ingest = cmd.find_subcommand_mut("ingest").unwrap().render_long_help().to_string();
        let concurrency = crate::ingest::IngestOptions::default().concurrency;
        assert!(ingest.contains(&format!("[default: {concurrency}]")), "{ingest}");
        assert!(ingest.contains("[default: doc_embeddings]"), "{ingest}");
        let serve = cmd.find_subcommand_mut("serve").unwrap().render_long_help().to_string();
        assert!(serve.contains("[default: embed-dlq]"), "{serve}");
        let reconcile = cmd.find_subcommand_mut("reconcile").unwrap().render_long_help().to_string();
        assert!(reconcile.contains("[default: doc_embeddings]"), "{reconcile}");
        // Parsing with the annotated definition still works.
        Cli::command_with_defaults()
            .try_get_matches_from(["embed-dlq", "ingest", "--concurrency", "3"])
            .unwrap();
    }

    #[test]
    fn mock_settings_are_bounded() {
        assert!(check_mock_config(&MockConfig::default()).is_ok());
        let bad = [
            MockConfig { rate_429: 1.5, ..MockConfig::default() },
            MockConfig { rate_5xx: f64::NAN, ..MockConfig::default() },
            MockConfig { dimensions: 0, ..MockConfig::default() },
            MockConfig { latency_ms: u64::MAX, ..MockConfig::default() },
            MockConfig { outage_after_ms: Some(MOCK_MAX_MS + 1), ..MockConfig::default() },
        ];
        for c in bad {
            assert!(check_mock_config(&c).is_err(), "{c:?}");
        }
    }
}
