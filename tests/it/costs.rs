//! Costs that do not grow with the DLQ (issue 19, item 6): the DLQ gauges `serve` samples
//! every 5 s equal plain counts of the table after every kind of write and read a bounded
//! number of rows; the reconciler's events check reads the stream in batches.

use std::time::Duration;

use embed_dlq::gauges::{DlqGauges, SCHEDULE_COUNT_CAP, dlq_gauges};
use embed_dlq::model::ErrorClass;
use embed_dlq::testkit::mock_provider::MockConfig;
use sqlx::{Acquire, PgConnection, Row};
use tokio_util::sync::CancellationToken;

use crate::support::*;

/// What the gauges must say, by plain SQL over every row: the test's oracle.
#[derive(Debug, PartialEq)]
struct Oracle {
    depth: Vec<(ErrorClass, i64)>,
    ready: i64,
    backing_off: i64,
    exhausted: i64,
    oldest_secs: f64,
    next_due_secs: f64,
}

async fn oracle(db: &TestDb) -> Oracle {
    let mut depth = Vec::new();
    for class in ErrorClass::ALL {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM embedding_dlq WHERE error_class = $1")
            .bind(class.as_str())
            .fetch_one(&db.pool)
            .await
            .unwrap();
        depth.push((class, n));
    }
    let r = sqlx::query(
        "SELECT count(*) FILTER (WHERE error_class = 'transient' AND exhausted_at IS NULL
                                   AND next_retry_at <= now()) AS ready,
                count(*) FILTER (WHERE error_class = 'transient' AND exhausted_at IS NULL
                                   AND next_retry_at > now()) AS backing_off,
                count(*) FILTER (WHERE exhausted_at IS NOT NULL) AS exhausted,
                COALESCE(extract(epoch FROM now() - min(first_failed_at)), 0)::float8 AS oldest,
                COALESCE(greatest(extract(epoch FROM min(next_retry_at) - now()), 0), 0)::float8 AS next_due
           FROM embedding_dlq",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    Oracle {
        depth,
        ready: r.get("ready"),
        backing_off: r.get("backing_off"),
        exhausted: r.get("exhausted"),
        oldest_secs: r.get("oldest"),
        next_due_secs: r.get("next_due"),
    }
}

async fn gauges(db: &TestDb) -> DlqGauges {
    let mut conn = db.pool.acquire().await.unwrap();
    dlq_gauges(&mut conn).await.unwrap()
}

/// The gauges equal the oracle (ages within a second: two statements, two clocks).
async fn assert_gauges_match(db: &TestDb, step: &str) {
    let g = gauges(db).await;
    let o = oracle(db).await;
    let s = g.schedule;
    assert_eq!(
        (&g.depth, s.ready, s.backing_off, s.exhausted, s.capped),
        (&o.depth, o.ready, o.backing_off, o.exhausted, false),
        "{step}: gauges {g:?}, oracle {o:?}"
    );
    assert!((s.oldest_secs - o.oldest_secs).abs() < 1.0, "{step}: oldest {g:?} vs {o:?}");
    assert!((s.next_due_secs - o.next_due_secs).abs() < 1.0, "{step}: next due {g:?} vs {o:?}");
}

/// Parks `n` chunks of `doc` through the pipeline with every request failing (transient).
async fn park_transient(db: &TestDb, doc: &str, n: i32, text: &str) {
    let mock = start_mock(MockConfig::default()).await;
    mock.control.set_outage(true);
    let mut s = settings(db, &mock);
    s.retry.max_attempts = 1;
    let corpus: String = (0..n).map(|i| line(doc, i, &format!("{text} {i}"))).collect();
    pipeline(&s).await.run(input(corpus.into_bytes()), CancellationToken::new()).await.unwrap();
}

/// Parks `n` chunks of `doc` as `permanent_input` (the provider rejects them with 422).
async fn park_permanent(db: &TestDb, doc: &str, n: i32) {
    let strict = start_mock(MockConfig { max_input_chars: 20, ..MockConfig::default() }).await;
    let corpus: String =
        (0..n).map(|i| line(doc, i, &format!("a text longer than twenty characters {i}"))).collect();
    pipeline(&settings(db, &strict))
        .await
        .run(input(corpus.into_bytes()), CancellationToken::new())
        .await
        .unwrap();
}

