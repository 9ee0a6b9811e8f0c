//! Relay identity and wake-ups, relay/replayer error classification, the event-stream
//! reconcile check, postponed work, paged reconcile scans, batched purge and requeue safety.
//! Real Postgres, real Redis.

use std::collections::HashSet;
use std::time::Duration;

use embed_dlq::reconcile::{Check, Mode, ReconcileConfig, Sweep, SweepPolicy};
use embed_dlq::relay::{Relay, RelayConfig};
use embed_dlq::replay::{ReplayConfig, Replayer, Scheduler};
use embed_dlq::streams::{REPLAY_GROUP, StreamKeys};
use embed_dlq::testkit::mock_provider::MockConfig;
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

/// The `event_id` of every entry of the events stream, in stream order.
async fn event_ids_on_stream(keys: &StreamKeys) -> Vec<String> {
    events_on_stream(keys)
        .await
        .iter()
        .map(|e| embed_dlq::streams::field(&e.map, "event_id").unwrap())
        .collect()
}

async fn events_on_stream(keys: &StreamKeys) -> Vec<redis::streams::StreamId> {
    let mut r = redis().await;
    let all: redis::streams::StreamRangeReply = r.xrange_all(keys.events()).await.unwrap();
    all.ids
}

/// The relay's first page right after a large park, before autovacuum has analyzed the
/// outbox: opening the interval costs an index probe per transaction, and the page reads
/// the oldest rows by id and stops at its batch. (The claim of an older relay, planned from
/// the planner's guess of a few unpublished rows, read and sorted the whole backlog: 2.3 s a
/// claim of 500 behind 700,000 rows; 5-8 s a claim at the start of the 1M scale run.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_page_after_a_large_park_reads_the_head_of_the_backlog_not_all_of_it() {
    const PARKED: usize = 5_000;
    let db = TestDb::new().await;
    sqlx::query("ALTER TABLE dlq_outbox SET (autovacuum_enabled = false)").execute(&db.pool).await.unwrap();
    park_due(&db, PARKED, "head").await;
    let keys = fresh_keys();
    let pool = embed_dlq::store::connect(&db.url, 2).await.unwrap();
    let config = RelayConfig { batch: 500, ..Default::default() };
    let mut relay = Relay::new(pool.clone(), redis().await, keys, config);
    quiet_statistics().await;
    let before = rows_read(&db, "dlq_outbox").await;
    assert_eq!(relay.run_once().await.unwrap().claimed, 500);
    drop(relay);
    pool.close().await;
    let read = rows_read_since(&db, "dlq_outbox", before).await;
    assert!(read <= 2_000, "one claim of 500 read {read} outbox rows (of {PARKED} unpublished)");
}

on_single_and_cluster! {
async fn a_second_installation_on_the_same_prefix_publishes_all_its_events() {
    let keys = fresh_keys();
    // Two databases whose outbox ids are the same (1..=5): a re-created database, a restore,
    // or a second deployment sharing the prefix.
    let first = TestDb::new().await;
    park(&first, "first", 5).await;
    assert_eq!(relay_all(&first, &keys).await, 5);
    let second = TestDb::new().await;
    park(&second, "second", 5).await;
    assert_eq!(relay_all(&second, &keys).await, 5, "no new event is taken for a duplicate of an old one");
    let entries = events_on_stream(&keys).await;
    assert_eq!(entries.len(), 10);
    let docs: HashSet<String> = entries
        .iter()
        .map(|e| {
            let body: serde_json::Value =
                serde_json::from_str(&embed_dlq::streams::field(&e.map, "body").unwrap()).unwrap();
            format!("{}#{}", body["doc_id"].as_str().unwrap(), body["chunk_index"])
        })
        .collect();
    assert_eq!(docs.len(), 10, "every park of both installations is on the stream once");
}
}

