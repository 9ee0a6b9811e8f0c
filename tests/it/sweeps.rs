//! Reconcile sweeps: what an incremental, a full and a deep run each find, the schedule that
//! picks them, and the incremental window (it survives restarts, does not skip a transaction
//! that commits late with an old timestamp, nor anything when two reconcilers run at once).

use std::time::Duration;

use embed_dlq::reconcile::{Check, Mode, ReconcileConfig, Reconciler, Report, Sweep, SweepPolicy};
use embed_dlq::store::Store;
use embed_dlq::testkit::mock_provider::MockConfig;
use tokio_util::sync::CancellationToken;

use crate::support::*;

/// Ingests `n` chunks of `doc` through the pipeline (the mock provider).
async fn ingest(db: &TestDb, doc: &str, n: i32) {
    let mock = start_mock(MockConfig::default()).await;
    let corpus: String = (0..n).map(|i| line(doc, i, &format!("{doc} text {i}"))).collect();
    let summary =
        pipeline(&settings(db, &mock)).await.run(input(corpus.into_bytes()), CancellationToken::new()).await;
    assert_eq!(summary.unwrap().stored, n as u64);
}

/// A reconciler over `db` with a pool of its own (like another process), without Redis.
async fn reconciler(db: &TestDb, sweeps: SweepPolicy) -> Reconciler {
    let pool = embed_dlq::store::connect(&db.url, 4).await.unwrap();
    Reconciler {
        store: Store::open(pool, "doc_embeddings").await.unwrap(),
        redis: None,
        keys: fresh_keys(),
        config: ReconcileConfig { sweeps, ..immediate() },
    }
}

/// The findings of the table checks, by check, in report order.
fn table_found(r: &Report) -> [u64; 5] {
    [Check::Leaks, Check::Duplicates, Check::StoredDrift, Check::StaleDlq, Check::BadVectors]
        .map(|c| r.get(c).found)
}

async fn exec(db: &TestDb, sql: &'static str) {
    sqlx::query(sql).execute(&db.pool).await.unwrap();
}

/// A vector deleted and one zeroed by hand in chunks the tool did not touch since the last
/// run are found only by a full sweep and a deep sweep respectively; the same faults in
/// chunks ingested since the last run are found by the incremental run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_sweep_finds_what_it_covers() {
    let db = TestDb::new().await;
    ingest(&db, "old", 10).await;
    // Written an hour ago (a run re-checks the few seconds of changes before its horizon).
    exec(&db, "UPDATE ingest_manifest SET updated_at = now() - interval '1 hour'").await;
    let mut r = reconciler(&db, SweepPolicy::Always(Sweep::Incremental)).await;
    // No earlier run: the window covers everything, and vectors are not read yet.
    let first = r.run_once(Mode::Check).await.unwrap();
    assert_eq!((first.sweep, first.since), (Sweep::Incremental, None));
    assert_eq!(first.total_found(), 0, "{first:#?}");
    ingest(&db, "new", 10).await;
    // Faults behind the tool's back: in old chunks (unchanged since the run) and in new ones.
    exec(&db, "DELETE FROM doc_embeddings WHERE chunk_index = 1").await;
    exec(
        &db,
        "UPDATE doc_embeddings SET embedding = array_fill(0, ARRAY[768])::vector WHERE chunk_index = 2",
    )
    .await;
    exec(&db, "UPDATE doc_embeddings SET content_hash = 'other' WHERE chunk_index = 3").await;

    let incremental = r.run_once(Mode::Check).await.unwrap();
    assert_eq!(incremental.sweep, Sweep::Incremental);
    assert!(incremental.since.is_some());
    assert_eq!(table_found(&incremental), [1, 0, 1, 0, 1], "{incremental:#?}");
    assert_eq!(incremental.get(Check::Leaks).examples, vec!["new#1".to_string()]);
    assert_eq!(incremental.get(Check::BadVectors).examples, vec!["new#2".to_string()]);

    let full = r.run_sweep(Mode::Check, Some(Sweep::Full)).await.unwrap();
    assert_eq!(table_found(&full), [2, 0, 2, 0, 1], "the full sweep reads no old vector: {full:#?}");

    let deep = r.run_sweep(Mode::Check, Some(Sweep::Deep)).await.unwrap();
    assert_eq!(table_found(&deep), [2, 0, 2, 0, 2], "{deep:#?}");

    let repaired = r.run_sweep(Mode::Repair, Some(Sweep::Deep)).await.unwrap();
    assert_eq!(repaired.get(Check::BadVectors).repaired, 2);
    let clean = r.run_sweep(Mode::Check, Some(Sweep::Deep)).await.unwrap();
    assert_eq!(clean.total_found(), 0, "{clean:#?}");
}

