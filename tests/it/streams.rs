//! Outbox relay, replay through the consumer group, XAUTOCLAIM, crashes at the dangerous
//! points (real processes killed by failpoints), tail. Real Postgres, real Redis.

use std::collections::HashSet;
use std::process::Stdio;
use std::time::Duration;

use embed_dlq::ingest::Pipeline;
use embed_dlq::relay::{Relay, RelayConfig};
use embed_dlq::replay::{ReplayConfig, Replayer, Scheduler};
use embed_dlq::streams::{REPLAY_GROUP, StreamKeys};
use embed_dlq::testkit::mock_provider::{self, MockConfig, MockProvider};
use redis::AsyncCommands;
use tokio_util::sync::CancellationToken;

use crate::support::*;

/// Parks `n` chunks as transient (the provider is down), returns the pipeline used.
/// The keys [`park_transient`] parks: `doc` chunks `0..n`.
fn parked_keys(doc: &str, n: usize) -> std::collections::BTreeSet<(String, i32)> {
    (0..n as i32).map(|i| (doc.to_string(), i)).collect()
}

async fn park_transient(db: &TestDb, n: usize, doc: &str) -> (MockProvider, Pipeline) {
    let down = start_mock(MockConfig::default()).await;
    down.control.set_outage(true);
    let mut s = settings(db, &down);
    s.retry.max_attempts = 2;
    let p = pipeline(&s).await;
    let mut corpus = String::new();
    for i in 0..n {
        corpus.push_str(&line(doc, i as i32, &format!("{doc} chunk {i}")));
    }
    let r = p.run(input(corpus.into_bytes()), CancellationToken::new()).await.unwrap();
    assert_eq!(r.parked_total(), n as u64);
    (down, p)
}

fn replay_config() -> ReplayConfig {
    ReplayConfig {
        batch: 64,
        block: Duration::from_millis(200),
        min_idle: Duration::from_millis(300),
        ..Default::default()
    }
}

/// A replayer embedding through a healthy mock.
async fn replayer(
    db: &TestDb,
    mock: &MockProvider,
    keys: &StreamKeys,
    name: &str,
    config: ReplayConfig,
) -> Replayer {
    // Long enough that a loaded machine never times out a healthy answer (a resend would
    // count its inputs twice); a test that wants the client to give up sets its own.
    replayer_with_timeout(db, mock, keys, name, config, Duration::from_secs(5)).await
}

async fn replayer_with_timeout(
    db: &TestDb,
    mock: &MockProvider,
    keys: &StreamKeys,
    name: &str,
    config: ReplayConfig,
    timeout: Duration,
) -> Replayer {
    replayer_for(db, mock, keys, name, config, timeout).await
}

/// Schedules every due row and relays it into the replay stream.
/// A replayer blocked in `XREADGROUP` when its stream is deleted (a `FLUSHALL`, an operator's
/// `DEL`) gets `UNBLOCKED the stream key no longer exists` from Redis 7: it recreates the
/// group and carries on, as after a `NOGROUP`. It used to end with that error, and `serve`
/// with it: under load, where the replayer is more often blocked at that moment, nothing
/// republished what Redis lost until a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayer_blocked_when_its_stream_is_deleted_recreates_the_group_and_carries_on() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let private = PrivateRedis::start().await;
    let mock = start_mock(MockConfig::default()).await;
    let mut redis = private.manager().await;
    embed_dlq::replay::ensure_group(&mut redis, &keys).await.unwrap();
    let p = pipeline(&settings(&db, &mock)).await;
    let rep = Replayer {
        name: "blocked".into(),
        store: p.store,
        embedder: p.embedder,
        client: embed_dlq::streams::client(&private.url).unwrap(),
        redis: redis.clone(),
        keys: keys.clone(),
        config: ReplayConfig { block: Duration::from_secs(30), ..replay_config() },
        paused_until: None,
    };
    let stop = CancellationToken::new();
    let task = tokio::spawn(rep.run(stop.clone(), CancellationToken::new()));
    let blocked = async |redis: &mut embed_dlq::streams::RedisConn| {
        let clients: String = redis::cmd("CLIENT").arg("LIST").query_async(redis).await.unwrap();
        clients.lines().any(|c| c.contains("cmd=xreadgroup") && c.contains(" flags=b "))
    };
    wait_for("the replayer blocked in XREADGROUP", Duration::from_secs(30), async || {
        blocked(&mut redis).await
    })
    .await;
    let _: () = redis::cmd("DEL").arg(keys.replay()).query_async(&mut redis).await.unwrap();
    wait_for("the group back and the replayer blocked again", Duration::from_secs(30), async || {
        let groups: redis::RedisResult<redis::Value> =
            redis::cmd("XINFO").arg("GROUPS").arg(keys.replay()).query_async(&mut redis).await;
        groups.is_ok() && blocked(&mut redis).await
    })
    .await;
    assert!(!task.is_finished(), "the replayer ended: {:?}", task.await);
    stop.cancel();
    task.await.unwrap().expect("the replayer stops cleanly");
}

async fn enqueue_due(db: &TestDb, p: &Pipeline, keys: &StreamKeys) -> u64 {
    make_due(db).await;
    let mut r = redis().await;
    embed_dlq::replay::ensure_group(&mut r, keys).await.unwrap();
    let n = Scheduler::new(p.store.clone(), replay_config(), redis().await, keys.clone())
        .run_once()
        .await
        .unwrap();
    relay_all(db, keys).await;
    n
}

/// One read of `rep` (a batch of new entries, or nothing after its block time), processed.
async fn read_batch(rep: &mut Replayer) -> embed_dlq::replay::ReplayCounts {
    let client = embed_dlq::streams::client(&redis_url()).unwrap();
    let mut conn = embed_dlq::streams::blocking(&client, Duration::from_secs(1)).await.unwrap();
    rep.read_once(&mut conn, &CancellationToken::new()).await.unwrap()
}

/// Delivers every new entry of the replay stream to the consumer `name`, which never
/// acknowledges them (a consumer that died): they stay pending, soon idle.
async fn deliver_to_dead_consumer(keys: &StreamKeys, name: &str) {
    let mut r = redis().await;
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(REPLAY_GROUP)
        .arg(name)
        .arg("COUNT")
        .arg(100)
        .arg("STREAMS")
        .arg(keys.replay())
        .arg(">")
        .query_async(&mut r)
        .await
        .unwrap();
}

/// Work items pending in the replay group (delivered, not acknowledged): the items of every
/// pending entry, read and parsed here (an entry carries a batch of items). A pending entry
/// deleted from the stream counts as none.
async fn pending(keys: &StreamKeys) -> usize {
    let mut r = redis().await;
    let reply: redis::streams::StreamPendingCountReply = redis::cmd("XPENDING")
        .arg(keys.replay())
        .arg(REPLAY_GROUP)
        .arg("-")
        .arg("+")
        .arg(100_000)
        .query_async(&mut r)
        .await
        .unwrap();
    let mut items = 0;
    for p in reply.ids {
        let entry: redis::streams::StreamRangeReply =
            redis::cmd("XRANGE").arg(keys.replay()).arg(&p.id).arg(&p.id).query_async(&mut r).await.unwrap();
        for e in entry.ids {
            let body: String = e.get("body").expect("a work item has a body");
            let body: serde_json::Value = serde_json::from_str(&body).expect("a work item's body is JSON");
            items += body.get("items").and_then(|i| i.as_array()).map_or(1, Vec::len);
        }
    }
    items
}

async fn drain(r: &mut Replayer, db: &TestDb, secs: u64) {
    let client = embed_dlq::streams::client(&redis_url()).unwrap();
    let mut conn = embed_dlq::streams::blocking(&client, Duration::from_secs(1)).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    let cancel = CancellationToken::new();
    while db.count("SELECT count(*) FROM embedding_dlq").await > 0 {
        assert!(tokio::time::Instant::now() < deadline, "replay did not drain the DLQ");
        r.read_once(&mut conn, &cancel).await.unwrap();
    }
}

/// Waits (up to 30 s) until no other session of the test database holds a lock on `table`:
/// a killed process's transaction rolls back only once Postgres notices its connection is gone.
async fn locks_released(db: &TestDb, table: &str) {
    for _ in 0..600 {
        let held: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
              WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
                AND l.relation = $1::regclass",
        )
        .bind(table)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if held == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn serve_cmd(db: &TestDb, mock: &MockProvider, keys_prefix: &str) -> tokio::process::Command {
    let mut c = tokio::process::Command::new(env!("CARGO_BIN_EXE_embed-dlq"));
    c.arg("serve")
        .args(["--database-url", &db.url, "--redis-url", &redis_url(), "--base-url", &mock.base_url()])
        .args(["--model", "mock", "--stream-prefix", keys_prefix, "--request-timeout-ms", "2000"])
        .args(["--retry-base-ms", "5", "--retry-cap-ms", "50", "--relay-poll-ms", "100"])
        .env_remove("EMBED_DLQ_FAILPOINT")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    c
}

on_single_and_cluster! {
#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints (scripts/test.sh)")]
async fn relay_killed_after_xadd_republishes_every_row_exactly_once() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    park_transient(&db, 300, "relay").await;
    assert_eq!(unpublished(&db, &keys).await.len(), 300);
    let mock = start_mock(MockConfig::default()).await;
    let out = serve_cmd(&db, &mock, &prefix_of(&keys))
        .args(["--replayers", "0", "--relay-batch", "100"])
        .env("EMBED_DLQ_FAILPOINT", "relay_after_publish")
        .output()
        .await
        .unwrap();
    assert!(!out.status.success(), "the failpoint aborts the relay");
    assert!(String::from_utf8_lossy(&out.stderr).contains("failpoint relay_after_publish"));
    let mut r = redis().await;
    let len: usize = r.xlen(keys.events()).await.unwrap();
    assert_eq!(len, 100, "one batch was added to the stream before the crash");
    // The dead relay's backend holds the outbox's position (its transaction rolls back, the
    // position where it was) until Postgres notices the connection is gone.
    locks_released(&db, "relay_position").await;

    let published = relay_all(&db, &keys).await;
    assert_eq!(published, 200, "the 100 already in the stream were recognised, not added again");
    assert_eq!(unpublished(&db, &keys).await, Vec::<String>::new());
    let entries: redis::streams::StreamRangeReply = r.xrange_all(keys.events()).await.unwrap();
    let ids: Vec<String> =
        entries.ids.iter().map(|e| embed_dlq::streams::field(&e.map, "outbox_id").unwrap()).collect();
    let unique: HashSet<&String> = ids.iter().collect();
    assert_eq!(ids.len(), 300);
    assert_eq!(unique.len(), 300, "no outbox row appears twice");
    // Stream order follows outbox order.
    let nums: Vec<i64> = ids.iter().map(|s| s.parse().unwrap()).collect();
    assert!(nums.windows(2).all(|w| w[0] < w[1]));
}
}

