//! Sharded streams (issue 10 item 2): `stream_shards` N splits the replay and events streams
//! into N hash slots. Each test runs on the single node and on the local Redis Cluster
//! (`on_single_and_cluster!`); on the cluster the shards must land on several masters.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use embed_dlq::reconcile::{Check, Mode};
use embed_dlq::relay::RelayConfig;
use embed_dlq::replay::ReplayConfig;
use embed_dlq::serve::{ServeConfig, ServeError};
use embed_dlq::streams::StreamKeys;
use embed_dlq::testkit::mock_provider::MockConfig;
use tokio_util::sync::CancellationToken;

use crate::support::*;

/// Fresh keys with `shards` shards.
fn sharded_keys(shards: u16) -> StreamKeys {
    StreamKeys::with_shards(&format!("it-sh-{}-{}", std::process::id(), rand::random::<u32>()), shards)
}

/// Parks `n` chunks (over `n / 10` documents) as transient, due for replay now; returns the
/// corpus keys.
async fn park_due(db: &TestDb, n: usize, doc: &str) -> std::collections::BTreeSet<(String, i32)> {
    let down = start_mock(MockConfig::default()).await;
    down.control.set_outage(true);
    let mut s = settings(db, &down);
    s.retry.max_attempts = 1;
    let p = pipeline(&s).await;
    let corpus: String = (0..n)
        .map(|i| line(&format!("{doc}-{}", i / 10), (i % 10) as i32, &format!("{doc} chunk {i}")))
        .collect();
    let keys = corpus_keys(corpus.as_bytes());
    let r = p.run(input(corpus.into_bytes()), CancellationToken::new()).await.unwrap();
    assert_eq!(r.parked_total(), n as u64);
    make_due(db).await;
    keys
}

/// Entries of a stream.
async fn xlen(key: &str) -> u64 {
    redis::cmd("XLEN").arg(key).query_async(&mut redis().await).await.unwrap()
}

/// Entries ever added to the stream `key` (`XINFO STREAM`'s `entries-added`: the replayers
/// delete the replay entries they settle, so their length says nothing once drained).
async fn entries_added(key: &str) -> u64 {
    let info: std::collections::HashMap<String, redis::Value> =
        redis::cmd("XINFO").arg("STREAM").arg(key).query_async(&mut redis().await).await.unwrap();
    redis::from_redis_value_ref(info.get("entries-added").expect("XINFO STREAM has entries-added")).unwrap()
}

/// On the cluster: the port of the master serving `key` (the seed node that answers a keyed
/// read without MOVED; the test cluster's masters are its seed nodes).
async fn master_of(key: &str) -> String {
    for url in redis_url().split(',') {
        let mut c = redis::Client::open(url).unwrap().get_multiplexed_async_connection().await.unwrap();
        if redis::cmd("EXISTS").arg(key).query_async::<i64>(&mut c).await.is_ok() {
            return url.to_string();
        }
    }
    panic!("no master of {key} among the seeds");
}

