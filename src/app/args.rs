//! The command line definition: every command, flag and its documented bound. Settings that
//! a config file may also give carry no clap default (it would shadow the file): their
//! defaults come from [`embed_dlq::config::help_defaults`] and are shown in the help.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand};
use embed_dlq::config::{IngestArgs, Origins, ProviderArgs, RetryArgs, ServeArgs, ServiceArgs, SourceArgs};
use embed_dlq::telemetry::LogFormat;

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
    /// The command line definition, with every setting's bound and default appended to its
    /// help (read from [`embed_dlq::config::help_bounds`] and
    /// [`embed_dlq::config::help_defaults`]: the resolver's own; clap itself holds no defaults,
    /// which would shadow the config file).
    pub fn command_with_defaults() -> clap::Command {
        use clap::CommandFactory;
        type Notes = HashMap<&'static str, String>;
        fn annotate(mut cmd: clap::Command, bounds: &Notes, defaults: &Notes) -> clap::Command {
            let keys: std::collections::BTreeSet<&'static str> =
                bounds.keys().chain(defaults.keys()).copied().collect();
            for key in keys {
                // Only options without a clap default of their own (command-only flags keep theirs).
                let Some(help) = cmd
                    .get_arguments()
                    .find(|a| a.get_id() == key && a.get_default_values().is_empty())
                    .and_then(|a| a.get_help())
                else {
                    continue;
                };
                let mut help = help.to_string();
                if let Some(bound) = bounds.get(key) {
                    help.push_str(&format!(" [range: {bound}]"));
                }
                if let Some(value) = defaults.get(key) {
                    help.push_str(&format!(" [default: {value}]"));
                }
                cmd = cmd.mut_arg(key, |a| a.help(help));
            }
            let names: Vec<String> = cmd.get_subcommands().map(|c| c.get_name().to_string()).collect();
            for name in names {
                cmd = cmd.mut_subcommand(name, |sc| annotate(sc, bounds, defaults));
            }
            cmd
        }
        let bounds: Notes = embed_dlq::config::help_bounds().into_iter().collect();
        let defaults: Notes = embed_dlq::config::help_defaults().into_iter().collect();
        let cmd = annotate(Cli::command(), &bounds, &defaults);
        // The global flags reach every subcommand when it is built, unless it has an argument
        // of the same id: the mock provider uses none of the database, Redis and config-file
        // ones, so it gets hidden copies of them and its help shows only its own flags.
        let hidden: Vec<clap::Arg> = cmd
            .get_arguments()
            .filter(|a| {
                ["config", "database_url", "redis_url", "redis_cluster"].contains(&a.get_id().as_str())
            })
            .map(|a| a.clone().hide(true))
            .collect();
        let keys = embed_dlq::testkit::mock_provider::MockConfig::keys().join(", ");
        cmd.mut_subcommand("mock-provider", |sc| {
            sc.args(hidden).mut_arg("settings", |a| {
                a.long_help(format!(
                    "Faults and account limits as one JSON object, e.g. '{{\"rate_429\":0.05,\"rate_5xx\":0.05}}'; \
                     every key is optional: {keys}"
                ))
            })
        })
    }

    /// Builds the command from parsed matches, remembering where each value came from.
    /// (`app::main` calls `Cli::command_with_defaults().get_matches()`, which prints help and
    /// exits on errors.)
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
        filter: embed_dlq::dlq::Filter,
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
        filter: embed_dlq::dlq::Filter,
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
        filter: embed_dlq::dlq::Filter,
        #[arg(long)]
        dry_run: bool,
        /// Do not ask for confirmation.
        #[arg(long)]
        yes: bool,
    },
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Apply the schema migrations (idempotent); with `--dimensions`, also create the target
    /// table (`--table`, else `[ingest] table`) if it is missing.
    Migrate(MigrateCommand),
    /// Embed a JSONL corpus (file or `-` for stdin) into the target table; park failures.
    Ingest(IngestCommand),
    /// Relay parked failures to Redis Streams and replay due work with a consumer group.
    // Boxed: its settings make it several times the size of the other commands.
    Serve(Box<ServeCommand>),
    /// Follow the events stream (every park, replay, re-park, exhaustion).
    Tail(TailCommand),
    /// Check that manifest, vectors, DLQ, outbox and streams agree; optionally repair.
    /// Exits 5 when something was found.
    Reconcile(ReconcileCommand),
    /// Inspect and act on the DLQ.
    Dlq(DlqCommand),
    /// Revisions of a target: a new embedding model built beside the live one, switched to
    /// once it covers it, rolled back (docs/revisions.md).
    Revision(RevisionCommand),
    /// Postgres tables as sources: register one (its capture triggers), list them, check
    /// their triggers (docs/table-source.md). `ingest --from-table NAME` follows one.
    #[command(subcommand)]
    Source(SourceCommand),
    /// The operator console in the browser: DLQ overview, list, detail, bulk requeue/purge,
    /// live events, reconcile (token `EMBED_DLQ_CONSOLE_TOKEN` for actions).
    Console(ConsoleCommand),
    /// Run the fault-injecting OpenAI-compatible provider.
    MockProvider(MockProviderCommand),
    /// End-to-end demo on the local services with the built-in fault-injecting provider.
    Demo(DemoCommand),
    /// Print a reference page of docs/reference/ as the code defines it (markdown).
    #[command(hide = true)]
    Reference {
        /// Which page.
        #[arg(value_enum)]
        page: ReferencePage,
    },
}

