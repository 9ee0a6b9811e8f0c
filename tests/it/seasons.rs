//! Histories that take time, not just operations: a database gone for longer than the
//! delivery cap times the reclaim time, a provider refusing for several lease periods, a
//! backlog bigger than the outstanding-work cap, Redis data lost with replay in flight. The
//! settings are shortened so each runs in seconds, but every one lasts longer than the
//! period it is about (a lease, min-idle × delivery cap). The oracle is plain SQL on the
//! tables and plain Redis commands, never the product's own checks.

use std::process::Stdio;
use std::time::Duration;

use embed_dlq::relay::{Relay, RelayConfig};
use embed_dlq::replay::{ReplayConfig, Replayer, Scheduler};
use embed_dlq::streams::StreamKeys;
use embed_dlq::testkit::mock_provider::{MockConfig, MockProvider};
use embed_dlq::testkit::proxy::TcpProxy;
use tokio_util::sync::CancellationToken;

use crate::support::*;

on_single_and_cluster! {
/// Postgres unreachable for several times `delivery_cap × min_idle` while replay is in
/// flight: every XREADGROUP and XAUTOCLAIM of that time adds a Redis delivery, and none of it
/// is the rows' fault. Once the database is back every row is replayed; none is exhausted.
async fn a_database_outage_longer_than_the_delivery_cap_exhausts_no_row() {
    // EMBED_DLQ_OUTAGE_{ROWS,SECS,MIN_IDLE_MS,CAP} scale it up to the long outages recorded
    // in docs/guarantees.md (e.g. 3,000 rows, 330 s, min-idle 15 s, cap 5).
    let env = |k: &str, d: u64| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let rows = env("EMBED_DLQ_OUTAGE_ROWS", 400) as usize;
    let outage = Duration::from_secs(env("EMBED_DLQ_OUTAGE_SECS", 12));
    let (min_idle_ms, cap) = (env("EMBED_DLQ_OUTAGE_MIN_IDLE_MS", 300), env("EMBED_DLQ_OUTAGE_CAP", 2));
    let db = TestDb::new().await;
    let keys = fresh_keys();
    park_due(&db, rows, "outage").await;
    // Slow enough that the stream holds unread and pending entries when the database goes.
    let mock = start_mock(MockConfig { latency_ms: 60, ..Default::default() }).await;
    let proxy = TcpProxy::start(postgres_addr(&db)).await.unwrap();
    let url = through(&db, proxy.addr);
    let mut child = serve_process(
        &url,
        &mock.base_url(),
        &keys,
        &[
            "--replayers",
            "2",
            "--replay-batch",
            "8",
            "--min-idle-ms",
            &min_idle_ms.to_string(),
            "--delivery-cap",
            &cap.to_string(),
        ],
    )
    .spawn()
    .unwrap();
    wait_for("the first replays", Duration::from_secs(60), async || {
        db.count("SELECT count(*) FROM doc_embeddings").await >= 24
    })
    .await;
    proxy.control.cut();
    // By default 12 s: forty reclaim periods, six times delivery cap × min-idle.
    assert!(outage > Duration::from_millis(min_idle_ms * cap), "the outage must outlast delivery cap × min-idle");
    tokio::time::sleep(outage).await;
    assert!(proxy.control.refused() > 0, "serve never tried the database during the outage");
    proxy.control.restore();
    let refused = proxy.control.refused();
    wait_for("the DLQ to drain or give up", Duration::from_secs(120 + rows as u64 / 50), async || {
        db.count("SELECT count(*) FROM embedding_dlq WHERE exhausted_at IS NULL").await == 0
    })
    .await;
    let _ = child.kill().await;
    let exhausted: Vec<(String, String)> = sqlx::query_as(
        "SELECT doc_id || '#' || chunk_index, coalesce(exhausted_reason, '') FROM embedding_dlq
          WHERE exhausted_at IS NOT NULL ORDER BY 1 LIMIT 5",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    eprintln!("outage: {rows} rows, Postgres cut {outage:?} (min-idle {min_idle_ms} ms, delivery cap {cap}), {refused} connections refused meanwhile, {} exhausted", exhausted.len());
    assert!(exhausted.is_empty(), "healthy rows exhausted by a database outage: {exhausted:?}");
    assert_eq!(
        db.count("SELECT count(DISTINCT (doc_id, chunk_index)) FROM doc_embeddings WHERE doc_id = 'outage'").await,
        rows as i64
    );
}
}

/// A replayer of the `replayers` group over `keys`, embedding through `mock`.
async fn replayer(
    db: &TestDb,
    mock: &MockProvider,
    keys: &StreamKeys,
    name: &str,
    config: ReplayConfig,
) -> Replayer {
    // Long enough that a loaded machine never times out a healthy answer (a resend counts
    // its inputs twice).
    replayer_for(db, mock, keys, name, config, Duration::from_secs(5)).await
}

/// Runs a scheduler of `config` over `p`'s store and `relay` in `tasks` until `stop`.
fn spawn_scheduler_and_relay(
    tasks: &mut tokio::task::JoinSet<Result<(), String>>,
    scheduler: Scheduler,
    relay: Relay,
    stop: &CancellationToken,
) {
    let s = stop.clone();
    tasks.spawn(async move { scheduler.run(s).await.map_err(|e| e.to_string()) });
    let s = stop.clone();
    tasks.spawn(async move { relay.run(s).await.map_err(|e| e.to_string()) });
}

/// The test Redis's `used_memory` in bytes (0 where `INFO` does not answer one node's text,
/// as on a cluster: the measured run is on a single node).
async fn used_memory() -> u64 {
    let mut r = redis().await;
    let info: String = redis::cmd("INFO").arg("memory").query_async(&mut r).await.unwrap_or_default();
    info.lines().find_map(|l| l.strip_prefix("used_memory:")).and_then(|v| v.trim().parse().ok()).unwrap_or(0)
}

/// Bytes `key` takes in the test Redis (`MEMORY USAGE ... SAMPLES 0`: every element counted).
async fn memory_of(key: &str) -> u64 {
    let mut r = redis().await;
    redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(key)
        .arg("SAMPLES")
        .arg(0)
        .query_async::<Option<u64>>(&mut r)
        .await
        .ok()
        .flatten()
        .unwrap_or(0)
}

on_single_and_cluster! {
/// Ten times the outstanding cap parked, the provider refusing for five lease periods, the
/// replayer far slower than leases run out: the replay stream never holds more than the cap,
/// and once the provider is back every row is embedded exactly once.
async fn a_backlog_ten_times_the_cap_keeps_the_replay_stream_bounded_and_embeds_each_row_once() {
    // EMBED_DLQ_BACKLOG_ROWS / _CAP scale it up for the measured run in BENCHMARKS.md.
    let env = |k: &str, d: usize| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let (rows, cap) = (env("EMBED_DLQ_BACKLOG_ROWS", 3_000), env("EMBED_DLQ_BACKLOG_CAP", 300));
    let db = TestDb::new().await;
    let keys = fresh_keys();
    park_due(&db, rows, "backlog").await;
    // The parks' events are published first, as they would be long before a backlog this
    // old: the refusing phase then times the replay work alone.
    relay_all(&db, &keys).await;
    let memory_before = used_memory().await;
    let refusing = start_mock(MockConfig::default()).await;
    refusing.control.set_quota_exhausted(true);
    let lease = Duration::from_secs(2);
    let config = ReplayConfig {
        batch: 16,
        block: Duration::from_millis(200),
        // Long enough that no live replayer's batch is ever reclaimed, even on a loaded
        // machine (a reclaim of a batch in flight embeds it twice, fenced at commit, and this
        // test counts embeddings).
        min_idle: Duration::from_secs(30),
        lease,
        outstanding_max: cap,
        systemic_pause: Duration::from_millis(500),
        schedule_every: Duration::from_millis(100),
        ..Default::default()
    };
    let stop = CancellationToken::new();
    let p = pipeline(&settings(&db, &refusing)).await;
    let scheduler = tokio::spawn(Scheduler::new(p.store.clone(), config.clone(), redis().await, keys.clone()).run(stop.clone()));
    let relay_config = RelayConfig { replay_maxlen: cap, poll: Duration::from_millis(100), ..Default::default() };
    let relay = tokio::spawn(Relay::new(db.pool.clone(), redis().await, keys.clone(), relay_config).run(stop.clone()));
    let (mut memory_peak, mut replay_memory_peak) = (memory_before, 0);
    let refused = CancellationToken::new();
    let slow = replayer(&db, &refusing, &keys, "refused", config.clone()).await;
    let slow = tokio::spawn(slow.run(refused.clone(), refused.clone()));
    let mut peak = 0;
    // Items issued: one lease number drawn for each (an entry carries a batch of them, and
    // the replayer deletes the entries it settles, so the stream cannot count them). The
    // refusing phase lasts at least five leases and until the work was issued again as the
    // leases ran out (counted, not timed: a loaded machine may need longer), at most 2 min.
    let issued_sql = "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM embed_dlq_lease_seq";
    let started = tokio::time::Instant::now();
    let mut issued = 0;
    while started.elapsed() < lease * 5 || issued <= 2 * cap as i64 {
        if started.elapsed() > Duration::from_secs(120) {
            break;
        }
        peak = peak.max(replay_len(&keys).await);
        memory_peak = memory_peak.max(used_memory().await);
        replay_memory_peak = replay_memory_peak.max(memory_of(&keys.replay()).await);
        tokio::time::sleep(Duration::from_millis(50)).await;
        issued = db.count(issued_sql).await;
    }
    refused.cancel();
    slow.await.unwrap().unwrap();
    let issued = db.count(issued_sql).await;
    eprintln!(
        "backlog: refusing phase: {issued} items issued, {} leases, {} loads, {} provider requests",
        db.count("SELECT count(*) FROM replay_lease").await,
        db.count("SELECT coalesce(sum(loads), 0)::bigint FROM replay_lease").await,
        refusing.control.stats().requests
    );
    assert!(issued > 2 * cap as i64, "the refusing phase issued work again as leases ran out ({issued} items)");
    assert!(refusing.control.stats().requests > 0, "the provider was asked and refused");
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 0);

    let healthy = start_mock(MockConfig::default()).await;
    let recovered = CancellationToken::new();
    let config = ReplayConfig { batch: 64, lease: Duration::from_secs(60), ..config };
    let mut replayers = Vec::new();
    for name in ["healthy-1", "healthy-2"] {
        let r = replayer(&db, &healthy, &keys, name, config.clone()).await;
        replayers.push(tokio::spawn(r.run(recovered.clone(), recovered.clone())));
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(180 + rows as u64 / 100);
    while db.count("SELECT count(*) FROM embedding_dlq").await > 0 {
        assert!(tokio::time::Instant::now() < deadline, "the backlog did not drain");
        peak = peak.max(replay_len(&keys).await);
        memory_peak = memory_peak.max(used_memory().await);
        replay_memory_peak = replay_memory_peak.max(memory_of(&keys.replay()).await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    recovered.cancel();
    stop.cancel();
    for r in replayers {
        r.await.unwrap().unwrap();
    }
    scheduler.await.unwrap().unwrap();
    relay.await.unwrap().unwrap();
    eprintln!(
        "backlog: {rows} rows, cap {cap}, {issued} work items issued while refused; replay stream peak {peak} \
         entries, {replay_memory_peak} bytes; Redis used_memory before {memory_before}, peak {memory_peak}, \
         after {} (events stream {} bytes)",
        used_memory().await,
        memory_of(&keys.events()).await
    );
    assert!(peak <= cap, "the replay stream held {peak} entries, over the cap of {cap}");
    assert_eq!(healthy.control.stats().inputs, rows as u64, "each row embedded exactly once after recovery");
    assert_eq!(
        db.count("SELECT count(DISTINCT (doc_id, chunk_index)) FROM doc_embeddings WHERE doc_id = 'backlog'").await,
        rows as i64
    );
}
}

/// A backlog many times the outstanding cap, a scheduler that ticks every 2 s: replay must
/// go at the replayers' pace, not at one cap's worth of rows per tick. Each settled batch frees
/// leases, and the next work has to be issued then (the chaos run's settle, 64 outstanding and
/// a pass a second, left 6,000-11,000 of 25,000 rows undrained after 280 s). At a cap per tick
/// this backlog takes 300 s; it has 90.
#[test]
fn a_backlog_past_the_cap_drains_at_the_replayers_pace_not_a_cap_per_tick() {
    run_on(Backend::SingleNode, async {
        const ROWS: usize = 1_200;
        const CAP: usize = 8;
        let db = TestDb::new().await;
        let keys = fresh_keys();
        park_due(&db, ROWS, "paced").await;
        relay_all(&db, &keys).await;
        let mock = start_mock(MockConfig::default()).await;
        let config = ReplayConfig {
            batch: 16,
            block: Duration::from_millis(200),
            min_idle: Duration::from_secs(30),
            lease: Duration::from_secs(60),
            outstanding_max: CAP,
            schedule_every: Duration::from_secs(2),
            ..Default::default()
        };
        let stop = CancellationToken::new();
        let p = pipeline(&settings(&db, &mock)).await;
        let mut tasks = tokio::task::JoinSet::new();
        let relay_config =
            RelayConfig { replay_maxlen: CAP, poll: Duration::from_millis(100), ..Default::default() };
        let relay = Relay::new(db.pool.clone(), redis().await, keys.clone(), relay_config);
        let scheduler = Scheduler::new(p.store.clone(), config.clone(), redis().await, keys.clone());
        spawn_scheduler_and_relay(&mut tasks, scheduler, relay, &stop);
        let rep = replayer(&db, &mock, &keys, "paced", config).await;
        let s = stop.clone();
        tasks.spawn(async move { rep.run(s.clone(), s).await.map_err(|e| e.to_string()) });
        let started = tokio::time::Instant::now();
        wait_for("the backlog to drain", Duration::from_secs(90), async || {
            db.count("SELECT count(*) FROM embedding_dlq").await == 0
        })
        .await;
        eprintln!("paced replay: {ROWS} rows at a cap of {CAP} drained in {:?}", started.elapsed());
        stop.cancel();
        while let Some(r) = tasks.join_next().await {
            r.unwrap().unwrap();
        }
        assert_eq!(mock.control.stats().inputs, ROWS as u64, "each row embedded once");
        assert_eq!(
            db.count(
                "SELECT count(DISTINCT (doc_id, chunk_index)) FROM doc_embeddings WHERE doc_id = 'paced'"
            )
            .await,
            ROWS as i64
        );
    });
}

/// Replay in flight against the Redis at `url`, with production's 15-minute lease; then
/// `flush` loses every stream, group and record of the keys' shard. Replay resumes at once
/// and drains the backlog: it does not wait out the leases of the lost work items.
async fn replay_resumes_after_redis_loses_its_data(url: &str, flush: impl AsyncFnOnce(&StreamKeys)) {
    const ROWS: usize = 600;
    let db = TestDb::new().await;
    let keys = fresh_keys();
    park_due(&db, ROWS, "lost").await;
    let mock = start_mock(MockConfig { latency_ms: 40, ..Default::default() }).await;
    let client = embed_dlq::streams::client(url).unwrap();
    let config = ReplayConfig {
        batch: 16,
        block: Duration::from_millis(200),
        schedule_every: Duration::from_millis(100),
        ..Default::default()
    };
    assert_eq!(config.lease, Duration::from_secs(900), "production's lease");
    let stop = CancellationToken::new();
    let p = pipeline(&settings(&db, &mock)).await;
    let mut tasks = tokio::task::JoinSet::new();
    let relay_config = RelayConfig { poll: Duration::from_millis(100), ..Default::default() };
    let relay = Relay::new(db.pool.clone(), client.managed().await.unwrap(), keys.clone(), relay_config);
    let scheduler =
        Scheduler::new(p.store.clone(), config.clone(), client.managed().await.unwrap(), keys.clone());
    spawn_scheduler_and_relay(&mut tasks, scheduler, relay, &stop);
    let mut redis = client.managed().await.unwrap();
    embed_dlq::replay::ensure_group(&mut redis, &keys).await.unwrap();
    let rep = Replayer {
        name: "survivor".into(),
        store: p.store.clone(),
        embedder: p.embedder.clone(),
        client: client.clone(),
        redis,
        keys: keys.clone(),
        config,
        paused_until: None,
    };
    let s = stop.clone();
    tasks.spawn(async move { rep.run(s.clone(), s).await.map_err(|e| e.to_string()) });
    wait_for("the first replays", Duration::from_secs(60), async || {
        db.count("SELECT count(*) FROM doc_embeddings").await >= 48
    })
    .await;
    flush(&keys).await;
    let lost_at = tokio::time::Instant::now();
    let left = db.count("SELECT count(*) FROM embedding_dlq").await;
    assert!(left > 0, "the data loss came too late: nothing was left in flight");
    // A minute is a fifteenth of the leases the lost items hold.
    wait_for("replay to resume and drain the DLQ", Duration::from_secs(60), async || {
        db.count("SELECT count(*) FROM embedding_dlq").await == 0
    })
    .await;
    eprintln!(
        "redis data loss: {left} rows in the DLQ when it happened, drained {:?} later",
        lost_at.elapsed()
    );
    stop.cancel();
    while let Some(r) = tasks.join_next().await {
        r.unwrap().unwrap();
    }
    assert_eq!(
        db.count("SELECT count(DISTINCT (doc_id, chunk_index)) FROM doc_embeddings WHERE doc_id = 'lost'")
            .await,
        ROWS as i64
    );
}

#[test]
fn replay_resumes_after_a_flushall_of_a_single_node() {
    run_on(Backend::SingleNode, async {
        let redis = PrivateRedis::start().await;
        replay_resumes_after_redis_loses_its_data(&redis.url, async |_| {
            let mut c = redis.manager().await;
            let _: () = redis::cmd("FLUSHALL").query_async(&mut c).await.unwrap();
        })
        .await;
    });
}

#[test]
fn replay_resumes_after_a_cluster_master_loses_its_data() {
    run_on(Backend::Cluster, async {
        let cluster = PrivateCluster::start().await;
        replay_resumes_after_redis_loses_its_data(&cluster.url, async |keys| {
            let master = cluster.master_of(&keys.replay()).await;
            let mut c = cluster.node(master).await.unwrap();
            let _: () = redis::cmd("FLUSHALL").query_async(&mut c).await.unwrap();
        })
        .await;
    });
}

/// The `event_id`s on the events stream (every shard) of the Redis at `conn`.
async fn event_ids_on_stream(
    conn: &mut embed_dlq::streams::RedisConn,
    keys: &StreamKeys,
) -> std::collections::HashSet<String> {
    let mut ids = std::collections::HashSet::new();
    for shard in keys.shard_ids() {
        let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
            .arg(keys.events_of(shard))
            .arg("-")
            .arg("+")
            .query_async(conn)
            .await
            .unwrap();
        ids.extend(reply.ids.iter().filter_map(|e| embed_dlq::streams::field(&e.map, "event_id")));
    }
    ids
}

/// Every event of the outbox (plain SQL on the outbox).
async fn published_event_ids(db: &TestDb) -> std::collections::HashSet<String> {
    let ids: Vec<String> =
        sqlx::query_scalar("SELECT event_id::text FROM dlq_outbox WHERE stream = 'events'")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    ids.into_iter().collect()
}

#[test]
fn serve_republishes_the_events_a_flushall_lost() {
    republishes_after_flushall(1);
}

/// With no replayer (and with one paused by a refusing provider, above) nothing reads the
/// replay streams, so no read finds a consumer group gone: serve must notice the loss by
/// itself.
#[test]
fn serve_without_replayers_republishes_the_events_a_flushall_lost() {
    republishes_after_flushall(0);
}

/// Parks rows whose replay the provider refuses, lets `serve --replayers {replayers}` publish
/// their events, flushes Redis and waits for exactly those events to be back on the stream.
fn republishes_after_flushall(replayers: usize) {
    run_on(Backend::SingleNode, async move {
        const ROWS: usize = 40;
        let redis = PrivateRedis::start().await;
        let db = TestDb::new().await;
        let keys = fresh_keys();
        park_due(&db, ROWS, "gone").await;
        // The provider refuses replay, so the rows stay parked and their events stay the
        // only ones: what the stream must hold again after the loss is exactly known.
        let mock = start_mock(MockConfig::default()).await;
        mock.control.set_quota_exhausted(true);
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_embed-dlq"));
        child
            .arg("serve")
            .args(["--database-url", &db.url, "--redis-url", &redis.url, "--base-url", &mock.base_url()])
            .args(["--model", "mock", "--stream-prefix", &prefix_of(&keys), "--relay-poll-ms", "100"])
            .args(["--replayers", &replayers.to_string()])
            .env_remove("EMBED_DLQ_FAILPOINT")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        let mut child = child.spawn().unwrap();
        let mut conn = redis.manager().await;
        wait_for("the parks on the events stream", Duration::from_secs(60), async || {
            let published = published_event_ids(&db).await;
            published.len() >= ROWS && published.is_subset(&event_ids_on_stream(&mut conn, &keys).await)
        })
        .await;
        let before = published_event_ids(&db).await;
        let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
        assert!(event_ids_on_stream(&mut conn, &keys).await.is_empty());
        wait_for("the lost events back on the stream", Duration::from_secs(60), async || {
            before.is_subset(&event_ids_on_stream(&mut conn, &keys).await)
        })
        .await;
        let _ = child.kill().await;
        let on_stream = event_ids_on_stream(&mut conn, &keys).await;
        let mut conn2 = redis.manager().await;
        let entries: usize = redis::cmd("XLEN").arg(keys.events()).query_async(&mut conn2).await.unwrap();
        assert_eq!(entries, on_stream.len(), "each event once on the stream");
    });
}

/// Redis killed during a drain and restarted from a snapshot older than its last writes (a
/// restore, or a restart that lost what came after the last save): the consumer group is in
/// the snapshot, so no read finds it gone, yet the newest work items and events are lost.
/// Serve sees another server under the shard and, with no reconciler, has the lost work
/// issued again within seconds (its lease is 15 minutes) and the lost events published
/// again; every chunk ends stored once and every event is on the stream once.
#[test]
fn a_redis_restored_from_an_older_snapshot_under_serve_gets_its_lost_work_and_events_back() {
    run_on(Backend::SingleNode, async {
        const N: usize = 1500;
        let mut redis = PrivateRedis::start_with_snapshots().await;
        let db = TestDb::new().await;
        let corpus = crate::cluster::park_due(&db, N, "restored").await;
        // Due over the first 6 seconds, so that work is still being issued at the crash.
        sqlx::query("UPDATE embedding_dlq SET next_retry_at = now() + random() * interval '6 seconds'")
            .execute(&db.pool)
            .await
            .unwrap();
        let mock = start_mock(MockConfig { latency_ms: 30, ..MockConfig::default() }).await;
        let serving = pipeline(&settings(&db, &mock)).await;
        let keys = fresh_keys();
        let client = embed_dlq::streams::client(&redis.url).unwrap();
        let cancel = CancellationToken::new();
        let serve = tokio::spawn(embed_dlq::serve::serve(
            serving.store.clone(),
            serving.embedder.clone(),
            client,
            crate::cluster::drain_config(&keys, "it-restored"),
            cancel.clone(),
        ));
        let left = async || db.count("SELECT count(*) FROM embedding_dlq").await;
        wait_for("the drain to start", Duration::from_secs(60), async || left().await < (N as i64) * 4 / 5)
            .await;

        // The snapshot, then events written after it: those the restart loses for certain
        // (nobody consumes the events stream).
        redis.save().await;
        let mut conn = redis.manager().await;
        let saved: std::collections::HashSet<String> = event_ids_on_stream(&mut conn, &keys).await;
        wait_for("events after the snapshot", Duration::from_secs(30), async || {
            event_ids_on_stream(&mut conn, &keys).await.len() > saved.len()
        })
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let lost: Vec<String> = event_ids_on_stream(&mut conn, &keys)
            .await
            .into_iter()
            .filter(|id| !saved.contains(id))
            .collect();
        let at_crash = left().await;
        redis.crash_and_restart().await;
        assert!(at_crash > 0, "the drain finished before the crash");
        let mut conn = redis.manager().await;
        let restored = event_ids_on_stream(&mut conn, &keys).await;
        assert!(
            lost.iter().all(|id| !restored.contains(id)),
            "the restart kept events written after the save"
        );

        wait_for("every row replayed and every lost event back", Duration::from_secs(90), async || {
            assert!(!serve.is_finished(), "serve stopped after the restart");
            let on_stream = event_ids_on_stream(&mut conn, &keys).await;
            left().await == 0 && lost.iter().all(|id| on_stream.contains(id))
        })
        .await;
        cancel.cancel();
        serve.await.unwrap().expect("serve stops cleanly after the restart");
        eprintln!("crashed with {at_crash} rows left and {} events written after the snapshot", lost.len());

        assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, N as i64);
        assert_eq!(db.leaks().await, 0);
        assert_corpus_accounted(&db, &corpus).await;
        let entries: usize = redis::cmd("XLEN").arg(keys.events()).query_async(&mut conn).await.unwrap();
        assert_eq!(
            entries,
            event_ids_on_stream(&mut conn, &keys).await.len(),
            "each event once on the stream"
        );
    });
}

/// Work items on the replay stream shards of `keys`, read and parsed here.
async fn replay_items(keys: &StreamKeys) -> usize {
    replay_entries(keys).await.0.len()
}

/// 600 due rows parked, and a scheduler's settings with leases of 1 s, batches and an
/// outstanding cap of `cap`, a pass every 100 ms: the backlog of the tests where no replayer
/// reads what is issued.
async fn unread_backlog(db: &TestDb, cap: usize) -> (embed_dlq::ingest::Pipeline, ReplayConfig) {
    park_due(db, 600, "unread").await;
    let mock = start_mock(MockConfig::default()).await;
    let p = pipeline(&settings(db, &mock)).await;
    let config = ReplayConfig {
        batch: cap,
        lease: Duration::from_secs(1),
        outstanding_max: cap,
        schedule_every: Duration::from_millis(100),
        ..Default::default()
    };
    (p, config)
}

on_single_and_cluster! {
/// With no replayer at all for many lease periods, the scheduler issues the same rows again
/// each time their leases run out, a batch to an entry: the stream must stay near the
/// outstanding cap in items, not grow to the cap in entries of a batch each (here eight lease
/// periods left 800 items; the trim by age keeps about two periods' worth, 300).
async fn with_no_replayer_for_many_leases_the_replay_stream_holds_about_two_leases_of_work() {
    const CAP: usize = 100;
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let (p, config) = unread_backlog(&db, CAP).await;
    let stop = CancellationToken::new();
    let scheduler = tokio::spawn(Scheduler::new(p.store.clone(), config, redis().await, keys.clone()).run(stop.clone()));
    let (mut peak, mut at_end) = (0, 0);
    // Until the rows were issued five times over (counted, not timed: about 8 s on a quiet
    // machine), sampling the stream all along.
    let issued_sql = "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM embed_dlq_lease_seq";
    let started = tokio::time::Instant::now();
    let mut issued = 0;
    while issued < 5 * CAP as i64 {
        assert!(started.elapsed() < Duration::from_secs(120), "the scheduler issued the rows again as their leases ran out ({issued})");
        at_end = replay_items(&keys).await;
        peak = peak.max(at_end);
        tokio::time::sleep(Duration::from_millis(100)).await;
        issued = db.count(issued_sql).await;
    }
    stop.cancel();
    scheduler.await.unwrap().unwrap();
    eprintln!("no replayer: {issued} items issued over {:?}, stream peak {peak} items, {at_end} at the end", started.elapsed());
    // Two lease periods and a pass of margin (300 here); without the trim by age, 800.
    assert!(peak <= 4 * CAP, "the replay stream held {peak} items with a cap of {CAP}");
}
}

on_single_and_cluster! {
/// A scheduler restarted after issuing work no replayer read, with nothing due any more (the
/// rows postponed): a scheduler trims by age only below entries in its log, and a new one
/// knew nothing of what the one before it appended, so those items stayed on the stream for
/// good (300 here). Now it notes each shard's newest entry as it starts and trims below it
/// once that is a lease (and the margin) old.
async fn a_restarted_scheduler_trims_what_the_one_before_it_issued_once_its_leases_ran_out() {
    const CAP: usize = 100;
    let db = TestDb::new().await;
    let keys = fresh_keys();
    let (p, config) = unread_backlog(&db, CAP).await;
    // A scheduler runs until the stream's items are what `done` waits for (counted, not timed:
    // a few seconds on a quiet machine), at most a minute.
    let run_until = async |what: &str, done: fn(usize) -> bool| {
        let stop = CancellationToken::new();
        let scheduler = tokio::spawn(
            Scheduler::new(p.store.clone(), config.clone(), redis().await, keys.clone()).run(stop.clone()),
        );
        let started = tokio::time::Instant::now();
        let mut items = replay_items(&keys).await;
        while !done(items) {
            assert!(started.elapsed() < Duration::from_secs(60), "{what} ({items} items on the stream)");
            tokio::time::sleep(Duration::from_millis(100)).await;
            items = replay_items(&keys).await;
        }
        stop.cancel();
        scheduler.await.unwrap().unwrap();
        items
    };
    let left_by_the_first =
        run_until("the first scheduler issued work again and again", |items| items >= 2 * CAP).await;
    sqlx::query("UPDATE embedding_dlq SET next_retry_at = now() + interval '1 hour'")
        .execute(&db.pool)
        .await
        .unwrap();
    // A lease and its margin are 2 s here: the second scheduler trims after that. The entry
    // it found newest stays (the trim removes what is below it).
    let left = run_until("the replay stream still held items issued before the restart", |items| items <= CAP).await;
    eprintln!("restarted with nothing due: {left_by_the_first} items on the stream before, {left} after");
}
}
