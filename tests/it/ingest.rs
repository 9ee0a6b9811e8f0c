//! The ingest pipeline against real Postgres+pgvector and the fault-injecting provider.

use std::collections::HashMap;

use embed_dlq::embed::{Reason, Stop};
use embed_dlq::ingest::IngestError;
use embed_dlq::model::ErrorClass;
use embed_dlq::testkit::corpus::{CorpusSpec, write_corpus};
use embed_dlq::testkit::mock_provider::{self, MockConfig};
use sqlx::Row;
use tokio_util::sync::CancellationToken;

use crate::support::*;

async fn dlq_by_class(db: &TestDb) -> HashMap<String, i64> {
    sqlx::query("SELECT error_class, count(*) AS n FROM embedding_dlq GROUP BY 1")
        .fetch_all(&db.pool)
        .await
        .unwrap()
        .into_iter()
        .map(|r| (r.get("error_class"), r.get("n")))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_mix_over_10k_chunks_loses_nothing_and_duplicates_nothing() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig {
        rate_429: 0.03,
        retry_after_ms: 20,
        rate_5xx: 0.05,
        rate_timeout: 0.003,
        timeout_hold_ms: 2_000,
        rate_reset: 0.02,
        seed: 7,
        ..MockConfig::default()
    })
    .await;
    let mut s = settings(&db, &mock);
    s.options.max_input_chars = 4_000;
    let spec = CorpusSpec { chunks: 10_000, poison_every: 100, broken_lines: true, ..CorpusSpec::default() };
    let mut corpus = Vec::new();
    let facts = write_corpus(&mut corpus, &spec, 4_000).unwrap();
    let keys = corpus_keys(&corpus);
    let summary = pipeline(&s).await.run(input(corpus), CancellationToken::new()).await.unwrap();

    assert_eq!(db.leaks().await, 0, "seed reconciliation query must return no rows");
    assert_corpus_accounted(&db, &keys).await;
    assert_eq!(db.manifest_disagreements().await, 0);

    // Every record is accounted for exactly once.
    assert_eq!(summary.records, 10_000 + facts.invalid_records as u64);
    assert_eq!(summary.stored + summary.parked_total(), summary.records);
    assert_eq!(summary.rejected_lines, facts.rejected_lines as u64);
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest").await as u64, summary.records);
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await as u64, summary.stored);

    let by_class = dlq_by_class(&db).await;
    let get = |c: ErrorClass| by_class.get(c.as_str()).copied().unwrap_or(0) as usize;
    // Every poison input is parked under its own class — or as transient when the faults
    // exhausted its batch's retries before the provider ever judged it.
    for (marker, expected, count) in [
        (mock_provider::POISON_400, ErrorClass::PermanentInput, facts.poison_400),
        (mock_provider::POISON_NAN, ErrorClass::InvalidVector, facts.poison_nan),
        (mock_provider::POISON_DIM, ErrorClass::DimensionMismatch, facts.poison_dim),
    ] {
        let classes: HashMap<String, i64> = sqlx::query(
            "SELECT error_class, count(*) AS n FROM embedding_dlq
              WHERE strpos(payload->>'text', $1) > 0 GROUP BY 1",
        )
        .bind(marker)
        .fetch_all(&db.pool)
        .await
        .unwrap()
        .into_iter()
        .map(|r| (r.get("error_class"), r.get("n")))
        .collect();
        let own = classes.get(expected.as_str()).copied().unwrap_or(0);
        let transient = classes.get("transient").copied().unwrap_or(0);
        assert_eq!((own + transient) as usize, count, "{marker}: {classes:?}");
        assert_eq!(classes.len() as i64, (own > 0) as i64 + (transient > 0) as i64, "{marker}: {classes:?}");
        assert!(own as usize >= count * 3 / 4, "{marker}: most are judged by the provider: {classes:?}");
    }
    // Pre-flight and broken records never reach the provider: their class is exact.
    let preflight: i64 =
        db.count("SELECT count(*) FROM embedding_dlq WHERE error_reason IN ('empty_text', 'too_long')").await;
    assert_eq!(preflight as usize, facts.empty + facts.too_long);
    assert_eq!(get(ErrorClass::InvalidRecord), facts.invalid_records);
    // Faults were really injected and mostly absorbed by retries.
    let mstats = mock.control.stats();
    assert!(mstats.rate_limited > 0 && mstats.server_errors > 0 && mstats.resets > 0, "{mstats:?}");
    assert!(summary.retries.values().sum::<u64>() > 0);
    assert!(get(ErrorClass::Transient) < 200, "retries should absorb most faults: {by_class:?}");
    // One outbox event per parked chunk, in the same transactions.
    assert_eq!(
        db.count("SELECT count(*) FROM dlq_outbox WHERE event = 'parked'").await,
        db.count("SELECT count(*) FROM embedding_dlq").await
    );
    // The stored vectors are the provider's, bit for bit.
    let row = sqlx::query(
        "SELECT e.embedding::text AS v FROM doc_embeddings e WHERE doc_id = 'doc-0' AND chunk_index = 0",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let stored: Vec<f32> =
        serde_json::from_str(&row.get::<String, _>("v")).expect("pgvector text form is a JSON array");
    let mut first = Vec::new();
    write_corpus(&mut first, &CorpusSpec { chunks: 1, broken_lines: false, ..spec.clone() }, 4_000).unwrap();
    let first: serde_json::Value = serde_json::from_slice(&first).unwrap();
    let text = first["text"].as_str().unwrap();
    assert_eq!(stored, mock_provider::vector_for(text, 768));
}

