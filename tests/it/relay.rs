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

