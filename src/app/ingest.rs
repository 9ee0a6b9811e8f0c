//! `ingest`: opens the input, runs the pipeline, prints the summary and maps it to an exit
//! code.

use embed_dlq::config::{FileConfig, IngestSettings};
use embed_dlq::ingest::IngestError;
use tokio_util::sync::CancellationToken;

use super::args::IngestCommand;
use super::render::print_summary;
use super::{Resolver, exit};

/// Runs `ingest`; returns the exit code.
pub async fn command(resolver: &Resolver, args: IngestCommand, cancel: CancellationToken) -> i32 {
    command_as(resolver, args, Run::Ingest, cancel).await
}

/// What a corpus run of [`command_as`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Run {
    /// `ingest`: every live revision, the corpus being what the source holds now.
    Ingest,
    /// `revision backfill`: the revisions besides the active one, copying what it holds.
    Backfill,
}

/// `ingest` (or, as `run` says, `revision backfill`) with `args`.
pub async fn command_as(
    resolver: &Resolver,
    args: IngestCommand,
    kind: Run,
    cancel: CancellationToken,
) -> i32 {
    let IngestCommand {
        input,
        provider,
        ingest,
        retry,
        json,
        no_progress,
        metrics_addr,
        yes,
        dry_run,
        source,
        idle_exit_ms,
        from_table,
    } = args;
    // A stream source only with --from-stream: a `[source]` in the config file is `serve`'s.
    let from_stream = !source.streams.is_empty();
    if let Some(name) = from_table {
        if from_stream || input != "-" {
            return exit::fail(exit::USAGE, "--from-table reads the table: no input file, no --from-stream");
        }
        let flags = FileConfig { provider: *provider, ingest: *ingest, retry: *retry, ..Default::default() };
        if kind == Run::Backfill {
            if dry_run || idle_exit_ms.is_some() {
                return exit::fail(exit::USAGE, "--dry-run and --idle-exit-ms do not go with a backfill");
            }
            return backfill_table(resolver, flags, &name, json, cancel).await;
        }
        return run_table(resolver, flags, &name, idle_exit_ms, yes, json, metrics_addr, cancel).await;
    }
    if from_stream && input != "-" {
        return exit::fail(exit::USAGE, "give either an input file or --from-stream, not both");
    }
    if from_stream && (dry_run || yes) {
        return exit::fail(
            exit::USAGE,
            "--dry-run and --yes go with a corpus run's cleanup, not --from-stream",
        );
    }
    if !from_stream && idle_exit_ms.is_some() {
        return exit::fail(exit::USAGE, "--idle-exit-ms goes with --from-stream");
    }
    let flags =
        FileConfig { provider: *provider, ingest: *ingest, retry: *retry, source, ..Default::default() };
    let settings = match resolver.settings(flags) {
        Ok(s) => {
            super::warn_missing_api_key(&s);
            s
        }
        Err(e) => return exit::usage(&e),
    };
    let source = settings.source.clone();
    let mut settings = match settings.ingest() {
        Ok(s) => s,
        Err(e) => return exit::usage(&e),
    };
    settings.options.cleanup.confirmed = yes;
    settings.options.cleanup.dry_run = dry_run;
    if kind == Run::Backfill
        && (settings.options.cleanup.mode != embed_dlq::ingest::CleanupMode::None || dry_run)
    {
        return exit::fail(
            exit::USAGE,
            "--cleanup and --dry-run go with an ingest: a backfill only copies what the active revision holds (deletions reach the shadow through the ingests that write every revision)",
        );
    }
    if let Some(addr) = metrics_addr
        && let Err(e) = embed_dlq::metrics::install(addr)
    {
        return exit::fail(exit::FAILURE, &e.to_string());
    }
    if let Some(mut opts) = source.filter(|_| from_stream) {
        if settings.options.cleanup.mode != embed_dlq::ingest::CleanupMode::None {
            return exit::fail(
                exit::USAGE,
                "--cleanup applies to a corpus run: a stream source has no end to clean up after",
            );
        }
        if let Some(ms) = idle_exit_ms {
            if ms > 86_400_000 {
                return exit::fail(exit::USAGE, &format!("--idle-exit-ms {ms} is out of range 0..=86400000"));
            }
            opts.idle_exit = Some(std::time::Duration::from_millis(ms));
        }
        return run_source(settings, opts, json, cancel).await;
    }
    run(settings, &input, kind, json, !no_progress, cancel).await
}

