//! Reconciler checks (each drift made on purpose, reported, repaired, then clean), Redis
//! data loss, `dlq requeue`, the metrics endpoint and the alert rules (promtool).

use std::process::Stdio;
use std::time::Duration;

use embed_dlq::model::ErrorClass;
use embed_dlq::reconcile::{Check, Mode, ReconcileConfig, Reconciler, Report, Sweep, SweepPolicy};
use embed_dlq::relay::{Relay, RelayConfig};
use embed_dlq::replay::{ReplayConfig, Replayer, Scheduler};
use embed_dlq::streams::StreamKeys;
use embed_dlq::testkit::mock_provider::MockConfig;
use tokio_util::sync::CancellationToken;

use crate::support::*;

async fn ingest(db: &TestDb, doc: &str, n: i32) -> String {
    let mock = start_mock(MockConfig::default()).await;
    let mut corpus = String::new();
    for i in 0..n {
        corpus.push_str(&line(doc, i, &format!("{doc} text {i}")));
    }
    pipeline(&settings(db, &mock))
        .await
        .run(input(corpus.clone().into_bytes()), CancellationToken::new())
        .await
        .unwrap();
    corpus
}

/// Report → repair → a second run must be clean for `check`.
async fn assert_found_repaired_clean(r: &mut Reconciler, check: Check, found: u64) -> Report {
    let report = r.run_once(Mode::Check).await.unwrap();
    assert_eq!(report.get(check).found, found, "{check:?}: {report:#?}");
    let dry = r.run_once(Mode::DryRun).await.unwrap();
    assert_eq!(dry.get(check).found, found, "dry run changes nothing");
    assert_eq!(dry.get(check).repaired, 0);
    let repaired = r.run_once(Mode::Repair).await.unwrap();
    assert!(repaired.get(check).repaired >= found, "{check:?}: {repaired:#?}");
    let clean = r.run_once(Mode::Check).await.unwrap();
    assert_eq!(clean.total_found(), 0, "second run is clean: {clean:#?}");
    report
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_database_has_no_findings() {
    let db = TestDb::new().await;
    ingest(&db, "clean", 20).await;
    let mut r = reconciler(&db, &fresh_keys(), immediate()).await;
    let report = r.run_once(Mode::Check).await.unwrap();
    assert_eq!(report.total_found(), 0, "{report:#?}");
    assert_eq!(report.findings.len(), Check::ALL.len());
    assert_eq!(db.count("SELECT count(*) FROM reconcile_runs").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaked_chunk_is_marked_for_reingest_and_the_next_ingest_restores_it() {
    let db = TestDb::new().await;
    let corpus = ingest(&db, "leak", 10).await;
    sqlx::query("DELETE FROM doc_embeddings WHERE chunk_index = 3").execute(&db.pool).await.unwrap();
    assert_eq!(db.leaks().await, 1);
    let mut r = reconciler(&db, &fresh_keys(), immediate()).await;
    assert_found_repaired_clean(&mut r, Check::Leaks, 1).await;
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest WHERE status = 'reingest'").await, 1);
    let mock = start_mock(MockConfig::default()).await;
    let again = pipeline(&settings(&db, &mock))
        .await
        .run(input(corpus.into_bytes()), CancellationToken::new())
        .await
        .unwrap();
    assert_eq!((again.stored, again.unchanged), (1, 9));
    assert_eq!(db.leaks().await, 0);
    assert_eq!(db.manifest_disagreements().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drifted_vector_is_found_and_requeued() {
    let db = TestDb::new().await;
    ingest(&db, "drift", 10).await;
    sqlx::query("UPDATE doc_embeddings SET content_hash = 'something-else' WHERE chunk_index = 4")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut r = reconciler(&db, &fresh_keys(), immediate()).await;
    let report = assert_found_repaired_clean(&mut r, Check::StoredDrift, 1).await;
    assert_eq!(report.get(Check::StoredDrift).examples, vec!["drift#4".to_string()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_vectors_are_found_and_removed() {
    let db = TestDb::new().await;
    ingest(&db, "dup", 5).await;
    let mut r = reconciler(&db, &fresh_keys(), immediate()).await;
    sqlx::raw_sql(
        "ALTER TABLE doc_embeddings DROP CONSTRAINT doc_embeddings_doc_id_chunk_index_key;
         INSERT INTO doc_embeddings (doc_id, chunk_index, content_hash, embedding)
         SELECT doc_id, chunk_index, content_hash, embedding FROM doc_embeddings WHERE chunk_index = 1;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    assert_eq!(db.duplicates().await, 1);
    assert_found_repaired_clean(&mut r, Check::Duplicates, 1).await;
    assert_eq!(db.duplicates().await, 0);
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_dlq_row_next_to_its_stored_vector_is_removed() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    mock.control.set_outage(true);
    let mut s = settings(&db, &mock);
    s.retry.max_attempts = 1;
    pipeline(&s)
        .await
        .run(input(line("stale", 0, "stale text").into_bytes()), CancellationToken::new())
        .await
        .unwrap();
    // The vector arrives by another path (say, a manual fix), the DLQ row stays behind.
    sqlx::query(
        "INSERT INTO doc_embeddings (doc_id, chunk_index, content_hash, embedding)
         SELECT doc_id, chunk_index, content_hash, array_fill(0.5, ARRAY[768])::vector FROM embedding_dlq",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut r = reconciler(&db, &fresh_keys(), immediate()).await;
    assert_found_repaired_clean(&mut r, Check::StaleDlq, 1).await;
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest WHERE status = 'stored'").await, 1);
    assert_eq!(db.count("SELECT count(*) FROM dlq_outbox WHERE event = 'resolved'").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_norm_vector_is_found_and_removed_for_reingest() {
    let db = TestDb::new().await;
    ingest(&db, "bad", 6).await;
    sqlx::query(
        "UPDATE doc_embeddings SET embedding = array_fill(0, ARRAY[768])::vector WHERE chunk_index = 2",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut r = reconciler(&db, &fresh_keys(), immediate()).await;
    assert_found_repaired_clean(&mut r, Check::BadVectors, 1).await;
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 5);
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest WHERE status = 'reingest'").await, 1);
}

async fn park(db: &TestDb, doc: &str, n: i32) {
    let mock = start_mock(MockConfig::default()).await;
    mock.control.set_outage(true);
    let mut s = settings(db, &mock);
    s.retry.max_attempts = 1;
    let mut corpus = String::new();
    for i in 0..n {
        corpus.push_str(&line(doc, i, &format!("{doc} {i}")));
    }
    pipeline(&s).await.run(input(corpus.into_bytes()), CancellationToken::new()).await.unwrap();
}

/// Makes every transient row due, runs a scheduler pass writing entries of at most `batch`
/// items, and relays the outbox.
async fn schedule_in_entries_of(db: &TestDb, keys: &StreamKeys, r: &Reconciler, batch: usize) {
    sqlx::query("UPDATE embedding_dlq SET next_retry_at = now() WHERE error_class = 'transient'")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut redis = redis().await;
    embed_dlq::replay::ensure_group(&mut redis, keys).await.unwrap();
    Scheduler::new(
        r.store.clone(),
        ReplayConfig { batch, ..ReplayConfig::default() },
        redis.clone(),
        keys.clone(),
    )
    .run_once()
    .await
    .unwrap();
    relay_all(db, keys).await;
}

on_single_and_cluster! {
async fn stuck_outbox_is_reported_until_a_relay_runs() {
    let db = TestDb::new().await;
    park(&db, "ob", 3).await;
    let keys = fresh_keys();
    let mut r =
        reconciler(&db, &keys, ReconcileConfig { outbox_stuck_after: Duration::ZERO, ..immediate() }).await;
    let report = r.run_once(Mode::Repair).await.unwrap();
    assert_eq!(report.get(Check::OutboxBacklog).found, 3);
    assert!(report.get(Check::OutboxBacklog).note.as_deref().unwrap().starts_with("3 unpublished"));
    relay_all(&db, &keys).await;
    assert_eq!(r.run_once(Mode::Check).await.unwrap().get(Check::OutboxBacklog).found, 0);
}
}

/// The walk over published events (every full sweep's, and serve's once Redis lost its data)
/// reads the published rows, not the outbox between them: in the 1M scale run, walking by
/// id behind a relay draining a backlog, each page of 1,000 events scanned the unpublished
/// rows in between (1 to 8 s a page, for seven minutes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_walk_over_published_events_reads_only_published_rows() {
    const PARKED: usize = 4_000;
    let db = TestDb::new().await;
    let keys = fresh_keys();
    park_due(&db, PARKED, "walk").await;
    relay_all(&db, &keys).await;
    // A relay behind a backlog: one event in twenty published, the rest waiting between them
    // (handed back to the relay, as a repair does), while the planner's statistics still say
    // everything is published (as after a large park, before autovacuum analyzes the table
    // again).
    for sql in [
        "ALTER TABLE dlq_outbox SET (autovacuum_enabled = false)",
        "ANALYZE dlq_outbox",
        "UPDATE dlq_outbox SET txid = pg_current_xact_id() WHERE stream = 'events' AND id % 20 <> 0",
    ] {
        sqlx::query(sql).execute(&db.pool).await.unwrap();
    }
    let published = db.count("SELECT count(*) FROM dlq_outbox WHERE stream = 'events' AND id % 20 = 0").await;
    assert!(published > 0 && published < PARKED as i64 / 10, "{published} published");
    let pool = embed_dlq::store::connect(&db.url, 2).await.unwrap();
    let r = Reconciler {
        store: embed_dlq::store::Store::open(pool.clone(), "doc_embeddings").await.unwrap(),
        redis: Some(redis().await),
        keys,
        config: immediate(),
    };
    quiet_statistics().await;
    let before = rows_read(&db, "dlq_outbox").await;
    assert_eq!(r.republish_lost_events().await.unwrap(), Some(0), "every published event is on the stream");
    pool.close().await;
    let read = rows_read_since(&db, "dlq_outbox", before).await;
    assert!(
        read <= 2 * published,
        "the walk over {published} published events read {read} outbox rows (of {PARKED})"
    );
}

/// An incremental run reads the outbox rows of its window, not the outbox. Two ways it did
/// not: a transaction left open anywhere on the server (an idle-in-transaction session, a
/// long report) holds every snapshot's xmin where it began, and walks bounded by that xmin
/// (the events check, the audit of replay work) read every row committed since, on every
/// run; and the events check's page, bounded below both by `(txid, id)` and by `txid`, was
/// an index scan started from the first bound and walked every index entry before the
/// second (the whole txid index, at each incremental run: no row read, so only the index's
/// blocks show it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_incremental_run_reads_its_window_of_the_outbox_even_beside_an_open_transaction() {
    const PARKED: usize = 20_000;
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let mut open = db.pool.begin().await.unwrap();
    sqlx::query("SELECT pg_current_xact_id()").execute(&mut *open).await.unwrap();
    park_due(&db, PARKED, "old").await;
    let mut redis = redis().await;
    embed_dlq::replay::ensure_group(&mut redis, &keys).await.unwrap();
    let pool = embed_dlq::store::connect(&db.url, 2).await.unwrap();
    let store = embed_dlq::store::Store::open(pool.clone(), "doc_embeddings").await.unwrap();
    // Replay work leased too: the audit of replay work looks for an older release's items
    // in the outbox.
    Scheduler::new(store.clone(), ReplayConfig::default(), redis.clone(), keys.clone())
        .run_once()
        .await
        .unwrap();
    relay_all(&db, &keys).await;
    let outbox = db.count("SELECT count(*) FROM dlq_outbox").await;
    assert!(outbox >= PARKED as i64, "{outbox} outbox rows");
    const PAGE: usize = 100;
    let full = ReconcileConfig { sweeps: SweepPolicy::Always(Sweep::Full), page: PAGE, ..immediate() };
    let mut r = Reconciler { store, redis: Some(redis), keys: keys.clone(), config: full };
    assert_eq!(r.run_once(Mode::Check).await.unwrap().total_found(), 0);
    park(&db, "new", 5).await;
    relay_all(&db, &keys).await;
    sqlx::query("ANALYZE dlq_outbox").execute(&db.pool).await.unwrap();
    r.config.sweeps = SweepPolicy::Always(Sweep::Incremental);
    quiet_statistics().await;
    let before = rows_read(&db, "dlq_outbox").await;
    let index_before = index_blocks_read(&db, "dlq_outbox_txid_idx").await;
    let report = r.run_once(Mode::Check).await.unwrap();
    assert_eq!(report.sweep, Sweep::Incremental);
    assert_eq!(report.total_found(), 0, "{report:#?}");
    drop(r);
    pool.close().await;
    let read = rows_read_since(&db, "dlq_outbox", before).await;
    let index_blocks = index_blocks_read(&db, "dlq_outbox_txid_idx").await - index_before;
    let index_size: i64 = db.count("SELECT pg_relation_size('dlq_outbox_txid_idx') / 8192").await;
    open.rollback().await.unwrap();
    eprintln!(
        "an incremental run beside an open transaction read {read} of {outbox} outbox rows, \
         {index_blocks} blocks of the txid index's {index_size}"
    );
    assert!(
        index_blocks < index_size / 3,
        "an incremental run after 5 new rows read {index_blocks} blocks of the txid index's {index_size}"
    );
    // The new rows, and the page of witnesses before the window.
    assert!(
        read < 3 * PAGE as i64,
        "an incremental run after 5 new rows read {read} of {outbox} outbox rows (page {PAGE})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_flushall_is_repaired_and_replay_drains_to_zero() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let private = PrivateRedis::start().await;
    let mut redis = private.manager().await;
    park(&db, "lost", 25).await;
    let mock = start_mock(MockConfig::default()).await;
    let p = pipeline(&settings(&db, &mock)).await;
    let mut r = Reconciler {
        store: p.store.clone(),
        redis: Some(redis.clone()),
        keys: keys.clone(),
        config: immediate(),
    };
    let mut relay = Relay::new(db.pool.clone(), redis.clone(), keys.clone(), RelayConfig::default());
    sqlx::query("UPDATE embedding_dlq SET next_retry_at = now()").execute(&db.pool).await.unwrap();
    embed_dlq::replay::ensure_group(&mut redis, &keys).await.unwrap();
    Scheduler::new(p.store.clone(), ReplayConfig::default(), redis.clone(), keys.clone())
        .run_once()
        .await
        .unwrap();
    while relay.run_once().await.unwrap().claimed > 0 {}
    assert_eq!(r.run_once(Mode::Check).await.unwrap().total_found(), 0, "work is in the stream");

    // Redis loses everything in the middle of the run.
    let _: () = redis::cmd("FLUSHALL").query_async(&mut redis).await.unwrap();
    let report = assert_found_repaired_clean(&mut r, Check::LostReplayWork, 25).await;
    assert_eq!(report.get(Check::LostReplayWork).examples.len(), 5);
    let scheduler = Scheduler::new(p.store.clone(), ReplayConfig::default(), redis.clone(), keys.clone());
    assert_eq!(scheduler.run_once().await.unwrap(), 25, "released leases are issued again");
    while relay.run_once().await.unwrap().claimed > 0 {}
    embed_dlq::replay::ensure_group(&mut redis, &keys).await.unwrap();
    let client = embed_dlq::streams::client(&private.url).unwrap();
    let mut rep = Replayer {
        name: "after-flush".into(),
        store: p.store.clone(),
        embedder: p.embedder.clone(),
        client: client.clone(),
        redis: redis.clone(),
        keys: keys.clone(),
        config: ReplayConfig { block: Duration::from_millis(200), ..Default::default() },
        paused_until: None,
    };
    let mut conn = embed_dlq::streams::blocking(&client, Duration::from_secs(1)).await.unwrap();
    for _ in 0..50 {
        if db.count("SELECT count(*) FROM embedding_dlq").await == 0 {
            break;
        }
        rep.read_once(&mut conn, &CancellationToken::new()).await.unwrap();
    }
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 25);
    assert_eq!(db.leaks().await, 0, "the seed's reconciliation query");
    let corpus: std::collections::BTreeSet<(String, i32)> =
        (0..25).map(|i| ("lost".to_string(), i)).collect();
    assert_corpus_accounted(&db, &corpus).await;
    assert_eq!(r.run_once(Mode::Check).await.unwrap().total_found(), 0);
}

on_single_and_cluster! {
async fn stream_entries_without_a_dlq_row_are_acknowledged_and_deleted() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    park(&db, "orphan", 8).await;
    let mut r = reconciler(&db, &keys, immediate()).await;
    // An entry per row.
    schedule_in_entries_of(&db, &keys, &r, 1).await;
    // The rows go away behind the stream's back (e.g. an operator deleted them by hand).
    sqlx::query("DELETE FROM embedding_dlq WHERE chunk_index < 3").execute(&db.pool).await.unwrap();
    sqlx::query("DELETE FROM ingest_manifest WHERE chunk_index < 3").execute(&db.pool).await.unwrap();
    assert_found_repaired_clean(&mut r, Check::OrphanStreamEntries, 3).await;
    let mut redis = redis().await;
    let len: u64 = redis::cmd("XLEN").arg(keys.replay()).query_async(&mut redis).await.unwrap();
    assert_eq!(len, 5);
}
}

on_single_and_cluster! {
async fn an_entry_of_several_items_is_an_orphan_only_once_none_of_its_rows_is_live() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    park(&db, "batch-orphan", 12).await;
    let mut r = reconciler(&db, &keys, immediate()).await;
    // Entries of up to 4 items: at least 3 of them, whatever the shards.
    schedule_in_entries_of(&db, &keys, &r, 4).await;
    let entries = replay_len(&keys).await as u64;
    assert!((3..12).contains(&entries), "{entries} entries for 12 rows in entries of at most 4");
    // Some rows of every entry go away: each entry still carries live work.
    sqlx::query("DELETE FROM embedding_dlq WHERE chunk_index % 4 = 0").execute(&db.pool).await.unwrap();
    sqlx::query("DELETE FROM ingest_manifest WHERE chunk_index % 4 = 0").execute(&db.pool).await.unwrap();
    let report = r.run_once(Mode::Repair).await.unwrap();
    let orphans = report.get(Check::OrphanStreamEntries);
    assert_eq!((orphans.found, orphans.repaired), (0, 0), "{report:#?}");
    assert_eq!(replay_len(&keys).await as u64, entries);
    // Then all of them: every entry is an orphan, and is deleted.
    sqlx::query("DELETE FROM embedding_dlq").execute(&db.pool).await.unwrap();
    sqlx::query("DELETE FROM ingest_manifest").execute(&db.pool).await.unwrap();
    assert_found_repaired_clean(&mut r, Check::OrphanStreamEntries, entries).await;
    assert_eq!(replay_len(&keys).await as u64, 0);
}
}

on_single_and_cluster! {
async fn replay_that_does_not_drain_is_reported() {
    let db = TestDb::new().await;
    park(&db, "stall", 4).await;
    sqlx::query("UPDATE embedding_dlq SET next_retry_at = now() - interval '1 hour'")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut r = reconciler(
        &db,
        &fresh_keys(),
        ReconcileConfig { replay_stall_after: Duration::from_secs(60), ..immediate() },
    )
    .await;
    let report = r.run_once(Mode::Repair).await.unwrap();
    assert_eq!(report.get(Check::ReplayStalled).found, 4);
    assert_eq!(report.get(Check::ReplayStalled).repaired, 0, "nothing to repair: an alert for the operator");
}
}

/// The stalled-replay check reads each due row's own lease by its key, whatever the
/// statistics say: planned from aged statistics (no live lease expected) it compared every
/// stalled row with every live lease, 20,000 rows behind 10,000 leases here, and a backlog
/// of a million rows behind the default cap would have held a reconcile run for hours.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stalled_replay_check_reads_each_rows_lease_by_key_whatever_the_statistics_say() {
    let db = TestDb::new().await;
    insert_parked_rows(&db, "late", 20_000, Some("1 hour")).await;
    age_lease_statistics(&db).await;
    // Half the rows are out as replay work (live leases), the other half wait behind the cap.
    sqlx::raw_sql(
        "INSERT INTO replay_lease (dlq_id, generation, leased_until)
         SELECT id, generation, now() + interval '15 minutes' FROM embedding_dlq ORDER BY id LIMIT 10000",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    quiet_statistics().await;
    let before = index_scans(&db, "replay_lease_pkey").await;
    let mut r = reconciler(
        &db,
        &fresh_keys(),
        ReconcileConfig { replay_stall_after: Duration::from_secs(60), ..immediate() },
    )
    .await;
    let report = r.run_once(Mode::Check).await.unwrap();
    assert_eq!(report.get(Check::ReplayStalled).found, 10_000, "the rows without a live lease");
    quiet_statistics().await;
    let probes = index_scans(&db, "replay_lease_pkey").await - before;
    assert!(probes >= 20_000, "each stalled row's lease read by key: {probes} probes");
}

/// Buffer hits on temporary tables so far, by every backend of the server (`pg_stat_io`,
/// after [`quiet_statistics`]). The audit of
/// replay work keeps its lists in temporary tables, whose own statistics go with them.
async fn temp_table_hits(db: &TestDb) -> i64 {
    quiet_statistics().await;
    sqlx::query_scalar("SELECT sum(hits)::bigint FROM pg_stat_io WHERE object = 'temp relation'")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// The audit of replay work looks each leased row up in the work it found outstanding by
/// key, whatever the statistics of the leases say: planned from aged ones (no live lease
/// expected) it scanned the whole list of outstanding items once per lease, 10,000 x 10,000
/// rows for a backlog at the default cap (7.8 s a run, `EXPLAIN ANALYZE`,
/// docs/perf-notes/2026-12-03-replay-commit-and-aged-lease-statistics.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_of_replay_work_looks_leases_up_by_key_whatever_the_statistics_say() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    insert_parked_rows(&db, "out", 20_000, Some("1 minute")).await;
    age_lease_statistics(&db).await;
    // Before autovacuum looks at the leases written below (it may within the test's waits).
    sqlx::raw_sql("ALTER TABLE replay_lease SET (autovacuum_enabled = false)")
        .execute(&db.pool)
        .await
        .unwrap();
    // A scheduler pass: 20,000 live leases, their 20,000 items waiting in the replay stream.
    let mut redis = redis().await;
    embed_dlq::replay::ensure_group(&mut redis, &keys).await.unwrap();
    let store = pipeline(&settings(&db, &start_mock(MockConfig::default()).await)).await.store;
    let config = ReplayConfig { outstanding_max: 20_000, ..ReplayConfig::default() };
    assert_eq!(Scheduler::new(store, config, redis.clone(), keys.clone()).run_once().await.unwrap(), 20_000);
    let before = temp_table_hits(&db).await;
    let mut r = reconciler(&db, &keys, immediate()).await;
    let report = r.run_once(Mode::Check).await.unwrap();
    assert_eq!(report.get(Check::LostReplayWork).found, 0, "every leased row's item is on the stream");
    // By key: a few pages of the lists' indexes a lease, about 60,000 hits. A scan of the
    // list of 20,000 outstanding items (about 110 pages) for each of the 20,000 leases: 2.2
    // million. Other tests' audits at the same time add thousands.
    let hits = temp_table_hits(&db).await - before;
    assert!(hits < 1_000_000, "the audit looked each lease's work up by key: {hits} temporary-table hits");
}

on_single_and_cluster! {
async fn requeue_of_a_permanent_class_stores_it_once_the_cause_is_fixed() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    // A provider that rejects long inputs with 422...
    let strict = start_mock(MockConfig { max_input_chars: 20, ..MockConfig::default() }).await;
    let mut corpus = String::new();
    for i in 0..6 {
        corpus.push_str(&line("perm", i, &format!("a text longer than twenty characters {i}")));
    }
    pipeline(&settings(&db, &strict))
        .await
        .run(input(corpus.into_bytes()), CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq WHERE error_class = 'permanent_input'").await, 6);
    // ...is fixed: replays go to one that accepts them.
    let fixed = start_mock(MockConfig::default()).await;
    let p = pipeline(&settings(&db, &fixed)).await;
    let filter = embed_dlq::dlq::Filter { class: Some(ErrorClass::PermanentInput), ..Default::default() };
    assert_eq!(embed_dlq::dlq::requeue(&p.store, &filter, true, 100).await.unwrap().requeued, 6);
    assert_eq!(db.count("SELECT count(*) FROM dlq_outbox WHERE event = 'requeued'").await, 0, "dry run");
    let mut redis = redis().await;
    embed_dlq::replay::ensure_group(&mut redis, &keys).await.unwrap();
    assert_eq!(embed_dlq::dlq::requeue(&p.store, &filter, false, 100).await.unwrap().requeued, 6);
    let scheduler = Scheduler::new(p.store.clone(), ReplayConfig::default(), redis.clone(), keys.clone());
    assert_eq!(scheduler.run_once().await.unwrap(), 6, "requeued rows are due now");
    relay_all(&db, &keys).await;
    let mut rep = Replayer {
        name: "requeue".into(),
        store: p.store.clone(),
        embedder: p.embedder.clone(),
        client: embed_dlq::streams::client(&redis_url()).unwrap(),
        redis,
        keys: keys.clone(),
        config: ReplayConfig { block: Duration::from_millis(200), ..Default::default() },
        paused_until: None,
    };
    let client = embed_dlq::streams::client(&redis_url()).unwrap();
    let mut conn = embed_dlq::streams::blocking(&client, Duration::from_secs(1)).await.unwrap();
    let c = rep.read_once(&mut conn, &CancellationToken::new()).await.unwrap();
    assert_eq!(c.replayed, 6, "{c:?}");
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings WHERE doc_id = 'perm'").await, 6);
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest WHERE status = 'stored'").await, 6);
    // Purge, for completeness: dry run, then for real.
    park(&db, "purge", 3).await;
    let filter = embed_dlq::dlq::Filter { doc: Some("purge".into()), ..Default::default() };
    assert_eq!(embed_dlq::dlq::purge(&p.store, &filter, true).await.unwrap(), 3);
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 3);
    assert_eq!(embed_dlq::dlq::purge(&p.store, &filter, false).await.unwrap(), 3);
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
    assert_eq!(db.leaks().await, 0);
    // A document prefix selects the documents that start with it, taken literally (`_` and
    // `%` are not wildcards), and nothing else.
    for (doc, n) in [("src1-a", 2), ("src1-b", 2), ("src10", 1), ("src1_x", 1), ("src2-a", 1)] {
        park(&db, doc, n).await;
    }
    let prefix = |p: &str| embed_dlq::dlq::Filter { doc_prefix: Some(p.into()), ..Default::default() };
    assert_eq!(embed_dlq::dlq::count(&p.store, &prefix("src1-")).await.unwrap(), 4);
    assert_eq!(embed_dlq::dlq::count(&p.store, &prefix("src1_")).await.unwrap(), 1);
    assert_eq!(embed_dlq::dlq::count(&p.store, &prefix("src")).await.unwrap(), 7);
    assert_eq!(embed_dlq::dlq::purge(&p.store, &prefix("src1-"), false).await.unwrap(), 4);
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 3);
}
}

fn promtool() -> std::process::Command {
    let c = std::process::Command::new("promtool");
    if which_promtool().is_none() {
        panic!("promtool is missing: scripts/test.sh installs Debian's prometheus package");
    }
    c
}

fn which_promtool() -> Option<()> {
    std::process::Command::new("promtool")
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|_| ())
}

#[test]
fn alert_rules_pass_promtool_check_and_unit_tests() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/prometheus");
    let check = promtool().args(["check", "rules", "alerts.yml"]).current_dir(dir).output().unwrap();
    assert!(check.status.success(), "{}", String::from_utf8_lossy(&check.stdout));
    let test = promtool().args(["test", "rules", "alerts_test.yml"]).current_dir(dir).output().unwrap();
    assert!(
        test.status.success(),
        "{}{}",
        String::from_utf8_lossy(&test.stdout),
        String::from_utf8_lossy(&test.stderr)
    );
}

on_single_and_cluster! {
async fn metrics_endpoint_passes_promtool_and_matches_the_dlq() {
    let db = TestDb::new().await;
    park(&db, "metrics", 7).await;
    let body = scrape_serve(&db).await;
    let depth_line = body
        .lines()
        .find(|l| l.starts_with("embed_dlq_dlq_depth{error_class=\"transient\"}"))
        .expect("transient depth exported");
    let depth: f64 = depth_line.rsplit(' ').next().unwrap().parse().unwrap();
    assert_eq!(
        depth as i64,
        db.count("SELECT count(*) FROM embedding_dlq WHERE error_class = 'transient'").await
    );
    let mut check = promtool()
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    check.stdin.take().unwrap().write_all(body.as_bytes()).unwrap();
    let out = check.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}\n{body}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
}

on_single_and_cluster! {
async fn periodic_reconcile_hands_over_every_run_until_cancelled() {
    let db = TestDb::new().await;
    ingest(&db, "periodic", 5).await;
    let mut r = reconciler(&db, &fresh_keys(), immediate()).await;
    let cancel = CancellationToken::new();
    let stopper = cancel.clone();
    let mut runs = Vec::new();
    let on_run = |outcome: Result<Report, _>| {
        runs.push(outcome.expect("reconcile run").total_found());
        if runs.len() == 3 {
            stopper.cancel();
        }
    };
    let every = Some(Duration::from_millis(20));
    let periodic = embed_dlq::serve::reconcile_periodically(&mut r, Mode::Check, every, on_run, &cancel);
    tokio::time::timeout(Duration::from_secs(30), periodic).await.expect("stops once cancelled");
    assert_eq!(runs, vec![0, 0, 0]);
    assert_eq!(db.count("SELECT count(*) FROM reconcile_runs").await, 3);
    // Without a period: exactly one run, then it returns on its own.
    let mut once = 0;
    let on_run = |outcome: Result<Report, _>| {
        outcome.expect("reconcile run");
        once += 1;
    };
    embed_dlq::serve::reconcile_periodically(&mut r, Mode::Check, None, on_run, &CancellationToken::new())
        .await;
    assert_eq!(once, 1);
}
}