/// The rows' `(dlq_id, lease_no)` of the leases in Postgres, read here (not through the
/// product's statements).
async fn leases(db: &TestDb) -> std::collections::BTreeSet<(i64, i64)> {
    sqlx::query_as::<_, (i64, i64)>("SELECT dlq_id, lease_no FROM replay_lease")
        .fetch_all(&db.pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

/// The `(dlq_id, lease)` every work item on the replay streams names, parsed here.
fn items_of(bodies: &[serde_json::Value]) -> Vec<(i64, i64)> {
    bodies.iter().map(|b| (b["dlq_id"].as_i64().unwrap(), b["lease"].as_i64().unwrap())).collect()
}

on_single_and_cluster! {
async fn a_replayer_prepares_the_next_batch_while_the_one_before_commits() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let (_down, p) = park_transient(&db, 128, "pipe").await;
    assert_eq!(enqueue_due(&db, &p, &keys).await, 128);
    let mock = start_mock(MockConfig::default()).await;
    let mut rep = replayer(&db, &mock, &keys, "pipe", replay_config()).await;
    let client = embed_dlq::streams::client(&redis_url()).unwrap();
    let mut conn = embed_dlq::streams::blocking(&client, Duration::from_secs(1)).await.unwrap();
    let (never, mut flight) = (CancellationToken::new(), embed_dlq::replay::InFlight::default());
    let charged = || db.count("SELECT count(*) FROM replay_lease WHERE loads = 1");
    // Step 1: the first 64 are loaded, charged and embedded; nothing is committed.
    let c = rep.step(&mut conn, &never, &never, &mut flight).await.unwrap();
    assert_eq!(c.replayed, 0);
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 128);
    assert_eq!((charged().await, mock.control.stats().inputs), (64, 64));
    // Step 2: the first batch commits while the second is prepared.
    let c = rep.step(&mut conn, &never, &never, &mut flight).await.unwrap();
    assert_eq!(c.replayed, 64);
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 64);
    assert_eq!((charged().await, mock.control.stats().inputs), (64, 128), "the second batch is charged");
    assert_eq!(pending(&keys).await, 64, "the committed batch is acknowledged, the other not yet");
    // Step 3: nothing new; the batch in hand commits.
    let c = rep.step(&mut conn, &never, &never, &mut flight).await.unwrap();
    assert_eq!(c.replayed, 64);
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
    assert_eq!((pending(&keys).await, db.count("SELECT count(*) FROM doc_embeddings").await), (0, 128));
    assert_eq!(rep.finish(&mut flight).await.unwrap(), embed_dlq::replay::ReplayCounts::default());
}
}

#[tokio::test]
async fn every_events_seq_is_its_outbox_rows_id_replayed_ones_included() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let (_down, p) = park_transient(&db, 70, "seq").await;
    enqueue_due(&db, &p, &keys).await;
    let mock = start_mock(MockConfig::default()).await;
    let mut rep = replayer(&db, &mock, &keys, "seq", replay_config()).await;
    drain(&mut rep, &db, 60).await;
    let rows: Vec<(i64, String, serde_json::Value)> =
        sqlx::query_as("SELECT id, event, body FROM dlq_outbox WHERE stream = 'events' ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let count = |event: &str| rows.iter().filter(|(_, e, _)| e == event).count();
    assert_eq!((count("parked"), count("replayed")), (70, 70));
    for (id, event, body) in &rows {
        assert_eq!(body["seq"].as_i64(), Some(*id), "{event}: {body}");
        assert_eq!(body["event"].as_str(), Some(event.as_str()), "{body}");
    }
    // A replayed event's envelope: the common fields and its own.
    let (_, _, replayed) = rows.iter().find(|(_, e, _)| e == "replayed").unwrap();
    let keys: std::collections::BTreeSet<&str> =
        replayed.as_object().unwrap().keys().map(String::as_str).collect();
    let expected = [
        "at",
        "attempts",
        "chunk_index",
        "dlq_id",
        "doc_id",
        "error_class",
        "event",
        "generation",
        "replays",
        "seq",
        "table",
    ];
    assert_eq!(keys, expected.into_iter().collect(), "{replayed}");
}

on_single_and_cluster! {
async fn the_scheduler_appends_work_items_itself_with_no_outbox_row_and_no_relay() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let (_down, p) = park_transient(&db, 12, "direct").await;
    make_due(&db).await;
    let mut r = redis().await;
    embed_dlq::replay::ensure_group(&mut r, &keys).await.unwrap();
    let scheduler = Scheduler::new(p.store.clone(), replay_config(), r.clone(), keys.clone());
    assert_eq!(scheduler.run_once().await.unwrap(), 12);
    // No relay ran: each leased row's item is on the stream, naming its lease.
    let (bodies, added) = replay_entries(&keys).await;
    let items = items_of(&bodies);
    assert_eq!((items.len(), added), (12, 1), "one entry for the batch: {bodies:?}");
    assert_eq!(items.iter().copied().collect::<std::collections::BTreeSet<_>>(), leases(&db).await);
    assert_eq!(db.count("SELECT count(*) FROM dlq_outbox WHERE stream = 'replay'").await, 0, "no outbox row");
    // A second pass issues nothing while the leases live.
    assert_eq!(scheduler.run_once().await.unwrap(), 0);
    assert_eq!(replay_entries(&keys).await.1, 1);
    // And the replayers drain them.
    let mock = start_mock(MockConfig::default()).await;
    let mut rep = replayer(&db, &mock, &keys, "direct", replay_config()).await;
    drain(&mut rep, &db, 60).await;
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 12);
    assert_eq!(mock.control.stats().inputs, 12, "each row embedded once");
    // A settled entry is deleted with its acknowledgement: the stream keeps outstanding work.
    let len: usize = r.xlen(keys.replay()).await.unwrap();
    assert_eq!(len, 0, "the settled batch's entry is gone");
}
}

on_single_and_cluster! {
#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints (scripts/test.sh)")]
async fn a_scheduler_killed_between_its_appends_and_its_commit_leaves_items_that_replay_each_row_once() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let (_down, p) = park_transient(&db, 40, "sched").await;
    make_due(&db).await;
    let mut r = redis().await;
    embed_dlq::replay::ensure_group(&mut r, &keys).await.unwrap();
    let mock = start_mock(MockConfig::default()).await;
    let out = serve_cmd(&db, &mock, &prefix_of(&keys))
        .args(["--replayers", "0"])
        .env("EMBED_DLQ_FAILPOINT", "schedule_after_publish")
        .output()
        .await
        .unwrap();
    assert!(!out.status.success(), "the failpoint aborts the scheduler");
    assert!(String::from_utf8_lossy(&out.stderr).contains("failpoint schedule_after_publish"));
    let (orphans, _) = replay_entries(&keys).await;
    assert_eq!(orphans.len(), 40, "the items were appended before the crash");
    // The dead scheduler's transaction rolls back once Postgres sees its connection gone.
    locks_released(&db, "replay_lease").await;
    assert!(leases(&db).await.is_empty(), "no lease committed without its commit");

    // The next pass issues the rows again; the orphaned items ahead of the new ones in the
    // stream are of no lease the rows hold, so each row is replayed once, by its new item.
    let scheduler = Scheduler::new(p.store.clone(), replay_config(), r.clone(), keys.clone());
    assert_eq!(scheduler.run_once().await.unwrap(), 40);
    let (bodies, _) = replay_entries(&keys).await;
    let issued: std::collections::BTreeSet<(i64, i64)> = items_of(&bodies[40..]).into_iter().collect();
    assert_eq!(issued, leases(&db).await, "the new items are the live leases'");
    let mut rep = replayer(&db, &mock, &keys, "after-crash", replay_config()).await;
    drain(&mut rep, &db, 60).await;
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 40);
    assert_eq!(mock.control.stats().inputs, 40, "no row embedded twice");
    assert_eq!(db.count("SELECT count(*) FROM dlq_outbox WHERE event = 'replayed'").await, 40);
}
}

/// Whether `table` is one Postgres empties in its crash recovery (and a standby never holds):
/// read from the catalog here.
async fn unlogged(db: &TestDb, table: &str) -> bool {
    sqlx::query_scalar::<_, String>("SELECT relpersistence::text FROM pg_class WHERE oid = $1::regclass")
        .bind(table)
        .fetch_one(&db.pool)
        .await
        .unwrap()
        == "u"
}

/// Replay leases are unlogged (migration 0024): a crash of Postgres, or a failover, empties
/// `replay_lease` and nothing else. The test empties it the same way crash recovery does
/// (`TRUNCATE`: an unlogged table comes back from its empty init fork) at the two moments that
/// matter: with the work items on the stream and no replayer yet, and again after a replayer
/// has loaded (charged) a batch. The promise: the rows are issued again at the next pass, not
/// a lease later; each row is replayed once and embedded once; nothing is charged to
/// a row for the lost leases; no lease outlives the drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_lost_with_a_postgres_crash_are_issued_again_at_once_and_each_row_replays_once() {
    let db = TestDb::new().await;
    assert!(unlogged(&db, "replay_lease").await, "a crash of Postgres empties the leases");
    assert!(!unlogged(&db, "embedding_dlq").await && !unlogged(&db, "ingest_manifest").await);
    let keys = fresh_keys();
    let (_down, p) = park_transient(&db, 40, "crash").await;
    make_due(&db).await;
    let mut r = redis().await;
    embed_dlq::replay::ensure_group(&mut r, &keys).await.unwrap();
    // Leases far longer than the test: only the loss of the leases can free the rows early.
    let config = ReplayConfig { lease: Duration::from_secs(3600), ..replay_config() };
    let scheduler = Scheduler::new(p.store.clone(), config.clone(), r.clone(), keys.clone());
    assert_eq!(scheduler.run_once().await.unwrap(), 40);
    let first: std::collections::BTreeSet<(i64, i64)> =
        items_of(&replay_entries(&keys).await.0).into_iter().collect();
    assert_eq!(first, leases(&db).await);

    // The crash, with the items on the stream and unread.
    sqlx::query("TRUNCATE replay_lease").execute(&db.pool).await.unwrap();
    assert_eq!(scheduler.run_once().await.unwrap(), 40, "the rows are issued again at the next pass");
    let (bodies, entries) = replay_entries(&keys).await;
    assert_eq!(entries, 2, "{bodies:?}");
    let second: std::collections::BTreeSet<(i64, i64)> = items_of(&bodies[40..]).into_iter().collect();
    assert_eq!(second, leases(&db).await, "the live leases are the new items'");
    assert!(first.is_disjoint(&second), "a lease number is never handed out twice");

    // A replayer reads the lost leases' entry: every item of it is an older lease's, skipped
    // and charged nothing.
    let mock = start_mock(MockConfig::default()).await;
    let mut rep =
        replayer(&db, &mock, &keys, "after-crash", ReplayConfig { batch: 40, ..config.clone() }).await;
    let client = embed_dlq::streams::client(&redis_url()).unwrap();
    let mut conn = embed_dlq::streams::blocking(&client, Duration::from_secs(1)).await.unwrap();
    let (never, mut flight) = (CancellationToken::new(), embed_dlq::replay::InFlight::default());
    let charged = || db.count("SELECT coalesce(sum(loads), 0) FROM replay_lease");
    rep.step(&mut conn, &never, &never, &mut flight).await.unwrap();
    assert_eq!((charged().await, mock.control.stats().inputs), (0, 0));
    // Then the new items' entry: loaded, charged, embedded; the crash comes again before the
    // commit. The commit is fenced by each row's generation and hash, not by its lease.
    rep.step(&mut conn, &never, &never, &mut flight).await.unwrap();
    assert_eq!((charged().await, mock.control.stats().inputs), (40, 40));
    sqlx::query("TRUNCATE replay_lease").execute(&db.pool).await.unwrap();
    let c = rep.step(&mut conn, &never, &never, &mut flight).await.unwrap();
    assert_eq!(c.replayed, 40, "{c:?}");
    assert_eq!(rep.finish(&mut flight).await.unwrap(), embed_dlq::replay::ReplayCounts::default());

    // Items whose leases were lost and not issued again yet: the load takes each lease over
    // (one load charged, as for any load), and the next pass has nothing to issue.
    let (_down, _) = park_transient(&db, 20, "crash-b").await;
    make_due(&db).await;
    assert_eq!(scheduler.run_once().await.unwrap(), 20);
    sqlx::query("TRUNCATE replay_lease").execute(&db.pool).await.unwrap();
    rep.step(&mut conn, &never, &never, &mut flight).await.unwrap();
    assert_eq!((charged().await, mock.control.stats().inputs), (20, 60), "taken over, charged once");
    assert_eq!(scheduler.run_once().await.unwrap(), 0, "the taken-over leases are live");
    let c = rep.step(&mut conn, &never, &never, &mut flight).await.unwrap();
    assert_eq!(c.replayed, 20, "{c:?}");
    assert_eq!(rep.finish(&mut flight).await.unwrap(), embed_dlq::replay::ReplayCounts::default());

    // Read here: every key one vector, each row replayed once, embedded once.
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 60);
    assert_eq!(db.count("SELECT count(DISTINCT (doc_id, chunk_index)) FROM doc_embeddings").await, 60);
    assert_eq!(db.count("SELECT count(*) FROM dlq_outbox WHERE event = 'replayed'").await, 60);
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest WHERE status <> 'stored'").await, 0);
    assert_eq!(mock.control.stats().inputs, 60, "no row embedded twice");
    assert_eq!(db.count("SELECT count(*) FROM replay_lease").await, 0, "no lease outlives the drain");
    assert_eq!(pending(&keys).await, 0);
}

