//! Concurrent runs share the work: ingests of the same corpus started together send each
//! input about once (the intake window's lease claim), a killed run's leases are taken over by
//! a rerun, and a live holder's lease is left alone until it expires — but never blocks a
//! newer record of different content.

use std::process::Stdio;
use std::time::Duration;

use embed_dlq::ingest::IngestSummary;
use embed_dlq::model::content_hash;
use embed_dlq::testkit::corpus::{CorpusSpec, write_corpus};
use embed_dlq::testkit::mock_provider::MockConfig;
use sqlx::Connection;
use tokio_util::sync::CancellationToken;

use crate::support::*;

fn corpus(chunks: usize) -> Vec<u8> {
    let mut bytes = Vec::new();
    write_corpus(&mut bytes, &CorpusSpec { chunks, ..CorpusSpec::default() }, 32_000).unwrap();
    bytes
}

/// `runs` pipelines of their own (own pool, own run) with intake windows of `window` keys.
async fn pipelines_of(
    db: &TestDb,
    mock: &embed_dlq::testkit::mock_provider::MockProvider,
    runs: usize,
    window: usize,
) -> Vec<embed_dlq::ingest::Pipeline> {
    let mut pipelines = Vec::new();
    for _ in 0..runs {
        let mut s = settings(db, mock);
        // Generous: a request timed out on a loaded machine is re-sent, and re-sends are not
        // what these tests measure.
        s.client.timeout = Duration::from_secs(30);
        let mut p = pipeline(&s).await;
        p.options.intake_window = window;
        pipelines.push(p);
    }
    pipelines
}

