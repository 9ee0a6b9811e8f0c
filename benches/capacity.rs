//! Inputs of the capacity model (docs/SCALING.md): CPU-seconds per operation spent by each
//! tier, and a check of the model against the local Redis Cluster with 1, 2 and 4 stream
//! shards.
//!
//! ```text
//! eval "$(scripts/services.sh up)"; eval "$(scripts/services.sh cluster up)"
//! cargo bench --bench capacity
//! BENCH_CAPACITY_CHUNKS=20000 BENCH_ROUNDS=3 BENCH_RECONCILE_ROWS=100000 BENCH_SHARDS=1,2,4 \
//!   BENCH_SHARD_CHUNKS=20000 cargo bench --bench capacity
//! ```
//!
//! Tiers, read before and after each phase:
//! - **client**: this process (`/proc/self/stat` utime + stime; the sampler thread excluded).
//!   The mock provider runs in a process of its own (the release binary's `mock-provider`):
//!   making vectors is the provider's cost, not the tool's.
//! - **Postgres**: the postmaster's children, sampled every 100 ms, booked by process title:
//!   backends of the bench's database ("own"), processes that name no database (I/O and
//!   parallel workers, WAL writer, checkpointer: "server-wide", shared with anything else
//!   the server does) and backends of other databases (not ours; printed so that a noisy
//!   run shows). Needs the server on this machine. WAL bytes are server-wide
//!   (`pg_current_wal_insert_lsn`).
//! - **Redis**: `INFO` of every node: `used_cpu_user + used_cpu_sys`, `total_net_input_bytes`,
//!   `total_net_output_bytes`, `used_memory`. Server-wide: run it against a Redis nobody
//!   else uses for clean numbers.
//!
//! Phases, each round (`BENCH_ROUNDS`, default 3) over `BENCH_CAPACITY_CHUNKS` chunks
//! (default 20000), against `REDIS_URL`: **park** (ingest with the provider in an outage:
//! manifest, DLQ and outbox rows), **relay** (outbox to the events stream), **schedule**
//! (due rows leased and appended to the replay stream by the scheduler itself), **relay work**
//! (the outbox's work items, which releases since 2026-12-03 no longer write: kept so older
//! figures stay comparable, it measures an empty pass), **replay**
//! (`BENCH_REPLAYERS` replayers, default 2, provider healthy: re-embed, store, resolve,
//! XACK), **relay outcomes** (the `replayed` events). Medians over the rounds. Then
//! reconcile over `BENCH_RECONCILE_ROWS` manifest rows (default 100000, 0 skips it; the data
//! set of benches/reconcile.rs): full sweeps, incremental sweeps after `BENCH_CHANGED`
//! (default 1000) changed chunks, one deep sweep.
//!
//! With `REDIS_CLUSTER_URL`, the shard check: for each of `BENCH_SHARDS` (default 1,2,4),
//! park `BENCH_SHARD_CHUNKS` chunks (default: as many as above), then time the drain (relay,
//! schedule, relay, the replayers spread with `replay::shares`, relay) and compare each
//! master's CPU and the drain rate with what the per-operation costs predict.
//! docs/SCALING.md has the results and the model built on them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

mod common;
use common::{
    BenchDb, CpuSampler, CpuSnapshot, MockProcess, RedisNode, RedisStats, change_reconcile_rows,
    cluster_nodes, env_usize, load_reconcile_rows, median, redis_stats, single_node,
};

use embed_dlq::config::{IngestArgs, IngestSettings, ProviderArgs, RetryArgs, ServiceArgs};
use embed_dlq::ingest::Pipeline;
use embed_dlq::reconcile::{Mode, ReconcileConfig, Reconciler, Sweep};
use embed_dlq::relay::{Relay, RelayConfig};
use embed_dlq::replay::{ReplayConfig, Replayer, Scheduler};
use embed_dlq::store::Store;
use embed_dlq::streams::{self, RedisClient, RedisConn, StreamKeys};
use embed_dlq::testkit::corpus::{CorpusSpec, write_corpus};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

