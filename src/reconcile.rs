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

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};

pub mod sql;

use crate::relay::sql as outbox;
use crate::store::park::OnNewerParked;
use crate::store::{Store, StoreError, TargetTable};
use crate::streams::RedisConn;
use crate::streams::{REPLAY_GROUP, StreamKeys};
use serde::Serialize;
use sql::{CheckRun, MAX_TABLES, Scope, WorkAudit};

/// The checks, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Check {
    /// Manifest rows with neither a vector nor a DLQ row (the seed's query), per target table.
    Leaks,
    /// More than one vector for a (doc_id, chunk_index) in a target table.
    Duplicates,
    /// Manifest says stored, but the vector is missing or has another content hash.
    StoredDrift,
    /// A DLQ row for a chunk whose vector with the same content is stored.
    StaleDlq,
    /// Vectors of the wrong dimension, with NaN, or of zero norm.
    BadVectors,
    /// Vectors of a chunk's previous text while the manifest holds newer content that is
    /// parked or exhausted: search returns text the source no longer holds. A finding under
    /// `[ingest] on_newer_parked = withdraw`; under `keep` they are expected and only counted
    /// in the note. The note also counts (full and deep sweeps) vectors with no manifest row.
    SupersededVectors,
    /// Outbox rows unpublished for longer than the threshold.
    OutboxBacklog,
    /// Events marked published whose entry is not on the events stream, and was not trimmed
    /// by its length cap (e.g. Redis lost its data, or entries were deleted by hand).
    MissingEvents,
    /// DLQ rows handed out as replay work that are in neither the outbox, the replay stream
    /// nor its pending list (e.g. Redis lost its data).
    LostReplayWork,
    /// Replay stream entries still to be processed whose DLQ row is gone or has moved on.
    OrphanStreamEntries,
    /// Rows due for replay for longer than the threshold: the replayers are not draining.
    ReplayStalled,
}

impl Check {
    /// Every check, in the order a report lists them.
    pub const ALL: [Check; 11] = [
        Check::Leaks,
        Check::Duplicates,
        Check::StoredDrift,
        Check::StaleDlq,
        Check::BadVectors,
        Check::SupersededVectors,
        Check::OutboxBacklog,
        Check::MissingEvents,
        Check::LostReplayWork,
        Check::OrphanStreamEntries,
        Check::ReplayStalled,
    ];

    /// Label value and report name.
    pub fn name(self) -> &'static str {
        match self {
            Check::Leaks => "leaks",
            Check::Duplicates => "duplicates",
            Check::StoredDrift => "stored_drift",
            Check::StaleDlq => "stale_dlq",
            Check::BadVectors => "bad_vectors",
            Check::SupersededVectors => "superseded_vectors",
            Check::OutboxBacklog => "outbox_backlog",
            Check::MissingEvents => "missing_events",
            Check::LostReplayWork => "lost_replay_work",
            Check::OrphanStreamEntries => "orphan_stream_entries",
            Check::ReplayStalled => "replay_stalled",
        }
    }

    /// What repair does, for the report.
    pub fn repair_action(self) -> Option<&'static str> {
        match self {
            Check::Leaks | Check::StoredDrift => Some("mark the chunk for re-ingest"),
            Check::Duplicates => Some("keep the newest vector row"),
            Check::StaleDlq => Some("delete the stale DLQ row, mark stored"),
            Check::BadVectors => Some("delete the vector, mark for re-ingest"),
            Check::SupersededVectors => Some("withdraw the vector (`withdrawn` event)"),
            Check::MissingEvents => Some("re-publish from the outbox"),
            Check::LostReplayWork => Some("release the leases: the scheduler issues the work again"),
            Check::OrphanStreamEntries => Some("acknowledge and delete the entries"),
            Check::OutboxBacklog | Check::ReplayStalled => None,
        }
    }
}

/// One check's result.
#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    /// Which check this is.
    pub check: Check,
    /// Rows or entries in the wrong state when the check ran (0 means the check passed).
    pub found: u64,
    /// A few examples (chunk keys or entry ids).
    pub examples: Vec<String>,
    /// Rows or entries changed by repair (0 in check or dry-run mode).
    pub repaired: u64,
    /// Extra context (e.g. backlog size and age).
    pub note: Option<String>,
}

/// The result of one [`Reconciler::run_once`]: one finding per check, serialisable for
/// `--json` and the metrics.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// One finding per check, in [`Check::ALL`] order.
    pub findings: Vec<Finding>,
    /// Whether the run changed anything.
    pub mode: Mode,
    /// What the table checks looked at.
    pub sweep: Sweep,
    /// An incremental run: the earliest manifest change it looked at (`None`: some check
    /// looked at every chunk).
    pub since: Option<DateTime<Utc>>,
    /// Why the incremental window keeps a wider margin than usual, if it does.
    pub window_note: Option<String>,
    /// Wall-clock duration of the run (after waiting for another run to finish).
    pub duration_secs: f64,
}

impl Report {
    /// Findings across all checks.
    pub fn total_found(&self) -> u64 {
        self.findings.iter().map(|f| f.found).sum()
    }

    /// The finding of one check.
    pub fn get(&self, check: Check) -> &Finding {
        self.findings.iter().find(|f| f.check == check).expect("every check reports")
    }
}

/// Whether to change anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Report the findings, change nothing.
    Check,
    /// Report what repair would do, change nothing.
    DryRun,
    /// Repair what each check can repair, then report what was found and repaired.
    Repair,
}

/// What a run's table checks look at; see the module doc.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Sweep {
    /// Only chunks whose manifest row changed since the previous run (per check, where the
    /// previous run left off); every chunk for a check no run has covered yet.
    Incremental,
    /// Every chunk; vectors' contents only of the changed chunks.
    Full,
    /// Every chunk and every vector's contents; duplicates by scanning.
    Deep,
}

impl Sweep {
    /// Name in reports, `reconcile_runs.sweep` and flags.
    pub fn name(self) -> &'static str {
        match self {
            Sweep::Incremental => "incremental",
            Sweep::Full => "full",
            Sweep::Deep => "deep",
        }
    }
}