/// Snapshot of every row's identity, content and physical version (xmin changes on any
/// update, even one that writes the same values).
async fn snapshot(db: &TestDb) -> Vec<String> {
    let mut out = Vec::new();
    for sql in [
        "SELECT doc_id || '/' || chunk_index || '/' || content_hash || '/' || updated_at || '/' || xmin AS s FROM doc_embeddings ORDER BY 1",
        "SELECT doc_id || '/' || chunk_index || '/' || status || '/' || updated_at || '/' || xmin AS s FROM ingest_manifest ORDER BY 1",
        "SELECT doc_id || '/' || chunk_index || '/' || attempts || '/' || last_failed_at || '/' || xmin AS s FROM embedding_dlq ORDER BY 1",
        "SELECT count(*)::text AS s FROM dlq_outbox",
    ] {
        for r in sqlx::query(sql).fetch_all(&db.pool).await.unwrap() {
            out.push(r.get("s"));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rerun_of_the_same_corpus_makes_no_call_and_changes_no_row() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let s = settings(&db, &mock);
    let spec = CorpusSpec { chunks: 2_000, poison_every: 50, broken_lines: true, ..CorpusSpec::default() };
    let mut corpus = Vec::new();
    write_corpus(&mut corpus, &spec, s.options.max_input_chars).unwrap();
    let p = pipeline(&s).await;
    let first = p.run(input(corpus.clone()), CancellationToken::new()).await.unwrap();
    assert!(first.parked_total() > 0 && first.stored > 0);
    let before = snapshot(&db).await;
    let calls = mock.control.stats().requests;

    let second = p.run(input(corpus), CancellationToken::new()).await.unwrap();
    assert_eq!(mock.control.stats().requests, calls, "an identical rerun must not call the provider");
    assert_eq!(second.provider_calls, 0);
    assert_eq!(second.unchanged, first.stored);
    assert_eq!(second.already_parked, first.parked_total());
    assert_eq!(second.stored + second.parked_total(), 0);
    assert_eq!(snapshot(&db).await, before, "no row may change, updated_at and xmin included");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changed_text_or_model_reembeds_without_duplicates() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let mut s = settings(&db, &mock);
    let mut corpus = String::new();
    for i in 0..50 {
        corpus.push_str(&line("d", i, &format!("text {i}")));
    }
    pipeline(&s).await.run(input(corpus.clone().into_bytes()), CancellationToken::new()).await.unwrap();
    // One chunk changes: only it is re-embedded.
    let changed = corpus.replace("\"text 7\"", "\"text 7 revised\"");
    let calls = mock.control.stats().inputs;
    let r = pipeline(&s).await.run(input(changed.into_bytes()), CancellationToken::new()).await.unwrap();
    assert_eq!(mock.control.stats().inputs - calls, 1);
    assert_eq!((r.stored, r.unchanged, r.vectors_written), (1, 49, 1));
    // A model change re-embeds everything, in place.
    s.client.model = "mock-v2".into();
    let keys = corpus_keys(corpus.as_bytes());
    let r = pipeline(&s).await.run(input(corpus.into_bytes()), CancellationToken::new()).await.unwrap();
    assert_eq!((r.stored, r.vectors_written), (50, 50));
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 50);
    assert_corpus_accounted(&db, &keys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_input_is_isolated_from_its_batch() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let mut s = settings(&db, &mock);
    s.options.batch_max_inputs = 64;
    let mut corpus = String::new();
    for i in 0..64 {
        let text = if i == 17 { format!("bad {}", mock_provider::POISON_400) } else { format!("good {i}") };
        corpus.push_str(&line("batch", i, &text));
    }
    let r = pipeline(&s).await.run(input(corpus.into_bytes()), CancellationToken::new()).await.unwrap();
    assert_eq!(r.stored, 63);
    assert_eq!(r.parked.get(&ErrorClass::PermanentInput), Some(&1));
    assert!(r.batch_splits > 0);
    let row = sqlx::query(
        "SELECT chunk_index, attempts, next_retry_at IS NULL AS never, error_reason FROM embedding_dlq",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(row.get::<i32, _>("chunk_index"), 17);
    assert_eq!(row.get::<i32, _>("attempts"), 1, "permanent failures park at attempt 1");
    assert!(row.get::<bool, _>("never"), "permanent rows are never scheduled for replay");
    assert_eq!(row.get::<String, _>("error_reason"), "http_400");
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings WHERE doc_id = 'batch'").await, 63);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_faults_beyond_the_cap_park_with_attempts_equal_to_the_cap() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    mock.control.set_outage(true);
    let s = settings(&db, &mock);
    let mut corpus = String::new();
    for i in 0..10 {
        corpus.push_str(&line("t", i, &format!("transient {i}")));
    }
    let r = pipeline(&s).await.run(input(corpus.into_bytes()), CancellationToken::new()).await.unwrap();
    assert_eq!(r.parked.get(&ErrorClass::Transient), Some(&10));
    // One batch, max_attempts requests, no extra attempt or sleep after the last one.
    assert_eq!(mock.control.stats().server_errors, s.retry.max_attempts as u64);
    let rows = sqlx::query(
        "SELECT doc_id, error_class, error_reason, attempts, last_status,
                next_retry_at > now() + interval '10 seconds' AS future, payload
           FROM embedding_dlq ORDER BY doc_id, chunk_index",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 10);
    for r in rows.iter().filter(|r| r.get::<String, _>("doc_id") == "t") {
        assert_eq!(r.get::<String, _>("error_class"), "transient");
        assert_eq!(r.get::<String, _>("error_reason"), "http_503");
        assert_eq!(r.get::<i32, _>("attempts"), s.retry.max_attempts as i32);
        assert_eq!(r.get::<Option<i32>, _>("last_status"), Some(503));
        assert_eq!(
            r.get::<Option<bool>, _>("future"),
            Some(true),
            "next_retry_at follows the longer DLQ schedule"
        );
        let payload: serde_json::Value = r.get("payload");
        assert!(payload["text"].as_str().unwrap().starts_with("transient "), "full payload kept: {payload}");
    }
    // Permanent failures, by contrast, park at attempt 1.
    mock.control.set_outage(false);
    let mut corpus = String::new();
    corpus.push_str(&line("p", 1, &format!("perm {}", mock_provider::POISON_422)));
    let r = pipeline(&s).await.run(input(corpus.into_bytes()), CancellationToken::new()).await.unwrap();
    assert_eq!(r.parked.get(&ErrorClass::PermanentInput), Some(&1));
    let attempts: i32 =
        sqlx::query_scalar("SELECT attempts FROM embedding_dlq WHERE doc_id = 'p' AND chunk_index = 1")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(attempts, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn park_is_atomic_when_a_later_part_fails() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let s = settings(&db, &mock);
    // Fail the outbox insert of a park: the DLQ row and the manifest status must roll back too.
    sqlx::raw_sql(
        "CREATE FUNCTION fail_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN RAISE EXCEPTION 'injected failure after the DLQ upsert'; END $$;
         CREATE TRIGGER fail_outbox BEFORE INSERT ON dlq_outbox
           FOR EACH ROW WHEN (NEW.doc_id = 'atomic') EXECUTE FUNCTION fail_outbox();",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let corpus = line("atomic", 0, &format!("x {}", mock_provider::POISON_400));
    let err = pipeline(&s)
        .await
        .run(input(corpus.clone().into_bytes()), CancellationToken::new())
        .await
        .unwrap_err();
    assert!(matches!(err, IngestError::Store(_)), "{err}");
    assert!(err.to_string().contains("injected failure"), "{err}");
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0, "no DLQ row without its outbox row");
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest").await, 0, "no manifest change either");
    assert_eq!(db.count("SELECT count(*) FROM dlq_outbox").await, 0);

    // Same for the manifest, the last part of the statement.
    sqlx::raw_sql(
        "DROP TRIGGER fail_outbox ON dlq_outbox;
         CREATE TRIGGER fail_manifest BEFORE INSERT ON ingest_manifest
           FOR EACH ROW WHEN (NEW.doc_id = 'atomic') EXECUTE FUNCTION fail_outbox();",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let err = pipeline(&s)
        .await
        .run(input(corpus.clone().into_bytes()), CancellationToken::new())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("injected failure"), "{err}");
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
    assert_eq!(db.count("SELECT count(*) FROM dlq_outbox").await, 0);

    // Once the fault is gone, a rerun parks it completely.
    sqlx::raw_sql("DROP TRIGGER fail_manifest ON ingest_manifest").execute(&db.pool).await.unwrap();
    pipeline(&s).await.run(input(corpus.into_bytes()), CancellationToken::new()).await.unwrap();
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 1);
    assert_eq!(db.count("SELECT count(*) FROM dlq_outbox WHERE event = 'parked'").await, 1);
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest WHERE status = 'parked'").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthorized_and_out_of_quota_stop_the_run_and_park_nothing() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig { api_key: Some("right-key".into()), ..MockConfig::default() }).await;
    let mut s = settings(&db, &mock);
    s.client.api_key = Some("wrong-key".into());
    let mut corpus = String::new();
    for i in 0..200 {
        corpus.push_str(&line("sys", i, &format!("chunk {i}")));
    }
    let err = pipeline(&s)
        .await
        .run(input(corpus.clone().into_bytes()), CancellationToken::new())
        .await
        .unwrap_err();
    match &err {
        IngestError::Provider { stop: Stop::Systemic { reason, .. }, summary } => {
            assert_eq!(*reason, Reason::Unauthorized);
            assert_eq!(summary.parked_total(), 0);
        }
        other => panic!("expected a systemic stop, got {other}"),
    }
    assert!(err.to_string().contains("401"), "clear message: {err}");
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest").await, 0);
    assert!(mock.control.stats().requests < 20, "the run stops promptly, not after trying every chunk");

    s.client.api_key = Some("right-key".into());
    mock.control.set_quota_exhausted(true);
    let err = pipeline(&s)
        .await
        .run(input(corpus.clone().into_bytes()), CancellationToken::new())
        .await
        .unwrap_err();
    assert!(
        matches!(
            &err,
            IngestError::Provider { stop: Stop::Systemic { reason: Reason::InsufficientQuota, .. }, .. }
        ),
        "{err}"
    );
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest").await, 0);

    // Fixed: the rerun does everything.
    mock.control.set_quota_exhausted(false);
    let r = pipeline(&s).await.run(input(corpus.into_bytes()), CancellationToken::new()).await.unwrap();
    assert_eq!(r.stored, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_bad_line_is_reported_or_parked() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let mut s = settings(&db, &mock);
    s.options.max_input_chars = 100;
    s.options.max_line_bytes = 4096;
    let mut corpus: Vec<u8> = Vec::new();
    corpus.extend_from_slice(line("ok", 0, "fine").as_bytes()); // 1
    corpus.extend_from_slice(b"{\"doc_id\": \"x\", \"chunk_index\": \n"); // 2 malformed JSON
    corpus.extend_from_slice(b"{\"doc_id\":\"bad\",\"chunk_index\":1,\"text\":\"caf\xe9\"}\n"); // 3 invalid UTF-8
    corpus.extend_from_slice(b"{\"doc_id\":\"bad\",\"chunk_index\":2}\n"); // 4 missing text
    corpus.extend_from_slice(b"{\"chunk_index\":3,\"text\":\"no doc\"}\n"); // 5 missing doc_id
    corpus.extend_from_slice(line("bad", 5, "").as_bytes()); // 6 empty text
    corpus.extend_from_slice(line("bad", 6, &"y".repeat(500)).as_bytes()); // 7 too long
    corpus.extend_from_slice(b"\n"); // 8 blank: skipped
    corpus.extend_from_slice(
        format!("{{\"doc_id\":\"huge\",\"chunk_index\":0,\"text\":\"{}\"}}\n", "z".repeat(10_000)).as_bytes(),
    ); // 9 line too long
    corpus.extend_from_slice(b"[\"an\", \"array\"]\n"); // 10 not an object
    corpus.extend_from_slice(b"{\"doc_id\":\"bad\",\"chunk_index\":7,\"text\":\"a\\u0000b\"}\n"); // 11 NUL
    corpus
        .extend_from_slice(b"{\"doc_id\":\"bad\",\"chunk_index\":8,\"text\":\"ok\",\"metadata\":\"str\"}\n"); // 12 bad metadata
    corpus.extend_from_slice(b"{\"doc_id\":\"bad\",\"chunk_index\":-4,\"text\":\"neg\"}"); // 13 negative index, no newline
    let r = pipeline(&s).await.run(input(corpus), CancellationToken::new()).await.unwrap();
    let rejected: Vec<u64> = r.rejected_examples.iter().map(|x| x.line).collect();
    assert_eq!(rejected, vec![2, 5, 9, 10, 13], "{:?}", r.rejected_examples);
    assert_eq!(r.rejected_lines, 5);
    assert!(r.rejected_examples[0].problem.contains("malformed JSON"));
    assert!(r.rejected_examples[1].problem.contains("doc_id"));
    assert_eq!(r.stored, 1);
    let rows = sqlx::query("SELECT chunk_index, error_class, error_reason, last_error, payload FROM embedding_dlq WHERE doc_id = 'bad' ORDER BY chunk_index")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let got: Vec<(i32, String, String)> =
        rows.iter().map(|r| (r.get("chunk_index"), r.get("error_class"), r.get("error_reason"))).collect();
    let want = vec![
        (1, "invalid_record", "invalid_record"),
        (2, "invalid_record", "invalid_record"),
        (5, "permanent_input", "empty_text"),
        (6, "permanent_input", "too_long"),
        (7, "invalid_record", "invalid_record"),
        (8, "invalid_record", "invalid_record"),
    ];
    let want: Vec<(i32, String, String)> =
        want.into_iter().map(|(i, c, r)| (i, c.into(), r.into())).collect();
    assert_eq!(got, want);
    let utf8: &sqlx::postgres::PgRow = &rows[0];
    assert!(utf8.get::<String, _>("last_error").starts_with("line 3: invalid UTF-8"));
    let payload: serde_json::Value = utf8.get("payload");
    assert!(payload["raw_line"].as_str().unwrap().contains("caf\u{FFFD}"), "{payload}");
    assert_eq!(db.leaks().await, 0);
    assert_eq!(mock.control.stats().inputs, 1, "only the good chunk reached the provider");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_error_body_is_truncated_before_it_is_stored() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig { max_input_chars: 1_000, ..MockConfig::default() }).await;
    let mut s = settings(&db, &mock);
    s.options.max_input_chars = 2_000_000;
    let corpus = line("big", 0, &"w".repeat(1_000_000));
    let r = pipeline(&s).await.run(input(corpus.into_bytes()), CancellationToken::new()).await.unwrap();
    assert_eq!(r.parked.get(&ErrorClass::PermanentInput), Some(&1));
    let (reason, len): (String, i32) =
        sqlx::query_as("SELECT error_reason, length(last_error) FROM embedding_dlq")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(reason, "http_422");
    assert!(len < 600, "the provider echoed 1 MB; we keep an excerpt, got {len} chars");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vectors_are_checked_against_the_target_column_dimension() {
    let db = TestDb::new().await;
    embed_dlq::store::create_target_table(&db.pool, "small_vectors", 16).await.unwrap();
    let mock = start_mock(MockConfig { dimensions: 16, ..MockConfig::default() }).await;
    let mut s = settings(&db, &mock);
    s.table = "small_vectors".into();
    let mut corpus = String::new();
    for i in 0..20 {
        let text = match i {
            3 => format!("d {}", mock_provider::POISON_DIM),
            4 => format!("n {}", mock_provider::POISON_NAN),
            5 => format!("e {}", mock_provider::POISON_EMPTY),
            _ => format!("fine {i}"),
        };
        corpus.push_str(&line("dims", i, &text));
    }
    let r = pipeline(&s).await.run(input(corpus.into_bytes()), CancellationToken::new()).await.unwrap();
    assert_eq!(r.stored, 17);
    assert_eq!(r.parked.get(&ErrorClass::DimensionMismatch), Some(&1));
    assert_eq!(r.parked.get(&ErrorClass::InvalidVector), Some(&2));
    assert_eq!(db.count("SELECT count(*) FROM small_vectors").await, 17);

    // A provider whose every vector has the wrong size is misconfigured: stop, park nothing.
    let wrong = start_mock(MockConfig { dimensions: 32, ..MockConfig::default() }).await;
    let mut s2 = settings(&db, &wrong);
    s2.table = "small_vectors".into();
    let mut corpus = String::new();
    for i in 0..20 {
        corpus.push_str(&line("wrongdims", i, &format!("text {i}")));
    }
    let err =
        pipeline(&s2).await.run(input(corpus.into_bytes()), CancellationToken::new()).await.unwrap_err();
    assert!(
        matches!(
            &err,
            IngestError::Provider { stop: Stop::Systemic { reason: Reason::DimensionMismatch, .. }, .. }
        ),
        "{err}"
    );
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq WHERE doc_id = 'wrongdims'").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sustained_outage_opens_the_breaker_instead_of_parking_the_corpus() {
    let db = TestDb::new().await;
    // 503 until the run has met enough of them to open the breaker (counted, not timed: an
    // outage of the server's first 1.5 s could end before a loaded machine's run began).
    let mock = start_mock(MockConfig::default()).await;
    mock.control.set_outage(true);
    let mut s = settings(&db, &mock);
    s.breaker.failure_threshold = 5;
    s.breaker.cooldown = std::time::Duration::from_millis(200);
    let mut corpus = String::new();
    for i in 0..2_000 {
        corpus.push_str(&line("outage", i, &format!("chunk {i}")));
    }
    let run = pipeline(&s).await;
    let run =
        tokio::spawn(async move { run.run(input(corpus.into_bytes()), CancellationToken::new()).await });
    wait_for("the run met the outage", std::time::Duration::from_secs(60), async || {
        mock.control.stats().server_errors >= 10
    })
    .await;
    mock.control.set_outage(false);
    let r = run.await.unwrap().unwrap();
    assert!(r.breaker_opened >= 1, "{r:?}");
    let parked = r.parked.get(&ErrorClass::Transient).copied().unwrap_or(0);
    assert!(parked < 400, "the breaker paused intake; only in-flight batches may park, got {parked}");
    assert_eq!(r.stored + parked, 2_000);
    assert_eq!(db.leaks().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limits_are_waited_out_not_parked() {
    let db = TestDb::new().await;
    let mock =
        start_mock(MockConfig { rate_429: 0.3, retry_after_ms: 30, seed: 3, ..MockConfig::default() }).await;
    let mut s = settings(&db, &mock);
    s.retry.max_attempts = 8;
    let mut corpus = String::new();
    for i in 0..300 {
        corpus.push_str(&line("rl", i, &format!("chunk {i}")));
    }
    let r = pipeline(&s).await.run(input(corpus.into_bytes()), CancellationToken::new()).await.unwrap();
    assert!(r.retries.get(Reason::RateLimited.as_str()).copied().unwrap_or(0) > 0, "{r:?}");
    assert_eq!(r.stored, 300);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_input_that_always_gets_500_does_not_take_its_batch_down() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let mut s = settings(&db, &mock);
    s.options.batch_max_inputs = 16;
    let mut corpus = String::new();
    for i in 0..16 {
        let text = if i == 5 { format!("ollama {}", mock_provider::POISON_500) } else { format!("fine {i}") };
        corpus.push_str(&line("o500", i, &text));
    }
    let r = pipeline(&s).await.run(input(corpus.into_bytes()), CancellationToken::new()).await.unwrap();
    assert_eq!(r.stored, 15, "{r:?}");
    assert_eq!(r.parked.get(&ErrorClass::Transient), Some(&1));
    let (idx, reason, attempts): (i32, String, i32) =
        sqlx::query_as("SELECT chunk_index, error_reason, attempts FROM embedding_dlq")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((idx, reason.as_str(), attempts), (5, "http_500", s.retry.max_attempts as i32));
}

/// A library user who builds `IngestOptions` by hand bypasses the config file's checks: zero
/// workers, writers, batch sizes or windows, or absurdly large ones, are clamped to the
/// documented bounds (`config::bounds`) when a run starts, so the run neither hangs, panics
/// nor spawns a million tasks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn options_out_of_bounds_are_clamped_when_a_run_starts() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let corpus: String = (0..40).map(|i| line("bounds", i, &format!("text {i}"))).collect();
    for extreme in [0usize, usize::MAX / 2] {
        let mut s = settings(&db, &mock);
        let o = &mut s.options;
        (o.batch_max_inputs, o.batch_max_chars, o.concurrency, o.writers) =
            (extreme, extreme, extreme, extreme);
        (o.intake_window, o.write_batch_rows) = (extreme, extreme);
        o.max_line_bytes = extreme.max(1 << 20);
        o.batch_linger = if extreme == 0 { std::time::Duration::ZERO } else { std::time::Duration::MAX };
        o.lease = if extreme == 0 { std::time::Duration::ZERO } else { std::time::Duration::MAX };
        o.price_per_million_tokens = Some(if extreme == 0 { f64::NAN } else { f64::INFINITY });
        let p = pipeline(&s).await;
        let run = p.run(input(corpus.clone().into_bytes()), CancellationToken::new());
        let r = tokio::time::timeout(std::time::Duration::from_secs(300), run)
            .await
            .unwrap_or_else(|_| panic!("a run with every option at {extreme} hung"))
            .unwrap();
        assert_eq!(r.stored + r.unchanged, 40, "{extreme}: {r:?}");
        assert_eq!(r.parked_total(), 0, "{extreme}: {r:?}");
        assert!(r.estimated_cost.is_none_or(f64::is_finite), "{r:?}");
    }
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 40);
}

/// Issue 20, item 9: `batch_max_chars` counts characters, as replay's requests do, not bytes:
/// twelve inputs of 10 two-byte characters under a budget of 30 go three to a request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_max_chars_counts_characters_not_bytes() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let mut s = settings(&db, &mock);
    s.options.batch_max_inputs = 64;
    s.options.batch_max_chars = 30;
    s.options.concurrency = 1;
    let corpus: String = (0..12).map(|i| line("chars", i, &format!("{}{i:x}", "é".repeat(9)))).collect();
    let r = pipeline(&s).await.run(input(corpus.into_bytes()), CancellationToken::new()).await.unwrap();
    assert_eq!(r.stored, 12, "{r:?}");
    assert_eq!(mock.control.stats().requests, 4, "3 inputs of 10 characters (19 bytes) a request");
}

/// A window that meets one document in two runs of keys whose chunk ranges overlap (chunks 0
/// and 9, another document's chunk, then chunk 4 again in the first one's range): the lookup
/// by ranges finds chunk 4's manifest row twice, and must still answer each key once. An
/// unchanged rerun in that order skips everything and sends nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_whose_ranges_of_one_document_overlap_is_looked_up_key_by_key() {
    const WINDOW: usize = 20;
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let s = settings(&db, &mock);
    let mut p = pipeline(&s).await;
    // One pair of documents a window, most of them past the run's first (claimed) windows.
    p.options.intake_window = WINDOW;
    let mut keys: Vec<(String, i32)> = Vec::new();
    for pair in 0..20 {
        let (x, y) = (format!("x{pair}"), format!("y{pair}"));
        let head = [(&x, 0), (&x, 9), (&y, 0), (&x, 4)];
        keys.extend(head.iter().map(|(d, i)| ((*d).clone(), *i)));
        keys.extend([1, 2, 3, 5, 6, 7, 8].map(|i| (x.clone(), i)));
        keys.extend((1..10).map(|i| (y.clone(), i)));
    }
    assert_eq!(keys.len(), 20 * WINDOW);
    let corpus = keys.iter().map(|(d, i)| line(d, *i, &format!("{d} chunk {i}"))).collect::<String>();

    let first = p.run(input(corpus.clone().into_bytes()), CancellationToken::new()).await.unwrap();
    assert_eq!(first.stored as usize, keys.len(), "{first:?}");
    let sent = mock.control.stats().inputs;
    let again = p.run(input(corpus.into_bytes()), CancellationToken::new()).await.unwrap();
    assert_eq!((again.unchanged as usize, again.stored), (keys.len(), 0), "{again:?}");
    assert_eq!(mock.control.stats().inputs, sent, "the unchanged rerun sent inputs: {again:?}");
}

/// Past its first windows a run alone looks its windows up in the manifest by document
/// ranges, with a statement that only reads. A rerun with some texts changed, chunks added,
/// the documents in another order and one document's chunks far apart and out of order
/// re-embeds exactly what changed or is new, skips the rest, and leaves every key holding the
/// vector of its newest text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_rerun_re_embeds_exactly_what_changed_or_is_new() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let s = settings(&db, &mock);
    let mut p = pipeline(&s).await;
    // Small windows: most of the run is past its first (always claimed) windows.
    p.options.intake_window = 16;
    let text = |doc: &str, i: i32, version: u32| format!("{doc} chunk {i} v{version}");
    let sparse = [0, 500_000, 3, 1_000_000];
    let mut first = Vec::new();
    for d in 0..40 {
        first.extend((0..10).map(|i| (format!("d{d}"), i, 0)));
    }
    first.extend(sparse.iter().map(|&i| ("sparse".to_string(), i, 0)));
    // The rerun: documents in reverse order, every seventh chunk changed, a chunk added to
    // each document, and one to the sparse one between its far-apart chunks.
    let mut second: Vec<(String, i32, u32)> = Vec::new();
    for d in (0..40).rev() {
        second.extend((0..11).map(|i| (format!("d{d}"), i, u32::from((d * 10 + i) % 7 == 0))));
    }
    second.extend(
        [0, 500_000, 250_000, 3, 1_000_000].map(|i| ("sparse".to_string(), i, u32::from(i == 500_000))),
    );
    let corpus = |records: &[(String, i32, u32)]| {
        records.iter().map(|(doc, i, v)| line(doc, *i, &text(doc, *i, *v))).collect::<String>().into_bytes()
    };
    let old: std::collections::HashSet<(String, i32)> =
        first.iter().map(|(d, i, _)| (d.clone(), *i)).collect();
    let changed = second.iter().filter(|(d, i, v)| *v == 1 && old.contains(&(d.clone(), *i))).count();
    let added = second.len() - first.len();
    assert!(changed > 40 && added == 41, "{changed} changed, {added} added");

    let r1 = p.run(input(corpus(&first)), CancellationToken::new()).await.unwrap();
    assert_eq!(r1.stored as usize, first.len(), "{r1:?}");
    let sent_before = mock.control.stats().inputs;
    let r2 = p.run(input(corpus(&second)), CancellationToken::new()).await.unwrap();
    assert_eq!(mock.control.stats().inputs - sent_before, (changed + added) as u64, "{r2:?}");
    assert_eq!(
        (r2.stored as usize, r2.unchanged as usize),
        (changed + added, second.len() - changed - added),
        "{r2:?}"
    );
    let stored: Vec<(String, i32, Vec<f32>)> =
        sqlx::query_as("SELECT doc_id, chunk_index, embedding::real[] FROM doc_embeddings")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(stored.len(), second.len());
    let newest: HashMap<(String, i32), String> =
        second.iter().map(|(doc, i, v)| ((doc.clone(), *i), text(doc, *i, *v))).collect();
    for (doc, i, v) in stored {
        let want = mock_provider::vector_for(&newest[&(doc.clone(), i)], 768);
        let off = v.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(v.len() == want.len() && off < 1e-6, "{doc}#{i}: not the vector of its newest text");
    }
}

/// Keys of a corpus in file order.
fn keys_in_order(corpus: &[u8]) -> Vec<(String, i32)> {
    corpus
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_slice(l).unwrap();
            (v["doc_id"].as_str().unwrap().to_owned(), v["chunk_index"].as_i64().unwrap() as i32)
        })
        .collect()
}