/// What a logical restore into another cluster (`pg_dump`, then `pg_restore` or `psql` on a
/// new server) does to the relay's records, as the relay sees it: the outbox rows keep the
/// txids and `relay_position` the snapshots of the old cluster, while the new cluster's
/// transaction ids count on from where its own counter is, here `behind` the old one's. The
/// old cluster's ids are moved up instead (the same picture), and `relay_position` is told
/// the dump came from `cluster` (its `system_identifier`) when given. The reconciler's events
/// windows are snapshots of the old cluster too.
async fn restored_into_another_cluster(db: &TestDb, behind: u64, cluster: Option<&str>) {
    let shift = |snapshot: &str| -> String {
        let mut parts = snapshot.split(':');
        let up = |list: &str| -> String {
            list.split(',')
                .filter(|x| !x.is_empty())
                .map(|x| (x.parse::<u64>().unwrap() + behind).to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        let (xmin, xmax, xip) = (parts.next().unwrap(), parts.next().unwrap(), parts.next().unwrap());
        format!("{}:{}:{}", up(xmin), up(xmax), up(xip))
    };
    let (lower, upper): (String, Option<String>) =
        sqlx::query_as("SELECT lower::text, upper::text FROM relay_position")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("UPDATE dlq_outbox SET txid = (txid::text::bigint + $1)::text::xid8 WHERE txid IS NOT NULL")
        .bind(behind as i64)
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("UPDATE relay_position SET lower = $1::pg_snapshot, upper = $2::pg_snapshot")
        .bind(shift(&lower))
        .bind(upper.as_deref().map(shift))
        .execute(&mut *tx)
        .await
        .unwrap();
    let windows: Vec<(i64, String)> =
        sqlx::query_as("SELECT id, events_window::text FROM reconcile_runs WHERE events_window IS NOT NULL")
            .fetch_all(&mut *tx)
            .await
            .unwrap();
    for (id, window) in windows {
        sqlx::query("UPDATE reconcile_runs SET events_window = $2::pg_snapshot WHERE id = $1")
            .bind(id)
            .bind(shift(&window))
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    if let Some(cluster) = cluster {
        sqlx::query("UPDATE relay_position SET system_identifier = $1")
            .bind(cluster)
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
}

/// A database before its dump: 3 events published, then 2 parked while no relay ran.
async fn published_and_waiting() -> (TestDb, StreamKeys) {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    park(&db, "published", 3).await;
    relay_all(&db, &keys).await;
    park(&db, "pending", 2).await;
    (db, keys)
}

/// Every outbox row is on the events stream exactly once (Redis's view, not the relay's).
async fn assert_each_event_once(db: &TestDb, keys: &StreamKeys, rows: usize) {
    assert_eq!(unpublished(db, keys).await, Vec::<String>::new(), "every outbox row is on the stream");
    let ids = event_ids_on_stream(keys).await;
    assert_eq!(ids.iter().collect::<HashSet<_>>().len(), ids.len(), "no event twice: {ids:?}");
    assert_eq!(ids.len(), rows);
}

/// Restored into a cluster whose transaction ids are far behind the old one's: rows written
/// after the restore have txids below the relay's position and read as published, and the
/// rows the old relay had not published yet are above any snapshot the new server takes.
/// The relay sees the position ahead of the server and starts again from every row it
/// cannot be sure of; the dedup records turn the ones already on the stream into no-ops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restore_into_a_cluster_whose_ids_are_behind_every_event_is_published_once() {
    let (db, keys) = published_and_waiting().await;
    // Published well before the relay last moved: not handed back, published they stay.
    sqlx::query(
        "UPDATE dlq_outbox SET created_at = created_at - interval '1 hour' WHERE doc_id = 'published'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    restored_into_another_cluster(&db, 1_000_000_000, None).await;
    park(&db, "after", 2).await;
    relay_all(&db, &keys).await;
    assert_each_event_once(&db, &keys, 7).await;
    // Nothing reads as waiting (their old ids are ahead of this cluster's: they would, and be
    // published again once its counter got there).
    let config = ReconcileConfig { outbox_stuck_after: Duration::ZERO, ..immediate() };
    let report = reconciler(&db, &keys, config).await.run_once(Mode::Check).await.unwrap();
    assert_eq!(report.get(Check::OutboxBacklog).note, None, "{report:#?}");
    park(&db, "later", 2).await;
    relay_all(&db, &keys).await;
    assert_each_event_once(&db, &keys, 9).await;
}

/// Restored into another cluster whose counter is only a little behind, and passes the old
/// position before the relay runs again: the position is no longer ahead of the server, yet
/// the rows written in between have txids the position counts as published. The cluster's
/// identity, recorded with the position, tells.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restore_into_a_cluster_that_caught_up_every_event_is_published_once() {
    let (db, keys) = published_and_waiting().await;
    restored_into_another_cluster(&db, 500, Some("another cluster")).await;
    park(&db, "after", 2).await;
    // The new cluster's counter passes the old one's.
    for _ in 0..1_000 {
        sqlx::query("SELECT pg_current_xact_id()").execute(&db.pool).await.unwrap();
    }
    relay_all(&db, &keys).await;
    assert_each_event_once(&db, &keys, 7).await;
}

/// The reconciler's events window is a snapshot of the old cluster too: after a restore into
/// another one it says nothing about the new cluster's transactions (the events the relay
/// published again have ids below it), and the next incremental run walks every event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restore_into_another_cluster_an_incremental_events_check_walks_every_event() {
    let (db, keys) = published_and_waiting().await;
    // Pages of two: the witnesses before the window are the two newest events.
    let config = ReconcileConfig { sweeps: SweepPolicy::Always(Sweep::Incremental), page: 2, ..immediate() };
    let mut r = reconciler(&db, &keys, config).await;
    assert_eq!(r.run_once(Mode::Check).await.unwrap().get(Check::MissingEvents).found, 0);
    restored_into_another_cluster(&db, 1_000_000_000, None).await;
    park(&db, "after", 4).await;
    relay_all(&db, &keys).await;
    assert_each_event_once(&db, &keys, 9).await;
    // An event published since the previous run, not among the newest, goes missing.
    let pending: String = sqlx::query_scalar(
        "SELECT event_id::text FROM dlq_outbox WHERE doc_id = 'pending' ORDER BY id LIMIT 1",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let entry = events_on_stream(&keys)
        .await
        .into_iter()
        .find(|e| embed_dlq::streams::field(&e.map, "event_id").as_deref() == Some(pending.as_str()))
        .expect("the pending event is on the stream");
    let mut redis = redis().await;
    let _: i64 = redis::cmd("XDEL").arg(keys.events()).arg(&entry.id).query_async(&mut redis).await.unwrap();
    let report = r.run_once(Mode::Check).await.unwrap();
    assert_eq!(report.sweep, Sweep::Incremental);
    assert_eq!(report.get(Check::MissingEvents).found, 1, "{report:#?}");
}

on_single_and_cluster! {
async fn a_republish_after_a_lost_commit_or_a_restore_is_deduplicated() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    park(&db, "again", 6).await;
    assert_eq!(relay_all(&db, &keys).await, 6);
    // The relay crashed after XADD and before its commit (or the database was restored to
    // before the commit): the same rows are unpublished again.
    rewind_relay(&db).await;
    let mut relay = Relay::new(db.pool.clone(), redis().await, keys.clone(), RelayConfig::default());
    let c = relay.run_once().await.unwrap();
    assert_eq!((c.claimed, c.published, c.duplicates), (6, 0, 6), "{c:?}");
    assert_eq!(events_on_stream(&keys).await.len(), 6);
}
}

/// One call of `redis/publish.lua` for rows `(stream, legacy marker index, event_id)` of shard
/// 0 of `keys`, recorded in the hash of hour `hour`; `legacy` names the old-format markers
/// passed after the streams.
fn publish_call(
    keys: &StreamKeys,
    hour: &str,
    legacy: &[&str],
    rows: &[(u8, u8, &str)],
) -> redis::ScriptInvocation<'static> {
    static SCRIPT: std::sync::LazyLock<redis::Script> =
        std::sync::LazyLock::new(|| redis::Script::new(include_str!("../../redis/publish.lua")));
    let tag = format!("{{{}}}", keys.prefix());
    let mut inv = SCRIPT.prepare_invoke();
    inv.key(format!("{tag}:published:{hour}")).key(keys.events()).key(keys.replay()).arg(3600).arg(0).arg(0);
    for e in legacy {
        inv.key(format!("{tag}:outbox:{e}"));
    }
    for (n, (stream, marker, e)) in rows.iter().enumerate() {
        inv.arg(*stream).arg(*marker).arg(*e).arg(n).arg("parked").arg("{}");
    }
    inv
}

fn added(replies: &[(String, i64)]) -> Vec<i64> {
    replies.iter().map(|(_, added)| *added).collect()
}

on_single_and_cluster! {
async fn one_script_call_adds_only_the_unpublished_rows_and_returns_every_id_in_order() {
    // The contract of redis/publish.lua itself: KEYS dedup hash, events, replay, old markers;
    // ARGV ttl, events maxlen, replay maxlen, then six per row; one {entry_id, added} pair per row, in order.
    let keys = fresh_keys();
    let mut r = redis().await;
    let row = |e| (1u8, 0u8, e);
    let first: Vec<(String, i64)> =
        publish_call(&keys, "2026113010", &[], &[row("e2"), row("e4")]).invoke_async(&mut r).await.unwrap();
    assert_eq!(added(&first), [1, 1]);
    let all = [row("e1"), row("e2"), row("e3"), row("e4"), row("e5")];
    let second: Vec<(String, i64)> = publish_call(&keys, "2026113010", &[], &all).invoke_async(&mut r).await.unwrap();
    assert_eq!(added(&second), [1, 0, 1, 0, 1], "{second:?}");
    assert_eq!((&second[1].0, &second[3].0), (&first[0].0, &first[1].0), "the original ids come back");
    let new: Vec<(u64, u64)> =
        [0, 2, 4].iter().map(|&i| embed_dlq::streams::parse_entry_id(&second[i].0)).collect();
    assert!(new.windows(2).all(|w| w[0] < w[1]), "the new entries keep the rows' order: {second:?}");
    let entries = events_on_stream(&keys).await;
    let on_stream: Vec<String> =
        entries.iter().map(|e| embed_dlq::streams::field(&e.map, "event_id").unwrap()).collect();
    assert_eq!(on_stream, ["e2", "e4", "e1", "e3", "e5"], "each event once, nothing added for a record");
    let ids: Vec<&str> = entries.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids, [&first[0].0, &first[1].0, &second[0].0, &second[2].0, &second[4].0]);
    // The same event twice in one call is added once; a replay row goes to the replay stream.
    let third: Vec<(String, i64)> = publish_call(&keys, "2026113010", &[], &[row("e6"), (2, 0, "w1"), row("e6")])
        .invoke_async(&mut r)
        .await
        .unwrap();
    assert_eq!(added(&third), [1, 1, 0], "{third:?}");
    assert_eq!(third[0].0, third[2].0);
    let replay: redis::streams::StreamRangeReply = r.xrange_all(keys.replay()).await.unwrap();
    assert_eq!(replay.ids.len(), 1);
    assert_eq!(embed_dlq::streams::field(&replay.ids[0].map, "event_id").as_deref(), Some("w1"));
    // The records live in the call's hash, with the TTL the call gave.
    let tag = format!("{{{}}}", keys.prefix());
    let ttl: i64 = r.ttl(format!("{tag}:published:2026113010")).await.unwrap();
    assert!((3500..=3600).contains(&ttl), "{ttl}");
    let recorded: Option<String> = r.hget(format!("{tag}:published:2026113010"), "e3").await.unwrap();
    assert_eq!(recorded.as_deref(), Some(second[2].0.as_str()));
    let _: () = r.del(&[keys.events(), keys.replay(), format!("{tag}:published:2026113010")]).await.unwrap();
}
}

