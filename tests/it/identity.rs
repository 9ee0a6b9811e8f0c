//! Identity and fencing (issue 7 items 1, 4, 5, 7, 13): the target table is part of a chunk's
//! identity; replay commits are fenced by generation and embedded content; the last line of a
//! corpus wins; parks are idempotent and announced once per content generation. Real
//! Postgres, real Redis, the mock provider over real HTTP.

use std::collections::HashMap;
use std::time::Duration;

use embed_dlq::ingest::{IngestSummary, Pipeline};
use embed_dlq::model::{ErrorClass, content_hash};
use embed_dlq::reconcile::{Mode, Reconciler};
use embed_dlq::relay::RelayConfig;
use embed_dlq::replay::{Replayer, Scheduler};
use embed_dlq::store::Store;
use embed_dlq::store::park::ParkedChunk;
use embed_dlq::streams::StreamKeys;
use embed_dlq::testkit::mock_provider::{self, MockConfig, MockProvider};
use tokio_util::sync::CancellationToken;

use crate::support::*;

fn corpus(doc: &str, n: i32) -> Vec<u8> {
    (0..n).map(|i| line(doc, i, &format!("{doc} chunk {i}"))).collect::<String>().into_bytes()
}

async fn vector_of(db: &TestDb, table: &str, doc: &str, idx: i32) -> Option<(String, Vec<f32>)> {
    let sql = format!("SELECT content_hash, embedding FROM {table} WHERE doc_id = $1 AND chunk_index = $2");
    sqlx::query_as::<_, (String, pgvector::Vector)>(sqlx::AssertSqlSafe(sql))
        .bind(doc)
        .bind(idx)
        .fetch_optional(&db.pool)
        .await
        .unwrap()
        .map(|(h, v)| (h, v.to_vec()))
}

fn assert_same_vector(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: dimension");
    let max = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(max < 1e-6, "{what}: not the expected vector (max difference {max})");
}

async fn schedule_and_relay(db: &TestDb, store: &Store, keys: &StreamKeys) -> u64 {
    make_due(db).await;
    let mut r = redis().await;
    embed_dlq::replay::ensure_group(&mut r, keys).await.unwrap();
    let n = Scheduler::new(store.clone(), quick_replay_config(), r.clone(), keys.clone())
        .run_once()
        .await
        .unwrap();
    relay_all(db, keys).await;
    n
}

async fn replayer(db: &TestDb, mock: &MockProvider, keys: &StreamKeys, name: &str) -> Replayer {
    replayer_for(db, mock, keys, name, quick_replay_config(), Duration::from_secs(10)).await
}

/// A pipeline whose provider is down: everything it ingests parks as transient.
async fn down_pipeline(
    db: &TestDb,
    table: &str,
    request_dimensions: Option<usize>,
) -> (MockProvider, Pipeline) {
    let down = start_mock(MockConfig::default()).await;
    down.control.set_outage(true);
    let mut s = settings(db, &down);
    s.retry.max_attempts = 2;
    s.table = table.to_string();
    s.client.request_dimensions = request_dimensions;
    let p = pipeline(&s).await;
    (down, p)
}

fn accounted(s: &IngestSummary) -> u64 {
    s.stored
        + s.unchanged
        + s.already_parked
        + s.parked_total()
        + s.superseded
        + s.not_attempted
        + s.leased_elsewhere
}

async fn reconcile_clean(db: &TestDb) {
    let store = Store::open(db.pool.clone(), "doc_embeddings").await.unwrap();
    let mut r = Reconciler { store, redis: None, keys: fresh_keys(), config: Default::default() };
    let report = r.run_once(Mode::Check).await.unwrap();
    assert_eq!(report.total_found(), 0, "{report:?}");
}