/// `runs` ingests of one corpus started together, each its own pipeline (own pool, own run):
/// together they send each input about once, and every chunk ends stored exactly once.
async fn concurrent_ingests_share_the_work(runs: usize) {
    const CHUNKS: usize = 4_000;
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig { latency_ms: 5, ..MockConfig::default() }).await;
    let bytes = corpus(CHUNKS);
    // Small windows: what the runs embed twice before they see each other (a run alone
    // claims nothing) is a window or two, well within the bound.
    let pipelines = pipelines_of(&db, &mock, runs, 128).await;
    let summaries: Vec<IngestSummary> = futures::future::join_all(
        pipelines.iter().map(|p| p.run(input(bytes.clone()), CancellationToken::new())),
    )
    .await
    .into_iter()
    .map(|r| r.expect("every concurrent run succeeds"))
    .collect();

    // Sent twice at most: what one run had at the provider without a lease when the others
    // took their locks (a run whose first windows went by before another began is alone;
    // its workers ask before each request whether that is still so), however loaded the
    // machine is.
    let o = &pipelines[0].options;
    let in_flight = o.concurrency * o.batch_max_inputs;
    let inputs = mock.control.stats().inputs;
    assert!(
        inputs as usize <= CHUNKS + in_flight,
        "{runs} concurrent runs sent {inputs} inputs for {CHUNKS} chunks (bound {CHUNKS} + {in_flight}): {summaries:#?}"
    );
    for s in &summaries {
        assert_eq!(s.records, CHUNKS as u64, "{s:?}");
        // `superseded`: a chunk both runs embedded before they saw each other, written by
        // the newer run too.
        assert_eq!(
            s.stored + s.unchanged + s.leased_elsewhere + s.superseded,
            s.records,
            "every record accounted: {s:?}"
        );
        assert_eq!(s.not_attempted + s.parked_total(), 0, "{s:?}");
    }
    assert!(summaries.iter().map(|s| s.stored).sum::<u64>() >= CHUNKS as u64, "{summaries:#?}");
    assert!(summaries.iter().any(|s| s.leased_elsewhere > 0), "the runs met: {summaries:#?}");
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, CHUNKS as i64);
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest WHERE status = 'stored'").await, CHUNKS as i64);
    assert_corpus_accounted(&db, &corpus_keys(&corpus(CHUNKS))).await;
    assert_eq!(db.leaks().await, 0);
    assert_eq!(db.manifest_disagreements().await, 0);
    assert_eq!(
        db.count("SELECT count(*) FROM ingest_lease WHERE finished_at IS NULL").await,
        0,
        "finished runs hold no lease in flight"
    );
    let retries: Vec<_> = summaries.iter().map(|s| &s.retries).collect();
    eprintln!("{runs} concurrent runs of {CHUNKS} chunks: {inputs} inputs sent; retries {retries:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_concurrent_ingests_send_each_input_about_once() {
    concurrent_ingests_share_the_work(2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_concurrent_ingests_send_each_input_about_once() {
    concurrent_ingests_share_the_work(3).await;
}

/// A run alone past its first windows only reads the manifest (no lease, nothing written);
/// two runs started beside it, together, make it claim leases again: its workers ask before
/// each request built without a lease whether another run is alive, and claim its chunks if
/// so. The three send each input once, except what the lone run had at the provider when the
/// others began (its requests in flight: concurrency x batch size), however late they start
/// and whatever the lone run had queued (the failure this test was written for: two runs that
/// started after the first one's leased windows re-sent its queued backlog, 4,608 and 4,928
/// inputs for 4,000 chunks).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_started_beside_a_lone_one_share_the_rest() {
    const CHUNKS: usize = 4_000;
    const WINDOW: usize = 128;
    let db = TestDb::new().await;
    // Slow enough that the first run is far from done when the others start.
    let mock = start_mock(MockConfig { latency_ms: 100, ..MockConfig::default() }).await;
    let bytes = corpus(CHUNKS);
    let runs = pipelines_of(&db, &mock, 3, WINDOW).await;
    let first = runs[0].run(input(bytes.clone()), CancellationToken::new());
    let others = async {
        // Past the first run's always-leased windows: it is in its lone, read-only mode.
        wait_for("the first run past its first windows", Duration::from_secs(60), async || {
            db.count("SELECT count(*) FROM ingest_manifest").await >= (12 * WINDOW) as i64
        })
        .await;
        tokio::join!(
            runs[1].run(input(bytes.clone()), CancellationToken::new()),
            runs[2].run(input(bytes.clone()), CancellationToken::new())
        )
    };
    let (first, (second, third)) = tokio::join!(first, others);
    let summaries = [first.expect("first run"), second.expect("second run"), third.expect("third run")];
    assert!(
        summaries[1].unchanged < CHUNKS as u64,
        "the later runs met the first one's work in flight: {summaries:#?}"
    );
    // Sent twice at most: what the lone run had at the provider, without leases, when the
    // others began (its workers ask before every request, so nothing it had queued).
    let o = &runs[0].options;
    let in_flight = o.concurrency * o.batch_max_inputs;
    let inputs = mock.control.stats().inputs;
    assert!(
        inputs as usize <= CHUNKS + in_flight,
        "{inputs} inputs sent for {CHUNKS} chunks (bound {CHUNKS} + {in_flight}): the lone run's queued work was sent again\n{summaries:#?}"
    );
    for s in &summaries {
        assert_eq!(
            s.stored + s.unchanged + s.leased_elsewhere + s.superseded,
            s.records,
            "every record accounted: {s:?}"
        );
        assert_eq!(s.not_attempted + s.parked_total(), 0, "{s:?}");
    }
    assert!(summaries[0].leased_elsewhere > 0, "the lone run left work to the others: {summaries:#?}");
    assert_corpus_accounted(&db, &corpus_keys(&corpus(CHUNKS))).await;
    assert_eq!(db.leaks().await, 0);
    assert_eq!(db.manifest_disagreements().await, 0);
    eprintln!("a lone run and two beside it, {CHUNKS} chunks: {inputs} inputs sent");
}

/// Holds the advisory lock of a made-up ingest run on a connection of its own, as a
/// concurrent run would: runs then claim leases (a run alone claims none).
pub(crate) async fn another_live_run(db: &TestDb) -> (sqlx::PgConnection, i64) {
    let mut conn = sqlx::PgConnection::connect(&db.url).await.unwrap();
    let run: i64 =
        sqlx::query_scalar("SELECT nextval('embed_dlq_ingest_run_seq')").fetch_one(&mut conn).await.unwrap();
    sqlx::query("SELECT pg_advisory_lock(embed_dlq_lease_lock_space(), $1::int)")
        .bind(run)
        .execute(&mut conn)
        .await
        .unwrap();
    (conn, run)
}

/// A run killed with -9 mid-way (while another run is alive, so it claims leases) leaves
/// leases behind; its advisory lock died with its connection, so a rerun started at once
/// takes them over and finishes every chunk, and no lease is left in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_runs_leases_are_taken_over_by_a_rerun() {
    const CHUNKS: i64 = 3_000;
    let db = TestDb::new().await;
    let (other, _) = another_live_run(&db).await;
    let mock = start_mock(MockConfig { latency_ms: 15, ..MockConfig::default() }).await;
    let dir = std::env::temp_dir().join(format!(
        "embed-dlq-leases-{}-{}",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("corpus.jsonl");
    std::fs::write(&path, corpus(CHUNKS as usize)).unwrap();
    let ingest = || {
        let mut c = tokio::process::Command::new(env!("CARGO_BIN_EXE_embed-dlq"));
        c.env_remove("EMBED_DLQ_API_KEY").env_remove("RUST_LOG").stdin(Stdio::null());
        c.arg("ingest")
            .arg(&path)
            .args(["--database-url", &db.url, "--base-url", &mock.base_url(), "--model", "mock"])
            .args(["--batch-max-inputs", "16", "--concurrency", "2", "--request-timeout-ms", "2000"])
            .args(["--retry-base-ms", "5", "--retry-cap-ms", "50", "--no-progress", "--json"])
            // Long leases: only the dead holder's lost advisory lock can free them in time.
            .args(["--lease-secs", "3600"]);
        c
    };
    let mut child = ingest().stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let mut progressed = false;
    for _ in 0..600 {
        if db.count("SELECT count(*) FROM doc_embeddings").await >= 300 {
            progressed = true;
            break;
        }
        assert!(child.try_wait().unwrap().is_none(), "the ingest ended before it was killed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(progressed, "the ingest made no progress");
    child.start_kill().unwrap(); // SIGKILL
    child.wait().await.unwrap();
    let done_before = db.count("SELECT count(*) FROM ingest_manifest").await;
    assert!(done_before < CHUNKS, "killed mid-way: {done_before}");
    let left = db.count("SELECT count(*) FROM ingest_lease WHERE finished_at IS NULL").await;
    assert!(left > 0, "the killed run left the leases of its windows in flight");

    let inputs_before = mock.control.stats().inputs;
    let rerun = ingest().output().await.unwrap();
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(rerun.status.code(), Some(0), "{}", String::from_utf8_lossy(&rerun.stderr));
    let s: serde_json::Value = serde_json::from_slice(&rerun.stdout).unwrap();
    assert_eq!(s["leased_elsewhere"], 0, "a dead run's leases are not waited for: {s}");
    // A commit the killed process had already sent may land after it died: at least what
    // was counted finished is unchanged, and the rerun stores the rest.
    let (unchanged, stored) = (s["unchanged"].as_i64().unwrap(), s["stored"].as_i64().unwrap());
    assert!(unchanged >= done_before, "{s}");
    assert_eq!(unchanged + stored, CHUNKS, "{s}");
    let embedded_again = (mock.control.stats().inputs - inputs_before) as i64;
    assert!(embedded_again <= CHUNKS - done_before + 200, "rerun embedded {embedded_again}: {s}");
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, CHUNKS);
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest").await, CHUNKS);
    assert_eq!(db.count("SELECT count(*) FROM ingest_lease WHERE finished_at IS NULL").await, 0);
    assert_corpus_accounted(&db, &corpus_keys(&corpus(CHUNKS as usize))).await;
    assert_eq!(db.leaks().await, 0);
    assert_eq!(db.manifest_disagreements().await, 0);
    other.close().await.unwrap();
}

/// Leases another run holds, planted in the table: a live holder's unexpired lease on the
/// same content is left to it (reported, not stored, not lost: a rerun once the holder is gone
/// stores it); its lease on older, different content, its expired lease, its finished lease
/// whose outcome the manifest no longer holds, its lease behind a newer manifest record, and
/// a dead run's lease are all taken over at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_holder_keeps_its_lease_until_it_expires_and_never_blocks_newer_content() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let text = |k: i32| format!("lease test chunk {k}");
    let lines: String = (0..200).map(|k| line("lease-doc", k, &text(k))).collect();
    let hash = |k: i32| content_hash("mock", 768, &text(k));

    // A live holder: a run id of its own and the run's advisory lock on a connection of its own.
    let (holder, live) = another_live_run(&db).await;
    let dead = live + 1_000_000; // no advisory lock: its process is gone
    // `expires_in` seconds from now (negative: already expired); `finished`: the holder's
    // outcome committed (in this planting transaction, so every later snapshot sees it).
    let plant = |k: i32, run: i64, content: String, expires_in: f64, finished: bool| {
        let pool = db.pool.clone();
        async move {
            sqlx::query(
                "INSERT INTO ingest_lease (target_table, doc_id, chunk_index, content_hash, source_seq, run_id,
                                           expires_at, finished_at, finished_xact)
                 VALUES ('public.doc_embeddings', 'lease-doc', $1, $2, ($3::bigint << 32) | $1, $3,
                         now() + make_interval(secs => $4),
                         CASE WHEN $5 THEN now() END, CASE WHEN $5 THEN pg_current_xact_id() END)",
            )
            .bind(k)
            .bind(content)
            .bind(run)
            .bind(expires_in)
            .bind(finished)
            .execute(&pool)
            .await
            .unwrap();
        }
    };
    for k in 0..20 {
        plant(k, live, hash(k), 3600.0, false).await; // left to the holder
    }
    for k in 20..40 {
        plant(k, live, "older content".into(), 3600.0, false).await; // newer record wins
    }
    for k in 40..60 {
        plant(k, dead, hash(k), 3600.0, false).await; // holder dead
    }
    for k in 60..80 {
        plant(k, live, hash(k), -1.0, false).await; // expired
    }
    for k in 80..100 {
        // Finished, but the manifest no longer holds it (an operator purged it): taken over.
        plant(k, live, hash(k), 3600.0, true).await;
    }
    for k in 100..120 {
        // In flight, but the manifest already holds a newer record than the lease's: the
        // holder's outcome would be superseded, so the lease is taken over.
        plant(k, live, hash(k), 3600.0, false).await;
        sqlx::query(
            "INSERT INTO ingest_manifest (target_table, doc_id, chunk_index, content_hash, status, source_seq)
             VALUES ('public.doc_embeddings', 'lease-doc', $1, 'newer content', 'stored', ($2::bigint << 32) | 100000)",
        )
        .bind(k)
        .bind(live)
        .execute(&db.pool)
        .await
        .unwrap();
    }

    let p = pipeline(&settings(&db, &mock)).await;
    let s = p.run(input(lines.clone().into_bytes()), CancellationToken::new()).await.unwrap();
    assert_eq!(s.leased_elsewhere, 20, "{s:?}");
    assert_eq!(s.stored, 180, "{s:?}");
    assert_eq!(mock.control.stats().inputs, 180, "the leased chunks were not sent");
    assert_eq!(
        db.count("SELECT count(*) FROM ingest_manifest WHERE doc_id = 'lease-doc' AND chunk_index < 20")
            .await,
        0,
        "left to the holder, so not finished by this run"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM ingest_lease WHERE chunk_index < 20").await,
        20,
        "visibly in flight: the holder's leases stay"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM ingest_lease WHERE chunk_index >= 20 AND finished_at IS NULL").await,
        0,
        "every lease taken over was finished"
    );

    // The holder goes away without finishing (its connection closes): a rerun stores the rest.
    holder.close().await.unwrap();
    // The server drops the holder's advisory lock when its backend exits, a moment after the
    // close returns (under load, the rerun's first claim once still saw it alive).
    for _ in 0..500 {
        let held: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2
                AND classid = embed_dlq_lease_lock_space()::oid AND objid = $1::bigint::oid
                AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .bind(live)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if held == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let keys = corpus_keys(lines.as_bytes());
    let s = p.run(input(lines.into_bytes()), CancellationToken::new()).await.unwrap();
    assert_eq!((s.unchanged, s.stored, s.leased_elsewhere), (180, 20, 0), "{s:?}");
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 200);
    let in_flight: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM ingest_lease WHERE finished_at IS NULL AND run_id NOT IN ($1, $2)",
    )
    .bind(live)
    .bind(dead)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(in_flight, 0, "only the gone holders' leases are left, for the expiry sweep");
    assert_corpus_accounted(&db, &keys).await;
    assert_eq!(db.leaks().await, 0);
    assert_eq!(db.manifest_disagreements().await, 0);
}

