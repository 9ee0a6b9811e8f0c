//! `serve`: relay, scheduler, N replayers, the republisher of events Redis lost, the gauge
//! sampler, the stream source (with a `[source]`, docs/sources.md) and (with `--console-addr`) the operator console under one stop token and one `Supervisor`. Shutdown is two-phase: on the signal every loop stops claiming new work
//! and finishes the batch in hand; after the grace period in-flight retry waits are cut
//! short (attempted items are re-parked, unattempted ones stay pending and are reclaimed by
//! any live replayer after `min_idle`).
//!
//! # Supervision: fail fast, let the process supervisor restart
//!
//! A task that panics, returns an error (a permanent one: transient errors are retried inside
//! the loops) or returns although nobody asked it to stop is logged at ERROR with its name,
//! and the whole process stops the same two-phase way and exits non-zero. It does not restart
//! the task itself: a process with a dead relay or replayer looks healthy while its work
//! silently piles up, and an in-process restart of a task that panicked would repeat the
//! panic with whatever state caused it. systemd (`Restart=on-failure`), Kubernetes or any
//! process supervisor restarts `serve`; the entries a dead replayer held are pending in the
//! consumer group and are taken over after `min_idle`, so nothing is lost.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::config::{IngestSettings, Settings};
use crate::embed::Embedder;
use crate::reconcile::{Mode, ReconcileConfig, ReconcileError, Reconciler, Report, SweepPolicy};
use crate::relay::{Relay, RelayConfig};
use crate::replay::{ReplayConfig, Replayer, Scheduler};
use crate::store::Store;
use crate::streams::{self, StreamKeys};
use crate::supervise::{Supervisor, TaskFailure};