/// Due times away from the oracle's `now()`: a third due an hour ago, the rest in an hour
/// (the pipeline's jittered delays can fall within a second of now, and two statements read
/// two clocks).
async fn spread_due_times(db: &TestDb) {
    sqlx::query(
        "UPDATE embedding_dlq SET next_retry_at = CASE WHEN id % 3 = 0 THEN now() - interval '1 hour'
                                                       ELSE now() + interval '1 hour' END
          WHERE next_retry_at IS NOT NULL",
    )
    .execute(&db.pool)
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_gauges_equal_plain_counts_after_parks_reparks_replays_requeues_and_purges() {
    let db = TestDb::new().await;
    assert_gauges_match(&db, "empty").await;
    park_transient(&db, "t", 40, "first").await;
    park_permanent(&db, "p", 12).await;
    spread_due_times(&db).await;
    assert_gauges_match(&db, "parked").await;
    // Re-park with new content: the upsert's update path (and an insert path in the same
    // statement for the new chunks 40..50).
    park_transient(&db, "t", 50, "second").await;
    spread_due_times(&db).await;
    assert_gauges_match(&db, "re-parked").await;
    // Replay passes as the replay commit writes them: re-parked, turned permanent, exhausted.
    sqlx::query(
        "UPDATE embedding_dlq SET replays = replays + 1, generation = nextval('embed_dlq_generation_seq'),
                error_class = CASE WHEN chunk_index % 5 = 1 THEN 'permanent_input' ELSE error_class END,
                next_retry_at = CASE WHEN chunk_index % 5 IN (1, 2) THEN NULL ELSE next_retry_at END,
                exhausted_at = CASE WHEN chunk_index % 5 = 2 THEN now() END,
                exhausted_reason = CASE WHEN chunk_index % 5 = 2 THEN 'replay limit reached' END
          WHERE doc_id = 't' AND chunk_index < 30",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    assert_gauges_match(&db, "re-parked by replay").await;
    // Replayed: the rows deleted.
    sqlx::query("DELETE FROM embedding_dlq WHERE doc_id = 't' AND chunk_index % 5 = 3")
        .execute(&db.pool)
        .await
        .unwrap();
    assert_gauges_match(&db, "replayed").await;
    // Requeue (exhausted and permanent rows become transient and due) and purge, as the
    // operator runs them.
    let store = embed_dlq::store::Store::open(db.pool.clone(), "doc_embeddings").await.unwrap();
    let exhausted = embed_dlq::dlq::Filter { exhausted: true, ..Default::default() };
    assert!(embed_dlq::dlq::requeue(&store, &exhausted, false, 100).await.unwrap().requeued > 0);
    let permanent = embed_dlq::dlq::Filter { class: Some(ErrorClass::PermanentInput), ..Default::default() };
    assert!(embed_dlq::dlq::requeue(&store, &permanent, false, 3).await.unwrap().requeued > 0);
    sqlx::query("UPDATE embedding_dlq SET next_retry_at = now() - interval '1 hour' WHERE next_retry_at > now() - interval '1 minute' AND next_retry_at <= now() + interval '1 minute'")
        .execute(&db.pool)
        .await
        .unwrap();
    assert_gauges_match(&db, "requeued").await;
    let purge = embed_dlq::dlq::Filter { doc: Some("p".into()), ..Default::default() };
    assert!(embed_dlq::dlq::purge(&store, &purge, false).await.unwrap() > 0);
    assert_gauges_match(&db, "purged").await;
    // Concurrent writers, some rolled back: their deltas commit or vanish with their rows.
    let mut writers = Vec::new();
    for w in 0..6i32 {
        let pool = db.pool.clone();
        writers.push(tokio::spawn(async move {
            let mut conn = pool.acquire().await.unwrap();
            let mut tx = conn.begin().await.unwrap();
            sqlx::query(
                "INSERT INTO embedding_dlq (target_table, doc_id, chunk_index, content_hash, payload,
                                            error_class, error_reason, attempts, next_retry_at, exhausted_at)
                 SELECT 'public.doc_embeddings', 'w' || $1, i, 'h', '{\"text\": \"x\"}',
                        CASE WHEN i % 4 = 0 THEN 'invalid_vector' ELSE 'transient' END, 'x', 1,
                        CASE WHEN i % 4 IN (1, 2) THEN now() + make_interval(hours => i % 3 - 1) END,
                        CASE WHEN i % 4 = 3 THEN now() END
                   FROM generate_series(0, 19) i",
            )
            .bind(w)
            .execute(&mut *tx)
            .await
            .unwrap();
            sqlx::query("DELETE FROM embedding_dlq WHERE doc_id = 'w' || $1 AND chunk_index < 5")
                .bind(w)
                .execute(&mut *tx)
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
            if w % 3 == 0 { tx.rollback().await.unwrap() } else { tx.commit().await.unwrap() }
        }));
        // A sample (and its fold) while the writers are in flight.
        gauges(&db).await;
    }
    for w in writers {
        w.await.unwrap();
    }
    assert_gauges_match(&db, "concurrent writers").await;
    // Every writer of the tool keeps `next_retry_at` to live transient rows: what lets the
    // gauges read `embedding_dlq_ready_idx` without rejecting entries.
    assert_eq!(
        db.count(
            "SELECT count(*) FROM embedding_dlq WHERE next_retry_at IS NOT NULL
                AND NOT (error_class = 'transient' AND exhausted_at IS NULL)"
        )
        .await,
        0
    );
    sqlx::query("TRUNCATE embedding_dlq CASCADE").execute(&db.pool).await.unwrap();
    assert_gauges_match(&db, "truncated").await;
    park_transient(&db, "after", 3, "again").await;
    spread_due_times(&db).await;
    assert_gauges_match(&db, "parked after the truncate").await;
}

/// `n` rows of `class` (1 kB payloads, as the tool parks them), `due` of them scheduled due an
/// hour ago, `waiting` of them in an hour, `exhausted` of them given up on.
async fn fill(db: &TestDb, doc: &str, n: i64, class: &str, due: i64, waiting: i64, exhausted: i64) {
    sqlx::query(
        "INSERT INTO embedding_dlq (target_table, doc_id, chunk_index, content_hash, payload,
                                    error_class, error_reason, attempts, next_retry_at, exhausted_at,
                                    first_failed_at)
         SELECT 'public.doc_embeddings', $1, i, md5(i::text),
                jsonb_build_object('text', repeat('x', 1000)), $2, 'x', 1,
                CASE WHEN i < $3 THEN now() - interval '1 hour'
                     WHEN i < $3 + $4 THEN now() + interval '1 hour' END,
                CASE WHEN i >= $3 + $4 AND i < $3 + $4 + $5 THEN now() END,
                now() - make_interval(secs => i % 1000)
           FROM generate_series(0, $6 - 1) i",
    )
    .bind(doc)
    .bind(class)
    .bind(due)
    .bind(waiting)
    .bind(exhausted)
    .bind(n)
    .execute(&db.pool)
    .await
    .unwrap();
}