on_single_and_cluster! {
#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints (scripts/test.sh)")]
async fn a_load_renews_a_lease_only_once_less_than_half_of_it_is_left() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let (_down, p) = park_transient(&db, 4, "renew").await;
    make_due(&db).await;
    let mut r = redis().await;
    embed_dlq::replay::ensure_group(&mut r, &keys).await.unwrap();
    let config = ReplayConfig { lease: Duration::from_secs(1000), ..replay_config() };
    assert_eq!(Scheduler::new(p.store.clone(), config, r.clone(), keys.clone()).run_once().await.unwrap(), 4);
    // Two leases with a tenth of their time left, two fresh ones.
    sqlx::query(
        "UPDATE replay_lease SET leased_until = now() + interval '100 seconds'
          WHERE dlq_id IN (SELECT dlq_id FROM replay_lease ORDER BY dlq_id LIMIT 2)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let read = || async {
        sqlx::query_as::<_, (i64, f64, i32)>(
            "SELECT dlq_id, extract(epoch FROM leased_until)::float8, loads FROM replay_lease ORDER BY dlq_id",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap()
    };
    let before = read().await;
    let hot = || db.count("SELECT n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'replay_lease'");
    let hot_before = hot().await;
    // A replayer loads (charges) the four items and dies before embedding them.
    let mock = start_mock(MockConfig::default()).await;
    let out = serve_cmd(&db, &mock, &prefix_of(&keys))
        .args(["--replayers", "1", "--replay-lease-secs", "1000"])
        .env("EMBED_DLQ_FAILPOINT", "replay_before_embed")
        .output()
        .await
        .unwrap();
    assert!(!out.status.success(), "the failpoint aborts the replayer");
    let after = read().await;
    assert_eq!(after.iter().map(|l| l.2).collect::<Vec<_>>(), [1, 1, 1, 1], "each item charged once");
    for (b, a) in before.iter().zip(&after).take(2) {
        assert!(a.1 >= b.1 + 800.0, "a lease with a tenth left is renewed in full: {b:?} -> {a:?}");
    }
    for (b, a) in before.iter().zip(&after).skip(2) {
        assert_eq!(a.1, b.1, "a fresh lease is left alone");
    }
    // Charging a fresh lease changes no indexed column: Postgres updates it in place.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while hot().await < hot_before + 2 {
        assert!(tokio::time::Instant::now() < deadline, "no heap-only update of the fresh leases");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
}

on_single_and_cluster! {
#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints (scripts/test.sh)")]
async fn replayer_killed_after_commit_leaves_a_redelivery_that_is_a_no_op() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let (_down, p) = park_transient(&db, 50, "ac").await;
    assert_eq!(enqueue_due(&db, &p, &keys).await, 50);
    let mock = start_mock(MockConfig::default()).await;
    let out = serve_cmd(&db, &mock, &prefix_of(&keys))
        .args(["--replayers", "1", "--replay-batch", "64", "--min-idle-ms", "60000"])
        .env("EMBED_DLQ_FAILPOINT", "replay_after_commit")
        .output()
        .await
        .unwrap();
    assert!(!out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0, "committed before the crash");
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 50);
    assert_eq!(pending(&keys).await, 50, "never acknowledged");
    let before: Vec<String> = sqlx::query_scalar(
        "SELECT doc_id || chunk_index || updated_at || xmin FROM doc_embeddings ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let embedded = mock.control.stats().inputs;

    let mut other = replayer(&db, &mock, &keys, "survivor", replay_config()).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let c = other.reclaim_once(&CancellationToken::new()).await.unwrap();
    assert_eq!((c.reclaimed, c.skipped, c.replayed), (50, 50, 0), "{c:?}");
    assert_eq!(pending(&keys).await, 0);
    assert_eq!(mock.control.stats().inputs, embedded, "no re-embedding for settled rows");
    let after: Vec<String> = sqlx::query_scalar(
        "SELECT doc_id || chunk_index || updated_at || xmin FROM doc_embeddings ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(before, after, "the redelivery changed no vector row");
    assert_corpus_accounted(&db, &parked_keys("ac", 50)).await;
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest WHERE status = 'stored'").await, 50);
    assert_eq!(db.count("SELECT count(*) FROM dlq_outbox WHERE event = 'replayed'").await, 50);
}
}

on_single_and_cluster! {
#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints (scripts/test.sh)")]
async fn replayer_killed_before_commit_is_taken_over_with_xautoclaim() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let (_down, p) = park_transient(&db, 40, "bc").await;
    enqueue_due(&db, &p, &keys).await;
    let mock = start_mock(MockConfig::default()).await;
    let out = serve_cmd(&db, &mock, &prefix_of(&keys))
        .args(["--replayers", "1", "--replay-batch", "64"])
        .env("EMBED_DLQ_FAILPOINT", "replay_before_commit")
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 40, "nothing committed");
    assert_eq!(pending(&keys).await, 40);

    let mut other = replayer(&db, &mock, &keys, "survivor", replay_config()).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let c = other.reclaim_once(&CancellationToken::new()).await.unwrap();
    assert_eq!((c.reclaimed, c.replayed), (40, 40), "{c:?}");
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 40);
    assert_eq!(pending(&keys).await, 0);
    assert_eq!(db.leaks().await, 0);
    assert_eq!(db.manifest_disagreements().await, 0);
}
}

on_single_and_cluster! {
async fn a_long_batch_is_not_stolen_while_its_owner_is_alive() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let (_down, p) = park_transient(&db, 10, "slow").await;
    enqueue_due(&db, &p, &keys).await;
    // Each replay request takes 4 s, four times the min-idle time; the owner's keepalive
    // (every min-idle / 3) has a whole second to be scheduled, as a loaded machine needs.
    let slow = start_mock(MockConfig { latency_ms: 4_000, ..MockConfig::default() }).await;
    let config = ReplayConfig { min_idle: Duration::from_millis(1_000), ..replay_config() };
    let mut owner =
        replayer_with_timeout(&db, &slow, &keys, "owner", config.clone(), Duration::from_secs(10)).await;
    let mut thief = replayer(&db, &slow, &keys, "thief", config).await;
    let owner_task = tokio::spawn(async move {
        let client = embed_dlq::streams::client(&redis_url()).unwrap();
        let mut conn = embed_dlq::streams::blocking(&client, Duration::from_secs(1)).await.unwrap();
        owner.read_once(&mut conn, &CancellationToken::new()).await.unwrap()
    });
    let mut stolen = 0;
    for _ in 0..12 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        stolen += thief.reclaim_once(&CancellationToken::new()).await.unwrap().reclaimed;
    }
    let c = owner_task.await.unwrap();
    assert_eq!(stolen, 0, "the owner's claim was kept fresh");
    assert_eq!(c.replayed, 10);
    assert_eq!(slow.control.stats().inputs, 10, "every item embedded exactly once");
    assert_eq!(pending(&keys).await, 0);
}
}

on_single_and_cluster! {
#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints (scripts/test.sh)")]
async fn an_input_that_kills_its_replayer_is_exhausted_after_the_cap_not_looped() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let (_down, p) = park_transient(&db, 5, "cap").await;
    enqueue_due(&db, &p, &keys).await;
    // A consumer that takes the entries and dies without loading them: Redis counts a
    // delivery, Postgres nothing, so it is never charged to the rows.
    deliver_to_dead_consumer(&keys, "ghost").await;
    // Replayers that die every time they begin to replay the batch (after loading its rows,
    // before the provider call), as on an input that crashes the process.
    let mock = start_mock(MockConfig::default()).await;
    let mut crashes = 0;
    while db.count("SELECT count(*) FROM embedding_dlq WHERE exhausted_at IS NOT NULL").await < 5 {
        assert!(crashes <= 3, "still not exhausted after {crashes} crashes");
        let mut child = serve_cmd(&db, &mock, &prefix_of(&keys))
            .args(["--replayers", "1", "--min-idle-ms", "300", "--delivery-cap", "2"])
            .env("EMBED_DLQ_FAILPOINT", "replay_before_embed")
            .spawn()
            .unwrap();
        let exited = tokio::time::timeout(Duration::from_secs(20), child.wait()).await;
        match exited {
            Ok(status) => {
                assert!(!status.unwrap().success(), "the failpoint aborts");
                crashes += 1;
            }
            // Alive: it exhausted the rows instead of beginning them again.
            Err(_) => {
                let _ = child.kill().await;
            }
        }
    }
    assert_eq!(crashes, 2, "loads 1 and 2 crash; the third load is past delivery cap 2");
    assert_eq!(mock.control.stats().requests, 0, "given up without a provider call");
    assert_eq!(
        db.count(
            "SELECT count(*) FROM embedding_dlq WHERE exhausted_at IS NOT NULL AND next_retry_at IS NULL
                AND exhausted_reason LIKE 'replay begun 3 times without an outcome%'"
        )
        .await,
        5
    );
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest WHERE status = 'exhausted'").await, 5);
    assert_eq!(db.count("SELECT count(*) FROM dlq_outbox WHERE event = 'exhausted'").await, 5);
    // The scheduler never picks them up again.
    make_due(&db).await;
    assert_eq!(Scheduler::new(p.store.clone(), replay_config(), redis().await, keys.clone()).run_once().await.unwrap(), 0);
}
}

