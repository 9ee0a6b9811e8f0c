//! Revisions of a target (issue 46), the groundwork: an existing table adopted as revision 1
//! keeps answering under its name (a view), and every writer (ingest, park, replay,
//! reconcile) writes the renamed relation under the unchanged identity. Real Postgres, real
//! Redis, the mock provider over real HTTP; the oracles read the relations and the catalog
//! directly.

use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use embed_dlq::model::content_hash;
use embed_dlq::reconcile::{Mode, ReconcileConfig, Reconciler, Sweep, SweepPolicy};
use embed_dlq::replay::Scheduler;
use embed_dlq::store::Store;
use embed_dlq::store::revision::adopt;
use embed_dlq::testkit::mock_provider::MockConfig;
use tokio_util::sync::CancellationToken;

use crate::support::*;

/// `n` chunks of document `doc`, version `v`; every 50th a text the provider rejects.
fn corpus(doc: &str, n: i32, v: &str) -> Vec<u8> {
    (0..n)
        .map(|i| {
            let poison = if i % 50 == 49 { "[[poison:400]] " } else { "" };
            line(doc, i, &format!("{poison}{doc} chunk {i} {v}"))
        })
        .collect::<String>()
        .into_bytes()
}

async fn relkind(db: &TestDb, name: &str) -> Option<String> {
    sqlx::query_scalar("SELECT c.relkind::text FROM pg_class c WHERE c.oid = to_regclass($1)")
        .bind(name)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// Every key's content hash in `relation`, read directly.
pub(crate) async fn hashes(db: &TestDb, relation: &str) -> std::collections::BTreeMap<(String, i32), String> {
    let sql = format!("SELECT doc_id, chunk_index, content_hash FROM {relation}");
    sqlx::query_as::<_, (String, i32, String)>(sqlx::AssertSqlSafe(sql))
        .fetch_all(&db.pool)
        .await
        .unwrap()
        .into_iter()
        .map(|(d, i, h)| ((d, i), h))
        .collect()
}

/// The manifest's text hash of a key, and what it must be: the first 16 bytes of SHA-256 of
/// "text", a zero byte and the text, computed by Postgres.
async fn text_hash_and_expected(
    db: &TestDb,
    identity: &str,
    doc: &str,
    idx: i32,
    text: &str,
) -> (Option<Vec<u8>>, Vec<u8>) {
    sqlx::query_as(
        "SELECT (SELECT text_hash FROM ingest_manifest WHERE target_table = $1 AND doc_id = $2 AND chunk_index = $3),
                substring(sha256(convert_to('text', 'UTF8') || '\\x00'::bytea || convert_to($4, 'UTF8')) FROM 1 FOR 16)",
    )
    .bind(identity)
    .bind(doc)
    .bind(idx)
    .bind(text)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// Makes every DLQ row due, has the scheduler issue them (`expected` of them) and a replayer
/// of `mock` replay them all, with their events relayed; returns the store of the default
/// target.
async fn replay_every_due_row(
    db: &TestDb,
    keys: &embed_dlq::streams::StreamKeys,
    mock: &embed_dlq::testkit::mock_provider::MockProvider,
    expected: u64,
) -> Store {
    make_due(db).await;
    let store = Store::open(db.pool.clone(), "doc_embeddings").await.unwrap();
    let mut r = redis().await;
    embed_dlq::replay::ensure_group(&mut r, keys).await.unwrap();
    let issued =
        Scheduler::new(store.clone(), quick_replay_config(), r, keys.clone()).run_once().await.unwrap();
    assert_eq!(issued, expected);
    relay_all(db, keys).await;
    let mut rep = replayer_for(db, mock, keys, "r", quick_replay_config(), Duration::from_secs(10)).await;
    let mut replayed = 0;
    for _ in 0..20 {
        replayed += read_once(&mut rep).await.replayed;
        if replayed >= expected {
            break;
        }
    }
    assert_eq!(replayed, expected);
    relay_all(db, keys).await;
    store
}

/// A full reconcile of every revision finds nothing; then, with the vector of `key` deleted by
/// hand from `relation`, exactly that one leak (reported as `example`). Full sweeps: a vector
/// deleted by hand changes no manifest row for an incremental one to see.
async fn reconcile_finds_a_lost_vector(
    db: &TestDb,
    store: Store,
    keys: embed_dlq::streams::StreamKeys,
    relation: &str,
    key: (&str, i32),
    example: &str,
) {
    let config = ReconcileConfig { sweeps: SweepPolicy::Always(Sweep::Full), ..immediate() };
    let mut reconciler = Reconciler { store, redis: Some(redis().await), keys, config };
    let report = reconciler.run_once(Mode::Check).await.unwrap();
    assert_eq!(report.total_found(), 0, "{report:?}");
    let sql = format!("DELETE FROM {relation} WHERE doc_id = $1 AND chunk_index = $2");
    sqlx::query(sqlx::AssertSqlSafe(sql)).bind(key.0).bind(key.1).execute(&db.pool).await.unwrap();
    let report = reconciler.run_once(Mode::Check).await.unwrap();
    let leaks = report.findings.iter().find(|f| f.check.name() == "leaks").unwrap();
    assert_eq!((leaks.found, leaks.examples.clone()), (1, vec![example.to_string()]), "{report:?}");
}

/// What a search of the query name sees: (rows, smallest and largest vector dimension).
type Answer = (i64, Option<i32>, Option<i32>);

/// Reads the query name over and over until stopped, every answer kept in order (an error
/// as its message): what a user's search sees across an adoption or a switch.
struct Probe {
    stop: Arc<AtomicBool>,
    seen: Arc<std::sync::atomic::AtomicU64>,
    task: tokio::task::JoinHandle<Vec<Result<Answer, String>>>,
}

impl Probe {
    /// Starts reading, and returns once a first answer is in (so one is from before what
    /// the test does next, however slow the machine).
    async fn start(db: &TestDb) -> Probe {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let task = tokio::spawn({
            let (pool, stop, seen) = (db.pool.clone(), stop.clone(), seen.clone());
            async move {
                let mut answers = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let a: Result<Answer, _> = sqlx::query_as(
                        "SELECT count(*), min(vector_dims(embedding)), max(vector_dims(embedding)) FROM doc_embeddings",
                    )
                    .fetch_one(&pool)
                    .await;
                    answers.push(a.map_err(|e| e.to_string()));
                    seen.fetch_add(1, Ordering::Relaxed);
                }
                answers
            }
        });
        let probe = Probe { stop, seen, task };
        probe.wait_past(0).await;
        probe
    }

    async fn wait_past(&self, n: u64) {
        wait_for("the probe's next answer", Duration::from_secs(60), async || {
            self.seen.load(Ordering::Relaxed) > n
        })
        .await;
    }

    /// Stops after two more answers (the second begun after this call, so after whatever
    /// the test did before it); returns every answer.
    async fn stop(self) -> Vec<Result<Answer, String>> {
        self.wait_past(self.seen.load(Ordering::Relaxed) + 1).await;
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopted_table_answers_under_its_name_and_every_writer_writes_its_relation() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let mock = start_mock(MockConfig::default()).await;
    let s = settings(&db, &mock);
    let v1 = pipeline(&s).await.run(input(corpus("a", 200, "v1")), CancellationToken::new()).await.unwrap();
    assert_eq!((v1.stored, v1.parked_total()), (196, 4), "{v1:?}");
    sqlx::query(
        "CREATE INDEX doc_embeddings_hnsw ON doc_embeddings USING hnsw (embedding vector_cosine_ops)",
    )
    .execute(&db.pool)
    .await
    .unwrap();

    // A probe reads the query name all through the adoption: never an error, never a
    // partial answer.
    let probe = Probe::start(&db).await;
    let rev = adopt(&db.pool, "doc_embeddings", Some("mock"), None).await.unwrap();
    let answers = probe.stop().await;
    assert!(answers.len() > 2, "{answers:?}");
    assert!(answers.iter().all(|a| a == &Ok((196, Some(768), Some(768)))), "every answer whole: {answers:?}");

    assert_eq!(
        (rev.target.as_str(), rev.revision, rev.identity.as_str(), rev.relation.as_str()),
        ("public.doc_embeddings", 1, "public.doc_embeddings", "public.doc_embeddings__r1")
    );
    assert_eq!((rev.model.as_deref(), rev.dimensions, rev.state.as_str()), (Some("mock"), 768, "active"));
    assert_eq!(relkind(&db, "doc_embeddings").await.as_deref(), Some("v"));
    assert_eq!(relkind(&db, "doc_embeddings__r1").await.as_deref(), Some("r"));
    assert_eq!(hashes(&db, "doc_embeddings__r1").await.len(), 196);
    assert_eq!(adopt(&db.pool, "public.doc_embeddings", None, None).await.unwrap(), rev, "idempotent");

    // The query name keeps the relation's index, and refuses writes.
    let mut conn = db.pool.acquire().await.unwrap();
    sqlx::query("SET enable_seqscan = off").execute(&mut *conn).await.unwrap();
    let plan: Vec<String> = sqlx::query_scalar(
        "EXPLAIN SELECT doc_id FROM doc_embeddings
          ORDER BY embedding <=> array_fill(0.1::real, ARRAY[768])::vector LIMIT 5",
    )
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    drop(conn);
    assert!(plan.iter().any(|l| l.contains("Index Scan using doc_embeddings_hnsw")), "{plan:#?}");
    for write in [
        "DELETE FROM doc_embeddings",
        "UPDATE doc_embeddings SET content_hash = 'x'",
        "INSERT INTO doc_embeddings (doc_id, chunk_index, content_hash) VALUES ('z', 0, 'z')",
    ] {
        let e = sqlx::query(write).execute(&db.pool).await.unwrap_err().to_string();
        assert!(e.contains("query name"), "{write}: {e}");
    }
    assert_eq!(hashes(&db, "doc_embeddings__r1").await.len(), 196);

    // Ingest: 50 chunks changed, a new document, through the query name.
    let mut v2 = corpus("a", 200, "v1");
    v2.extend(corpus("a", 50, "v2"));
    v2.extend(corpus("b", 20, "v1"));
    let r2 = pipeline(&s).await.run(input(v2), CancellationToken::new()).await.unwrap();
    assert_eq!((r2.stored, r2.parked_total()), (49 + 20, 1), "{r2:?}");
    // Replay: 10 chunks change while the provider is down, then replay stores them.
    let down = start_mock(MockConfig::default()).await;
    down.control.set_outage(true);
    let mut sd = settings(&db, &down);
    sd.retry.max_attempts = 1;
    let v3 = (0..10).map(|i| line("b", i, &format!("b chunk {i} v3"))).collect::<String>().into_bytes();
    let parked = pipeline(&sd).await.run(input(v3), CancellationToken::new()).await.unwrap();
    assert_eq!(parked.parked_total(), 10, "{parked:?}");
    let store = replay_every_due_row(&db, &keys, &mock, 10).await;

    // The relation holds every key's newest text (the poison ones parked), under the
    // unchanged identity; nothing names the relation as a table of its own.
    let want = |doc: &str, i: i32, v: &str| content_hash("mock", 768, &format!("{doc} chunk {i} {v}"));
    let got = hashes(&db, "doc_embeddings__r1").await;
    let mut expected = std::collections::BTreeMap::new();
    for i in (0..200).filter(|i| i % 50 != 49) {
        expected.insert(("a".to_string(), i), want("a", i, if i < 50 { "v2" } else { "v1" }));
    }
    for i in 0..20 {
        expected.insert(("b".to_string(), i), want("b", i, if i < 10 { "v3" } else { "v1" }));
    }
    assert_eq!(got, expected);
    assert_eq!(hashes(&db, "doc_embeddings").await, expected, "the query name answers the relation");
    // Every write records the text's own hash: a new chunk's insert, a changed chunk's
    // upsert, a replay (its park's), a park of a poison text.
    for (doc, idx, text) in [
        ("b", 15, "b chunk 15 v1"),
        ("a", 0, "a chunk 0 v2"),
        ("b", 0, "b chunk 0 v3"),
        ("a", 99, "[[poison:400]] a chunk 99 v1"),
    ] {
        let (got, want) = text_hash_and_expected(&db, "public.doc_embeddings", doc, idx, text).await;
        assert_eq!(got, Some(want), "{doc}#{idx}");
    }
    let identities: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT target_table FROM ingest_manifest
         UNION SELECT DISTINCT target_table FROM embedding_dlq
         UNION SELECT DISTINCT target_table FROM dlq_outbox WHERE target_table IS NOT NULL",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(identities, vec!["public.doc_embeddings".to_string()]);
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 4, "the poison rows only");
    assert_eq!(db.leaks().await, 0);
    assert_eq!(db.manifest_disagreements().await, 0);

    // And it reads the relation: a vector lost from it is a leak of the identity.
    reconcile_finds_a_lost_vector(&db, store, keys, "doc_embeddings__r1", ("a", 0), "a#0").await;
}

/// An ingest that opened the table before it was adopted cannot write through the name
/// afterwards: its writes are refused, nothing of it is stored in the wrong place or lost,
/// and a rerun stores it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_opened_the_table_before_its_adoption_writes_nothing_through_the_view() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let s = settings(&db, &mock);
    let v1 = pipeline(&s).await.run(input(corpus("a", 100, "v1")), CancellationToken::new()).await.unwrap();
    assert_eq!(v1.stored, 98);
    let before = hashes(&db, "doc_embeddings").await;
    let stale = pipeline(&s).await;
    adopt(&db.pool, "doc_embeddings", Some("mock"), None).await.unwrap();
    let outcome = stale.run(input(corpus("a", 100, "v2")), CancellationToken::new()).await;
    eprintln!("the stale run: {outcome:?}");
    assert_eq!(hashes(&db, "doc_embeddings__r1").await, before, "nothing written by the stale run");
    assert_eq!(db.leaks().await, 0);
    assert_eq!(db.manifest_disagreements().await, 0);
    let rerun =
        pipeline(&s).await.run(input(corpus("a", 100, "v2")), CancellationToken::new()).await.unwrap();
    assert_eq!(rerun.stored, 98, "{rerun:?}");
    let got = hashes(&db, "doc_embeddings__r1").await;
    assert!(got.iter().all(|((d, i), h)| h == &content_hash("mock", 768, &format!("{d} chunk {i} v2"))));
    assert_eq!(db.manifest_disagreements().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adoption_keeps_select_grants_and_refuses_what_it_cannot_adopt() {
    let db = TestDb::new().await;
    let role = format!("it_reader_{}", rand::random::<u32>());
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE ROLE {role}"))).execute(&db.pool).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("GRANT SELECT ON doc_embeddings TO {role}")))
        .execute(&db.pool)
        .await
        .unwrap();
    let result = async {
        adopt(&db.pool, "doc_embeddings", None, None).await.unwrap();
        let can: bool =
            sqlx::query_scalar("SELECT has_table_privilege($1, 'public.doc_embeddings', 'SELECT')")
                .bind(&role)
                .fetch_one(&db.pool)
                .await
                .unwrap();
        assert!(can, "the reader can still read the query name");
        // Not a second time under another name, not a missing table, not a name too long.
        let e = adopt(&db.pool, "doc_embeddings__r1", None, None).await.unwrap_err().to_string();
        assert!(e.contains("revision's relation"), "{e}");
        let e = adopt(&db.pool, "no_such_table", None, None).await.unwrap_err().to_string();
        assert!(e.contains("does not exist"), "{e}");
        let long = "t".repeat(60);
        embed_dlq::store::create_target_table(&db.pool, &long, 8).await.unwrap();
        let e = adopt(&db.pool, &long, None, None).await.unwrap_err().to_string();
        assert!(e.contains("too long"), "{e}");
        assert_eq!(relkind(&db, &long).await.as_deref(), Some("r"), "left as it was");
    }
    .await;
    for sql in [format!("DROP OWNED BY {role}"), format!("DROP ROLE {role}")] {
        sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&db.pool).await.unwrap();
    }
    result
}

/// A shadow revision beside an adopted target: its own relation at its own dimension, shaped
/// like the active one (the HNSW index too), empty, `shadow`; an ingest into it writes it
/// under its own identity with its own model, and the query name still answers the active
/// revision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_revision_has_its_own_relation_dimension_and_identity() {
    use embed_dlq::store::revision::{create_shadow, list};
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let mut s = settings(&db, &mock);
    pipeline(&s).await.run(input(corpus("a", 60, "v1")), CancellationToken::new()).await.unwrap();
    sqlx::query(
        "CREATE INDEX doc_embeddings_hnsw ON doc_embeddings USING hnsw (embedding vector_cosine_ops)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // The table is adopted on the way (revision 1 records the model its vectors came from).
    let shadow =
        create_shadow(&db.pool, "doc_embeddings", Some("mock"), "mock-next", 256, Some(256)).await.unwrap();
    assert_eq!(
        (shadow.revision, shadow.identity.as_str(), shadow.relation.as_str(), shadow.dimensions),
        (2, "public.doc_embeddings__r2", "public.doc_embeddings__r2", 256)
    );
    assert_eq!(
        (shadow.model.as_deref(), shadow.request_dimensions, shadow.state.as_str()),
        (Some("mock-next"), Some(256), "shadow")
    );
    let all = list(&db.pool, Some("doc_embeddings")).await.unwrap();
    let states: Vec<(i32, &str, Option<&str>)> =
        all.iter().map(|r| (r.revision, r.state.as_str(), r.model.as_deref())).collect();
    assert_eq!(states, vec![(1, "active", Some("mock")), (2, "shadow", Some("mock-next"))]);
    let dims: i32 = sqlx::query_scalar(
        "SELECT atttypmod FROM pg_attribute WHERE attrelid = 'doc_embeddings__r2'::regclass AND attname = 'embedding'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(dims, 256);
    let indexes: Vec<String> = sqlx::query_scalar(
        "SELECT indexdef FROM pg_indexes WHERE schemaname = 'public' AND tablename = 'doc_embeddings__r2' ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(indexes.iter().any(|d| d.contains("USING hnsw (embedding vector_cosine_ops)")), "{indexes:#?}");
    assert!(
        indexes.iter().any(|d| d.contains("UNIQUE") && d.contains("(doc_id, chunk_index)")),
        "{indexes:#?}"
    );
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings__r2").await, 0);

    s.table = "doc_embeddings__r2".into();
    s.client.model = "mock-next".into();
    s.client.request_dimensions = Some(256);
    let into_shadow =
        pipeline(&s).await.run(input(corpus("a", 60, "v1")), CancellationToken::new()).await.unwrap();
    assert_eq!((into_shadow.stored, into_shadow.unchanged), (59, 0), "{into_shadow:?}");
    let got = hashes(&db, "doc_embeddings__r2").await;
    assert!(got.iter().all(|((d, i), h)| h == &content_hash("mock-next", 256, &format!("{d} chunk {i} v1"))));
    assert_eq!(got.len(), 59);
    assert_eq!(
        db.count("SELECT count(*) FROM doc_embeddings").await,
        59,
        "the query name answers revision 1"
    );
    let dims_answered: i32 = sqlx::query_scalar("SELECT vector_dims(embedding) FROM doc_embeddings LIMIT 1")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(dims_answered, 768);
    let per_identity: Vec<(String, i64)> =
        sqlx::query_as("SELECT target_table, count(*) FROM ingest_manifest GROUP BY 1 ORDER BY 1")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        per_identity,
        vec![("public.doc_embeddings".to_string(), 60), ("public.doc_embeddings__r2".to_string(), 60)]
    );
    let parked_models: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT target_table, model FROM embedding_dlq ORDER BY 1")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        parked_models,
        vec![
            ("public.doc_embeddings".to_string(), Some("mock".to_string())),
            ("public.doc_embeddings__r2".to_string(), Some("mock-next".to_string()))
        ],
        "each revision's failures park under its own identity and model"
    );
    // The two revisions hold the same text of every chunk, whatever their models.
    let same_text = db
        .count(
            "SELECT count(*) FROM ingest_manifest a JOIN ingest_manifest b USING (doc_id, chunk_index)
              WHERE a.target_table = 'public.doc_embeddings' AND b.target_table = 'public.doc_embeddings__r2'
                AND a.text_hash = b.text_hash AND a.content_hash <> b.content_hash",
        )
        .await;
    assert_eq!(same_text, 60);
    let e = create_shadow(&db.pool, "doc_embeddings", None, "m", 0, None).await.unwrap_err().to_string();
    assert!(e.contains("dimensions must be"), "{e}");
}

/// The whole move to a new model, in the library: a shadow made, refused while it covers
/// nothing; one corpus run writes both revisions (each with its model); rows written before
/// text hashes existed are refused until the corpus records theirs; the switch, with a probe
/// reading the query name throughout (each answer one revision whole, never a mix, never
/// empty); a change after it reaches both; the rollback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switch_needs_coverage_answers_one_revision_whole_and_rolls_back() {
    use embed_dlq::store::revision::{RevisionError, activate, create_shadow, list};
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let s = settings(&db, &mock);
    let v1 = corpus("a", 60, "v1");
    pipeline(&s).await.run(input(v1.clone()), CancellationToken::new()).await.unwrap();
    create_shadow(&db.pool, "doc_embeddings", Some("mock"), "mock-next", 256, Some(256)).await.unwrap();
    let refused = activate(&db.pool, "doc_embeddings", Some(2), 0).await.unwrap_err();
    match &refused {
        RevisionError::NotCovered { coverage, .. } => {
            assert_eq!((coverage.active_chunks, coverage.missing, coverage.covered), (60, 60, 0), "{refused}")
        }
        other => panic!("{other}"),
    }

    // One corpus run writes both revisions: the active one finds it unchanged.
    let fanout = s.fanout().await.unwrap().expect("two live revisions");
    let runs = fanout.run(input(v1.clone()), CancellationToken::new()).await;
    let summaries: Vec<(i32, u64, u64, u64)> = runs
        .iter()
        .map(|r| {
            let s = r.result.as_ref().unwrap();
            (r.revision.revision, s.stored, s.unchanged, s.parked_total() + s.already_parked)
        })
        .collect();
    assert_eq!(summaries, vec![(1, 0, 59, 1), (2, 59, 0, 1)]);
    // The active revision's run sent nothing to the provider.
    let active_calls = runs[0].result.as_ref().unwrap().provider_calls;
    assert_eq!(active_calls, 0, "the active revision embedded nothing again");

    // Rows from before text hashes: unknown text, refused, until the corpus records them.
    sqlx::query(
        "UPDATE ingest_manifest SET text_hash = NULL WHERE target_table = 'public.doc_embeddings' AND chunk_index < 5",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    match activate(&db.pool, "doc_embeddings", Some(2), 0).await.unwrap_err() {
        RevisionError::NotCovered { coverage, .. } => assert_eq!(coverage.other_text, 5, "{coverage:?}"),
        other => panic!("{other}"),
    }
    let store = Store::open(db.pool.clone(), "doc_embeddings").await.unwrap();
    let active = list(&db.pool, Some("doc_embeddings")).await.unwrap().remove(0);
    // A stale corpus fills nothing (its text is not what the revision holds)...
    let stale = corpus("a", 60, "v0");
    let filled = embed_dlq::ingest::record_text_hashes(&store, &active, "mock", 768, input(stale), 1 << 20)
        .await
        .unwrap();
    assert_eq!(filled, 0);
    // ...and a rerun of the corpus, which finds both revisions unchanged, records them.
    let fanout = s.fanout().await.unwrap().expect("two live revisions");
    assert!(fanout.fill.is_some(), "the active revision lacks text hashes");
    for run in fanout.run(input(v1.clone()), CancellationToken::new()).await {
        let summary = run.result.unwrap();
        assert_eq!((summary.stored, summary.unchanged), (0, 59), "{summary:?}");
    }
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest WHERE text_hash IS NULL").await, 0);

    // The switch, under a probe: one revision whole each time, the old one until the
    // switch, the new one after it.
    let probe = Probe::start(&db).await;
    let switched = activate(&db.pool, "doc_embeddings", Some(2), 0).await.unwrap();
    let answers = probe.stop().await;
    let mut shapes: Vec<Answer> = answers.iter().map(|a| a.clone().unwrap()).collect();
    shapes.dedup();
    assert_eq!(shapes, vec![(59, Some(768), Some(768)), (59, Some(256), Some(256))], "{answers:?}");
    assert_eq!((switched.active, switched.previous, switched.coverage.covered), (2, 1, 60));
    let states = |all: Vec<embed_dlq::store::revision::Revision>| {
        all.into_iter().map(|r| (r.revision, r.state)).collect::<Vec<_>>()
    };
    assert_eq!(
        states(list(&db.pool, None).await.unwrap()),
        vec![(1, "previous".to_string()), (2, "active".to_string())]
    );

    // A change after the switch reaches both (the previous one is kept in step for a
    // rollback), and the rollback is a switch like any other.
    let mut v2 = v1.clone();
    v2.extend(corpus("a", 5, "v2"));
    let fanout = s.fanout().await.unwrap().expect("two live revisions");
    assert_eq!(fanout.revisions[0].0.revision, 2, "the active revision first");
    for run in fanout.run(input(v2), CancellationToken::new()).await {
        assert_eq!(run.result.as_ref().unwrap().stored, 5, "{run:?}");
    }
    let back = activate(&db.pool, "doc_embeddings", None, 0).await.unwrap();
    assert_eq!((back.active, back.previous), (1, 2));
    let dims: i32 = sqlx::query_scalar("SELECT vector_dims(embedding) FROM doc_embeddings LIMIT 1")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(dims, 768);
    let changed = db.count("SELECT count(*) FROM doc_embeddings WHERE content_hash IN (SELECT content_hash FROM ingest_manifest WHERE target_table = 'public.doc_embeddings' AND chunk_index < 5)").await;
    assert_eq!(changed, 5);
    match activate(&db.pool, "doc_embeddings", Some(1), 0).await.unwrap_err() {
        RevisionError::NotSwitchable { state, .. } => assert_eq!(state, "active"),
        other => panic!("{other}"),
    }
}

/// The move to a new model as a user runs it: `revision create`, a refused `activate` (exit
/// 2, with the numbers), `revision backfill`, `revision list`, `activate`, `activate
/// --previous`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_revision_commands_move_a_target_to_a_new_model_and_back() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let dir = std::env::temp_dir().join(format!(
        "embed-dlq-revisions-{}-{}",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("corpus.jsonl");
    std::fs::write(&path, corpus("a", 80, "v1")).unwrap();
    let run = |args: &[&str]| {
        let mut c = binary();
        c.args(["--database-url", &db.url]).args(args);
        async move { c.output().await.unwrap() }
    };
    let provider = ["--base-url", &mock.base_url(), "--model", "mock", "--no-progress"];
    let path = path.to_str().unwrap();
    let out = run(&[&["ingest", path][..], &provider].concat()).await;
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));

    let out = run(&[
        "revision",
        "create",
        "--model",
        "mock-next",
        "--dimensions",
        "256",
        "--request-dimensions",
        "256",
    ])
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("doc_embeddings__r2"));
    let out = run(&["revision", "activate", "--revision", "2"]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("does not cover") && stderr.contains("80 of 80 chunks not covered"), "{stderr}");

    let out = run(&[&["revision", "backfill", path][..], &provider, &["--json"]].concat()).await;
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let per_revision: Vec<(i64, i64, i64)> = summary["revisions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let s = &r["summary"];
            (r["revision"].as_i64().unwrap(), s["stored"].as_i64().unwrap(), s["unchanged"].as_i64().unwrap())
        })
        .collect();
    // The shadow alone: a backfill copies what revision 1 holds and never writes it.
    assert_eq!(per_revision, vec![(2, 79, 0)], "{summary}");

    let out = run(&["revision", "list", "--json"]).await;
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let states: Vec<(i64, &str, i64)> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (r["revision"].as_i64().unwrap(), r["state"].as_str().unwrap(), r["dimensions"].as_i64().unwrap())
        })
        .collect();
    assert_eq!(states, vec![(1, "active", 768), (2, "shadow", 256)]);
    let covered: Vec<Option<i64>> =
        listed.as_array().unwrap().iter().map(|r| r["coverage"]["covered"].as_i64()).collect();
    assert_eq!(covered, vec![None, Some(80)], "{listed}");
    let out = run(&["revision", "list"]).await;
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("80/80 (100.0%)"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );

    let out = run(&["revision", "activate", "--revision", "2"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let dims = || async {
        sqlx::query_scalar::<_, i32>("SELECT vector_dims(embedding) FROM doc_embeddings LIMIT 1")
            .fetch_one(&db.pool)
            .await
            .unwrap()
    };
    assert_eq!(dims().await, 256);
    let out = run(&["revision", "activate", "--previous"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(dims().await, 768);
    let out = run(&["revision", "activate", "--revision", "9"]).await;
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));

    // Retiring: not the active revision, not without --yes; then the table and rows go.
    for (args, code) in [
        (&["revision", "retire", "--revision", "1", "--yes"][..], 2),
        (&["revision", "retire", "--revision", "2"][..], 2),
        (&["revision", "retire", "--revision", "2", "--yes"][..], 0),
    ] {
        let out = run(args).await;
        assert_eq!(out.status.code(), Some(code), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    assert_eq!(db.count("SELECT count(*) FROM pg_class WHERE relname = 'doc_embeddings__r2'").await, 0);
    assert_eq!(
        db.count("SELECT count(*) FROM ingest_manifest WHERE target_table = 'public.doc_embeddings__r2'")
            .await,
        0
    );
    assert_eq!(
        db.count("SELECT count(*) FROM embedding_dlq WHERE target_table = 'public.doc_embeddings__r2'").await,
        0
    );
    // Writes reach the active revision alone again, and its search is untouched.
    let out = run(&[&["ingest", path][..], &provider, &["--json"]].concat()).await;
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(summary.get("revisions").is_none(), "{summary}");
    assert_eq!(summary["unchanged"].as_i64(), Some(79), "{summary}");
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 79);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A shadow's failures park under its own identity with its own model; replay embeds each
/// row with its revision's model into its revision's relation; the reconciler checks both
/// revisions, each against its own relation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_revisions_parked_chunks_replay_into_it_and_the_reconciler_checks_each() {
    use embed_dlq::store::revision::create_shadow;
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let mock = start_mock(MockConfig::default()).await;
    let s = settings(&db, &mock);
    let v1 = (0..20).map(|i| line("d", i, &format!("d chunk {i} v1"))).collect::<String>().into_bytes();
    pipeline(&s).await.run(input(v1), CancellationToken::new()).await.unwrap();
    create_shadow(&db.pool, "doc_embeddings", Some("mock"), "mock-next", 256, Some(256)).await.unwrap();
    // A change while the provider is down: each revision parks it, under its identity.
    let down = start_mock(MockConfig::default()).await;
    down.control.set_outage(true);
    let mut sd = settings(&db, &down);
    sd.retry.max_attempts = 1;
    let v2 = (0..6).map(|i| line("d", i, &format!("d chunk {i} v2"))).collect::<String>().into_bytes();
    for run in sd.fanout().await.unwrap().unwrap().run(input(v2), CancellationToken::new()).await {
        assert_eq!(run.result.as_ref().unwrap().parked_total(), 6, "{run:?}");
    }
    let parked: Vec<(String, Option<String>, Option<i32>, i64)> = sqlx::query_as(
        "SELECT target_table, model, request_dimensions, count(*) FROM embedding_dlq GROUP BY 1, 2, 3 ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        parked,
        vec![
            ("public.doc_embeddings".into(), Some("mock".into()), None, 6),
            ("public.doc_embeddings__r2".into(), Some("mock-next".into()), Some(256), 6)
        ]
    );
    // The shadow has only the changed chunks missing (the other 14 never reached it).
    let store = replay_every_due_row(&db, &keys, &mock, 12).await;
    let shadow = hashes(&db, "doc_embeddings__r2").await;
    let want: std::collections::BTreeMap<_, _> = (0..6)
        .map(|i| (("d".to_string(), i), content_hash("mock-next", 256, &format!("d chunk {i} v2"))))
        .collect();
    assert_eq!(shadow, want, "the shadow's rows replayed with its model into its relation");
    let dims: Vec<i32> = sqlx::query_scalar("SELECT DISTINCT vector_dims(embedding) FROM doc_embeddings__r2")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(dims, vec![256]);
    let active = hashes(&db, "doc_embeddings__r1").await;
    assert!(
        (0..6)
            .all(|i| active[&("d".to_string(), i)] == content_hash("mock", 768, &format!("d chunk {i} v2")))
    );

    reconcile_finds_a_lost_vector(
        &db,
        store,
        keys,
        "doc_embeddings__r2",
        ("d", 3),
        "public.doc_embeddings__r2:d#3",
    )
    .await;
}

/// A backfill SIGKILLed halfway resumes where it stopped: the rerun embeds what is missing,
/// plus at most what was in flight at the kill, and the shadow then covers the active
/// revision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_backfill_resumes_where_it_stopped() {
    use embed_dlq::store::revision::{activate, create_shadow};
    const CHUNKS: i64 = 1_500;
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig { latency_ms: 15, ..MockConfig::default() }).await;
    let dir = std::env::temp_dir().join(format!(
        "embed-dlq-backfill-{}-{}",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("corpus.jsonl");
    let corpus_text: String = (0..CHUNKS as i32).map(|i| line("k", i, &format!("k chunk {i}"))).collect();
    std::fs::write(&path, corpus_text).unwrap();
    let path = path.to_str().unwrap().to_string();
    let backfill = |what: &str| {
        let mut c = binary();
        c.args(["--database-url", &db.url, what])
            .args(if what == "revision" { &["backfill"][..] } else { &[][..] })
            .arg(&path)
            .args(["--base-url", &mock.base_url(), "--model", "mock", "--no-progress"])
            .args(["--batch-max-inputs", "16", "--concurrency", "2", "--request-timeout-ms", "5000"]);
        c
    };
    let out = backfill("ingest").output().await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    create_shadow(&db.pool, "doc_embeddings", None, "mock-next", 256, Some(256)).await.unwrap();
    let before = mock.control.stats().inputs;

    let mut child = backfill("revision").stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    wait_for("the backfill's first 300 vectors", Duration::from_secs(120), async || {
        db.count("SELECT count(*) FROM doc_embeddings__r2").await >= 300
    })
    .await;
    child.start_kill().unwrap(); // SIGKILL
    child.wait().await.unwrap();
    // A COMMIT the server had read before the kill still lands: counted only once it has.
    killed_writers_gone(&db).await;
    let done = db.count("SELECT count(*) FROM doc_embeddings__r2").await;
    let sent_before_kill = mock.control.stats().inputs - before;
    assert!(done < CHUNKS, "killed in the middle: {done}");
    assert!(activate(&db.pool, "doc_embeddings", Some(2), 0).await.is_err(), "not covered yet");

    let out = backfill("revision").arg("--json").output().await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // The backfill writes the shadow alone.
    assert_eq!(summary["revisions"].as_array().map(Vec::len), Some(1), "{summary}");
    let shadow = &summary["revisions"][0]["summary"];
    assert_eq!(
        shadow["unchanged"].as_i64(),
        Some(done),
        "what the killed run stored is not embedded again: {summary}"
    );
    let sent_after = mock.control.stats().inputs - before - sent_before_kill;
    assert_eq!(sent_after, (CHUNKS - done) as u64, "the rerun sends each missing chunk once");
    // In flight at the kill: sent, not stored. At most what the two writers were gathering
    // (a 512-row statement each) and what the two workers held (a batch of 16 at the
    // provider, one done and one waiting for the writers' channel, each).
    let lost_in_flight = sent_before_kill - done as u64;
    let bound = 2 * 512 + 3 * 2 * 16;
    assert!(lost_in_flight <= bound, "{lost_in_flight} inputs were in flight at the kill (bound {bound})");
    let switched = activate(&db.pool, "doc_embeddings", Some(2), 0).await.unwrap();
    assert_eq!(switched.coverage.covered, CHUNKS as u64);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A target that is not the default table: its own schema and a name that needs quoting
/// (capitals, a space) go through adoption, a shadow, a fan-out ingest, the switch and the
/// retirement; out-of-bound inputs are refused before anything changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quoted_target_in_its_own_schema_moves_like_the_default_one() {
    use embed_dlq::store::revision::{activate, create_shadow, list, retire};
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    sqlx::query(r#"CREATE SCHEMA "Docs""#).execute(&db.pool).await.unwrap();
    embed_dlq::store::create_target_table(&db.pool, "Docs.My Chunks", 768).await.unwrap();
    let mut s = settings(&db, &mock);
    s.table = "Docs.My Chunks".into();
    let v1 = (0..30).map(|i| line("q", i, &format!("q chunk {i}"))).collect::<String>().into_bytes();
    assert_eq!(pipeline(&s).await.run(input(v1.clone()), CancellationToken::new()).await.unwrap().stored, 30);

    for (model, dims, why) in
        [("", 8, "model name"), (&"m".repeat(257)[..], 8, "model name"), ("m", 16_001, "dimensions")]
    {
        let e =
            create_shadow(&db.pool, "Docs.My Chunks", None, model, dims, None).await.unwrap_err().to_string();
        assert!(e.contains(why), "{e}");
    }
    let shadow = create_shadow(&db.pool, "Docs.My Chunks", None, "mock-next", 64, Some(64)).await.unwrap();
    assert_eq!(
        (shadow.target.as_str(), shadow.relation.as_str()),
        (r#""Docs"."My Chunks""#, r#""Docs"."My Chunks__r2""#)
    );
    for run in s.fanout().await.unwrap().unwrap().run(input(v1), CancellationToken::new()).await {
        let summary = run.result.unwrap();
        assert_eq!(summary.stored + summary.unchanged, 30, "{summary:?}");
    }
    activate(&db.pool, "Docs.My Chunks", Some(2), 0).await.unwrap();
    let dims: Vec<i32> =
        sqlx::query_scalar(r#"SELECT DISTINCT vector_dims(embedding) FROM "Docs"."My Chunks""#)
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(dims, vec![64]);
    let retired = retire(&db.pool, "Docs.My Chunks", 1).await.unwrap();
    assert_eq!((retired.relation.as_str(), retired.manifest_rows), (r#""Docs"."My Chunks__r1""#, 30));
    let states: Vec<(i32, String)> = list(&db.pool, Some("Docs.My Chunks"))
        .await
        .unwrap()
        .into_iter()
        .map(|r| (r.revision, r.state))
        .collect();
    assert_eq!(states, vec![(1, "retired".to_string()), (2, "active".to_string())]);
    assert_eq!(db.count(r#"SELECT count(*) FROM "Docs"."My Chunks""#).await, 30);
    // The default table was never touched.
    assert_eq!(db.count("SELECT count(*) FROM pg_class WHERE relname LIKE 'doc_embeddings__r%'").await, 0);
}

/// A table embedded with a `dimensions` request parameter keeps it once adopted with a
/// recorded model: `revision create --active-model M` records revision 1's model but not the
/// parameter its writers send, and every writer of revision 1 then sent none, so the provider
/// answered its native size (the mock 768, against a 256-dimension table) and every ingest of
/// the active revision stopped on `dimension_mismatch` (found by the migration bench: serve's
/// source failed and restarted in a loop). Revision 1's writers now send their own configured
/// parameter unless the registry records one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopted_table_keeps_its_dimensions_request_parameter() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let dir = std::env::temp_dir().join(format!(
        "embed-dlq-reqdims-{}-{}",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let run = |args: Vec<String>| {
        let mut c = binary();
        c.args(["--database-url", &db.url]).args(args);
        async move {
            let out = c.output().await.unwrap();
            assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        }
    };
    let s = |v: &[&str]| v.iter().map(|a| a.to_string()).collect::<Vec<_>>();
    let text = |i: i32, v: &str| format!("small chunk {i} {v}");
    let write = |v: &str| {
        let path = dir.join(format!("{v}.jsonl"));
        std::fs::write(&path, (0..20).map(|i| line("s", i, &text(i, v))).collect::<String>()).unwrap();
        path.to_str().unwrap().to_string()
    };
    let ingest = |path: String| {
        s(&[
            "ingest",
            &path,
            "--table",
            "small",
            "--model",
            "mock",
            "--request-dimensions",
            "256",
            "--no-progress",
        ])
    };
    let provider = ["--base-url", &mock.base_url()];
    run(s(&["migrate", "--table", "small", "--dimensions", "256"])).await;
    run([ingest(write("v1")), s(&provider)].concat()).await;
    run(s(&[
        "revision",
        "create",
        "--target",
        "small",
        "--active-model",
        "mock",
        "--model",
        "mock-next",
        "--dimensions",
        "384",
        "--request-dimensions",
        "384",
    ]))
    .await;
    run([ingest(write("v2")), s(&provider)].concat()).await;
    let (r1, r2) = (hashes(&db, "small__r1").await, hashes(&db, "small__r2").await);
    for i in 0..20 {
        let key = ("s".to_string(), i);
        assert_eq!(r1.get(&key), Some(&content_hash("mock", 256, &text(i, "v2"))), "revision 1 s#{i}");
        assert_eq!(r2.get(&key), Some(&content_hash("mock-next", 384, &text(i, "v2"))), "revision 2 s#{i}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A backfill beside a live writer of the shadow (`serve` writing every revision, or any other
/// run holding leases there) finishes every chunk the active revision holds: it takes no
/// leases and leaves nothing to the other writer, whose lease only saves calls (every write
/// is fenced by its record's position, and the backfill's by the active record's). It used to
/// leave such chunks "to a concurrent run" and exit 7, a rerun every time serve was alive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backfill_beside_a_live_writer_of_the_shadow_finishes_every_chunk() {
    use embed_dlq::store::revision::{activate, create_shadow};
    const CHUNKS: i32 = 200;
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let dir = std::env::temp_dir().join(format!(
        "embed-dlq-backfill-beside-{}-{}",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let text = |i: i32| format!("beside chunk {i}");
    let path = dir.join("corpus.jsonl");
    std::fs::write(&path, (0..CHUNKS).map(|i| line("b", i, &text(i))).collect::<String>()).unwrap();
    let path = path.to_str().unwrap().to_string();
    let run = |what: &[&str]| {
        let mut c = binary();
        c.args(["--database-url", &db.url]).args(what).arg(&path).args([
            "--base-url",
            &mock.base_url(),
            "--model",
            "mock",
            "--no-progress",
            "--json",
        ]);
        c
    };
    let out = run(&["ingest"]).output().await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    create_shadow(&db.pool, "doc_embeddings", None, "mock-next", 256, Some(256)).await.unwrap();

    // Another live run holds the shadow's leases of the first 20 chunks, for the very content
    // the backfill embeds, unexpired.
    let (holder, live) = crate::leases::another_live_run(&db).await;
    for i in 0..20 {
        sqlx::query(
            "INSERT INTO ingest_lease (target_table, doc_id, chunk_index, content_hash, source_seq, run_id, expires_at)
             VALUES ('public.doc_embeddings__r2', 'b', $1, $2, ($3::bigint << 32) | $1, $3, now() + interval '1 hour')",
        )
        .bind(i)
        .bind(content_hash("mock-next", 256, &text(i)))
        .bind(live)
        .execute(&db.pool)
        .await
        .unwrap();
    }
    let before = mock.control.stats().inputs;
    let out = run(&["revision", "backfill"]).output().await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let shadow = &summary["revisions"][0]["summary"];
    assert_eq!(shadow["stored"].as_i64(), Some(CHUNKS as i64), "{summary}");
    assert_eq!(shadow["leased_elsewhere"].as_i64(), Some(0), "{summary}");
    assert_eq!(mock.control.stats().inputs - before, CHUNKS as u64, "each chunk sent once");
    let r2 = hashes(&db, "doc_embeddings__r2").await;
    for i in 0..CHUNKS {
        assert_eq!(r2.get(&("b".to_string(), i)), Some(&content_hash("mock-next", 256, &text(i))), "b#{i}");
    }
    let switched = activate(&db.pool, "doc_embeddings", Some(2), 0).await.unwrap();
    assert_eq!(switched.coverage.covered, CHUNKS as u64);
    sqlx::Connection::close(holder).await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A query of the name that runs long (a report, a stuck transaction) never makes the switch
/// hold every other query of the name behind it: Postgres queues a lock request behind the
/// locks already held and every later request behind it, so a replace of the view that simply
/// waited for the long reader stopped all searches for as long as the reader ran. Each attempt
/// now waits a moment and gives the name back; queries keep being answered (by the active
/// revision) while the reader runs, and the switch goes through once it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_reader_of_the_name_never_holds_the_other_queries_behind_a_switch() {
    use embed_dlq::store::revision::{activate, create_shadow};
    use sqlx::Connection;
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let s = settings(&db, &mock);
    pipeline(&s).await.run(input(corpus("l", 40, "v1")), CancellationToken::new()).await.unwrap();
    create_shadow(&db.pool, "doc_embeddings", Some("mock"), "mock-next", 256, Some(256)).await.unwrap();
    let runs =
        s.fanout().await.unwrap().unwrap().run(input(corpus("l", 40, "v1")), CancellationToken::new()).await;
    assert!(runs.iter().all(|r| r.result.is_ok()), "{runs:?}");

    // The long reader: a transaction that read the name and stays open.
    let mut reader = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut reader).await.unwrap();
    let read: i64 =
        sqlx::query_scalar("SELECT count(*) FROM doc_embeddings").fetch_one(&mut reader).await.unwrap();
    assert_eq!(read, 40);
    let switch = {
        let pool = db.pool.clone();
        tokio::spawn(async move { activate(&pool, "doc_embeddings", Some(2), 0).await })
    };
    // The switch is trying for the view's lock (its replace shows in pg_stat_activity).
    wait_for("the switch's replace of the view", Duration::from_secs(60), async || {
        db.count(
            "SELECT count(*) FROM pg_stat_activity
              WHERE query LIKE 'CREATE OR REPLACE VIEW%' AND datname = current_database()",
        )
        .await
            > 0
    })
    .await;
    let searches = embed_dlq::store::connect(&db.url, 1).await.unwrap();
    for n in 0..20 {
        // A guard against the hang this test is about, not a measure of speed.
        let answered = tokio::time::timeout(
            Duration::from_secs(30),
            sqlx::query_scalar::<_, i32>("SELECT max(vector_dims(embedding)) FROM doc_embeddings")
                .fetch_one(&searches),
        )
        .await;
        let dims = answered.unwrap_or_else(|_| panic!("query {n} of the name waited behind the switch"));
        assert_eq!(dims.unwrap(), 768, "the active revision answers until the switch");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!switch.is_finished(), "the switch waits for the reader, which reads one revision whole");
    let again: i64 =
        sqlx::query_scalar("SELECT count(*) FROM doc_embeddings").fetch_one(&mut reader).await.unwrap();
    assert_eq!(again, 40);
    sqlx::query("COMMIT").execute(&mut reader).await.unwrap();
    let switched = switch.await.unwrap().unwrap();
    assert_eq!(switched.active, 2);
    let dims: i32 = sqlx::query_scalar("SELECT max(vector_dims(embedding)) FROM doc_embeddings")
        .fetch_one(&searches)
        .await
        .unwrap();
    assert_eq!(dims, 256, "revision 2 answers after the switch");
}

/// The shadow's provider runs out of quota in the middle of a backfill (OpenAI's 429
/// `insufficient_quota`): the backfill stops with the provider's refusal (exit 4), no chunk is
/// parked for it in either revision, the active revision is untouched, and once the quota is
/// back a rerun copies the rest, each chunk the shadow still missed sent once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backfill_whose_provider_runs_out_of_quota_stops_charges_nothing_and_resumes() {
    use embed_dlq::store::revision::{activate, create_shadow};
    const CHUNKS: i64 = 1_500;
    let db = TestDb::new().await;
    let fast = start_mock(MockConfig::default()).await;
    let corpus_bytes = corpus("q", CHUNKS as i32, "v1");
    let dir = std::env::temp_dir().join(format!(
        "embed-dlq-quota-{}-{}",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("dump.jsonl");
    std::fs::write(&path, &corpus_bytes).unwrap();
    let first = pipeline(&settings(&db, &fast))
        .await
        .run(input(corpus_bytes), CancellationToken::new())
        .await
        .unwrap();
    create_shadow(&db.pool, "doc_embeddings", Some("mock"), "mock-next", 256, Some(256)).await.unwrap();
    let r1_before = hashes(&db, "doc_embeddings__r1").await;
    let dlq_before = db.count("SELECT count(*) FROM embedding_dlq").await;
    let shadow_mock = start_mock(MockConfig { latency_ms: 15, ..MockConfig::default() }).await;
    let backfill = || {
        let mut c = binary();
        c.args(["--database-url", &db.url, "revision", "backfill"])
            .arg(&path)
            .args(["--base-url", &shadow_mock.base_url(), "--model", "mock", "--no-progress", "--json"])
            .args(["--batch-max-inputs", "16", "--concurrency", "2", "--request-timeout-ms", "5000"]);
        c
    };
    let child = backfill().stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    wait_for("the backfill's first 300 vectors", Duration::from_secs(120), async || {
        db.count("SELECT count(*) FROM doc_embeddings__r2").await >= 300
    })
    .await;
    shadow_mock.control.set_quota_exhausted(true);
    let out = child.wait_with_output().await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "the provider refused the run: {stderr}");
    assert!(stderr.contains("quota"), "{stderr}");
    // What the shadow parked before the refusal is its poison inputs (rejected with 400, as in
    // revision 1), nothing for the refusal.
    let refused = db
        .count(
            "SELECT count(*) FROM embedding_dlq
              WHERE target_table = 'public.doc_embeddings__r2' AND error_class <> 'permanent_input'",
        )
        .await;
    assert_eq!(refused, 0, "nothing parked for the refusal");
    let active_rows = "SELECT count(*) FROM embedding_dlq WHERE target_table = 'public.doc_embeddings'";
    assert_eq!(db.count(active_rows).await, dlq_before, "revision 1's DLQ untouched");
    assert_eq!(hashes(&db, "doc_embeddings__r1").await, r1_before, "the active revision is untouched");
    let done = db.count("SELECT count(*) FROM doc_embeddings__r2").await;
    assert!(done < first.stored as i64, "stopped in the middle: {done}");

    shadow_mock.control.set_quota_exhausted(false);
    let parked_in_shadow =
        db.count("SELECT count(*) FROM embedding_dlq WHERE target_table = 'public.doc_embeddings__r2'").await;
    let out = backfill().output().await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let shadow = &summary["revisions"][0]["summary"];
    // Nothing the first run settled is sent again: what it stored is unchanged, what it parked
    // (poison) already parked; the rest is stored now.
    assert_eq!(shadow["unchanged"].as_i64(), Some(done), "{summary}");
    assert_eq!(shadow["already_parked"].as_i64(), Some(parked_in_shadow), "{summary}");
    assert_eq!(shadow["stored"].as_i64(), Some(first.stored as i64 - done), "{summary}");
    let r2 = hashes(&db, "doc_embeddings__r2").await;
    assert_eq!(r2.len() as u64, first.stored);
    let switched = activate(&db.pool, "doc_embeddings", Some(2), 0).await.unwrap();
    assert_eq!(switched.coverage.uncovered(), 0);
    let _ = std::fs::remove_dir_all(&dir);
}