/// A run alone claims leases in its first windows only (`ALWAYS_LEASED_WINDOWS`, 8): each of
/// those is marked finished by the outcome that stores its chunk (a store that knows its rows
/// hold no lease skips the lease update, so the flag must travel with every leased chunk), and
/// the later windows write no lease rows at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_runs_first_windows_leases_are_finished_by_their_outcomes() {
    const WINDOW: usize = 32;
    const CHUNKS: usize = 12 * WINDOW;
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let mut p = pipeline(&settings(&db, &mock)).await;
    p.options.intake_window = WINDOW;
    let s = p.run(input(corpus(CHUNKS)), CancellationToken::new()).await.unwrap();
    assert_eq!(s.stored, CHUNKS as u64, "{s:?}");
    // A run sweeps its finished leases 10 s (the grace) after their outcome: a run that took
    // that long has swept some, and the count below says nothing.
    if s.elapsed_secs >= 8.0 {
        eprintln!("run too slow ({:.1} s) to count the leases it kept; not checked", s.elapsed_secs);
        return;
    }
    assert_eq!(
        db.count("SELECT count(*) FROM ingest_lease WHERE finished_at IS NULL").await,
        0,
        "no lease left in flight"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM ingest_lease WHERE finished_xact IS NOT NULL").await,
        8 * WINDOW as i64,
        "every lease of the first 8 windows was finished by its outcome, and none claimed after"
    );
    assert_eq!(db.leaks().await, 0);
    assert_eq!(db.manifest_disagreements().await, 0);
}

