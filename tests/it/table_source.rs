//! A Postgres table as the source (issue 47): the follower's snapshot and changes against an
//! oracle of the test's own (the table's rows, the mock's deterministic vectors), never the
//! product's SQL.

use std::collections::HashMap;
use std::time::Duration;

use embed_dlq::ingest::table::FollowOptions;
use embed_dlq::store::table_source::{self, TableSourceSpec};
use embed_dlq::testkit::mock_provider::{self, MockConfig};
use tokio_util::sync::CancellationToken;

use crate::support::*;

const DIMS: usize = 768;

/// The source table of these tests: `views` is not embedded.
async fn create_documents(db: &TestDb, rows: i64) {
    sqlx::raw_sql(
        "CREATE TABLE documents (id bigint PRIMARY KEY, title text NOT NULL, body text, views integer NOT NULL DEFAULT 0)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO documents (id, title, body)
         SELECT i, 'title ' || i, 'body of document ' || i FROM generate_series(1, $1) AS i",
    )
    .bind(rows)
    .execute(&db.pool)
    .await
    .unwrap();
}

fn spec() -> TableSourceSpec {
    TableSourceSpec {
        name: "docs".into(),
        table: "documents".into(),
        key_column: "id".into(),
        chunk_column: None,
        template: "{title}\n\n{body}".into(),
        metadata_columns: vec!["views".into()],
        target_table: "doc_embeddings".into(),
        chunking: None,
    }
}

/// The oracle: every row's expected text (the test's own rendering of the template), and
/// whether the vector table holds exactly one vector per row, each the mock's vector of
/// that text. Returns the first disagreement.
async fn disagreement(db: &TestDb) -> Option<String> {
    let rows: Vec<(i64, String, Option<String>)> =
        sqlx::query_as("SELECT id, title, body FROM documents").fetch_all(&db.pool).await.unwrap();
    let want: HashMap<String, String> = rows
        .into_iter()
        .map(|(id, title, body)| (id.to_string(), format!("{title}\n\n{}", body.unwrap_or_default())))
        .collect();
    let got: Vec<(String, i32, pgvector::Vector)> =
        sqlx::query_as("SELECT doc_id, chunk_index, embedding FROM doc_embeddings")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    if got.len() != want.len() {
        let have: std::collections::HashSet<&String> = got.iter().map(|g| &g.0).collect();
        let mut missing: Vec<(&String, &String)> = want.iter().filter(|(d, _)| !have.contains(d)).collect();
        missing.sort();
        missing.truncate(5);
        return Some(format!("{} vectors for {} rows; without a vector: {missing:?}", got.len(), want.len()));
    }
    for (doc, idx, v) in got {
        let Some(text) = want.get(&doc) else { return Some(format!("a vector for {doc}, which has no row")) };
        if idx != 0 {
            return Some(format!("{doc} has chunk {idx}"));
        }
        let expected = mock_provider::vector_for(text, DIMS);
        let max = v.to_vec().iter().zip(&expected).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        if max > 1e-6 {
            return Some(format!("{doc}: a stale vector (not the one of {text:?})"));
        }
    }
    None
}