/// Settings whose run is past its first (always-leased) windows after 128 chunks: what comes
/// after is written the way a fresh corpus is (plain inserts of new chunks first).
fn small_windows(mut s: embed_dlq::config::IngestSettings) -> embed_dlq::config::IngestSettings {
    s.options.intake_window = 16;
    s.options.write_batch_rows = 16;
    s
}

/// A table that already holds vectors the manifest knows nothing of (filled by hand, or
/// before this tool): a fresh run's plain inserts meet them, and the upserts decide instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_chunks_whose_vectors_the_table_already_holds_are_upserted_not_refused() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let spec = CorpusSpec { doc_prefix: "held".into(), chunks: 600, ..CorpusSpec::default() };
    let mut corpus = Vec::new();
    write_corpus(&mut corpus, &spec, 4_000).unwrap();
    let keys = keys_in_order(&corpus);
    // Every chunk of the second half (well past the first windows) is already in the table.
    let held: Vec<&(String, i32)> = keys[300..].iter().collect();
    sqlx::query(
        "INSERT INTO doc_embeddings (doc_id, chunk_index, content_hash, embedding)
         SELECT d, i, 'stale', array_fill(0.25::real, ARRAY[768])::vector
           FROM UNNEST($1::text[], $2::int[]) AS t(d, i)",
    )
    .bind(held.iter().map(|k| k.0.as_str()).collect::<Vec<_>>())
    .bind(held.iter().map(|k| k.1).collect::<Vec<_>>())
    .execute(&db.pool)
    .await
    .unwrap();

    let summary = pipeline(&small_windows(settings(&db, &mock)))
        .await
        .run(input(corpus.clone()), CancellationToken::new())
        .await;
    let summary = summary.expect("the run stores every chunk");
    assert_eq!((summary.stored, summary.superseded), (600, 0), "{summary:?}");
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings WHERE content_hash = 'stale'").await, 0);
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 600);
    assert_corpus_accounted(&db, &corpus_keys(&corpus)).await;
}

