//! The app layer of the `embed-dlq` binary: parses the command line, resolves each command's
//! settings, calls the library, renders the outcome (human or `--json`) and maps it to a
//! documented exit code ([`exit`]). The library never prints or exits; everything that does
//! is here.
//!
//! - [`args`]: the clap definition of every command.
//! - [`exit`]: exit codes and the mapping of outcomes to them.
//! - [`render`]: the ingest summary and the reconcile report.
//! - one file per command, each resolving its settings, calling the library and rendering:
//!   [`migrate`], [`ingest`], [`serve`], [`tail`], [`reconcile`], [`dlq`], [`console`], [`mock`],
//!   [`demo`].

mod args;
mod console;
mod demo;
mod dlq;
mod exit;
mod ingest;
mod migrate;
mod mock;
mod reconcile;
mod render;
mod revision;
mod serve;
mod source;
mod tail;

use embed_dlq::config::{ConfigError, ConfigFile, FileConfig, Origins, ServiceArgs, Settings};
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

/// Loads the config file and runs the command.
async fn dispatch(cli: Cli, cancel: CancellationToken) -> i32 {
    let file = match &cli.config {
        Some(p) => match ConfigFile::load(p) {
            Ok(f) => Some(f),
            Err(e) => return exit::usage(&e),
        },
        None => None,
    };
    let resolver = Resolver { file, origins: cli.origins, services: cli.services };
    match cli.command {
        Command::Migrate(args) => migrate::command(&resolver, args).await,
        Command::Ingest(args) => ingest::command(&resolver, args, cancel).await,
        Command::Serve(args) => serve::command(&resolver, *args, cancel).await,
        Command::Tail(args) => tail::command(&resolver, args, cancel).await,
        Command::Reconcile(args) => reconcile::command(&resolver, args, cancel).await,
        Command::Dlq(args) => dlq::command(&resolver, args).await,
        Command::Revision(args) => revision::command(&resolver, args, cancel).await,
        Command::Console(args) => console::command(&resolver, args, cancel).await,
        Command::Source(args) => source::command(&resolver, args).await,
        Command::MockProvider(args) => mock::command(args, cancel).await,
        Command::Demo(args) => demo::command(&resolver, args, cancel).await,
        Command::Reference { page } => {
            let text = match page {
                args::ReferencePage::Configuration => embed_dlq::reference::configuration(),
                args::ReferencePage::Metrics => embed_dlq::reference::metrics(),
            };
            print!("{text}");
            exit::OK
        }
    }
}

/// Resolves every command's settings the same way ([`Settings::resolve`]): its flags
/// (environment values included, and the global service flags) over the config file over
/// the defaults.
struct Resolver {
    file: Option<ConfigFile>,
    /// Which values came from flags and which from environment variables (for messages).
    origins: Origins,
    /// The global `--database-url`/`--redis-url` flags.
    services: ServiceArgs,
}

impl Resolver {
    /// The settings for a command's `flags` (their `services` group is ignored: the global
    /// service flags are used).
    fn settings(&self, flags: FileConfig) -> Result<Settings, ConfigError> {
        let flags = FileConfig { services: self.services.clone(), ..flags };
        Settings::resolve(flags, self.file.as_ref(), &self.origins)
    }

    /// For commands that need a database: the settings and the database URL they name.
    fn with_database(&self, flags: FileConfig) -> Result<(Settings, String), ConfigError> {
        let settings = self.settings(flags)?;
        let url = settings.database_url()?.to_string();
        Ok((settings, url))
    }
}

/// Refuses with `serve`'s message (exit 2) when the database is relayed under another stream
/// prefix than `prefix`, for the commands that only read the streams (`tail`, `console`): they
/// would show another deployment's streams, or empty ones. Records nothing. `Err` holds the
/// exit code; a database error is [`exit::FAILURE`].
async fn refuse_other_prefix(pool: &sqlx::PgPool, prefix: &str) -> Result<(), i32> {
    match store::prefix::verify(pool, prefix).await {
        Ok(()) => Ok(()),
        Err(store::prefix::PrefixError::Mismatch(m)) => Err(exit::fail(exit::USAGE, &m.to_string())),
        Err(e) => Err(exit::fail(exit::FAILURE, &e.to_string())),
    }
}

/// Warns on stderr when the API key's variable is unset: requests go without a key, and a
/// gateway that needs one may answer with a plain 500 that looks like an outage.
fn warn_missing_api_key(settings: &Settings) {
    if let Some(var) = settings.missing_api_key() {
        eprintln!(
            "embed-dlq: warning: {var} is not set: requests carry no API key. Fine for a server \
             without authentication (the mock, TEI, vLLM or Ollama started without a key); a \
             provider or gateway that needs one answers 401, 400 or even a plain 500 (LiteLLM)"
        );
    }
}

/// A migrated store on `table` with a pool of `connections`, for the operator commands.
async fn open_store(url: &str, connections: u32, table: &str) -> Result<Store, StoreError> {
    let pool = store::connect(url, connections).await?;
    store::migrate(&pool).await?;
    Store::open(pool, table).await
}
