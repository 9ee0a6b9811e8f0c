//! A target moved to a second model at scale, under live writes (issue 46), with the floor of
//! the same work side by side in the same run.
//!
//! ```text
//! scripts/services.sh up; eval "$(scripts/services.sh env)"   # DATABASE_URL and REDIS_URL
//! BENCH_CHUNKS=1000000 cargo bench --bench migration
//! ```
//!
//! Real processes of the release binary (`serve`, `revision ...`), the built-in mock provider
//! over real HTTP (no latency, no faults), this machine's Postgres and Redis:
//!
//! 1. **Floor**: a fresh `ingest` of the corpus (`BENCH_CHUNKS` chunks) into a plain table of
//!    the new dimension, in a database of its own: the embedding and writing a backfill must
//!    do, with nothing of revisions in between.
//! 2. The target (`docs`, 256 dimensions, model `m-a`) gets the corpus; `serve` follows a
//!    source stream that a publisher feeds at `BENCH_RATE` entries a second (default 200:
//!    three in ten change the text of a random chunk of the corpus, one in ten deletes a chunk
//!    the stream made, the rest are new chunks), and a probe queries the name `docs` every
//!    100 ms: 20 random keys of the corpus, `count(*)` and the least and greatest
//!    `vector_dims(embedding)` of the answer. Each answer must hold all 20 rows, all of one
//!    dimension, and the dimension of the revision active when the query was sent (either,
//!    for a query sent while a switch was under way).
//! 3. `serve` is stopped (SIGTERM), `revision create` adopts `docs` and makes revision 2
//!    (model `m-b`, 384 dimensions), `serve` starts again (the guide's order for the first
//!    revision of a table); the publisher never stops.
//! 4. A dump of the source (the corpus with every change published so far) is written and
//!    `revision backfill` copies it into revision 2 through a provider of its own (its inputs
//!    counted), SIGKILLed `BENCH_BACKFILL_KILLS` times at random moments and rerun, while
//!    `serve` is SIGKILLed `BENCH_SERVE_KILLS` times at random moments and restarted.
//! 5. `revision activate --revision 2`, a rollback (`--previous`), `activate` again; the
//!    publisher stops, the stream drains, and every key of both revisions is checked against
//!    what the test published (content hashes computed here), then `revision retire` of 1.
//!
//! Reported: the backfill's wall time (every run, kills included) against the floor's, its
//! provider inputs per chunk it had to embed, each switch's coverage check and the time it
//! held queries of the name, the probe's answers and the slowest, and what was wrong (must
//! be nothing).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod common;
use common::{BenchDb, env_usize};

use embed_dlq::model::content_hash;
use embed_dlq::testkit::mock_provider::{MockConfig, MockProvider};
use rand::{RngExt, SeedableRng};
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

const BIN: &str = env!("CARGO_BIN_EXE_embed-dlq");
const DIMS_A: i32 = 256;
const DIMS_B: i32 = 384;
/// Keys a probe asks for at once.
const PROBE_KEYS: usize = 20;
/// Chunks a document of the corpus has.
const PER_DOC: usize = 10;

fn main() {
    if std::env::args().any(|a| a == "--test" || a == "--list") {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    rt.block_on(run());
}

/// Key `i` of the corpus.
fn corpus_key(i: usize) -> (String, i32) {
    (format!("d{}", i / PER_DOC), (i % PER_DOC) as i32)
}

fn corpus_text(i: usize) -> String {
    format!(
        "doc {} chunk {} v0: embedding pipelines park failures, replay them and reconcile",
        i / PER_DOC,
        i % PER_DOC
    )
}

fn jsonl(doc: &str, idx: i32, text: &str) -> String {
    format!("{}\n", serde_json::json!({"doc_id": doc, "chunk_index": idx, "text": text}))
}

/// What the stream changed: key → its latest text, `None` once deleted.
type Changes = HashMap<(String, i32), Option<String>>;

/// Writes the corpus with `changes` applied (the source's state) to `path`; returns its lines.
fn write_dump(path: &Path, chunks: usize, changes: &Changes) -> usize {
    use std::io::Write;
    let mut f = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(path).unwrap());
    let mut lines = 0;
    for i in 0..chunks {
        let key = corpus_key(i);
        let text = match changes.get(&key) {
            Some(Some(t)) => t.clone(),
            Some(None) => continue,
            None => corpus_text(i),
        };
        f.write_all(jsonl(&key.0, key.1, &text).as_bytes()).unwrap();
        lines += 1;
    }
    for ((doc, idx), text) in changes {
        if doc.starts_with("live-")
            && let Some(t) = text
        {
            f.write_all(jsonl(doc, *idx, t).as_bytes()).unwrap();
            lines += 1;
        }
    }
    f.flush().unwrap();
    lines
}