/// Why `serve` stopped other than by a signal.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// Redis was unreachable at start-up.
    #[error("cannot connect to Redis: {0}")]
    Redis(#[source] redis::RedisError),
    /// The streams were set up with another shard count ([`crate::streams::check_shards`]).
    #[error("{0}")]
    Shards(#[source] crate::streams::ShardMismatch),
    /// The database is relayed under another stream prefix ([`crate::store::prefix::check`]).
    #[error("{0}")]
    Prefix(#[source] crate::store::prefix::PrefixMismatch),
    /// Postgres failed while the stream prefix was checked at start-up.
    #[error("postgres: {0}")]
    Store(#[source] crate::store::StoreError),
    /// A task died; the process stopped so its supervisor restarts it.
    #[error("{0}; serve stopped (exit non-zero) so that its process supervisor restarts it")]
    Task(TaskFailure),
}

/// What [`serve`] runs and how; [`ServeConfig::from_settings`] builds it from the resolved
/// settings.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Replayer tasks (0: this process only relays and schedules).
    pub replayers: usize,
    /// Outbox relay tuning.
    pub relay: RelayConfig,
    /// Scheduler and replayer tuning.
    pub replay: ReplayConfig,
    /// The streams the relay publishes to and the replayers read.
    pub keys: StreamKeys,
    /// How long in-flight work may take to finish after the signal.
    pub grace: Duration,
    /// Prefix of this process's consumer names (host and pid by default).
    pub consumer_prefix: String,
    /// Run the reconciler (check only) this often.
    pub reconcile_every: Option<Duration>,
    /// How each periodic reconcile run picks its sweep (incremental, full or deep).
    pub reconcile_sweeps: SweepPolicy,
    /// Sample the DLQ/outbox/stream gauges (when a metrics endpoint is installed).
    pub metrics: bool,
    /// Ingest from Redis Stream(s) too (`[source]`), with the ingest options of
    /// `source_ingest`.
    pub source: Option<crate::ingest::source::SourceOptions>,
    /// The ingest options of the stream source's pipeline (`[ingest]`).
    pub source_ingest: crate::ingest::IngestOptions,
    /// Postgres table sources followed by this process (`serve --follow-table`): set by the
    /// caller, which resolves each source's target (none from the settings alone).
    pub table_followers: Vec<TableFollower>,
}

/// Most table sources one `serve` follows.
pub const MAX_TABLE_FOLLOWERS: usize = 16;

/// A table source `serve` follows (docs/table-source.md), into every live revision of its
/// target.
#[derive(Clone)]
pub struct TableFollower {
    /// The source.
    pub source: crate::store::table_source::TableSource,
    /// What it writes (`IngestSettings::source_targets` of the source's target).
    pub targets: std::sync::Arc<dyn crate::ingest::source::SourceTargets>,
}

impl std::fmt::Debug for TableFollower {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TableFollower").field("source", &self.source.name).finish_non_exhaustive()
    }
}

impl ServeConfig {
    /// `serve`'s runtime configuration from the resolved settings (stream keys from the
    /// stream prefix, the consumer prefix defaulting to host and pid).
    pub fn from_settings(settings: &Settings) -> ServeConfig {
        let serve = &settings.serve;
        ServeConfig {
            reconcile_every: serve.reconcile_every,
            reconcile_sweeps: serve.reconcile_sweeps,
            metrics: serve.metrics_addr.is_some(),
            replayers: serve.replayers,
            relay: serve.relay.clone(),
            replay: serve.replay.clone(),
            keys: settings.stream_keys(),
            grace: serve.grace,
            consumer_prefix: serve.consumer_prefix.clone().unwrap_or_else(default_consumer_prefix),
            source: settings.source.clone(),
            // A stream has no end to clean up after: `[ingest] cleanup` is a corpus run's.
            source_ingest: crate::ingest::IngestOptions {
                cleanup: crate::ingest::CleanupOptions::default(),
                ..settings.options.clone()
            },
            table_followers: Vec::new(),
        }
    }

    /// The ingest settings for `serve`'s pipeline: its pool is sized from `concurrency`, so
    /// it is raised until every replayer, the relay, the scheduler and the sampler get a
    /// connection of their own.
    pub fn pipeline_settings(&self, mut ingest: IngestSettings) -> IngestSettings {
        ingest.options.concurrency = ingest.options.concurrency.max(self.replayers + 3);
        ingest
    }
}

/// A consumer name unique to this process.
pub(crate) fn default_consumer_prefix() -> String {
    let host = std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "host".into());
    format!("{host}-{}", std::process::id())
}

/// Runs until `cancel` or until a task fails, then drains within `grace`. `Ok` after a
/// requested stop; `Err` if any task panicked, failed or ended on its own (see the module
/// doc), even during the drain.
pub async fn serve(
    store: Store,
    embedder: Embedder,
    client: crate::streams::RedisClient,
    config: ServeConfig,
    cancel: CancellationToken,
) -> Result<(), ServeError> {
    serve_with_console(store, embedder, client, config, None, None, cancel).await
}

