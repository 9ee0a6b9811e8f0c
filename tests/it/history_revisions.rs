//! The history's revision operations (issue 46), on [`REVISED`] only: `revision_create` (a
//! shadow of another model and dimension; the first adopts the table), `backfill` and
//! `backfill_killed` (a fan-out ingest of the newest corpus, SIGKILLed at a random moment),
//! `activate` (sometimes after a healthy backfill, as an operator would; refused while the
//! shadow does not cover the active revision), `rollback` and `retire`. The history keeps its
//! own record of each revision's model, dimension and state from the commands' exit codes
//! and the documented rules; the checks compare the product with it.
//!
//! A probe reads the query name every 100 ms from the first `revision_create` to the end:
//! every answer must be one revision whole (one vector dimension: consecutive revisions never
//! share one) and never empty once it held rows, and the dimension it answers must be the
//! one of the revision the history's record says is active.

use super::*;

/// The table whose revisions the history moves.
pub(super) const REVISED: &str = TABLES[1];

/// Dimensions a revision is made at: each new one differs from the active one's, so that the
/// probe tells revisions apart by their vectors.
const REVISION_DIMS: [usize; 3] = [768, 384, 256];

/// A revision's state in the history's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RevState {
    Active,
    Shadow,
    Previous,
}

/// One revision of [`REVISED`] as the history records it.
#[derive(Debug, Clone)]
pub(super) struct RevModel {
    pub(super) n: i32,
    pub(super) model: String,
    pub(super) dims: usize,
    pub(super) state: RevState,
}

/// What the checks read of one revision of a table (a table never revised: itself).
#[derive(Debug, Clone)]
pub(super) struct Checked {
    /// The name its manifest and DLQ rows record.
    pub(super) identity: String,
    /// Where its vectors are read: the query name for the active revision (which so checks
    /// that the name answers the revision the record says is active), else its relation.
    pub(super) relation: String,
    pub(super) model: String,
    pub(super) dims: usize,
    pub(super) active: bool,
}

/// What the probe of the query name saw.
#[derive(Debug, Default)]
pub(super) struct ProbeLog {
    pub(super) answers: u64,
    /// Answers that were not one revision whole, or empty after rows, or an error.
    pub(super) bad: Vec<String>,
    /// The dimensions answered, each change once, in order.
    pub(super) dims_seen: Vec<i32>,
    seen_rows: bool,
}

/// The probe task: reads the query name until stopped.
pub(super) struct NameProbe {
    pub(super) log: std::sync::Arc<std::sync::Mutex<ProbeLog>>,
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl NameProbe {
    fn start(pool: sqlx::PgPool) -> NameProbe {
        let log = std::sync::Arc::new(std::sync::Mutex::new(ProbeLog::default()));
        let stop = tokio_util::sync::CancellationToken::new();
        let task = tokio::spawn({
            let (log, stop) = (log.clone(), stop.clone());
            async move {
                let sql = format!(
                    "SELECT count(*), min(vector_dims(embedding)), max(vector_dims(embedding)) FROM {REVISED}"
                );
                while !stop.is_cancelled() {
                    let answer = sqlx::query_as::<_, (i64, Option<i32>, Option<i32>)>(sqlx::AssertSqlSafe(
                        sql.clone(),
                    ))
                    .fetch_one(&pool)
                    .await;
                    {
                        let mut l = log.lock().unwrap();
                        l.answers += 1;
                        match answer {
                            Ok((n, lo, hi)) => {
                                if lo != hi {
                                    l.bad.push(format!("a mix: {n} rows of dimensions {lo:?}..{hi:?}"));
                                } else if n == 0 && l.seen_rows {
                                    l.bad.push("an empty answer after rows".into());
                                }
                                l.seen_rows |= n > 0;
                                if let Some(d) = hi
                                    && l.dims_seen.last() != Some(&d)
                                {
                                    l.dims_seen.push(d);
                                }
                            }
                            Err(e) => l.bad.push(format!("an error: {e}")),
                        }
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                        _ = stop.cancelled() => {}
                    }
                }
            }
        });
        NameProbe { log, stop, task }
    }

    pub(super) async fn stop(self) -> std::sync::Arc<std::sync::Mutex<ProbeLog>> {
        self.stop.cancel();
        let _ = self.task.await;
        self.log
    }
}

impl History {
    /// The revisions a check of `table` reads, the active one first.
    pub(super) fn checked(&self, table: &str) -> Vec<Checked> {
        if table != REVISED || self.revisions.is_empty() {
            return vec![Checked {
                identity: table.into(),
                relation: table.into(),
                model: MODEL.into(),
                dims: DIMS,
                active: true,
            }];
        }
        let mut out: Vec<Checked> = self
            .revisions
            .iter()
            .map(|r| Checked {
                identity: if r.n == 1 { table.to_string() } else { format!("public.{table}__r{}", r.n) },
                relation: if r.state == RevState::Active {
                    table.to_string()
                } else {
                    format!("public.{table}__r{}", r.n)
                },
                model: r.model.clone(),
                dims: r.dims,
                active: r.state == RevState::Active,
            })
            .collect();
        out.sort_by_key(|c| !c.active);
        out
    }