/// The release binary with `args`, its output captured.
async fn cli(args: &[&str]) -> std::process::Output {
    Command::new(BIN).args(args).output().await.unwrap()
}

fn must(out: &std::process::Output, what: &str) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{what} exited {:?}: {}\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().rev().find(|l| l.starts_with('{')).unwrap_or("{}");
    serde_json::from_str(last).unwrap_or_else(|e| panic!("{what}: {e}: {stdout}"))
}

/// What the probe saw.
#[derive(Default)]
struct ProbeLog {
    answers: u64,
    bad: Vec<String>,
    latencies_ms: Vec<f64>,
    dims_seen: Vec<i32>,
    /// The slowest answer: its latency and the phase it was sent in.
    slowest: (f64, &'static str),
}

/// What the run is doing, for the probe's slowest answer.
type Phase = Arc<Mutex<&'static str>>;

/// Queries the name `docs` every 100 ms until `stop`: `expected` is the dimension the answer
/// must have (0: either, a switch is under way).
fn start_probe(
    pool: sqlx::PgPool,
    chunks: usize,
    expected: Arc<AtomicI32>,
    phase: Phase,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<ProbeLog> {
    tokio::spawn(async move {
        let mut log = ProbeLog::default();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let sql = "SELECT count(*), min(vector_dims(embedding)), max(vector_dims(embedding)) FROM docs
                    WHERE (doc_id, chunk_index) IN (SELECT * FROM UNNEST($1::text[], $2::int[]))";
        while !stop.is_cancelled() {
            // Distinct keys: `IN` answers a key asked twice once.
            let mut picked = std::collections::BTreeSet::new();
            while picked.len() < PROBE_KEYS.min(chunks) {
                picked.insert(rng.random_range(0..chunks));
            }
            let keys: Vec<(String, i32)> = picked.into_iter().map(corpus_key).collect();
            let docs: Vec<&str> = keys.iter().map(|k| k.0.as_str()).collect();
            let idxs: Vec<i32> = keys.iter().map(|k| k.1).collect();
            let want = expected.load(Ordering::SeqCst);
            let sent_in = *phase.lock().unwrap();
            let sent = Instant::now();
            let answer = sqlx::query_as::<_, (i64, Option<i32>, Option<i32>)>(sql)
                .bind(&docs)
                .bind(&idxs)
                .fetch_one(&pool)
                .await;
            let ms = sent.elapsed().as_secs_f64() * 1000.0;
            log.latencies_ms.push(ms);
            if ms > log.slowest.0 {
                log.slowest = (ms, sent_in);
            }
            log.answers += 1;
            match answer {
                Ok((n, lo, hi)) => {
                    if n != keys.len() as i64 {
                        log.bad.push(format!("{n} of {PROBE_KEYS} rows"));
                    } else if lo != hi {
                        log.bad.push(format!("a mix of dimensions {lo:?}..{hi:?}"));
                    } else if want != 0 && hi != Some(want) {
                        log.bad.push(format!("dimension {hi:?} while revision of {want} was active"));
                    }
                    if let Some(d) = hi
                        && log.dims_seen.last() != Some(&d)
                    {
                        log.dims_seen.push(d);
                    }
                }
                Err(e) => log.bad.push(format!("an error: {e}")),
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                _ = stop.cancelled() => {}
            }
        }
        log
    })
}

/// Publishes to `stream` at `rate` entries a second until `stop`; records each change in
/// `changes`. Returns the entries published.
fn start_publisher(
    redis_url: String,
    stream: String,
    rate: usize,
    chunks: usize,
    changes: Arc<Mutex<Changes>>,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let client = embed_dlq::streams::client(&redis_url).unwrap();
        let mut redis = client.managed().await.unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate.max(1) as f64));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let (mut n, mut live) = (0u64, Vec::<(String, i32)>::new());
        while !stop.is_cancelled() {
            tick.tick().await;
            let mut cmd = redis::cmd("XADD");
            cmd.arg(&stream).arg("*");
            let (key, text) = match n % 10 {
                0..=2 => {
                    let key = corpus_key(rng.random_range(0..chunks));
                    let text = format!("{} {} changed by entry {n}", key.0, key.1);
                    (key, Some(text))
                }
                9 if !live.is_empty() => (live.swap_remove(rng.random_range(0..live.len())), None),
                _ => {
                    let key = (format!("live-{}", n / 10), (n % 10) as i32);
                    live.push(key.clone());
                    (key.clone(), Some(format!("{} {} new in entry {n}", key.0, key.1)))
                }
            };
            cmd.arg("doc_id").arg(&key.0).arg("chunk_index").arg(key.1.to_string());
            match &text {
                Some(t) => cmd.arg("text").arg(t),
                None => cmd.arg("op").arg("delete"),
            };
            // Recorded before the entry exists, so a dump taken meanwhile never misses it.
            changes.lock().unwrap().insert(key, text);
            let _: String = cmd.query_async(&mut redis).await.unwrap();
            n += 1;
        }
        n
    })
}

