//! Redis Cluster specifics (issue 10): a single seed URL with `redis_cluster`, and a master
//! killed during a drain. The relay, replay, tail and reconcile tests run on both deployments
//! through `on_single_and_cluster!`; these are the cluster-only ones. Real Postgres, real
//! Redis Cluster, the mock provider over real HTTP.

use std::collections::HashMap;
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
pub(crate) async fn park_due(db: &TestDb, n: usize, doc: &str) -> std::collections::BTreeSet<(String, i32)> {
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

/// A master is SIGKILLed while `serve` drains a parked corpus, after it took events its
/// frozen replica never got: the replica is promoted, serve carries on without a restart and
/// without a reconciler puts back from Postgres whatever the promoted replica had not
/// received, within seconds; every chunk ends stored exactly once and every lost event is
/// back on the stream once (read from the stream itself).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_killed_during_a_drain_loses_nothing_and_stores_nothing_twice() {
    const N: usize = 3000;
    // A node timeout long enough to keep the replica frozen (below) while the master takes
    // events it never gets, on a loaded machine too.
    let cluster = PrivateCluster::start_with_node_timeout(Duration::from_secs(3)).await;
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
    let config = drain_config(&keys, "it-failover");
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
    let frozen_at = tokio::time::Instant::now();
    tokio::time::sleep(Duration::from_millis(150)).await;
    let mut m = cluster.node(master).await.unwrap();
    let links: i64 =
        redis::cmd("CLIENT").arg("KILL").arg("TYPE").arg("replica").query_async(&mut m).await.unwrap();
    assert_eq!(links, 1, "the master's replication link was not cut");
    // At least 500 ms, and until the master has taken events the replica never got. Events,
    // not work items: nobody consumes the events stream, so an event taken now is certainly
    // lost with the master, where a work item may be read and replayed before the kill (the
    // failover then lost nothing and proved nothing). The replica stays frozen for less than
    // the node timeout, with a margin for a loaded machine.
    let freeze_limit = cluster.node_timeout.mul_f64(0.8);
    let last_at_cut = last_generated_id(&mut m, &keys.events()).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    while last_generated_id(&mut m, &keys.events()).await == last_at_cut && frozen_at.elapsed() < freeze_limit
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let at_kill = left().await;
    // The events the master took after the cut: the replica never got them.
    let lost = event_ids(&mut m, &keys.events(), &format!("({last_at_cut}")).await;
    cluster.kill(master).await;
    cluster.signal(&replica_pid, "CONT");
    let frozen_for = frozen_at.elapsed();
    assert!(at_kill > 0, "the drain finished before the kill");
    assert!(
        !lost.is_empty(),
        "the master took no event in the {frozen_for:?} its replica was frozen: the failover \
         would lose nothing and prove nothing"
    );

    // The replica takes over (after `cluster-node-timeout` and an election); serve keeps
    // running throughout.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while cluster.info(replica, "replication", "role").await.as_deref() != Some("master") {
        assert!(tokio::time::Instant::now() < deadline, "replica {replica} was not promoted");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cluster.wait_healthy(Duration::from_secs(30)).await;
    assert_eq!(cluster.master_of(&keys.replay()).await, replica);

    // Serve alone, with no reconciler, finds that the shard's server changed and puts back
    // what the promoted replica had not received: the lost work items are issued again (their
    // lease is 15 minutes: nothing else could drain them this soon) and the lost events are
    // published again.
    let mut new_master = cluster.node(replica).await.unwrap();
    let events_back = async |node: &mut redis::aio::MultiplexedConnection| {
        let on_stream: std::collections::HashSet<String> =
            event_ids(node, &keys.events(), "-").await.into_iter().collect();
        lost.iter().filter(|id| on_stream.contains(*id)).count()
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        assert!(!serve.is_finished(), "serve stopped during the failover");
        let (rows, back) = (left().await, events_back(&mut new_master).await);
        if rows == 0 && back == lost.len() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "90 s after the failover: {rows} rows left, {back} of {} lost events back",
            lost.len()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    cancel.cancel();
    serve.await.unwrap().expect("serve stops cleanly after the failover");
    // A repair afterwards (what an operator's periodic reconcile does) finds nothing lost
    // left to put back; it acknowledges the entries the promoted replica still held for rows
    // replayed meanwhile.
    let mut reconciler = embed_dlq::reconcile::Reconciler {
        store: serving.store.clone(),
        redis: Some(redis.managed().await.unwrap()),
        keys: keys.clone(),
        config: embed_dlq::reconcile::ReconcileConfig {
            lost_work_grace: Duration::from_secs(1),
            ..immediate()
        },
    };
    let last = reconciler.run_once(Mode::Repair).await.unwrap();
    eprintln!(
        "killed master {master} with {at_kill} rows left and {} events its replica never got \
         ({frozen_for:?} frozen); afterwards the reconciler found {} lost work items, {} lost \
         events and {} orphan entries",
        lost.len(),
        last.get(Check::LostReplayWork).found,
        last.get(Check::MissingEvents).found,
        last.get(Check::OrphanStreamEntries).found,
    );
    assert_eq!(last.get(Check::MissingEvents).found, 0, "{last:#?}");
    assert_eq!(last.get(Check::LostReplayWork).found, 0, "{last:#?}");

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
    // Every event lost with the master is back on the promoted replica's stream, once.
    let mut on_stream: HashMap<String, usize> = HashMap::new();
    for id in event_ids(&mut new_master, &keys.events(), "-").await {
        *on_stream.entry(id).or_default() += 1;
    }
    let twice: Vec<_> = on_stream.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "events on the stream more than once: {twice:?}");
    let still_lost: Vec<_> = lost.iter().filter(|id| !on_stream.contains_key(*id)).collect();
    assert!(
        still_lost.is_empty(),
        "{} of {} lost events never came back: {still_lost:?}",
        still_lost.len(),
        lost.len()
    );
}

