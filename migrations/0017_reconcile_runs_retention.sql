-- `reconcile_runs` gains a row per run: every `serve` reconciles every 10 minutes by default,
-- so a year holds tens of thousands of runs, each with its findings. Two readers must not
-- grow with it: `serve`'s metrics sampler reads the latest `finished_at` every 5 s (the
-- "reconcile not run recently" gauge), and each run's retention prune (src/store/reconcile.rs)
-- finds the runs past the retention by age. Both walk this index from one end.
CREATE INDEX reconcile_runs_finished_idx ON reconcile_runs (finished_at);