/// `source`: Postgres tables followed by `ingest --from-table`.
#[derive(Subcommand, Debug)]
pub enum SourceCommand {
    /// Register a table as a source and install its capture triggers, in one transaction: a
    /// change committed after it is queued; the first follower snapshots what was there.
    AddTable {
        /// The source's name: 1..=40 of [a-z0-9_].
        name: String,
        /// The table followed (schema-qualified or on the search path).
        #[arg(long)]
        table: String,
        /// The column whose value is the document id.
        #[arg(long)]
        key: String,
        /// A row per chunk: the integer column holding the chunk index (default: a row is
        /// one chunk, index 0).
        #[arg(long)]
        chunk_column: Option<String>,
        /// The text embedded: `{column}` placeholders, `{{`/`}}` for braces, `\n` and `\t`
        /// for a newline and a tab. An update that changes none of these columns (nor the
        /// key) queues nothing and costs no provider call.
        #[arg(long)]
        text: String,
        /// Columns kept as the chunk's metadata (in a parked chunk's DLQ payload).
        #[arg(long, value_delimiter = ',')]
        metadata: Vec<String>,
        /// The vector table fed (default: the configured `[ingest] table`).
        #[arg(long)]
        target: Option<String>,
        /// A row holds a whole document: cut it into chunks of at most N characters
        /// (16..=100000), chunk 0 first. An edit re-embeds only the chunks whose text
        /// changed; a shorter document's trailing chunks are deleted.
        #[arg(long, value_name = "N", conflicts_with_all = ["chunk_column", "chunk_tokens"])]
        chunk_chars: Option<u32>,
        /// As --chunk-chars, in cl100k_base tokens (8..=8191: the tokenizer and input limit
        /// of OpenAI's embedding models).
        #[arg(long, value_name = "N", conflicts_with = "chunk_column")]
        chunk_tokens: Option<u32>,
        /// Characters or tokens of a chunk's end repeated at the next one's start (below the
        /// chunk size).
        #[arg(long, value_name = "N", default_value_t = 0)]
        chunk_overlap: u32,
        /// Cut at Markdown's structure first (headings, blocks, lists), then at sentences.
        #[arg(long)]
        markdown: bool,
    },
    /// Reinstall a source's missing or disabled capture triggers and resync the table with
    /// a full cleanup at the next follow (what changed meanwhile was never queued).
    Repair {
        /// The source's name.
        name: String,
    },
    /// Unregister a source: drop its capture triggers and its queue (refused while its
    /// follower runs). The vectors it wrote stay in the vector table.
    Remove {
        /// The source's name.
        name: String,
    },
    /// List the sources: table, target, snapshot state, queue depth and lag, triggers.
    /// Exits 5 when a source's capture trigger is missing or disabled.
    List {
        /// Print JSON on stdout.
        #[arg(long)]
        json: bool,
    },
}

/// The generated pages of `docs/reference/`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum ReferencePage {
    /// Every setting: key, flag, environment variable, default, bound.
    Configuration,
    /// Every metric: type, unit, labels, meaning.
    Metrics,
}