/// pgvector itself refuses a wrong dimension and NaN or infinite values for a `vector(N)`
/// column, on the text path, the array cast and the binary path the tool writes with: what a
/// hand-made vector can still be is a zero vector, which the deep sweep finds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgvector_refuses_nan_and_wrong_dimensions_on_every_input_path() {
    let db = TestDb::new().await;
    ingest(&db, "v", 1).await;
    for sql in [
        "UPDATE doc_embeddings SET embedding = array_fill(0.5, ARRAY[767])::vector",
        "UPDATE doc_embeddings SET embedding = ('[NaN' || repeat(',1', 767) || ']')::vector",
        "UPDATE doc_embeddings SET embedding = ('[Infinity' || repeat(',1', 767) || ']')::vector",
        "UPDATE doc_embeddings SET embedding = array_fill('NaN'::real, ARRAY[768])::vector",
    ] {
        let e = sqlx::query(sql).execute(&db.pool).await.expect_err(sql);
        assert!(e.to_string().contains("dimensions") || e.to_string().contains("not allowed"), "{sql}: {e}");
    }
    let mut nan = vec![1.0f32; 768];
    nan[7] = f32::NAN;
    for v in [nan, vec![1.0f32; 767]] {
        let e = sqlx::query("UPDATE doc_embeddings SET embedding = $1")
            .bind(pgvector::Vector::from(v))
            .execute(&db.pool)
            .await
            .expect_err("binary input");
        assert!(e.to_string().contains("dimensions") || e.to_string().contains("not allowed"), "{e}");
    }
    exec(&db, "UPDATE doc_embeddings SET embedding = array_fill(0, ARRAY[768])::vector").await;
    let mut r = reconciler(&db, SweepPolicy::Always(Sweep::Deep)).await;
    assert_eq!(r.run_once(Mode::Check).await.unwrap().get(Check::BadVectors).found, 1);
}

/// The schedule: the first run of a database is deep, then incremental until a full sweep is
/// due; it is read from the recorded runs, so a new process follows it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_schedule_picks_deep_then_incremental_then_full_when_due() {
    let db = TestDb::new().await;
    ingest(&db, "s", 3).await;
    let hourly = SweepPolicy::Scheduled {
        full_every: Duration::from_secs(3600),
        deep_every: Some(Duration::from_secs(86_400)),
    };
    let mut r = reconciler(&db, hourly).await;
    let mut seen = Vec::new();
    for _ in 0..3 {
        seen.push(r.run_once(Mode::Check).await.unwrap().sweep);
    }
    assert_eq!(seen, [Sweep::Deep, Sweep::Incremental, Sweep::Incremental]);
    // Another process whose full sweeps are due every run, and which never goes deep.
    let every_run = SweepPolicy::Scheduled { full_every: Duration::ZERO, deep_every: None };
    let mut other = reconciler(&db, every_run).await;
    assert_eq!(other.run_once(Mode::Check).await.unwrap().sweep, Sweep::Full);
    // The last deep sweep is a day ago: deep again.
    exec(&db, "UPDATE reconcile_runs SET finished_at = finished_at - interval '2 days' WHERE sweep = 'deep'")
        .await;
    assert_eq!(r.run_once(Mode::Check).await.unwrap().sweep, Sweep::Deep);
    assert_eq!(r.run_once(Mode::Check).await.unwrap().sweep, Sweep::Incremental);
    assert_eq!(
        db.count("SELECT count(*) FROM reconcile_runs WHERE resume ? 'leaks' AND resume ? 'bad_vectors'")
            .await,
        6
    );
}

