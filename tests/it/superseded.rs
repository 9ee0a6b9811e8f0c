//! Superseded vectors (issue 19, item 5): when a chunk's new text is parked, the vector of its
//! previous text is withdrawn in the park's transaction (`[ingest] on_newer_parked =
//! withdraw`, the default) or kept until the new text is stored (`keep`); the reconciler's
//! `superseded_vectors` check finds such vectors and, under `withdraw`, removes them.
//!
//! Every oracle here reads the vector table, the DLQ and the outbox with plain SELECTs of its
//! own, never the product's statements.

use std::time::Duration;

use embed_dlq::replay::{ReplayConfig, Replayer, Scheduler};
use embed_dlq::testkit::mock_provider::{MockConfig, POISON_400};
use tokio_util::sync::CancellationToken;

use crate::support::*;

/// One JSONL corpus of document `doc`, chunk `i` holding `texts[i]`.
fn corpus(doc: &str, texts: &[&str]) -> Vec<u8> {
    texts.iter().enumerate().map(|(i, t)| line(doc, i as i32, t)).collect::<String>().into_bytes()
}

async fn ingest(settings: &embed_dlq::config::IngestSettings, bytes: Vec<u8>) {
    pipeline(settings).await.run(input(bytes), CancellationToken::new()).await.unwrap();
}

/// The content hash of the vector row of (`doc`, `idx`) in `doc_embeddings`, if there is one.
async fn vector_hash(db: &TestDb, doc: &str, idx: i32) -> Option<String> {
    sqlx::query_scalar("SELECT content_hash FROM doc_embeddings WHERE doc_id = $1 AND chunk_index = $2")
        .bind(doc)
        .bind(idx)
        .fetch_optional(&db.pool)
        .await
        .unwrap()
}