/// A newer record of a new chunk committed while this run embedded it (another writer's):
/// the run's plain insert of the chunk fails, the upsert finds the newer record and the
/// run's outcome is superseded, not written over it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_record_committed_while_a_new_chunk_was_embedded_is_not_overwritten() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig { latency_ms: 1_500, ..MockConfig::default() }).await;
    let mut s = small_windows(settings(&db, &mock));
    s.client.timeout = std::time::Duration::from_secs(10);
    let spec = CorpusSpec { doc_prefix: "raced".into(), chunks: 192, ..CorpusSpec::default() };
    let mut corpus = Vec::new();
    write_corpus(&mut corpus, &spec, 4_000).unwrap();
    let keys = keys_in_order(&corpus);
    let run = pipeline(&s).await;
    let run = tokio::spawn(async move { run.run(input(corpus), CancellationToken::new()).await });
    // Every window has been looked up (none had a manifest row) and the provider holds the
    // first requests.
    while mock.control.stats().requests <= mock.control.stats().canaries {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    // The last 64 chunks (past the run's first windows) get a newer record meanwhile.
    let newer = &keys[128..];
    let docs: Vec<&str> = newer.iter().map(|k| k.0.as_str()).collect();
    let idxs: Vec<i32> = newer.iter().map(|k| k.1).collect();
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO ingest_manifest (target_table, doc_id, chunk_index, content_hash, status, source_seq)
         SELECT 'public.doc_embeddings', d, i, 'newer', 'stored', 4611686018427387904
           FROM UNNEST($1::text[], $2::int[]) AS t(d, i)",
    )
    .bind(&docs)
    .bind(&idxs)
    .execute(&mut *tx)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO doc_embeddings (doc_id, chunk_index, content_hash, embedding)
         SELECT d, i, 'newer', array_fill(0.5::real, ARRAY[768])::vector FROM UNNEST($1::text[], $2::int[]) AS t(d, i)",
    )
    .bind(&docs)
    .bind(&idxs)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();

    let summary = run.await.unwrap().expect("the run ends well");
    assert_eq!((summary.stored, summary.superseded), (128, 64), "{summary:?}");
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings WHERE content_hash = 'newer'").await, 64);
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 192);
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest WHERE content_hash = 'newer'").await, 64);
}