/// The table source `name`, read from the database the flags name; `Err` holds the exit code
/// (reported).
async fn load_table_source(
    resolver: &Resolver,
    name: &str,
) -> Result<embed_dlq::store::table_source::TableSource, i32> {
    let Ok((_, url)) = resolver.with_database(FileConfig::default()) else {
        return Err(exit::fail(
            exit::USAGE,
            "--from-table needs the database: set DATABASE_URL or --database-url",
        ));
    };
    let pool =
        embed_dlq::store::connect(&url, 1).await.map_err(|e| exit::fail(exit::FAILURE, &e.to_string()))?;
    let source = embed_dlq::store::table_source::load(&pool, name).await;
    pool.close().await;
    source.map_err(|e| exit::fail(exit::USAGE, &e.to_string()))
}

/// `revision backfill --from-table NAME`: the source table's rows, in key order, copied into
/// every live revision of its target but the active one, as a corpus backfill copies a
/// corpus (each row only where the active revision holds that very text). Reading the table
/// is checked at the end: a read that failed part way is exit 1, since what follows it was
/// never offered (a rerun skips what was copied).
async fn backfill_table(
    resolver: &Resolver,
    mut flags: FileConfig,
    name: &str,
    json: bool,
    cancel: CancellationToken,
) -> i32 {
    let source = match load_table_source(resolver, name).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    flags.ingest.table = Some(source.target_table.clone());
    let mut settings = match resolver.settings(flags).and_then(|s| {
        super::warn_missing_api_key(&s);
        s.ingest()
    }) {
        Ok(s) => s,
        Err(e) => return exit::usage(&e),
    };
    if settings.options.cleanup.mode != embed_dlq::ingest::CleanupMode::None {
        return exit::fail(exit::USAGE, "--cleanup goes with an ingest, not a backfill");
    }
    {
        use std::io::IsTerminal;
        settings.options.progress &= !json && std::io::stderr().is_terminal();
    }
    let fanout = match settings.backfill().await {
        Ok(Some(fanout)) => fanout,
        Ok(None) => {
            return exit::fail(
                exit::USAGE,
                &format!("{} has no revision to backfill besides the active one", settings.table),
            );
        }
        Err(e) => return exit::fail(exit::FAILURE, &e.to_string()),
    };
    let pool = fanout.revisions[0].1.store.pool().clone();
    tracing::info!(source = name, table = %source.table, target = %source.target_table, "backfilling from a table source");
    let (rows, reading) = embed_dlq::ingest::table::table_as_jsonl(pool, source);
    let reader = Box::new(tokio::io::BufReader::with_capacity(256 * 1024, rows));
    let code = run_revisions(fanout, reader, json, false, cancel).await;
    match reading.await {
        Ok(Ok(_)) => code,
        Ok(Err(e)) => exit::fail(
            exit::FAILURE,
            &format!(
                "reading table source {name} failed part way ({e}); rerun the backfill: what it copied is skipped"
            ),
        ),
        Err(e) => exit::fail(exit::FAILURE, &format!("reading table source {name} stopped: {e}")),
    }
}