/// How [`Reconciler::run_once`] picks a run's [`Sweep`]. The schedule reads the recorded runs
/// of the database, so it holds across restarts and across every process that reconciles it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SweepPolicy {
    /// Deep when no deep sweep finished within `deep_every` (`None`: never deep); else full
    /// when no full (or deep) sweep finished within `full_every` (zero: every run is full)
    /// or no run left resume points; else incremental.
    Scheduled {
        /// Longest time between full sweeps.
        full_every: Duration,
        /// Longest time between deep sweeps (`None`: only when asked for).
        deep_every: Option<Duration>,
    },
    /// Always this sweep.
    Always(Sweep),
}

/// Default longest time between full sweeps: a full sweep costs about one anti-join of the
/// manifest against the vectors (see BENCHMARKS.md).
pub const DEFAULT_FULL_EVERY: Duration = Duration::from_secs(3600);
/// Default longest time between deep sweeps: one reads every vector.
pub const DEFAULT_DEEP_EVERY: Duration = Duration::from_secs(7 * 86_400);

impl Default for SweepPolicy {
    fn default() -> Self {
        SweepPolicy::Scheduled { full_every: DEFAULT_FULL_EVERY, deep_every: Some(DEFAULT_DEEP_EVERY) }
    }
}

impl SweepPolicy {
    /// The sweep of the next run, given what the previous runs left.
    fn pick(self, previous: &sql::Previous) -> Sweep {
        let (full_every, deep_every) = match self {
            SweepPolicy::Always(s) => return s,
            SweepPolicy::Scheduled { full_every, deep_every } => (full_every, deep_every),
        };
        let older = |ago: Option<f64>, d: Duration| ago.is_none_or(|s| s >= d.as_secs_f64());
        if let Some(d) = deep_every
            && older(previous.secs_since_deep, d)
        {
            return Sweep::Deep;
        }
        let resumable = [Check::Leaks, Check::StoredDrift, Check::StaleDlq]
            .iter()
            .all(|c| previous.resume.contains_key(c.name()));
        if !resumable || older(previous.secs_since_full, full_every) {
            return Sweep::Full;
        }
        Sweep::Incremental
    }
}

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

impl Finding {
    /// Adds examples until the finding holds `limit`.
    fn add_examples(&mut self, examples: impl IntoIterator<Item = String>, limit: usize) {
        let room = limit.saturating_sub(self.examples.len());
        self.examples.extend(examples.into_iter().take(room));
    }
}

/// A replay stream entry still to be replayed: its id, and the `(DLQ row, generation)` of
/// each work item it carries (`None`: unreadable).
type OutstandingEntry = (String, Option<Vec<(i64, i64)>>);

/// Records the page's `outstanding` work items (entry id, and the DLQ rows and generations
/// it carries, if readable) in `audit`; returns the entries all of whose rows are gone or
/// have moved on to another generation, and the unreadable ones.
async fn orphans_among(
    audit: &mut WorkAudit,
    outstanding: Vec<OutstandingEntry>,
) -> Result<Vec<String>, ReconcileError> {
    let (ids, gens): (Vec<i64>, Vec<i64>) =
        outstanding.iter().filter_map(|(_, w)| w.as_ref()).flatten().copied().unzip();
    audit.record_outstanding(&ids, &gens).await?;
    let live: HashMap<i64, i64> = audit.live_generations(&ids).await?;
    Ok(outstanding
        .into_iter()
        .filter(|(_, w)| match w {
            // An entry of several items is an orphan only once none of them is live.
            Some(items) => items.iter().all(|(dlq_id, generation)| live.get(dlq_id) != Some(generation)),
            None => true,
        })
        .map(|(id, _)| id)
        .collect())
}

/// A check's result as the report shows it.
fn finding(check: Check, run: CheckRun) -> Finding {
    Finding { check, found: run.found, examples: run.examples, repaired: run.repaired, note: None }
}

/// The table checks, in report order.
const TABLE_CHECKS: [Check; 6] = [
    Check::Leaks,
    Check::Duplicates,
    Check::StoredDrift,
    Check::StaleDlq,
    Check::BadVectors,
    Check::SupersededVectors,
];

/// The checks whose window an incremental run resumes, per check, where the previous run
/// left off: they look at chunks (manifest rows) and can be limited to the changed ones.
const WINDOWED: [Check; 5] =
    [Check::Leaks, Check::StoredDrift, Check::StaleDlq, Check::BadVectors, Check::SupersededVectors];

/// What each table check of one run looks at.
#[derive(Debug, Clone, Copy)]
struct Plan {
    /// Leaks and stored drift (one scan).
    gaps: Scope,
    stale: Scope,
    superseded: Scope,
    /// `None`: no vector is read (a full or incremental sweep with no earlier window).
    bad: Option<Scope>,
    /// Scan for duplicates even where the unique index rules them out.
    scan_duplicates: bool,
}

impl Plan {
    /// The plan of `sweep` given where the previous run left off (`resume`).
    fn new(sweep: Sweep, resume: &HashMap<String, DateTime<Utc>>) -> Plan {
        let window = |c: Check| resume.get(c.name()).copied().map(Scope::Since);
        let earlier = |a: Option<Scope>, b: Option<Scope>| match (a, b) {
            (Some(Scope::Since(x)), Some(Scope::Since(y))) => Scope::Since(x.min(y)),
            _ => Scope::All,
        };
        match sweep {
            Sweep::Incremental => Plan {
                gaps: earlier(window(Check::Leaks), window(Check::StoredDrift)),
                stale: window(Check::StaleDlq).unwrap_or(Scope::All),
                superseded: window(Check::SupersededVectors).unwrap_or(Scope::All),
                bad: window(Check::BadVectors),
                scan_duplicates: false,
            },
            Sweep::Full => Plan {
                gaps: Scope::All,
                stale: Scope::All,
                superseded: Scope::All,
                bad: window(Check::BadVectors),
                scan_duplicates: false,
            },
            Sweep::Deep => Plan {
                gaps: Scope::All,
                stale: Scope::All,
                superseded: Scope::All,
                bad: Some(Scope::All),
                scan_duplicates: true,
            },
        }
    }

