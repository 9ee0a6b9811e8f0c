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
        };
        tracker.spawn(replayer.run(cancel.clone(), hard.clone()));
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