/// The arguments of `migrate`.
#[derive(clap::Args, Debug)]
pub struct MigrateCommand {
    /// The target table to create (default: the configured one).
    #[arg(long, requires = "dimensions")]
    pub table: Option<String>,
    /// Dimensions of the table's `vector(N)` column, 1..=16000.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=16_000))]
    pub dimensions: Option<u64>,
    /// Record this stream prefix as the one the database's outbox is relayed under, replacing
    /// the recorded one: moves the database to new streams (stop every `serve` first, then run
    /// `reconcile --repair` with the new prefix).
    #[arg(long, value_name = "PREFIX")]
    pub adopt_stream_prefix: Option<String>,
}

/// The arguments of `ingest`.
#[derive(clap::Args, Debug)]
pub struct IngestCommand {
    /// JSONL input: one {"doc_id","chunk_index","text","metadata"?} per line.
    #[arg(default_value = "-")]
    pub input: String,
    #[command(flatten)]
    pub provider: Box<ProviderArgs>,
    #[command(flatten)]
    pub ingest: Box<IngestArgs>,
    #[command(flatten)]
    pub retry: Box<RetryArgs>,
    /// Print the summary as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Serve Prometheus metrics here while ingesting (e.g. 127.0.0.1:9466).
    #[arg(long)]
    pub metrics_addr: Option<SocketAddr>,
    /// With --cleanup full: delete even more than --cleanup-max-fraction of the table.
    #[arg(long)]
    pub yes: bool,
    /// Read the input and print what the cleanup and the input's deletes would delete; embed
    /// nothing, write nothing.
    #[arg(long)]
    pub dry_run: bool,
    #[command(flatten)]
    pub source: SourceArgs,
    /// With --from-stream: stop once no entry has arrived for this long and the group has
    /// nothing pending (a batch run over what the stream holds), 0..=86400000 ms. With
    /// --from-table: once the change queue has been empty this long.
    #[arg(long, value_name = "MS")]
    pub idle_exit_ms: Option<u64>,
    /// Follow a table source registered with `source add-table` (docs/table-source.md):
    /// snapshot it if it was not yet, then apply its queued changes as they come. With
    /// `revision backfill`: read the table once, in key order, as the corpus to copy.
    #[arg(long, value_name = "NAME", conflicts_with = "dry_run")]
    pub from_table: Option<String>,
}

/// The arguments of `serve`.
#[derive(clap::Args, Debug)]
pub struct ServeCommand {
    #[command(flatten)]
    pub provider: Box<ProviderArgs>,
    #[command(flatten)]
    pub ingest: Box<IngestArgs>,
    #[command(flatten)]
    pub retry: Box<RetryArgs>,
    #[command(flatten)]
    pub serve: ServeArgs,
    /// `[source]`: ingest from Redis Stream(s) too (docs/sources.md).
    #[command(flatten)]
    pub source: SourceArgs,
    /// Also follow this Postgres table source (`source add-table`; repeatable, at most 16):
    /// its snapshot, then its changes, into every live revision of its target. While
    /// another process follows it, this one stands by (docs/table-source.md).
    #[arg(long = "follow-table", value_name = "NAME")]
    pub follow_table: Vec<String>,
    /// Also serve the operator console here (e.g. 127.0.0.1:8088); see `console --help`.
    #[arg(long)]
    pub console_addr: Option<SocketAddr>,
    /// With --console-addr: the console hides and refuses every action.
    #[arg(long, requires = "console_addr")]
    pub console_read_only: bool,
    /// With --console-addr beyond loopback: serve the pages without a login (see `console
    /// --public-read`).
    #[arg(long, requires = "console_addr")]
    pub console_public_read: bool,
    /// With --console-addr: whether the session cookie is `Secure` (see `console
    /// --cookie-secure`).
    #[arg(long, value_enum, default_value_t, requires = "console_addr")]
    pub console_cookie_secure: embed_dlq::console::CookieSecure,
}