/// A finding left unrepaired is reported by every later incremental run (it holds its
/// check's window open) until it is repaired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unrepaired_finding_is_reported_until_repaired() {
    let db = TestDb::new().await;
    ingest(&db, "a", 5).await;
    let mut r = reconciler(&db, SweepPolicy::Always(Sweep::Incremental)).await;
    r.run_once(Mode::Check).await.unwrap();
    ingest(&db, "b", 5).await;
    exec(&db, "DELETE FROM doc_embeddings WHERE doc_id = 'b' AND chunk_index = 4").await;
    for _ in 0..3 {
        let report = r.run_once(Mode::Check).await.unwrap();
        assert_eq!(report.get(Check::Leaks).found, 1, "{report:#?}");
    }
    assert_eq!(r.run_once(Mode::DryRun).await.unwrap().get(Check::Leaks).found, 1);
    let repaired = r.run_once(Mode::Repair).await.unwrap();
    assert_eq!(repaired.get(Check::Leaks).repaired, 1);
    assert_eq!(r.run_once(Mode::Check).await.unwrap().total_found(), 0);
}

/// The window is in `reconcile_runs`: a reconciler of a new process resumes where the last
/// recorded run left off, and finds what changed since.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_window_survives_a_restart() {
    let db = TestDb::new().await;
    ingest(&db, "a", 5).await;
    let mut first = reconciler(&db, SweepPolicy::Always(Sweep::Incremental)).await;
    first.run_once(Mode::Check).await.unwrap();
    first.run_once(Mode::Check).await.unwrap();
    first.store.pool().close().await;
    drop(first);
    let recorded: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(
        "SELECT (resume->>'leaks')::timestamptz FROM reconcile_runs ORDER BY id DESC LIMIT 1",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    ingest(&db, "b", 5).await;
    exec(&db, "DELETE FROM doc_embeddings WHERE doc_id = 'b' AND chunk_index = 0").await;
    let mut restarted = reconciler(&db, SweepPolicy::Always(Sweep::Incremental)).await;
    let report = restarted.run_once(Mode::Check).await.unwrap();
    assert_eq!(report.since, Some(recorded), "{report:#?}");
    assert_eq!(report.get(Check::Leaks).examples, vec!["b#0".to_string()]);
}

/// A writer stamps `updated_at` with its transaction's start and may commit after reconcile
/// runs went by: its change is older than those runs, and must still be looked at. A window
/// resuming from the runs' own start times (less their 2 s margin) would skip it forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_commit_with_an_old_timestamp_is_not_skipped() {
    let db = TestDb::new().await;
    ingest(&db, "a", 3).await;
    let mut r = reconciler(&db, SweepPolicy::Always(Sweep::Incremental)).await;
    r.run_once(Mode::Check).await.unwrap();
    // A manifest row marked stored without its vector (a writer's bug), in a transaction that
    // stays open while two runs go by.
    let mut late = db.pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO ingest_manifest (target_table, doc_id, chunk_index, content_hash, status)
         VALUES ('public.doc_embeddings', 'late', 0, 'h', 'stored')",
    )
    .execute(&mut *late)
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    for _ in 0..2 {
        assert_eq!(r.run_once(Mode::Check).await.unwrap().total_found(), 0);
    }
    late.commit().await.unwrap();
    let report = r.run_once(Mode::Check).await.unwrap();
    assert_eq!(report.sweep, Sweep::Incremental);
    assert_eq!(report.get(Check::Leaks).examples, vec!["late#0".to_string()], "{report:#?}");
}