on_single_and_cluster! {
/// The acceptance check: 4 shards, a parked corpus drains through `serve` with fewer
/// replayers than shards, every shard carries work and events, nothing is stored twice, and
/// on the cluster the shards sit on several masters.
async fn a_parked_corpus_drains_through_four_shards_with_two_replayers() {
    const N: usize = 2000;
    let db = TestDb::new().await;
    let corpus = park_due(&db, N, "sharded").await;
    let healthy = start_mock(MockConfig::default()).await;
    let serving = pipeline(&settings(&db, &healthy)).await;
    let keys = sharded_keys(4);
    let config = ServeConfig {
        replayers: 2,
        relay: RelayConfig { poll: Duration::from_millis(100), ..RelayConfig::default() },
        replay: ReplayConfig {
            batch: 64,
            block: Duration::from_millis(400),
            min_idle: Duration::from_secs(5),
            schedule_every: Duration::from_millis(100),
            ..ReplayConfig::default()
        },
        keys: keys.clone(),
        grace: Duration::from_secs(5),
        consumer_prefix: "it-sharded".into(),
        reconcile_every: None,
        reconcile_sweeps: Default::default(),
        metrics: false,
        source: None,
        source_ingest: Default::default(),
        table_followers: Vec::new(),
    };
    let cancel = CancellationToken::new();
    let serve = tokio::spawn(embed_dlq::serve::serve(
        serving.store.clone(),
        serving.embedder.clone(),
        redis_client(),
        config,
        cancel.clone(),
    ));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while db.count("SELECT count(*) FROM embedding_dlq").await > 0 {
        assert!(tokio::time::Instant::now() < deadline, "serve did not drain the sharded DLQ");
        assert!(!serve.is_finished(), "serve stopped");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The last `replayed` events are published by the relay right after their commits:
    // the stop comes once every event the outbox holds is on a shard (counted, not slept on).
    wait_for("the relay published every event", Duration::from_secs(60), async || {
        let mut events = 0;
        for shard in keys.shard_ids() {
            events += xlen(&keys.events_of(shard)).await;
        }
        let published = db.count("SELECT count(*) FROM dlq_outbox WHERE stream = 'events'").await;
        events as i64 >= published
    })
    .await;
    cancel.cancel();
    serve.await.unwrap().unwrap();

    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, N as i64);
    assert_corpus_accounted(&db, &corpus).await;
    assert_eq!(db.leaks().await, 0);
    assert_eq!(db.manifest_disagreements().await, 0);
    let mut events = 0;
    for shard in keys.shard_ids() {
        let (work, evs) = (entries_added(&keys.replay_of(shard)).await, xlen(&keys.events_of(shard)).await);
        assert!(work > 0 && evs > 0, "shard {shard}: {work} replay entries, {evs} events");
        events += evs;
    }
    let published: i64 = db.count("SELECT count(*) FROM dlq_outbox WHERE stream = 'events'").await;
    assert_eq!(events as i64, published, "every event on exactly one shard");
    if backend() == Backend::Cluster {
        let mut masters = HashSet::new();
        for shard in keys.shard_ids() {
            masters.insert(master_of(&keys.replay_of(shard)).await);
        }
        assert!(masters.len() >= 2, "the 4 shards sit on {} master(s)", masters.len());
    }
    // Nothing left for the reconciler.
    let mut r = reconciler(&db, &keys, immediate()).await;
    let report = r.run_once(Mode::Check).await.unwrap();
    assert_eq!(report.total_found(), 0, "{report:#?}");
}
}