/// The arguments of `console`.
#[derive(clap::Args, Debug)]
pub struct ConsoleCommand {
    /// Address to listen on: loopback by default; any other address belongs behind TLS.
    #[arg(long, default_value = embed_dlq::console::DEFAULT_LISTEN)]
    pub listen: SocketAddr,
    /// Hide and refuse every action (requeue, purge, reconcile runs; a login only serves
    /// reading, where reading needs one).
    #[arg(long)]
    pub read_only: bool,
    /// Beyond loopback, serve every page without a login (by default only the login page
    /// answers there: rows hold customer text). On loopback pages need no login anyway.
    #[arg(long)]
    pub public_read: bool,
    /// Whether the session cookie is `Secure` (sent back over HTTPS only): `auto` beyond
    /// loopback, where the console belongs behind TLS; `always`; `never` (plain HTTP beyond
    /// loopback: the token and the session travel in clear).
    #[arg(long, value_enum, default_value_t)]
    pub cookie_secure: embed_dlq::console::CookieSecure,
    /// Rows a second a console requeue publishes, 1..=100000.
    #[arg(long, default_value_t = embed_dlq::console::DEFAULT_REQUEUE_RATE,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub requeue_rate: u32,
    /// Live-event (SSE) clients served at once, 1..=64.
    #[arg(long, default_value_t = embed_dlq::console::DEFAULT_EVENT_CLIENTS as u64,
          value_parser = clap::value_parser!(u64).range(1..=64))]
    pub max_event_clients: u64,
    /// Row pages and text downloads served at once, 1..=64; more are answered 503 with
    /// Retry-After (a row's payload may be megabytes).
    #[arg(long, default_value_t = embed_dlq::console::DEFAULT_ROW_VIEWS as u64,
          value_parser = clap::value_parser!(u64).range(1..=64))]
    pub max_row_views: u64,
    /// Time limit of every page but the live tail and a reconcile run (a slow database shows
    /// a 503 instead of hanging the browser), 1..=600 s.
    #[arg(long, default_value_t = embed_dlq::console::DEFAULT_PAGE_TIMEOUT.as_secs(),
          value_parser = clap::value_parser!(u64).range(embed_dlq::console::PAGE_TIMEOUT_SECS))]
    pub page_timeout_secs: u64,
    /// Newest events scanned for a row's events on its page, 100..=100000.
    #[arg(long, default_value_t = embed_dlq::console::DEFAULT_EVENTS_SCAN as u64,
          value_parser = clap::value_parser!(u64).range(100..=100_000))]
    pub events_scan: u64,
    /// Prometheus endpoint of an ingest or serve process whose breaker state the overview
    /// shows (repeatable, at most 8).
    #[arg(long = "metrics-url")]
    pub metrics_urls: Vec<String>,
    /// Host name the console answers to besides IP addresses and localhost (repeatable, at
    /// most 16), e.g. a reverse proxy's.
    #[arg(long = "allow-host")]
    pub allowed_hosts: Vec<String>,
    /// Target vector table (else `[ingest] table` of the config file).
    #[arg(long)]
    pub table: Option<String>,
    /// Key prefix of the streams (else `[serve] stream_prefix` of the config file).
    #[arg(long, env = "EMBED_DLQ_STREAM_PREFIX")]
    pub stream_prefix: Option<String>,
}

/// The arguments of `tail`.
#[derive(clap::Args, Debug)]
pub struct TailCommand {
    /// Where to start: `$` (new events only), `0` (everything kept) or an entry id.
    #[arg(long, default_value = "$")]
    pub from: String,
    /// When entries after the resume point were trimmed from the stream: `warn` (a line on
    /// stderr, then go on with the oldest entry kept) or `fail` (the line, then exit 6 with
    /// nothing printed past the gap and the checkpoint unmoved).
    #[arg(long, value_enum, default_value_t = embed_dlq::tail::OnGap::Warn)]
    pub on_gap: embed_dlq::tail::OnGap,
    /// One JSON object per event.
    #[arg(long)]
    pub json: bool,
    /// Resume from this file and save the last printed id to it.
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// Exit after this many events (at least 1).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub count: Option<u64>,
    /// Exit once caught up.
    #[arg(long)]
    pub no_follow: bool,
    /// Key prefix of the streams (else `[serve] stream_prefix` of the config file).
    #[arg(long, env = "EMBED_DLQ_STREAM_PREFIX")]
    pub stream_prefix: Option<String>,
    /// Shards of the streams (else `[serve] stream_shards` of the config file).
    #[arg(long, env = "EMBED_DLQ_STREAM_SHARDS")]
    pub stream_shards: Option<u16>,
}