/// Autovacuum works in a transaction for as long as a table takes (minutes at ten million
/// rows) but never stamps `updated_at`: the window must not reach back to its start. (The
/// 1M scale run's incremental reconcile re-read 345,000 unchanged chunks in 6 s, twice a full
/// sweep's time: its window began at an autovacuum's start, 15 s before the previous run.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_autovacuum_does_not_hold_the_window_open() {
    let db = TestDb::new().await;
    // A table whose autovacuum is due at once and crawls: one cost unit, then 100 ms asleep.
    // Made before anything else happens in the new database, and its counts sent to the
    // statistics at once: the launcher's first visit then finds it due. A first visit that
    // found nothing due put the next one a naptime away (a minute, more on a busy server:
    // this test took 10 to 170 s).
    let mut conn = db.pool.acquire().await.unwrap();
    for sql in [
        "CREATE TABLE crawl (id int) WITH (autovacuum_vacuum_threshold = 0,
             autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_cost_delay = 100,
             autovacuum_vacuum_cost_limit = 1)",
        "INSERT INTO crawl SELECT generate_series(1, 100000)",
        "DELETE FROM crawl",
        "SELECT pg_stat_force_next_flush()",
    ] {
        sqlx::query(sql).execute(&mut *conn).await.unwrap();
    }
    drop(conn);
    ingest(&db, "a", 3).await;
    let worker = async || -> Option<chrono::DateTime<chrono::Utc>> {
        sqlx::query_scalar(
            "SELECT xact_start FROM pg_stat_activity
              WHERE datname = current_database() AND backend_type = 'autovacuum worker'
                AND query LIKE '%crawl%'",
        )
        .fetch_optional(&db.pool)
        .await
        .unwrap()
    };
    // The launcher visits each database once per `autovacuum_naptime` (a minute).
    wait_for("an autovacuum of the crawling table", Duration::from_secs(180), async || {
        worker().await.is_some()
    })
    .await;
    let vacuum_began = worker().await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut r = reconciler(&db, SweepPolicy::Always(Sweep::Incremental)).await;
    r.run_once(Mode::Check).await.unwrap();
    assert_eq!(worker().await, Some(vacuum_began), "the autovacuum ended before the run: nothing was tried");
    let report = r.run_once(Mode::Check).await.unwrap();
    let since = report.since.expect("an incremental run has a window");
    assert!(
        since > vacuum_began,
        "the window reaches back to the autovacuum's start: {since} <= {vacuum_began}"
    );
}