    /// The scope of a windowed check (`None`: not checked).
    fn scope(&self, check: Check) -> Option<Scope> {
        match check {
            Check::Leaks | Check::StoredDrift => Some(self.gaps),
            Check::StaleDlq => Some(self.stale),
            Check::SupersededVectors => Some(self.superseded),
            Check::BadVectors => self.bad,
            _ => None,
        }
    }

    /// The earliest change any windowed check looks at (`None`: some check looks at every
    /// chunk).
    fn since(&self) -> Option<DateTime<Utc>> {
        let mut out: Option<DateTime<Utc>> = None;
        for c in WINDOWED {
            match self.scope(c) {
                Some(Scope::All) => return None,
                Some(Scope::Since(t)) => out = Some(out.map_or(t, |o| o.min(t))),
                None => {}
            }
        }
        out
    }
}

/// Events created before this instant may have outlived their dedup record (it lives
/// `dedup_ttl` from the last write to its hash, at or after the event's publish), with an
/// hour of margin for a relay that published late. A TTL too large for the clock means no
/// record has expired yet, never that all have.
fn records_expire_before(now: DateTime<Utc>, dedup_ttl: Duration) -> DateTime<Utc> {
    chrono::Duration::from_std(dedup_ttl.saturating_sub(Duration::from_secs(3600)))
        .ok()
        .and_then(|d| now.checked_sub_signed(d))
        .unwrap_or(DateTime::<Utc>::MIN_UTC)
}

/// What [`Reconciler::events_missing_from_stream`] found on a page.
#[derive(Default)]
struct StreamLookup<'r> {
    missing: Vec<&'r outbox::PublishedEvent>,
    trimmed: u64,
    expired: u64,
}

/// The stream findings of a run, and where the events check's next window starts.
struct StreamFindings {
    findings: Vec<Finding>,
    /// Whether the events check ran (it needs Redis).
    events_checked: bool,
    /// Where the next run's events check resumes: the outbox transactions its walk could not
    /// see yet, and those of the missing events it left unrepaired (a snapshot, text form).
    events_window: Option<String>,
}

/// The table findings of a run, and per windowed check the earliest change among findings
/// left unrepaired.
struct TableFindings {
    findings: Vec<Finding>,
    unrepaired: HashMap<Check, DateTime<Utc>>,
}

/// Runs the checks over one database and its streams; [`Reconciler::run_once`] is what the
/// `reconcile` command and the periodic loop of [`crate::serve`] call.
pub struct Reconciler {
    /// The database whose manifest, vectors, DLQ and outbox are checked.
    pub store: Store,
    /// Without Redis, the two stream checks are skipped (and say so).
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

    /// The table checks, one finding each, summed over every table the manifest or the DLQ
    /// names (an incremental run: every table with changed chunks, and this store's own),
    /// each checked with its own joins. A table that cannot be checked is named in the leaks
    /// finding's note.
    async fn table_findings(&self, repair: bool, plan: &Plan) -> Result<TableFindings, ReconcileError> {
        let mut names = vec![self.store.table_name().to_string()];
        let named = sql::tables_named(self.store.pool(), plan.since(), MAX_TABLES).await?;
        names.extend(named.into_iter().filter(|n| n != self.store.table_name()));
        let mut targets = Vec::new();
        let mut skipped_tables = Vec::new();
        for name in names {
            match self.store.target_for(&name).await {
                Ok(t) => targets.push(t),
                Err(StoreError::Target { problem, .. }) => skipped_tables.push(format!("{name}: {problem}")),
                Err(e) => return Err(e.into()),
            }
        }
        let several = targets.len() > 1;
        let mut merged: Vec<Finding> = TABLE_CHECKS
            .iter()
            .map(|&check| Finding { check, found: 0, examples: vec![], repaired: 0, note: None })
            .collect();
        let mut unrepaired: HashMap<Check, DateTime<Utc>> = HashMap::new();
        for target in &targets {
            for (mut f, oldest, note) in self.check_table(target, repair, plan).await? {
                if several {
                    for e in &mut f.examples {
                        *e = format!("{}:{e}", target.name);
                    }
                }
                let m = merged.iter_mut().find(|m| m.check == f.check).expect("a table check");
                m.found += f.found;
                m.repaired += f.repaired;
                m.add_examples(f.examples, self.config.examples);
                if let Some(note) = note {
                    m.note = Some(match m.note.take() {
                        Some(n) if n != note => format!("{n}; {note}"),
                        _ => note,
                    });
                }
                let left = f.found > 0 && (!repair || f.repaired < f.found);
                if let (true, Some(t)) = (left, oldest) {
                    let e = unrepaired.entry(f.check).or_insert(t);
                    *e = (*e).min(t);
                }
            }
        }
        if !skipped_tables.is_empty() {
            let m = merged.iter_mut().find(|m| m.check == Check::Leaks).expect("leaks");
            m.note = Some(format!("not checked: {}", skipped_tables.join("; ")));
        }
        if plan.bad.is_none() {
            let m = merged.iter_mut().find(|m| m.check == Check::BadVectors).expect("bad vectors");
            m.note = Some(
                "vectors not read: from now on those of changed chunks; every vector in a deep sweep".into(),
            );
        }
        Ok(TableFindings { findings: merged, unrepaired })
    }

    /// The table checks of one table: each finding, the earliest change among the rows it
    /// found, and a note.
    async fn check_table(
        &self,
        target: &TargetTable,
        repair: bool,
        plan: &Plan,
    ) -> Result<Vec<(Finding, Option<DateTime<Utc>>, Option<String>)>, ReconcileError> {
        let pool = self.store.pool();
        let (examples, page) = (self.config.examples, self.config.page());
        let mut out = Vec::with_capacity(TABLE_CHECKS.len());
        let (dups, note) =
            sql::duplicates_check(pool, target, examples, plan.scan_duplicates, repair).await?;
        out.push((finding(Check::Duplicates, dups), None, note));
        let (leaks, drift) = sql::gaps(pool, target, plan.gaps, examples, repair).await?;
        for (check, run) in [(Check::Leaks, leaks), (Check::StoredDrift, drift)] {
            let oldest = run.oldest_change;
            out.push((finding(check, run), oldest, None));
        }
        let stale = sql::stale_dlq(pool, target, plan.stale, examples, page, repair).await?;
        let oldest = stale.oldest_change;
        out.push((finding(Check::StaleDlq, stale), oldest, None));
        if let Some(scope) = plan.bad {
            let bad = sql::bad_vectors(pool, target, scope, examples, page, repair).await?;
            let oldest = bad.oldest_change;
            out.push((finding(Check::BadVectors, bad), oldest, None));
        }
        out.push(self.superseded_check(target, repair, plan.superseded).await?);
        Ok(out)
    }