/// Waits until the oracle agrees (or panics with its last disagreement after 60 s).
async fn until_in_sync(db: &TestDb) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let Some(why) = disagreement(db).await else { return };
        assert!(tokio::time::Instant::now() < deadline, "never in sync: {why}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_source_snapshots_the_table_then_follows_inserts_updates_and_deletes() {
    // 2,500 rows: three snapshot pages (the first version's pages were cut in string order
    // of the key and lost 899 rows).
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    create_documents(&db, 2_500).await;
    let source = table_source::add_table(&db.pool, &spec()).await.unwrap();
    let s = settings(&db, &mock);
    let p = pipeline(&s).await;
    let cancel = CancellationToken::new();
    let follower = {
        let (p, source, cancel) = (p.clone(), source.clone(), cancel.clone());
        tokio::spawn(async move { p.follow_table(&source, FollowOptions::default(), cancel).await })
    };
    until_in_sync(&db).await;

    // Edits, deletes and inserts, in several transactions, one of them moving a key.
    sqlx::raw_sql(
        "UPDATE documents SET body = 'edited ' || id WHERE id % 10 = 0;
         DELETE FROM documents WHERE id % 25 = 1;
         INSERT INTO documents (id, title, body) SELECT i, 'new ' || i, NULL FROM generate_series(9001, 9020) AS i;
         BEGIN; UPDATE documents SET id = 50000 WHERE id = 7; UPDATE documents SET title = 'twice' WHERE id = 8;
                UPDATE documents SET title = 'twice, again' WHERE id = 8; COMMIT;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    until_in_sync(&db).await;

    // An update of a column that is not embedded makes no provider call: the next embedded
    // change, applied after it, is the only request.
    let before = mock.control.stats();
    sqlx::raw_sql("UPDATE documents SET views = views + 1").execute(&db.pool).await.unwrap();
    sqlx::raw_sql("UPDATE documents SET body = 'the last edit' WHERE id = 2")
        .execute(&db.pool)
        .await
        .unwrap();
    until_in_sync(&db).await;
    let after = mock.control.stats();
    assert_eq!(after.inputs - before.inputs, 1, "only the edited row was sent: {after:?}");

    cancel.cancel();
    let summary = follower.await.unwrap().unwrap();
    assert_eq!(summary.snapshots, 1);
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncate_of_the_source_table_empties_the_vectors_only_when_confirmed() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    create_documents(&db, 50).await;
    let source = table_source::add_table(&db.pool, &spec()).await.unwrap();
    let p = pipeline(&settings(&db, &mock)).await;
    let idle = FollowOptions { idle_exit: Some(Duration::from_millis(300)), ..FollowOptions::default() };
    p.follow_table(&source, idle.clone(), CancellationToken::new()).await.unwrap();
    until_in_sync(&db).await;
    sqlx::raw_sql("TRUNCATE documents").execute(&db.pool).await.unwrap();
    let refused = p.follow_table(&source, idle.clone(), CancellationToken::new()).await;
    assert!(refused.is_err(), "a resync deleting every vector needs --yes: {refused:?}");
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 50, "nothing deleted unconfirmed");
    sqlx::raw_sql("INSERT INTO documents (id, title, body) VALUES (1, 'after the truncate', 'x')")
        .execute(&db.pool)
        .await
        .unwrap();
    let confirmed = FollowOptions { confirmed: true, ..idle };
    p.follow_table(&source, confirmed, CancellationToken::new()).await.unwrap();
    until_in_sync(&db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_follower_of_a_source_is_refused_and_bad_specs_are_explained() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    create_documents(&db, 5).await;
    let source = table_source::add_table(&db.pool, &spec()).await.unwrap();
    let p = pipeline(&settings(&db, &mock)).await;
    let cancel = CancellationToken::new();
    let first = {
        let (p, source, cancel) = (p.clone(), source.clone(), cancel.clone());
        tokio::spawn(async move { p.follow_table(&source, FollowOptions::default(), cancel).await })
    };
    until_in_sync(&db).await;
    let second = p.follow_table(&source, FollowOptions::default(), CancellationToken::new()).await;
    assert!(second.unwrap_err().to_string().contains("another follower"));
    let removed = table_source::remove_table(&db.pool, &source).await.unwrap_err().to_string();
    assert!(removed.contains("another follower holds"), "{removed}");
    cancel.cancel();
    first.await.unwrap().unwrap();

    for (bad, why) in [
        (TableSourceSpec { name: "Bad Name".into(), ..spec() }, "source name"),
        (TableSourceSpec { name: "other".into(), table: "nope".into(), ..spec() }, "no table"),
        (
            TableSourceSpec { name: "other".into(), template: "{missing}".into(), ..spec() },
            "no column missing",
        ),
        (
            TableSourceSpec { name: "other".into(), chunk_column: Some("title".into()), ..spec() },
            "not integer",
        ),
        (TableSourceSpec { name: "other".into(), template: "plain".into(), ..spec() }, "placeholder"),
        (spec(), "exists"),
    ] {
        let e = table_source::add_table(&db.pool, &bad).await.unwrap_err().to_string();
        assert!(e.contains(why), "{e}");
    }
    // A dropped trigger is seen, never a silent stop.
    assert!(table_source::missing_triggers(&db.pool, &source).await.unwrap().is_empty());
    sqlx::raw_sql("DROP TRIGGER embed_dlq_docs_update ON documents").execute(&db.pool).await.unwrap();
    assert_eq!(
        table_source::missing_triggers(&db.pool, &source).await.unwrap(),
        vec!["embed_dlq_docs_update"]
    );
    let listed = binary().args(["source", "list", "--database-url", &db.url]).output().await.unwrap();
    assert_eq!(listed.status.code(), Some(5), "{}", String::from_utf8_lossy(&listed.stdout));
    let checked = binary().args(["reconcile", "--database-url", &db.url]).output().await.unwrap();
    let report = String::from_utf8_lossy(&checked.stdout);
    assert_eq!(checked.status.code(), Some(5), "{report}");
    assert!(
        report.contains("table_source_triggers") && report.contains("docs: embed_dlq_docs_update"),
        "{report}"
    );
    let repaired =
        binary().args(["reconcile", "--repair", "--database-url", &db.url]).output().await.unwrap();
    assert!(repaired.status.success() || repaired.status.code() == Some(5), "{repaired:?}");
    assert!(table_source::missing_triggers(&db.pool, &source).await.unwrap().is_empty(), "reinstalled");
    let after = table_source::load(&db.pool, "docs").await.unwrap();
    assert!(
        !after.snapshot_done && after.resync_full,
        "what changed without the trigger is caught up by a resync"
    );
    // An edit made while the trigger was gone reaches the vectors through that resync.
    sqlx::raw_sql(
        "DROP TRIGGER embed_dlq_docs_update ON documents; UPDATE documents SET body = 'unseen' WHERE id = 3",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let s = table_source::load(&db.pool, "docs").await.unwrap();
    table_source::repair_triggers(&db.pool, &s).await.unwrap();
    let idle = FollowOptions {
        idle_exit: Some(Duration::from_millis(300)),
        confirmed: true,
        ..FollowOptions::default()
    };
    p.follow_table(&s, idle, CancellationToken::new()).await.unwrap();
    assert_eq!(disagreement(&db).await, None);

    // Removed (no follower now): its triggers are gone from the catalog, a write queues
    // nothing, the vectors stay, and the name is free again.
    let removed =
        binary().args(["source", "remove", "docs", "--database-url", &db.url]).output().await.unwrap();
    assert!(removed.status.success(), "{removed:?}");
    assert_eq!(
        db.count("SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'embed_dlq_docs_%'").await,
        0,
        "its triggers are dropped"
    );
    sqlx::raw_sql("UPDATE documents SET body = 'after the removal' WHERE id = 4")
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(db.count("SELECT count(*) FROM embed_table_changes").await, 0, "nothing queued");
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 5, "the vectors stay");
    table_source::add_table(&db.pool, &spec()).await.unwrap();
}

/// The follower SIGKILLed eight times at random moments while a writer edits, deletes and
/// inserts rows and bumps a column that is not embedded: once the writer stops and a last
/// follower drains the queue, every row has exactly its final text's vector, nothing is
/// parked, and nothing was lost to a kill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_killed_again_and_again_under_live_writes_loses_nothing_and_keeps_nothing_stale() {
    use rand::RngExt;
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    create_documents(&db, 2_000).await;
    let added = binary()
        .args(["source", "add-table", "docs", "--table", "documents", "--key", "id"])
        .args(["--text", r"{title}\n\n{body}", "--metadata", "views", "--database-url", &db.url])
        .output()
        .await
        .unwrap();
    assert!(added.status.success(), "{}", String::from_utf8_lossy(&added.stderr));
    let follower = |idle: Option<&str>| {
        let mut c = binary();
        c.args(["ingest", "--from-table", "docs", "--database-url", &db.url, "--base-url", &mock.base_url()])
            .args([
                "--model",
                "mock",
                "--retry-base-ms",
                "5",
                "--retry-cap-ms",
                "50",
                "--batch-max-inputs",
                "32",
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped());
        if let Some(ms) = idle {
            c.args(["--idle-exit-ms", ms]).stdout(std::process::Stdio::piped());
        }
        c
    };
    let stop = CancellationToken::new();
    let writer = {
        let (pool, stop) = (db.pool.clone(), stop.clone());
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.is_cancelled() {
                n += 1;
                let id = rand::random_range(1..2_100i64);
                let sql = match n % 6 {
                    0 => "UPDATE documents SET views = views + 1 WHERE id % 7 = $1 % 7".to_string(),
                    1 => "DELETE FROM documents WHERE id = $1".to_string(),
                    2 => "INSERT INTO documents (id, title, body) VALUES ($1, 'back ' || $1, 'again') ON CONFLICT (id) DO UPDATE SET title = 'conflict ' || $1".to_string(),
                    _ => format!("UPDATE documents SET body = 'version {n} of ' || id WHERE id = $1 OR id = $1 + 1"),
                };
                sqlx::query(sqlx::AssertSqlSafe(sql)).bind(id).execute(&pool).await.unwrap();
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            n
        })
    };
    for _ in 0..8 {
        let mut child = follower(None).spawn().unwrap();
        let ms = rand::rng().random_range(300..1_500);
        tokio::time::sleep(Duration::from_millis(ms)).await;
        child.kill().await.unwrap();
    }
    stop.cancel();
    let writes = writer.await.unwrap();
    killed_writers_gone(&db).await;
    let last = follower(Some("1000")).output().await.unwrap();
    assert!(last.status.success(), "{}", String::from_utf8_lossy(&last.stderr));
    if let Some(why) = disagreement(&db).await {
        eprintln!("{}", String::from_utf8_lossy(&last.stdout));
        panic!("after {writes} writes and 8 kills: {why}");
    }
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
    assert_eq!(db.count("SELECT count(*) FROM embed_table_changes").await, 0, "the queue was drained");
}

