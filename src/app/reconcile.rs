//! `reconcile`: connects to Postgres (and Redis if configured), runs the checks once or
//! periodically, prints every report and maps the last one to an exit code.

use std::net::SocketAddr;
use std::time::Duration;

use embed_dlq::reconcile::{Mode, Reconciler};
use embed_dlq::streams::StreamKeys;
use tokio_util::sync::CancellationToken;

use super::exit;
use super::render::print_report;

/// Where and how to reconcile.
pub struct ReconcileRun<'a> {
    /// The Postgres that holds manifest, vectors, DLQ and outbox.
    pub database_url: &'a str,
    /// Without Redis, the checks that compare with the streams are skipped.
    pub redis_url: Option<&'a str>,
    /// The target vector table.
    pub table: &'a str,
    /// Key prefix of the streams.
    pub stream_prefix: &'a str,
    /// Check, repair, or show what a repair would do.
    pub mode: Mode,
    /// Run every this often until a signal; `None` runs once.
    pub every: Option<Duration>,
    /// Each report as one JSON object instead of a table.
    pub json: bool,
    /// Serve Prometheus metrics here while running.
    pub metrics_addr: Option<SocketAddr>,
}

/// Runs the reconciler; returns [`exit::FINDINGS`] if a single run found something, and
/// [`exit::OK`] when a periodic run is stopped by a signal.
pub async fn command(run: ReconcileRun<'_>, cancel: CancellationToken) -> i32 {
    if let Some(addr) = run.metrics_addr
        && let Err(e) = embed_dlq::metrics::install(addr)
    {
        return exit::fail(exit::FAILURE, &e.to_string());
    }
    let store = match super::open_store(run.database_url, 4, run.table).await {
        Ok(s) => s,
        Err(e) => return exit::fail(exit::FAILURE, &e.to_string()),
    };
    let redis = match run.redis_url {
        Some(u) => match embed_dlq::streams::client(u) {
            Ok(c) => match embed_dlq::streams::managed(&c).await {
                Ok(m) => Some(m),
                Err(e) => return exit::fail(exit::FAILURE, &format!("cannot connect to Redis: {e}")),
            },
            Err(e) => return exit::fail(exit::USAGE, &format!("bad Redis URL: {e}")),
        },
        None => None,
    };
    let mut reconciler =
        Reconciler { store, redis, keys: StreamKeys::new(run.stream_prefix), config: Default::default() };
    let mut code = exit::OK;
    let json = run.json;
    let on_run = |outcome: Result<_, _>| {
        code = match outcome {
            Ok(report) => {
                print_report(&report, json);
                if report.total_found() > 0 { exit::FINDINGS } else { exit::OK }
            }
            Err(e) => exit::fail(exit::FAILURE, &format!("reconcile failed: {e}")),
        }
    };
    embed_dlq::serve::reconcile_periodically(&mut reconciler, run.mode, run.every, on_run, &cancel).await;
    if run.every.is_some() { exit::OK } else { code }
}