on_single_and_cluster! {
async fn an_old_format_marker_still_dedupes_the_row_it_was_written_for() {
    // An older relay published e1 (a key per event holding its entry id) and crashed before
    // marking the row: the upgraded relay, told the row may have one, gets that id back.
    let keys = fresh_keys();
    let mut r = redis().await;
    let tag = format!("{{{}}}", keys.prefix());
    let old: String = r.xadd(keys.events(), "*", &[("event_id", "e1")]).await.unwrap();
    let _: () = r.set(format!("{tag}:outbox:e1"), &old).await.unwrap();
    let rows = [(1, 4, "e1"), (1, 0, "e2")];
    let replies: Vec<(String, i64)> =
        publish_call(&keys, "2026113010", &["e1"], &rows).invoke_async(&mut r).await.unwrap();
    assert_eq!(added(&replies), [0, 1], "{replies:?}");
    assert_eq!(replies[0].0, old);
    assert_eq!(events_on_stream(&keys).await.len(), 2);
    let _: () = r.del(&[keys.events(), format!("{tag}:outbox:e1"), format!("{tag}:published:2026113010")]).await.unwrap();
}
}

on_single_and_cluster! {
async fn a_call_that_fails_half_way_still_records_the_rows_it_added() {
    // Redis does not roll a script back: when a later XADD fails, the entries added before it
    // stay, so their records must be written too, or a retry would add them a second time.
    let keys = fresh_keys();
    let mut r = redis().await;
    let _: () = r.set(keys.replay(), "not a stream").await.unwrap();
    let rows = [(1, 0, "e1"), (2, 0, "w1"), (1, 0, "e2")];
    let failed: redis::RedisResult<Vec<(String, i64)>> =
        publish_call(&keys, "2026113010", &[], &rows).invoke_async(&mut r).await;
    assert!(failed.is_err(), "{failed:?}");
    let _: () = r.del(keys.replay()).await.unwrap();
    let retried: Vec<(String, i64)> = publish_call(&keys, "2026113010", &[], &rows).invoke_async(&mut r).await.unwrap();
    assert_eq!(added(&retried), [0, 1, 1], "{retried:?}");
    let on_stream: Vec<String> = event_ids_on_stream(&keys).await;
    assert_eq!(on_stream, ["e1", "e2"], "e1 once");
    let tag = format!("{{{}}}", keys.prefix());
    let _: () = r.del(&[keys.events(), keys.replay(), format!("{tag}:published:2026113010")]).await.unwrap();
}
}

on_single_and_cluster! {
async fn rows_parked_before_the_upgrade_are_checked_against_old_markers() {
    // Rows created before migration 0011's cut-over, published by an older relay that wrote a
    // marker per event and crashed before its commit: the upgraded relay adds nothing.
    let db = TestDb::new().await;
    let keys = fresh_keys();
    park(&db, "upgrade", 4).await;
    let mut r = redis().await;
    let rows: Vec<(String,)> =
        sqlx::query_as("SELECT event_id::text FROM dlq_outbox ORDER BY id").fetch_all(&db.pool).await.unwrap();
    for (event_id,) in &rows {
        let id: String = r.xadd(keys.events(), "*", &[("event_id", event_id.as_str())]).await.unwrap();
        let _: () = r.set(keys_legacy_marker(&keys, event_id), id).await.unwrap();
    }
    sqlx::query("UPDATE embed_dlq_dedup_hashes SET since = now()").execute(&db.pool).await.unwrap();
    let mut relay = Relay::new(db.pool.clone(), redis().await, keys.clone(), RelayConfig::default());
    let c = relay.run_once().await.unwrap();
    assert_eq!((c.claimed, c.published, c.duplicates), (4, 0, 4), "{c:?}");
    assert_eq!(events_on_stream(&keys).await.len(), 4);
    // Rows created after the cut-over never had a marker: the relay does not look for one.
    park(&db, "after", 2).await;
    assert_eq!(relay_all(&db, &keys).await, 2);
    assert_eq!(events_on_stream(&keys).await.len(), 6);
}
}

fn keys_legacy_marker(keys: &StreamKeys, event_id: &str) -> String {
    format!("{{{}}}:outbox:{event_id}", keys.prefix())
}