/// Item 1: `migrate --table b`, ingest a corpus into the default table, then into `b`: `b`
/// gets every vector (it used to stay empty, "skipped unchanged"). Two spellings of one table
/// are one identity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tables_with_the_same_corpus_each_get_every_vector() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    embed_dlq::store::create_target_table(&db.pool, "b", 768).await.unwrap();
    let mut s = settings(&db, &mock);
    let into_a = pipeline(&s).await.run(input(corpus("d", 20)), CancellationToken::new()).await.unwrap();
    assert_eq!(into_a.stored, 20);
    s.table = "b".into();
    let into_b = pipeline(&s).await.run(input(corpus("d", 20)), CancellationToken::new()).await.unwrap();
    assert_eq!((into_b.stored, into_b.unchanged), (20, 0), "{into_b:?}");
    assert_eq!(db.count("SELECT count(*) FROM b").await, 20);
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 20);
    assert_eq!(
        db.count(
            "SELECT count(*) FROM ingest_manifest WHERE target_table = 'public.b' AND status = 'stored'"
        )
        .await,
        20
    );
    assert_eq!((db.leaks_in("b").await, db.leaks().await), (0, 0));

    // `public.doc_embeddings` is `doc_embeddings`: nothing to do, no provider call.
    let calls = mock.control.stats().requests;
    s.table = "public.doc_embeddings".into();
    let again = pipeline(&s).await.run(input(corpus("d", 20)), CancellationToken::new()).await.unwrap();
    assert_eq!((again.unchanged, again.stored), (20, 0), "{again:?}");
    assert_eq!(mock.control.stats().requests, calls);
    reconcile_clean(&db).await;
}

/// Item 1: one `serve` replays DLQ rows of two tables of different dimensions, each into its
/// own table, embedded as the row records (here: `dimensions` 384 for one of them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_replays_each_table_into_itself_with_its_own_dimensions() {
    let db = TestDb::new().await;
    embed_dlq::store::create_target_table(&db.pool, "small", 384).await.unwrap();
    let (_down, p768) = down_pipeline(&db, "doc_embeddings", None).await;
    let r = p768.run(input(corpus("big", 10)), CancellationToken::new()).await.unwrap();
    assert_eq!(r.parked_total(), 10);
    let (_down2, p384) = down_pipeline(&db, "small", Some(384)).await;
    let r = p384.run(input(corpus("tiny", 12)), CancellationToken::new()).await.unwrap();
    assert_eq!(r.parked_total(), 12);
    assert_eq!(
        db.count("SELECT count(*) FROM embedding_dlq WHERE target_table = 'public.small' AND dimensions = 384 AND request_dimensions = 384 AND model = 'mock'").await,
        12
    );
    make_due(&db).await;

    // One serve, configured for the default table and no `dimensions` parameter.
    let healthy = start_mock(MockConfig::default()).await;
    let serving = pipeline(&settings(&db, &healthy)).await;
    let keys = fresh_keys();
    let config = embed_dlq::serve::ServeConfig {
        replayers: 1,
        relay: RelayConfig::default(),
        replay: quick_replay_config(),
        keys: keys.clone(),
        grace: Duration::from_secs(2),
        consumer_prefix: "identity-serve".into(),
        reconcile_every: None,
        reconcile_sweeps: Default::default(),
        metrics: false,
        source: None,
        source_ingest: Default::default(),
        table_followers: Vec::new(),
    };
    let cancel = CancellationToken::new();
    let task = tokio::spawn(embed_dlq::serve::serve(
        serving.store.clone(),
        serving.embedder.clone(),
        embed_dlq::streams::client(&redis_url()).unwrap(),
        config,
        cancel.clone(),
    ));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while db.count("SELECT count(*) FROM embedding_dlq").await > 0 {
        assert!(tokio::time::Instant::now() < deadline, "serve did not drain the DLQ of both tables");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cancel.cancel();
    task.await.unwrap().unwrap();

    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 10);
    assert_eq!(db.count("SELECT count(*) FROM small").await, 12);
    for i in 0..12 {
        let (hash, v) = vector_of(&db, "small", "tiny", i).await.expect("replayed into its own table");
        let text = format!("tiny chunk {i}");
        assert_same_vector(&v, &mock_provider::vector_for(&text, 384), "small");
        assert_eq!(hash, content_hash("mock", 384, &text));
    }
    let (_, v) = vector_of(&db, "doc_embeddings", "big", 3).await.unwrap();
    assert_same_vector(&v, &mock_provider::vector_for("big chunk 3", 768), "doc_embeddings");
    assert_eq!((db.leaks().await, db.leaks_in("small").await), (0, 0));
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest WHERE status <> 'stored'").await, 0);
    reconcile_clean(&db).await;
}