/// The id of the newest entry ever added to the stream `key` on this node (`XINFO STREAM`'s
/// `last-generated-id`; `0-0` while there is no stream).
async fn last_generated_id(node: &mut redis::aio::MultiplexedConnection, key: &str) -> String {
    let info: redis::RedisResult<HashMap<String, redis::Value>> =
        redis::cmd("XINFO").arg("STREAM").arg(key).query_async(node).await;
    info.ok()
        .and_then(|i| i.get("last-generated-id").and_then(|v| redis::from_redis_value_ref::<String>(v).ok()))
        .unwrap_or_else(|| "0-0".into())
}

/// The `event_id` fields of the entries of the events stream `key` on this node from `start`
/// (an XRANGE start: `-`, or `(id` for after `id`) to its end, read a page at a time.
async fn event_ids(node: &mut redis::aio::MultiplexedConnection, key: &str, start: &str) -> Vec<String> {
    let mut ids = Vec::new();
    let mut start = start.to_string();
    loop {
        let page: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
            .arg(key)
            .arg(&start)
            .arg("+")
            .arg("COUNT")
            .arg(1000)
            .query_async(node)
            .await
            .unwrap();
        let Some(last) = page.ids.last() else { return ids };
        start = format!("({}", last.id);
        ids.extend(
            page.ids.iter().map(|e| e.get::<String>("event_id").expect("an event entry has an event_id")),
        );
    }
}

/// Serve as the Redis-loss tests run it: two replayers, a relay polling every 100 ms, a
/// scheduler every 200 ms, a 2 s min-idle, no reconciler of its own and no metrics.
pub(crate) fn drain_config(keys: &StreamKeys, consumer_prefix: &str) -> ServeConfig {
    ServeConfig {
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
        consumer_prefix: consumer_prefix.into(),
        reconcile_every: None,
        reconcile_sweeps: Default::default(),
        metrics: false,
        source: None,
        source_ingest: Default::default(),
        table_followers: Vec::new(),
    }
}