/// [`serve`], also serving the operator console (`serve --console-addr`) as one of its
/// supervised tasks, with this process's provider breaker on its overview. A console that
/// cannot bind its address is a failed task: the process stops (exit non-zero).
///
/// `source_targets` is what a `[source]` writes (the target's live revisions:
/// [`crate::config::IngestSettings::source_targets`]); without it, the table of `store`
/// alone, with `embedder`.
pub async fn serve_with_console(
    store: Store,
    embedder: Embedder,
    client: crate::streams::RedisClient,
    config: ServeConfig,
    console: Option<crate::console::MountedConsole>,
    source_targets: Option<std::sync::Arc<dyn crate::ingest::source::SourceTargets>>,
    cancel: CancellationToken,
) -> Result<(), ServeError> {
    // The prefix first: a process with the wrong one must leave nothing behind, and the
    // shard check records the count under the prefix (`{prefix}:meta`) on first use.
    match crate::store::prefix::check(store.pool(), config.keys.prefix()).await {
        Ok(()) => {}
        Err(crate::store::prefix::PrefixError::Mismatch(m)) => return Err(ServeError::Prefix(m)),
        Err(crate::store::prefix::PrefixError::Store(e)) => return Err(ServeError::Store(e)),
    }
    let manager = streams::managed(&client).await.map_err(ServeError::Redis)?;
    match streams::check_shards(&mut manager.clone(), &config.keys).await {
        Ok(()) => {}
        Err(streams::ShardsError::Mismatch(m)) => return Err(ServeError::Shards(m)),
        Err(streams::ShardsError::Redis(e)) => return Err(ServeError::Redis(e)),
    }
    // `stop`: the signal, or a failed task. `hard`: the grace period is over.
    let stop = cancel.child_token();
    let hard = CancellationToken::new();
    let mut tasks = Supervisor::new(stop.clone());
    let relay = Relay::new(store.pool().clone(), manager.clone(), config.keys.clone(), config.relay.clone());
    tasks.spawn_until("relay", stop.clone(), relay.run(stop.clone()));
    let scheduler =
        Scheduler::new(store.clone(), config.replay.clone(), manager.clone(), config.keys.clone());
    tasks.spawn_until("scheduler", stop.clone(), scheduler.run(stop.clone()));
    // The republisher puts the events Redis lost back on the events stream: it looks for the
    // loss itself, and replayers that find a stream's consumer group gone wake it at once.
    let data_lost = std::sync::Arc::new(tokio::sync::Notify::new());
    let republisher = Reconciler {
        store: store.clone(),
        redis: Some(manager.clone()),
        keys: config.keys.clone(),
        config: ReconcileConfig {
            events_maxlen: config.relay.events_maxlen,
            dedup_ttl: config.relay.marker_ttl,
            ..Default::default()
        },
    };
    tasks.spawn_until(
        "republisher",
        stop.clone(),
        republish_on_loss(republisher, data_lost.clone(), stop.clone()),
    );
    // Every shard is read by some replayer of this process, however few there are.
    for (n, shards) in crate::replay::shares(config.replayers, config.keys.shards()).into_iter().enumerate() {
        let replayer = Replayer {
            name: format!("{}-{n}", config.consumer_prefix),
            store: store.clone(),
            embedder: embedder.clone(),
            client: client.clone(),
            redis: manager.clone(),
            keys: config.keys.clone(),
            config: crate::replay::ReplayConfig {
                shards,
                data_lost: Some(data_lost.clone()),
                ..config.replay.clone()
            },
            paused_until: None,
        };
        let name = format!("replayer {}", replayer.name);
        tasks.spawn_until(name, stop.clone(), replayer.run(stop.clone(), hard.clone()));
    }
    if let Some(source) = config.source.clone() {
        let targets = source_targets.unwrap_or_else(|| {
            std::sync::Arc::new(crate::ingest::Pipeline {
                store: store.clone(),
                embedder: embedder.clone(),
                options: config.source_ingest.clone(),
            })
        });
        tasks.spawn_until("source", stop.clone(), run_source(targets, client.clone(), source, stop.clone()));
    }
    for follower in config.table_followers.iter().take(MAX_TABLE_FOLLOWERS).cloned() {
        let name = format!("table source {}", follower.source.name);
        tasks.spawn_until(name, stop.clone(), run_table_source(follower, stop.clone()));
    }
    if config.metrics || config.reconcile_every.is_some() {
        let sampler = sample_and_reconcile(store.clone(), manager.clone(), config.clone(), stop.clone());
        tasks.spawn_until("sampler", stop.clone(), sampler);
    }
    if let Some(mounted) = console {
        let console = crate::console::Console {
            store: store.clone(),
            redis: Some(mounted.redis),
            keys: config.keys.clone(),
            gate: Some(embedder.gate.clone()),
            config: mounted.config,
        };
        tasks.spawn_until("console", stop.clone(), crate::console::serve(console, stop.clone()));
    }
    tracing::info!(
        replayers = config.replayers,
        stream_shards = config.keys.shards(),
        "serving: relay, scheduler, replayers"
    );
    stop.cancelled().await;
    match tasks.failures().first() {
        Some(f) => tracing::error!(error = %f, grace_ms = config.grace.as_millis() as u64,
            "a serve task died: stopping the process so that its supervisor restarts it"),
        None => {
            tracing::info!(grace_ms = config.grace.as_millis() as u64, "stopping: finishing in-flight work")
        }
    }
    if tokio::time::timeout(config.grace, tasks.wait()).await.is_err() {
        tracing::warn!("grace period over: cutting retry waits short");
        hard.cancel();
        if tokio::time::timeout(Duration::from_secs(5), tasks.wait()).await.is_err() {
            tracing::warn!(tasks = tasks.len(), "tasks still running after the grace period: aborting them");
            tasks.abort_all().await;
        }
    }
    match tasks.failures().into_iter().next() {
        Some(f) => Err(ServeError::Task(f)),
        None => Ok(()),
    }
}