on_single_and_cluster! {
async fn a_replayer_that_stalled_does_not_take_back_what_another_reclaimed() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let (_down, p) = park_transient(&db, 6, "stalled").await;
    enqueue_due(&db, &p, &keys).await;
    // The owner's batch takes 2 s; its keepalive refreshes every 200 ms (min-idle / 3).
    let slow = start_mock(MockConfig { latency_ms: 2_000, ..MockConfig::default() }).await;
    let config = ReplayConfig { min_idle: Duration::from_millis(600), ..replay_config() };
    let mut owner =
        replayer_with_timeout(&db, &slow, &keys, "owner", config, Duration::from_secs(10)).await;
    let owner_task = tokio::spawn(async move {
        let client = embed_dlq::streams::client(&redis_url()).unwrap();
        let mut conn = embed_dlq::streams::blocking(&client, Duration::from_secs(1)).await.unwrap();
        owner.read_once(&mut conn, &CancellationToken::new()).await.unwrap()
    });
    // The owner holds the batch once it has read it (its 2 s request keeps it held).
    wait_for("the owner holds the batch", Duration::from_secs(30), async || pending(&keys).await == 6).await;
    // Another replayer takes the entries over, as it would after the owner stalled past
    // min-idle (forced here with min-idle 0).
    let mut r = redis().await;
    let _: redis::Value = redis::cmd("XAUTOCLAIM")
        .arg(keys.replay())
        .arg(REPLAY_GROUP)
        .arg("reclaimer")
        .arg(0)
        .arg("0-0")
        .arg("COUNT")
        .arg(100)
        .arg("JUSTID")
        .query_async(&mut r)
        .await
        .unwrap();
    // Several of the owner's keepalive periods later, the entries are still the reclaimer's.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let owners: redis::streams::StreamPendingCountReply = redis::cmd("XPENDING")
        .arg(keys.replay())
        .arg(REPLAY_GROUP)
        .arg("-")
        .arg("+")
        .arg(100)
        .query_async(&mut r)
        .await
        .unwrap();
    let by: HashSet<String> = owners.ids.iter().map(|p| p.consumer.clone()).collect();
    assert_eq!(by, HashSet::from(["reclaimer".to_string()]), "the stalled owner took entries back: {by:?}");
    // The owner still finishes its batch: the commit is fenced by Postgres, not by Redis.
    let c = owner_task.await.unwrap();
    assert_eq!(c.replayed, 6, "{c:?}");
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
}
}

/// Replays `doc` until the scheduler has nothing left to enqueue; returns the passes made.
async fn replay_until_settled(db: &TestDb, p: &Pipeline, keys: &StreamKeys, rep: &mut Replayer) -> usize {
    let client = embed_dlq::streams::client(&redis_url()).unwrap();
    let mut conn = embed_dlq::streams::blocking(&client, Duration::from_secs(1)).await.unwrap();
    for pass in 0..20 {
        if enqueue_due(db, p, keys).await == 0 {
            return pass;
        }
        rep.read_once(&mut conn, &CancellationToken::new()).await.unwrap();
    }
    panic!("still replaying after 20 passes: a loop");
}

on_single_and_cluster! {
async fn failing_replays_end_permanent_or_exhausted_never_forever() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let config = ReplayConfig {
        schedule: embed_dlq::embed::retry::DlqSchedule { max_replays: 4, ..Default::default() },
        ..replay_config()
    };
    // A chunk the server fails with 500 every time (parked during an outage first).
    let (_down, p) = park_transient(&db, 1, &format!("bad500 {}", mock_provider::POISON_500)).await;
    let failing = start_mock(MockConfig::default()).await;
    let mut rep = replayer(&db, &failing, &keys, "r", config.clone()).await;
    let passes = replay_until_settled(&db, &p, &keys, &mut rep).await;
    assert_eq!(passes, 3, "reclassified after three identical 500s, before the replay cap of 4");
    let (class, reason, next): (String, String, Option<chrono::DateTime<chrono::Utc>>) =
        sqlx::query_as("SELECT error_class, error_reason, next_retry_at FROM embedding_dlq")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((class.as_str(), reason.as_str(), next), ("permanent_input", "repeated_http_500", None));

    // A chunk that meets an outage on every pass: exhausted at the replay cap.
    sqlx::query("DELETE FROM embedding_dlq").execute(&db.pool).await.unwrap();
    let (_down2, p2) = park_transient(&db, 1, "outage").await;
    failing.control.set_outage(true);
    let passes = replay_until_settled(&db, &p2, &keys, &mut rep).await;
    assert_eq!(passes, 4);
    let (exhausted, status): (bool, String) = sqlx::query_as(
        "SELECT d.exhausted_at IS NOT NULL, m.status FROM embedding_dlq d JOIN ingest_manifest m USING (doc_id, chunk_index)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(exhausted);
    assert_eq!(status, "exhausted");
    assert_eq!(pending(&keys).await, 0);
}
}

on_single_and_cluster! {
async fn three_replayers_drain_10k_parked_items_each_exactly_once() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let (_down, p) = park_transient(&db, 10_000, "bulk").await;
    assert_eq!(enqueue_due(&db, &p, &keys).await, 10_000);
    let mock = start_mock(MockConfig::default()).await;
    let mut tasks = Vec::new();
    for n in 0..3 {
        let mut rep = replayer(&db, &mock, &keys, &format!("r{n}"), replay_config()).await;
        let pool = db.pool.clone();
        tasks.push(tokio::spawn(async move {
            let client = embed_dlq::streams::client(&redis_url()).unwrap();
            let mut conn = embed_dlq::streams::blocking(&client, Duration::from_millis(200)).await.unwrap();
            let mut replayed = 0;
            let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
            loop {
                let left: i64 =
                    sqlx::query_scalar("SELECT count(*) FROM embedding_dlq").fetch_one(&pool).await.unwrap();
                if left == 0 {
                    return replayed;
                }
                assert!(tokio::time::Instant::now() < deadline, "drain timed out");
                replayed += rep.read_once(&mut conn, &CancellationToken::new()).await.unwrap().replayed;
            }
        }));
    }
    let mut per_replayer = Vec::new();
    for t in tasks {
        per_replayer.push(t.await.unwrap());
    }
    assert_eq!(per_replayer.iter().sum::<u64>(), 10_000, "{per_replayer:?}");
    assert!(per_replayer.iter().filter(|n| **n > 0).count() >= 2, "work was shared: {per_replayer:?}");
    assert_eq!(mock.control.stats().inputs, 10_000, "each item embedded exactly once");
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 10_000);
    assert_corpus_accounted(&db, &parked_keys("bulk", 10_000)).await;
    assert_eq!(db.leaks().await, 0);
    assert_eq!(db.manifest_disagreements().await, 0);
    assert_eq!(pending(&keys).await, 0);
}
}

on_single_and_cluster! {
async fn tail_prints_every_park_in_order_and_resumes_without_gaps() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    park_transient(&db, 30, "tail").await;
    relay_all(&db, &keys).await;
    let dir = std::env::temp_dir().join(format!("embed-dlq-tail-{}", rand::random::<u64>()));
    std::fs::create_dir_all(&dir).unwrap();
    let checkpoint = dir.join("tail.checkpoint");
    let opts = |count: Option<u64>, no_follow: bool| embed_dlq::tail::TailOptions {
        from: "0".into(),
        checkpoint: Some(checkpoint.clone()),
        count,
        no_follow,
        on_gap: embed_dlq::tail::OnGap::Fail,
    };
    let mut first: Vec<embed_dlq::tail::TailEvent> = Vec::new();
    let n = embed_dlq::tail::tail(
        &redis_client(),
        &keys,
        &opts(Some(10), false),
        &mut first,
        CancellationToken::new(),
    )
    .await
    .unwrap();
    assert_eq!(n, 10);
    // "Restart": a new tail from the same checkpoint.
    let mut second: Vec<embed_dlq::tail::TailEvent> = Vec::new();
    let n = embed_dlq::tail::tail(
        &redis_client(),
        &keys,
        &opts(None, true),
        &mut second,
        CancellationToken::new(),
    )
    .await
    .unwrap();
    assert_eq!(n, 20);
    let lines: Vec<serde_json::Value> = first.iter().chain(&second).map(|e| e.to_json()).collect();
    let printed: Vec<i64> = lines.iter().map(|v| v["dlq_id"].as_i64().unwrap()).collect();
    let expected: Vec<i64> =
        sqlx::query_scalar("SELECT dlq_id FROM dlq_outbox WHERE event = 'parked' ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(printed, expected, "every park, in order, no gap and no repeat across the restart");
    assert!(lines.iter().all(|v| v["event"] == "parked" && v["error_class"] == "transient"));
    let _ = std::fs::remove_dir_all(&dir);
}
}

on_single_and_cluster! {
async fn sigterm_during_heavy_replay_exits_in_grace_and_leaves_work_reclaimable() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let (_down, p) = park_transient(&db, 400, "term").await;
    enqueue_due(&db, &p, &keys).await;
    let slow = start_mock(MockConfig { latency_ms: 200, ..MockConfig::default() }).await;
    let mut child = serve_cmd(&db, &slow, &prefix_of(&keys))
        .args(["--replayers", "2", "--replay-batch", "16", "--grace-ms", "3000", "--min-idle-ms", "500"])
        .spawn()
        .unwrap();
    for _ in 0..200 {
        if db.count("SELECT count(*) FROM embedding_dlq").await < 380 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pid = child.id().unwrap().to_string();
    let started = tokio::time::Instant::now();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait()).await.expect("exits").unwrap();
    assert!(status.success(), "{status}");
    assert!(started.elapsed() < Duration::from_secs(9), "exited within the grace period");
    let left = db.count("SELECT count(*) FROM embedding_dlq").await;
    assert!(left > 0, "stopped in the middle");
    // Whatever the dead consumers still held is reclaimable: a new replayer finishes it all.
    let healthy = start_mock(MockConfig::default()).await;
    let mut rep = replayer(&db, &healthy, &keys, "after", replay_config()).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    rep.reclaim_once(&CancellationToken::new()).await.unwrap();
    drain(&mut rep, &db, 60).await;
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 400);
    assert_corpus_accounted(&db, &parked_keys("term", 400)).await;
    assert_eq!(pending(&keys).await, 0);
}
}

on_single_and_cluster! {
async fn trimming_never_removes_entries_a_group_still_needs() {
    let keys = fresh_keys();
    let mut r = redis().await;
    embed_dlq::replay::ensure_group(&mut r, &keys).await.unwrap();
    let mut ids = Vec::new();
    for i in 0..10 {
        let id: String = r.xadd(keys.replay(), "*", &[("n", i)]).await.unwrap();
        ids.push(id);
    }
    // Deliver the first six; acknowledge 0, 1, 3, 4 (2 and 5 stay pending); 6..9 undelivered.
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(REPLAY_GROUP)
        .arg("c")
        .arg("COUNT")
        .arg(6)
        .arg("STREAMS")
        .arg(keys.replay())
        .arg(">")
        .query_async(&mut r)
        .await
        .unwrap();
    let _: i64 = r.xack(keys.replay(), REPLAY_GROUP, &[&ids[0], &ids[1], &ids[3], &ids[4]]).await.unwrap();
    let removed = embed_dlq::relay::trim_below_group_needs(&mut r, &keys.replay()).await.unwrap();
    assert_eq!(removed, 2, "only the acknowledged entries below the oldest pending one");
    let left: redis::streams::StreamRangeReply = r.xrange_all(keys.replay()).await.unwrap();
    let left: Vec<&String> = left.ids.iter().map(|e| &e.id).collect();
    assert_eq!(left, ids[2..].iter().collect::<Vec<_>>());
    // Once everything delivered is acknowledged, only undelivered entries remain.
    let _: i64 = r.xack(keys.replay(), REPLAY_GROUP, &[&ids[2], &ids[5]]).await.unwrap();
    embed_dlq::relay::trim_below_group_needs(&mut r, &keys.replay()).await.unwrap();
    let len: usize = r.xlen(keys.replay()).await.unwrap();
    assert_eq!(len, 4, "entries 6..9 were never delivered and must stay");
}
}