/// The chunk size of the document table below, in characters.
const ARTICLE_CHUNK: usize = 200;

/// A document of `paragraphs` paragraphs, its words depending on `id` and `version`.
fn article(id: i64, paragraphs: i64, version: &str) -> String {
    (0..paragraphs)
        .map(|p| {
            format!("Paragraph {p} of article {id} ({version}) says something about topic {}.", (id + p) % 7)
        })
        .collect::<Vec<_>>()
        .join("\n\n")
}

/// The test's own cut of every row of `articles` (text-splitter, configured as the source
/// is), keyed by document and chunk index.
async fn article_chunks(db: &TestDb) -> HashMap<(String, i32), String> {
    let splitter = text_splitter::TextSplitter::new(ARTICLE_CHUNK);
    let rows: Vec<(i64, String, String)> =
        sqlx::query_as("SELECT id, title, body FROM articles").fetch_all(&db.pool).await.unwrap();
    let mut want = HashMap::new();
    for (id, title, body) in rows {
        let text = format!("{title}\n\n{body}");
        for (i, chunk) in splitter.chunks(&text).enumerate() {
            want.insert((id.to_string(), i as i32), chunk.to_owned());
        }
    }
    want
}

/// Whether the vector table holds exactly the chunks of [`article_chunks`], each the mock's
/// vector of its text; the first disagreement otherwise.
async fn article_disagreement(db: &TestDb) -> Option<String> {
    let want = article_chunks(db).await;
    let got: Vec<(String, i32, pgvector::Vector)> =
        sqlx::query_as("SELECT doc_id, chunk_index, embedding FROM doc_embeddings")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let mut extra = 0;
    for (doc, idx, v) in &got {
        let Some(text) = want.get(&(doc.clone(), *idx)) else {
            extra += 1;
            continue;
        };
        let expected = mock_provider::vector_for(text, DIMS);
        let max = v.to_vec().iter().zip(&expected).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        if max > 1e-6 {
            return Some(format!("{doc}/{idx}: a stale vector (not the one of {text:?})"));
        }
    }
    (extra > 0 || got.len() != want.len())
        .then(|| format!("{} vectors for {} chunks, {extra} of them for no chunk", got.len(), want.len()))
}