    /// The `superseded_vectors` check of one table, judged by the store's
    /// [`OnNewerParked`] policy: under `withdraw` a vector of a parked chunk's previous text is a
    /// finding, and repair withdraws it; under `keep` it is what the policy asks for, so it
    /// is only counted in the note (no finding, no repair, and it holds no window open). A
    /// sweep over every chunk also counts, in the note, vectors with no manifest row (never
    /// repaired: see [`sql::vectors_without_manifest`]).
    async fn superseded_check(
        &self,
        target: &TargetTable,
        repair: bool,
        scope: Scope,
    ) -> Result<(Finding, Option<DateTime<Utc>>, Option<String>), ReconcileError> {
        let pool = self.store.pool();
        let (examples, page) = (self.config.examples, self.config.page());
        let withdraw = self.store.on_newer_parked() == OnNewerParked::Withdraw;
        let mut run =
            sql::superseded_vectors(pool, target, scope, examples, page, repair && withdraw).await?;
        let mut notes = Vec::new();
        if !withdraw && run.found > 0 {
            notes.push(format!(
                "{} kept on purpose (on_newer_parked = keep), e.g. {}",
                run.found,
                run.examples.join(", ")
            ));
            run = CheckRun::default();
        }
        if scope == Scope::All {
            let orphans = sql::vectors_without_manifest(pool, target, examples).await?;
            if orphans.found > 0 {
                notes.push(format!(
                    "{} vectors have no manifest row (left by a dlq purge, or written by another tool), e.g. {}; not repaired",
                    orphans.found,
                    orphans.examples.join(", ")
                ));
            }
        }
        let oldest = run.oldest_change;
        let note = (!notes.is_empty()).then(|| notes.join("; "));
        Ok((finding(Check::SupersededVectors, run), oldest, note))
    }

    /// The three stream checks, or (without Redis) three findings saying they were skipped.
    /// `events_window`: the events check looks at the events of the outbox transactions not
    /// visible in this snapshot (`None`: every retained event).
    async fn stream_findings(
        &self,
        repair: bool,
        events_window: Option<String>,
    ) -> Result<StreamFindings, ReconcileError> {
        let Some(mut redis) = self.redis.clone() else {
            let skipped =
                [Check::MissingEvents, Check::LostReplayWork, Check::OrphanStreamEntries].map(|check| {
                    Finding {
                        check,
                        found: 0,
                        examples: vec![],
                        repaired: 0,
                        note: Some("skipped: no Redis configured".into()),
                    }
                });
            return Ok(StreamFindings {
                findings: skipped.into(),
                events_checked: false,
                events_window: None,
            });
        };
        // The prefix was checked when the run started (`run_sweep`).
        crate::streams::check_shards(&mut redis, &self.keys).await?;
        let (missing, next_window) = self.missing_events_check(&mut redis, repair, events_window).await?;
        let [lost, orphans] = self.replay_stream_checks(&mut redis, repair).await?;
        Ok(StreamFindings {
            findings: vec![missing, lost, orphans],
            events_checked: true,
            events_window: next_window,
        })
    }