on_single_and_cluster! {
async fn dead_consumers_are_removed_from_the_group() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let mock = start_mock(MockConfig::default()).await;
    let mut rep = replayer(
        &db,
        &mock,
        &keys,
        "alive",
        ReplayConfig { dead_consumer_after: Duration::from_millis(200), ..replay_config() },
    )
    .await;
    let mut r = redis().await;
    // A consumer that joined, read nothing and went away.
    let _: i64 = redis::cmd("XGROUP")
        .arg("CREATECONSUMER")
        .arg(keys.replay())
        .arg(REPLAY_GROUP)
        .arg("ghost")
        .query_async(&mut r)
        .await
        .unwrap();
    let consumers = |r: &mut embed_dlq::streams::RedisConn| {
        let mut r = r.clone();
        let stream = keys.replay();
        async move {
            let info: redis::streams::StreamInfoConsumersReply = redis::cmd("XINFO")
                .arg("CONSUMERS")
                .arg(stream)
                .arg(REPLAY_GROUP)
                .query_async(&mut r)
                .await
                .unwrap();
            info.consumers.into_iter().map(|c| c.name).collect::<Vec<_>>()
        }
    };
    assert!(consumers(&mut r).await.contains(&"ghost".to_string()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    rep.reclaim_once(&CancellationToken::new()).await.unwrap();
    assert!(!consumers(&mut r).await.contains(&"ghost".to_string()));
}
}

on_single_and_cluster! {
async fn several_relays_at_once_publish_every_row_exactly_once() {
    let db = std::sync::Arc::new(TestDb::new().await);
    let keys = fresh_keys();
    park_transient(&db, 2_000, "multi").await;
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let mut relay = Relay::new(
            db.pool.clone(),
            redis().await,
            keys.clone(),
            RelayConfig { batch: 50, ..Default::default() },
        );
        let (db, keys) = (db.clone(), keys.clone());
        // Each relay passes until the streams hold every row: one that finds the outbox
        // held by another publishes nothing that pass and tries again.
        tasks.push(tokio::spawn(async move {
            let mut published = 0;
            loop {
                let c = relay.run_once().await.unwrap();
                published += c.published;
                if c.claimed == 0 {
                    if unpublished(&db, &keys).await.is_empty() {
                        return published;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        }));
    }
    let mut per_relay = Vec::new();
    for t in tasks {
        per_relay.push(t.await.unwrap());
    }
    assert_eq!(per_relay.iter().sum::<u64>(), 2_000, "{per_relay:?}");
    let mut r = redis().await;
    let entries: redis::streams::StreamRangeReply = r.xrange_all(keys.events()).await.unwrap();
    let ids: HashSet<String> =
        entries.ids.iter().map(|e| embed_dlq::streams::field(&e.map, "outbox_id").unwrap()).collect();
    assert_eq!((entries.ids.len(), ids.len()), (2_000, 2_000));
}
}

on_single_and_cluster! {
async fn a_provider_refusing_replay_postpones_rows_without_charging_them() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let (_down, p) = park_transient(&db, 12, "sys").await;
    enqueue_due(&db, &p, &keys).await;
    let before: Vec<(i64, i32, i32)> =
        sqlx::query_as("SELECT id, replays, attempts FROM embedding_dlq ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    // The provider now rejects our key: not the rows' fault.
    let locked =
        start_mock(MockConfig { api_key: Some("the-right-key".into()), ..MockConfig::default() }).await;
    let config = ReplayConfig { systemic_pause: Duration::from_secs(120), ..replay_config() };
    let mut rep = replayer(&db, &locked, &keys, "r", config).await;
    let c = read_batch(&mut rep).await;
    assert_eq!((c.postponed, c.reparked, c.exhausted), (12, 0, 0), "{c:?}");
    assert!(rep.paused_until.is_some(), "the replayer pauses instead of hammering");
    assert_eq!(pending(&keys).await, 0, "acknowledged: no delivery count is burnt on it");
    let after: Vec<(i64, i32, i32)> =
        sqlx::query_as("SELECT id, replays, attempts FROM embedding_dlq ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(before, after, "same generation, same attempts: nothing charged");
    assert_eq!(
        db.count("SELECT count(*) FROM embedding_dlq WHERE next_retry_at > now() + interval '100 seconds'")
            .await,
        12,
        "back on the schedule after the pause"
    );
}
}

/// What a replayer did with one batch of six rows of a target the provider refuses (doc
/// `held`, altered by `alter`) beside six rows it accepts (doc `free`), all due and on the
/// stream, embedding through a mock with `mock`; `held` is (id, replays, attempts) of the
/// refused rows before the batch.
struct BesideARefusal {
    db: TestDb,
    keys: StreamKeys,
    rep: Replayer,
    counts: embed_dlq::replay::ReplayCounts,
    held: Vec<(i64, i32, i32)>,
}

async fn one_batch_beside_a_refusal(alter: &str, mock: MockConfig) -> BesideARefusal {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let (_down, p) = park_transient(&db, 6, "held").await;
    park_transient(&db, 6, "free").await;
    sqlx::query(sqlx::AssertSqlSafe(format!("UPDATE embedding_dlq SET {alter} WHERE doc_id = 'held'")))
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(enqueue_due(&db, &p, &keys).await, 12);
    let held = held_rows(&db).await;
    let mock = start_mock(mock).await;
    let config = ReplayConfig { systemic_pause: Duration::from_secs(120), ..replay_config() };
    let mut rep = replayer(&db, &mock, &keys, "beside", config).await;
    let counts = read_batch(&mut rep).await;
    BesideARefusal { db, keys, rep, counts, held }
}

async fn held_rows(db: &TestDb) -> Vec<(i64, i32, i32)> {
    sqlx::query_as("SELECT id, replays, attempts FROM embedding_dlq WHERE doc_id = 'held' ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

on_single_and_cluster! {
async fn a_model_the_provider_no_longer_serves_holds_back_only_its_own_rows() {
    // After a model migration the DLQ still holds rows recorded with the old model, which the
    // provider now answers with 404 model_not_found. Those rows wait, uncharged; the other
    // model's rows in the same batch are replayed, and the replayer does not pause. (The
    // retired model sorts first, so its refusal comes before the other group is sent.)
    let r = one_batch_beside_a_refusal(
        "model = 'a-retired-model'",
        MockConfig { retired_models: vec!["a-retired-model".into()], ..MockConfig::default() },
    )
    .await;
    let c = r.counts;
    assert_eq!((c.replayed, c.postponed, c.reparked, c.exhausted), (6, 6, 0, 0), "{c:?}");
    assert!(r.rep.paused_until.is_none(), "one model's refusal paused the replay of every model");
    assert_eq!(pending(&r.keys).await, 0);
    assert_eq!(r.db.count("SELECT count(*) FROM embedding_dlq WHERE doc_id = 'free'").await, 0);
    assert_eq!(held_rows(&r.db).await, r.held, "the retired model's rows are not charged");
    assert_eq!(
        r.db.count("SELECT count(*) FROM embedding_dlq WHERE next_retry_at > now() + interval '100 seconds'").await,
        6,
        "the retired model's rows are back on the schedule after the pause"
    );
}
}

on_single_and_cluster! {
async fn dimensions_the_model_cannot_give_hold_back_only_their_own_rows() {
    // Same model, but some rows were parked asking for `dimensions` it cannot give (400 for
    // every input, the canary too): only those rows wait; the replayer does not pause.
    let r = one_batch_beside_a_refusal("request_dimensions = 4096", MockConfig::default()).await;
    let c = r.counts;
    assert_eq!((c.replayed, c.postponed, c.reparked, c.exhausted), (6, 6, 0, 0), "{c:?}");
    assert!(r.rep.paused_until.is_none(), "one target's refusal paused the replay of every target");
    assert_eq!(r.db.count("SELECT count(*) FROM embedding_dlq WHERE doc_id = 'free'").await, 0);
    assert_eq!(held_rows(&r.db).await, r.held, "the refused rows are not charged");
}
}

on_single_and_cluster! {
async fn a_mixed_batch_commits_in_one_transaction_and_acks_exactly_its_settled_entries() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    // One chunk the provider fails with 500 forever (to be re-parked) and six good ones.
    let (_down, p) = park_transient(&db, 1, &format!("bad500 {}", mock_provider::POISON_500)).await;
    park_transient(&db, 6, "mix").await;
    assert_eq!(enqueue_due(&db, &p, &keys).await, 7);
    // After the work was published: chunk 1 is superseded (a new generation, as a re-park
    // gives it) and chunk 2's row is gone (resolved meanwhile): both entries are stale.
    sqlx::query(
        "UPDATE embedding_dlq SET generation = nextval('embed_dlq_generation_seq')
          WHERE doc_id = 'mix' AND chunk_index = 1",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query("DELETE FROM embedding_dlq WHERE doc_id = 'mix' AND chunk_index = 2")
        .execute(&db.pool)
        .await
        .unwrap();
    // A provider that takes at most two inputs a request (413 above): the batch of seven
    // entries is read, loaded and committed at once, but embedded two inputs a request.
    let mock = start_mock(MockConfig { max_inputs: 2, ..MockConfig::default() }).await;
    let config = ReplayConfig { request_inputs: 2, ..replay_config() };
    let mut rep = replayer(&db, &mock, &keys, "mixer", config).await;
    let c = read_batch(&mut rep).await;
    assert_eq!((c.replayed, c.reparked, c.skipped, c.left_pending), (4, 1, 2, 0), "{c:?}");
    assert_eq!(pending(&keys).await, 0, "every settled entry acknowledged, and only after the commit");
    let stats = mock.control.stats();
    assert_eq!(stats.rejected, 0, "no request above the provider's limit: {stats:?}");
    assert!(stats.ok >= 2, "the live rows went in several requests: {stats:?}");
    // The replayed and re-parked rows were committed by one transaction.
    let (events, transactions): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT xmin::text) FROM dlq_outbox WHERE event IN ('replayed', 'reparked')",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((events, transactions), (5, 1));
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 4);
    assert_eq!(
        db.count("SELECT count(*) FROM embedding_dlq WHERE doc_id LIKE 'bad500%' AND replays = 1").await,
        1,
        "the failing row re-parked once"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM embedding_dlq WHERE doc_id = 'mix' AND chunk_index = 1 AND replays = 0")
            .await,
        1,
        "the superseded row untouched"
    );
}
}

on_single_and_cluster! {
/// A replay result is applied only while the chunk's manifest row still holds the content
/// that was embedded: the commit reads that from the manifest rows it locks. Here the manifest
/// of one chunk changes (and nothing else: its DLQ row keeps generation and content) while
/// the batch is being embedded.
async fn a_replay_whose_manifest_row_changed_during_the_embed_is_not_applied() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let (_down, p) = park_transient(&db, 4, "moved").await;
    assert_eq!(enqueue_due(&db, &p, &keys).await, 4);
    let slow = start_mock(MockConfig { latency_ms: 1_500, ..MockConfig::default() }).await;
    let mut rep = replayer_with_timeout(&db, &slow, &keys, "moved", replay_config(), Duration::from_secs(10)).await;
    let batch = tokio::spawn(async move { read_batch(&mut rep).await });
    // The batch is loaded (its leases charged) before the provider answers.
    let charged = async {
        while db.count("SELECT count(*) FROM replay_lease WHERE loads > 0").await < 4 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), charged).await.expect("the batch was loaded");
    sqlx::query(
        "UPDATE ingest_manifest SET content_hash = 'changed meanwhile' WHERE doc_id = 'moved' AND chunk_index = 2",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let c = batch.await.unwrap();
    assert_eq!(c.replayed, 3, "{c:?}");
    let stored: Vec<i32> = sqlx::query_scalar("SELECT chunk_index FROM doc_embeddings ORDER BY 1")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(stored, vec![0, 1, 3], "no vector for the chunk whose manifest moved on");
    assert_eq!(
        db.count("SELECT count(*) FROM embedding_dlq WHERE doc_id = 'moved' AND chunk_index = 2").await,
        1,
        "its DLQ row stays"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM ingest_manifest WHERE doc_id = 'moved' AND status = 'stored'").await,
        3
    );
}
}

/// Sequential scans of the DLQ and of the manifest so far, as the statistics collector has
/// them: an idle backend flushes its counts within 10 s (`PGSTAT_IDLE_INTERVAL`).
async fn seq_scans(db: &TestDb) -> (i64, i64) {
    tokio::time::sleep(Duration::from_secs(11)).await;
    sqlx::query_as(
        "SELECT (SELECT seq_scan FROM pg_stat_user_tables WHERE relname = 'embedding_dlq'),
                (SELECT seq_scan FROM pg_stat_user_tables WHERE relname = 'ingest_manifest')",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

on_single_and_cluster! {
async fn a_replay_batch_reads_the_manifest_by_key_not_by_scanning_it() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let mock = start_mock(MockConfig::default()).await;
    let config = ReplayConfig { batch: 300, ..replay_config() };
    let mut rep = replayer(&db, &mock, &keys, "indexed", config.clone()).await;
    // 20,000 chunks parked as permanent (never scheduled) and 3,000 transient ones, all due
    // at the same instant: a batch is a small part of the DLQ and of the manifest.
    insert_parked_rows(&db, "perm", 20_000, None).await;
    insert_parked_rows(&db, "due", 3_000, Some("1 minute")).await;
    let before = seq_scans(&db).await;
    // Six scheduler passes of 500 due rows each, then one batch of 300: loaded, locked and
    // committed by key.
    let mut r = redis().await;
    embed_dlq::replay::ensure_group(&mut r, &keys).await.unwrap();
    // Its entries hold a batch of 300 each.
    let scheduler = Scheduler::new(rep.store.clone(), config, r.clone(), keys.clone());
    assert_eq!(scheduler.run_once().await.unwrap(), 3_000);
    relay_all(&db, &keys).await;
    let c = read_batch(&mut rep).await;
    assert_eq!(c.replayed, 300, "{c:?}");
    let after = seq_scans(&db).await;
    assert_eq!(after.1, before.1, "replaying a batch scanned the whole manifest");
}
}

/// A scheduling pass checks each due row it walks against that row's own lease, by key,
/// whatever the statistics say. `leased_until` is always "now + a lease", so a lease length
/// after any analyze of `replay_lease` its statistics say no lease is live; planned from them,
/// the check became a walk of every live lease for every due row: the second statement of a
/// pass over 20,000 due rows (10,000 leased by the first) took 9.7 s instead of 0.08
/// (`EXPLAIN ANALYZE`, docs/perf-notes/2026-12-03-replay-commit-and-aged-lease-statistics.md),
/// and every pass of a backlog bigger than the cap paid the same until autovacuum analyzed the
/// table again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduling_pass_checks_due_rows_against_their_own_lease_whatever_the_statistics_say() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let mock = start_mock(MockConfig::default()).await;
    let rep = replayer(&db, &mock, &keys, "planned", replay_config()).await;
    insert_parked_rows(&db, "due", 20_000, Some("1 minute")).await;
    age_lease_statistics(&db).await;
    quiet_statistics().await;
    let before = index_scans(&db, "replay_lease_pkey").await;
    let mut r = redis().await;
    embed_dlq::replay::ensure_group(&mut r, &keys).await.unwrap();
    // One pass, two statements: 10,000 rows, then the other 10,000 behind 10,000 live leases.
    let config = ReplayConfig { outstanding_max: 20_000, ..replay_config() };
    let scheduler = Scheduler::new(rep.store.clone(), config, r.clone(), keys.clone());
    assert_eq!(scheduler.run_once().await.unwrap(), 20_000);
    quiet_statistics().await;
    let probes = index_scans(&db, "replay_lease_pkey").await - before;
    // The inserts check the key of each of their 20,000 leases; the second statement walks
    // all 20,000 due rows (the first 10,000 leased by the first) and must look up each
    // one's lease by that key too. Planned from the stale statistics, only the inserts
    // probed it (20,006), and the walk compared every due row with every live lease.
    assert!(probes >= 40_000, "due rows checked against their own lease by key: {probes} probes");
}

#[tokio::test]
async fn replay_commits_read_only_their_batch_of_the_dlq_and_the_leases_whatever_the_statistics_say() {
    // Both tables swing between empty and a backlog: after a drain, an `ANALYZE` (autovacuum's)
    // sees their pages and no live row, and until the next one the planner believes a table
    // of any size holds one row. Planned from that, the replay commit walked every DLQ row of
    // the target table (by `target_table`) and every lease (a full index scan) for each
    // batch, joining each against the batch: seconds a batch at a backlog of 20,000.
    let db = TestDb::new().await;
    let keys = fresh_keys();
    // Inputs over 1,000 characters are refused (422): those rows are re-parked as permanent,
    // the others replayed, so both commit statements run.
    let mock = start_mock(MockConfig { max_input_chars: 1_000, ..MockConfig::default() }).await;
    let mut rep = replayer(&db, &mock, &keys, "believed-empty", replay_config()).await;
    insert_parked_rows(&db, "drained", 3_000, Some("1 minute")).await;
    sqlx::raw_sql(
        "ALTER TABLE embedding_dlq SET (autovacuum_enabled = off);
         ALTER TABLE replay_lease SET (autovacuum_enabled = off);
         INSERT INTO replay_lease (dlq_id, generation, leased_until)
         SELECT id, generation, now() FROM embedding_dlq;
         DELETE FROM embedding_dlq; DELETE FROM replay_lease; DELETE FROM ingest_manifest;
         ANALYZE embedding_dlq; ANALYZE replay_lease;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let believed: Vec<(String, f32)> = sqlx::query_as(
        "SELECT relname::text, reltuples FROM pg_class
          WHERE relname IN ('embedding_dlq', 'replay_lease') AND relpages > 0 ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(believed, [("embedding_dlq".into(), 0.0), ("replay_lease".into(), 0.0)], "pages, no live row");
    // The next backlog, issued and replayed before any new `ANALYZE`.
    insert_parked_rows_unanalyzed(&db, "backlog", 3_000, Some("1 minute")).await;
    sqlx::query("UPDATE embedding_dlq SET payload = jsonb_set(payload, '{text}', to_jsonb(repeat('x', 2000))) WHERE id % 2 = 0")
        .execute(&db.pool)
        .await
        .unwrap();
    schedule_all(&rep, &keys, 3_000).await;
    quiet_statistics().await;
    let (dlq_before, leases_before) =
        (rows_read(&db, "embedding_dlq").await, rows_read(&db, "replay_lease").await);
    settle_without_counting(&mut rep, 3_000).await;
    quiet_statistics().await;
    // Taken before the counts below, which read the DLQ themselves.
    let dlq_read = rows_read(&db, "embedding_dlq").await - dlq_before;
    let leases_read = rows_read(&db, "replay_lease").await - leases_before;
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 1_500);
    assert_eq!(
        db.count("SELECT count(*) FROM embedding_dlq WHERE error_class = 'permanent_input'").await,
        1_500
    );
    // 47 batches of 64: the load reads each row twice and charges its lease, the manifest
    // lock reads the row, the commit deletes or re-parks it and deletes its lease (4 row
    // reads and 2 lease reads each). Walking the tables for each batch read 80,000-150,000
    // DLQ rows and 75,000 leases.
    assert!(dlq_read <= 6 * 3_000, "DLQ rows read by the drain: {dlq_read}");
    assert!(leases_read <= 5 * 3_000, "lease rows read by the drain: {leases_read}");
}

/// Issues every due row as replay work on `keys` through `rep`'s store: `rows` of them.
async fn schedule_all(rep: &Replayer, keys: &StreamKeys, rows: u64) {
    let mut r = redis().await;
    embed_dlq::replay::ensure_group(&mut r, keys).await.unwrap();
    let scheduler = Scheduler::new(rep.store.clone(), replay_config(), r, keys.clone());
    assert_eq!(scheduler.run_once().await.unwrap(), rows);
}

/// Reads until `rows` items were settled (replayed, re-parked or exhausted), without counting
/// what is left: a count reads the DLQ, which the callers count the reads of.
async fn settle_without_counting(rep: &mut Replayer, rows: u64) {
    let client = embed_dlq::streams::client(&redis_url()).unwrap();
    let mut conn = embed_dlq::streams::blocking(&client, Duration::from_secs(1)).await.unwrap();
    let (mut settled, deadline) = (0, tokio::time::Instant::now() + Duration::from_secs(300));
    while settled < rows {
        assert!(tokio::time::Instant::now() < deadline, "replay did not settle the DLQ: {settled}");
        let c = rep.read_once(&mut conn, &CancellationToken::new()).await.unwrap();
        settled += c.replayed + c.reparked + c.exhausted;
    }
}

on_single_and_cluster! {
async fn replay_commits_read_only_their_batch_of_the_manifest_whatever_the_statistics_say() {
    // The manifest believed empty: a corpus deleted (the manifest's rows with it) and an
    // `ANALYZE` before its pages were vacuumed away, then a corpus ingested again and a
    // backlog parked, all before the next `ANALYZE`. The DLQ's statistics are fresh. Joined
    // with the batch, the replay commit's and the re-park's manifest updates walked the whole
    // manifest (a full scan of its primary key, believed one row) for each batch.
    let db = TestDb::new().await;
    let keys = fresh_keys();
    // Inputs over 1,000 characters are refused (422): those rows are re-parked as permanent,
    // the others replayed, so both commit statements run.
    let mock = start_mock(MockConfig { max_input_chars: 1_000, ..MockConfig::default() }).await;
    let mut rep = replayer(&db, &mock, &keys, "manifest-believed-empty", replay_config()).await;
    leave_believed_empty(&db, "ingest_manifest", &stored_chunks("deleted", 20_000)).await;
    insert_parked_rows_unanalyzed(&db, "backlog", 3_000, Some("1 minute")).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "{};
         UPDATE embedding_dlq SET payload = jsonb_set(payload, '{{text}}', to_jsonb(repeat('x', 2000)))
          WHERE id % 2 = 0;
         ANALYZE embedding_dlq;",
        stored_chunks("stored", 20_000)
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    schedule_all(&rep, &keys, 3_000).await;
    quiet_statistics().await;
    let before = rows_read(&db, "ingest_manifest").await;
    settle_without_counting(&mut rep, 3_000).await;
    quiet_statistics().await;
    let manifest_read = rows_read(&db, "ingest_manifest").await - before;
    // Read here: what the drain did to the manifest.
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 1_500);
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest WHERE doc_id LIKE 'backlog-%' AND status = 'stored'").await, 1_500);
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest WHERE doc_id LIKE 'backlog-%' AND status = 'parked'").await, 1_500);
    // 47 batches of 64: the load's probe, the lock and the commit's update read each row
    // (3 a row). Walking the manifest for each batch read 23,000 rows a batch.
    assert!(manifest_read <= 5 * 3_000, "manifest rows read by the drain: {manifest_read}");
}
}

/// Appends `n` synthetic `parked` events (chunks `first..first + n` of doc `doc`) to the
/// events stream of `keys` (one shard).
async fn add_events(keys: &StreamKeys, doc: &str, first: usize, n: usize) {
    let mut conn = redis().await;
    for chunk in (first..first + n).collect::<Vec<_>>().chunks(500) {
        let mut pipe = redis::pipe();
        for i in chunk {
            let body = serde_json::json!({"event": "parked", "doc_id": doc, "chunk_index": i}).to_string();
            pipe.cmd("XADD")
                .arg(keys.events())
                .arg("*")
                .arg("event")
                .arg("parked")
                .arg("body")
                .arg(body)
                .ignore();
        }
        let _: () = pipe.query_async(&mut conn).await.unwrap();
    }
}

/// Runs `embed-dlq tail --json --no-follow` on `keys` with `args`; returns (exit code,
/// stdout lines, stderr).
/// Runs `tail` to its end on `keys`' streams. With `db`, tail checks that database's recorded
/// stream prefix; without, it runs with no database at all (never the environment's
/// `DATABASE_URL`, which is no test's database and may record another prefix).
async fn tail_process(
    db: Option<&TestDb>,
    keys: &StreamKeys,
    args: &[&str],
) -> (i32, Vec<serde_json::Value>, String) {
    let mut c = tokio::process::Command::new(env!("CARGO_BIN_EXE_embed-dlq"));
    c.env_remove("DATABASE_URL");
    if let Some(db) = db {
        c.args(["--database-url", &db.url]);
    }
    let out = c
        .args([
            "--redis-url",
            &redis_url(),
            "tail",
            "--json",
            "--no-follow",
            "--stream-prefix",
            &prefix_of(keys),
        ])
        .args(args)
        .env_remove("EMBED_DLQ_CONFIG")
        .stdin(Stdio::null())
        .output()
        .await
        .unwrap();
    let lines =
        String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    (out.status.code().unwrap_or(-1), lines, String::from_utf8(out.stderr).unwrap())
}

on_single_and_cluster! {
async fn tail_reports_the_events_trimmed_past_its_checkpoint_and_fails_on_request() {
    // Issue 19: checkpoint after 300 events, 2,000 more, the stream trimmed to 1,000: 1,300
    // entries are gone, 1,000 of them (the 301st to the 1,300th) never read by this tail,
    // which must say so rather than exit 0 in silence.
    let keys = fresh_keys();
    let dir = std::env::temp_dir().join(format!("embed-dlq-gap-{}", rand::random::<u64>()));
    std::fs::create_dir_all(&dir).unwrap();
    let checkpoint = dir.join("tail.checkpoint");
    let cp = checkpoint.to_str().unwrap();
    add_events(&keys, "gap", 0, 300).await;
    let (code, lines, stderr) = tail_process(None, &keys, &["--from", "0", "--checkpoint", cp]).await;
    assert_eq!((code, lines.len()), (0, 300), "{stderr}");
    assert!(stderr.is_empty(), "no gap from the start: {stderr}");
    let saved = std::fs::read_to_string(&checkpoint).unwrap();
    add_events(&keys, "gap", 300, 2000).await;
    let _: u64 = redis::cmd("XTRIM").arg(keys.events()).arg("MAXLEN").arg(1000).query_async(&mut redis().await).await.unwrap();

    // --on-gap fail: nothing delivered, a documented exit code, the checkpoint unmoved.
    let (code, lines, stderr) = tail_process(None, &keys, &["--checkpoint", cp, "--on-gap", "fail"]).await;
    assert!(stderr.contains("1000 events missed"), "{stderr}");
    assert_eq!((code, lines.len()), (6, 0), "{stderr}");
    assert_eq!(std::fs::read_to_string(&checkpoint).unwrap(), saved, "a failed gap leaves the checkpoint");

    // The default (warn): the gap on stderr, then the 1,000 events still held, exit 0.
    let (code, lines, stderr) = tail_process(None, &keys, &["--checkpoint", cp]).await;
    assert_eq!(code, 0, "{stderr}");
    assert!(stderr.contains("1000 events missed"), "{stderr}");
    let chunks: Vec<i64> = lines.iter().map(|v| v["chunk_index"].as_i64().unwrap()).collect();
    assert_eq!(chunks, (1300..2300).collect::<Vec<i64>>());
    // Past the gap the position is caught up again: the next resume is clean.
    add_events(&keys, "gap", 2300, 5).await;
    let (code, lines, stderr) = tail_process(None, &keys, &["--checkpoint", cp, "--on-gap", "fail"]).await;
    assert_eq!((code, lines.len(), stderr.as_str()), (0, 5, ""));
    let _ = std::fs::remove_dir_all(&dir);
}
}

on_single_and_cluster! {
async fn a_republished_event_carries_its_chunk_order_and_tail_marks_it_late() {
    // A `parked` event lost in Redis is republished by the reconciler at the end of the
    // stream, after the chunk's later `replayed`: tail must not pass it off as the newest.
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let (_down, p) = park_transient(&db, 3, "order").await;
    relay_all(&db, &keys).await;
    let up = start_mock(MockConfig::default()).await;
    enqueue_due(&db, &p, &keys).await;
    let mut rep = replayer(&db, &up, &keys, "order", replay_config()).await;
    drain(&mut rep, &db, 30).await;
    relay_all(&db, &keys).await;
    let mut conn = redis().await;
    let entries: redis::streams::StreamRangeReply =
        redis::cmd("XRANGE").arg(keys.events()).arg("-").arg("+").query_async(&mut conn).await.unwrap();
    let bodies: Vec<(String, serde_json::Value)> = entries
        .ids
        .iter()
        .map(|e| (e.id.clone(), serde_json::from_str(&embed_dlq::streams::field(&e.map, "body").unwrap()).unwrap()))
        .collect();
    assert_eq!(bodies.len(), 6, "3 parked, 3 replayed");
    // The order the test made them in: each chunk's parked before its replayed.
    for i in 0..3 {
        let of = |event: &str| {
            bodies.iter().find(|(_, b)| b["chunk_index"] == i && b["event"] == event).unwrap().1["seq"].as_i64()
        };
        let (parked, replayed) = (of("parked"), of("replayed"));
        assert!(parked.is_some() && replayed.is_some(), "every event carries seq: {bodies:?}");
        assert!(parked < replayed, "chunk {i}: parked {parked:?} before replayed {replayed:?}");
    }
    let lost = &bodies.iter().find(|(_, b)| b["chunk_index"] == 0 && b["event"] == "parked").unwrap().0;
    let _: u64 = redis::cmd("XDEL").arg(keys.events()).arg(lost).query_async(&mut conn).await.unwrap();
    let mut r = reconciler(&db, &keys, immediate()).await;
    r.run_once(embed_dlq::reconcile::Mode::Repair).await.unwrap();
    relay_all(&db, &keys).await;

    let (code, lines, stderr) = tail_process(Some(&db), &keys, &["--from", "0"]).await;
    assert_eq!(code, 0, "{stderr}");
    let chunk0: Vec<&serde_json::Value> = lines.iter().filter(|v| v["chunk_index"] == 0).collect();
    assert_eq!(chunk0.len(), 2, "{lines:?}");
    assert_eq!((chunk0[0]["event"].as_str(), chunk0[1]["event"].as_str()), (Some("replayed"), Some("parked")));
    assert!(chunk0[0]["late_after_seq"].is_null());
    assert_eq!(chunk0[1]["late_after_seq"], chunk0[0]["seq"], "the republished parked is reported late");
    assert!(lines.iter().filter(|v| v["chunk_index"] != 0).all(|v| v["late_after_seq"].is_null()));
}
}

on_single_and_cluster! {
async fn a_replayer_probes_again_after_an_outage_longer_than_max_outage_and_replays_once_the_provider_is_back() {
    // Issue 19: `serve` lives for months; a provider outage longer than `max_outage_secs` must
    // postpone the rows it holds (uncharged) and not keep the breaker from ever probing
    // again: once the provider is back, the next batch replays.
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let (_down, p) = park_transient(&db, 12, "long-outage").await;
    let mock = start_mock(MockConfig::default()).await;
    mock.control.set_outage(true);
    let mut s = settings(&db, &mock);
    // Retries enough to outlast `max_outage`: the batch waits on the breaker, then gives up.
    s.retry.max_attempts = 1_000;
    s.retry.base = Duration::from_millis(5);
    s.retry.cap = Duration::from_millis(20);
    s.breaker = embed_dlq::embed::gate::BreakerConfig {
        failure_threshold: 1,
        cooldown: Duration::from_millis(50),
        max_cooldown: Duration::from_millis(200),
        max_outage: Duration::from_millis(300),
    };
    let config = ReplayConfig { systemic_pause: Duration::from_secs(120), ..replay_config() };
    let mut rep = replayer_on(pipeline(&s).await, &keys, "outage", config).await;
    enqueue_due(&db, &p, &keys).await;
    let c = read_batch(&mut rep).await;
    assert_eq!((c.postponed, c.replayed, c.exhausted), (12, 0, 0), "the outage outlasted max_outage: {c:?}");
    let postponed_for: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM max(next_retry_at) - now())::float8 FROM embedding_dlq",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(
        postponed_for <= 10.0,
        "an outage's rows wait for the breaker's next probe (200 ms here), not the refusal pause: {postponed_for} s"
    );

    // The provider is back; the rows come due and are on the stream again.
    mock.control.set_outage(false);
    // The replayer paused until the breaker's next probe, as `serve`'s loop would.
    let paused = rep.paused_until.take().expect("a refusal of the whole batch pauses the replayer");
    assert!(paused <= std::time::Instant::now() + Duration::from_secs(10), "paused until the next probe");
    tokio::time::sleep_until(paused.into()).await;
    enqueue_due(&db, &p, &keys).await;
    let c = read_batch(&mut rep).await;
    assert_eq!((c.replayed, c.postponed), (12, 0), "the breaker probed and closed: {c:?}");
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
}
}

/// Runs `corpus` through a pipeline of `settings`.
async fn ingest_corpus(settings: &embed_dlq::config::IngestSettings, corpus: String) {
    pipeline(settings).await.run(input(corpus.into_bytes()), CancellationToken::new()).await.unwrap();
}

on_single_and_cluster! {
/// The events contract end to end: one database records every kind of event the outbox allows
/// (its CHECK constraint, which `contract::every_event_kind_the_outbox_allows_is_in_the_contract`
/// compares with the schema) through the real statements, the relay publishes them, and every
/// entry conforms to `docs/events.schema.json` (`relay_all` checks each entry it adds).
async fn every_kind_of_event_is_published_as_the_contract_says() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let up = start_mock(MockConfig::default()).await;
    let s = settings(&db, &up);
    // parked: three chunks during an outage.
    let (_down, p) = park_transient(&db, 3, "k").await;
    // resolved: a later ingest stores one of them with new text.
    ingest_corpus(&s, line("k", 0, "k chunk 0, edited")).await;
    // withdrawn (and parked): a stored chunk whose new text the provider rejects.
    ingest_corpus(&s, line("w", 0, "w zero")).await;
    ingest_corpus(&s, line("w", 0, &format!("w zero, rewritten {}", mock_provider::POISON_400))).await;
    relay_all(&db, &keys).await;
    // reparked, then exhausted: replays that meet an outage, up to a cap of two.
    let failing = start_mock(MockConfig::default()).await;
    failing.control.set_outage(true);
    let capped = ReplayConfig {
        schedule: embed_dlq::embed::retry::DlqSchedule { max_replays: 2, ..Default::default() },
        ..replay_config()
    };
    let mut rep = replayer(&db, &failing, &keys, "failing", capped).await;
    assert_eq!(replay_until_settled(&db, &p, &keys, &mut rep).await, 2);
    // requeued: an operator sends the exhausted rows back.
    let doc = |d: &str| embed_dlq::dlq::Filter { doc: Some(d.into()), ..Default::default() };
    assert_eq!(embed_dlq::dlq::requeue(&p.store, &doc("k"), false, 1000).await.unwrap().requeued, 2);
    // replayed: the provider is back.
    let mut rep = replayer(&db, &up, &keys, "healthy", replay_config()).await;
    enqueue_due(&db, &p, &keys).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while db.count("SELECT count(*) FROM embedding_dlq WHERE doc_id = 'k'").await > 0 {
        assert!(tokio::time::Instant::now() < deadline, "the requeued rows were not replayed");
        read_batch(&mut rep).await;
    }
    // purged: an operator drops the rejected chunk.
    assert_eq!(embed_dlq::dlq::purge(&p.store, &doc("w"), false).await.unwrap(), 1);
    // deleted: a delete record of the input removes document k (three chunks).
    ingest_corpus(&s, "{\"doc_id\": \"k\", \"op\": \"delete\"}\n".to_string()).await;
    relay_all(&db, &keys).await;

    let published = assert_events_conform(&keys).await;
    let kinds: std::collections::BTreeSet<String> = published.iter().map(|e| e.fields["event"].clone()).collect();
    let allowed: std::collections::BTreeSet<String> =
        crate::contract::kinds_the_outbox_allows(&db).await.into_iter().filter(|k| k != "replay").collect();
    assert_eq!(
        kinds, allowed,
        "every kind of event the outbox allows was published and checked (a new kind needs a step here)"
    );
    let outbox_events = db.count("SELECT count(*) FROM dlq_outbox WHERE stream = 'events'").await;
    assert_eq!(published.len() as i64, outbox_events, "every event recorded was published once");
}
}