on_single_and_cluster! {
async fn a_pass_mixing_published_and_new_rows_adds_only_the_new_ones_in_outbox_order() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    park(&db, "mixed", 6).await;
    assert_eq!(relay_all(&db, &keys).await, 6);
    let on_stream = || async {
        events_on_stream(&keys)
            .await
            .iter()
            .map(|e| (embed_dlq::streams::field(&e.map, "event_id").unwrap(), e.id.clone()))
            .collect::<Vec<_>>()
    };
    let before = on_stream().await;
    // A lost commit (or a restore): every row looks unpublished again, and four new rows
    // follow.
    rewind_relay(&db).await;
    park(&db, "mixed-new", 4).await;
    let config = RelayConfig { rows_per_call: 3, ..RelayConfig::default() };
    let mut relay = Relay::new(db.pool.clone(), redis().await, keys.clone(), config);
    let c = relay.run_once().await.unwrap();
    assert_eq!((c.claimed, c.published, c.duplicates), (10, 4, 6), "{c:?}");
    let after = on_stream().await;
    assert_eq!(after.len(), 10, "each event on the stream once");
    assert_eq!(&after[..6], &before[..], "the republished rows kept their original entries");
    let outbox: Vec<String> =
        sqlx::query_scalar("SELECT event_id::text FROM dlq_outbox ORDER BY id").fetch_all(&db.pool).await.unwrap();
    let stream: Vec<String> = after.into_iter().map(|(event, _)| event).collect();
    assert_eq!(stream, outbox, "the stream holds the rows in outbox order");
}
}

on_single_and_cluster! {
async fn drain_overlaps_batches_and_keeps_every_row_once_in_outbox_order() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    park(&db, "drain", 25).await;
    let config = RelayConfig { batch: 4, rows_per_call: 3, ..RelayConfig::default() };
    let mut relay = Relay::new(db.pool.clone(), redis().await, keys.clone(), config);
    let c = relay.drain(&CancellationToken::new()).await.unwrap();
    assert_eq!((c.claimed, c.published, c.duplicates), (25, 25, 0), "{c:?}");
    assert_eq!(unpublished(&db, &keys).await, Vec::<String>::new());
    let outbox: Vec<String> =
        sqlx::query_scalar("SELECT event_id::text FROM dlq_outbox ORDER BY id").fetch_all(&db.pool).await.unwrap();
    let stream: Vec<String> = event_ids_on_stream(&keys).await;
    assert_eq!(stream, outbox, "each row once, in outbox order");
}
}

