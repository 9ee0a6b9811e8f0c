//! Redis Cluster specifics (issue 10): a single seed URL with `redis_cluster`, and a master
//! killed during a drain. The relay, replay, tail and reconcile tests run on both deployments
//! through `on_single_and_cluster!`; these are the cluster-only ones. Real Postgres, real
//! Redis Cluster, the mock provider over real HTTP.

use std::time::Duration;

use embed_dlq::dlq::Filter;
use embed_dlq::reconcile::{Check, Mode};
use embed_dlq::relay::RelayConfig;
use embed_dlq::replay::ReplayConfig;
use embed_dlq::serve::ServeConfig;
use embed_dlq::streams::StreamKeys;
use embed_dlq::testkit::mock_provider::MockConfig;
use tokio_util::sync::CancellationToken;

use crate::support::*;

/// Parks `n` chunks as transient (the provider is down) and makes them due for replay;
/// returns the corpus keys.
async fn park_due(db: &TestDb, n: usize, doc: &str) -> std::collections::BTreeSet<(String, i32)> {
    let down = start_mock(MockConfig::default()).await;
    down.control.set_outage(true);
    let mut s = settings(db, &down);
    s.retry.max_attempts = 1;
    let p = pipeline(&s).await;
    let corpus: String = (0..n).map(|i| line(doc, i as i32, &format!("{doc} chunk {i}"))).collect();
    let keys = corpus_keys(corpus.as_bytes());
    let r = p.run(input(corpus.into_bytes()), CancellationToken::new()).await.unwrap();
    assert_eq!(r.parked_total(), n as u64);
    make_due(db).await;
    keys
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_seed_url_with_redis_cluster_discovers_the_other_nodes() {
    let seed = std::env::var("REDIS_CLUSTER_URL").expect("REDIS_CLUSTER_URL (scripts/test.sh)");
    let seed = seed.split(',').next().unwrap().to_string();
    // As a plain single-node client, the seed answers MOVED for keys of other masters' slots:
    // what `serve` logged forever before cluster mode.
    let mut plain = embed_dlq::streams::client(&seed).unwrap().managed().await.unwrap();
    let keys: Vec<String> = (0..16)
        .map(|i| format!("{{it-seed-{}-{}-{i}}}:k", std::process::id(), rand::random::<u32>()))
        .collect();
    let mut moved = 0;
    for k in &keys {
        if let Err(e) = redis::cmd("SET").arg(k).arg(1).arg("EX").arg(60).query_async::<()>(&mut plain).await
        {
            assert_eq!(e.kind(), redis::ErrorKind::Server(redis::ServerErrorKind::Moved), "{e}");
            moved += 1;
        }
    }
    assert!(moved > 0, "16 random hash tags all on the seed's master");
    // With `redis_cluster`, the same seed reaches every slot.
    let client = embed_dlq::streams::open(&seed, true).unwrap();
    assert!(client.is_cluster());
    let mut conn = client.managed().await.unwrap();
    for k in &keys {
        let () = redis::cmd("SET").arg(k).arg(2).arg("EX").arg(60).query_async(&mut conn).await.unwrap();
        let v: i64 = redis::cmd("GET").arg(k).query_async(&mut conn).await.unwrap();
        assert_eq!(v, 2);
    }
}

/// A master is SIGKILLed while `serve` drains a parked corpus: its replica is promoted, serve
/// carries on without a restart, the reconciler reschedules from Postgres whatever the
/// promoted replica had not received, and every chunk ends stored exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_killed_during_a_drain_loses_nothing_and_stores_nothing_twice() {
    const N: usize = 3000;
    let cluster = PrivateCluster::start().await;
    let db = TestDb::new().await;
    let corpus = park_due(&db, N, "failover").await;
    // Due over the first 8 seconds, so that work items are still being published when the
    // master dies.
    sqlx::query("UPDATE embedding_dlq SET next_retry_at = now() + random() * interval '8 seconds'")
        .execute(&db.pool)
        .await
        .unwrap();

    let healthy = start_mock(MockConfig { latency_ms: 30, ..MockConfig::default() }).await;
    let serving = pipeline(&settings(&db, &healthy)).await;
    let keys = StreamKeys::new(&format!("it-failover-{}-{}", std::process::id(), rand::random::<u32>()));
    let config = ServeConfig {
        replayers: 2,
        relay: RelayConfig { batch: 200, poll: Duration::from_millis(100), ..RelayConfig::default() },
        replay: ReplayConfig {
            batch: 32,
            block: Duration::from_millis(500),
            min_idle: Duration::from_secs(2),
            schedule_every: Duration::from_millis(200),
            ..ReplayConfig::default()
        },
        keys: keys.clone(),
        grace: Duration::from_secs(5),
        consumer_prefix: "it-failover".into(),
        reconcile_every: None,
        reconcile_sweeps: Default::default(),
        metrics: false,
        source: None,
        source_ingest: Default::default(),
    };
    let redis = embed_dlq::streams::client(&cluster.url).unwrap();
    assert!(redis.is_cluster());
    let cancel = CancellationToken::new();
    let serve = tokio::spawn(embed_dlq::serve::serve(
        serving.store.clone(),
        serving.embedder.clone(),
        redis.clone(),
        config,
        cancel.clone(),
    ));

    // Kill the master of the streams' slot once the drain is under way.
    let left = || async { embed_dlq::dlq::count(&serving.store, &Filter::default()).await.unwrap() };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while left().await > (N as u64) * 4 / 5 {
        assert!(tokio::time::Instant::now() < deadline, "the drain did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let master = cluster.master_of(&keys.replay()).await;
    let replica: u16 = cluster
        .info(master, "replication", "slave0")
        .await
        .and_then(|s| s.split(',').find_map(|kv| kv.strip_prefix("port=").map(str::to_string)))
        .expect("the master has a replica")
        .parse()
        .unwrap();
    // Replication is asynchronous. The replica is frozen for less than a
    // `cluster-node-timeout` (so nobody marks it failing) and the master drops its
    // replication link meanwhile: whatever the master takes after that (work items, events,
    // acknowledgements, deliveries) never reaches the replica and dies with the master.
    let replica_pid = cluster.pid(replica).await;
    cluster.signal(&replica_pid, "STOP");
    tokio::time::sleep(Duration::from_millis(150)).await;
    let mut m = cluster.node(master).await.unwrap();
    let _: i64 =
        redis::cmd("CLIENT").arg("KILL").arg("TYPE").arg("replica").query_async(&mut m).await.unwrap();
    // At least 500 ms, and until the master has taken entries (work items or events) the
    // replica never got: on a loaded machine the drain could add none in a fixed pause, and
    // the failover then lost nothing and proved nothing. Never past 1.2 s: the replica stays
    // frozen for less than the cluster's node timeout (2 s).
    let cut_at = tokio::time::Instant::now();
    let added = async |m: &mut redis::aio::MultiplexedConnection| {
        entries_added(m, &keys.replay()).await + entries_added(m, &keys.events()).await
    };
    let added_at_cut = added(&mut m).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    while added(&mut m).await <= added_at_cut && cut_at.elapsed() < Duration::from_millis(1_200) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let at_kill = left().await;
    cluster.kill(master).await;
    cluster.signal(&replica_pid, "CONT");
    assert!(at_kill > 0, "the drain finished before the kill");

    // The replica takes over (after `cluster-node-timeout` and an election); serve keeps
    // running throughout.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while cluster.info(replica, "replication", "role").await.as_deref() != Some("master") {
        assert!(tokio::time::Instant::now() < deadline, "replica {replica} was not promoted");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cluster.wait_healthy(Duration::from_secs(30)).await;
    assert_eq!(cluster.master_of(&keys.replay()).await, replica);

    // Whatever the replica had not received is rescheduled from Postgres by the reconciler
    // (the scheduler's lease is 15 minutes: only the repair can bring it back this soon).
    let mut reconciler = embed_dlq::reconcile::Reconciler {
        store: serving.store.clone(),
        redis: Some(redis.managed().await.unwrap()),
        keys: keys.clone(),
        config: embed_dlq::reconcile::ReconcileConfig {
            lost_work_grace: Duration::from_secs(1),
            ..immediate()
        },
    };
    let (mut rescheduled, mut republished) = (0, 0);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        assert!(!serve.is_finished(), "serve stopped during the failover");
        if left().await == 0 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{} rows left after the failover", left().await);
        match reconciler.run_once(Mode::Repair).await {
            Ok(r) => {
                rescheduled += r.get(Check::LostReplayWork).repaired;
                republished += r.get(Check::MissingEvents).repaired;
            }
            Err(e) => eprintln!("reconcile during the failover: {e}"),
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    cancel.cancel();
    serve.await.unwrap().expect("serve stops cleanly after the failover");
    // After one more repair (events the promoted replica never received are published
    // again), the streams and Postgres agree.
    let last = reconciler.run_once(Mode::Repair).await.unwrap();
    republished += last.get(Check::MissingEvents).repaired;
    eprintln!(
        "killed master {master} with {at_kill} rows left; the reconciler rescheduled {rescheduled} \
         work items and republished {republished} events lost with it"
    );
    assert!(rescheduled + republished > 0, "the failover lost nothing: the test proved nothing");

    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, N as i64);
    assert_eq!(db.leaks().await, 0);
    assert_corpus_accounted(&db, &corpus).await;
    assert_eq!(db.manifest_disagreements().await, 0);
    let mut relay = embed_dlq::relay::Relay::new(
        db.pool.clone(),
        redis.managed().await.unwrap(),
        keys.clone(),
        RelayConfig::default(),
    );
    while relay.run_once().await.unwrap().claimed > 0 {}
    let report = reconciler.run_once(Mode::Check).await.unwrap();
    assert_eq!(report.total_found(), 0, "{report:#?}");
}

/// Entries ever added to the stream `key` on this node (`XINFO STREAM`'s `entries-added`), 0
/// if it cannot tell.
async fn entries_added(node: &mut redis::aio::MultiplexedConnection, key: &str) -> u64 {
    let info: redis::RedisResult<std::collections::HashMap<String, redis::Value>> =
        redis::cmd("XINFO").arg("STREAM").arg(key).query_async(node).await;
    info.ok()
        .and_then(|i| i.get("entries-added").and_then(|v| redis::from_redis_value_ref::<u64>(v).ok()))
        .unwrap_or(0)
}