/// Item 4: content changes while a replay of the old content is in flight. The old replay
/// commits nothing (before: the old text's vector was stored under the new hash); once the
/// provider is healthy the stored vector is the new text's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_in_flight_for_old_content_never_stores_its_vector() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let (_down, p) = down_pipeline(&db, "doc_embeddings", None).await;
    let old = line("k", 0, "the old text");
    let new = line("k", 0, "the new text");
    assert_eq!(p.run(input(old.into_bytes()), CancellationToken::new()).await.unwrap().parked_total(), 1);
    assert_eq!(schedule_and_relay(&db, &p.store, &keys).await, 1);

    // A slow provider: the replay of the old text is in flight (for 5 s: long enough for the
    // ingest below on any machine, and the assertion after it says so if not)...
    let slow = start_mock(MockConfig { latency_ms: 5_000, ..Default::default() }).await;
    let mut rep = replayer(&db, &slow, &keys, "slow").await;
    let in_flight = tokio::spawn(async move {
        let client = embed_dlq::streams::client(&redis_url()).unwrap();
        let mut conn = embed_dlq::streams::blocking(&client, Duration::from_secs(1)).await.unwrap();
        rep.read_once(&mut conn, &CancellationToken::new()).await.unwrap()
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while slow.control.stats().requests == 0 {
        assert!(tokio::time::Instant::now() < deadline, "the replay never reached the provider");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // ...when the content changes and parks again (the provider is still down for ingest).
    let r = p.run(input(new.clone().into_bytes()), CancellationToken::new()).await.unwrap();
    assert_eq!(r.parked_total(), 1, "{r:?}");
    assert_eq!(slow.control.stats().ok, 0, "the old replay must still be in flight");
    let counts = in_flight.await.unwrap();
    assert_eq!(counts.replayed, 0, "{counts:?}");
    assert!(vector_of(&db, "doc_embeddings", "k", 0).await.is_none(), "a stale vector was stored");
    let new_hash = content_hash("mock", 768, "the new text");
    let (hash, status): (String, String) =
        sqlx::query_as("SELECT content_hash, status FROM ingest_manifest").fetch_one(&db.pool).await.unwrap();
    assert_eq!((hash.as_str(), status.as_str()), (new_hash.as_str(), "parked"));
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 1);

    // Healthy again: the new text is replayed and stored.
    let healthy = start_mock(MockConfig::default()).await;
    let mut rep = replayer(&db, &healthy, &keys, "healthy").await;
    schedule_and_relay(&db, &p.store, &keys).await;
    let client = embed_dlq::streams::client(&redis_url()).unwrap();
    let mut conn = embed_dlq::streams::blocking(&client, Duration::from_secs(1)).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while db.count("SELECT count(*) FROM embedding_dlq").await > 0 {
        assert!(tokio::time::Instant::now() < deadline, "replay did not drain the DLQ");
        rep.read_once(&mut conn, &CancellationToken::new()).await.unwrap();
    }
    let (hash, v) = vector_of(&db, "doc_embeddings", "k", 0).await.unwrap();
    assert_eq!(hash, new_hash);
    assert_same_vector(&v, &mock_provider::vector_for("the new text", 768), "final vector");
    assert_eq!(db.manifest_disagreements().await, 0);
    reconcile_clean(&db).await;
}

/// Item 5: the same key twice in one corpus with different texts, the first one failing
/// slowly: the last line wins every time, in every run, with no DLQ row left beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_line_of_a_key_wins_and_leaves_no_dlq_row() {
    let mock = start_mock(MockConfig::default()).await;
    let mut text = String::new();
    text.push_str(&line("dup", 0, &format!("first version {}", mock_provider::POISON_500)));
    for i in 1..6 {
        text.push_str(&line("other", i, &format!("filler {i}")));
    }
    text.push_str(&line("dup", 0, "second version"));
    let want = mock_provider::vector_for("second version", 768);
    let want_hash = content_hash("mock", 768, "second version");
    for round in 0..3 {
        let db = TestDb::new().await;
        let s = settings(&db, &mock);
        for run in 0..2 {
            let r = pipeline(&s)
                .await
                .run(input(text.clone().into_bytes()), CancellationToken::new())
                .await
                .unwrap();
            assert_eq!(accounted(&r), r.records, "round {round} run {run}: {r:?}");
            let (hash, v) = vector_of(&db, "doc_embeddings", "dup", 0).await.expect("dup stored");
            assert_eq!(hash, want_hash, "round {round} run {run}");
            assert_same_vector(&v, &want, "dup");
            assert_eq!(
                db.count("SELECT count(*) FROM embedding_dlq WHERE doc_id = 'dup'").await,
                0,
                "round {round} run {run}: a stale DLQ row was left beside the stored newer version"
            );
            assert_eq!(db.manifest_disagreements().await, 0, "round {round} run {run}");
            assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 6);
            reconcile_clean(&db).await;
        }
    }
}