/// `serve` following `stream` into `docs`.
fn spawn_serve(
    db_url: &str,
    redis_url: &str,
    prefix: &str,
    stream: &str,
    provider: &str,
    dir: &Path,
    n: usize,
) -> Child {
    let log = std::fs::File::create(dir.join(format!("serve-{n}.log"))).unwrap();
    Command::new(BIN)
        .args(["serve", "--database-url", db_url, "--redis-url", redis_url, "--stream-prefix", prefix])
        .args(["--from-stream", stream, "--group", "bench", "--consumer", "bench-serve"])
        .args(["--source-min-idle-ms", "2000", "--table", "docs", "--model", "m-a"])
        .args(["--request-dimensions", &DIMS_A.to_string(), "--base-url", provider])
        .args(["--reconcile-every-secs", "0", "--log-format", "json"])
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

/// Whether the group `bench` on `stream` has read and acknowledged everything.
async fn drained(redis: &mut embed_dlq::streams::RedisConn, stream: &str) -> bool {
    let reply: redis::Value = match redis::cmd("XINFO").arg("GROUPS").arg(stream).query_async(redis).await {
        Ok(v) => v,
        Err(_) => return false,
    };
    let redis::Value::Array(groups) = reply else { return false };
    groups.into_iter().any(|g| {
        let fields: Vec<redis::Value> = match g {
            redis::Value::Array(a) => a,
            redis::Value::Map(m) => m.into_iter().flat_map(|(k, v)| [k, v]).collect(),
            _ => return false,
        };
        let get = |name: &str| {
            fields.chunks(2).find_map(|kv| match (&kv[0], kv.get(1)) {
                (redis::Value::BulkString(k), Some(v)) if k == name.as_bytes() => Some(v.clone()),
                _ => None,
            })
        };
        matches!(get("name"), Some(redis::Value::BulkString(n)) if n == b"bench")
            && matches!(get("pending"), Some(redis::Value::Int(0)))
            && matches!(get("lag"), Some(redis::Value::Int(0)))
    })
}

/// Every key's content hash in `relation`.
async fn hashes(pool: &sqlx::PgPool, relation: &str) -> HashMap<(String, i32), String> {
    let sql = format!("SELECT doc_id, chunk_index, content_hash FROM {relation}");
    sqlx::query_as::<_, (String, i32, String)>(sqlx::AssertSqlSafe(sql))
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .map(|(d, i, h)| ((d, i), h))
        .collect()
}

/// Keys of `relation` that do not hold the vector of their latest text by `model` at `dims`,
/// or that were deleted and are still there; with the first few.
async fn wrong_keys(
    pool: &sqlx::PgPool,
    relation: &str,
    model: &str,
    dims: usize,
    chunks: usize,
    changes: &Changes,
) -> (usize, Vec<String>) {
    let got = hashes(pool, relation).await;
    let mut wrong = Vec::new();
    let mut check = |key: &(String, i32), text: Option<&str>| {
        let ok = match text {
            Some(t) => got.get(key) == Some(&content_hash(model, dims, t)),
            None => !got.contains_key(key),
        };
        if !ok {
            wrong.push(format!("{}#{}", key.0, key.1));
        }
    };
    for i in 0..chunks {
        let key = corpus_key(i);
        match changes.get(&key) {
            Some(t) => check(&key, t.as_deref()),
            None => check(&key, Some(&corpus_text(i))),
        }
    }
    for (key, text) in changes.iter().filter(|(k, _)| k.0.starts_with("live-")) {
        check(key, text.as_deref());
    }
    let n = wrong.len();
    wrong.truncate(5);
    (n, wrong)
}

async fn run() {
    let admin = std::env::var("DATABASE_URL").expect("DATABASE_URL");
    let redis_url = std::env::var("REDIS_URL").expect("REDIS_URL");
    let chunks = env_usize("BENCH_CHUNKS", 1_000_000);
    let rate = env_usize("BENCH_RATE", 200);
    let backfill_kills = env_usize("BENCH_BACKFILL_KILLS", 3);
    let serve_kills = env_usize("BENCH_SERVE_KILLS", 2);
    let pid = std::process::id();
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("target/bench-migration-{pid}"));
    std::fs::create_dir_all(&dir).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(u64::from(pid));
    println!(
        "migration benchmark: {chunks} chunks, {rate} entries/s, {backfill_kills} backfill and {serve_kills} serve SIGKILLs"
    );

    let (live, fill, floor_mock) = (mock().await, mock().await, mock().await);
    let corpus = dir.join("corpus.jsonl");
    {
        use std::io::Write;
        let mut f = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(&corpus).unwrap());
        for i in 0..chunks {
            let (doc, idx) = corpus_key(i);
            f.write_all(jsonl(&doc, idx, &corpus_text(i)).as_bytes()).unwrap();
        }
        f.flush().unwrap();
    }
    let corpus = corpus.to_str().unwrap().to_string();

    // 1. The floor, in a database of its own.
    let floor_db = BenchDb::create(&admin, &format!("bench_migration_floor_{pid}")).await;
    let b = DIMS_B.to_string();
    must(
        &cli(&["migrate", "--database-url", &floor_db.url, "--table", "floor", "--dimensions", &b]).await,
        "migrate",
    );
    let started = Instant::now();
    let floor = must(
        &cli(&[
            "ingest",
            &corpus,
            "--database-url",
            &floor_db.url,
            "--table",
            "floor",
            "--model",
            "m-b",
            "--request-dimensions",
            &b,
            "--base-url",
            &floor_mock.base_url(),
            "--no-progress",
            "--json",
        ])
        .await,
        "the floor's ingest",
    );
    let floor_secs = started.elapsed().as_secs_f64();
    assert_eq!(floor["stored"].as_u64(), Some(chunks as u64), "{floor}");
    floor_db.drop().await;
    println!("floor: a fresh ingest of {chunks} chunks at {DIMS_B} dimensions in {floor_secs:.1} s");

    // 2. The target, the live writes and the probe.
    let db = BenchDb::create(&admin, &format!("bench_migration_{pid}")).await;
    let a = DIMS_A.to_string();
    must(
        &cli(&["migrate", "--database-url", &db.url, "--table", "docs", "--dimensions", &a]).await,
        "migrate",
    );
    let started = Instant::now();
    must(
        &cli(&[
            "ingest",
            &corpus,
            "--database-url",
            &db.url,
            "--table",
            "docs",
            "--model",
            "m-a",
            "--request-dimensions",
            &a,
            "--base-url",
            &live.base_url(),
            "--no-progress",
            "--json",
        ])
        .await,
        "the first ingest",
    );
    println!(
        "revision 1: {chunks} chunks at {DIMS_A} dimensions in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let (prefix, stream) = (format!("bench-mig-{pid}"), format!("bench-mig-{pid}:source"));
    let stop = CancellationToken::new();
    let expected = Arc::new(AtomicI32::new(DIMS_A));
    let probe_pool = embed_dlq::store::connect(&db.url, 2).await.unwrap();
    let phase: Phase = Arc::new(Mutex::new("live writes, revision 1 alone"));
    let set_phase = |p: &'static str| *phase.lock().unwrap() = p;
    let probe = start_probe(probe_pool, chunks, expected.clone(), phase.clone(), stop.clone());
    let changes = Arc::new(Mutex::new(Changes::new()));
    let publishing = CancellationToken::new();
    let published_from = Instant::now();
    let publisher =
        start_publisher(redis_url.clone(), stream.clone(), rate, chunks, changes.clone(), publishing.clone());
    let mut serves = 0;
    let serve = |n: &mut usize| {
        *n += 1;
        spawn_serve(&db.url, &redis_url, &prefix, &stream, &live.base_url(), &dir, *n)
    };
    let mut serving = serve(&mut serves);
    tokio::time::sleep(Duration::from_secs(5)).await;

    // 3. The first revision of the table, made with serve stopped.
    let pid_of = |c: &Child| nix_pid(c.id().unwrap());
    set_phase("serve stopped, revision create");
    signal(pid_of(&serving), "TERM");
    serving.wait().await.unwrap();
    let started = Instant::now();
    let made = must(
        &cli(&[
            "revision",
            "create",
            "--database-url",
            &db.url,
            "--target",
            "docs",
            "--active-model",
            "m-a",
            "--model",
            "m-b",
            "--dimensions",
            &b,
            "--request-dimensions",
            &b,
            "--json",
        ])
        .await,
        "revision create",
    );
    let create_secs = started.elapsed().as_secs_f64();
    println!("revision create (the adoption and revision 2): {create_secs:.2} s: {made}");
    let serving = Arc::new(tokio::sync::Mutex::new(serve(&mut serves)));
    let held_before: i64 = loop {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM docs__r2").fetch_one(&db.pool).await.unwrap();
        if n > 0 {
            break n;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };

    // 4. The dump and the backfill, with SIGKILLs of it and of serve.
    set_phase("the dump and the backfill");
    let dump = dir.join("dump.jsonl");
    let snapshot = changes.lock().unwrap().clone();
    let dump_lines = write_dump(&dump, chunks, &snapshot);
    drop(snapshot);
    let held_before = held_before.max(
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM docs__r2").fetch_one(&db.pool).await.unwrap(),
    );
    let dump = dump.to_str().unwrap().to_string();
    let backfilling = Arc::new(AtomicBool::new(true));
    let killer = {
        let (serving, backfilling) = (serving.clone(), backfilling.clone());
        let times: Vec<f64> = (0..serve_kills).map(|_| rng.random_range(2.0..floor_secs.max(3.0))).collect();
        let (db_url, redis_url, prefix, stream, provider, dir) =
            (db.url.clone(), redis_url.clone(), prefix.clone(), stream.clone(), live.base_url(), dir.clone());
        tokio::spawn(async move {
            let mut times = times;
            times.sort_by(|a, b| a.partial_cmp(b).unwrap());
            let (started, mut killed) = (Instant::now(), 0);
            for (n, at) in times.into_iter().enumerate() {
                tokio::time::sleep(Duration::from_secs_f64(at).saturating_sub(started.elapsed())).await;
                if !backfilling.load(Ordering::SeqCst) {
                    break;
                }
                let mut s = serving.lock().await;
                s.start_kill().unwrap();
                s.wait().await.unwrap();
                killed += 1;
                *s = spawn_serve(&db_url, &redis_url, &prefix, &stream, &provider, &dir, 100 + n);
            }
            killed
        })
    };
    let fill_before = fill.control.stats().inputs;
    let (mut runs, mut killed, mut backfill_secs) = (0, 0, 0.0);
    let summary = loop {
        runs += 1;
        let mut c = Command::new(BIN);
        c.args([
            "revision",
            "backfill",
            &dump,
            "--database-url",
            &db.url,
            "--table",
            "docs",
            "--model",
            "m-a",
        ])
        .args(["--request-dimensions", &a, "--base-url", &fill.base_url(), "--no-progress", "--json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
        let started = Instant::now();
        let mut child = c.spawn().unwrap();
        if killed < backfill_kills {
            let at = Duration::from_secs_f64(rng.random_range(0.5..(floor_secs * 0.9).max(1.0)));
            if tokio::time::timeout(at, child.wait()).await.is_err() {
                child.start_kill().unwrap();
                child.wait().await.unwrap();
                backfill_secs += started.elapsed().as_secs_f64();
                killed += 1;
                println!("backfill run {runs}: SIGKILL after {:.1} s", at.as_secs_f64());
                continue;
            }
        }
        let out = child.wait_with_output().await.unwrap();
        backfill_secs += started.elapsed().as_secs_f64();
        // Exit 7 (chunks left to a concurrent run): a backfill takes no leases, so it must
        // not happen; counted in the runs if it does.
        if out.status.code() == Some(7) {
            println!("backfill run {runs}: exit 7 (left to a concurrent writer), rerun");
            continue;
        }
        break must(&out, "revision backfill");
    };
    backfilling.store(false, Ordering::SeqCst);
    let serve_killed = killer.await.unwrap();
    let fill_inputs = fill.control.stats().inputs - fill_before;
    let shadow = &summary["revisions"][0]["summary"];
    let copied = shadow["stored"].as_u64().unwrap() + shadow["unchanged"].as_u64().unwrap();
    let needed = copied.saturating_sub(held_before as u64);
    println!(
        "backfill: {dump_lines} lines in {runs} runs ({killed} SIGKILLed), {backfill_secs:.1} s in all; \
         {copied} copied, {} left out (the active revision holds other text: changed since the dump), \
         {fill_inputs} provider inputs for the {needed} chunks revision 2 did not hold yet",
        shadow["differs_from_active"]
    );

    // 5. The switch, a rollback, the switch again.
    let mut switches = Vec::new();
    for (what, args, after) in [
        ("activate", &["--revision", "2"][..], DIMS_B),
        ("rollback", &["--previous"][..], DIMS_A),
        ("activate again", &["--revision", "2"][..], DIMS_B),
    ] {
        set_phase("between switches");
        tokio::time::sleep(Duration::from_secs(3)).await;
        set_phase(what);
        expected.store(0, Ordering::SeqCst);
        let started = Instant::now();
        let out = cli(&[
            &["revision", "activate", "--database-url", &db.url, "--target", "docs"][..],
            args,
            &["--wait-secs", "60", "--json"],
        ]
        .concat())
        .await;
        let wall = started.elapsed().as_secs_f64();
        let a = must(&out, what);
        expected.store(after, Ordering::SeqCst);
        println!(
            "{what}: {wall:.2} s in all; coverage check {} ms, queries of the name held {:.1} ms; uncovered: {}",
            a["coverage_check_ms"],
            a["switch_us"].as_f64().unwrap_or(f64::NAN) / 1000.0,
            a["coverage"]
        );
        switches.push((what, wall, a));
    }
    set_phase("draining");
    tokio::time::sleep(Duration::from_secs(3)).await;
    publishing.cancel();
    let published = publisher.await.unwrap();
    let publish_secs = published_from.elapsed().as_secs_f64();
    let client = embed_dlq::streams::client(&redis_url).unwrap();
    let mut redis = client.managed().await.unwrap();
    let drain_started = Instant::now();
    while !drained(&mut redis, &stream).await {
        assert!(drain_started.elapsed() < Duration::from_secs(600), "the source drains");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    {
        let mut s = serving.lock().await;
        signal(pid_of(&s), "TERM");
        s.wait().await.unwrap();
    }
    stop.cancel();
    let probe = probe.await.unwrap();
    let changes = changes.lock().unwrap().clone();
    let (wrong_a, ex_a) = wrong_keys(&db.pool, "docs__r1", "m-a", DIMS_A as usize, chunks, &changes).await;
    let (wrong_b, ex_b) = wrong_keys(&db.pool, "docs__r2", "m-b", DIMS_B as usize, chunks, &changes).await;
    let started = Instant::now();
    must(
        &cli(&[
            "revision",
            "retire",
            "--database-url",
            &db.url,
            "--target",
            "docs",
            "--revision",
            "1",
            "--yes",
            "--json",
        ])
        .await,
        "revision retire",
    );
    let retire_secs = started.elapsed().as_secs_f64();

    let mut lat = probe.latencies_ms.clone();
    lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let pct = |p: f64| lat.get(((lat.len() as f64 - 1.0) * p) as usize).copied().unwrap_or(f64::NAN);
    println!();
    println!("| measure | value |");
    println!("| --- | --- |");
    println!("| chunks in the corpus / lines in the dump | {chunks} / {dump_lines} |");
    println!(
        "| live writes | {published} entries in {publish_secs:.0} s ({:.0}/s) |",
        published as f64 / publish_secs
    );
    println!(
        "| backfill wall (all {runs} runs, {killed} SIGKILLed; serve SIGKILLed {serve_killed}x) / floor | {backfill_secs:.1} s / {floor_secs:.1} s = {:.2} |",
        backfill_secs / floor_secs
    );
    println!(
        "| backfill provider inputs per chunk it had to embed | {fill_inputs} / {needed} = {:.4} |",
        fill_inputs as f64 / needed.max(1) as f64
    );
    println!("| backfill lines left out (changed since the dump) | {} |", shadow["differs_from_active"]);
    for (what, wall, a) in &switches {
        println!(
            "| {what}: command wall, coverage check, name held | {wall:.2} s, {} ms, {:.1} ms (uncovered at the switch: {}) |",
            a["coverage_check_ms"],
            a["switch_us"].as_f64().unwrap_or(f64::NAN) / 1000.0,
            a["coverage"]["missing"].as_u64().unwrap_or(0)
                + a["coverage"]["other_text"].as_u64().unwrap_or(0)
                + a["coverage"]["unresolved"].as_u64().unwrap_or(0)
                + a["coverage"]["without_vector"].as_u64().unwrap_or(0)
        );
    }
    println!(
        "| revision create (adoption + revision 2) / retire | {create_secs:.2} s / {retire_secs:.2} s |"
    );
    println!(
        "| probe answers; wrong (a mix, short, other dimension, error) | {}; {} |",
        probe.answers,
        probe.bad.len()
    );
    println!(
        "| probe latency p50 / p99 / max | {:.1} / {:.1} / {:.1} ms |",
        pct(0.5),
        pct(0.99),
        lat.last().copied().unwrap_or(f64::NAN)
    );
    println!("| the slowest probe answer | {:.1} ms, sent during: {} |", probe.slowest.0, probe.slowest.1);
    println!("| dimensions the probe saw, in order | {:?} |", probe.dims_seen);
    println!("| keys wrong at the end: revision 1, revision 2 | {wrong_a} {ex_a:?}, {wrong_b} {ex_b:?} |");
    if !probe.bad.is_empty() {
        println!("probe: first wrong answers: {:?}", &probe.bad[..probe.bad.len().min(5)]);
    }
    let _: i64 = redis::cmd("DEL").arg(&stream).query_async(&mut redis).await.unwrap_or(0);
    db.drop().await;
    let _ = std::fs::remove_dir_all(&dir);
    assert!(probe.bad.is_empty() && wrong_a == 0 && wrong_b == 0, "the migration lost or mixed something");
}

/// A mock provider serving vectors of up to the new dimension.
async fn mock() -> MockProvider {
    MockProvider::start(
        MockConfig { dimensions: DIMS_B as usize, ..MockConfig::default() },
        SocketAddr::from(([127, 0, 0, 1], 0)),
        CancellationToken::new(),
    )
    .await
    .unwrap()
}

fn nix_pid(id: u32) -> String {
    id.to_string()
}

/// Sends SIG`name` to process `pid`.
fn signal(pid: String, name: &str) {
    let status = std::process::Command::new("kill").args([&format!("-{name}"), &pid]).status().unwrap();
    assert!(status.success(), "kill -{name} {pid}");
}
