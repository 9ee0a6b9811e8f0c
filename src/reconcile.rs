//! The reconciler: proves that the manifest, the vector table, the DLQ, the outbox and the
//! Redis streams agree, and repairs what can be repaired safely.
//!
//! Every check is one set-based SQL statement or a paged scan (of a stream, or of outbox rows
//! against a stream), so a run's memory is bounded by the page size
//! (`ReconcileConfig::page`), not by the size of the data. [`Reconciler::run_once`] returns
//! a [`Report`]; in repair mode each repairable check fixes what it found (in one statement,
//! a few pages of rows, or one Redis pipeline), and a second run is clean. Each run is
//! recorded in `reconcile_runs` (for the "reconcile not run recently" alert, whatever
//! process runs it, and for where the next run resumes).
//!
//! # Sweeps: what a run looks at
//!
//! The table checks come in three [`Sweep`]s; the outbox, stream and replay-stall checks are
//! the same in each.
//!
//! - **incremental**: only the chunks whose manifest row changed since the previous run, so
//!   its cost follows the changes, not the corpus. Every writer of this tool that stores,
//!   parks, replays or resolves a chunk moves its manifest `updated_at` in the same
//!   transaction, so everything this tool did since the previous run is looked at, vectors'
//!   contents included.
//! - **full**: every chunk. Leaks and stored drift are one anti-join, stale DLQ rows a pass
//!   over the DLQ, and duplicates are ruled out by the table's unique index. Vectors'
//!   contents are read only for changed chunks, as in an incremental run: a vector is
//!   checked (dimension, finite, non-zero norm) before this tool writes it, pgvector refuses a
//!   wrong dimension or a NaN on every input path, so what is left to find is a zero vector
//!   written by hand.
//! - **deep**: full, plus the norm of every vector and the duplicates `GROUP BY` whatever the
//!   index says (a corrupt index, hand-made rows). It reads every vector: many times the
//!   cost of a full sweep.
//!
//! What only a full sweep finds: changes made behind this tool's back that leave the
//! manifest alone (a vector or DLQ row deleted, a vector's content changed by hand, in a
//! chunk that did not change since the previous run). What only a deep sweep finds: a bad
//! vector written by hand into such a chunk.
//!
//! # The incremental window
//!
//! A writer stamps `updated_at = now()`, its transaction's start, and may commit long after
//! a reconcile run went by. So a run does not resume from its own start but from its
//! *horizon*: the oldest transaction start among the database's other client sessions when
//! the run began (read from `pg_stat_activity` before any check takes a snapshot; autovacuum
//! and other server processes never stamp `updated_at`), less a small
//! margin (2 s). Whatever this run could not see was written by a transaction running then (which
//! started no earlier than the horizon) or starting later, so its `updated_at` is at or after
//! the horizon, and the next run looks at it. Sessions whose transactions cannot be seen
//! (other roles without `pg_read_all_stats`, prepared transactions) widen the margin to an
//! hour, and the report says so.
//!
//! A finding left unrepaired holds its check's window open back to it, so it is reported
//! again by every run until it is repaired. Runs of one database take an advisory lock, one
//! after another: two reconcilers started at once (several `serve` hosts) never advance past
//! each other's windows. The window lives in `reconcile_runs`, so it survives restarts; a run
//! that fails records nothing, and the next one starts where the last recorded run left off.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};

mod checks;
mod report;
pub mod sql;
mod streams;
mod sweep;
mod tables;

pub use checks::{Check, Finding};
pub use report::{Mode, Report};
pub(crate) use report::{publish_report, publish_zero_findings};
pub use sweep::{DEFAULT_DEEP_EVERY, DEFAULT_FULL_EVERY, Sweep, SweepPolicy};

use crate::relay::sql as outbox;
use crate::store::{Store, StoreError};
use crate::streams::{RedisConn, StreamKeys};
use checks::finding;
use sweep::{Plan, WINDOWED};