on_single_and_cluster! {
/// `tail` follows all shards, merged; a restart from its checkpoint (one id per shard)
/// neither skips nor repeats an event, and each chunk's events keep their order.
async fn tail_merges_every_shard_and_resumes_without_gaps_or_repeats() {
    let db = TestDb::new().await;
    let keys = sharded_keys(3);
    park_due(&db, 60, "tail").await;
    relay_all(&db, &keys).await;
    let dir = std::env::temp_dir().join(format!("embed-dlq-shtail-{}", rand::random::<u64>()));
    std::fs::create_dir_all(&dir).unwrap();
    let checkpoint = dir.join("tail.checkpoint");
    let opts = |count: Option<u64>| embed_dlq::tail::TailOptions {
        from: "0".into(),
        checkpoint: Some(checkpoint.clone()),
        count,
        no_follow: true,
        on_gap: embed_dlq::tail::OnGap::Fail,
    };
    let mut first: Vec<embed_dlq::tail::TailEvent> = Vec::new();
    let n = embed_dlq::tail::tail(&redis_client(), &keys, &opts(Some(25)), &mut first, CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(n, 25);
    let saved = std::fs::read_to_string(&checkpoint).unwrap();
    assert!(saved.starts_with("stream_shards 3\n"), "{saved}");
    let mut second: Vec<embed_dlq::tail::TailEvent> = Vec::new();
    let n = embed_dlq::tail::tail(&redis_client(), &keys, &opts(None), &mut second, CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(n, 35);
    // One park event per chunk: the DLQ row id identifies it.
    let seen: Vec<i64> = first.iter().chain(&second).map(|e| e.to_json()["dlq_id"].as_i64().unwrap()).collect();
    let unique: HashSet<i64> = seen.iter().copied().collect();
    assert_eq!(unique.len(), 60, "no repeat across the restart");
    let expected: Vec<i64> = sqlx::query_scalar("SELECT dlq_id FROM dlq_outbox WHERE stream = 'events'")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(unique, expected.into_iter().collect::<HashSet<_>>(), "no gap");
    // A checkpoint of another shard count is refused, not misread.
    let err = embed_dlq::tail::tail(
        &redis_client(),
        &StreamKeys::with_shards(keys.prefix(), 1),
        &opts(None),
        &mut Vec::new(),
        CancellationToken::new(),
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("shard"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
}

on_single_and_cluster! {
/// Reconcile checks every shard: events deleted from two shards are found and republished
/// to the same shards, an orphan work item on a shard is found and removed.
async fn reconcile_checks_and_repairs_every_shard() {
    let db = TestDb::new().await;
    let keys = sharded_keys(4);
    park_due(&db, 40, "rec").await;
    relay_all(&db, &keys).await;
    let mut r = reconciler(&db, &keys, immediate()).await;
    assert_eq!(r.run_once(Mode::Check).await.unwrap().total_found(), 0);
    let mut conn = redis().await;
    let mut deleted = 0;
    let mut before: HashMap<u16, u64> = HashMap::new();
    for shard in [1u16, 3] {
        let entries: redis::streams::StreamRangeReply =
            redis::cmd("XRANGE").arg(keys.events_of(shard)).arg("-").arg("+").arg("COUNT").arg(2).query_async(&mut conn).await.unwrap();
        for e in &entries.ids {
            let _: i64 = redis::cmd("XDEL").arg(keys.events_of(shard)).arg(&e.id).query_async(&mut conn).await.unwrap();
            deleted += 1;
        }
        before.insert(shard, xlen(&keys.events_of(shard)).await);
    }
    assert!(deleted > 0);
    let orphan: String = redis::cmd("XADD")
        .arg(keys.replay_of(2))
        .arg("*")
        .arg("body")
        .arg(r#"{"dlq_id": 999999999, "generation": 1}"#)
        .query_async(&mut conn)
        .await
        .unwrap();
    let report = r.run_once(Mode::Repair).await.unwrap();
    assert_eq!(report.get(Check::MissingEvents).found, deleted);
    assert_eq!(report.get(Check::OrphanStreamEntries).found, 1, "{orphan} on shard 2");
    relay_all(&db, &keys).await;
    for (shard, n) in before {
        assert!(xlen(&keys.events_of(shard)).await > n, "shard {shard} got its events back");
    }
    let report = r.run_once(Mode::Check).await.unwrap();
    assert_eq!(report.total_found(), 0, "{report:#?}");
}
}

on_single_and_cluster! {
/// The shard count is recorded with the streams; a process configured with another one
/// refuses to start (serve, reconcile, tail) and says why; streams from before the count was
/// recorded count as one shard.
async fn another_shard_count_is_refused_with_a_clear_message() {
    let keys = sharded_keys(4);
    let mut conn = redis().await;
    embed_dlq::streams::check_shards(&mut conn, &keys).await.unwrap();
    embed_dlq::streams::check_shards(&mut conn, &keys).await.unwrap();
    let two = StreamKeys::with_shards(keys.prefix(), 2);
    let err = embed_dlq::streams::check_shards(&mut conn, &two).await.unwrap_err().to_string();
    assert!(err.contains("set up with 4 shard(s)") && err.contains("stream_shards = 2"), "{err}");

    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let p = pipeline(&settings(&db, &mock)).await;
    let config = ServeConfig {
        replayers: 1,
        relay: RelayConfig::default(),
        replay: ReplayConfig::default(),
        keys: two.clone(),
        grace: Duration::from_secs(1),
        consumer_prefix: "it-shard-mismatch".into(),
        reconcile_every: None,
        reconcile_sweeps: Default::default(),
        metrics: false,
        source: None,
        source_ingest: Default::default(),
        table_followers: Vec::new(),
    };
    let served = embed_dlq::serve::serve(p.store.clone(), p.embedder.clone(), redis_client(), config, CancellationToken::new()).await;
    assert!(matches!(served, Err(ServeError::Shards(_))), "{served:?}");
    let mut r = reconciler(&db, &two, immediate()).await;
    assert!(r.run_once(Mode::Check).await.unwrap_err().to_string().contains("set up with 4 shard(s)"));
    // The commands: a usage error (exit 2) that names both counts; nothing runs.
    let base_url = mock.base_url();
    for command in ["serve", "reconcile", "tail"] {
        let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_embed-dlq"))
            .arg(command)
            .args(["--database-url", &db.url, "--redis-url", &redis_url()])
            .args(if command == "serve" { vec!["--base-url", base_url.as_str()] } else { vec![] })
            .args(["--stream-prefix", keys.prefix(), "--stream-shards", "2"])
            .env_remove("EMBED_DLQ_CONFIG")
            .stdin(std::process::Stdio::null())
            .output()
            .await
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{command}: {stderr}");
        assert!(stderr.contains("set up with 4 shard(s)") && stderr.contains("stream_shards = 2"), "{command}: {stderr}");
    }

    // An unsharded deployment from before the count was recorded.
    let legacy = sharded_keys(1);
    let _: String = redis::cmd("XADD").arg(legacy.events()).arg("*").arg("k").arg("v").query_async(&mut conn).await.unwrap();
    let four = StreamKeys::with_shards(legacy.prefix(), 4);
    let err = embed_dlq::streams::check_shards(&mut conn, &four).await.unwrap_err().to_string();
    assert!(err.contains("set up with 1 shard(s)"), "{err}");
    embed_dlq::streams::check_shards(&mut conn, &legacy).await.unwrap();
}
}

on_single_and_cluster! {
/// A replayer that reads several shards does not wait on an empty one while another has work
/// (the capacity check found 4 shards over 2 replayers draining at less than half the rate:
/// each read blocked for its share of the block time on an empty shard first). Shard 0 is
/// emptied, shard 1 holds work; with a block time of a minute, a read that blocked on shard 0
/// first would take 30 s: it must come back with shard 1's work long before.
async fn a_replayer_with_several_shards_takes_work_without_waiting_on_an_empty_one() {
    let db = TestDb::new().await;
    park_due(&db, 40, "stall").await;
    let healthy = start_mock(MockConfig::default()).await;
    let p = pipeline(&settings(&db, &healthy)).await;
    let keys = sharded_keys(2);
    let mut redis = redis().await;
    embed_dlq::replay::ensure_group(&mut redis, &keys).await.unwrap();
    let config = ReplayConfig { batch: 64, block: Duration::from_secs(60), ..ReplayConfig::default() };
    embed_dlq::replay::Scheduler::new(p.store.clone(), config.clone(), redis.clone(), keys.clone()).run_once().await.unwrap();
    relay_all(&db, &keys).await;
    let (on_0, on_1) = (xlen(&keys.replay_of(0)).await, xlen(&keys.replay_of(1)).await);
    assert!(on_0 > 0 && on_1 > 0, "40 chunks spread over both shards: {on_0} and {on_1}");
    let _: u64 = redis::cmd("XTRIM").arg(keys.replay_of(0)).arg("MAXLEN").arg(0).query_async(&mut redis).await.unwrap();
    // Work items left, all on shard 1 (in one entry: a batch holds all of them).
    let items_on_1 = replay_entries(&keys).await.0.len() as u64;
    let mut replayer = embed_dlq::replay::Replayer {
        name: "stall-0".into(),
        store: p.store.clone(),
        embedder: p.embedder.clone(),
        client: redis_client(),
        redis: redis.clone(),
        keys: keys.clone(),
        config: ReplayConfig { shards: vec![0, 1], ..config },
        paused_until: None,
    };
    let mut conn = embed_dlq::streams::blocking(&redis_client(), Duration::from_secs(70)).await.unwrap();
    let counts = tokio::time::timeout(
        Duration::from_secs(20),
        replayer.read_once(&mut conn, &CancellationToken::new()),
    )
    .await
    .expect("the read did not wait out an empty shard's block time")
    .unwrap();
    assert_eq!(counts.replayed, items_on_1, "{counts:?}");
}
}
