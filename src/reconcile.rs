//! The reconciler: proves that the manifest, the vector table, the DLQ, the outbox and the
//! Redis streams agree, and repairs what can be repaired safely.
//!
//! Every check is one set-based SQL statement or a paged scan (of a stream, or of outbox rows
//! against a stream), so a run stays cheap at a million chunks and its memory is bounded by
//! the page size (`ReconcileConfig::page`), not by the size of the data. [`Reconciler::run_once`] returns a [`Report`]; in repair mode
//! each repairable check fixes what it found in one statement (or one Redis pipeline), and a
//! second run is clean. Each run is recorded in `reconcile_runs` (for the "reconcile not run
//! recently" alert, whatever process runs it).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::store::reconcile::{self as sql, CheckRun, MAX_TABLES, TableCheck, WorkAudit};
use crate::store::{Store, StoreError, TargetTable, outbox};
use crate::streams::RedisConn;
use crate::streams::{REPLAY_GROUP, StreamKeys};
use serde::Serialize;

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
    pub const ALL: [Check; 10] = [
        Check::Leaks,
        Check::Duplicates,
        Check::StoredDrift,
        Check::StaleDlq,
        Check::BadVectors,
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
            Check::MissingEvents => Some("re-publish from the outbox"),
            Check::LostReplayWork => Some("re-publish through the outbox"),
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
    /// Wall-clock duration of the run.
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

/// Thresholds of the checks, and the page size that bounds a run's memory.
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
}

/// The checks made per target table, in report order, with the statement each one runs.
const TABLE_CHECKS: [(Check, TableCheck); 5] = [
    (Check::Leaks, TableCheck::Leaks),
    (Check::Duplicates, TableCheck::Duplicates),
    (Check::StoredDrift, TableCheck::StoredDrift),
    (Check::StaleDlq, TableCheck::StaleDlq),
    (Check::BadVectors, TableCheck::BadVectors),
];

impl Finding {
    /// Adds examples until the finding holds `limit`.
    fn add_examples(&mut self, examples: impl IntoIterator<Item = String>, limit: usize) {
        let room = limit.saturating_sub(self.examples.len());
        self.examples.extend(examples.into_iter().take(room));
    }
}

/// Records the page's `outstanding` work items (entry id, and the DLQ row and generation it
/// carries, if readable) in `audit`; returns the entries whose row is gone or has moved on to
/// another generation, and the unreadable ones.
async fn orphans_among(
    audit: &mut WorkAudit,
    outstanding: Vec<(String, Option<(i64, i64)>)>,
) -> Result<Vec<String>, ReconcileError> {
    let (ids, gens): (Vec<i64>, Vec<i64>) = outstanding.iter().filter_map(|(_, w)| *w).unzip();
    audit.record_outstanding(&ids, &gens).await?;
    let live: HashMap<i64, i64> = audit.live_generations(&ids).await?;
    Ok(outstanding
        .into_iter()
        .filter(|(_, w)| match w {
            Some((dlq_id, generation)) => live.get(dlq_id) != Some(generation),
            None => true,
        })
        .map(|(id, _)| id)
        .collect())
}

/// A check's result as the report shows it.
fn finding(check: Check, run: CheckRun) -> Finding {
    Finding { check, found: run.found, examples: run.examples, repaired: run.repaired, note: None }
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
    /// Thresholds and page size.
    pub config: ReconcileConfig,
}

impl Reconciler {
    /// One run of every check.
    pub async fn run_once(&mut self, mode: Mode) -> Result<Report, ReconcileError> {
        let started = Instant::now();
        let started_at = chrono::Utc::now();
        let repair = mode == Mode::Repair;
        let pool = self.store.pool();
        let mut findings = Vec::with_capacity(Check::ALL.len());
        findings.extend(self.table_findings(repair).await?);
        findings.push(self.outbox_check().await?);
        findings.extend(self.stream_findings(repair).await?);
        let stalled = sql::replay_stalled(pool, self.config.replay_stall_after, self.config.examples).await?;
        findings.push(finding(Check::ReplayStalled, stalled));
        let report = Report { findings, mode, duration_secs: started.elapsed().as_secs_f64() };
        let findings_json = serde_json::to_value(&report.findings).expect("findings serialize");
        sql::record_run(pool, started_at, repair, findings_json).await?;
        Ok(report)
    }