async fn until_articles_in_sync(db: &TestDb) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let Some(why) = article_disagreement(db).await else { return };
        assert!(tokio::time::Instant::now() < deadline, "never in sync: {why}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// How many chunks of `after` differ from `before`'s chunk of the same document and index:
/// what an edit should cost in provider inputs.
fn changed_chunks(before: &HashMap<(String, i32), String>, after: &HashMap<(String, i32), String>) -> u64 {
    after.iter().filter(|(key, text)| before.get(*key) != Some(*text)).count() as u64
}

/// A table of whole documents, cut into chunks of 200 characters: the snapshot stores every
/// chunk; an edit at a document's end sends only the chunks whose text changed; a document
/// cut shorter loses its trailing chunks; an update of a column that is not embedded sends
/// nothing; a deleted row loses every chunk; an empty document is parked, not dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_document_table_is_cut_into_chunks_and_an_edit_sends_only_the_chunks_it_changed() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    sqlx::raw_sql(
        "CREATE TABLE articles (id bigint PRIMARY KEY, title text NOT NULL, body text NOT NULL, views integer NOT NULL DEFAULT 0)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    for id in 1..=120i64 {
        sqlx::query("INSERT INTO articles (id, title, body) VALUES ($1, $2, $3)")
            .bind(id)
            .bind(format!("Article {id}"))
            .bind(article(id, 3 + id % 12, "v1"))
            .execute(&db.pool)
            .await
            .unwrap();
    }
    let spec = TableSourceSpec {
        name: "articles".into(),
        table: "articles".into(),
        metadata_columns: vec![],
        chunking: Some(table_source::Chunking {
            unit: table_source::ChunkUnit::Chars,
            size: ARTICLE_CHUNK as u32,
            overlap: 0,
            markdown: false,
        }),
        ..spec()
    };
    let bad = TableSourceSpec { name: "bad".into(), chunk_column: Some("views".into()), ..spec.clone() };
    let refused = table_source::add_table(&db.pool, &bad).await.unwrap_err().to_string();
    assert!(refused.contains("chunk column"), "{refused}");
    let source = table_source::add_table(&db.pool, &spec).await.unwrap();
    let p = pipeline(&settings(&db, &mock)).await;
    let cancel = CancellationToken::new();
    let follower = {
        let (p, source, cancel) = (p.clone(), source.clone(), cancel.clone());
        tokio::spawn(async move { p.follow_table(&source, FollowOptions::default(), cancel).await })
    };
    until_articles_in_sync(&db).await;
    let first = article_chunks(&db).await;
    assert!(first.len() > 240, "{} chunks: most documents are several", first.len());
    assert_eq!(mock.control.stats().inputs, first.len() as u64, "each chunk sent once");

    // A sentence added at the end of 30 documents: only the chunks it changed are sent.
    let before = article_chunks(&db).await;
    let sent = mock.control.stats().inputs;
    sqlx::raw_sql("UPDATE articles SET body = body || ' One more closing sentence.' WHERE id % 4 = 0")
        .execute(&db.pool)
        .await
        .unwrap();
    until_articles_in_sync(&db).await;
    let after = article_chunks(&db).await;
    let changed = changed_chunks(&before, &after);
    assert!((30..90).contains(&changed), "{changed} chunks changed by the edit");
    assert_eq!(mock.control.stats().inputs - sent, changed, "only the changed chunks were sent");

    // 30 documents cut to two paragraphs: their trailing chunks go, the rest is skipped.
    let before = after;
    let sent = mock.control.stats().inputs;
    for id in (1..=120i64).filter(|id| id % 4 == 1) {
        sqlx::query("UPDATE articles SET body = $2 WHERE id = $1")
            .bind(id)
            .bind(article(id, 2, "v1"))
            .execute(&db.pool)
            .await
            .unwrap();
    }
    until_articles_in_sync(&db).await;
    let after = article_chunks(&db).await;
    assert!(after.len() < before.len() - 30, "{} chunks after, {} before", after.len(), before.len());
    assert_eq!(mock.control.stats().inputs - sent, changed_chunks(&before, &after));

    // Views only, then one edit: the edit's chunks are the only inputs.
    let before = after;
    let sent = mock.control.stats().inputs;
    sqlx::raw_sql("UPDATE articles SET views = views + 1").execute(&db.pool).await.unwrap();
    sqlx::raw_sql("UPDATE articles SET title = 'Renamed' WHERE id = 3").execute(&db.pool).await.unwrap();
    until_articles_in_sync(&db).await;
    let after = article_chunks(&db).await;
    let changed = changed_chunks(&before, &after);
    assert!(changed >= 1);
    assert_eq!(mock.control.stats().inputs - sent, changed, "a views update sent nothing");

    // Deleted rows lose every chunk; an empty document is parked, never silently dropped.
    sqlx::raw_sql("DELETE FROM articles WHERE id % 10 = 7").execute(&db.pool).await.unwrap();
    until_articles_in_sync(&db).await;
    sqlx::raw_sql("INSERT INTO articles (id, title, body) VALUES (500, '', '')")
        .execute(&db.pool)
        .await
        .unwrap();
    wait_for("the empty document parked", Duration::from_secs(30), async || {
        db.count("SELECT count(*) FROM embedding_dlq WHERE doc_id = '500' AND chunk_index = 0").await == 1
    })
    .await;
    cancel.cancel();
    follower.await.unwrap().unwrap();
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq WHERE doc_id <> '500'").await, 0);
}