/// Thresholds of the checks, the page size that bounds a run's memory, and the sweep
/// schedule.
#[derive(Debug, Clone)]
pub struct ReconcileConfig {
    /// An unpublished outbox row older than this is a finding.
    pub outbox_stuck_after: Duration,
    /// A row due for replay for longer than this is a finding.
    pub replay_stall_after: Duration,
    /// Replay work younger than this is left alone (the relay may be about to publish it).
    pub lost_work_grace: Duration,
    /// Examples per finding in the report.
    pub examples: usize,
    /// Stream entries or outbox rows handled per page by the scanning checks: what bounds a
    /// run's memory. Clamped to `1..=`[`MAX_PAGE`].
    pub page: usize,
    /// The events stream's length cap as the relay applies it (`MAXLEN ~`): entries older
    /// than the stream's first entry count as trimmed by policy, not as missing, while the
    /// stream holds at least this many entries. 0: no cap (nothing is ever trimmed).
    pub events_maxlen: usize,
    /// How long the relay's dedup records live (`[serve] relay_marker_ttl_secs`): the
    /// missing-events check learns where an event went from its record, and a record older
    /// than this may have expired (the event is then not checked) rather than been lost.
    pub dedup_ttl: Duration,
    /// How [`Reconciler::run_once`] picks each run's sweep.
    pub sweeps: SweepPolicy,
}

/// Largest page a scanning check uses, whatever is configured.
pub const MAX_PAGE: usize = 10_000;

impl Default for ReconcileConfig {
    fn default() -> Self {
        ReconcileConfig {
            outbox_stuck_after: Duration::from_secs(60),
            replay_stall_after: Duration::from_secs(300),
            lost_work_grace: Duration::from_secs(30),
            examples: 5,
            page: 1000,
            events_maxlen: crate::streams::DEFAULT_EVENTS_MAXLEN,
            dedup_ttl: crate::relay::RelayConfig::default().marker_ttl,
            sweeps: SweepPolicy::default(),
        }
    }
}

impl ReconcileConfig {
    fn page(&self) -> usize {
        self.page.clamp(1, MAX_PAGE)
    }
}