    /// Republishes the events Redis lost (a `FLUSHALL`, a restart without persistence, a
    /// cluster master restarted empty): the missing-events check with repair, alone, under
    /// the reconcile lock (so it never races a reconcile run's own republish), recording no
    /// run. `serve` calls it when a replayer finds a stream's consumer group gone, so lost
    /// events come back within seconds instead of at the next `reconcile --repair`. Returns
    /// the events marked for the relay to publish again (`None` without Redis).
    pub async fn republish_lost_events(&self) -> Result<Option<u64>, ReconcileError> {
        let Some(mut redis) = self.redis.clone() else { return Ok(None) };
        // Held until it is dropped at the end: rolled back, so nothing is recorded.
        let _lock = sql::RunLock::begin(self.store.pool()).await?;
        crate::streams::check_shards(&mut redis, &self.keys).await?;
        let (missing, _) = self.missing_events_check(&mut redis, true, None).await?;
        Ok(Some(missing.repaired))
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

    /// Published events must be on the events stream: pages through the published `events`
    /// rows of the outbox ([`ReconcileConfig::page`] at a time), reads the entry id each one
    /// became from its dedup record (the relay writes it when it publishes, see
    /// `redis/publish.lua`) and looks the entries up (per shard and page, one `XRANGE` over
    /// the page's entry ids: [`entries_present`]).
    ///
    /// With a `window` (an incremental run), only the rows of the outbox transactions not
    /// visible in that snapshot (what the relay published since the previous run's walk
    /// began, and the previous run's unrepaired findings), and the page
    /// of events just before it: the witnesses that what the previous runs checked is still
    /// there. A stream only ever loses its newest entries together with the older ones (a
    /// `FLUSHALL`, a restart without persistence or from an older snapshot, a failover to a
    /// replica that lagged), so a witness missing sends the check through every retained
    /// event; an entry deleted by hand from the middle of a stream is found by the next full
    /// sweep. Without a window, every retained event. Either walk ends at the outbox's
    /// position when it began: what a relay publishes meanwhile goes to the stream as it is
    /// now, and the next run's window covers it.
    ///
    /// An event whose record is gone was lost with the data of Redis, unless the record may
    /// have expired ([`ReconcileConfig::dedup_ttl`]): those are counted in the note. An entry
    /// older than the stream's first one, while the stream is at its length cap, was trimmed
    /// by policy and is not a finding. Repair deletes the event's dedup record (or the relay
    /// would take the republish for a duplicate) and hands the row back to the relay, which
    /// publishes it again with the same `event_id`. Rows an older relay published (before
    /// migration 0022) are not walked; rows past the outbox retention are gone. Returns the
    /// finding and where the next incremental walk starts.
    async fn missing_events_check(
        &self,
        redis: &mut RedisConn,
        repair: bool,
        window: Option<String>,
    ) -> Result<(Finding, Option<String>), ReconcileError> {
        use outbox::EventsPage;
        let pool = self.store.pool();
        let page = self.config.page();
        let mut out =
            Finding { check: Check::MissingEvents, found: 0, examples: vec![], repaired: 0, note: None };
        let at = outbox::position(pool).await?;
        // What this walk cannot see yet, plus its unrepaired findings: the next window.
        let mut next_window = outbox::Window::parse(at.lower());
        // A window ahead of the position was taken in another cluster (a logical restore:
        // the relay started its position again) and says nothing about this one's
        // transactions: every retained event is walked.
        let window = window.filter(|w| match (outbox::Window::parse(w), &next_window) {
            (Some(w), Some(now)) => !w.is_ahead_of(now),
            _ => true,
        });
        let mut since = None;
        let mut lost_before_window = false;
        if let Some(window) = window {
            let witnesses =
                outbox::published_events(pool, &EventsPage::PublishedBefore(window.clone()), page).await?;
            let missing = self.events_missing_from_stream(redis, &witnesses).await?;
            lost_before_window = !missing.missing.is_empty();
            if !lost_before_window {
                since = Some(window);
            }
        }
        let mut cursor = EventsPage::Published { since, after: (0, 0), at };
        let (mut trimmed, mut expired) = (0u64, 0u64);
        loop {
            let rows = outbox::published_events(pool, &cursor, page).await?;
            let Some(last) = rows.last() else { break };
            if let EventsPage::Published { after, .. } = &mut cursor {
                *after = (last.txid, last.id);
            }
            let found = self.events_missing_from_stream(redis, &rows).await?;
            trimmed += found.trimmed;
            expired += found.expired;
            let missing = found.missing;
            out.found += missing.len() as u64;
            out.add_examples(missing.iter().map(|r| r.key.clone()), self.config.examples);
            if repair && !missing.is_empty() {
                out.repaired += self.republish_events(redis, &missing).await?;
            } else if let Some(w) = next_window.as_mut() {
                w.hold(missing.iter().map(|r| r.txid));
            }
            if rows.len() < page {
                break;
            }
        }
        let mut notes = Vec::new();
        if lost_before_window {
            notes.push("events published before the previous run are gone from the stream: checked every retained event".to_string());
        }
        if trimmed > 0 {
            notes.push(format!("{trimmed} trimmed by the stream's length cap"));
        }
        if expired > 0 {
            notes.push(format!(
                "{expired} not checked: their dedup records may have expired (relay_marker_ttl_secs)"
            ));
        }
        out.note = (!notes.is_empty()).then(|| notes.join("; "));
        Ok((out, next_window.map(|w| w.to_string())))
    }

    /// Which of `rows` are not on their shard's events stream, how many more were trimmed by
    /// its length cap (missing, older than its first entry, while the stream is at the cap),
    /// and how many could not be checked (their record may have expired).
    async fn events_missing_from_stream<'r>(
        &self,
        redis: &mut RedisConn,
        rows: &'r [outbox::PublishedEvent],
    ) -> Result<StreamLookup<'r>, ReconcileError> {
        let mut by_shard: std::collections::BTreeMap<u16, Vec<&'r outbox::PublishedEvent>> =
            Default::default();
        for r in rows {
            by_shard.entry(r.identity.shard(&self.keys)).or_default().push(r);
        }
        let mut out = StreamLookup::default();
        let expiry = records_expire_before(chrono::Utc::now(), self.config.dedup_ttl);
        for (shard, rows) in by_shard {
            let records = self.records(redis, shard, &rows).await?;
            let mut recorded = Vec::with_capacity(rows.len());
            for (r, record) in rows.into_iter().zip(records) {
                match record {
                    Some(entry) => recorded.push((r, entry)),
                    None if r.created_at < expiry => out.expired += 1,
                    None => out.missing.push(r),
                }
            }
            let (m, t) = self.missing_from_shard(redis, shard, recorded).await?;
            out.missing.extend(m);
            out.trimmed += t;
        }
        out.missing.sort_by_key(|r| r.id);
        Ok(out)
    }

    /// The entry id each of `rows` (all of shard `shard`) became, from its dedup record
    /// (`None`: no record), in one pipeline: an `HMGET` per dedup hash, then a `GET` of the
    /// old-format marker of rows created before the hashes that had no field.
    async fn records(
        &self,
        redis: &mut RedisConn,
        shard: u16,
        rows: &[&outbox::PublishedEvent],
    ) -> Result<Vec<Option<String>>, ReconcileError> {
        let mut hours: Vec<&str> = rows.iter().map(|r| r.dedup_hour.as_str()).collect();
        hours.sort_unstable();
        hours.dedup();
        let mut pipe = redis::pipe();
        for hour in &hours {
            let fields: Vec<&str> =
                rows.iter().filter(|r| r.dedup_hour == *hour).map(|r| r.event_id.as_str()).collect();
            pipe.cmd("HMGET").arg(self.keys.dedup_hash(shard, hour)).arg(fields);
        }
        let per_hour: Vec<Vec<Option<String>>> = pipe.query_async(redis).await?;
        let mut found: HashMap<&str, String> = HashMap::new();
        for (hour, values) in hours.iter().zip(per_hour) {
            let of_hour = rows.iter().filter(|r| r.dedup_hour == *hour);
            for (r, v) in of_hour.zip(values) {
                if let Some(v) = v {
                    found.insert(r.event_id.as_str(), v);
                }
            }
        }
        let legacy: Vec<&&outbox::PublishedEvent> =
            rows.iter().filter(|r| r.legacy_marker && !found.contains_key(r.event_id.as_str())).collect();
        if !legacy.is_empty() {
            let mut pipe = redis::pipe();
            for r in &legacy {
                pipe.get(self.keys.legacy_marker(shard, &r.event_id));
            }
            let values: Vec<Option<String>> = pipe.query_async(redis).await?;
            for (r, v) in legacy.iter().zip(values) {
                if let Some(v) = v {
                    found.insert(r.event_id.as_str(), v);
                }
            }
        }
        Ok(rows.iter().map(|r| found.get(r.event_id.as_str()).cloned()).collect())
    }

    /// Which of `rows` (of shard `shard`, each with the entry id its record names) are not on
    /// the shard's events stream, and how many of those were trimmed by its length cap. One
    /// pipeline: one slot.
    async fn missing_from_shard<'r>(
        &self,
        redis: &mut RedisConn,
        shard: u16,
        rows: Vec<(&'r outbox::PublishedEvent, String)>,
    ) -> Result<(Vec<&'r outbox::PublishedEvent>, u64), ReconcileError> {
        if rows.is_empty() {
            return Ok((vec![], 0));
        }
        let stream = self.keys.events_of(shard);
        let mut wanted: Vec<(u64, u64)> =
            rows.iter().map(|(_, entry)| crate::streams::parse_entry_id(entry)).collect();
        wanted.sort_unstable();
        wanted.dedup();
        let present = entries_present(redis, &stream, &wanted).await?;
        // The stream's head after the lookups: trimming only moves it forward, so an entry
        // missing above is either below this head (trimmed) or deleted.
        let (len, head): (usize, redis::streams::StreamRangeReply) = redis::pipe()
            .cmd("XLEN")
            .arg(&stream)
            .cmd("XRANGE")
            .arg(&stream)
            .arg("-")
            .arg("+")
            .arg("COUNT")
            .arg(1)
            .query_async(redis)
            .await?;
        let capped = self.config.events_maxlen > 0 && len >= self.config.events_maxlen;
        let head = head.ids.first().map(|e| crate::streams::parse_entry_id(&e.id));
        let mut missing = Vec::new();
        let mut trimmed = 0u64;
        for (r, entry) in rows {
            let entry = crate::streams::parse_entry_id(&entry);
            if present.contains(&entry) {
                continue;
            }
            if capped && head.is_some_and(|h| entry < h) {
                trimmed += 1;
            } else {
                missing.push(r);
            }
        }
        Ok((missing, trimmed))
    }

    /// Has the relay publish `missing` events again: deletes their dedup records, and the
    /// markers an older relay may have written (or the relay would take the republish for a
    /// duplicate), then hands their rows back to the relay.
    async fn republish_events(
        &self,
        redis: &mut RedisConn,
        missing: &[&outbox::PublishedEvent],
    ) -> Result<u64, ReconcileError> {
        // One pipeline per shard: a cluster pipeline must stay in one slot.
        let mut by_shard: std::collections::BTreeMap<u16, redis::Pipeline> = Default::default();
        for r in missing {
            let shard = r.identity.shard(&self.keys);
            let forget = by_shard.entry(shard).or_insert_with(redis::pipe);
            forget.hdel(self.keys.dedup_hash(shard, &r.dedup_hour), &r.event_id).ignore();
            forget.del(self.keys.legacy_marker(shard, &r.event_id)).ignore();
        }
        for forget in by_shard.values() {
            let _: () = forget.query_async(redis).await?;
        }
        let ids: Vec<i64> = missing.iter().map(|r| r.id).collect();
        Ok(outbox::mark_unpublished(self.store.pool(), &ids).await?)
    }

    /// The replay stream against the DLQ, in one paged scan, for two checks:
    ///
    /// - lost replay work: rows handed out as work (leased) with no outstanding work item —
    ///   neither an unpublished outbox row nor a stream entry still to be processed (pending
    ///   in the group, or not yet delivered). Repair publishes them again.
    /// - orphan entries: entries still to be processed whose row is gone or has moved on to
    ///   another generation. Repair acknowledges and deletes them, page by page.
    ///
    /// Memory is bounded by the page: outstanding work items go into a temporary table and
    /// the lost rows are found set-based in Postgres. Order matters: the outbox snapshot is
    /// taken first (a row the relay publishes meanwhile is seen there, or on the stream), the
    /// stream is scanned next, and the DLQ rows are read last (a work item consumed meanwhile
    /// has already moved its row on). Candidates were enqueued before the transaction began
    /// (`now()` is its start), minus the grace period.
    async fn replay_stream_checks(
        &self,
        redis: &mut RedisConn,
        repair: bool,
    ) -> Result<[Finding; 2], ReconcileError> {
        let mut audit = WorkAudit::begin(self.store.pool()).await?;
        let orphans = self.orphan_entries_check(redis, &mut audit, repair).await?;
        audit.analyze().await?;
        let lost = self.lost_work_check(&mut audit, repair).await?;
        audit.finish().await?;
        Ok([lost, orphans])
    }

    /// Scans every shard's replay stream page by page: records every outstanding work item
    /// in `audit` and finds (and, with `repair`, acknowledges and deletes) the orphan entries.
    async fn orphan_entries_check(
        &self,
        redis: &mut RedisConn,
        audit: &mut WorkAudit,
        repair: bool,
    ) -> Result<Finding, ReconcileError> {
        let mut orphans = Finding {
            check: Check::OrphanStreamEntries,
            found: 0,
            examples: vec![],
            repaired: 0,
            note: None,
        };
        for shard in self.keys.shard_ids() {
            self.orphans_of_shard(redis, &self.keys.replay_of(shard), audit, repair, &mut orphans).await?;
        }
        Ok(orphans)
    }

    /// [`Reconciler::orphan_entries_check`] for one shard's replay stream.
    async fn orphans_of_shard(
        &self,
        redis: &mut RedisConn,
        stream: &str,
        audit: &mut WorkAudit,
        repair: bool,
        orphans: &mut Finding,
    ) -> Result<(), ReconcileError> {
        let page = self.config.page();
        let exists: bool = redis::cmd("EXISTS").arg(stream).query_async(redis).await?;
        if !exists {
            return Ok(());
        }
        // Where the group stands: entries after its last delivered id are still to be read.
        let groups: redis::streams::StreamInfoGroupsReply =
            redis::cmd("XINFO").arg("GROUPS").arg(stream).query_async(redis).await?;
        let group = groups.groups.into_iter().find(|g| g.name == REPLAY_GROUP);
        let last_delivered =
            group.as_ref().map(|g| crate::streams::parse_entry_id(&g.last_delivered_id)).unwrap_or((0, 0));
        let mut start = "-".to_string();
        loop {
            let entries: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
                .arg(stream)
                .arg(&start)
                .arg("+")
                .arg("COUNT")
                .arg(page)
                .query_async(redis)
                .await?;
            let (Some(first), Some(last)) = (entries.ids.first(), entries.ids.last()) else { break };
            let pending = match &group {
                Some(g) if g.pending > 0 => pending_between(redis, stream, &first.id, &last.id, page).await?,
                _ => HashSet::new(),
            };
            let outstanding: Vec<OutstandingEntry> = entries
                .ids
                .iter()
                .filter(|e| pending.contains(&e.id) || crate::streams::parse_entry_id(&e.id) > last_delivered)
                .map(|e| {
                    let items = crate::streams::work::from_entry(&e.map)
                        .map(|items| items.iter().map(|w| (w.dlq_id, w.generation)).collect());
                    (e.id.clone(), items)
                })
                .collect();
            let page_orphans = orphans_among(audit, outstanding).await?;
            orphans.found += page_orphans.len() as u64;
            orphans.add_examples(page_orphans.iter().cloned(), self.config.examples);
            if repair && !page_orphans.is_empty() {
                let mut pipe = redis::pipe();
                pipe.cmd("XACK").arg(stream).arg(REPLAY_GROUP).arg(&page_orphans).ignore();
                pipe.cmd("XDEL").arg(stream).arg(&page_orphans);
                let (deleted,): (u64,) = pipe.query_async(redis).await?;
                orphans.repaired += deleted;
            }
            if entries.ids.len() < page {
                break;
            }
            start = format!("({}", last.id);
        }
        Ok(())
    }

    /// Leased rows with no outstanding work item (found in `audit` after the stream scan);
    /// with `repair`, their leases are released so the scheduler issues them again.
    async fn lost_work_check(&self, audit: &mut WorkAudit, repair: bool) -> Result<Finding, ReconcileError> {
        let page = self.config.page();
        let mut lost =
            Finding { check: Check::LostReplayWork, found: 0, examples: vec![], repaired: 0, note: None };
        let mut after = 0i64;
        loop {
            let rows = audit.lost_work(self.config.lost_work_grace, after, page).await?;
            let Some(last) = rows.last() else { break };
            after = last.0;
            lost.found += rows.len() as u64;
            lost.add_examples(rows.iter().map(|(_, key)| key.clone()), self.config.examples);
            if repair {
                // Released, not issued here: the scheduler issues them again within the
                // outstanding cap at its next pass.
                let ids: Vec<i64> = rows.iter().map(|(id, _)| *id).collect();
                lost.repaired += self.store.release_leases(&ids).await?;
            }
            if rows.len() < page {
                break;
            }
        }
        Ok(lost)
    }
}