fn parked(doc: &str, idx: i32, text: &str, seq: i64) -> ParkedChunk {
    ParkedChunk {
        doc_id: doc.into(),
        chunk_index: idx,
        content_hash: content_hash("mock", 768, text),
        text_hash: embed_dlq::model::TextHash::of(text),
        payload: serde_json::json!({"doc_id": doc, "chunk_index": idx, "text": text}),
        class: ErrorClass::Transient,
        reason: "http_503".into(),
        last_error: "down".into(),
        last_status: Some(503),
        attempts: 3,
        retry_in: Some(Duration::from_secs(60)),
        source_seq: seq,
    }
}

/// Item 7: the same `park_batch` twice (a retry after a lost commit acknowledgement) changes
/// nothing the second time: attempts unchanged, exactly one `parked` event. Changed content
/// is a new generation with its own event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_park_is_a_no_op_without_a_second_event() {
    let db = TestDb::new().await;
    let store = Store::open(db.pool.clone(), "doc_embeddings").await.unwrap();
    let rows = vec![parked("a", 0, "alpha", 1), parked("a", 1, "beta", 2)];
    store.park_batch(&rows).await.unwrap();
    let before: Vec<(i64, i32, i64)> =
        sqlx::query_as("SELECT id, attempts, generation FROM embedding_dlq ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    store.park_batch(&rows).await.unwrap();
    let after: Vec<(i64, i32, i64)> =
        sqlx::query_as("SELECT id, attempts, generation FROM embedding_dlq ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(before, after);
    assert!(after.iter().all(|(_, attempts, _)| *attempts == 3));
    assert_eq!(db.count("SELECT count(*) FROM dlq_outbox WHERE event = 'parked'").await, 2);

    // New content for one of them: a new generation, attempts restart, one more event.
    store.park_batch(&[parked("a", 0, "alpha v2", 3)]).await.unwrap();
    let (attempts, generation): (i32, i64) =
        sqlx::query_as("SELECT attempts, generation FROM embedding_dlq WHERE chunk_index = 0")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(attempts, 3);
    assert!(generation > before[0].2);
    assert_eq!(db.count("SELECT count(*) FROM dlq_outbox WHERE event = 'parked'").await, 3);
    // An older record of the same chunk is refused.
    let refused = store.park_batch(&[parked("a", 0, "alpha v0", 0)]).await.unwrap();
    assert_eq!(refused.superseded, vec![0]);
    assert_eq!(db.count("SELECT count(*) FROM dlq_outbox WHERE event = 'parked'").await, 3);
}

/// Item 13: two ingests of the same corpus (with permanent poison inputs) at once announce
/// each park once: `parked` events == DLQ rows, no duplicate vectors, no leaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_concurrent_ingests_announce_each_park_once() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let mut text = String::new();
    for i in 0..300 {
        let t = if i % 10 == 3 {
            format!("poison {i} {}", mock_provider::POISON_400)
        } else {
            format!("text {i}")
        };
        text.push_str(&line("c", i, &t));
    }
    let s = settings(&db, &mock);
    let (one, two) = (pipeline(&s).await, pipeline(&s).await);
    let (r1, r2) = tokio::join!(
        one.run(input(text.clone().into_bytes()), CancellationToken::new()),
        two.run(input(text.clone().into_bytes()), CancellationToken::new()),
    );
    let (r1, r2) = (r1.unwrap(), r2.unwrap());
    assert_eq!((accounted(&r1), accounted(&r2)), (300, 300), "{r1:?} {r2:?}");
    let dlq = db.count("SELECT count(*) FROM embedding_dlq").await;
    assert_eq!(dlq, 30);
    assert_eq!(db.count("SELECT count(*) FROM dlq_outbox WHERE event = 'parked'").await, dlq);
    let per_generation: HashMap<(i64, i64), i64> = sqlx::query_as::<_, (i64, i64, i64)>(
        "SELECT dlq_id, (body->>'generation')::bigint, count(*) FROM dlq_outbox WHERE event = 'parked' GROUP BY 1, 2",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap()
    .into_iter()
    .map(|(id, g, n)| ((id, g), n))
    .collect();
    assert!(per_generation.values().all(|n| *n == 1), "{per_generation:?}");
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 270);
    assert_eq!((db.leaks().await, db.manifest_disagreements().await), (0, 0));
    assert_corpus_accounted(&db, &corpus_keys(text.as_bytes())).await;
    reconcile_clean(&db).await;
}