/// Follows table source `name` until stopped (or idle, with `--idle-exit-ms`).
#[allow(clippy::too_many_arguments)]
async fn run_table(
    resolver: &Resolver,
    mut flags: FileConfig,
    name: &str,
    idle_exit_ms: Option<u64>,
    yes: bool,
    json: bool,
    metrics_addr: Option<std::net::SocketAddr>,
    cancel: CancellationToken,
) -> i32 {
    if idle_exit_ms.is_some_and(|ms| ms > 86_400_000) {
        return exit::fail(exit::USAGE, "--idle-exit-ms is out of range 0..=86400000");
    }
    let source = match load_table_source(resolver, name).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    flags.ingest.table = Some(source.target_table.clone());
    let settings = match resolver.settings(flags).and_then(|s| {
        super::warn_missing_api_key(&s);
        s.ingest()
    }) {
        Ok(s) => s,
        Err(e) => return exit::usage(&e),
    };
    if settings.options.cleanup.mode != embed_dlq::ingest::CleanupMode::None {
        return exit::fail(
            exit::USAGE,
            "--cleanup goes with a corpus run: a table source deletes what its table deletes",
        );
    }
    if let Some(addr) = metrics_addr
        && let Err(e) = embed_dlq::metrics::install(addr)
    {
        return exit::fail(exit::FAILURE, &e.to_string());
    }
    let mut settings = settings;
    settings.options.progress = false;
    // Every live revision of the target, looked up for each segment.
    let targets = settings.source_targets();
    let options = embed_dlq::ingest::table::FollowOptions {
        idle_exit: idle_exit_ms.map(std::time::Duration::from_millis),
        confirmed: yes,
        ..Default::default()
    };
    tracing::info!(source = name, table = %source.table, target = %source.target_table, "following a table source");
    match embed_dlq::ingest::table::follow_table(&targets, &source, options, cancel.clone()).await {
        Ok(done) => {
            if json {
                println!("{}", serde_json::to_string(&done).unwrap_or_default());
            } else {
                println!(
                    "table source {name}: {} snapshot(s), {} changes applied in {} segment(s), {} left queued",
                    done.snapshots, done.changes_applied, done.segments, done.changes_retried
                );
                print_summary(&done.ingest, false);
            }
            if cancel.is_cancelled() { exit::INTERRUPTED } else { exit::OK }
        }
        Err(IngestError::CleanupRefused { reason, summary }) => {
            print_summary(&summary, json);
            exit::fail(
                exit::USAGE,
                &format!("{reason} (the table was truncated: rerun with --yes to resync it)"),
            )
        }
        Err(IngestError::Provider { stop, summary }) => {
            print_summary(&summary, json);
            exit::fail(
                exit::PROVIDER_STOP,
                &format!("{stop}. Nothing was parked for this; the changes stay queued."),
            )
        }
        Err(e) => exit::fail(exit::FAILURE, &e.to_string()),
    }
}

/// Ingests from Redis Stream(s) until stopped (or drained, with `--idle-exit-ms`).
async fn run_source(
    settings: IngestSettings,
    opts: embed_dlq::ingest::source::SourceOptions,
    json: bool,
    cancel: CancellationToken,
) -> i32 {
    let Some(url) = settings.redis_url.as_deref() else {
        return exit::fail(
            exit::USAGE,
            "--from-stream needs Redis: set REDIS_URL, --redis-url or [services] redis_url",
        );
    };
    let client = match embed_dlq::streams::open(url, settings.redis_cluster) {
        Ok(c) => c,
        Err(e) => return exit::fail(exit::USAGE, &format!("redis_url cannot be used: {}", e.category())),
    };
    tracing::info!(streams = ?opts.streams, group = %opts.group, consumer = %opts.consumer, "ingesting from a stream source");
    let targets = std::sync::Arc::new(settings.source_targets());
    match embed_dlq::ingest::source::run_source_into(targets, &client, opts, cancel.clone()).await {
        Ok(runs) => {
            print_source_runs(&runs, json);
            // What was left (to a stop, or to another run's lease) stays pending in the
            // group and is finished by the source, not by a rerun: no exit 7 here. A revision
            // that stopped missed writes: its coverage shows them, a backfill writes them.
            if cancel.is_cancelled() {
                exit::INTERRUPTED
            } else if let Some(stopped) = runs.iter().find(|r| r.stopped.is_some()) {
                let r = stopped.revision.as_ref().map_or(0, |r| r.revision);
                exit::fail(
                    exit::FAILURE,
                    &format!(
                        "revision {r}'s writes stopped ({}); the source went on without it: backfill it before activating it",
                        stopped.stopped.as_deref().unwrap_or_default()
                    ),
                )
            } else {
                exit::OK
            }
        }
        Err(IngestError::Provider { stop, summary }) => {
            print_summary(&summary, json);
            exit::fail(
                exit::PROVIDER_STOP,
                &format!("{stop}. Nothing was parked for this; its entries stay pending in the group."),
            )
        }
        Err(e) => exit::fail(exit::FAILURE, &e.to_string()),
    }
}