/// The arguments of `reconcile`.
#[derive(clap::Args, Debug)]
pub struct ReconcileCommand {
    /// Fix what can be fixed safely.
    #[arg(long)]
    pub repair: bool,
    /// With --repair: show what would be done, change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Run periodically, every this many seconds (a long-running job), 1..=604800.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=604_800))]
    pub every_secs: Option<u64>,
    /// Every run is a full sweep: every chunk, vectors' contents only of changed chunks
    /// (default: incremental, with full and deep sweeps on schedule).
    #[arg(long, conflicts_with = "deep")]
    pub full: bool,
    /// Every run is a deep sweep: a full one that also reads every vector.
    #[arg(long)]
    pub deep: bool,
    /// Without --full/--deep, a run is a full sweep when none finished within this many
    /// seconds; 0 = every run.
    #[arg(long = "full-every-secs", id = "reconcile_full_every_secs")]
    pub full_every_secs: Option<u64>,
    /// Without --full/--deep, a run is a deep sweep when none finished within this many
    /// seconds; 0 = never.
    #[arg(long = "deep-every-secs", id = "reconcile_deep_every_secs")]
    pub deep_every_secs: Option<u64>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Serve Prometheus metrics here while running (e.g. 127.0.0.1:9465).
    #[arg(long)]
    pub metrics_addr: Option<SocketAddr>,
    /// Target vector table (else `[ingest] table` of the config file).
    #[arg(long)]
    pub table: Option<String>,
    /// The policy the ingests follow (else `[ingest] on_newer_parked` of the config file,
    /// default withdraw): under keep, vectors of parked chunks' previous text are expected
    /// (noted, never repaired); under withdraw they are findings that --repair withdraws.
    #[arg(long, value_enum)]
    pub on_newer_parked: Option<embed_dlq::store::park::OnNewerParked>,
    /// Key prefix of the streams (else `[serve] stream_prefix` of the config file).
    #[arg(long, env = "EMBED_DLQ_STREAM_PREFIX")]
    pub stream_prefix: Option<String>,
    /// Shards of the streams (else `[serve] stream_shards` of the config file).
    #[arg(long, env = "EMBED_DLQ_STREAM_SHARDS")]
    pub stream_shards: Option<u16>,
}

/// The arguments of `dlq`.
#[derive(clap::Args, Debug)]
pub struct DlqCommand {
    #[command(subcommand)]
    pub action: DlqAction,
    /// JSON output.
    #[arg(long, global = true)]
    pub json: bool,
    /// Target vector table (else `[ingest] table` of the config file).
    #[arg(long, global = true)]
    pub table: Option<String>,
}

/// The arguments of `revision`.
#[derive(clap::Args, Debug)]
pub struct RevisionCommand {
    #[command(subcommand)]
    pub action: RevisionAction,
    /// JSON output.
    #[arg(long, global = true)]
    pub json: bool,
}

/// `revision` actions.
#[derive(Subcommand, Debug)]
pub enum RevisionAction {
    /// Every revision of every target (or of `--target`): state, model, dimensions, relation,
    /// and how much of the active revision each other one covers.
    List {
        /// The target (the name users query).
        #[arg(long, alias = "table")]
        target: Option<String>,
    },
    /// Make a shadow revision for a new model: its own table `<target>__r<n>` beside the
    /// active one, written by every corpus ingest of the target from now on. A target that
    /// is still a plain table becomes revision 1 first (renamed to `<target>__r1`, its name a
    /// view over the active revision).
    Create {
        /// The target (the name users query; default: the configured table).
        #[arg(long, alias = "table")]
        target: Option<String>,
        /// The new revision's model.
        #[arg(long)]
        model: String,
        /// Its vectors' dimension, 1..=16000.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=16_000))]
        dimensions: u64,
        /// The `dimensions` request parameter to send for it (models that shorten their
        /// vectors on request).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=16_000))]
        request_dimensions: Option<u64>,
        /// The model the target's existing vectors were made with, recorded for revision 1
        /// when the target is adopted (default: none recorded, so each ingest embeds
        /// revision 1 with its own configured model, as before: a wrong name here would
        /// re-embed every chunk of it).
        #[arg(long)]
        active_model: Option<String>,
    },
    /// Fill the shadow revisions from a corpus (INPUT, or a table source's table with
    /// `--from-table NAME`): each chunk is copied into every live revision but the active
    /// one, with its model, where the active revision holds that very text; this also
    /// records the text hashes of chunks written before they existed. Resumable: a rerun
    /// embeds only what is missing. Takes the flags of `ingest`.
    Backfill(Box<IngestCommand>),
    /// Switch the target's name to a revision, in one transaction, if it covers the active
    /// one (the same chunks, each of the same text, stored); exits 2 with the numbers if not.
    Activate {
        /// The target (default: the configured table).
        #[arg(long, alias = "table")]
        target: Option<String>,
        /// The revision to switch to.
        #[arg(long, required_unless_present = "previous", conflicts_with = "previous")]
        revision: Option<i32>,
        /// Switch back to the previous revision (a rollback).
        #[arg(long)]
        previous: bool,
        /// Switch even though this many chunks are not covered, 0..=10^12.
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1_000_000_000_000))]
        allow_missing: u64,
        /// Under live writes: when the first check finds only work in flight uncovered (at
        /// most 10,000 chunks), pause every stream source's intake and check again for up to
        /// this many seconds, 0..=600 (0: one check).
        #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(0..=600))]
        wait_secs: u64,
    },
    /// Retire a revision that is not active: drop its table and delete its manifest and DLQ
    /// rows; writes stop reaching it. Needs `--yes`.
    Retire {
        /// The target (default: the configured table).
        #[arg(long, alias = "table")]
        target: Option<String>,
        /// The revision to retire.
        #[arg(long)]
        revision: i32,
        /// Confirm: the revision's vectors are dropped for good.
        #[arg(long)]
        yes: bool,
    },
}