/// The DLQ row of (`doc`, `idx`): id, error class, content hash, generation.
async fn dlq_row(db: &TestDb, doc: &str, idx: i32) -> (i64, String, String, i64) {
    sqlx::query_as(
        "SELECT id, error_class, content_hash, generation FROM embedding_dlq
          WHERE doc_id = $1 AND chunk_index = $2",
    )
    .bind(doc)
    .bind(idx)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// The outbox events of (`doc`, `idx`) in the order they were written: event, the writing
/// transaction's id, body.
async fn events_of(db: &TestDb, doc: &str, idx: i32) -> Vec<(String, String, serde_json::Value)> {
    sqlx::query_as(
        "SELECT event, xmin::text, body FROM dlq_outbox WHERE doc_id = $1 AND chunk_index = $2 ORDER BY id",
    )
    .bind(doc)
    .bind(idx)
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn superseded_by_a_park_the_previous_vector_is_withdrawn_in_the_same_transaction() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let s = settings(&db, &mock);
    ingest(&s, corpus("w", &["w zero", "w one", "w two"])).await;
    let old = vector_hash(&db, "w", 1).await.expect("the first text is stored");

    // Chunk 1's new text is rejected by the provider (400): parked as permanent_input.
    let new_text = format!("w one, rewritten {POISON_400}");
    ingest(&s, corpus("w", &["w zero", &new_text, "w two"])).await;

    let (dlq_id, class, parked, generation) = dlq_row(&db, "w", 1).await;
    assert_eq!(class, "permanent_input");
    assert_ne!(parked, old, "the DLQ row holds the new text");
    assert_eq!(vector_hash(&db, "w", 1).await, None, "the previous text's vector is no longer searchable");
    assert!(vector_hash(&db, "w", 0).await.is_some() && vector_hash(&db, "w", 2).await.is_some());
    let events = events_of(&db, "w", 1).await;
    let names: Vec<&str> = events.iter().map(|(e, _, _)| e.as_str()).collect();
    assert_eq!(names, ["parked", "withdrawn"], "{events:#?}");
    let (parked_tx, withdrawn_tx) = (&events[0].1, &events[1].1);
    assert_eq!(parked_tx, withdrawn_tx, "one transaction parks and withdraws");
    let body = &events[1].2;
    assert_eq!(body["event"], "withdrawn");
    assert_eq!(body["dlq_id"], dlq_id);
    assert_eq!(body["generation"], generation);
    assert_eq!(body["table"], "public.doc_embeddings");
    assert_eq!(body["withdrawn_hash"], old.as_str());
    assert_eq!(body["content_hash"], parked.as_str());
    assert_eq!(body["by"], "ingest");
    // Nothing lost: the chunk is in the DLQ with its new text.
    assert_eq!(db.leaks().await, 0);
    assert_eq!(db.manifest_disagreements().await, 0);

    // Parking the same text again withdraws nothing more and announces nothing.
    ingest(&s, corpus("w", &["w zero", &new_text, "w two"])).await;
    assert_eq!(events_of(&db, "w", 1).await.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn superseded_then_replayed_a_chunk_stores_its_new_vector() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let mock = start_mock(MockConfig::default()).await;
    let mut s = settings(&db, &mock);
    s.retry.max_attempts = 1;
    ingest(&s, corpus("r", &["r zero", "r one"])).await;
    let old = vector_hash(&db, "r", 0).await.unwrap();

    // The provider is down when chunk 0's new text comes: parked as transient.
    mock.control.set_outage(true);
    ingest(&s, corpus("r", &["r zero, second edition", "r one"])).await;
    let (_, class, parked, _) = dlq_row(&db, "r", 0).await;
    assert_eq!(class, "transient");
    assert_eq!(vector_hash(&db, "r", 0).await, None);

    // Back up: the replay stores the new text's vector (an insert: the old row is gone).
    mock.control.set_outage(false);
    let p = pipeline(&s).await;
    make_due(&db).await;
    let mut redis = redis().await;
    embed_dlq::replay::ensure_group(&mut redis, &keys).await.unwrap();
    Scheduler::new(p.store.clone(), ReplayConfig::default(), redis.clone(), keys.clone())
        .run_once()
        .await
        .unwrap();
    relay_all(&db, &keys).await;
    let client = embed_dlq::streams::client(&redis_url()).unwrap();
    let mut rep = Replayer {
        name: "superseded".into(),
        store: p.store.clone(),
        embedder: p.embedder.clone(),
        client: client.clone(),
        redis,
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
    assert_eq!(vector_hash(&db, "r", 0).await.as_deref(), Some(parked.as_str()));
    assert_ne!(parked, old);
    assert_eq!(db.leaks().await, 0);
    assert_corpus_accounted(&db, &corpus_keys(&corpus("r", &["r zero, second edition", "r one"]))).await;
    assert_eq!(db.manifest_disagreements().await, 0);
}

/// The finding of the check named `name` in `report`, as JSON (by name, as `--json` shows it).
fn finding(report: &embed_dlq::reconcile::Report, name: &str) -> serde_json::Value {
    let all = serde_json::to_value(&report.findings).unwrap();
    all.as_array().unwrap().iter().find(|f| f["check"] == name).cloned().unwrap_or_else(|| {
        panic!("no {name} finding in {report:#?}");
    })
}

/// Puts back by hand a vector of other text under (`doc`, `idx`): what a `keep` policy, or a
/// release before this check, leaves next to a parked chunk.
async fn put_back_previous_vector(db: &TestDb, doc: &str, idx: i32) {
    sqlx::query(
        "INSERT INTO doc_embeddings (doc_id, chunk_index, content_hash, embedding)
         VALUES ($1, $2, 'previous-text', array_fill(0.5, ARRAY[768])::vector)
         ON CONFLICT (doc_id, chunk_index) DO UPDATE SET content_hash = EXCLUDED.content_hash",
    )
    .bind(doc)
    .bind(idx)
    .execute(&db.pool)
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn superseded_vector_next_to_a_parked_chunk_is_found_and_withdrawn_by_repair() {
    use embed_dlq::reconcile::Mode;
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let s = settings(&db, &mock);
    ingest(&s, corpus("h", &["h zero", "h one", "h two"])).await;
    ingest(&s, corpus("h", &["h zero", &format!("h one again {POISON_400}"), "h two"])).await;
    put_back_previous_vector(&db, "h", 1).await;
    let (dlq_id, _, parked, _) = dlq_row(&db, "h", 1).await;
    let withdrawn_before = db.count("SELECT count(*) FROM dlq_outbox WHERE event = 'withdrawn'").await;

    let mut r = reconciler(&db, &fresh_keys(), immediate()).await;
    let report = r.run_once(Mode::Check).await.unwrap();
    let f = finding(&report, "superseded_vectors");
    assert_eq!(f["found"], 1, "{report:#?}");
    assert_eq!(f["examples"], serde_json::json!(["h#1"]));
    assert_eq!(report.total_found(), 1, "no other check reports it: {report:#?}");
    assert_eq!(vector_hash(&db, "h", 1).await.as_deref(), Some("previous-text"), "a check changes nothing");

    let repaired = r.run_once(Mode::Repair).await.unwrap();
    assert_eq!(finding(&repaired, "superseded_vectors")["repaired"], 1, "{repaired:#?}");
    assert_eq!(vector_hash(&db, "h", 1).await, None, "the previous text's vector is withdrawn");
    assert!(vector_hash(&db, "h", 0).await.is_some() && vector_hash(&db, "h", 2).await.is_some());
    let events = events_of(&db, "h", 1).await;
    let (event, _, body) = events.last().unwrap();
    assert_eq!(event, "withdrawn");
    assert_eq!(
        (&body["dlq_id"], &body["withdrawn_hash"], &body["content_hash"], &body["by"]),
        (
            &serde_json::json!(dlq_id),
            &serde_json::json!("previous-text"),
            &serde_json::json!(parked),
            &serde_json::json!("reconcile")
        )
    );
    assert_eq!(
        db.count("SELECT count(*) FROM dlq_outbox WHERE event = 'withdrawn'").await,
        withdrawn_before + 1
    );
    // The chunk is still in the DLQ with its new text: nothing lost, and the next run is clean.
    assert_eq!(dlq_row(&db, "h", 1).await.2, parked);
    assert_eq!(db.leaks().await, 0);
    let clean = r.run_once(Mode::Check).await.unwrap();
    assert_eq!(clean.total_found(), 0, "{clean:#?}");
}

/// Ingest settings for `db` under `on_newer_parked = keep`.
fn keep_settings(
    db: &TestDb,
    mock: &embed_dlq::testkit::mock_provider::MockProvider,
) -> embed_dlq::config::IngestSettings {
    let mut s = settings(db, mock);
    s.options.on_newer_parked = embed_dlq::store::park::OnNewerParked::Keep;
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn superseded_under_keep_the_previous_vector_serves_until_the_new_text_is_stored() {
    use embed_dlq::reconcile::{Mode, Reconciler, Sweep};
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let s = keep_settings(&db, &mock);
    ingest(&s, corpus("k", &["k zero", "k one"])).await;
    let old = vector_hash(&db, "k", 1).await.unwrap();
    ingest(&s, corpus("k", &["k zero", &format!("k one, edited {POISON_400}")])).await;

    let (_, class, parked, _) = dlq_row(&db, "k", 1).await;
    assert_eq!(class, "permanent_input");
    assert_eq!(
        vector_hash(&db, "k", 1).await,
        Some(old.clone()),
        "keep: search still serves the previous text"
    );
    assert_eq!(db.count("SELECT count(*) FROM dlq_outbox WHERE event = 'withdrawn'").await, 0);

    // A reconciler of the same policy: expected, so no finding, only a note; repair keeps it.
    let keys = fresh_keys();
    let mut keeping = Reconciler {
        store: pipeline(&s).await.store,
        redis: Some(redis().await),
        keys: keys.clone(),
        config: immediate(),
    };
    for mode in [Mode::Check, Mode::Repair] {
        let report = keeping.run_sweep(mode, Some(Sweep::Full)).await.unwrap();
        let f = finding(&report, "superseded_vectors");
        assert_eq!((f["found"].as_u64(), f["repaired"].as_u64()), (Some(0), Some(0)), "{report:#?}");
        let note = f["note"].as_str().unwrap_or_default();
        assert!(note.contains("1 kept on purpose") && note.contains("k#1"), "{note}");
        assert_eq!(report.total_found(), 0, "{report:#?}");
    }
    assert_eq!(vector_hash(&db, "k", 1).await, Some(old.clone()));

    // The policy becomes withdraw: a full sweep (an incremental one sees only the chunks
    // changed since the last run) finds the kept vector and withdraws it.
    let mut r = reconciler(&db, &keys, immediate()).await;
    let full = r.run_sweep(Mode::Repair, Some(Sweep::Full)).await.unwrap();
    let f = finding(&full, "superseded_vectors");
    assert_eq!((f["found"].as_u64(), f["repaired"].as_u64()), (Some(1), Some(1)), "{full:#?}");
    assert_eq!(vector_hash(&db, "k", 1).await, None);
    let (event, _, body) = events_of(&db, "k", 1).await.pop().unwrap();
    assert_eq!(
        (event.as_str(), &body["withdrawn_hash"], &body["by"]),
        ("withdrawn", &serde_json::json!(old), &serde_json::json!("reconcile"))
    );
    assert_eq!(dlq_row(&db, "k", 1).await.2, parked, "the new text is still parked");
    assert_eq!(db.leaks().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn superseded_under_keep_a_stored_new_text_replaces_the_kept_vector() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let s = keep_settings(&db, &mock);
    ingest(&s, corpus("s", &["s zero"])).await;
    let old = vector_hash(&db, "s", 0).await.unwrap();
    ingest(&s, corpus("s", &[&format!("s zero, edited {POISON_400}")])).await;
    assert_eq!(vector_hash(&db, "s", 0).await, Some(old.clone()));
    // The text is fixed upstream: the next ingest stores it over the kept vector.
    ingest(&s, corpus("s", &["s zero, edited and fixed"])).await;
    let now = vector_hash(&db, "s", 0).await.unwrap();
    assert_ne!(now, old);
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 1);
    assert_eq!(db.manifest_disagreements().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn superseded_then_purged_under_keep_the_vector_without_a_manifest_row_is_noted_not_repaired() {
    use embed_dlq::reconcile::{Mode, Sweep};
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let s = keep_settings(&db, &mock);
    ingest(&s, corpus("p", &["p zero", "p one"])).await;
    ingest(&s, corpus("p", &["p zero", &format!("p one, edited {POISON_400}")])).await;
    let p = pipeline(&s).await;
    let filter = embed_dlq::dlq::Filter { doc: Some("p".into()), ..Default::default() };
    assert_eq!(embed_dlq::dlq::purge(&p.store, &filter, false).await.unwrap(), 1);
    assert_eq!(
        db.count("SELECT count(*) FROM ingest_manifest WHERE doc_id = 'p' AND chunk_index = 1").await,
        0
    );
    assert!(vector_hash(&db, "p", 1).await.is_some(), "the purge leaves the kept vector");

    // Whatever the policy: reported in the note of a full sweep, never a finding nor repaired
    // (a vector written by another tool looks the same).
    let mut r = reconciler(&db, &fresh_keys(), immediate()).await;
    let report = r.run_sweep(Mode::Repair, Some(Sweep::Full)).await.unwrap();
    let f = finding(&report, "superseded_vectors");
    assert_eq!((f["found"].as_u64(), f["repaired"].as_u64()), (Some(0), Some(0)), "{report:#?}");
    let note = f["note"].as_str().unwrap_or_default();
    assert!(note.contains("1 vectors have no manifest row") && note.contains("p#1"), "{note}");
    assert!(vector_hash(&db, "p", 1).await.is_some());
    let incremental = r.run_sweep(Mode::Check, Some(Sweep::Incremental)).await.unwrap();
    assert_eq!(
        finding(&incremental, "superseded_vectors")["note"],
        serde_json::Value::Null,
        "an incremental run does not scan every vector"
    );
}