/// Prints a stream source's summary: the table's alone, or each revision's under a line
/// naming it (with `--json`: the active revision's summary, every revision's under
/// `revisions`, as a corpus fan-out prints them).
fn print_source_runs(runs: &[embed_dlq::ingest::source::SourceRevisionRun], json: bool) {
    if let [only] = runs
        && only.revision.is_none()
    {
        print_summary(&only.summary, json);
        return;
    }
    if json {
        let all: Vec<serde_json::Value> = runs
            .iter()
            .map(|run| {
                let mut v = revision_json(run.revision.as_ref());
                v["summary"] = serde_json::to_value(&run.summary).expect("summary serializes");
                if let Some(why) = &run.stopped {
                    v["error"] = serde_json::Value::String(why.clone());
                }
                v
            })
            .collect();
        let mut head = runs
            .first()
            .map(|r| serde_json::to_value(&r.summary).expect("summary serializes"))
            .unwrap_or_else(|| serde_json::json!({}));
        head["revisions"] = serde_json::Value::Array(all);
        println!("{head}");
        return;
    }
    for run in runs {
        if let Some(r) = &run.revision {
            println!("{}", revision_heading(r));
        }
        print_summary(&run.summary, false);
        if let Some(why) = &run.stopped {
            println!("  stopped in a segment: {why}");
        }
    }
}

/// The fields that name a revision in a `--json` summary.
fn revision_json(r: Option<&embed_dlq::store::revision::Revision>) -> serde_json::Value {
    match r {
        Some(r) => serde_json::json!({"revision": r.revision, "relation": r.relation, "identity": r.identity,
                                      "model": r.model, "state": r.state}),
        None => serde_json::json!({}),
    }
}

/// The line above a revision's summary.
fn revision_heading(r: &embed_dlq::store::revision::Revision) -> String {
    format!(
        "revision {} of {} ({}, {}, model {}):",
        r.revision,
        r.target,
        r.state,
        r.relation,
        r.model.as_deref().unwrap_or("as configured")
    )
}

/// Ingests `input` (a path, or `-` for stdin).
async fn run(
    mut settings: IngestSettings,
    input: &str,
    kind: Run,
    json: bool,
    progress: bool,
    cancel: CancellationToken,
) -> i32 {
    use std::io::IsTerminal;
    settings.options.progress = progress && !json && std::io::stderr().is_terminal();
    let dry_run = settings.options.cleanup.dry_run;
    let reader: Box<dyn tokio::io::AsyncBufRead + Unpin + Send> = if input == "-" {
        Box::new(tokio::io::BufReader::with_capacity(256 * 1024, tokio::io::stdin()))
    } else {
        match tokio::fs::File::open(input).await {
            Ok(f) => {
                settings.options.total_bytes = f.metadata().await.ok().map(|m| m.len());
                Box::new(tokio::io::BufReader::with_capacity(256 * 1024, f))
            }
            Err(e) => return exit::fail(exit::FAILURE, &format!("cannot open {input}: {e}")),
        }
    };
    let fanout = match kind {
        Run::Ingest => settings.fanout().await,
        Run::Backfill => settings.backfill().await,
    };
    match fanout {
        Ok(Some(fanout)) => return run_revisions(fanout, reader, json, dry_run, cancel).await,
        Ok(None) if kind == Run::Backfill => {
            return exit::fail(
                exit::USAGE,
                &format!("{} has no revision to backfill besides the active one", settings.table),
            );
        }
        Ok(None) => {}
        Err(e) => return exit::fail(exit::FAILURE, &e.to_string()),
    }
    // A target whose one live revision is not revision 1 writes it, with its model.
    let settings = match settings.aimed_at_live_revision().await {
        Ok(s) => s,
        Err(e) => return exit::fail(exit::FAILURE, &e.to_string()),
    };
    let pipeline = match settings.pipeline().await {
        Ok(p) => p,
        Err(e) => return exit::fail(exit::FAILURE, &e.to_string()),
    };
    let result = pipeline.run(reader, cancel.clone()).await;
    outcome(result, json, dry_run, &cancel)
}