/// Two reconcilers (two processes) repairing incrementally at once while a writer commits
/// faulty chunks, some in transactions held open across runs: every fault is found and
/// repaired, none skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_reconcilers_at_once_skip_nothing() {
    let db = TestDb::new().await;
    ingest(&db, "seed", 3).await;
    let stop = CancellationToken::new();
    let mut loops = Vec::new();
    for _ in 0..2 {
        let mut r = reconciler(&db, SweepPolicy::Always(Sweep::Incremental)).await;
        let stop = stop.clone();
        loops.push(tokio::spawn(async move {
            let mut runs = 0u32;
            while !stop.is_cancelled() {
                let report = r.run_once(Mode::Repair).await.unwrap();
                assert_eq!(report.sweep, Sweep::Incremental);
                runs += 1;
            }
            runs
        }));
    }
    let planted = 30;
    let writer = embed_dlq::store::connect(&db.url, 4).await.unwrap();
    // One transaction stays open longer than the window's margin while runs go by.
    let mut long = writer.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO ingest_manifest (target_table, doc_id, chunk_index, content_hash, status)
         VALUES ('public.doc_embeddings', 'leak', $1, 'h', 'stored')",
    )
    .bind(planted)
    .execute(&mut *long)
    .await
    .unwrap();
    let opened = std::time::Instant::now();
    let mut open = Vec::new();
    for i in 0..planted {
        let mut tx = writer.begin().await.unwrap();
        sqlx::query(
            "INSERT INTO ingest_manifest (target_table, doc_id, chunk_index, content_hash, status)
             VALUES ('public.doc_embeddings', 'leak', $1, 'h', 'stored')",
        )
        .bind(i)
        .execute(&mut *tx)
        .await
        .unwrap();
        // Every third transaction stays open while others commit and runs go by.
        if i % 3 == 0 {
            open.push(tx);
        } else {
            tx.commit().await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
        if open.len() == 2 {
            tokio::time::sleep(Duration::from_millis(300)).await;
            for tx in open.drain(..) {
                tx.commit().await.unwrap();
            }
        }
    }
    for tx in open.drain(..) {
        tx.commit().await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(3_000).saturating_sub(opened.elapsed())).await;
    long.commit().await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.cancel();
    let mut runs = 0;
    for l in loops {
        runs += l.await.unwrap();
    }
    assert!(runs >= 2, "{runs} runs");
    // One more incremental run resumes from the last one: anything skipped stays skipped.
    let mut last = reconciler(&db, SweepPolicy::Always(Sweep::Incremental)).await;
    last.run_once(Mode::Repair).await.unwrap();
    assert_eq!(
        db.count("SELECT count(*) FROM ingest_manifest WHERE doc_id = 'leak' AND status = 'reingest'").await,
        planted as i64 + 1,
        "every planted leak was found and repaired"
    );
    assert!(db.count("SELECT count(*) FROM reconcile_runs WHERE sweep = 'incremental'").await >= 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_past_the_retention_are_pruned_a_page_a_run_and_each_sweeps_latest_stays() {
    let db = TestDb::new().await;
    ingest(&db, "retention", 5).await;
    let mut r = reconciler(&db, SweepPolicy::default()).await;
    // Four years of daily runs past the 90-day retention (the newest of them a deep sweep),
    // and twenty recent incremental ones; no full sweep ever ran.
    exec(
        &db,
        "INSERT INTO reconcile_runs (started_at, finished_at, repaired, findings, sweep)
         SELECT now() - make_interval(days => 91 + i), now() - make_interval(days => 91 + i), false, '[]',
                CASE WHEN i = 0 THEN 'deep' ELSE 'incremental' END
           FROM generate_series(0, 1499) i",
    )
    .await;
    exec(
        &db,
        "INSERT INTO reconcile_runs (started_at, finished_at, repaired, findings, sweep)
         SELECT now() - make_interval(hours => i), now() - make_interval(hours => i), false, '[]', 'incremental'
           FROM generate_series(1, 20) i",
    )
    .await;
    let old = "SELECT count(*) FROM reconcile_runs WHERE finished_at < now() - interval '90 days'";
    // A deep sweep (none within 7 days): the old deep run is no longer the latest of its
    // sweep. A page of 1,000 goes.
    assert_eq!(r.run_once(Mode::Check).await.unwrap().sweep, Sweep::Deep);
    assert_eq!(db.count(old).await, 500);
    // An incremental run: the rest goes.
    assert_eq!(r.run_once(Mode::Check).await.unwrap().sweep, Sweep::Incremental);
    assert_eq!(db.count(old).await, 0);
    assert_eq!(db.count("SELECT count(*) FROM reconcile_runs").await, 20 + 2, "recent runs are kept");
}

/// A vector table believed empty (its vectors deleted and analyzed before vacuum took the
/// pages, then filled again): the deep sweep's repair of bad vectors reads only the page's
/// vectors beyond what the check itself reads. Joined with the page's keys, the repair's
/// delete walked the whole table for each page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repairing_bad_vectors_reads_only_their_page_of_the_vector_table_whatever_the_statistics_say() {
    let db = TestDb::new().await;
    leave_believed_empty(&db, "doc_embeddings", &fake_vectors("deleted", 20_000)).await;
    ingest(&db, "v", 1_000).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(fake_vectors("other", 20_000))).execute(&db.pool).await.unwrap();
    exec(&db, "UPDATE doc_embeddings SET embedding = array_fill(0, ARRAY[768])::vector WHERE doc_id = 'v'")
        .await;
    let mut r = reconciler(&db, SweepPolicy::Always(Sweep::Deep)).await;
    // What the deep check reads by itself, then the same with the repair.
    quiet_statistics().await;
    let before = rows_read(&db, "doc_embeddings").await;
    assert_eq!(r.run_once(Mode::Check).await.unwrap().get(Check::BadVectors).found, 1_000);
    quiet_statistics().await;
    let check_read = rows_read(&db, "doc_embeddings").await - before;
    let before = rows_read(&db, "doc_embeddings").await;
    assert_eq!(r.run_once(Mode::Repair).await.unwrap().get(Check::BadVectors).repaired, 1_000);
    quiet_statistics().await;
    let repair_read = rows_read(&db, "doc_embeddings").await - before;
    // Read here: the bad vectors are gone, their chunks marked for re-ingest, the rest kept.
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 20_000);
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest WHERE status = 'reingest'").await, 1_000);
    // Beyond the check: the repair's pages of keys, which walk the table once between them
    // (finding a bad vector means reading its norm), then a probe and the delete's read of
    // each bad vector. The delete joined with a page walked the table once more per page.
    let extra = repair_read - check_read;
    assert!(
        extra <= 22_000 + 4 * 1_000,
        "vectors read by the repair beyond the check's {check_read}: {extra}"
    );
}