fn main() {
    // `cargo test --benches` runs benches in test mode: do nothing there.
    if std::env::args().any(|a| a == "--test" || a == "--list") {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    rt.block_on(run());
}

/// What one phase cost: wall time, each tier's CPU-seconds, bytes.
#[derive(Clone, Debug, Default)]
struct Cost {
    ops: f64,
    wall: f64,
    cpu: CpuSnapshot,
    /// Per Redis node, in the order of the node list.
    redis: Vec<RedisStats>,
    /// Server-wide WAL bytes.
    wal: f64,
    /// The mock provider's CPU-seconds.
    mock: f64,
}

impl Cost {
    fn redis_cpu(&self) -> f64 {
        self.redis.iter().map(|r| r.cpu).sum()
    }
    fn redis_in(&self) -> f64 {
        self.redis.iter().map(|r| r.net_in).sum()
    }
    fn redis_out(&self) -> f64 {
        self.redis.iter().map(|r| r.net_out).sum()
    }
    fn redis_mem(&self) -> f64 {
        self.redis.iter().map(|r| r.used_memory).sum()
    }
    fn pg(&self) -> f64 {
        self.cpu.pg_own + self.cpu.pg_background
    }
    /// Every tier of the tool (client, Postgres own + background, Redis).
    fn total(&self) -> f64 {
        self.cpu.client + self.pg() + self.redis_cpu()
    }
}

/// Reads the probes.
struct Probes<'a> {
    sampler: &'a CpuSampler,
    pool: PgPool,
    mock: &'a MockProcess,
}

struct Reading {
    at: Instant,
    cpu: CpuSnapshot,
    redis: Vec<RedisStats>,
    wal: f64,
    mock: f64,
}

impl Probes<'_> {
    async fn read(&self, nodes: &mut [RedisNode]) -> Reading {
        let wal: f64 =
            sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::float8")
                .fetch_one(&self.pool)
                .await
                .unwrap();
        let mut redis = Vec::new();
        for n in nodes.iter_mut() {
            redis.push(redis_stats(&mut n.conn).await);
        }
        Reading { at: Instant::now(), cpu: self.sampler.snapshot(), redis, wal, mock: self.mock.cpu() }
    }

    async fn measure<F: std::future::Future>(
        &self,
        nodes: &mut [RedisNode],
        ops: u64,
        f: F,
    ) -> (F::Output, Cost) {
        let before = self.read(nodes).await;
        let out = f.await;
        let after = self.read(nodes).await;
        let cost = Cost {
            ops: ops as f64,
            wall: after.at.duration_since(before.at).as_secs_f64(),
            cpu: after.cpu.since(&before.cpu),
            redis: after.redis.iter().zip(&before.redis).map(|(a, b)| a.since(b)).collect(),
            wal: after.wal - before.wal,
            mock: after.mock - before.mock,
        };
        (out, cost)
    }
}

async fn relay_all(relay: &mut Relay) -> u64 {
    let mut n = 0;
    loop {
        let c = relay.run_once().await.unwrap().claimed;
        if c == 0 {
            return n;
        }
        n += c;
    }
}