    /// The table checks ([`TABLE_CHECKS`]), one finding each, summed over every table the
    /// manifest or the DLQ names (each checked with its own joins). A table that cannot be
    /// checked is named in the leaks finding's note.
    async fn table_findings(&self, repair: bool) -> Result<Vec<Finding>, ReconcileError> {
        let mut targets = Vec::new();
        let mut skipped_tables = Vec::new();
        for name in self.store.known_tables(MAX_TABLES).await? {
            match self.store.target_for(&name).await {
                Ok(t) => targets.push(t),
                Err(StoreError::Target { problem, .. }) => skipped_tables.push(format!("{name}: {problem}")),
                Err(e) => return Err(e.into()),
            }
        }
        let several = targets.len() > 1;
        let mut per_table: Vec<Vec<Finding>> = Vec::with_capacity(targets.len());
        for target in &targets {
            per_table.push(self.check_table(target, several, repair).await?);
        }
        let mut findings = Vec::with_capacity(TABLE_CHECKS.len());
        for (n, (check, _)) in TABLE_CHECKS.into_iter().enumerate() {
            let mut merged = Finding { check, found: 0, examples: vec![], repaired: 0, note: None };
            for f in per_table.iter().map(|fs| &fs[n]) {
                merged.found += f.found;
                merged.repaired += f.repaired;
                merged.add_examples(f.examples.iter().cloned(), self.config.examples);
            }
            if check == Check::Leaks && !skipped_tables.is_empty() {
                merged.note = Some(format!("not checked: {}", skipped_tables.join("; ")));
            }
            findings.push(merged);
        }
        Ok(findings)
    }

    /// The table checks of one table, in [`TABLE_CHECKS`] order. With `several` tables, each
    /// example is prefixed with its table's name.
    async fn check_table(
        &self,
        target: &TargetTable,
        several: bool,
        repair: bool,
    ) -> Result<Vec<Finding>, ReconcileError> {
        let mut out = Vec::with_capacity(TABLE_CHECKS.len());
        for (check, table_check) in TABLE_CHECKS {
            let run = sql::table_check(self.store.pool(), target, table_check, self.config.examples, repair)
                .await?;
            out.push(finding(check, run));
        }
        if several {
            for f in &mut out {
                for e in &mut f.examples {
                    *e = format!("{}:{e}", target.name);
                }
            }
        }
        Ok(out)
    }

    /// The three stream checks, or (without Redis) three findings saying they were skipped.
    async fn stream_findings(&self, repair: bool) -> Result<Vec<Finding>, ReconcileError> {
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
            return Ok(skipped.into());
        };
        crate::streams::check_shards(&mut redis, &self.keys).await?;
        let missing = self.missing_events_check(&mut redis, repair).await?;
        let [lost, orphans] = self.replay_stream_checks(&mut redis, repair).await?;
        Ok(vec![missing, lost, orphans])
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

    /// Events marked published must be on the events stream: pages through the published
    /// `events` rows of the outbox (by id, [`ReconcileConfig::page`] at a time) and looks up
    /// the entry id each one recorded at publish time (one pipelined `XRANGE id id` per row).
    /// An entry older than the stream's first one, while the stream is at its length cap, was
    /// trimmed by policy and is not a finding. Repair deletes the event's dedup marker (or
    /// the relay would take the republish for a duplicate) and marks the row unpublished: the
    /// relay publishes it again with the same `event_id`. Rows published before migration
    /// 0005 have no entry id and are skipped; rows past the outbox retention are gone.
    async fn missing_events_check(
        &self,
        redis: &mut RedisConn,
        repair: bool,
    ) -> Result<Finding, ReconcileError> {
        let page = self.config.page();
        let mut after = 0i64;
        let mut trimmed = 0u64;
        let mut out =
            Finding { check: Check::MissingEvents, found: 0, examples: vec![], repaired: 0, note: None };
        loop {
            let rows = outbox::published_events(self.store.pool(), after, page).await?;
            let Some(last) = rows.last() else { break };
            after = last.id;
            let (missing, page_trimmed) = self.events_missing_from_stream(redis, &rows).await?;
            trimmed += page_trimmed;
            out.found += missing.len() as u64;
            out.add_examples(missing.iter().map(|r| r.key.clone()), self.config.examples);
            if repair && !missing.is_empty() {
                out.repaired += self.republish_events(redis, &missing).await?;
            }
            if rows.len() < page {
                break;
            }
        }
        out.note = (trimmed > 0).then(|| format!("{trimmed} trimmed by the stream's length cap"));
        Ok(out)
    }

