//! What a run returns and how it is published: the [`Mode`] it ran in, its [`Report`], and
//! the report as gauges (findings by check, duration, time of success).

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::checks::{Check, Finding};
use super::sweep::Sweep;

/// The result of one [`Reconciler::run_once`]: one finding per check, serialisable for
/// `--json` and the metrics.
///
/// [`Reconciler::run_once`]: super::Reconciler::run_once
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