/// Most stream entries one batched lookup of [`entries_present`] reads per entry id it looks
/// for: the events of one page of the outbox lie close together on their shard's stream (the
/// relay publishes in outbox order), so a range over them holds little else.
const LOOKUP_SPAN_FACTOR: usize = 2;

/// Which of `wanted` (sorted, distinct entry ids) are on `stream`, in one `XRANGE` from the
/// first to the last of them, cut at [`LOOKUP_SPAN_FACTOR`] entries per id: every entry in
/// `first..=last` comes back unless the reply is cut, so an id the reply covers and does not
/// hold is not on the stream. Ids past a cut reply (a range that holds many other entries:
/// events of rows published out of order, or of other pages) are looked up one by one, in one
/// pipeline, as before this batching: each reply is bounded by its `COUNT`, and a page costs
/// one round trip where it cost one command per event.
async fn entries_present(
    redis: &mut RedisConn,
    stream: &str,
    wanted: &[(u64, u64)],
) -> Result<HashSet<(u64, u64)>, ReconcileError> {
    let (Some(first), Some(last)) = (wanted.first(), wanted.last()) else {
        return Ok(HashSet::new());
    };
    let id = |(ms, seq): (u64, u64)| format!("{ms}-{seq}");
    let count = wanted.len().saturating_mul(LOOKUP_SPAN_FACTOR);
    let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
        .arg(stream)
        .arg(id(*first))
        .arg(id(*last))
        .arg("COUNT")
        .arg(count)
        .query_async(redis)
        .await?;
    let on_stream: HashSet<(u64, u64)> =
        reply.ids.iter().map(|e| crate::streams::parse_entry_id(&e.id)).collect();
    // Everything up to the last entry returned is covered; with a reply shorter than COUNT,
    // everything is.
    let covered = match reply.ids.last() {
        Some(e) if reply.ids.len() >= count => crate::streams::parse_entry_id(&e.id),
        _ => *last,
    };
    let mut present: HashSet<(u64, u64)> = wanted.iter().copied().filter(|w| on_stream.contains(w)).collect();
    let rest: Vec<(u64, u64)> = wanted.iter().copied().filter(|w| *w > covered).collect();
    if !rest.is_empty() {
        let mut pipe = redis::pipe();
        for w in &rest {
            pipe.cmd("XRANGE").arg(stream).arg(id(*w)).arg(id(*w)).arg("COUNT").arg(1);
        }
        let hits: Vec<Vec<redis::Value>> = pipe.query_async(redis).await?;
        present.extend(rest.iter().zip(&hits).filter(|(_, hit)| !hit.is_empty()).map(|(w, _)| *w));
    }
    Ok(present)
}