on_single_and_cluster! {
/// A replayer's reclaim pass whose stream is deleted while it embeds what it claimed (a
/// `FLUSHALL` mid-pass) ends the pass as it would after a lost group. Its look at the group's
/// consumers (`XINFO CONSUMERS`) then got `no such key`, an error no reader recovered from:
/// it ended the replayer, and `serve` with it, so nothing replayed until a restart (the
/// history checker's Redis-loss scene, seed 7, waited 65 s).
async fn a_stream_deleted_during_a_reclaim_pass_does_not_end_the_replayer() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let (_down, p) = park_transient(&db, 20, "nk").await;
    enqueue_due(&db, &p, &keys).await;
    // Delivered to a consumer that died: pending and soon idle, for the pass to claim.
    deliver_to_dead_consumer(&keys, "dead").await;
    let mut r = redis().await;
    assert_eq!(pending(&keys).await, 20);
    let mock = start_mock(MockConfig { latency_ms: 1_000, ..MockConfig::default() }).await;
    let config = replay_config();
    let mut rep =
        replayer_with_timeout(&db, &mock, &keys, "survivor", config.clone(), Duration::from_secs(10)).await;
    tokio::time::sleep(config.min_idle + Duration::from_millis(100)).await;
    let cancel = CancellationToken::new();
    let pass = rep.reclaim_once(&cancel);
    let delete = async {
        wait_for("the claimed rows at the provider", Duration::from_secs(30), async || {
            mock.control.stats().requests > 0
        })
        .await;
        let _: () = redis::cmd("DEL").arg(keys.replay()).query_async(&mut r).await.unwrap();
    };
    let (pass, ()) = tokio::join!(pass, delete);
    match pass {
        Ok(c) => assert_eq!((c.reclaimed, c.replayed), (20, 20), "{c:?}"),
        Err(e) => panic!("the pass ended with: {e} (transient: {})", e.is_transient()),
    }
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 20);
}
}