/// The stream source of `serve` until `stop`: a run that fails (the database or Redis away,
/// the provider refusing the run) leaves its unsettled entries pending and is started again
/// after a capped backoff; options that cannot work end the task (and so the process).
async fn run_source(
    targets: std::sync::Arc<dyn crate::ingest::source::SourceTargets>,
    client: crate::streams::RedisClient,
    opts: crate::ingest::source::SourceOptions,
    stop: CancellationToken,
) -> Result<(), crate::ingest::IngestError> {
    let mut backoff = crate::embed::retry::Reconnect::new(Duration::from_secs(1), Duration::from_secs(60));
    tracing::info!(streams = ?opts.streams, group = %opts.group, consumer = %opts.consumer, "serving a stream source");
    while !stop.is_cancelled() {
        match crate::ingest::source::run_source_into(targets.clone(), &client, opts.clone(), stop.clone())
            .await
        {
            Ok(runs) => {
                for run in runs {
                    let summary = &run.summary;
                    let left = summary.source.as_ref().map_or(0, |s| s.left_pending);
                    tracing::info!(
                        revision = ?run.revision.as_ref().map(|r| r.revision),
                        records = summary.records,
                        stored = summary.stored,
                        left_pending = left,
                        stopped = ?run.stopped,
                        "stream source stopped"
                    );
                }
                if !stop.is_cancelled() {
                    backoff.reset();
                }
            }
            Err(crate::ingest::IngestError::Source(e)) if opts.problem().is_some() => {
                return Err(crate::ingest::IngestError::Source(e));
            }
            Err(e) => {
                tracing::warn!(error = %e, "stream source run failed; its unsettled entries stay pending; restarting");
                crate::shutdown::sleep_or_cancel(backoff.next_delay(), &stop).await;
            }
        }
    }
    Ok(())
}

