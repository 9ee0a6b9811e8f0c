//! `serve`: relay, scheduler and N replayers under one cancellation token and one task
//! tracker. Shutdown is two-phase: on the signal every loop stops claiming new work and
//! finishes the batch in hand; after the grace period in-flight retry waits are cut short
//! (attempted items are re-parked, unattempted ones stay pending and are reclaimed by any
//! live replayer after `min_idle`).

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::embed::Embedder;
use crate::relay::{Relay, RelayConfig};
use crate::replay::{ReplayConfig, Replayer, Scheduler};
use crate::store::Store;
use crate::streams::{self, StreamKeys};

/// Everything `serve` runs.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub replayers: usize,
    pub relay: RelayConfig,
    pub replay: ReplayConfig,
    pub keys: StreamKeys,
    /// How long in-flight work may take to finish after the signal.
    pub grace: Duration,
    /// Prefix of this process's consumer names (host and pid by default).
    pub consumer_prefix: String,
    /// Run the reconciler (check only) this often.
    pub reconcile_every: Option<Duration>,
    /// Sample the DLQ/outbox/stream gauges (when a metrics endpoint is installed).
    pub metrics: bool,
}

/// A consumer name unique to this process.
pub fn default_consumer_prefix() -> String {
    let host = std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "host".into());
    format!("{host}-{}", std::process::id())
}

/// Runs until `cancel`, then drains within `grace`.
pub async fn serve(
    store: Store,
    embedder: Embedder,
    client: redis::Client,
    config: ServeConfig,
    cancel: CancellationToken,
) -> Result<(), String> {
    let manager = streams::managed(&client).await.map_err(|e| format!("cannot connect to Redis: {e}"))?;
    let hard = CancellationToken::new();
    let tracker = TaskTracker::new();
    let relay = Relay::new(store.pool().clone(), manager.clone(), config.keys.clone(), config.relay.clone());
    tracker.spawn(relay.run(cancel.clone()));
    let scheduler = Scheduler { store: store.clone(), config: config.replay.clone() };
    tracker.spawn(scheduler.run(cancel.clone()));
    for n in 0..config.replayers {
        let replayer = Replayer {
            name: format!("{}-{n}", config.consumer_prefix),
            store: store.clone(),
            embedder: embedder.clone(),
            client: client.clone(),
            redis: manager.clone(),
            keys: config.keys.clone(),
            config: config.replay.clone(),
            paused_until: None,
        };
        tracker.spawn(replayer.run(cancel.clone(), hard.clone()));
    }
    if config.metrics || config.reconcile_every.is_some() {
        let store = store.clone();
        let keys = config.keys.clone();
        let mut redis = manager.clone();
        let every = config.reconcile_every;
        let cancel = cancel.clone();
        tracker.spawn(async move {
            let mut reconciler = crate::reconcile::Reconciler {
                store: store.clone(),
                redis: Some(redis.clone()),
                keys: keys.clone(),
                config: Default::default(),
            };
            crate::metrics::zero_findings();
            let mut last_reconcile = std::time::Instant::now();
            let mut first = true;
            while !cancel.is_cancelled() {
                if let Some(every) = every
                    && (first || last_reconcile.elapsed() >= every)
                {
                    first = false;
                    last_reconcile = std::time::Instant::now();
                    match reconciler.run_once(crate::reconcile::Mode::Check).await {
                        Ok(r) => {
                            crate::metrics::reconcile_report(&r);
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
                if let Err(e) = crate::metrics::sample(&store, Some(&mut redis), &keys).await {
                    tracing::warn!(error = %e, "sampling gauges failed");
                }
                crate::relay::sleep_or_cancel(Duration::from_secs(5), &cancel).await;
            }
        });
    }
    tracker.close();
    tracing::info!(replayers = config.replayers, "serving: relay, scheduler, replayers");
    cancel.cancelled().await;
    tracing::info!(grace_ms = config.grace.as_millis() as u64, "stopping: finishing in-flight work");
    if tokio::time::timeout(config.grace, tracker.wait()).await.is_err() {
        tracing::warn!("grace period over: cutting retry waits short");
        hard.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(5), tracker.wait()).await;
    }
    Ok(())
}