on_single_and_cluster! {
/// A shutdown in the middle of a batch leaves the items it had not sent unattempted: their
/// entry (which carries the whole batch) stays pending, and whoever takes it over replays
/// those and skips the rows the first replayer committed.
async fn an_entry_with_items_left_unattempted_stays_pending_and_its_settled_items_are_skipped_later() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let (_down, p) = park_transient(&db, 12, "held").await;
    assert_eq!(enqueue_due(&db, &p, &keys).await, 12);
    assert_eq!(replay_entries(&keys).await.1, 1, "one entry carries the 12 items");
    // Requests of 4 inputs, one at a time, within a budget of one request a minute: the first
    // goes at once, the second waits for its slot, and the shutdown ends that wait unsent.
    let budgeted = start_mock(MockConfig::default()).await;
    let mut s = settings(&db, &budgeted);
    s.limits = embed_dlq::embed::limit::LimitConfig {
        max_requests_per_minute: Some(1),
        ..embed_dlq::embed::limit::LimitConfig::default()
    };
    let config = ReplayConfig { request_inputs: 4, requests_in_flight: 1, ..replay_config() };
    let mut first = replayer_on(pipeline(&s).await, &keys, "first", config).await;
    let hard = CancellationToken::new();
    // The shutdown comes once the first request's rows are committed (counted, not slept on),
    // while the second waits a minute for its slot.
    let cut = {
        let (hard, pool) = (hard.clone(), db.pool.clone());
        tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(50);
            loop {
                let left: i64 =
                    sqlx::query_scalar("SELECT count(*) FROM embedding_dlq").fetch_one(&pool).await.unwrap();
                if left == 8 || tokio::time::Instant::now() > deadline {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            hard.cancel();
        })
    };
    let client = embed_dlq::streams::client(&redis_url()).unwrap();
    let mut conn = embed_dlq::streams::blocking(&client, Duration::from_secs(1)).await.unwrap();
    let c = first.read_once(&mut conn, &hard).await.unwrap();
    cut.await.unwrap();
    assert_eq!((c.replayed, c.left_pending), (4, 8), "{c:?}");
    assert_eq!(budgeted.control.stats().inputs, 4, "one request sent");
    let committed = db.count("SELECT count(*) FROM doc_embeddings").await as u64;
    assert_eq!(committed, c.replayed);
    assert_eq!(pending(&keys).await, 12, "the entry is not acknowledged while items of it are unsent");

    // Taken over once idle: the committed rows are skipped, the others replayed.
    let mock = start_mock(MockConfig::default()).await;
    let mut other = replayer(&db, &mock, &keys, "other", replay_config()).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let c2 = other.reclaim_once(&CancellationToken::new()).await.unwrap();
    assert_eq!((c2.reclaimed, c2.skipped, c2.replayed), (12, committed, 12 - committed), "{c2:?}");
    assert_eq!(mock.control.stats().inputs, 12 - committed, "only the unsent rows are embedded again");
    assert_eq!(pending(&keys).await, 0);
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 12);
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
    assert_eq!(db.count("SELECT count(*) FROM dlq_outbox WHERE event = 'replayed'").await, 12);
}
}