/// Follows a table source until `stop`. A failed run (Postgres gone, a provider stop) is
/// retried with capped backoff: its changes stay queued and its lag gauge and alert show
/// the wait. A resync after a TRUNCATE that needs `--yes` is logged at ERROR and retried
/// after at least 30 s; between tries the source is free for `ingest --from-table NAME
/// --yes`. While another process follows the source, this one stands by and tries again
/// every few seconds. A source that is gone or no longer fits its table ends the task (and
/// `serve`).
async fn run_table_source(
    follower: TableFollower,
    stop: CancellationToken,
) -> Result<(), crate::ingest::IngestError> {
    use crate::ingest::IngestError;
    use crate::ingest::table::{FollowOptions, follow_table};
    use crate::store::table_source::TableSourceError;
    let name = follower.source.name.clone();
    let mut backoff = crate::embed::retry::Reconnect::new(Duration::from_secs(1), Duration::from_secs(60));
    tracing::info!(source = %name, table = %follower.source.table, target = %follower.source.target_table, "serving a table source");
    while !stop.is_cancelled() {
        let run =
            follow_table(&*follower.targets, &follower.source, FollowOptions::default(), stop.clone()).await;
        let wait = match run {
            Ok(done) => {
                tracing::info!(source = %name, snapshots = done.snapshots, changes = done.changes_applied, "table source stopped");
                backoff.reset();
                continue;
            }
            Err(IngestError::TableSource(
                e @ (TableSourceError::Unknown(_) | TableSourceError::Invalid { .. }),
            )) => {
                return Err(IngestError::TableSource(e));
            }
            Err(IngestError::TableSource(TableSourceError::FollowerRunning(_))) => {
                tracing::info!(source = %name, "another follower holds this table source: standing by");
                backoff.next_delay().min(Duration::from_secs(5))
            }
            Err(IngestError::CleanupRefused { reason, .. }) => {
                tracing::error!(source = %name, %reason, "the table was truncated: its resync needs `embed-dlq ingest --from-table NAME --yes`; retrying");
                backoff.next_delay().max(Duration::from_secs(30))
            }
            Err(e) => {
                tracing::warn!(source = %name, error = %e, "table source run failed; its changes stay queued; restarting");
                backoff.next_delay()
            }
        };
        crate::shutdown::sleep_or_cancel(wait, &stop).await;
    }
    Ok(())
}

/// How long the republisher waits after the first sign of lost Redis data before it looks:
/// the other shards' replayers notice within a read or two, and one pass covers them all.
const REPUBLISH_SETTLE: Duration = Duration::from_secs(2);

/// How often serve looks for lost Redis data by itself: replayers notice it when a read finds
/// a consumer group gone, but a replayer paused by a refusing provider reads nothing for up
/// to its pause, and `--replayers 0` has none. One `XGROUP CREATE` per shard.
const LOSS_CHECK_EVERY: Duration = Duration::from_secs(2);

/// Watches for lost Redis data, then republishes the lost events
/// ([`Reconciler::republish_lost_events`]): on word from a replayer
/// ([`ReplayConfig::data_lost`]), or when its own check every [`LOSS_CHECK_EVERY`] finds a
/// shard's consumer group missing ([`crate::replay::recover_lost_groups`], which also
/// releases the shard's lost leases) or another server under a shard than at the check
/// before ([`ServersSeen`]). A failed pass is retried with capped backoff until it succeeds
/// or `stop`; a failed check is tried again at the next tick.
async fn republish_on_loss(
    reconciler: Reconciler,
    data_lost: std::sync::Arc<tokio::sync::Notify>,
    stop: CancellationToken,
) {
    let Some(mut redis) = reconciler.redis.clone() else { return };
    let shards: Vec<u16> = reconciler.keys.shard_ids().collect();
    // The servers as they are at the start, before anything else: a pass of the loop below
    // can take as long as an outage, and a change is seen against this.
    let mut servers = ServersSeen::default();
    if let Err(e) = servers.replaced(&reconciler, &mut redis).await {
        tracing::debug!(error = %e, "reading which Redis servers hold the streams failed; trying again");
    }
    while !stop.is_cancelled() {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = data_lost.notified() => {}
            _ = tokio::time::sleep(LOSS_CHECK_EVERY) => {
                // A failed read (Redis down, a server that refuses INFO in scripts) leaves the
                // servers as last seen, and the groups are checked all the same.
                let replaced = servers.replaced(&reconciler, &mut redis).await.unwrap_or_else(|e| {
                    tracing::debug!(error = %e, "looking for replaced Redis servers failed; trying again");
                    0
                });
                let missing = match crate::replay::recover_lost_groups(&reconciler.store, &mut redis, &reconciler.keys, &shards, None)
                    .await
                {
                    Ok(0) => 0,
                    Ok(missing) => {
                        tracing::warn!(shards = missing,
                            "consumer groups missing (Redis lost its data?): recreated; republishing the lost events");
                        missing
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "looking for lost Redis data failed; trying again");
                        0
                    }
                };
                // A replaced server was seen once (its leases are already released): its
                // events are republished whatever the group check said.
                if missing == 0 && replaced == 0 {
                    continue;
                }
            }
        }
        crate::shutdown::sleep_or_cancel(REPUBLISH_SETTLE, &stop).await;
        let mut backoff =
            crate::embed::retry::Reconnect::new(Duration::from_secs(1), Duration::from_secs(60));
        while !stop.is_cancelled() {
            match reconciler.republish_lost_events().await {
                Ok(n) => {
                    let n = n.unwrap_or(0);
                    if n > 0 {
                        tracing::warn!(events = n, "republishing events Redis lost");
                    }
                    break;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "republishing lost events failed; retrying");
                    crate::shutdown::sleep_or_cancel(backoff.next_delay(), &stop).await;
                }
            }
        }
    }
}