/// A deletion newer than a new chunk's record (its tombstone, without a manifest row left):
/// the run's write of the chunk is superseded, and the rest of its batch is still stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deletion_newer_than_a_new_chunks_record_keeps_it_out() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let spec = CorpusSpec { doc_prefix: "fenced".into(), chunks: 400, ..CorpusSpec::default() };
    let mut corpus = Vec::new();
    write_corpus(&mut corpus, &spec, 4_000).unwrap();
    let keys = keys_in_order(&corpus);
    // A whole document and one chunk of another, both past the run's first windows.
    let (whole_doc, one_chunk) = (&keys[200].0, &keys[300]);
    let whole: Vec<&(String, i32)> = keys.iter().filter(|k| &k.0 == whole_doc).collect();
    assert!(whole.len() > 1);
    sqlx::query(
        "INSERT INTO ingest_tombstone (target_table, doc_id, chunk_index, source_seq)
         VALUES ('public.doc_embeddings', $1, -1, 4611686018427387904),
                ('public.doc_embeddings', $2, $3, 4611686018427387904)",
    )
    .bind(whole_doc)
    .bind(&one_chunk.0)
    .bind(one_chunk.1)
    .execute(&db.pool)
    .await
    .unwrap();

    let summary = pipeline(&small_windows(settings(&db, &mock)))
        .await
        .run(input(corpus), CancellationToken::new())
        .await
        .expect("the run ends well");
    let fenced = whole.len() as u64 + 1;
    assert_eq!((summary.stored, summary.superseded), (400 - fenced, fenced), "{summary:?}");
    let stored: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM doc_embeddings WHERE doc_id = $1 OR (doc_id = $2 AND chunk_index = $3)",
    )
    .bind(whole_doc)
    .bind(&one_chunk.0)
    .bind(one_chunk.1)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(stored, 0, "a deleted chunk came back");
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await as u64, 400 - fenced);
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest").await as u64, 400 - fenced);
}