/// The work item of each DLQ row (by id), as JSON written here: the fields a scheduler
/// writes, without a lease number (an item from before leases were numbered is replayed if
/// its generation is current).
async fn hand_written_items(db: &TestDb) -> Vec<serde_json::Value> {
    let rows: Vec<(i64, i64, String, String, String, i32)> = sqlx::query_as(
        "SELECT id, generation, content_hash, target_table, doc_id, chunk_index FROM embedding_dlq ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    rows.into_iter()
        .map(|(id, generation, hash, table, doc, idx)| {
            serde_json::json!({
                "dlq_id": id, "generation": generation, "content_hash": hash, "table": table,
                "doc_id": doc, "chunk_index": idx, "attempts": 2,
            })
        })
        .collect()
}

/// Appends a replay stream entry with `body` to the first shard of `keys`.
async fn append_replay_entry(keys: &StreamKeys, body: &serde_json::Value) {
    let _: String = redis::cmd("XADD")
        .arg(keys.replay())
        .arg("*")
        .arg("event")
        .arg("replay")
        .arg("body")
        .arg(body.to_string())
        .query_async(&mut redis().await)
        .await
        .unwrap();
}

on_single_and_cluster! {
/// An entry of one work item, as releases before batched entries wrote them (and as the relay
/// still publishes from their outbox rows), is replayed like a batch of one.
async fn a_single_item_entry_of_an_earlier_release_is_still_replayed() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let (_down, _p) = park_transient(&db, 3, "legacy").await;
    make_due(&db).await;
    embed_dlq::replay::ensure_group(&mut redis().await, &keys).await.unwrap();
    for item in hand_written_items(&db).await {
        // The body an earlier release wrote: one item, no `items` array, no lease number.
        append_replay_entry(&keys, &item).await;
    }
    let mock = start_mock(MockConfig::default()).await;
    let mut rep = replayer(&db, &mock, &keys, "upgraded", replay_config()).await;
    drain(&mut rep, &db, 60).await;
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings WHERE doc_id = 'legacy'").await, 3);
    assert_eq!(mock.control.stats().inputs, 3);
    assert_eq!(pending(&keys).await, 0);
}
}

on_single_and_cluster! {
/// An entry naming the same row twice (written by hand, or by a scheduler of another kind):
/// the row is embedded and stored once, the second item skipped.
async fn an_entry_naming_a_row_twice_embeds_it_once() {
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let (_down, _p) = park_transient(&db, 2, "twice").await;
    make_due(&db).await;
    embed_dlq::replay::ensure_group(&mut redis().await, &keys).await.unwrap();
    let items = hand_written_items(&db).await;
    append_replay_entry(&keys, &serde_json::json!({"items": [items[0], items[1], items[0]]})).await;
    let mock = start_mock(MockConfig::default()).await;
    let mut rep = replayer(&db, &mock, &keys, "twice", replay_config()).await;
    let c = read_batch(&mut rep).await;
    assert_eq!((c.replayed, c.skipped), (2, 1), "{c:?}");
    assert_eq!(mock.control.stats().inputs, 2, "each row embedded once");
    assert_eq!(db.count("SELECT count(*) FROM dlq_outbox WHERE event = 'replayed'").await, 2);
    assert_eq!(pending(&keys).await, 0);
}
}
