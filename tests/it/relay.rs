//! Relay identity and wake-ups, relay/replayer error classification, the event-stream
//! reconcile check, postponed work, paged reconcile scans, batched purge and requeue safety.
//! Real Postgres, real Redis.

use std::collections::HashSet;
use std::time::Duration;

use embed_dlq::mock_provider::MockConfig;
use embed_dlq::reconcile::{Check, Mode, ReconcileConfig, Reconciler};
use embed_dlq::relay::{Relay, RelayConfig};
use embed_dlq::replay::{ReplayConfig, Replayer, Scheduler};
use embed_dlq::streams::{REPLAY_GROUP, StreamKeys};
use redis::AsyncCommands;
use sqlx::postgres::PgListener;
use tokio_util::sync::CancellationToken;

use crate::support::*;

/// Parks `n` chunks of `doc` as transient (the provider is down).
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

/// Relays every unpublished outbox row; returns the new stream entries.
async fn relay_all(db: &TestDb, keys: &StreamKeys) -> u64 {
    let mut relay = Relay::new(db.pool.clone(), redis().await, keys.clone(), RelayConfig::default());
    let mut published = 0;
    loop {
        let c = relay.run_once().await.unwrap();
        published += c.published;
        if c.claimed == 0 {
            return published;
        }
    }
}

async fn reconciler(db: &TestDb, keys: &StreamKeys, config: ReconcileConfig) -> Reconciler {
    let p = pipeline(&settings(db, &start_mock(MockConfig::default()).await)).await;
    Reconciler { store: p.store, redis: Some(redis().await), keys: keys.clone(), config }
}

fn immediate() -> ReconcileConfig {
    ReconcileConfig {
        outbox_stuck_after: Duration::from_secs(3600),
        replay_stall_after: Duration::from_secs(3600),
        lost_work_grace: Duration::ZERO,
        ..Default::default()
    }
}

async fn events_on_stream(keys: &StreamKeys) -> Vec<redis::streams::StreamId> {
    let mut r = redis().await;
    let all: redis::streams::StreamRangeReply = r.xrange_all(keys.events()).await.unwrap();
    all.ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_without_dlq_rows_sends_no_notification_and_a_park_does() {
    let db = TestDb::new().await;
    let mut listener = PgListener::connect(&db.url).await.unwrap();
    listener.listen("embed_dlq_outbox").await.unwrap();
    let mock = start_mock(MockConfig::default()).await;
    let mut corpus = String::new();
    for i in 0..40 {
        corpus.push_str(&line("quiet", i, &format!("quiet {i}")));
    }
    let p = pipeline(&settings(&db, &mock)).await;
    assert_eq!(p.run(input(corpus.into_bytes()), CancellationToken::new()).await.unwrap().stored, 40);
    // Notifications arrive in commit order: if the stores notified, theirs come first.
    sqlx::query("SELECT pg_notify('embed_dlq_outbox', 'marker')").execute(&db.pool).await.unwrap();
    let first = listener.recv().await.unwrap();
    assert_eq!(first.payload(), "marker", "a store that wrote no outbox row notified the relay");
    park(&db, "loud", 1).await;
    let next = listener.recv().await.unwrap();
    assert_eq!(next.payload(), "", "a park wakes the relay");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_outbox_table_is_gone_stops_with_an_error() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    sqlx::query("ALTER TABLE dlq_outbox RENAME TO dlq_outbox_renamed").execute(&db.pool).await.unwrap();
    let relay = Relay::new(db.pool.clone(), redis().await, keys, RelayConfig::default());
    // A hang guard, not a timing assertion: a relay that retries a permanent error forever
    // never returns.
    let ended = tokio::time::timeout(Duration::from_secs(60), relay.run(CancellationToken::new())).await;
    let result = ended.expect("the relay gave up instead of retrying forever");
    let err = result.expect_err("a permanent error ends the relay with Err");
    assert!(!err.is_transient());
    assert!(err.to_string().contains("dlq_outbox"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_loops_stop_on_permanent_errors() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let r = reconciler(&db, &keys, immediate()).await;
    sqlx::query("ALTER TABLE embedding_dlq RENAME COLUMN enqueued_at TO enqueued_at_gone")
        .execute(&db.pool)
        .await
        .unwrap();
    let scheduler = Scheduler { store: r.store.clone(), config: ReplayConfig::default() };
    let ended = tokio::time::timeout(Duration::from_secs(60), scheduler.run(CancellationToken::new())).await;
    let err = ended.expect("the scheduler gave up").expect_err("permanent error");
    assert!(!err.is_transient(), "{err}");

    // The replay stream's key holds a string: WRONGTYPE on every read is not transient.
    let mut redis = redis().await;
    let _: () = redis.set(keys.replay(), "not a stream").await.unwrap();
    let mock = start_mock(MockConfig::default()).await;
    let p = pipeline(&settings(&db, &mock)).await;
    let rep = Replayer {
        name: "wrongtype".into(),
        store: p.store.clone(),
        embedder: p.embedder.clone(),
        client: embed_dlq::streams::client(&redis_url()).unwrap(),
        redis: redis.clone(),
        keys: keys.clone(),
        config: ReplayConfig { block: Duration::from_millis(200), ..Default::default() },
        paused_until: None,
    };
    let ended = tokio::time::timeout(
        Duration::from_secs(60),
        rep.run(CancellationToken::new(), CancellationToken::new()),
    )
    .await;
    let err = ended.expect("the replayer gave up").expect_err("permanent error");
    assert!(!err.is_transient(), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_classified_by_kind_and_code_not_text() {
    use embed_dlq::relay::RelayError;
    let db = TestDb::new().await;
    let missing = sqlx::query("SELECT * FROM no_such_table").execute(&db.pool).await.unwrap_err();
    assert!(!RelayError::from(missing).is_transient(), "undefined table");
    let column = sqlx::query("SELECT no_such_column FROM dlq_outbox").execute(&db.pool).await.unwrap_err();
    assert!(!RelayError::from(column).is_transient(), "undefined column");
    let mut own = <sqlx::PgConnection as sqlx::Connection>::connect(&db.url).await.unwrap();
    let cancelled = sqlx::raw_sql("SET statement_timeout = 1; SELECT pg_sleep(1)")
        .execute(&mut own)
        .await
        .expect_err("statement timeout");
    assert!(RelayError::from(cancelled).is_transient(), "a cancelled statement may succeed next time");

    let mut redis = redis().await;
    let key = format!("{}:wrongtype", fresh_keys().events());
    let _: () = redis.set(&key, "x").await.unwrap();
    let wrongtype: redis::RedisError = redis::cmd("XADD")
        .arg(&key)
        .arg("*")
        .arg("a")
        .arg("b")
        .query_async::<String>(&mut redis)
        .await
        .unwrap_err();
    assert!(!RelayError::from(wrongtype).is_transient(), "WRONGTYPE");
    let script_error: redis::RedisError = redis::Script::new("return redis.call('NOSUCHCOMMAND')")
        .invoke_async::<_, redis::Value>(&mut redis)
        .await
        .unwrap_err();
    assert!(!RelayError::from(script_error).is_transient(), "a script error");
    let _: () = redis.del(&key).await.unwrap();

    let refused = embed_dlq::streams::client("redis://127.0.0.1:1/").unwrap();
    let err = refused.get_multiplexed_async_connection().await.unwrap_err();
    assert!(RelayError::from(err).is_transient(), "connection refused");
}