/// Replays until `total` entries were handled, with `replayers` replayers spread over the
/// shards as `serve` spreads them ([`embed_dlq::replay::shares`]).
async fn drain(
    pipeline: &Pipeline,
    client: &RedisClient,
    redis: &RedisConn,
    keys: &StreamKeys,
    replayers: usize,
    total: u64,
) {
    let done = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for (n, share) in embed_dlq::replay::shares(replayers, keys.shards()).into_iter().enumerate() {
        let config = ReplayConfig { block: Duration::from_millis(100), shards: share, ..Default::default() };
        let mut rep = Replayer {
            name: format!("capacity-{n}"),
            store: pipeline.store.clone(),
            embedder: pipeline.embedder.clone(),
            client: client.clone(),
            redis: redis.clone(),
            keys: keys.clone(),
            config,
            paused_until: None,
        };
        let (client, done) = (client.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let mut conn = client.blocking(Duration::from_secs(1)).await.unwrap();
            let mut idle_since = Instant::now();
            while done.load(Ordering::SeqCst) < total {
                let c = rep.read_once(&mut conn, &CancellationToken::new()).await.unwrap();
                let handled = c.replayed + c.reparked + c.exhausted + c.skipped;
                if handled > 0 {
                    idle_since = Instant::now();
                    done.fetch_add(handled, Ordering::SeqCst);
                }
                assert!(idle_since.elapsed() < Duration::from_secs(60), "replay made no progress for 60 s");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// Deletes every key of this run (streams, publish markers) on every master.
async fn clean_keys(nodes: &mut [RedisNode], pattern: &str) {
    for n in nodes.iter_mut().filter(|n| n.master) {
        let mut cursor: u64 = 0;
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(pattern)
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut n.conn)
                .await
                .unwrap();
            if !keys.is_empty() {
                let mut pipe = redis::pipe();
                for k in &keys {
                    pipe.cmd("UNLINK").arg(k).ignore();
                }
                let _: () = pipe.query_async(&mut n.conn).await.unwrap();
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
}

fn corpus(prefix: &str, chunks: usize) -> Vec<u8> {
    let mut out = Vec::new();
    write_corpus(
        &mut out,
        &CorpusSpec { doc_prefix: prefix.into(), chunks, ..CorpusSpec::default() },
        100_000,
    )
    .unwrap();
    out
}

/// Replay and relay settings that let a round's `chunks` parked chunks be outstanding at
/// once (the default cap would hand them out only as they are settled).
fn whole_round_outstanding(chunks: usize) -> (ReplayConfig, RelayConfig) {
    let replay = ReplayConfig {
        outstanding_max: chunks.max(ReplayConfig::default().outstanding_max),
        ..Default::default()
    };
    let relay = RelayConfig { replay_maxlen: replay.outstanding_max, ..Default::default() };
    (replay, relay)
}

/// Parks `chunks` chunks: the provider in an outage, one attempt each, the breaker never
/// opening (so every chunk is tried and parked, as in benches/ingest.rs).
async fn park(parking: &Pipeline, mock: &MockProcess, prefix: &str, chunks: usize) -> u64 {
    let input = corpus(prefix, chunks);
    mock.set_outage(true).await;
    let summary = parking.run(std::io::Cursor::new(input), CancellationToken::new()).await.unwrap();
    mock.set_outage(false).await;
    let parked: u64 = summary.parked.values().sum();
    assert_eq!(parked as usize, chunks, "every chunk parked: {summary:?}");
    parked
}

const PHASES: [&str; 6] = ["park", "relay", "schedule", "relay work", "replay", "relay outcomes"];

async fn run() {
    let admin = std::env::var("DATABASE_URL").expect("DATABASE_URL (eval \"$(scripts/services.sh up)\")");
    let redis_url = std::env::var("REDIS_URL").expect("REDIS_URL (eval \"$(scripts/services.sh up)\")");
    let chunks = env_usize("BENCH_CAPACITY_CHUNKS", 20_000).max(100);
    let rounds = env_usize("BENCH_ROUNDS", 3).max(1);
    let replayers = env_usize("BENCH_REPLAYERS", 2).clamp(1, 64);
    let pid = std::process::id();

    let mock = MockProcess::start().await;
    let db = BenchDb::create(&admin, &format!("bench_{pid}")).await;
    let pool = db.pool.clone();
    let sampler = CpuSampler::start(&pool, &db.name).await;
    let probes = Probes { sampler: &sampler, pool: pool.clone(), mock: &mock };
    let settings = IngestSettings::resolve(
        ServiceArgs { database_url: Some(db.url.clone()), redis_url: None, ..Default::default() },
        ProviderArgs { base_url: Some(mock.base_url()), model: Some("bench".into()), ..Default::default() },
        IngestArgs::default(),
        RetryArgs::default(),
        None,
    )
    .unwrap();
    let pipeline = settings.pipeline().await.unwrap();
    let mut parking = pipeline.clone();
    parking.embedder.policy.max_attempts = 1;
    parking.embedder.gate =
        Arc::new(embed_dlq::embed::gate::ProviderGate::new(embed_dlq::embed::gate::BreakerConfig {
            failure_threshold: u32::MAX,
            ..Default::default()
        }));

    let client = streams::client(&redis_url).unwrap();
    let redis = streams::managed(&client).await.unwrap();
    let mut nodes = vec![single_node(&redis_url).await];

    println!(
        "capacity benchmark: {chunks} chunks a round, {rounds} rounds, {replayers} replayers; Postgres processes {}",
        if sampler.postgres() { "sampled" } else { "NOT readable (Postgres columns are 0)" }
    );
    let mut costs: Vec<Vec<Cost>> = vec![Vec::new(); PHASES.len()];
    let mut sizes = String::new();
    for round in 0..rounds {
        sqlx::raw_sql(
            "TRUNCATE doc_embeddings, ingest_manifest, embedding_dlq, replay_lease, dlq_outbox; CHECKPOINT",
        )
        .execute(&pool)
        .await
        .unwrap();
        let keys = StreamKeys::new(&format!("cap-{pid}-{round}"));
        let n = chunks as u64;
        let (_, c) =
            probes.measure(&mut nodes, n, park(&parking, &mock, &format!("c{round}-"), chunks)).await;
        costs[0].push(c);
        if round == 0 {
            sizes = row_sizes(&pool, &["embedding_dlq", "dlq_outbox", "ingest_manifest"]).await;
        }
        // Every parked chunk outstanding at once, so each phase is measured on its own.
        let (replay, relay_config) = whole_round_outstanding(chunks);
        let mut relay = Relay::new(pool.clone(), redis.clone(), keys.clone(), relay_config);
        let (_, c) = probes.measure(&mut nodes, n, relay_all(&mut relay)).await;
        costs[1].push(c);
        sqlx::query("UPDATE embedding_dlq SET next_retry_at = now()").execute(&pool).await.unwrap();
        embed_dlq::replay::ensure_group(&mut redis.clone(), &keys).await.unwrap();
        let scheduler = Scheduler::new(pipeline.store.clone(), replay, redis.clone(), keys.clone());
        let (scheduled, c) = probes.measure(&mut nodes, n, scheduler.run_once()).await;
        assert_eq!(scheduled.unwrap(), n);
        costs[2].push(c);
        let (_, c) = probes.measure(&mut nodes, n, relay_all(&mut relay)).await;
        costs[3].push(c);
        let (_, c) =
            probes.measure(&mut nodes, n, drain(&pipeline, &client, &redis, &keys, replayers, n)).await;
        costs[4].push(c);
        let (_, c) = probes.measure(&mut nodes, n, relay_all(&mut relay)).await;
        costs[5].push(c);
        let left: i64 =
            sqlx::query_scalar("SELECT count(*) FROM embedding_dlq").fetch_one(&pool).await.unwrap();
        assert_eq!(left, 0, "every parked chunk replayed");
        let line: Vec<String> = PHASES
            .iter()
            .zip(&costs)
            .map(|(p, c)| format!("{p} {:.2}", c.last().unwrap().total() / n as f64 * 1000.0))
            .collect();
        println!("round {round}: CPU-s per 1k (all tiers): {}", line.join(", "));
        clean_keys(&mut nodes, &format!("*cap-{pid}-{round}*")).await;
    }

    let today = chrono::Utc::now().format("%Y-%m-%d");
    println!();
    println!(
        "Per-operation costs, medians of {rounds} rounds of {chunks} ({today}, `cargo bench --bench capacity`):"
    );
    println!();
    println!(
        "| phase (per 1k items) | wall s | client CPU-s | Postgres own CPU-s | Postgres server-wide CPU-s | Redis CPU-s | all tiers CPU-s | WAL MB | Redis in MB | Redis out MB | (other DBs' CPU-s) | (mock provider CPU-s) |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    let per_k =
        |c: &[Cost], f: &dyn Fn(&Cost) -> f64| median(c.iter().map(|c| f(c) / c.ops * 1000.0).collect());
    let mut model = Vec::new();
    for (phase, c) in PHASES.iter().zip(&costs) {
        let row = PerK {
            wall: per_k(c, &|c| c.wall),
            client: per_k(c, &|c| c.cpu.client),
            pg_own: per_k(c, &|c| c.cpu.pg_own),
            pg_bg: per_k(c, &|c| c.cpu.pg_background),
            redis: per_k(c, &|c| c.redis_cpu()),
            total: per_k(c, &|c| c.total()),
            wal: per_k(c, &|c| c.wal),
            net_in: per_k(c, &|c| c.redis_in()),
            net_out: per_k(c, &|c| c.redis_out()),
            other: per_k(c, &|c| c.cpu.pg_other),
            mock: per_k(c, &|c| c.mock),
        };
        println!(
            "| {phase} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.2} | {:.2} | {:.2} | {:.3} | {:.3} |",
            row.wall,
            row.client,
            row.pg_own,
            row.pg_bg,
            row.redis,
            row.total,
            row.wal / 1e6,
            row.net_in / 1e6,
            row.net_out / 1e6,
            row.other,
            row.mock
        );
        model.push(row);
    }
    let sum = |f: &dyn Fn(&PerK) -> f64| model.iter().map(f).sum::<f64>();
    println!(
        "| **lifecycle** (park to replayed) | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.2} | {:.2} | {:.2} | {:.3} | {:.3} |",
        sum(&|r| r.wall),
        sum(&|r| r.client),
        sum(&|r| r.pg_own),
        sum(&|r| r.pg_bg),
        sum(&|r| r.redis),
        sum(&|r| r.total),
        sum(&|r| r.wal) / 1e6,
        sum(&|r| r.net_in) / 1e6,
        sum(&|r| r.net_out) / 1e6,
        sum(&|r| r.other),
        sum(&|r| r.mock)
    );
    let mem = median(costs[1].iter().map(|c| c.redis_mem() / c.ops).collect());
    let mem_work = median(costs[3].iter().map(|c| c.redis_mem() / c.ops).collect());
    println!();
    println!(
        "Redis memory: {mem:.0} B per parked event relayed (events entry + publish marker), {mem_work:.0} B per replay work entry"
    );
    println!("{sizes}");

    reconcile_costs(&admin, &redis_url, &probes, &mut nodes).await;

    if let Ok(cluster_url) = std::env::var("REDIS_CLUSTER_URL") {
        let drain_model: Vec<&PerK> = model[1..].iter().collect();
        shard_check(&cluster_url, &pipeline, &parking, &probes, &drain_model, chunks, replayers).await;
    }
    drop(sampler);
    drop(mock);
    db.drop().await;
}

/// One phase's per-1k costs (medians).
struct PerK {
    wall: f64,
    client: f64,
    pg_own: f64,
    pg_bg: f64,
    redis: f64,
    total: f64,
    wal: f64,
    net_in: f64,
    net_out: f64,
    other: f64,
    mock: f64,
}

/// Bytes per row of `tables` (heap + TOAST, and indexes), as a Markdown table.
async fn row_sizes(pool: &PgPool, tables: &[&str]) -> String {
    let mut out =
        String::from("\n| table | rows | table B/row | indexes B/row |\n| --- | --- | --- | --- |\n");
    for t in tables {
        let (rows, heap, idx): (i64, i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT (SELECT count(*) FROM {t}), pg_table_size('{t}'), pg_indexes_size('{t}')"
        )))
        .fetch_one(pool)
        .await
        .unwrap();
        let per = |b: i64| if rows > 0 { b as f64 / rows as f64 } else { 0.0 };
        out += &format!("| {t} | {rows} | {:.0} | {:.0} |\n", per(heap), per(idx));
    }
    out
}

/// Reconcile over the data set of benches/reconcile.rs: full sweeps, incremental sweeps
/// after changes, one deep sweep; CPU per 1k rows.
async fn reconcile_costs(admin: &str, redis_url: &str, probes: &Probes<'_>, nodes: &mut [RedisNode]) {
    let rows = env_usize("BENCH_RECONCILE_ROWS", 100_000);
    if rows == 0 {
        return;
    }
    let rows = rows.max(1000);
    let changed = env_usize("BENCH_CHANGED", 1000).max(1);
    let rounds = env_usize("BENCH_ROUNDS", 3).max(1);
    let pid = std::process::id();
    let name = format!("bench_{pid}_reconcile");
    probes.sampler.add_own_db(&name);
    let db = BenchDb::create(admin, &name).await;
    let started = Instant::now();
    load_reconcile_rows(&db.pool, rows).await;
    println!("reconcile: {rows} manifest rows loaded in {:.0}s", started.elapsed().as_secs_f64());
    let sizes = row_sizes(&db.pool, &["ingest_manifest", "doc_embeddings", "embedding_dlq"]).await;
    let mut r = Reconciler {
        store: Store::open(db.pool.clone(), "doc_embeddings").await.unwrap(),
        redis: Some(streams::managed(&streams::client(redis_url).unwrap()).await.unwrap()),
        keys: StreamKeys::new(&format!("cap-reconcile-{pid}")),
        config: ReconcileConfig::default(),
    };
    // Establishes the resume points.
    let report = r.run_sweep(Mode::Check, Some(Sweep::Deep)).await.unwrap();
    assert_eq!(report.total_found(), 0, "{report:#?}");
    let (mut full, mut inc) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let (report, c) =
            probes.measure(nodes, rows as u64, r.run_sweep(Mode::Check, Some(Sweep::Full))).await;
        assert_eq!(report.unwrap().total_found(), 0);
        full.push(c);
        change_reconcile_rows(&db.pool, round * changed, changed, round).await;
        // As in benches/reconcile.rs: changes come more than 2 s before the run.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let (report, c) =
            probes.measure(nodes, changed as u64, r.run_sweep(Mode::Check, Some(Sweep::Incremental))).await;
        assert_eq!(report.unwrap().total_found(), 0);
        inc.push(c);
    }
    let (report, deep) =
        probes.measure(nodes, rows as u64, r.run_sweep(Mode::Check, Some(Sweep::Deep))).await;
    assert_eq!(report.unwrap().total_found(), 0);
    println!();
    println!("Reconcile over {rows} manifest rows (medians of {rounds}; deep: one run):");
    println!();
    println!(
        "| sweep | per | wall s | client CPU-s | Postgres own CPU-s | Postgres server-wide CPU-s | Redis CPU-s |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    let per_k =
        |c: &[Cost], f: &dyn Fn(&Cost) -> f64| median(c.iter().map(|c| f(c) / c.ops * 1000.0).collect());
    for (name, per, c) in [
        ("full", "1k manifest rows", &full[..]),
        ("incremental", "1k changed chunks", &inc[..]),
        ("deep", "1k manifest rows", std::slice::from_ref(&deep)),
    ] {
        println!(
            "| {name} | {per} | {:.4} | {:.4} | {:.4} | {:.4} | {:.4} |",
            per_k(c, &|c| c.wall),
            per_k(c, &|c| c.cpu.client),
            per_k(c, &|c| c.cpu.pg_own),
            per_k(c, &|c| c.cpu.pg_background),
            per_k(c, &|c| c.redis_cpu())
        );
    }
    println!("{sizes}");
    db.drop().await;
}

/// Parks a corpus, then drains it through the cluster with 1, 2, 4 shards; compares each
/// master's CPU and the drain rate with the model.
async fn shard_check(
    cluster_url: &str,
    pipeline: &Pipeline,
    parking: &Pipeline,
    probes: &Probes<'_>,
    drain_model: &[&PerK],
    default_chunks: usize,
    replayers: usize,
) {
    let shard_counts: Vec<u16> = std::env::var("BENCH_SHARDS")
        .unwrap_or_else(|_| "1,2,4".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let chunks = env_usize("BENCH_SHARD_CHUNKS", default_chunks).max(100);
    let pid = std::process::id();
    let client = streams::open(cluster_url, true).unwrap();
    let redis = streams::managed(&client).await.unwrap();
    let mut nodes = cluster_nodes(cluster_url).await;
    let pool = probes.pool.clone();
    // The model: CPU-s per item of the drain phases (relay to relay outcomes), per tier.
    let model_redis: f64 = drain_model.iter().map(|r| r.redis).sum::<f64>() / 1000.0;
    let model_total: f64 = drain_model.iter().map(|r| r.total).sum::<f64>() / 1000.0;
    let model_mock: f64 = drain_model.iter().map(|r| r.mock).sum::<f64>() / 1000.0;
    // The drain runs its steps one after the other, as the single-node phases did: its wall
    // time is their sum.
    let model_wall: f64 = drain_model.iter().map(|r| r.wall).sum::<f64>() / 1000.0;
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) as f64;
    println!();
    println!(
        "Shard check: {chunks} parked chunks drained through the cluster ({} masters), {replayers} replayers; \
         model: {:.3} CPU-s per 1k items in all tiers, {:.3} in Redis (single node, no replica); {cores} cores",
        nodes.iter().filter(|n| n.master).count(),
        model_total * 1000.0,
        model_redis * 1000.0
    );
    let mut table = Vec::new();
    for &shards in &shard_counts {
        sqlx::raw_sql(
            "TRUNCATE doc_embeddings, ingest_manifest, embedding_dlq, replay_lease, dlq_outbox; CHECKPOINT",
        )
        .execute(&pool)
        .await
        .unwrap();
        let keys = StreamKeys::with_shards(&format!("cap-{pid}-shards{shards}"), shards);
        park(parking, probes.mock, &format!("k{shards}-"), chunks).await;
        sqlx::query("UPDATE embedding_dlq SET next_retry_at = now()").execute(&pool).await.unwrap();
        embed_dlq::replay::ensure_group(&mut redis.clone(), &keys).await.unwrap();
        let n = chunks as u64;
        let (replay, relay_config) = whole_round_outstanding(chunks);
        let mut relay = Relay::new(pool.clone(), redis.clone(), keys.clone(), relay_config);
        let scheduler = Scheduler::new(pipeline.store.clone(), replay, redis.clone(), keys.clone());
        let ((), c) = probes
            .measure(&mut nodes, n, async {
                relay_all(&mut relay).await;
                scheduler.run_once().await.unwrap();
                relay_all(&mut relay).await;
                drain(pipeline, &client, &redis, &keys, replayers, n).await;
                relay_all(&mut relay).await;
            })
            .await;
        let left: i64 =
            sqlx::query_scalar("SELECT count(*) FROM embedding_dlq").fetch_one(&pool).await.unwrap();
        assert_eq!(left, 0, "every parked chunk replayed");
        // Share of the items each master should see: shards whose slot it serves.
        let slots: Vec<u16> = keys.shard_ids().map(|s| streams::slot(keys.events_of(s).as_bytes())).collect();
        let per_node: Vec<String> = nodes
            .iter()
            .zip(&c.redis)
            .map(|(node, stats)| {
                let share =
                    slots.iter().filter(|&&s| node.master && node.serves(s)).count() as f64 / shards as f64;
                let role = if node.master { "master" } else { "replica" };
                if node.master {
                    format!(
                        "{} {role}: {:.2} s (model {:.2} s)",
                        node.addr,
                        stats.cpu,
                        share * model_redis * n as f64
                    )
                } else {
                    format!("{} {role}: {:.2} s", node.addr, stats.cpu)
                }
            })
            .collect();
        let rate = n as f64 / c.wall;
        // The steps run one after the other: the single-node phases' wall times add up. The
        // ceiling: on this machine every tier (and the mock provider) shares the same cores,
        // so no drain goes faster than cores / (CPU-s per item). Replicas are not in the
        // single-node model.
        let predicted = 1.0 / model_wall;
        let ceiling = cores / (model_total + model_mock);
        let measured_total = c.total() / n as f64;
        println!(
            "{shards} shard(s): {rate:.0} items/s (model {predicted:.0}, CPU ceiling on {cores} cores {ceiling:.0}); CPU-s per 1k items: all tiers {:.3} (model {:.3}), client {:.3}, Postgres {:.3}, Redis {:.3}; {}",
            measured_total * 1000.0,
            model_total * 1000.0,
            c.cpu.client / n as f64 * 1000.0,
            c.pg() / n as f64 * 1000.0,
            c.redis_cpu() / n as f64 * 1000.0,
            per_node.join(", ")
        );
        let masters: Vec<String> = nodes
            .iter()
            .zip(&c.redis)
            .filter(|(node, _)| node.master)
            .map(|(node, stats)| {
                let share = slots.iter().filter(|&&s| node.serves(s)).count() as f64 / shards as f64;
                format!("{:.2} / {:.2}", stats.cpu, share * model_redis * n as f64)
            })
            .collect();
        let replicas: f64 =
            nodes.iter().zip(&c.redis).filter(|(node, _)| !node.master).map(|(_, s)| s.cpu).sum();
        table.push(format!(
            "| {shards} | {rate:.0} | {predicted:.0} | {ceiling:.0} | {:.3} | {:.3} | {} | {replicas:.2} |",
            measured_total * 1000.0,
            model_total * 1000.0,
            masters.join(" · ")
        ));
        clean_keys(&mut nodes, &format!("*cap-{pid}-shards{shards}*")).await;
    }
    println!();
    println!(
        "| shards | drain items/s measured | model (sum of phase walls) | CPU ceiling ({cores} cores) | CPU-s per 1k measured | model | master CPU-s measured / model ({}) | replicas CPU-s |",
        nodes.iter().filter(|n| n.master).map(|n| n.addr.as_str()).collect::<Vec<_>>().join(" · ")
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for row in table {
        println!("{row}");
    }
}
