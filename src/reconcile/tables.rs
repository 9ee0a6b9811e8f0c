//! The table checks of a run (leaks, duplicates, stored drift, stale DLQ rows, bad and
//! superseded vectors): every target table the manifest or the DLQ names is checked with its
//! own statements (`sql`), in the scopes the run's plan gives, and the results are merged
//! into one finding per check.

use std::collections::HashMap;

use chrono::{DateTime, Utc};

use super::checks::{Check, Finding, finding};
use super::sql::{self, CheckRun, MAX_TABLES, Scope};
use super::sweep::Plan;
use super::{ReconcileError, Reconciler};
use crate::store::park::OnNewerParked;
use crate::store::{StoreError, TargetTable};

/// The table checks, in report order.
const TABLE_CHECKS: [Check; 6] = [
    Check::Leaks,
    Check::Duplicates,
    Check::StoredDrift,
    Check::StaleDlq,
    Check::BadVectors,
    Check::SupersededVectors,
];

/// The table findings of a run, and per windowed check the earliest change among findings
/// left unrepaired.
pub(super) struct TableFindings {
    pub(super) findings: Vec<Finding>,
    pub(super) unrepaired: HashMap<Check, DateTime<Utc>>,
}

impl Reconciler {
    /// The table checks, one finding each, summed over every table the manifest or the DLQ
    /// names (an incremental run: every table with changed chunks, and this store's own),
    /// each checked with its own joins. A table that cannot be checked is named in the leaks
    /// finding's note.
    pub(super) async fn table_findings(
        &self,
        repair: bool,
        plan: &Plan,
    ) -> Result<TableFindings, ReconcileError> {
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
}