/// The migration for existing data: rows written before `0004_identity.sql` belong to the
/// default table, get a generation, and a parked one is replayed (with the configured model)
/// into the default table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_from_before_the_identity_migration_belong_to_the_default_table() {
    let db = TestDb::unmigrated().await;
    embed_dlq::store::MIGRATOR.run_to(3, &db.pool).await.unwrap();
    let hash = content_hash("mock", 768, "legacy text");
    sqlx::query(
        "INSERT INTO ingest_manifest (doc_id, chunk_index, content_hash, status) VALUES ('old', 0, $1, 'parked')",
    )
    .bind(&hash)
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO embedding_dlq (doc_id, chunk_index, content_hash, payload, error_class, error_reason,
                                    attempts, next_retry_at)
         VALUES ('old', 0, $1, '{\"doc_id\":\"old\",\"chunk_index\":0,\"text\":\"legacy text\"}',
                 'transient', 'http_503', 3, now())",
    )
    .bind(&hash)
    .execute(&db.pool)
    .await
    .unwrap();
    embed_dlq::store::migrate(&db.pool).await.unwrap();
    let (table, generation, dims, model): (String, i64, Option<i32>, Option<String>) =
        sqlx::query_as("SELECT target_table, generation, dimensions, model FROM embedding_dlq")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((table.as_str(), dims, model), ("public.doc_embeddings", Some(768), None));
    assert!(generation > 0);
    assert_eq!(
        db.count("SELECT count(*) FROM ingest_manifest WHERE target_table = 'public.doc_embeddings'").await,
        1
    );

    let keys = fresh_keys();
    let healthy = start_mock(MockConfig::default()).await;
    let mut rep = replayer(&db, &healthy, &keys, "legacy").await;
    let store = rep.store.clone();
    assert_eq!(schedule_and_relay(&db, &store, &keys).await, 1);
    let client = embed_dlq::streams::client(&redis_url()).unwrap();
    let mut conn = embed_dlq::streams::blocking(&client, Duration::from_secs(1)).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while db.count("SELECT count(*) FROM embedding_dlq").await > 0 {
        assert!(tokio::time::Instant::now() < deadline, "replay did not drain the DLQ");
        rep.read_once(&mut conn, &CancellationToken::new()).await.unwrap();
    }
    let (h, v) = vector_of(&db, "doc_embeddings", "old", 0).await.unwrap();
    assert_eq!(h, hash);
    assert_same_vector(&v, &mock_provider::vector_for("legacy text", 768), "legacy row");
    assert_eq!(db.manifest_disagreements().await, 0);
    reconcile_clean(&db).await;
}