/// Issue 20, item 7: an ingest that leaves chunks to a live holder's lease (or not attempted)
/// has not finished them: nothing will find them if the holder dies, since they have no
/// manifest row. The binary says so on a summary line (how many, why, and that a rerun
/// finishes them) and exits 7, not 0; the rerun once the holder is gone exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ingest_that_leaves_chunks_unfinished_exits_7_and_says_a_rerun_finishes_them() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let text = |k: i32| format!("unfinished test chunk {k}");
    let lines: String = (0..20).map(|k| line("unfinished-doc", k, &text(k))).collect();
    let (holder, live) = another_live_run(&db).await;
    for k in 0..5 {
        sqlx::query(
            "INSERT INTO ingest_lease (target_table, doc_id, chunk_index, content_hash, source_seq, run_id, expires_at)
             VALUES ('public.doc_embeddings', 'unfinished-doc', $1, $2, ($3::bigint << 32) | $1, $3,
                     now() + interval '1 hour')",
        )
        .bind(k)
        .bind(content_hash("mock", 768, &text(k)))
        .bind(live)
        .execute(&db.pool)
        .await
        .unwrap();
    }
    let path = std::env::temp_dir().join(format!("embed-dlq-it-unfinished-{}.jsonl", rand::random::<u64>()));
    std::fs::write(&path, &lines).unwrap();
    let ingest = || {
        let mut c = tokio::process::Command::new(env!("CARGO_BIN_EXE_embed-dlq"));
        c.env_remove("EMBED_DLQ_API_KEY").env_remove("RUST_LOG").stdin(Stdio::null());
        c.arg("ingest")
            .arg(&path)
            .args(["--database-url", &db.url, "--base-url", &mock.base_url(), "--model", "mock"])
            .args(["--no-progress"]);
        c
    };
    let out = ingest().output().await.unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let all = format!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(7), "{all}");
    let note = stdout.lines().find(|l| l.starts_with("not finished")).unwrap_or_else(|| panic!("{all}"));
    assert!(note.contains(" 5 ") && note.contains("rerun"), "{note}");
    assert!(note.contains("unfinished-doc#0"), "names the chunks: {note}");
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 15);

    // The holder dies without finishing: a rerun stores the rest and exits 0.
    holder.close().await.unwrap();
    let mut code = None;
    for _ in 0..50 {
        let out = ingest().output().await.unwrap();
        code = out.status.code();
        if code == Some(0) {
            break;
        }
        // The server drops the holder's advisory lock a moment after the close returns.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = std::fs::remove_file(&path);
    assert_eq!(code, Some(0));
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 20);
    assert_eq!(db.leaks().await, 0);
}