/// A target with a shadow revision: the follower writes every change into both revisions,
/// each with its own model (the shadow at 256 dimensions), deletes from both, and stops
/// writing a revision once it is retired. Before the fan-out it wrote the target's table
/// alone, so a revision switched to after a backfill lacked every change made meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_source_writes_every_live_revision_of_its_target() {
    use embed_dlq::model::content_hash;
    use embed_dlq::store::revision::create_shadow;
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    create_documents(&db, 40).await;
    let source = table_source::add_table(&db.pool, &spec()).await.unwrap();
    let s = settings(&db, &mock);
    let idle = FollowOptions { idle_exit: Some(Duration::from_millis(300)), ..FollowOptions::default() };
    let follow = async || {
        let targets = s.source_targets();
        embed_dlq::ingest::table::follow_table(&targets, &source, idle.clone(), CancellationToken::new())
            .await
            .unwrap()
    };
    follow().await;
    until_in_sync(&db).await;
    create_shadow(&db.pool, "doc_embeddings", Some("mock"), "mock-next", 256, Some(256)).await.unwrap();
    sqlx::raw_sql(
        "UPDATE documents SET body = 'second version ' || id WHERE id <= 10;
         DELETE FROM documents WHERE id BETWEEN 11 AND 15;
         INSERT INTO documents (id, title, body) SELECT i, 'late ' || i, 'late body' FROM generate_series(100, 104) AS i;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    follow().await;
    let rows: Vec<(i64, String, Option<String>)> =
        sqlx::query_as("SELECT id, title, body FROM documents").fetch_all(&db.pool).await.unwrap();
    let text =
        |title: &str, body: &Option<String>| format!("{title}\n\n{}", body.clone().unwrap_or_default());
    let r1 = crate::revisions::hashes(&db, "doc_embeddings__r1").await;
    let r2 = crate::revisions::hashes(&db, "doc_embeddings__r2").await;
    for (id, title, body) in &rows {
        let key = (id.to_string(), 0);
        assert_eq!(r1.get(&key), Some(&content_hash("mock", 768, &text(title, body))), "r1 {id}");
        if *id <= 10 || *id >= 100 {
            assert_eq!(r2.get(&key), Some(&content_hash("mock-next", 256, &text(title, body))), "r2 {id}");
        }
    }
    for id in 11..=15 {
        assert!(
            !r1.contains_key(&(id.to_string(), 0)) && !r2.contains_key(&(id.to_string(), 0)),
            "{id} deleted"
        );
    }
    assert_eq!(r2.len(), 15, "the shadow holds what changed since it was made (a backfill copies the rest)");
}