/// The ids of the group's pending entries of `stream` between `first` and `last`
/// (inclusive), read `page` at a time.
async fn pending_between(
    redis: &mut RedisConn,
    stream: &str,
    first: &str,
    last: &str,
    page: usize,
) -> Result<HashSet<String>, ReconcileError> {
    let mut out = HashSet::new();
    let mut start = first.to_string();
    loop {
        let reply: redis::streams::StreamPendingCountReply = redis::cmd("XPENDING")
            .arg(stream)
            .arg(REPLAY_GROUP)
            .arg(&start)
            .arg(last)
            .arg(page)
            .query_async(redis)
            .await?;
        let n = reply.ids.len();
        if let Some(p) = reply.ids.last() {
            start = format!("({}", p.id);
        }
        out.extend(reply.ids.into_iter().map(|p| p.id));
        if n < page {
            return Ok(out);
        }
    }
}

/// Publishes a reconcile report as gauges: findings by check, duration, time of success.
pub(crate) fn publish_report(r: &Report) {
    use crate::metrics::{RECONCILE_DURATION, RECONCILE_FINDINGS, RECONCILE_LAST_SUCCESS};
    for f in &r.findings {
        metrics::gauge!(RECONCILE_FINDINGS, "check" => f.check.name()).set(f.found as f64);
    }
    metrics::gauge!(RECONCILE_DURATION).set(r.duration_secs);
    metrics::gauge!(RECONCILE_LAST_SUCCESS).set(chrono::Utc::now().timestamp() as f64);
}