    fn active_revision(&self) -> Option<&RevModel> {
        self.revisions.iter().find(|r| r.state == RevState::Active)
    }

    fn revision_in(&self, state: RevState) -> Option<i32> {
        self.revisions.iter().find(|r| r.state == state).map(|r| r.n)
    }

    /// Runs `embed-dlq revision ARGS --table REVISED`; its exit code and stderr.
    async fn revision_cli(&self, args: &[&str]) -> (Option<i32>, String) {
        let mut c = binary();
        c.arg("revision")
            .args(args)
            .args(["--table", REVISED, "--database-url", &self.db.url, "--redis-url", &self.redis.url()])
            .env("EMBED_DLQ_STREAM_PREFIX", &self.prefix);
        let out = c.output().await.unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    }

    /// One revision operation, chosen at random among those the record allows.
    pub(super) async fn revision_step(&mut self) {
        let has_shadow = self.revision_in(RevState::Shadow).is_some();
        let has_previous = self.revision_in(RevState::Previous).is_some();
        match self.rng.random_range(0..6) {
            0 if !has_shadow => self.revision_create().await,
            0 | 1 if has_shadow || has_previous => {
                let kill = self.rng.random_bool(0.5);
                self.backfill(kill, None).await
            }
            2 | 3 if has_shadow => self.activate().await,
            4 if has_previous => self.rollback().await,
            5 if has_previous || (has_shadow && self.revisions.len() > 2) => self.retire().await,
            _ if !has_shadow => self.revision_create().await,
            _ => self.activate().await,
        }
    }

    /// `revision create`: a shadow of a new model, at a dimension other than the active
    /// revision's; the first one adopts the table as revision 1 (model `mock`).
    async fn revision_create(&mut self) {
        let active_dims = self.active_revision().map_or(DIMS, |r| r.dims);
        let choices: Vec<usize> = REVISION_DIMS.into_iter().filter(|&d| d != active_dims).collect();
        let dims = choices[self.rng.random_range(0..choices.len())];
        let n = self.revisions.iter().map(|r| r.n).max().unwrap_or(1) + 1;
        let model = format!("mock-r{n}");
        let dims_arg = dims.to_string();
        let mut args =
            vec!["create", "--model", &model, "--dimensions", &dims_arg, "--request-dimensions", &dims_arg];
        if self.revisions.is_empty() {
            args.extend(["--active-model", MODEL]);
        }
        let (code, stderr) = self.revision_cli(&args).await;
        assert_eq!(code, Some(0), "seed {}: revision create: {stderr}", self.seed);
        if self.revisions.is_empty() {
            self.revisions.push(RevModel { n: 1, model: MODEL.into(), dims: DIMS, state: RevState::Active });
            self.probe = Some(NameProbe::start(self.db.pool.clone()));
        }
        self.revisions.push(RevModel { n, model: model.clone(), dims, state: RevState::Shadow });
        self.note("revision_create", format!("revision {n}: {model} at {dims} dimensions"));
    }