    /// Which of `rows` are not on their shard's events stream, and how many more were
    /// trimmed by its length cap (missing, older than its first entry, while the stream is at
    /// the cap).
    async fn events_missing_from_stream<'r>(
        &self,
        redis: &mut RedisConn,
        rows: &'r [outbox::PublishedEvent],
    ) -> Result<(Vec<&'r outbox::PublishedEvent>, u64), ReconcileError> {
        let mut by_shard: std::collections::BTreeMap<u16, Vec<&'r outbox::PublishedEvent>> =
            Default::default();
        for r in rows {
            by_shard.entry(r.identity.shard(&self.keys)).or_default().push(r);
        }
        let (mut missing, mut trimmed) = (Vec::new(), 0);
        for (shard, rows) in by_shard {
            let (m, t) = self.missing_from_shard(redis, shard, rows).await?;
            missing.extend(m);
            trimmed += t;
        }
        missing.sort_by_key(|r| r.id);
        Ok((missing, trimmed))
    }

    /// [`Reconciler::events_missing_from_stream`] for the rows of one shard (one pipeline:
    /// one slot).
    async fn missing_from_shard<'r>(
        &self,
        redis: &mut RedisConn,
        shard: u16,
        rows: Vec<&'r outbox::PublishedEvent>,
    ) -> Result<(Vec<&'r outbox::PublishedEvent>, u64), ReconcileError> {
        let stream = self.keys.events_of(shard);
        let mut pipe = redis::pipe();
        for r in &rows {
            pipe.cmd("XRANGE").arg(&stream).arg(&r.entry_id).arg(&r.entry_id).arg("COUNT").arg(1);
        }
        let present: Vec<Vec<redis::Value>> = pipe.query_async(redis).await?;
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
        for (r, hit) in rows.into_iter().zip(&present) {
            if !hit.is_empty() {
                continue;
            }
            let entry = crate::streams::parse_entry_id(&r.entry_id);
            if capped && head.is_some_and(|h| entry < h) {
                trimmed += 1;
            } else {
                missing.push(r);
            }
        }
        Ok((missing, trimmed))
    }

    /// Has the relay publish `missing` events again: deletes their dedup markers (or the
    /// relay would take the republish for a duplicate), then marks their rows unpublished.
    async fn republish_events(
        &self,
        redis: &mut RedisConn,
        missing: &[&outbox::PublishedEvent],
    ) -> Result<u64, ReconcileError> {
        let mut del = redis::cmd("DEL");
        for r in missing {
            del.arg(self.keys.outbox_marker(r.identity.shard(&self.keys), &r.event_id));
        }
        let _: i64 = del.query_async(redis).await?;
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
            let outstanding: Vec<(String, Option<(i64, i64)>)> = entries
                .ids
                .iter()
                .filter(|e| pending.contains(&e.id) || crate::streams::parse_entry_id(&e.id) > last_delivered)
                .map(|e| {
                    (e.id.clone(), crate::streams::work::from_entry(&e.map).map(|w| (w.dlq_id, w.generation)))
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
    /// with `repair`, enqueued again.
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
                let ids: Vec<i64> = rows.iter().map(|(id, _)| *id).collect();
                let lease = crate::replay::ReplayConfig::default().lease;
                lost.repaired += self.store.enqueue_ids(&ids, lease).await?;
            }
            if rows.len() < page {
                break;
            }
        }
        Ok(lost)
    }
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