/// A manifest believed empty (its rows deleted and analyzed before vacuum took its pages,
/// then filled again: a corpus deleted and ingested anew) holds 22,000 rows when an unchanged
/// corpus is ingested again beside another live run. Every window's claim then moves its
/// chunks' positions forward (they were confirmed at a later position of the history), and
/// must read only its own keys of the manifest to do so, never the whole table once a window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rerun_beside_another_run_reads_only_its_windows_of_the_manifest_whatever_the_statistics_say() {
    const CHUNKS: usize = 2_000;
    const WINDOW: usize = 128;
    let db = TestDb::new().await;
    leave_believed_empty(&db, "ingest_manifest", &stored_chunks("gone", 20_000)).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(stored_chunks("beside", 20_000))).execute(&db.pool).await.unwrap();
    let mock = start_mock(MockConfig::default()).await;
    let bytes = corpus(CHUNKS);
    let runs = pipelines_of(&db, &mock, 2, WINDOW).await;
    let first = runs[0].run(input(bytes.clone()), CancellationToken::new()).await.unwrap();
    assert_eq!(first.stored, CHUNKS as u64, "{first:?}");
    let newest = db.count("SELECT max(source_seq) FROM ingest_manifest").await;

    let (_other, _) = another_live_run(&db).await;
    quiet_statistics().await;
    let before = rows_read(&db, "ingest_manifest").await;
    let again = runs[1].run(input(bytes), CancellationToken::new()).await.unwrap();
    quiet_statistics().await;
    let read = rows_read(&db, "ingest_manifest").await - before;
    eprintln!("manifest rows read by an unchanged rerun of {CHUNKS} chunks beside another run: {read}");
    assert_eq!(again.unchanged, CHUNKS as u64, "{again:?}");
    let confirmed: i64 = sqlx::query_scalar("SELECT count(*) FROM ingest_manifest WHERE source_seq > $1")
        .bind(newest)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        confirmed, CHUNKS as i64,
        "the rerun beside another run confirmed its chunks at their later positions"
    );
    // Each chunk's row is read a few times (the window's lookup, the confirmation and its
    // lock); a walk of the table once a window reads 16 x 22,000.
    assert!(
        read < 10 * CHUNKS as i64,
        "{read} manifest rows read to confirm {CHUNKS} unchanged chunks in windows of {WINDOW}"
    );
    assert_eq!(mock.control.stats().inputs, CHUNKS as u64, "nothing embedded again");
}