/// Ingests `reader` into every live revision of its target (the active one, shadows, the
/// previous one): each revision's summary, under a line naming it (with `--json`, one object:
/// the active revision's summary with every revision's under `revisions`); the exit code is
/// the first revision's (in that order) that is not 0: an ingest that left a revision behind
/// did not finish.
async fn run_revisions(
    fanout: embed_dlq::ingest::Fanout,
    reader: Box<dyn tokio::io::AsyncBufRead + Unpin + Send>,
    json: bool,
    dry_run: bool,
    cancel: CancellationToken,
) -> i32 {
    let runs = fanout.run(reader, cancel.clone()).await;
    if json {
        let mut all = Vec::new();
        for run in &runs {
            let mut v = revision_json(Some(&run.revision));
            match &run.result {
                Ok(summary) => v["summary"] = serde_json::to_value(summary).expect("summary serializes"),
                Err(e) => v["error"] = serde_json::Value::String(e.to_string()),
            }
            all.push(v);
        }
        let mut head = match runs.first().map(|r| &r.result) {
            Some(Ok(summary)) => serde_json::to_value(summary).expect("summary serializes"),
            _ => serde_json::json!({}),
        };
        head["revisions"] = serde_json::Value::Array(all);
        println!("{head}");
    }
    let mut code = exit::OK;
    for run in runs {
        if !json {
            println!("{}", revision_heading(&run.revision));
        }
        let this = outcome_printed(run.result, (!json).then_some(false), dry_run, &cancel);
        if code == exit::OK {
            code = this;
        }
    }
    code
}

/// Prints a run's summary and maps its result to an exit code.
fn outcome(
    result: Result<embed_dlq::ingest::IngestSummary, IngestError>,
    json: bool,
    dry_run: bool,
    cancel: &CancellationToken,
) -> i32 {
    outcome_printed(result, Some(json), dry_run, cancel)
}

/// [`outcome`], printing the summary as `print` says (`Some(json)`), or not at all (`None`:
/// a fan-out run's `--json` object already holds it).
fn outcome_printed(
    result: Result<embed_dlq::ingest::IngestSummary, IngestError>,
    print: Option<bool>,
    dry_run: bool,
    cancel: &CancellationToken,
) -> i32 {
    let show = |s: &embed_dlq::ingest::IngestSummary| {
        if let Some(json) = print {
            print_summary(s, json);
        }
    };
    match result {
        Ok(summary) if dry_run => {
            show(&summary);
            if cancel.is_cancelled() { exit::INTERRUPTED } else { exit::OK }
        }
        Ok(summary) => {
            show(&summary);
            exit::summary_exit_code(&summary, cancel.is_cancelled())
        }
        Err(IngestError::CleanupRefused { reason, summary }) => {
            show(&summary);
            exit::fail(exit::USAGE, &reason)
        }
        Err(IngestError::Provider { stop, summary }) => {
            show(&summary);
            exit::fail(
                exit::PROVIDER_STOP,
                &format!("{stop}. Nothing was parked for this; fix it and rerun the same corpus."),
            )
        }
        Err(e) => exit::fail(exit::FAILURE, &e.to_string()),
    }
}
