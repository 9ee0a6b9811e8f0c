//! The app layer of the `embed-dlq` binary: parses the command line, resolves each command's
//! settings, calls the library, renders the outcome (human or `--json`) and maps it to a
//! documented exit code ([`exit`]). The library never prints or exits; everything that does
//! is here.
//!
//! - [`args`]: the clap definition of every command.
//! - [`exit`]: exit codes and the mapping of outcomes to them.
//! - [`render`]: the ingest summary and the reconcile report.
//! - one file per command that does more than call one library function: [`ingest`],
//!   [`serve`], [`tail`], [`reconcile`], [`dlq`], [`mock`], [`demo`].

mod args;
mod demo;
mod dlq;
mod exit;
mod ingest;
mod mock;
mod reconcile;
mod render;
mod serve;
mod tail;

use embed_dlq::config::{ConfigError, ConfigFile, FileConfig, IngestArgs, ServeArgs, Settings};
use embed_dlq::store::{self, Store, StoreError};
use tokio_util::sync::CancellationToken;

use args::{Cli, Command};

/// Parses the command line, sets up logging and runs the command on a tokio runtime;
/// returns the process exit code.
pub fn main() -> i32 {
    // Parse with the matches kept, so settings errors can say flag or environment variable.
    let matches = Cli::command_with_defaults().get_matches();
    let cli = Cli::from_matches(&matches).unwrap_or_else(|e| e.exit());
    embed_dlq::telemetry::init_logging(cli.log_format);
    let runtime =
        tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("build tokio runtime");
    let code = runtime.block_on(run(cli));
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    code
}

/// Runs the parsed command until it ends; the first signal asks it to stop gracefully, the
/// second exits at once with [`exit::INTERRUPTED`].
async fn run(cli: Cli) -> i32 {
    let signals = embed_dlq::shutdown::on_signal();
    // A task of its own (it lives as long as the process, so nothing joins it): the second
    // signal must exit even while the command blocks its thread, e.g. on a confirmation
    // prompt reading stdin.
    let immediate = signals.immediate.clone();
    tokio::spawn(async move {
        immediate.cancelled().await;
        exit::immediately()
    });
    dispatch(cli, signals.graceful).await
}

/// Resolves the command's settings and runs it.
///
/// Every command resolves its settings the same way ([`Settings::resolve`]): its flags
/// (environment values included) over the config file over the defaults.
async fn dispatch(cli: Cli, cancel: CancellationToken) -> i32 {
    let file = match &cli.config {
        Some(p) => match ConfigFile::load(p) {
            Ok(f) => Some(f),
            Err(e) => return exit::usage(&e),
        },
        None => None,
    };
    let origins = cli.origins;
    let services = cli.services;
    let resolve = |flags: FileConfig| Settings::resolve(flags, file.as_ref(), &origins);
    // Commands that need a database: the settings and the database URL they name.
    let resolve_with_database = |flags: FileConfig| -> Result<(Settings, String), ConfigError> {
        let settings = resolve(flags)?;
        let url = settings.database_url()?.to_string();
        Ok((settings, url))
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
                Err(e) => return exit::usage(&e),
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
                Err(e) => exit::fail(exit::FAILURE, &e.to_string()),
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
                Err(e) => return exit::usage(&e),
            };
            if let Some(addr) = metrics_addr
                && let Err(e) = embed_dlq::metrics::install(addr)
            {
                return exit::fail(exit::FAILURE, &e.to_string());
            }
            ingest::command(settings, &input, json, !no_progress, cancel).await
        }
        Command::Serve { provider, ingest, retry, serve } => {
            let flags = FileConfig { services, provider: *provider, ingest: *ingest, retry: *retry, serve };
            let resolved = resolve(flags).and_then(|s| Ok((s.ingest()?, s.redis_url()?.to_string(), s)));
            let (ingest, redis_url, settings) = match resolved {
                Ok(r) => r,
                Err(e) => return exit::usage(&e),
            };
            serve::command(&settings, ingest, &redis_url, cancel).await
        }
        Command::Tail { from, json, checkpoint, count, no_follow, stream_prefix } => {
            let flags = FileConfig {
                services,
                serve: ServeArgs { stream_prefix, ..Default::default() },
                ..Default::default()
            };
            let (redis_url, settings) = match resolve(flags).and_then(|s| Ok((s.redis_url()?.to_string(), s)))
            {
                Ok(r) => r,
                Err(e) => return exit::usage(&e),
            };
            let opts = embed_dlq::tail::TailOptions { from, checkpoint, count, no_follow };
            tail::command(&redis_url, &settings.stream_keys(), opts, json, cancel).await
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
                Err(e) => return exit::usage(&e),
            };
            let mode = match (repair, dry_run) {
                (true, true) => embed_dlq::reconcile::Mode::DryRun,
                (true, false) => embed_dlq::reconcile::Mode::Repair,
                (false, _) => embed_dlq::reconcile::Mode::Check,
            };
            let run = reconcile::ReconcileRun {
                database_url: &url,
                redis_url: settings.redis_url.as_deref(),
                table: &settings.table,
                stream_prefix: &settings.stream_prefix,
                mode,
                every: every_secs.map(std::time::Duration::from_secs),
                json,
                metrics_addr,
            };
            reconcile::command(run, cancel).await
        }
        Command::Dlq { action, json, table } => {
            let flags = FileConfig {
                services,
                ingest: IngestArgs { table, ..Default::default() },
                ..Default::default()
            };
            let (settings, url) = match resolve_with_database(flags) {
                Ok(r) => r,
                Err(e) => return exit::usage(&e),
            };
            dlq::command(&url, &settings.table, action, json).await
        }
        Command::MockProvider { listen, settings } => mock::command(listen, &settings, cancel).await,
        Command::Demo { chunks, concurrency, json } => {
            let urls = resolve(FileConfig { services, ..Default::default() })
                .and_then(|s| Ok((s.database_url()?.to_string(), s.redis_url()?.to_string())));
            let (url, redis_url) = match urls {
                Ok(u) => u,
                Err(e) => return exit::fail(exit::USAGE, &format!("{e} (or run scripts/demo.sh)")),
            };
            match demo::run(&url, &redis_url, chunks as usize, concurrency as usize, json, cancel).await {
                Ok(code) => code,
                Err(e) => exit::fail(exit::FAILURE, &format!("{e:#}")),
            }
        }
    }
}

/// Applies the migrations; with `create`, also creates that target table.
async fn migrate(url: &str, create: Option<(&str, usize)>) -> Result<(), StoreError> {
    let pool = store::connect(url, 2).await?;
    store::migrate(&pool).await?;
    if let Some((t, d)) = create {
        store::create_target_table(&pool, t, d).await?;
    }
    Ok(())
}

/// A migrated store on `table` with a pool of `connections`, for the operator commands.
async fn open_store(url: &str, connections: u32, table: &str) -> Result<Store, StoreError> {
    let pool = store::connect(url, connections).await?;
    store::migrate(&pool).await?;
    Store::open(pool, table).await
}