/// Rows Postgres has read from the manifest by sequential scans ([`settled_stats`]).
async fn manifest_rows_scanned(db: &TestDb) -> i64 {
    let mut conn = settled_stats(db).await;
    sqlx::query_scalar(
        "SELECT coalesce(seq_tup_read, 0) FROM pg_stat_user_tables WHERE relname = 'ingest_manifest'",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap()
}

/// A connection whose view of the table statistics includes everything the pipeline's
/// connections did: they are gone (a backend reports its counts when idle or at exit) and
/// the snapshot is fresh.
async fn settled_stats(db: &TestDb) -> sqlx::pool::PoolConnection<sqlx::Postgres> {
    for _ in 0..500 {
        let open: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'embed-dlq'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if open == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let mut conn = db.pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_stat_clear_snapshot()").execute(&mut *conn).await.unwrap();
    conn
}

/// Rows read from `table` (sequential scans plus index entries read, every index) by every
/// connection so far ([`settled_stats`]).
async fn rows_read(db: &TestDb, table: &str) -> i64 {
    let mut conn = settled_stats(db).await;
    sqlx::query_scalar(
        "SELECT coalesce((SELECT seq_tup_read FROM pg_stat_user_tables WHERE relname = $1), 0)
              + coalesce((SELECT sum(idx_tup_read) FROM pg_stat_user_indexes WHERE relname = $1), 0)::bigint",
    )
    .bind(table)
    .fetch_one(&mut *conn)
    .await
    .unwrap()
}

/// New chunks written after 40,000 tombstones and DLQ rows of other documents appeared (a
/// table with a long history; the pipeline's first writes saw them empty): each batch reads
/// only its keys of them. A plan that joins them (all of the table's tombstones
/// materialized, the DLQ walked by table), as a plan made once while they were empty and kept
/// does (tried: 160,000 and 1,680,000 rows read), would read them all for every batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_chunks_read_only_their_keys_of_a_large_dlq_and_tombstones() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let p = pipeline(&small_windows(settings(&db, &mock))).await;
    let corpus = |doc_prefix: &str, chunks| {
        let mut out = Vec::new();
        write_corpus(
            &mut out,
            &CorpusSpec { doc_prefix: doc_prefix.into(), chunks, ..CorpusSpec::default() },
            4_000,
        )
        .unwrap();
        input(out)
    };
    assert_eq!(p.run(corpus("early", 200), CancellationToken::new()).await.unwrap().stored, 200);
    sqlx::raw_sql(
        "INSERT INTO ingest_tombstone (target_table, doc_id, chunk_index, source_seq)
         SELECT 'public.doc_embeddings', 'gone-' || n, -1, 1 FROM generate_series(1, 40000) n;
         INSERT INTO embedding_dlq (target_table, doc_id, chunk_index, content_hash, payload, error_class,
                                    error_reason, attempts)
         SELECT 'public.doc_embeddings', 'parked-' || n, 0, 'h', '{}', 'permanent_input', 'test', 1
           FROM generate_series(1, 40000) n;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    assert_eq!(p.run(corpus("later", 800), CancellationToken::new()).await.unwrap().stored, 800);
    drop(p);
    // 1,000 chunks in 63 batches: a probe each is about 1,000 rows read per table; a scan per
    // batch of either table reads 2.5 million.
    for table in ["ingest_tombstone", "embedding_dlq"] {
        let read = rows_read(&db, table).await;
        assert!(read < 20_000, "the writes read {read} rows of {table}");
    }
}

/// A long-lived pipeline (a stream source's, `serve`'s) whose manifest was emptied (a reset,
/// a mass deletion) and fills again: its window lookups stay index probes. A lookup planned
/// once on the empty table and kept (its plan cached under the size class of the manifest as
/// it had been) scanned the whole manifest once per document range when the manifest grew
/// back to that size: 100 times slower, fresh ingest and unchanged rerun alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn window_lookups_stay_index_probes_after_the_manifest_was_emptied_under_a_long_lived_pipeline() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let spec = CorpusSpec { doc_prefix: "reset".into(), chunks: 3_000, ..CorpusSpec::default() };
    let mut corpus = Vec::new();
    write_corpus(&mut corpus, &spec, 4_000).unwrap();
    let p = pipeline(&small_windows(settings(&db, &mock))).await;
    p.run(input(corpus.clone()), CancellationToken::new()).await.unwrap();
    // Emptied, and analyzed so (as autovacuum does once it notices the change).
    sqlx::raw_sql("TRUNCATE ingest_manifest, doc_embeddings; ANALYZE ingest_manifest")
        .execute(&db.pool)
        .await
        .unwrap();
    let fresh = p.run(input(corpus.clone()), CancellationToken::new()).await.unwrap();
    let rerun = p.run(input(corpus), CancellationToken::new()).await.unwrap();
    assert_eq!((fresh.stored, rerun.unchanged), (3_000, 3_000));
    drop(p);
    let scanned = manifest_rows_scanned(&db).await;
    // The first windows' claims may scan the manifest while it is a page or two (their
    // custom plans choose to: about 4,000 rows in all); a scan per range of the lookups once
    // the manifest has grown back read 160,000.
    assert!(scanned < 16_000, "the lookups scanned {scanned} manifest rows");
}

/// The DLQ swings between empty and a backlog: an `ANALYZE` after a drain (autovacuum's) finds
/// its pages and no live row, and until the next one the planner believes it holds one row
/// whatever its size. Planned from that, each write batch's resolve of its chunks' DLQ rows
/// (a join of the batch with the DLQ) walked every DLQ row of the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_batches_read_only_their_own_dlq_rows_whatever_the_statistics_say() {
    let db = TestDb::new().await;
    insert_parked_rows(&db, "drained", 5_000, Some("1 minute")).await;
    sqlx::raw_sql(
        "ALTER TABLE embedding_dlq SET (autovacuum_enabled = off);
         DELETE FROM embedding_dlq; DELETE FROM ingest_manifest; ANALYZE embedding_dlq;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // The next backlog, parked before any new `ANALYZE` (rows of other documents).
    insert_parked_rows_unanalyzed(&db, "backlog", 5_000, Some("1 minute")).await;
    let mock = start_mock(MockConfig::default()).await;
    let spec = CorpusSpec { doc_prefix: "beside".into(), chunks: 3_000, ..CorpusSpec::default() };
    let mut corpus = Vec::new();
    write_corpus(&mut corpus, &spec, 4_000).unwrap();
    let before = rows_read(&db, "embedding_dlq").await;
    let p = pipeline(&settings(&db, &mock)).await;
    let summary = p.run(input(corpus), CancellationToken::new()).await.unwrap();
    assert_eq!(summary.stored, 3_000);
    drop(p);
    let read = rows_read(&db, "embedding_dlq").await - before;
    // None of these chunks has a DLQ row: each batch's lookups find nothing. Walking the
    // backlog for each write batch read it once per batch (5,000 rows a batch).
    assert!(read < 1_000, "the write batches read {read} DLQ rows");
}