/// Rows read from `embedding_dlq` and index entries returned from its indexes by this
/// session so far (the statistics of the open transaction included).
async fn dlq_reads(conn: &mut PgConnection) -> i64 {
    sqlx::query_scalar(
        "SELECT (pg_stat_get_xact_tuples_returned('embedding_dlq'::regclass)
                 + pg_stat_get_xact_tuples_fetched('embedding_dlq'::regclass)
                 + (SELECT COALESCE(sum(pg_stat_get_xact_tuples_returned(indexrelid)
                                        + pg_stat_get_xact_tuples_fetched(indexrelid)), 0)
                      FROM pg_index WHERE indrelid = 'embedding_dlq'::regclass))::bigint",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_gauges_read_a_bounded_number_of_rows_whatever_the_dlq_holds() {
    let db = TestDb::new().await;
    // 30,000 permanent rows and 300 scheduled ones: the old aggregates read every row, twice.
    fill(&db, "permanent", 30_000, "permanent_input", 0, 0, 0).await;
    fill(&db, "transient", 400, "transient", 150, 150, 100).await;
    sqlx::query("ANALYZE embedding_dlq").execute(&db.pool).await.unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    let before = dlq_reads(&mut tx).await;
    let g = dlq_gauges(&mut tx).await.unwrap();
    let read = dlq_reads(&mut tx).await - before;
    tx.commit().await.unwrap();
    let o = oracle(&db).await;
    assert_eq!((g.schedule.ready, g.schedule.backing_off, g.schedule.exhausted), (150, 150, 100));
    assert_eq!(g.depth, o.depth);
    // The 150 due rows (an index entry and a heap row each) and the first entry of two
    // indexes, each counted by the index and by the heap fetch: never the whole table.
    assert!(read <= 2 * 2 * 150 + 16, "the gauges read {read} rows and index entries of a 30,400-row DLQ");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_schedule_counts_stop_at_the_cap_and_derive_the_other_side_exactly() {
    let db = TestDb::new().await;
    let cap = SCHEDULE_COUNT_CAP;
    // More due than the cap: backing off is counted, ready derived from the exact total.
    fill(&db, "due", cap + 500, "transient", cap + 300, 200, 0).await;
    let s = gauges(&db).await.schedule;
    assert_eq!((s.ready, s.backing_off, s.capped), (cap + 300, 200, false));
    assert_gauges_match(&db, "ready over the cap").await;
    // Both over the cap: each reads the cap, and says so.
    fill(&db, "waiting", cap + 10, "transient", 0, cap + 10, 0).await;
    let s = gauges(&db).await.schedule;
    assert_eq!((s.ready, s.backing_off, s.capped), (cap, cap, true));
}

/// `XRANGE` calls Redis served since the last `CONFIG RESETSTAT`.
async fn xrange_calls(redis: &mut embed_dlq::streams::RedisConn) -> u64 {
    let info: String = redis::cmd("INFO").arg("commandstats").query_async(redis).await.unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_xrange:calls="))
        .map_or(0, |rest| rest.split(',').next().unwrap().parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_events_check_reads_each_page_of_events_in_one_range_and_still_tells_deleted_from_trimmed() {
    use embed_dlq::reconcile::{Check, Mode, ReconcileConfig, Reconciler, Sweep};
    use embed_dlq::relay::{Relay, RelayConfig};
    let db = TestDb::new().await;
    // A Redis of its own: the command counts are this test's alone.
    let private = PrivateRedis::start().await;
    let keys = fresh_keys();
    park_transient(&db, "ev", 300, "event").await;
    let mut relay =
        Relay::new(db.pool.clone(), private.manager().await, keys.clone(), RelayConfig::default());
    while relay.run_once().await.unwrap().claimed > 0 {}
    let mut redis = private.manager().await;
    let entries: redis::streams::StreamRangeReply =
        redis::cmd("XRANGE").arg(keys.events()).arg("-").arg("+").query_async(&mut redis).await.unwrap();
    assert_eq!(entries.ids.len(), 300);
    // Two deleted (findings), then the oldest 20 trimmed by the length cap (policy).
    let _: i64 = redis::cmd("XDEL")
        .arg(keys.events())
        .arg(&entries.ids[100].id)
        .arg(&entries.ids[201].id)
        .query_async(&mut redis)
        .await
        .unwrap();
    let _: i64 =
        redis::cmd("XTRIM").arg(keys.events()).arg("MAXLEN").arg(278).query_async(&mut redis).await.unwrap();
    let store = embed_dlq::store::Store::open(db.pool.clone(), "doc_embeddings").await.unwrap();
    let config = ReconcileConfig { events_maxlen: 278, page: 1000, ..immediate() };
    let mut r = Reconciler { store, redis: Some(private.manager().await), keys: keys.clone(), config };
    let _: () = redis::cmd("CONFIG").arg("RESETSTAT").query_async(&mut redis).await.unwrap();
    let report = r.run_once(Mode::Check).await.unwrap();
    let calls = xrange_calls(&mut redis).await;
    let missing = report.get(Check::MissingEvents);
    assert_eq!(missing.found, 2, "{report:#?}");
    assert_eq!(missing.note.as_deref(), Some("20 trimmed by the stream's length cap"));
    // One range and one head read for the page of 300 events, and the replay stream checks'
    // own pages: never one command per event.
    assert!(calls <= 6, "{calls} XRANGE calls to check 300 events");
    // Small pages, then the two events republished at the end of the stream: the pages that
    // hold them span most of the stream, their ranges are cut at the COUNT, and the ids past
    // the cut are looked up one by one, with the same answers.
    r.config.page = 7;
    let report = r.run_sweep(Mode::Repair, Some(Sweep::Full)).await.unwrap();
    assert_eq!(report.get(Check::MissingEvents).found, 2, "{report:#?}");
    assert_eq!(report.get(Check::MissingEvents).repaired, 2);
    while relay.run_once().await.unwrap().claimed > 0 {}
    let clean = r.run_sweep(Mode::Check, Some(Sweep::Full)).await.unwrap();
    assert_eq!(clean.get(Check::MissingEvents).found, 0, "{clean:#?}");
    assert_eq!(
        clean.get(Check::MissingEvents).note.as_deref(),
        Some("20 trimmed by the stream's length cap")
    );
    let _: i64 = redis::cmd("XDEL")
        .arg(keys.events())
        .arg(&entries.ids[150].id)
        .query_async(&mut redis)
        .await
        .unwrap();
    let full = r.run_sweep(Mode::Check, Some(Sweep::Full)).await.unwrap();
    assert_eq!(full.get(Check::MissingEvents).found, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_incremental_events_check_reads_the_events_since_the_previous_run_yet_finds_a_stream_that_lost_its_data()
 {
    use embed_dlq::reconcile::{Check, Mode, ReconcileConfig, Reconciler, Sweep};
    use embed_dlq::relay::{Relay, RelayConfig};
    let db = TestDb::new().await;
    let private = PrivateRedis::start().await;
    let keys = fresh_keys();
    let mut redis = private.manager().await;
    let mut relay =
        Relay::new(db.pool.clone(), private.manager().await, keys.clone(), RelayConfig::default());
    park_transient(&db, "old", 300, "event").await;
    relay_until_idle(&mut relay).await;
    let old: redis::streams::StreamRangeReply =
        redis::cmd("XRANGE").arg(keys.events()).arg("-").arg("+").query_async(&mut redis).await.unwrap();
    assert_eq!(old.ids.len(), 300);
    let store = embed_dlq::store::Store::open(db.pool.clone(), "doc_embeddings").await.unwrap();
    let config = ReconcileConfig { page: 10, ..immediate() };
    let mut r = Reconciler { store, redis: Some(private.manager().await), keys: keys.clone(), config };
    let first = r.run_sweep(Mode::Check, Some(Sweep::Full)).await.unwrap();
    assert_eq!(first.get(Check::MissingEvents).found, 0, "{first:#?}");

    park_transient(&db, "new", 5, "event").await;
    relay_until_idle(&mut relay).await;
    let _: () = redis::cmd("CONFIG").arg("RESETSTAT").query_async(&mut redis).await.unwrap();
    let report = r.run_sweep(Mode::Check, Some(Sweep::Incremental)).await.unwrap();
    let calls = xrange_calls(&mut redis).await;
    assert_eq!(report.get(Check::MissingEvents).found, 0, "{report:#?}");
    // The page of witnesses and the five new events (a range and a head read each), and the
    // replay stream checks' own pages: not the 31 pages of every retained event.
    assert!(calls <= 8, "{calls} XRANGE calls for 5 events published since the previous run");

    // An entry deleted by hand from the middle of the stream: only a full sweep finds it.
    let _: i64 =
        redis::cmd("XDEL").arg(keys.events()).arg(&old.ids[150].id).query_async(&mut redis).await.unwrap();
    let incremental = r.run_sweep(Mode::Check, Some(Sweep::Incremental)).await.unwrap();
    assert_eq!(incremental.get(Check::MissingEvents).found, 0, "{incremental:#?}");
    let full = r.run_sweep(Mode::Repair, Some(Sweep::Full)).await.unwrap();
    assert_eq!(
        (full.get(Check::MissingEvents).found, full.get(Check::MissingEvents).repaired),
        (1, 1),
        "{full:#?}"
    );
    relay_until_idle(&mut relay).await;

    // The stream loses its data: the witnesses are gone, and the incremental run checks and
    // repairs every retained event.
    let _: () = redis::cmd("FLUSHALL").query_async(&mut redis).await.unwrap();
    let lost = r.run_sweep(Mode::Repair, Some(Sweep::Incremental)).await.unwrap();
    let missing = lost.get(Check::MissingEvents);
    assert_eq!((missing.found, missing.repaired), (305, 305), "{lost:#?}");
    assert!(missing.note.as_deref().is_some_and(|n| n.contains("before the previous run")), "{missing:#?}");
    relay_until_idle(&mut relay).await;
    let len: usize = redis::cmd("XLEN").arg(keys.events()).query_async(&mut redis).await.unwrap();
    assert_eq!(len, 305, "every retained event is on the stream again");
    let clean = r.run_sweep(Mode::Check, Some(Sweep::Incremental)).await.unwrap();
    assert_eq!(clean.get(Check::MissingEvents).found, 0, "{clean:#?}");
}

/// A manifest believed empty (a corpus deleted and analyzed before its pages were vacuumed
/// away, then ingested again): requeue and purge, which change a batch of chunks' manifest
/// rows, read only those rows. Joined with the batch, the manifest's update and delete walked
/// every row of it for each batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requeue_and_purge_read_only_their_batch_of_the_manifest_whatever_the_statistics_say() {
    let db = TestDb::new().await;
    leave_believed_empty(&db, "ingest_manifest", &stored_chunks("deleted", 20_000)).await;
    // 2,000 rows replay gave up on, beside 20,000 stored chunks; the DLQ's statistics fresh.
    insert_parked_rows_unanalyzed(&db, "gave-up", 2_000, Some("1 minute")).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "{};
         UPDATE embedding_dlq SET exhausted_at = now(), exhausted_reason = 'replay limit reached';
         UPDATE ingest_manifest SET status = 'exhausted' WHERE doc_id LIKE 'gave-up-%';
         ANALYZE embedding_dlq;",
        stored_chunks("stored", 20_000)
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    let store = embed_dlq::store::Store::open(db.pool.clone(), "doc_embeddings").await.unwrap();
    let gave_up = "SELECT count(*) FROM ingest_manifest WHERE doc_id LIKE 'gave-up-%'";

    quiet_statistics().await;
    let before = rows_read(&db, "ingest_manifest").await;
    let exhausted = embed_dlq::dlq::Filter { exhausted: true, ..Default::default() };
    assert_eq!(embed_dlq::dlq::requeue(&store, &exhausted, false, 100_000).await.unwrap().requeued, 2_000);
    quiet_statistics().await;
    let requeue_read = rows_read(&db, "ingest_manifest").await - before;
    let parked = "SELECT count(*) FROM ingest_manifest WHERE doc_id LIKE 'gave-up-%' AND status = 'parked'";
    assert_eq!(db.count(parked).await, 2_000);

    let before = rows_read(&db, "ingest_manifest").await;
    assert_eq!(
        embed_dlq::dlq::purge(&store, &embed_dlq::dlq::Filter::default(), false).await.unwrap(),
        2_000
    );
    quiet_statistics().await;
    let purge_read = rows_read(&db, "ingest_manifest").await - before;
    assert_eq!(db.count(gave_up).await, 0);
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest").await, 20_000);

    // The lock reads each row, the update or delete finds it by key (2 a row, and the
    // candidates' `needs re-ingest` check another for requeue). Walking the manifest for each
    // batch read its 22,000 rows a batch.
    assert!(requeue_read <= 4 * 2_000, "manifest rows read by the requeue: {requeue_read}");
    assert!(purge_read <= 4 * 2_000, "manifest rows read by the purge: {purge_read}");
}