/// The arguments of `mock-provider`.
#[derive(clap::Args, Debug)]
pub struct MockProviderCommand {
    /// Address to listen on.
    #[arg(long, default_value = embed_dlq::config::DEFAULT_MOCK_ADDR)]
    pub listen: SocketAddr,
    /// Faults and account limits as JSON, e.g. '{"rate_429":0.05}' (--help lists the keys).
    #[arg(long, default_value = "{}")]
    pub settings: String,
    /// Requests per minute of the mock account (beyond it: 429 with Retry-After and
    /// x-ratelimit-* headers), 1..=10000000000; overrides `rpm_limit` of --settings.
    #[arg(long)]
    pub rpm_limit: Option<u64>,
    /// Tokens per minute of the mock account (characters / 4), 1..=10000000000; overrides
    /// `tpm_limit` of --settings.
    #[arg(long)]
    pub tpm_limit: Option<u64>,
}

/// The arguments of `demo`.
#[derive(clap::Args, Debug)]
pub struct DemoCommand {
    /// Chunks in the generated corpus, 1..=10000000.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    pub chunks: u64,
    /// Concurrent provider requests, 1..=256.
    #[arg(
        long,
        default_value_t = embed_dlq::ingest::IngestOptions::default().concurrency as u64,
        value_parser = clap::value_parser!(u64).range(1..=256)
    )]
    pub concurrency: u64,
    /// Print the summaries as JSON.
    #[arg(long)]
    pub json: bool,
    /// Key prefix of the streams (else `[serve] stream_prefix` of the config file).
    #[arg(long, env = "EMBED_DLQ_STREAM_PREFIX")]
    pub stream_prefix: Option<String>,
    /// The shell line that sets the services' environment, shown first among the commands to
    /// try next (`scripts/demo.sh` passes `eval "$(scripts/services.sh up)"`).
    #[arg(long, hide = true)]
    pub setup_hint: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn help_shows_the_resolved_defaults() {
        let mut cmd = Cli::command_with_defaults();
        let ingest = cmd.find_subcommand_mut("ingest").unwrap().render_long_help().to_string();
        let concurrency = embed_dlq::ingest::IngestOptions::default().concurrency;
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

    /// A setting's bound is written once, by the resolver: no flag of any command, however
    /// deep, says its range in its own words as well (`--full-every-secs` once showed
    /// "0..=2592000 [range: 0..=2592000]").
    #[test]
    fn no_help_restates_the_bound_it_is_given() {
        fn walk(cmd: &clap::Command, path: &str, restated: &mut Vec<String>) {
            for arg in cmd.get_arguments() {
                let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
                if let Some((own, _)) = help.split_once(" [range: ")
                    && own.contains("..=")
                {
                    restated.push(format!("{path} --{}: {help}", arg.get_id()));
                }
            }
            for sub in cmd.get_subcommands() {
                walk(sub, &format!("{path} {}", sub.get_name()), restated);
            }
        }
        let mut restated = Vec::new();
        walk(&Cli::command_with_defaults(), "embed-dlq", &mut restated);
        assert!(restated.is_empty(), "{restated:#?}");
    }
}