/// The server seen under each stream shard at the previous check
/// ([`crate::streams::shard_servers`]). A failover to a replica that had not caught up keeps
/// the consumer groups but loses the newest work items and events: nothing reads as missing,
/// so a replaced server is taken for lost data. Its shard's leases are released (the
/// scheduler issues the items again at its next pass; those that survived are replayed once
/// and their second item is skipped) and the lost events are republished, within seconds
/// instead of a lease. A restart that kept every write costs the same, once.
#[derive(Default)]
struct ServersSeen(Vec<Option<String>>);

impl ServersSeen {
    /// Reads the shards' servers, releases the leases of every shard whose server changed
    /// since the previous check, and returns how many did (none at the first check).
    async fn replaced(
        &mut self,
        reconciler: &Reconciler,
        redis: &mut crate::streams::RedisConn,
    ) -> Result<usize, crate::replay::ReplayError> {
        let now = crate::streams::shard_servers(redis, &reconciler.keys).await?;
        let changed = self.update(now);
        for &shard in &changed {
            let released =
                crate::replay::release_lost_leases(&reconciler.store, &reconciler.keys, shard).await?;
            metrics::counter!(crate::metrics::REPLAY_LEASES_RELEASED).increment(released);
            tracing::warn!(
                shard,
                released,
                "another Redis server holds the shard's streams (a failover or a restart): released \
                 the leases of its work items, which are issued again; republishing the events it lost"
            );
        }
        Ok(changed.len())
    }

    /// Takes the servers read now (per shard, `None` where the read found none) and returns
    /// the shards whose server changed. A shard read as `None` (no server during a failover,
    /// a node that does not answer) keeps the server last seen, so the change shows at the
    /// first check that finds the new one; forgetting it would let a failover that outlasts
    /// a check pass unseen.
    fn update(&mut self, now: Vec<Option<String>>) -> Vec<u16> {
        let mut changed = Vec::new();
        if self.0.len() != now.len() {
            self.0 = vec![None; now.len()];
        }
        for (shard, (seen, read)) in self.0.iter_mut().zip(now).enumerate() {
            let Some(read) = read else { continue };
            if seen.as_ref().is_some_and(|s| *s != read) {
                changed.push(shard as u16);
            }
            *seen = Some(read);
        }
        changed
    }
}

