//! The sweep policy: what a run's table checks look at. The three [`Sweep`]s (incremental,
//! full, deep), the [`SweepPolicy`] that picks each run's sweep from the recorded runs, and the
//! plan that turns a sweep and the previous run's resume points into each check's scope.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::checks::Check;
use super::sql::{self, Scope};

/// What a run's table checks look at; see [the module doc](super).
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
///
/// [`Reconciler::run_once`]: super::Reconciler::run_once
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
    pub(super) fn pick(self, previous: &sql::Previous) -> Sweep {
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

/// The checks whose window an incremental run resumes, per check, where the previous run
/// left off: they look at chunks (manifest rows) and can be limited to the changed ones.
pub(super) const WINDOWED: [Check; 5] =
    [Check::Leaks, Check::StoredDrift, Check::StaleDlq, Check::BadVectors, Check::SupersededVectors];

/// What each table check of one run looks at.
#[derive(Debug, Clone, Copy)]
pub(super) struct Plan {
    /// Leaks and stored drift (one scan).
    pub(super) gaps: Scope,
    pub(super) stale: Scope,
    pub(super) superseded: Scope,
    /// `None`: no vector is read (a full or incremental sweep with no earlier window).
    pub(super) bad: Option<Scope>,
    /// Scan for duplicates even where the unique index rules them out.
    pub(super) scan_duplicates: bool,
}

impl Plan {
    /// The plan of `sweep` given where the previous run left off (`resume`).
    pub(super) fn new(sweep: Sweep, resume: &HashMap<String, DateTime<Utc>>) -> Plan {
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
    pub(super) fn since(&self) -> Option<DateTime<Utc>> {
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