/// Why a run could not finish: a query or command failed. Findings are never errors.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// A store statement failed.
    #[error("{0}")]
    Store(#[from] StoreError),
    /// A check's query failed.
    #[error("postgres: {0}")]
    Db(#[from] sqlx::Error),
    /// A stream check's Redis command failed.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// The streams were set up with another shard count (or Redis failed while checking it).
    #[error("{0}")]
    Shards(#[from] crate::streams::ShardsError),
    /// The database is relayed under another stream prefix (or Postgres failed while checking it).
    #[error("{0}")]
    Prefix(#[from] crate::store::prefix::PrefixError),
}

/// Runs the checks over one database and its streams; [`Reconciler::run_once`] is what the
/// `reconcile` command and the periodic loop of [`crate::serve`] call.
pub struct Reconciler {
    /// The database whose manifest, vectors, DLQ and outbox are checked.
    pub store: Store,
    /// Without Redis, the three stream checks are skipped (and say so).
    pub redis: Option<RedisConn>,
    /// The streams the stream checks read.
    pub keys: StreamKeys,
    /// Thresholds, page size and the sweep schedule.
    pub config: ReconcileConfig,
}

impl Reconciler {
    /// One run of every check, in the sweep [`ReconcileConfig::sweeps`] picks.
    pub async fn run_once(&mut self, mode: Mode) -> Result<Report, ReconcileError> {
        self.run_sweep(mode, None).await
    }

    /// One run of every check in `sweep` (`None`: the one [`ReconcileConfig::sweeps`]
    /// picks). Waits until no other reconcile run of this database is in progress (an
    /// advisory lock held for the whole run): each run resumes where the one before it left
    /// off.
    pub async fn run_sweep(&mut self, mode: Mode, sweep: Option<Sweep>) -> Result<Report, ReconcileError> {
        let lock = sql::RunLock::begin(self.store.pool()).await?;
        // With streams, the database's stream prefix before anything else: a run under
        // another prefix must repair nothing and write nothing, `{prefix}:meta` included.
        if self.redis.is_some() {
            crate::store::prefix::check(self.store.pool(), self.keys.prefix()).await?;
        }
        let started = Instant::now();
        let started_at = chrono::Utc::now();
        let sweep = sweep.unwrap_or_else(|| self.config.sweeps.pick(&lock.previous));
        let plan = Plan::new(sweep, &lock.previous.resume);
        let repair = mode == Mode::Repair;
        let pool = self.store.pool();
        let mut findings = Vec::with_capacity(Check::ALL.len());
        let tables = self.table_findings(repair, &plan).await?;
        findings.extend(tables.findings);
        findings.push(self.outbox_check().await?);
        // The events check's window: where the previous run left off, in an incremental run.
        let events_window = match sweep {
            Sweep::Incremental => lock.previous.events_window.clone(),
            Sweep::Full | Sweep::Deep => None,
        };
        let streams = self.stream_findings(repair, events_window).await?;
        findings.extend(streams.findings);
        let stalled = sql::replay_stalled(pool, self.config.replay_stall_after, self.config.examples).await?;
        findings.push(finding(Check::ReplayStalled, stalled));
        findings.push(self.table_source_check(repair).await?);
        // Where the next incremental run starts, per check: this run's horizon, or the oldest
        // finding it left unrepaired (so that finding is reported again until repaired).
        let resume: HashMap<String, DateTime<Utc>> = WINDOWED
            .iter()
            .map(|c| {
                let at = tables.unrepaired.get(c).map_or(lock.horizon, |t| (*t).min(lock.horizon));
                (c.name().to_string(), at)
            })
            .collect();
        // The events check resumes at the outbox transactions its walk could not see yet, or
        // its oldest finding left unrepaired; a run without Redis keeps the previous window
        // (it looked at no event).
        let events_window = match streams.events_checked {
            true => streams.events_window,
            false => lock.previous.events_window.clone(),
        };
        let since = (sweep == Sweep::Incremental).then(|| plan.since()).flatten();
        let report = Report {
            findings,
            mode,
            sweep,
            since,
            window_note: lock.horizon_note.clone(),
            duration_secs: started.elapsed().as_secs_f64(),
        };
        let record = sql::RunRecord {
            started_at,
            repaired: repair,
            findings: serde_json::to_value(&report.findings).expect("findings serialize"),
            sweep: sweep.name(),
            scope_from: since,
            resume,
            events_window,
        };
        lock.finish(record).await?;
        Ok(report)
    }

    /// Every table source's capture triggers are in place and enabled; a repair reinstalls
    /// the missing ones and schedules a full resync (what changed meanwhile was not queued).
    async fn table_source_check(&self, repair: bool) -> Result<Finding, ReconcileError> {
        use crate::store::table_source::{self, TableSourceError};
        let pool = self.store.pool();
        let mut f = Finding {
            check: Check::TableSourceTriggers,
            found: 0,
            examples: vec![],
            repaired: 0,
            note: None,
        };
        let as_store = |e: TableSourceError| match e {
            TableSourceError::Store(e) => ReconcileError::from(e),
            other => ReconcileError::from(crate::store::StoreError::Target {
                table: "embed_table_sources".into(),
                problem: other.to_string(),
            }),
        };
        for name in table_source::list(pool).await.map_err(as_store)? {
            let source = table_source::load(pool, &name).await.map_err(as_store)?;
            let missing = table_source::missing_triggers(pool, &source).await.map_err(as_store)?;
            if missing.is_empty() {
                continue;
            }
            f.found += missing.len() as u64;
            f.add_examples(missing.iter().map(|t| format!("{name}: {t}")), self.config.examples);
            if repair {
                table_source::repair_triggers(pool, &source).await.map_err(as_store)?;
                f.repaired += missing.len() as u64;
            }
        }
        Ok(f)
    }

    async fn outbox_check(&self) -> Result<Finding, ReconcileError> {
        let outbox::Backlog { unpublished: backlog, stuck, oldest_secs: oldest } =
            outbox::backlog(self.store.pool(), self.config.outbox_stuck_after).await?;
        Ok(Finding {
            check: Check::OutboxBacklog,
            found: stuck as u64,
            examples: vec![],
            repaired: 0,
            note: (backlog > 0).then(|| {
                let hint = if stuck > 0 { " (is a relay running?)" } else { "" };
                format!("{backlog} unpublished, oldest {oldest:.0}s old{hint}")
            }),
        })
    }
}