/// `revision backfill --from-table`: a shadow made after the first snapshot gets every row
/// of the table (not only those changed since), each with the shadow's model, while the
/// follower applies edits beside it; the target without a shadow, or a --table that is not
/// the source's, is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revision_backfill_from_the_table_fills_the_shadow_with_every_row_under_live_edits() {
    use embed_dlq::model::content_hash;
    use embed_dlq::store::revision::create_shadow;
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    create_documents(&db, 1_500).await;
    let source = table_source::add_table(&db.pool, &spec()).await.unwrap();
    let s = settings(&db, &mock);
    let idle = FollowOptions { idle_exit: Some(Duration::from_millis(300)), ..FollowOptions::default() };
    let targets = s.source_targets();
    embed_dlq::ingest::table::follow_table(&targets, &source, idle.clone(), CancellationToken::new())
        .await
        .unwrap();
    let backfill = |extra: &[&str]| {
        let mut c = binary();
        c.args(["revision", "backfill", "--from-table", "docs", "--json", "--no-progress"])
            .args(["--database-url", &db.url, "--base-url", &mock.base_url(), "--model", "mock"])
            .args(extra);
        c
    };
    let refused = backfill(&[]).output().await.unwrap();
    assert_eq!(refused.status.code(), Some(2), "no shadow yet: {}", String::from_utf8_lossy(&refused.stderr));
    create_shadow(&db.pool, "doc_embeddings", Some("mock"), "mock-next", 256, Some(256)).await.unwrap();
    let wrong = backfill(&["--table", "other_embeddings"]).output().await.unwrap();
    assert_eq!(wrong.status.code(), Some(2), "{}", String::from_utf8_lossy(&wrong.stderr));

    let cancel = CancellationToken::new();
    let follower = {
        let (targets, source, cancel) = (s.source_targets(), source.clone(), cancel.clone());
        tokio::spawn(async move {
            embed_dlq::ingest::table::follow_table(&targets, &source, FollowOptions::default(), cancel).await
        })
    };
    let edits = {
        let pool = db.pool.clone();
        tokio::spawn(async move {
            for round in 0..30i64 {
                let sql = format!(
                    "UPDATE documents SET body = 'round {round} of ' || id WHERE id % 30 = {round};
                     DELETE FROM documents WHERE id = {};
                     INSERT INTO documents (id, title, body) VALUES ({}, 'late', 'late body');",
                    round * 7 + 3,
                    10_000 + round
                );
                sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&pool).await.unwrap();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let out = backfill(&[]).output().await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    edits.await.unwrap();
    // The follower settles the last edits in both revisions, then stops.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while db.count("SELECT count(*) FROM embed_table_changes").await > 0 {
        assert!(tokio::time::Instant::now() < deadline, "the follower never drained its queue");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cancel.cancel();
    follower.await.unwrap().unwrap();

    let rows: Vec<(i64, String, Option<String>)> =
        sqlx::query_as("SELECT id, title, body FROM documents").fetch_all(&db.pool).await.unwrap();
    let text =
        |title: &str, body: &Option<String>| format!("{title}\n\n{}", body.clone().unwrap_or_default());
    let r1 = crate::revisions::hashes(&db, "doc_embeddings__r1").await;
    let r2 = crate::revisions::hashes(&db, "doc_embeddings__r2").await;
    for (id, title, body) in &rows {
        let key = (id.to_string(), 0);
        assert_eq!(r1.get(&key), Some(&content_hash("mock", 768, &text(title, body))), "r1 {id}");
        assert_eq!(r2.get(&key), Some(&content_hash("mock-next", 256, &text(title, body))), "r2 {id}");
    }
    assert_eq!((r1.len(), r2.len()), (rows.len(), rows.len()), "nothing but the rows");
    let activated = binary()
        .args(["revision", "activate", "--revision", "2", "--database-url", &db.url, "--json"])
        .output()
        .await
        .unwrap();
    assert_eq!(
        activated.status.code(),
        Some(0),
        "the shadow covers: {}",
        String::from_utf8_lossy(&activated.stdout)
    );
}

/// A snapshot stopped part way resumes after the last part it settled: the second follower
/// reads what the first did not store (and one part at most again), not the whole table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_stopped_part_way_resumes_after_the_last_part_it_settled() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig { latency_ms: 15, ..MockConfig::default() }).await;
    const ROWS: i64 = 6_000;
    const PART: i64 = 1_000;
    create_documents(&db, ROWS).await;
    let source = table_source::add_table(&db.pool, &spec()).await.unwrap();
    let s = settings(&db, &mock);
    let options = FollowOptions {
        idle_exit: Some(Duration::from_millis(300)),
        snapshot_part_rows: PART,
        ..FollowOptions::default()
    };
    let cancel = CancellationToken::new();
    let first = {
        let (targets, source, cancel, options) =
            (s.source_targets(), source.clone(), cancel.clone(), options.clone());
        tokio::spawn(async move {
            embed_dlq::ingest::table::follow_table(&targets, &source, options, cancel).await
        })
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while db.count("SELECT count(*) FROM doc_embeddings").await < ROWS / 2 {
        assert!(tokio::time::Instant::now() < deadline, "the first snapshot never got half way");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cancel.cancel();
    let stopped = first.await.unwrap().unwrap();
    assert_eq!(stopped.snapshots, 0, "stopped before its end");
    let stored_before = db.count("SELECT count(*) FROM doc_embeddings").await;
    assert!(stored_before < ROWS, "stopped part way: {stored_before}");
    // An edit made meanwhile, before where the snapshot got to, comes through the queue.
    sqlx::raw_sql("UPDATE documents SET body = 'edited while stopped' WHERE id = 5")
        .execute(&db.pool)
        .await
        .unwrap();

    let targets = s.source_targets();
    let second = embed_dlq::ingest::table::follow_table(&targets, &source, options, CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(second.snapshots, 1);
    let unstored = (ROWS - stored_before) as u64;
    assert!(
        second.ingest.records <= unstored + PART as u64 + 1,
        "the second follower read {} records for the {unstored} rows the first did not store",
        second.ingest.records
    );
    until_in_sync(&db).await;
    let sent = mock.control.stats().inputs;
    assert!(sent <= ROWS as u64 + 1 + 256, "{sent} inputs for {ROWS} rows and one edit");
}

/// `serve --follow-table` in two processes: one follows, the other stands by; the follower
/// SIGKILLed, the standby takes the source over and applies the edits made since, with
/// nothing lost and nothing stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_follows_a_table_source_and_a_standby_takes_over_when_it_is_killed() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    create_documents(&db, 200).await;
    table_source::add_table(&db.pool, &spec()).await.unwrap();
    let keys = fresh_keys();
    let extra = ["--replayers", "0", "--follow-table", "docs"];
    let mut first = serve_process(&db.url, &mock.base_url(), &keys, &extra).spawn().unwrap();
    until_in_sync(&db).await;
    let mut standby = serve_process(&db.url, &mock.base_url(), &keys, &extra).spawn().unwrap();
    sqlx::raw_sql("UPDATE documents SET body = 'seen by the first' WHERE id <= 20")
        .execute(&db.pool)
        .await
        .unwrap();
    until_in_sync(&db).await;
    assert!(standby.try_wait().unwrap().is_none(), "the standby waits, it does not fail");
    first.kill().await.unwrap();
    sqlx::raw_sql(
        "UPDATE documents SET body = 'after the kill' WHERE id BETWEEN 21 AND 60;
         DELETE FROM documents WHERE id > 190;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    until_in_sync(&db).await;
    let unknown =
        serve_process(&db.url, &mock.base_url(), &keys, &["--replayers", "0", "--follow-table", "nope"])
            .status()
            .await
            .unwrap();
    assert_eq!(unknown.code(), Some(2), "an unknown source is a usage error");
    standby.kill().await.unwrap();
}