    /// `revision backfill` of the newest corpus through a random provider (or `via`), maybe
    /// SIGKILLed at a random moment.
    async fn backfill(&mut self, kill: bool, via: Option<(&'static str, String)>) {
        let corpus = self.corpus_for(REVISED, false);
        let path = corpus.write(&self.dir);
        let (provider, url) = via.unwrap_or_else(|| self.providers.pick(&mut self.rng));
        let mut c = binary();
        c.args(["revision", "backfill"]).arg(&path);
        self.common_flags(&mut c, &url, &self.db.url);
        c.args([
            "--table",
            REVISED,
            "--batch-max-inputs",
            "64",
            "--concurrency",
            "4",
            "--no-progress",
            "--json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        let mut child = c.spawn().unwrap();
        let what = format!("v{} into {REVISED}'s revisions via {provider}", corpus.version);
        if kill {
            let after = Duration::from_millis(self.rng.random_range(20..1500));
            if tokio::time::timeout(after, child.wait()).await.is_err() {
                child.start_kill().unwrap();
                let _ = child.wait().await;
                self.kills += 1;
                self.note("backfill_killed", format!("{what}, SIGKILL after {after:?}"));
                return;
            }
        }
        let out = tokio::time::timeout(Duration::from_secs(600), child.wait_with_output())
            .await
            .expect("backfill finishes")
            .unwrap();
        let code = out.status.code();
        assert!(
            matches!(code, Some(0 | 4)),
            "seed {}: backfill {what} exited {code:?}: {}",
            self.seed,
            String::from_utf8_lossy(&out.stderr)
        );
        self.note("backfill", format!("{what}: exit {code:?}"));
    }

    /// `revision activate` of the shadow, after a healthy backfill half the time; refused
    /// (exit 2) while it does not cover the active revision.
    async fn activate(&mut self) {
        let Some(shadow) = self.revision_in(RevState::Shadow) else { return };
        if self.rng.random_bool(0.5) {
            let healthy = ("healthy", self.providers.healthy.base_url());
            self.backfill(false, Some(healthy)).await;
        }
        let n = shadow.to_string();
        let (code, stderr) = self.revision_cli(&["activate", "--revision", &n]).await;
        match code {
            Some(0) => {
                self.switch_to(shadow);
                self.note("activate", format!("revision {shadow}"));
            }
            Some(2) if stderr.contains("does not cover") => {
                self.note("activate_refused", format!("revision {shadow}: not covered"));
            }
            _ => panic!("seed {}: revision activate {shadow} exited {code:?}: {stderr}", self.seed),
        }
    }

    /// `revision activate --previous`: back to the previous revision, if it covers the
    /// active one.
    async fn rollback(&mut self) {
        let Some(previous) = self.revision_in(RevState::Previous) else { return };
        let (code, stderr) = self.revision_cli(&["activate", "--previous"]).await;
        match code {
            Some(0) => {
                self.switch_to(previous);
                self.note("rollback", format!("to revision {previous}"));
            }
            Some(2) if stderr.contains("does not cover") => {
                self.note("rollback_refused", format!("revision {previous}: not covered"));
            }
            _ => panic!("seed {}: rollback exited {code:?}: {stderr}", self.seed),
        }
    }

    /// The documented moves of a switch to `n`: the previous revision (if any) becomes a
    /// shadow, the active one the previous, `n` the active one.
    fn switch_to(&mut self, n: i32) {
        for r in &mut self.revisions {
            if r.state == RevState::Previous {
                r.state = RevState::Shadow;
            }
        }
        for r in &mut self.revisions {
            if r.state == RevState::Active {
                r.state = RevState::Previous;
            }
        }
        for r in &mut self.revisions {
            if r.n == n {
                r.state = RevState::Active;
            }
        }
    }

    /// `revision retire` of a revision that is not active (the previous one first); its
    /// relation must be gone after it.
    async fn retire(&mut self) {
        let Some(n) = self.revision_in(RevState::Previous).or_else(|| self.revision_in(RevState::Shadow))
        else {
            return;
        };
        let arg = n.to_string();
        let (code, stderr) = self.revision_cli(&["retire", "--revision", &arg, "--yes"]).await;
        assert_eq!(code, Some(0), "seed {}: revision retire {n}: {stderr}", self.seed);
        self.revisions.retain(|r| r.n != n);
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_class WHERE relname = $1")
            .bind(format!("{REVISED}__r{n}"))
            .fetch_one(&self.db.pool)
            .await
            .unwrap();
        if left != 0 {
            self.fault_problems.push(format!("revision {n} retired, its relation is still there"));
        }
        self.note("retire", format!("revision {n}"));
    }

    /// The probe's checks: no answer mixed revisions or was empty, and the name answers the
    /// dimension of the revision the record says is active.
    pub(super) async fn check_query_name(&mut self) -> Vec<(String, bool, String)> {
        let Some(probe) = self.probe.take() else { return Vec::new() };
        let log = probe.stop().await;
        let log = log.lock().unwrap();
        let mut checks = vec![(
            format!("{REVISED}: the query name never mixes revisions, never answers empty"),
            log.bad.is_empty(),
            format!(
                "{} answers, dimensions answered in turn {:?}; {}",
                log.answers,
                log.dims_seen,
                log.bad.iter().take(5).cloned().collect::<Vec<_>>().join("; ")
            ),
        )];
        if let Some(active) = self.active_revision() {
            let answered = log.dims_seen.last().copied();
            checks.push((
                format!("{REVISED}: the query name answers the active revision"),
                answered.is_none() || answered == Some(active.dims as i32),
                format!("revision {} at {} dimensions; answered {answered:?}", active.n, active.dims),
            ));
        }
        checks
    }
}