on_single_and_cluster! {
async fn a_relay_waits_while_another_holds_the_outbox_and_a_chunks_events_keep_their_order() {
    // Two relays (two `serve` hosts) on one outbox: relay A holds the outbox's position (it
    // is publishing, or its host froze with the position held). Relay B must publish
    // nothing meanwhile: anything it published could overtake A's rows, e.g. chunk X's later
    // `resolved` event ahead of its `parked` one in A's page.
    let db = TestDb::new().await;
    let keys = fresh_keys();
    park(&db, "order", 1).await;
    park(&db, "filler", 3).await;
    let mock = start_mock(MockConfig::default()).await;
    let s = settings(&db, &mock);
    pipeline(&s).await.run(input(line("order", 0, "order 0, edited").into_bytes()), CancellationToken::new()).await.unwrap();
    let x: Vec<String> = sqlx::query_scalar(
        "SELECT event FROM dlq_outbox WHERE doc_id = 'order' AND stream = 'events' ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(x, ["parked", "resolved"]);
    let mut relay_a = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM relay_position FOR UPDATE").execute(&mut *relay_a).await.unwrap();

    let mut relay_b = Relay::new(db.pool.clone(), redis().await, keys.clone(), RelayConfig::default());
    assert_eq!(relay_b.run_once().await.unwrap().claimed, 0);
    assert_eq!(relay_b.drain(&CancellationToken::new()).await.unwrap().claimed, 0);
    assert!(events_on_stream(&keys).await.is_empty(), "relay B published while A held the outbox");

    relay_a.rollback().await.unwrap();
    relay_all(&db, &keys).await;
    assert_eq!(unpublished(&db, &keys).await, Vec::<String>::new());
    let order: Vec<String> = events_on_stream(&keys)
        .await
        .iter()
        .filter_map(|e| {
            let body: serde_json::Value =
                serde_json::from_str(&embed_dlq::streams::field(&e.map, "body").unwrap()).unwrap();
            (body["doc_id"] == "order").then(|| body["event"].as_str().unwrap().to_string())
        })
        .collect();
    assert_eq!(order, ["parked", "resolved"], "X's events on the stream in the order they happened");
}
}

on_single_and_cluster! {
async fn a_row_of_a_transaction_that_commits_after_later_rows_were_published_is_published() {
    // A long transaction writes an outbox row (its id is drawn now, low), then stays open
    // while other rows, with higher ids, commit and are published. A relay that kept its
    // place by id would pass over the low id for good; by commit order it comes next.
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let mut long = db.pool.begin().await.unwrap();
    let early: String = sqlx::query_scalar(
        "INSERT INTO dlq_outbox (event, doc_id, chunk_index, body) VALUES ('parked', 'long', 0, '{}')
         RETURNING event_id::text",
    )
    .fetch_one(&mut *long)
    .await
    .unwrap();
    park(&db, "meanwhile", 5).await;
    let config = RelayConfig { batch: 2, ..RelayConfig::default() };
    let mut relay = Relay::new(db.pool.clone(), redis().await, keys.clone(), config.clone());
    while relay.run_once().await.unwrap().claimed > 0 {}
    assert_eq!(unpublished(&db, &keys).await, Vec::<String>::new(), "the open transaction's row is not visible yet");
    assert_eq!(events_on_stream(&keys).await.len(), 5);
    long.commit().await.unwrap();
    park(&db, "after", 2).await;
    let published = relay_until_idle(&mut relay).await;
    assert_eq!(published, 3);
    assert_eq!(unpublished(&db, &keys).await, Vec::<String>::new());
    let stream: Vec<String> = event_ids_on_stream(&keys).await;
    assert_eq!(stream.iter().filter(|e| **e == early).count(), 1, "the long transaction's row once");
    assert_eq!(stream[5], early, "published right after it committed, before later commits");
}
}

on_single_and_cluster! {
async fn rows_left_for_a_later_batch_are_published_without_waiting_for_a_wake_up() {
    // Three chunks, each parked and then resolved: p0 p1 p2 r0 r1 r2 in the outbox, with
    // batches of two. Wherever a drain stops with rows still to publish (its bound of pages,
    // an interval that ended while more committed), the loop must look again at once:
    // nothing else will wake it (no new row, and the poll is an hour).
    let db = TestDb::new().await;
    let keys = fresh_keys();
    park(&db, "pairs", 3).await;
    let mock = start_mock(MockConfig::default()).await;
    let s = settings(&db, &mock);
    let edited: String = (0..3).map(|i| line("pairs", i, &format!("pairs {i}, edited"))).collect();
    pipeline(&s).await.run(input(edited.into_bytes()), CancellationToken::new()).await.unwrap();
    assert_eq!(unpublished(&db, &keys).await.len(), 6);
    let config = RelayConfig { batch: 2, poll: Duration::from_secs(3600), ..RelayConfig::default() };
    let relay = Relay::new(db.pool.clone(), redis().await, keys.clone(), config);
    let cancel = CancellationToken::new();
    let running = tokio::spawn(relay.run(cancel.clone()));
    let all_published = tokio::time::timeout(Duration::from_secs(60), async {
        while !unpublished(&db, &keys).await.is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    cancel.cancel();
    running.await.unwrap().unwrap();
    assert!(all_published.is_ok(), "rows left for a later batch waited for a wake-up that never came");
    let mut per_chunk: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for e in events_on_stream(&keys).await {
        let body: serde_json::Value =
            serde_json::from_str(&embed_dlq::streams::field(&e.map, "body").unwrap()).unwrap();
        per_chunk.entry(body["chunk_index"].to_string()).or_default().push(body["event"].as_str().unwrap().into());
    }
    assert_eq!(per_chunk.len(), 3);
    for events in per_chunk.values() {
        assert_eq!(events, &["parked", "resolved"], "{per_chunk:?}");
    }
}
}

on_single_and_cluster! {
async fn a_failed_publish_in_a_drain_releases_the_later_batches_too() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    park(&db, "stuck", 12).await;
    // The events stream is not a stream: every publish fails (WRONGTYPE).
    let mut r = redis().await;
    let _: () = r.set(keys.events(), "not a stream").await.unwrap();
    let config = RelayConfig { batch: 4, ..RelayConfig::default() };
    let mut relay = Relay::new(db.pool.clone(), r.clone(), keys.clone(), config.clone());
    let err = relay.drain(&CancellationToken::new()).await.expect_err("WRONGTYPE");
    assert!(!err.is_transient(), "{err}");
    drop(relay);
    // The position was released (a dropped transaction rolls back when its connection goes
    // back to the pool); a hang guard, not a timing assertion.
    let free = "SELECT count(*) FROM (SELECT 1 FROM relay_position FOR UPDATE SKIP LOCKED) t";
    tokio::time::timeout(Duration::from_secs(60), async {
        while db.count(free).await < 1 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the outbox's position stayed held after the drain failed");
    let _: () = r.del(keys.events()).await.unwrap();
    assert_eq!(unpublished(&db, &keys).await.len(), 12);
    let mut relay = Relay::new(db.pool.clone(), r, keys.clone(), config);
    assert_eq!(relay.drain(&CancellationToken::new()).await.unwrap().published, 12);
    let outbox: Vec<String> =
        sqlx::query_scalar("SELECT event_id::text FROM dlq_outbox ORDER BY id").fetch_all(&db.pool).await.unwrap();
    let stream: Vec<String> = event_ids_on_stream(&keys).await;
    assert_eq!(stream, outbox, "outbox order after the retry");
}
}

on_single_and_cluster! {
async fn a_claim_idle_timeout_out_of_bounds_is_clamped_not_sent_to_postgres() {
    // Zero would switch the timeout off in Postgres (that it is clamped instead is
    // `a_zero_claim_idle_timeout_still_ends_a_silent_claim`), and `Duration::MAX` in
    // milliseconds is past its integer range (an error on every claim): both are clamped.
    let db = TestDb::new().await;
    park(&db, "bounds", 3).await;
    for timeout in [Duration::ZERO, Duration::MAX] {
        let config = RelayConfig { claim_idle_timeout: timeout, ..RelayConfig::default() };
        let mut relay = Relay::new(db.pool.clone(), redis().await, fresh_keys(), config);
        rewind_relay(&db).await;
        let c = relay.run_once().await.unwrap();
        assert_eq!(c.published, 3, "{timeout:?}: {c:?}");
    }
}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_relay_went_silent_is_released_by_postgres() {
    a_silent_claim_is_released(Duration::from_secs(4)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_claim_idle_timeout_still_ends_a_silent_claim() {
    // Sent as is, zero would switch Postgres' idle timeout off and the claim would stay open
    // until the publish gave up: clamped, it ends after the lower bound.
    a_silent_claim_is_released(Duration::ZERO).await;
}

/// A relay host that freezes (or drops off the network) holding the outbox's position: the
/// other relays, and so every event, must not wait for the host. Here the relay's Redis is
/// frozen, so its publish hangs (until its 10 s reply timeout) with the position held;
/// Postgres must end the idle transaction (`claim_idle_timeout`) first.
async fn a_silent_claim_is_released(claim_idle_timeout: Duration) {
    let db = TestDb::new().await;
    park(&db, "silent", 5).await;
    let private = PrivateRedis::start().await;
    let conn = private.manager().await;
    private.freeze();
    // The claim must be seen while it is open: the watcher's session is opened before the
    // relay starts, so no poll waits for a new connection (that took over the claim's whole
    // life once, under a loaded CI machine, with a 1 s timeout). The timeout stays well
    // under the 10 s reply timeout that ends the frozen publish.
    let mut watcher = <sqlx::PgConnection as sqlx::Connection>::connect(&db.url).await.unwrap();
    let config = RelayConfig { claim_idle_timeout, ..RelayConfig::default() };
    let mut relay = Relay::new(db.pool.clone(), conn, fresh_keys(), config);
    let blocked = tokio::spawn(async move { relay.run_once().await });
    // Whether a session holds the outbox's position (its row lock's table lock), read from
    // the lock table: probing the row with `FOR UPDATE SKIP LOCKED` locked it for that
    // moment, and a relay taking the position just then found it held elsewhere and claimed
    // nothing (this test's flake on a loaded CI machine: 30 s waiting for a claim never made).
    // (Of this database: the test databases are copies of one template, so their tables
    // share object ids.)
    let held = "SELECT count(*) FROM pg_locks
                 WHERE locktype = 'relation' AND relation = 'relay_position'::regclass
                   AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
                   AND mode = 'RowShareLock' AND granted AND pid <> pg_backend_pid()";
    // Sessions of this (the test's own) database that Postgres ended with a FATAL error, as the
    // idle timeout ends the claim's: a claim that lived too briefly for any poll to meet it
    // open (a loaded machine, a one-second timeout) is still seen to have been ended.
    let ended = "SELECT sessions_fatal FROM pg_stat_database WHERE datname = current_database()";
    let ended_before: i64 = sqlx::query_scalar(ended).fetch_one(&mut watcher).await.unwrap();
    enum Seen {
        Open,
        /// Ended by Postgres; whether the relay was still blocked when that was seen.
        Ended {
            while_blocked: bool,
        },
    }
    let seen = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            if sqlx::query_scalar::<_, i64>(held).fetch_one(&mut watcher).await.unwrap() > 0 {
                return Seen::Open;
            }
            if sqlx::query_scalar::<_, i64>(ended).fetch_one(&mut watcher).await.unwrap() > ended_before {
                return Seen::Ended { while_blocked: !blocked.is_finished() };
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the relay never claimed the rows");
    // Hang guard, not a timing assertion: the question is which comes first, the rows free
    // again or the relay's publish giving up.
    let released_while_blocked = match seen {
        Seen::Ended { while_blocked } => while_blocked,
        Seen::Open => tokio::time::timeout(Duration::from_secs(60), async {
            loop {
                if blocked.is_finished() {
                    return false;
                }
                if sqlx::query_scalar::<_, i64>(held).fetch_one(&mut watcher).await.unwrap() == 0 {
                    return !blocked.is_finished();
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("neither the claim ended nor the publish gave up"),
    };
    assert!(released_while_blocked, "the claim stayed open until the silent relay's publish gave up");
    // The host wakes up: its publish goes through, its mark finds the session ended. That
    // is a retry (the rows are published again, deduplicated), never a reason to stop.
    private.thaw();
    let woke = blocked.await.unwrap();
    let err = woke.expect_err("the mark of a claim Postgres ended");
    assert!(err.is_transient(), "{err}");
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

on_single_and_cluster! {
async fn postponed_rows_are_not_lost_replay_work_and_repair_leaves_them_alone() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    park(&db, "paused", 6).await;
    sqlx::query("UPDATE embedding_dlq SET next_retry_at = now()").execute(&db.pool).await.unwrap();
    let mut redis = redis().await;
    embed_dlq::replay::ensure_group(&mut redis, &keys).await.unwrap();
    let r = reconciler(&db, &keys, immediate()).await;
    Scheduler::new(r.store.clone(), ReplayConfig::default(), redis.clone(), keys.clone()).run_once().await.unwrap();
    relay_all(&db, &keys).await;
    // The provider refuses the run (wrong key): the replayer postpones the rows uncharged.
    let locked =
        start_mock(MockConfig { api_key: Some("the-right-key".into()), ..MockConfig::default() }).await;
    let p = pipeline(&settings(&db, &locked)).await;
    let client = embed_dlq::streams::client(&redis_url()).unwrap();
    let mut rep = Replayer {
        name: "paused".into(),
        store: p.store.clone(),
        embedder: p.embedder.clone(),
        client: client.clone(),
        redis: redis.clone(),
        keys: keys.clone(),
        config: ReplayConfig {
            block: Duration::from_millis(200),
            systemic_pause: Duration::from_secs(600),
            ..Default::default()
        },
        paused_until: None,
    };
    let mut conn = embed_dlq::streams::blocking(&client, Duration::from_secs(1)).await.unwrap();
    let c = rep.read_once(&mut conn, &CancellationToken::new()).await.unwrap();
    assert_eq!(c.postponed, 6, "{c:?}");
    // The relay's maintenance trims the acknowledged entries away.
    embed_dlq::relay::trim_below_group_needs(&mut redis, &keys.replay()).await.unwrap();
    let state = || async {
        sqlx::query_as::<_, (i64, i32, chrono::DateTime<chrono::Utc>)>(
            "SELECT id, replays, next_retry_at FROM embedding_dlq ORDER BY id",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap()
    };
    let before = state().await;
    let outbox_before = db.count("SELECT count(*) FROM dlq_outbox").await;
    let mut r = r;
    let report = r.run_once(Mode::Check).await.unwrap();
    assert_eq!(report.get(Check::LostReplayWork).found, 0, "{report:#?}");
    let repaired = r.run_once(Mode::Repair).await.unwrap();
    assert_eq!(repaired.total_found(), 0, "{repaired:#?}");
    assert_eq!(state().await, before, "repair did not cancel the pause");
    assert_eq!(db.count("SELECT count(*) FROM dlq_outbox").await, outbox_before, "no new work item");
}
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

on_single_and_cluster! {
async fn replay_loops_stop_on_permanent_errors() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let r = reconciler(&db, &keys, immediate()).await;
    sqlx::query("ALTER TABLE replay_lease RENAME COLUMN lease_no TO lease_no_gone")
        .execute(&db.pool)
        .await
        .unwrap();
    let scheduler = Scheduler::new(r.store.clone(), ReplayConfig::default(), redis().await, keys.clone());
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
}

on_single_and_cluster! {
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

    let refused = redis::Client::open("redis://127.0.0.1:1/").unwrap();
    let err = refused.get_multiplexed_async_connection().await.unwrap_err();
    assert!(RelayError::from(err).is_transient(), "connection refused");
}
}

on_single_and_cluster! {
async fn published_events_missing_from_the_stream_are_found_and_republished() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    park(&db, "gone", 30).await;
    assert_eq!(relay_all(&db, &keys).await, 30);
    let mut redis = redis().await;
    let entries = events_on_stream(&keys).await;
    let key_of = |e: &redis::streams::StreamId| {
        let body: serde_json::Value =
            serde_json::from_str(&embed_dlq::streams::field(&e.map, "body").unwrap()).unwrap();
        format!("{}#{}", body["doc_id"].as_str().unwrap(), body["chunk_index"])
    };
    // An operator deletes two entries in the middle (a finding); then the length cap trims
    // the oldest 8 (policy, not a finding).
    let _: i64 = redis.xdel(keys.events(), &[&entries[15].id, &entries[22].id]).await.unwrap();
    let _: i64 =
        redis::cmd("XTRIM").arg(keys.events()).arg("MAXLEN").arg(20).query_async(&mut redis).await.unwrap();
    let config = ReconcileConfig { events_maxlen: 20, page: 7, ..immediate() };
    let mut r = reconciler(&db, &keys, config).await;
    let report = r.run_once(Mode::Check).await.unwrap();
    assert_eq!(report.get(Check::MissingEvents).found, 2, "{report:#?}");
    assert_eq!(report.get(Check::MissingEvents).examples, vec![key_of(&entries[15]), key_of(&entries[22])]);
    assert_eq!(
        report.get(Check::MissingEvents).note.as_deref(),
        Some("8 trimmed by the stream's length cap")
    );
    let dry = r.run_once(Mode::DryRun).await.unwrap();
    assert_eq!((dry.get(Check::MissingEvents).found, dry.get(Check::MissingEvents).repaired), (2, 0));
    let repaired = r.run_once(Mode::Repair).await.unwrap();
    assert_eq!(repaired.get(Check::MissingEvents).repaired, 2);
    assert_eq!(relay_all(&db, &keys).await, 2, "the markers did not swallow the republish");
    let clean = r.run_once(Mode::Check).await.unwrap();
    assert_eq!(clean.total_found(), 0, "{clean:#?}");
    let on_stream: Vec<String> = event_ids_on_stream(&keys).await;
    assert_eq!(on_stream.len(), 22);
    assert_eq!(on_stream.iter().collect::<HashSet<_>>().len(), 22, "each event once");

    // Redis loses everything: every event still in the outbox is found and republished.
    let _: i64 = redis.del(keys.events()).await.unwrap();
    let report = r.run_once(Mode::Repair).await.unwrap();
    assert_eq!(report.get(Check::MissingEvents).found, 30, "{report:#?}");
    assert_eq!(relay_all(&db, &keys).await, 30);
    assert_eq!(r.run_once(Mode::Check).await.unwrap().total_found(), 0);
}
}

on_single_and_cluster! {
async fn reconcile_pages_through_the_replay_stream() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    park(&db, "paged", 23).await;
    sqlx::query("UPDATE embedding_dlq SET next_retry_at = now()").execute(&db.pool).await.unwrap();
    let mut redis = redis().await;
    embed_dlq::replay::ensure_group(&mut redis, &keys).await.unwrap();
    let mut r = reconciler(&db, &keys, ReconcileConfig { page: 4, ..immediate() }).await;
    // An entry per row, so that pages of 4 entries split the work.
    let per_row = ReplayConfig { batch: 1, ..ReplayConfig::default() };
    Scheduler::new(r.store.clone(), per_row.clone(), redis.clone(), keys.clone()).run_once().await.unwrap();
    relay_all(&db, &keys).await;
    // Deliver 10 entries to a consumer (pending), leave 13 undelivered.
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(REPLAY_GROUP)
        .arg("c")
        .arg("COUNT")
        .arg(10)
        .arg("STREAMS")
        .arg(keys.replay())
        .arg(">")
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(r.run_once(Mode::Check).await.unwrap().total_found(), 0, "all work is outstanding");
    // Rows deleted by hand: 3 pending and 3 undelivered entries become orphans.
    sqlx::query("DELETE FROM embedding_dlq WHERE chunk_index IN (1, 5, 9, 12, 17, 22)")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("DELETE FROM ingest_manifest WHERE chunk_index IN (1, 5, 9, 12, 17, 22)")
        .execute(&db.pool)
        .await
        .unwrap();
    // Work lost across page boundaries: entries of 7 rows vanish from the stream.
    let all: redis::streams::StreamRangeReply = redis.xrange_all(keys.replay()).await.unwrap();
    let lost: Vec<&String> = [2, 3, 4, 13, 14, 15, 16].iter().map(|i| &all.ids[*i].id).collect();
    let _: i64 = redis.xack(keys.replay(), REPLAY_GROUP, &lost).await.unwrap();
    let _: i64 = redis.xdel(keys.replay(), &lost).await.unwrap();
    let report = r.run_once(Mode::Check).await.unwrap();
    assert_eq!(report.get(Check::OrphanStreamEntries).found, 6, "{report:#?}");
    assert_eq!(report.get(Check::LostReplayWork).found, 7, "{report:#?}");
    let repaired = r.run_once(Mode::Repair).await.unwrap();
    assert_eq!(repaired.get(Check::OrphanStreamEntries).repaired, 6);
    assert_eq!(repaired.get(Check::LostReplayWork).repaired, 7, "their leases released");
    let scheduler = Scheduler::new(r.store.clone(), per_row, redis.clone(), keys.clone());
    assert_eq!(scheduler.run_once().await.unwrap(), 7, "and their work issued again");
    relay_all(&db, &keys).await;
    assert_eq!(r.run_once(Mode::Check).await.unwrap().total_found(), 0);
    let len: usize = redis.xlen(keys.replay()).await.unwrap();
    assert_eq!(len, 23 - 7 - 6 + 7);
}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_deletes_in_bounded_batches_each_with_its_events() {
    let db = TestDb::new().await;
    park(&db, "purge", 25).await;
    park(&db, "keep", 3).await;
    let p = pipeline(&settings(&db, &start_mock(MockConfig::default()).await)).await;
    let filter = embed_dlq::dlq::Filter { doc: Some("purge".into()), ..Default::default() };
    assert_eq!(embed_dlq::dlq::purge_in_batches(&p.store, &filter, true, 10).await.unwrap(), 25);
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 28, "dry run");
    assert_eq!(embed_dlq::dlq::purge_in_batches(&p.store, &filter, false, 10).await.unwrap(), 25);
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 3);
    assert_eq!(db.count("SELECT count(*) FROM dlq_outbox WHERE event = 'purged'").await, 25);
    // One transaction per batch of at most 10 rows, each with its own events.
    let per_tx: Vec<i64> = sqlx::query_scalar(
        "SELECT count(*) FROM dlq_outbox WHERE event = 'purged' GROUP BY xmin::text ORDER BY 1 DESC",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(per_tx, vec![10, 10, 5]);
    assert_eq!(db.leaks().await, 0);
}

on_single_and_cluster! {
async fn requeue_never_sends_a_record_that_needs_a_corrected_payload() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let strict = start_mock(MockConfig { max_input_chars: 20, ..MockConfig::default() }).await;
    let mut corpus = String::new();
    corpus.push_str(&line("fix", 0, "a text longer than twenty characters"));
    corpus.push_str(&line("fix", 1, "another text longer than twenty characters"));
    corpus.push_str(&format!("{}\n", serde_json::json!({"doc_id": "fix", "chunk_index": 2})));
    pipeline(&settings(&db, &strict))
        .await
        .run(input(corpus.into_bytes()), CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq WHERE error_class = 'invalid_record'").await, 1);
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq WHERE error_class = 'permanent_input'").await, 2);
    // A row whose payload text is empty (written by an older version, or by hand).
    sqlx::query(
        "UPDATE embedding_dlq SET payload = jsonb_set(payload, '{text}', '\"\"') WHERE chunk_index = 1",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut redis = redis().await;
    embed_dlq::replay::ensure_group(&mut redis, &keys).await.unwrap();
    let p = pipeline(&settings(&db, &start_mock(MockConfig::default()).await)).await;
    let all = embed_dlq::dlq::Filter::default();
    let dry = embed_dlq::dlq::requeue(&p.store, &all, true, 100).await.unwrap();
    assert_eq!((dry.requeued, dry.needs_reingest), (1, 2));
    let done = embed_dlq::dlq::requeue(&p.store, &all, false, 100).await.unwrap();
    assert_eq!((done.requeued, done.needs_reingest), (1, 2));
    let scheduler = Scheduler::new(p.store.clone(), ReplayConfig::default(), redis.clone(), keys.clone());
    assert_eq!(scheduler.run_once().await.unwrap(), 1, "the scheduler issues the requeued row's work");
    assert_eq!(db.count("SELECT count(*) FROM dlq_outbox WHERE event = 'requeued'").await, 1);
    let (items, _) = replay_entries(&keys).await;
    assert_eq!(items.len(), 1, "one work item on the replay stream: {items:?}");
    assert_eq!(
        db.count("SELECT count(*) FROM embedding_dlq WHERE doc_id = 'fix' AND chunk_index = 0 AND error_class = 'transient'")
            .await,
        1
    );
    assert_eq!(
        db.count(
            "SELECT count(*) FROM embedding_dlq
              WHERE (chunk_index = 1 AND error_class = 'permanent_input')
                 OR (chunk_index = 2 AND error_class = 'invalid_record')"
        )
        .await,
        2,
        "left for re-ingest"
    );
}
}

/// Every event body keeps its keys and values now that the envelope is built by
/// `embed_dlq_event` (migration 0006): the function gives byte for byte the body the single
/// `jsonb_build_object` gave, and each event kind carries the envelope of its row plus its own
/// keys, no more, no less.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_bodies_keep_their_envelope_and_keys() {
    let db = TestDb::new().await;
    let same: bool = sqlx::query_scalar(
        "SELECT embed_dlq_event('parked', 7, 'public.t', 'd', 2, 9, jsonb_build_object('attempts', 3, 'at', now()))::text
              = jsonb_build_object('event', 'parked', 'dlq_id', 7::bigint, 'table', 'public.t', 'doc_id', 'd',
                                   'chunk_index', 2, 'generation', 9::bigint, 'attempts', 3, 'at', now())::text",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(same, "the envelope function must give the body the single jsonb_build_object gave");

    park(&db, "env", 3).await;
    let p = pipeline(&settings(&db, &start_mock(MockConfig::default()).await)).await;
    let one = embed_dlq::dlq::Filter { doc: Some("env".into()), ..Default::default() };
    let requeued = embed_dlq::dlq::requeue(&p.store, &one, false, 100_000).await.unwrap();
    assert_eq!(requeued.requeued, 3);
    assert_eq!(embed_dlq::dlq::purge(&p.store, &one, false).await.unwrap(), 3);

    // `seq` is added to every events-stream body by the outbox trigger (migration 0014).
    let envelope = ["event", "dlq_id", "table", "doc_id", "chunk_index", "generation", "seq"];
    let own = |event: &str| -> Vec<&'static str> {
        match event {
            "parked" => vec![
                "content_hash",
                "error_class",
                "error_reason",
                "attempts",
                "first_failed_at",
                "last_failed_at",
                "next_retry_at",
            ],
            "requeued" => vec!["error_reason", "attempts", "at"],
            "purged" => vec!["error_class", "error_reason", "attempts", "at"],
            other => panic!("unexpected event {other}"),
        }
    };
    let rows: Vec<(String, i64, String, String, i32, serde_json::Value)> = sqlx::query_as(
        "SELECT event, dlq_id, target_table, doc_id, chunk_index, body FROM dlq_outbox
          WHERE stream = 'events' ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let mut kinds = HashSet::new();
    for (event, dlq_id, table, doc_id, chunk_index, body) in rows {
        let keys: HashSet<&str> = body.as_object().unwrap().keys().map(String::as_str).collect();
        let expected: HashSet<&str> = envelope.iter().copied().chain(own(&event)).collect();
        assert_eq!(keys, expected, "{event}: {body}");
        assert_eq!(body["event"], event.as_str());
        assert_eq!(body["dlq_id"], dlq_id);
        assert_eq!(body["table"], table.as_str());
        assert_eq!(body["doc_id"], doc_id.as_str());
        assert_eq!(body["chunk_index"], chunk_index);
        assert!(body["generation"].is_i64(), "{body}");
        assert!(body["seq"].is_i64(), "{body}");
        kinds.insert(event);
    }
    assert_eq!(kinds, HashSet::from(["parked".to_string(), "requeued".into(), "purged".into()]));
}

/// A DLQ row's class is read as `ErrorClass`: `--json` shows the same spelling as the column,
/// and a class this build does not know (a newer schema, a hand-edited row) is an error for the
/// query that read it, never a panic nor a string that silently matches nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_rows_read_their_class_typed_and_refuse_an_unknown_one() {
    let db = TestDb::new().await;
    park(&db, "cls", 2).await;
    let p = pipeline(&settings(&db, &start_mock(MockConfig::default()).await)).await;
    let all = embed_dlq::dlq::Filter::default();
    let rows = embed_dlq::dlq::list(&p.store, &all, 10, 0).await.unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0].error_class, embed_dlq::model::ErrorClass::Transient);
    let json = serde_json::to_value(&rows[0]).unwrap();
    assert_eq!(json["error_class"], "transient");
    let stats = embed_dlq::dlq::stats(&p.store).await.unwrap();
    assert_eq!(serde_json::to_value(&stats).unwrap()["by_class"][0]["error_class"], "transient");

    sqlx::raw_sql(
        "ALTER TABLE embedding_dlq DROP CONSTRAINT embedding_dlq_error_class_check;
         UPDATE embedding_dlq SET error_class = 'from_the_future' WHERE id = (SELECT min(id) FROM embedding_dlq);",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let err = embed_dlq::dlq::list(&p.store, &all, 10, 0).await.unwrap_err();
    assert!(err.to_string().contains("from_the_future"), "{err}");
    assert!(matches!(err, embed_dlq::store::StoreError::Db(sqlx::Error::ColumnDecode { .. })), "{err:?}");
    assert!(embed_dlq::dlq::stats(&p.store).await.is_err());
}

/// The upgrade to the relay by commit order (migration 0022) over an outbox an older relay
/// left half published: what it published stays published (not added again, not walked by
/// the reconciler), and what it left is published once by the new relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upgrade_to_the_relay_by_commit_order_publishes_what_the_older_relay_left_once() {
    let db = TestDb::unmigrated().await;
    embed_dlq::store::MIGRATOR.run_to(21, &db.pool).await.unwrap();
    // Written by hand: the tool's own writers would migrate the database first.
    sqlx::query(
        "INSERT INTO dlq_outbox (event, doc_id, chunk_index, body, target_table)
         SELECT 'parked', 'upgrade', i, '{}', 'public.doc_embeddings' FROM generate_series(0, 6) i",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let keys = fresh_keys();
    // The older relay published the first three (its mark: `published_at`, `entry_id`).
    let mut r = redis().await;
    let first: Vec<(i64, String)> =
        sqlx::query_as("SELECT id, event_id::text FROM dlq_outbox ORDER BY id LIMIT 3")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    for (id, event_id) in &first {
        let entry: String = r.xadd(keys.events(), "*", &[("event_id", event_id.as_str())]).await.unwrap();
        sqlx::query("UPDATE dlq_outbox SET published_at = now(), entry_id = $2 WHERE id = $1")
            .bind(id)
            .bind(entry)
            .execute(&db.pool)
            .await
            .unwrap();
    }
    embed_dlq::store::migrate(&db.pool).await.unwrap();
    let mut relay = Relay::new(db.pool.clone(), redis().await, keys.clone(), RelayConfig::default());
    let published = relay_until_idle(&mut relay).await;
    assert_eq!(published, 4, "the four rows the older relay left");
    assert_eq!(unpublished(&db, &keys).await, Vec::<String>::new());
    let stream: Vec<String> = event_ids_on_stream(&keys).await;
    let outbox: Vec<String> = sqlx::query_scalar("SELECT event_id::text FROM dlq_outbox ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(stream, outbox, "each event once, in outbox order");
    let mut r = reconciler(&db, &keys, immediate()).await;
    let report = r.run_sweep(Mode::Check, Some(embed_dlq::reconcile::Sweep::Full)).await.unwrap();
    assert_eq!(report.get(Check::MissingEvents).found, 0, "{report:#?}");
    assert_eq!(report.get(Check::OutboxBacklog).found, 0, "{report:#?}");
}