/// The gauge sampler and the periodic reconcile check, every 5 s until `stop`.
async fn sample_and_reconcile(
    store: Store,
    mut redis: crate::streams::RedisConn,
    config: ServeConfig,
    stop: CancellationToken,
) {
    let keys = config.keys;
    let mut reconciler = crate::reconcile::Reconciler {
        store: store.clone(),
        redis: Some(redis.clone()),
        keys: keys.clone(),
        config: ReconcileConfig {
            sweeps: config.reconcile_sweeps,
            // The cap the relay trims to: older entries are trimmed by policy, not lost.
            events_maxlen: config.relay.events_maxlen,
            dedup_ttl: config.relay.marker_ttl,
            ..Default::default()
        },
    };
    crate::reconcile::publish_zero_findings();
    let mut last_reconcile = std::time::Instant::now();
    let mut revisions_sampled: Option<std::time::Instant> = None;
    let mut first = true;
    while !stop.is_cancelled() {
        if revisions_sampled.is_none_or(|t| t.elapsed() >= crate::gauges::REVISION_SAMPLE_EVERY) {
            revisions_sampled = Some(std::time::Instant::now());
            if let Err(e) = crate::gauges::sample_revisions(store.pool()).await {
                tracing::warn!(error = %e, "sampling the revision gauges failed");
            }
        }
        if let Some(every) = config.reconcile_every
            && (first || last_reconcile.elapsed() >= every)
        {
            first = false;
            last_reconcile = std::time::Instant::now();
            match reconciler.run_once(crate::reconcile::Mode::Check).await {
                Ok(r) => {
                    crate::reconcile::publish_report(&r);
                    if r.total_found() > 0 {
                        tracing::warn!(
                            findings = r.total_found(),
                            "reconcile found drift (run `embed-dlq reconcile --repair`)"
                        );
                    }
                }
                Err(e) => tracing::warn!(error = %e, "reconcile failed"),
            }
        }
        if let Err(e) = crate::gauges::sample(&store, Some(&mut redis), &keys).await {
            tracing::warn!(error = %e, "sampling gauges failed");
        }
        crate::shutdown::sleep_or_cancel(Duration::from_secs(5), &stop).await;
    }
}

/// Runs `reconciler` once, or every `every` until `cancel`, publishing each report to the
/// metrics (the findings, then the sampled DLQ/outbox/stream gauges) and handing each
/// outcome to `on_run`. This is the `reconcile` command's loop: a failed run is handed over
/// like a report, and the next one is tried on schedule.
pub async fn reconcile_periodically(
    reconciler: &mut Reconciler,
    mode: Mode,
    every: Option<Duration>,
    mut on_run: impl FnMut(Result<Report, ReconcileError>),
    cancel: &CancellationToken,
) {
    crate::reconcile::publish_zero_findings();
    loop {
        let outcome = reconciler.run_once(mode).await;
        if let Ok(report) = &outcome {
            crate::reconcile::publish_report(report);
            let mut redis = reconciler.redis.clone();
            if let Err(e) = crate::gauges::sample(&reconciler.store, redis.as_mut(), &reconciler.keys).await {
                tracing::warn!(error = %e, "sampling gauges failed");
            }
        }
        on_run(outcome);
        let Some(every) = every else { return };
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ServersSeen;

    fn servers(ids: &[Option<&str>]) -> Vec<Option<String>> {
        ids.iter().map(|s| s.map(str::to_string)).collect()
    }

    #[test]
    fn a_failover_seen_through_a_check_with_no_server_is_still_a_change() {
        let mut seen = ServersSeen::default();
        assert!(seen.update(servers(&[Some("a"), Some("b")])).is_empty(), "the first check sees no change");
        assert!(seen.update(servers(&[Some("a"), Some("b")])).is_empty());
        // Shard 1's master died: no server answers for it at this check...
        assert!(seen.update(servers(&[Some("a"), None])).is_empty());
        // ...and its replica took over by the next one.
        assert_eq!(seen.update(servers(&[Some("a"), Some("c")])), [1]);
        assert!(seen.update(servers(&[Some("a"), Some("c")])).is_empty(), "seen once");
    }

    #[test]
    fn a_shard_never_seen_before_is_not_a_change() {
        let mut seen = ServersSeen::default();
        assert!(seen.update(servers(&[None, None])).is_empty());
        assert!(seen.update(servers(&[Some("a"), None])).is_empty());
        assert_eq!(seen.update(servers(&[Some("b"), Some("x")])), [0]);
    }
}
