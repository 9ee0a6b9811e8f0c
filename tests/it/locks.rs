//! Lock order: every writer that touches a chunk's manifest row and its DLQ row locks the
//! manifest row first (ingest's store and park, replay's commits). An operator action that
//! locked the DLQ row first would deadlock against a replay commit of the same chunk, and
//! Postgres would abort one of them after `deadlock_timeout`.
//!
//! Each test holds a manifest row lock the way a replay commit does, starts the operator
//! action, waits until it is blocked, then touches the DLQ row from the lock holder (as the
//! replay commit's next statement would). With the right order the action is blocked on the
//! manifest and has not touched the DLQ row yet, so both finish; with the wrong order one of
//! them fails with SQLSTATE 40P01.

use std::future::Future;
use std::time::Duration;

use embed_dlq::dlq::{self, Filter};
use embed_dlq::store::{Store, StoreError};
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
async fn action_waits_for_the_manifest_lock_first<F, T>(db: &TestDb, action: F)
where
    F: Future<Output = Result<T, StoreError>> + Send + 'static,
    T: Send + 'static,
{
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query(
        "SELECT 1 FROM ingest_manifest m JOIN embedding_dlq d
            ON m.target_table = d.target_table AND m.doc_id = d.doc_id AND m.chunk_index = d.chunk_index
         FOR UPDATE OF m",
    )
    .execute(&mut *holder)
    .await
    .unwrap();
    let action = tokio::spawn(action);
    let mut waited = Duration::ZERO;
    while waiting_on_locks(db).await == 0 {
        assert!(waited < Duration::from_secs(60), "the action never blocked on the held manifest lock");
        tokio::time::sleep(Duration::from_millis(20)).await;
        waited += Duration::from_millis(20);
    }
    // What a replay commit does next, while it holds the manifest row.
    let touched = sqlx::query("UPDATE embedding_dlq SET attempts = attempts").execute(&mut *holder).await;
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
