//! Lock order: every writer that touches a chunk's manifest row and its DLQ row or vector
//! locks the manifest row first (ingest's store and park, replay's commits). An operator
//! action or a reconcile repair that locked the DLQ row or the vector first would deadlock
//! against a replay commit or an ingest of the same chunk, and Postgres would abort one of
//! them after `deadlock_timeout`.
//!
//! Each test holds a manifest row lock the way a replay commit (or an ingest) does, starts the
//! action, waits until it is blocked, then touches the DLQ row or the vector from the lock
//! holder (as the writer's next statement would). With the right order the action is blocked
//! on the manifest and has not touched the other row yet, so both finish; with the wrong
//! order one of them fails with SQLSTATE 40P01.

use std::future::Future;
use std::time::Duration;

use embed_dlq::dlq::{self, Filter};
use embed_dlq::reconcile::{Mode, Reconciler};
use embed_dlq::store::Store;
use embed_dlq::testkit::mock_provider::{self, MockConfig};
use tokio_util::sync::CancellationToken;

use crate::support::*;

/// One chunk parked as `permanent_input` (a poison input), next to a stored one.
async fn one_parked_row(db: &TestDb) {
    let mock = start_mock(MockConfig::default()).await;
    let corpus =
        line("lock", 0, "a fine chunk") + &line("lock", 1, &format!("bad {}", mock_provider::POISON_400));
    pipeline(&settings(db, &mock))
        .await
        .run(input(corpus.into_bytes()), CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 1);
}

/// Backends of this test's database waiting on a lock.
async fn waiting_on_locks(db: &TestDb) -> i64 {
    db.count(
        "SELECT count(*) FROM pg_stat_activity
          WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    .await
}

/// Holds the parked chunk's manifest row lock, runs `action` until it blocks, then updates
/// the DLQ row from the holder and commits. Both must succeed.
async fn action_waits_for_the_manifest_lock_first<F, T, E>(db: &TestDb, action: F)
where
    F: Future<Output = Result<T, E>> + Send + 'static,
    T: Send + 'static,
    E: std::fmt::Debug + Send + 'static,
{
    let lock = "SELECT 1 FROM ingest_manifest m JOIN embedding_dlq d
                   ON m.target_table = d.target_table AND m.doc_id = d.doc_id AND m.chunk_index = d.chunk_index
                FOR UPDATE OF m";
    action_waits_for_the_lock_first(db, lock, "UPDATE embedding_dlq SET attempts = attempts", action).await
}

/// Takes the row locks of `lock` in a transaction (what a writer's first statement does),
/// runs `action` until it blocks, then runs `touch` from the holder (the writer's next
/// statement) and commits. Both must succeed.
async fn action_waits_for_the_lock_first<F, T, E>(
    db: &TestDb,
    lock: &'static str,
    touch: &'static str,
    action: F,
) where
    F: Future<Output = Result<T, E>> + Send + 'static,
    T: Send + 'static,
    E: std::fmt::Debug + Send + 'static,
{
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query(lock).execute(&mut *holder).await.unwrap();
    let action = tokio::spawn(action);
    let mut waited = Duration::ZERO;
    while waiting_on_locks(db).await == 0 {
        assert!(waited < Duration::from_secs(60), "the action never blocked on the held manifest lock");
        tokio::time::sleep(Duration::from_millis(20)).await;
        waited += Duration::from_millis(20);
    }
    // What the writer does next, while it holds the manifest row.
    let touched = sqlx::query(touch).execute(&mut *holder).await;
    let committed = holder.commit().await;
    let action = action.await.unwrap();
    assert!(touched.is_ok(), "the lock holder failed (deadlock?): {touched:?}");
    assert!(committed.is_ok(), "{committed:?}");
    assert!(action.is_ok(), "the action failed (deadlock?): {:?}", action.err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requeue_locks_the_manifest_row_before_the_dlq_row() {
    let db = TestDb::new().await;
    one_parked_row(&db).await;
    // Exhausted, so requeue moves its manifest row (a `parked` one it would leave alone).
    sqlx::query("UPDATE embedding_dlq SET exhausted_at = now(), exhausted_reason = 'test'")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("UPDATE ingest_manifest SET status = 'exhausted' WHERE status = 'parked'")
        .execute(&db.pool)
        .await
        .unwrap();
    let store = Store::open(db.pool.clone(), "doc_embeddings").await.unwrap();
    action_waits_for_the_manifest_lock_first(&db, async move {
        dlq::requeue(&store, &Filter::default(), false, 1_000).await
    })
    .await;
    assert_eq!(db.count("SELECT count(*) FROM dlq_outbox WHERE event = 'requeued'").await, 1);
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq WHERE error_class = 'transient'").await, 1);
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest WHERE status = 'parked'").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_locks_the_manifest_row_before_the_dlq_row() {
    let db = TestDb::new().await;
    one_parked_row(&db).await;
    let store = Store::open(db.pool.clone(), "doc_embeddings").await.unwrap();
    action_waits_for_the_manifest_lock_first(&db, async move {
        dlq::purge(&store, &Filter::default(), false).await
    })
    .await;
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
    assert_eq!(db.count("SELECT count(*) FROM dlq_outbox WHERE event = 'purged'").await, 1);
    assert_eq!(db.leaks().await, 0);
}

/// A reconciler over the test database, without Redis (the stream checks are skipped).
async fn reconciler_of(db: &TestDb) -> Reconciler {
    let store = Store::open(db.pool.clone(), "doc_embeddings").await.unwrap();
    Reconciler { store, redis: None, keys: fresh_keys(), config: Default::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_dlq_repair_locks_the_manifest_row_before_the_dlq_row() {
    let db = TestDb::new().await;
    one_parked_row(&db).await;
    // The parked chunk's vector arrives by another path: its DLQ row is stale.
    sqlx::query(
        "INSERT INTO doc_embeddings (doc_id, chunk_index, content_hash, embedding)
         SELECT doc_id, chunk_index, content_hash, array_fill(0.5, ARRAY[768])::vector FROM embedding_dlq",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut r = reconciler_of(&db).await;
    action_waits_for_the_manifest_lock_first(&db, async move { r.run_once(Mode::Repair).await }).await;
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
    assert_eq!(db.count("SELECT count(*) FROM dlq_outbox WHERE event = 'resolved'").await, 1);
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest WHERE status = 'stored'").await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_vector_repair_locks_the_manifest_row_before_the_vector() {
    let db = TestDb::new().await;
    one_parked_row(&db).await;
    sqlx::query("UPDATE doc_embeddings SET embedding = array_fill(0, ARRAY[768])::vector")
        .execute(&db.pool)
        .await
        .unwrap();
    // The first run of a database reads every vector (a deep sweep).
    let mut r = reconciler_of(&db).await;
    action_waits_for_the_lock_first(
        &db,
        "SELECT 1 FROM ingest_manifest m JOIN doc_embeddings e
            ON m.doc_id = e.doc_id AND m.chunk_index = e.chunk_index
         FOR UPDATE OF m",
        // An ingest storing the chunk again writes its vector next.
        "UPDATE doc_embeddings SET updated_at = updated_at",
        async move { r.run_once(Mode::Repair).await },
    )
    .await;
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 0);
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest WHERE status = 'reingest'").await, 1);
}
