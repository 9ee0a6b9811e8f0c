//! `reconcile`: connects to Postgres (and Redis if configured), runs the checks once or
//! periodically, prints every report and maps the last one to an exit code.

use std::net::SocketAddr;
use std::time::Duration;

use embed_dlq::config::{FileConfig, IngestArgs, ServeArgs};
use embed_dlq::reconcile::{Mode, ReconcileConfig, ReconcileError, Reconciler, Sweep, SweepPolicy};
use embed_dlq::store::park::OnNewerParked;
use embed_dlq::store::prefix::PrefixError;
use embed_dlq::streams::{RedisClient, ShardsError, StreamKeys};
use tokio_util::sync::CancellationToken;

use super::args::ReconcileCommand;
use super::render::print_report;
use super::{Resolver, exit};

/// Runs `reconcile`; returns the exit code.
pub async fn command(resolver: &Resolver, args: ReconcileCommand, cancel: CancellationToken) -> i32 {
    let ReconcileCommand {
        repair,
        dry_run,
        every_secs,
        full,
        deep,
        full_every_secs,
        deep_every_secs,
        json,
        metrics_addr,
        table,
        on_newer_parked,
        stream_prefix,
        stream_shards,
    } = args;
    let flags = FileConfig {
        ingest: IngestArgs { table, on_newer_parked, ..Default::default() },
        serve: ServeArgs {
            stream_prefix,
            stream_shards,
            reconcile_full_every_secs: full_every_secs,
            reconcile_deep_every_secs: deep_every_secs,
            ..Default::default()
        },
        ..Default::default()
    };
    let (settings, url) = match resolver.with_database(flags) {
        Ok(r) => r,
        Err(e) => return exit::usage(&e),
    };
    let mode = match (repair, dry_run) {
        (true, true) => Mode::DryRun,
        (true, false) => Mode::Repair,
        (false, _) => Mode::Check,
    };
    let sweeps = match (full, deep) {
        (_, true) => SweepPolicy::Always(Sweep::Deep),
        (true, false) => SweepPolicy::Always(Sweep::Full),
        (false, false) => settings.serve.reconcile_sweeps,
    };
    let run = ReconcileRun {
        database_url: &url,
        redis: match settings.redis_url.is_some().then(|| settings.redis_client()).transpose() {
            Ok(r) => r,
            Err(e) => return exit::usage(&e),
        },
        table: &settings.table,
        on_newer_parked: settings.options.on_newer_parked,
        keys: settings.stream_keys(),
        mode,
        sweeps,
        config: settings.reconcile_config(),
        every: every_secs.map(Duration::from_secs),
        json,
        metrics_addr,
    };
    reconcile(run, cancel).await
}

/// Where and how to reconcile.
struct ReconcileRun<'a> {
    /// The Postgres that holds manifest, vectors, DLQ and outbox.
    database_url: &'a str,
    /// Without Redis, the checks that compare with the streams are skipped.
    redis: Option<RedisClient>,
    /// The target vector table.
    table: &'a str,
    /// What the ingests do to a parked chunk's previous vector: what `superseded_vectors`
    /// expects.
    on_newer_parked: OnNewerParked,
    /// The streams (prefix and shards).
    keys: StreamKeys,
    /// Check, repair, or show what a repair would do.
    mode: Mode,
    /// How each run picks its sweep.
    sweeps: SweepPolicy,
    /// The settings' reconciler configuration (the events stream cap of `[serve]
    /// events_maxlen` among them); `sweeps` replaces its sweep policy.
    config: ReconcileConfig,
    /// Run every this often until a signal; `None` runs once.
    every: Option<Duration>,
    /// Each report as one JSON object instead of a table.
    json: bool,
    /// Serve Prometheus metrics here while running.
    metrics_addr: Option<SocketAddr>,
}

/// Runs the reconciler; returns [`exit::FINDINGS`] if a single run found something, and
/// [`exit::OK`] when a periodic run is stopped by a signal.
async fn reconcile(run: ReconcileRun<'_>, cancel: CancellationToken) -> i32 {
    if let Some(addr) = run.metrics_addr
        && let Err(e) = embed_dlq::metrics::install(addr)
    {
        return exit::fail(exit::FAILURE, &e.to_string());
    }
    let store = match super::open_store(run.database_url, 4, run.table).await {
        Ok(s) => s.with_on_newer_parked(run.on_newer_parked),
        Err(e) => return exit::fail(exit::FAILURE, &e.to_string()),
    };
    let redis = match &run.redis {
        Some(client) => match client.managed().await {
            Ok(m) => Some(m),
            Err(e) => return exit::fail(exit::FAILURE, &format!("cannot connect to Redis: {e}")),
        },
        None => None,
    };
    let config = ReconcileConfig { sweeps: run.sweeps, ..run.config };
    let mut reconciler = Reconciler { store, redis, keys: run.keys, config };
    let mut code = exit::OK;
    let json = run.json;
    let on_run = |outcome: Result<_, _>| {
        code = match outcome {
            Ok(report) => {
                print_report(&report, json);
                if report.total_found() > 0 { exit::FINDINGS } else { exit::OK }
            }
            // Configured with another shard count than the streams have: a usage error.
            Err(
                e @ (ReconcileError::Shards(ShardsError::Mismatch(_))
                | ReconcileError::Prefix(PrefixError::Mismatch(_))),
            ) => exit::fail(exit::USAGE, &e.to_string()),
            Err(e) => exit::fail(exit::FAILURE, &format!("reconcile failed: {e}")),
        }
    };
    embed_dlq::serve::reconcile_periodically(&mut reconciler, run.mode, run.every, on_run, &cancel).await;
    if run.every.is_some() { exit::OK } else { code }
}