/// An incremental run checks the chunks changed since the last run, and must read the vector
/// table by their keys alone, whatever the statistics say (and a run over every chunk must
/// read it once, not once a chunk): here a vector table believed empty
/// (its rows deleted and analyzed before vacuum, then filled again) holding 20,000 vectors
/// and their manifest rows untouched since the last run, and 10 chunks ingested since. A
/// join of the changed chunks with the table it believes holds one row may walk all of it,
/// on every run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_incremental_run_reads_only_the_changed_chunks_vectors_whatever_the_statistics_say() {
    let db = TestDb::new().await;
    leave_believed_empty(&db, "doc_embeddings", &fake_vectors("deleted", 20_000)).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "{}; {};
         UPDATE ingest_manifest SET updated_at = now() - interval '1 hour',
                                    content_hash = md5('old' || substr(doc_id, 5))",
        fake_vectors("old", 20_000),
        stored_chunks("old", 20_000)
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    let mut r = reconciler(&db, SweepPolicy::Always(Sweep::Incremental)).await;
    // The first run has no earlier one: it checks every chunk, reading the vector table a few
    // times at most. (What this cannot see: as a nested loop against a table believed to
    // hold one row, its anti-join read the table once and compared every manifest row with
    // every vector in memory, 14 s here; docs/perf-notes/2026-12-04-where-the-goals-ended.md
    // has the plans.)
    quiet_statistics().await;
    let before = rows_read(&db, "doc_embeddings").await;
    let first = r.run_once(Mode::Check).await.unwrap();
    quiet_statistics().await;
    let first_read = rows_read(&db, "doc_embeddings").await - before;
    assert_eq!(first.since, None);
    assert_eq!(first.total_found(), 0, "the 20,000 stored chunks agree with their vectors: {first:#?}");
    eprintln!("vectors read by a run over every chunk: {first_read}");
    assert!(first_read <= 4 * 20_000, "a run over 20,000 chunks read {first_read} vectors");
    ingest(&db, "new", 10).await;
    exec(&db, "DELETE FROM doc_embeddings WHERE doc_id = 'new' AND chunk_index = 1").await;

    quiet_statistics().await;
    let before = rows_read(&db, "doc_embeddings").await;
    let incremental = r.run_once(Mode::Check).await.unwrap();
    quiet_statistics().await;
    let read = rows_read(&db, "doc_embeddings").await - before;
    assert_eq!(incremental.sweep, Sweep::Incremental);
    assert_eq!(incremental.get(Check::Leaks).examples, vec!["new#1".to_string()], "{incremental:#?}");
    eprintln!("vectors read by an incremental run over 10 changed chunks: {read}");
    assert!(read <= 1_000, "an incremental run over 10 changed chunks read {read} vectors");
}