/// Sets every check's findings gauge to zero, so dashboards and alerts see zeros before the
/// first finding.
pub(crate) fn publish_zero_findings() {
    for c in Check::ALL {
        metrics::gauge!(crate::metrics::RECONCILE_FINDINGS, "check" => c.name()).set(0.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn previous(full: Option<f64>, deep: Option<f64>, resume: &[Check]) -> sql::Previous {
        let at = chrono::Utc::now();
        sql::Previous {
            secs_since_full: full,
            secs_since_deep: deep,
            resume: resume.iter().map(|c| (c.name().to_string(), at)).collect(),
            events_window: None,
        }
    }

    #[test]
    fn a_dedup_record_expires_after_its_ttl_less_an_hour_and_a_huge_ttl_never() {
        let now = chrono::Utc::now();
        let day = Duration::from_secs(86_400);
        assert_eq!(records_expire_before(now, day), now - chrono::Duration::hours(23));
        assert_eq!(records_expire_before(now, Duration::from_secs(60)), now, "under the margin");
        assert_eq!(records_expire_before(now, Duration::MAX), DateTime::<Utc>::MIN_UTC);
        assert_eq!(records_expire_before(now, Duration::from_secs(u64::MAX / 4)), DateTime::<Utc>::MIN_UTC);
    }

    #[test]
    fn the_schedule_goes_deep_then_full_then_incremental() {
        let hour = Duration::from_secs(3600);
        let policy = SweepPolicy::Scheduled { full_every: hour, deep_every: Some(24 * hour) };
        // Never ran: deep.
        assert_eq!(policy.pick(&previous(None, None, &[])), Sweep::Deep);
        // A recent deep run with resume points: incremental.
        assert_eq!(policy.pick(&previous(Some(60.0), Some(60.0), &WINDOWED)), Sweep::Incremental);
        // Resume points missing (runs from before sweeps existed): full.
        assert_eq!(policy.pick(&previous(Some(60.0), Some(60.0), &[])), Sweep::Full);
        // bad_vectors alone may be missing: its window starts at the next run.
        let three = [Check::Leaks, Check::StoredDrift, Check::StaleDlq];
        assert_eq!(policy.pick(&previous(Some(60.0), Some(60.0), &three)), Sweep::Incremental);
        // Full due, deep not.
        assert_eq!(policy.pick(&previous(Some(3600.0), Some(3600.0), &WINDOWED)), Sweep::Full);
        // Deep due.
        assert_eq!(policy.pick(&previous(Some(60.0), Some(86_400.0), &WINDOWED)), Sweep::Deep);
        // Never deep; full every run.
        let never = SweepPolicy::Scheduled { full_every: Duration::ZERO, deep_every: None };
        assert_eq!(never.pick(&previous(None, None, &[])), Sweep::Full);
        assert_eq!(never.pick(&previous(Some(0.5), None, &WINDOWED)), Sweep::Full);
        assert_eq!(
            SweepPolicy::Always(Sweep::Incremental).pick(&previous(None, None, &[])),
            Sweep::Incremental
        );
    }

    #[test]
    fn an_incremental_plan_resumes_each_check_where_it_left_off() {
        let t = |s: i64| chrono::DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap();
        let resume: HashMap<String, DateTime<Utc>> = [
            ("leaks".to_string(), t(10)),
            ("stored_drift".to_string(), t(5)),
            ("stale_dlq".to_string(), t(20)),
            ("superseded_vectors".to_string(), t(30)),
        ]
        .into();
        let plan = Plan::new(Sweep::Incremental, &resume);
        assert_eq!(plan.gaps, Scope::Since(t(5)), "leaks and drift share the earlier start");
        assert_eq!(plan.stale, Scope::Since(t(20)));
        assert_eq!(plan.superseded, Scope::Since(t(30)));
        assert_eq!(plan.bad, None, "no window yet: no vector is read");
        assert_eq!(plan.since(), Some(t(5)));
        let full = Plan::new(Sweep::Full, &resume);
        assert_eq!((full.gaps, full.stale, full.bad, full.since()), (Scope::All, Scope::All, None, None));
        assert_eq!(full.superseded, Scope::All, "a full sweep also finds vectors without a manifest row");
        // A window not recorded yet (runs of a release before the check): that check looks at
        // every chunk, the others keep theirs.
        let mut older = resume.clone();
        older.remove("superseded_vectors");
        let plan = Plan::new(Sweep::Incremental, &older);
        assert_eq!((plan.superseded, plan.stale, plan.since()), (Scope::All, Scope::Since(t(20)), None));
        let deep = Plan::new(Sweep::Deep, &resume);
        assert_eq!((deep.bad, deep.scan_duplicates), (Some(Scope::All), true));
        // No resume point for a check: that check looks at every chunk.
        let plan = Plan::new(Sweep::Incremental, &HashMap::new());
        assert_eq!((plan.gaps, plan.stale, plan.since()), (Scope::All, Scope::All, None));
    }
}
