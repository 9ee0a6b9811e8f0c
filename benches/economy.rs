//! Provider economy: what the provider is sent per chunk stored, for embed-dlq and for the
//! seed's design, under the faults that cost money (poison inputs, random request faults, an
//! outage, a 429 storm).
//!
//! ```text
//! BENCH=economy scripts/bench.sh          # = services up + cargo bench --bench economy
//! ECONOMY_SEEDS=42,1,2 ECONOMY_ONLY="demo mix" BENCH=economy scripts/bench.sh   # a subset
//! ```
//!
//! Every scenario runs embed-dlq's real pipeline (`Pipeline::run`, the settings the command
//! line would resolve) against the fault-injecting mock over real HTTP, on a fresh database
//! that is dropped afterwards. Figures come from the mock's own counters. Transient rows the
//! ingest parked are then replayed by `serve` (relay, scheduler, replayers, the same library
//! call as the command) once the provider is back, and its requests are counted too: a
//! chunk's whole way to a stored vector. The parked rows are made due at once instead of
//! after their 30-60 s, and `serve` re-parks on a 1 s schedule, so the bench does not wait
//! for the DLQ schedule; that changes when requests are sent, not how many.
//!
//! The seed's design (one input per request, 6 attempts, full-jitter backoff from 1 s doubling
//! to 45 s, parked rows replayed by its replay job) is simulated over the same corpus and the
//! same mock settings in virtual time (`embed_dlq::testkit::seed_model`, whose unit tests check
//! it against the closed forms).
//!
//! Scenarios a-c use fast retry timings (5 ms base, 40 ms cap, 1 s request timeout): the
//! mock's faults are drawn per request, whatever the time, so the timings change how long a
//! run takes, not what it sends. The outage and the storm use the defaults, because there
//! time is the fault.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use embed_dlq::config::{
    FileConfig, IngestArgs, IngestSettings, Origins, ProviderArgs, RetryArgs, ServeArgs, ServiceArgs,
    Settings,
};
use embed_dlq::embed::gate::OnOutage;
use embed_dlq::ingest::IngestSummary;
use embed_dlq::model::ErrorClass;
use embed_dlq::serve::ServeConfig;
use embed_dlq::testkit::TestDb;
use embed_dlq::testkit::corpus::{CorpusSpec, demo_faults, write_corpus};
use embed_dlq::testkit::mock_provider::{self, MockConfig, MockProvider, MockStats};
use embed_dlq::testkit::seed_model::{self, SeedDesign, SeedInput, SeedOutcome};
use tokio_util::sync::CancellationToken;

fn main() {
    // `cargo test --benches` runs benches in test mode: do nothing there.
    if std::env::args().any(|a| a == "--test" || a == "--list") {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    rt.block_on(run());
}

/// The corpus of a scenario.
#[derive(Debug, Clone)]
enum Corpus {
    /// The generated corpus (40 words a chunk), no poison.
    Clean(usize),
    /// `tests/it/economy.rs`'s 0.5% corpus: one chunk in `every` rejected (400 and 422 in turn).
    Poison { chunks: usize, every: usize },
    /// The demo's corpus: poison every 200 chunks (400, NaN, wrong dimension, blank, too long).
    Demo(usize),
}

/// Longest input; the demo corpus's over-long poison is one character longer.
const MAX_INPUT_CHARS: usize = 8_000;

impl Corpus {
    fn jsonl(&self, tag: &str) -> Vec<u8> {
        let mut out = Vec::new();
        match *self {
            Corpus::Clean(chunks) => {
                let spec = CorpusSpec { doc_prefix: tag.into(), chunks, ..CorpusSpec::default() };
                write_corpus(&mut out, &spec, MAX_INPUT_CHARS).unwrap();
            }
            Corpus::Demo(chunks) => {
                let spec =
                    CorpusSpec { doc_prefix: tag.into(), chunks, poison_every: 200, ..CorpusSpec::default() };
                write_corpus(&mut out, &spec, MAX_INPUT_CHARS).unwrap();
            }
            Corpus::Poison { chunks, every } => {
                let markers = [mock_provider::POISON_400, mock_provider::POISON_422];
                for n in 0..chunks {
                    let mut text = format!("chunk {n} about vectors, batches and the tokens they cost");
                    if n % every == every / 2 {
                        text.push_str(markers[(n / every) % markers.len()]);
                    }
                    let line = serde_json::json!({"doc_id": format!("{tag}{}", n / 8), "chunk_index": n % 8, "text": text});
                    out.extend_from_slice(format!("{line}\n").as_bytes());
                }
            }
        }
        out
    }

    /// The same chunks as the seed's design meets them: a chunk embed-dlq parks before or
    /// after one call (a poison marker, blank, too long) costs the seed one request.
    fn seed_inputs(jsonl: &[u8]) -> Vec<SeedInput> {
        jsonl
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| {
                let v: serde_json::Value = serde_json::from_slice(l).unwrap();
                let text = v["text"].as_str().unwrap_or_default();
                let chars = text.chars().count();
                let tokens = chars.div_ceil(4).max(1) as u64;
                if text.contains("[[poison:") || text.trim().is_empty() || chars > MAX_INPUT_CHARS {
                    SeedInput::Poison { tokens }
                } else {
                    SeedInput::Clean { tokens }
                }
            })
            .collect()
    }
}

/// One row of the table.
#[derive(Debug, Clone)]
struct Scenario {
    label: String,
    corpus: Corpus,
    mock: MockConfig,
    workers: usize,
    /// Fast retry timings (see the module doc) instead of the defaults.
    fast: bool,
    on_outage: Option<OnOutage>,
    /// `--max-requests-per-minute` and `--max-tokens-per-minute` (0: no token budget).
    budget: Option<(u32, u32)>,
}

impl Scenario {
    fn new(label: impl Into<String>, corpus: Corpus, mock: MockConfig) -> Self {
        Scenario { label: label.into(), corpus, mock, workers: 4, fast: true, on_outage: None, budget: None }
    }
}

/// The provider's counters of one phase: `after` minus `before`.
fn delta(after: &MockStats, before: &MockStats) -> MockStats {
    MockStats {
        requests: after.requests - before.requests,
        inputs: after.inputs - before.inputs,
        ok: after.ok - before.ok,
        rate_limited: after.rate_limited - before.rate_limited,
        server_errors: after.server_errors - before.server_errors,
        timeouts: after.timeouts - before.timeouts,
        resets: after.resets - before.resets,
        rejected: after.rejected - before.rejected,
        unauthorized: after.unauthorized - before.unauthorized,
        canaries: after.canaries - before.canaries,
        over_limit: after.over_limit - before.over_limit,
        fault_inputs: after.fault_inputs - before.fault_inputs,
    }
}

/// Requests that met a request-level fault (the same set as `fault_inputs`).
fn failed(m: &MockStats) -> u64 {
    m.rate_limited + m.server_errors + m.timeouts + m.resets
}

/// What embed-dlq sent, and where the chunks ended.
struct Measured {
    summary: IngestSummary,
    /// The mock's counters after the ingest.
    ingest: MockStats,
    /// What `serve`'s replay sent after it.
    replay: MockStats,
    /// Both phases.
    all: MockStats,
    /// Vectors in the table at the end (ingest and replay).
    stored: u64,
    /// Transient rows `serve` had not finished by the deadline.
    left_transient: u64,
    ingest_secs: f64,
    total_secs: f64,
}

/// The resolved settings of one scenario, as the command line would give them.
fn settings(s: &Scenario, db: &TestDb, mock: &MockProvider, serve: bool, prefix: &str) -> Settings {
    let fast = |v| if s.fast { Some(v) } else { None };
    let flags = FileConfig {
        services: ServiceArgs {
            database_url: Some(db.url.clone()),
            redis_url: std::env::var("REDIS_URL").ok(),
            redis_cluster: None,
        },
        provider: ProviderArgs {
            base_url: Some(mock.base_url()),
            model: Some("economy".into()),
            request_timeout_ms: fast(1_000),
            max_requests_per_minute: s.budget.map(|b| b.0),
            max_tokens_per_minute: s.budget.map(|b| b.1).filter(|&tpm| tpm > 0),
            ..Default::default()
        },
        ingest: IngestArgs {
            concurrency: Some(s.workers),
            max_input_chars: Some(MAX_INPUT_CHARS),
            on_outage: s.on_outage,
            ..Default::default()
        },
        retry: RetryArgs {
            retry_base_ms: fast(5),
            retry_cap_ms: fast(40),
            // `serve` re-parks a failed replay on a 1 s schedule (the count does not depend on it).
            dlq_base_secs: serve.then_some(1),
            ..Default::default()
        },
        serve: ServeArgs { stream_prefix: Some(prefix.into()), ..Default::default() },
        source: Default::default(),
    };
    Settings::resolve(flags, None, &Origins::default()).expect("valid settings")
}

async fn count(db: &TestDb, sql: &'static str) -> u64 {
    sqlx::query_scalar::<_, i64>(sql).fetch_one(&db.pool).await.unwrap() as u64
}

/// Transient rows that replay still has to finish.
const PENDING_TRANSIENT: &str =
    "SELECT count(*) FROM embedding_dlq WHERE error_class = 'transient' AND exhausted_at IS NULL";

async fn measure(s: &Scenario, n: usize) -> Measured {
    let db = TestDb::new().await;
    let mock =
        MockProvider::start(s.mock.clone(), SocketAddr::from(([127, 0, 0, 1], 0)), CancellationToken::new())
            .await
            .unwrap();
    let prefix = format!("economy-{}-{n}", std::process::id());
    let ingest: IngestSettings = settings(s, &db, &mock, false, &prefix).ingest().unwrap();
    let pipeline = ingest.pipeline().await.unwrap();
    let corpus = s.corpus.jsonl(&format!("e{n}-"));
    let started = Instant::now();
    let summary = pipeline.run(std::io::Cursor::new(corpus), CancellationToken::new()).await.unwrap();
    let ingest_secs = started.elapsed().as_secs_f64();
    let ingest_stats = mock.control.stats();
    drop(pipeline);

    let mut left_transient = count(&db, PENDING_TRANSIENT).await;
    if left_transient > 0 {
        left_transient = replay(s, &db, &mock, &prefix).await;
    }
    let all = mock.control.stats();
    let replay_stats = delta(&all, &ingest_stats);
    let stored = count(&db, "SELECT count(*) FROM doc_embeddings").await;
    let total_secs = started.elapsed().as_secs_f64();
    mock.shutdown().await;
    Measured {
        summary,
        ingest: ingest_stats,
        replay: replay_stats,
        all,
        stored,
        left_transient,
        ingest_secs,
        total_secs,
    }
}

/// Runs `serve` until every transient row is stored (or 5 minutes); returns the rows left.
async fn replay(s: &Scenario, db: &TestDb, mock: &MockProvider, prefix: &str) -> u64 {
    let Ok(redis_url) = std::env::var("REDIS_URL") else {
        eprintln!("REDIS_URL is not set: the parked rows are not replayed (run scripts/bench.sh)");
        return count(db, PENDING_TRANSIENT).await;
    };
    while mock.control.in_outage() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    sqlx::query("UPDATE embedding_dlq SET next_retry_at = now() WHERE next_retry_at IS NOT NULL")
        .execute(&db.pool)
        .await
        .unwrap();
    let settings = settings(s, db, mock, true, prefix);
    let config = ServeConfig::from_settings(&settings);
    let pipeline = config.pipeline_settings(settings.ingest().unwrap()).pipeline().await.unwrap();
    let client = embed_dlq::streams::client(&redis_url).unwrap();
    let cancel = CancellationToken::new();
    let serve = tokio::spawn(embed_dlq::serve::serve(
        pipeline.store,
        pipeline.embedder,
        client.clone(),
        config,
        cancel.clone(),
    ));
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut left = count(db, PENDING_TRANSIENT).await;
    while left > 0 && Instant::now() < deadline && !serve.is_finished() {
        tokio::time::sleep(Duration::from_millis(200)).await;
        left = count(db, PENDING_TRANSIENT).await;
    }
    cancel.cancel();
    serve.await.unwrap().expect("serve stopped cleanly");
    delete_keys(&client, prefix).await;
    left
}

/// Deletes every Redis key of this scenario's stream prefix.
async fn delete_keys(client: &embed_dlq::streams::RedisClient, prefix: &str) {
    let mut conn = embed_dlq::streams::managed(client).await.unwrap();
    let pattern = format!("{{{prefix}}}*");
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await
            .unwrap();
        if !keys.is_empty() {
            let _: () = redis::cmd("DEL").arg(&keys).query_async(&mut conn).await.unwrap();
        }
        if next == 0 {
            return;
        }
        cursor = next;
    }
}

/// The seed's design over the same chunks and provider.
fn seed(s: &Scenario) -> SeedOutcome {
    let design = SeedDesign {
        workers: s.workers,
        latency_secs: s.mock.latency_ms as f64 / 1000.0 + 0.001,
        ..SeedDesign::default()
    };
    seed_model::simulate(&design, &s.mock, &Corpus::seed_inputs(&s.corpus.jsonl("seed-")))
}

/// `1/(1-p)`.
fn floor(failed: u64, requests: u64) -> f64 {
    if requests == 0 { 1.0 } else { 1.0 / (1.0 - failed as f64 / requests as f64) }
}

fn ratio(a: u64, b: u64) -> f64 {
    a as f64 / b.max(1) as f64
}

/// One line of the comparison table.
struct Row {
    label: String,
    ours: Measured,
    seed: SeedOutcome,
}

impl Row {
    fn print_detail(&self) {
        let m = &self.ours;
        let all = &m.all;
        let parked: u64 =
            m.summary.parked.iter().filter(|(c, _)| **c != ErrorClass::Transient).map(|(_, n)| n).sum();
        println!(
            "  embed-dlq: stored {} (parked permanent {parked}, transient {} of which replayed {}, left {}); \
             ingest {} req / {} inputs, replay {} req / {} inputs; {} failed req ({} over the limit), {} canaries; \
             fault inputs {}; {} rejected req, {} splits; breaker opened {}; {:.1} s ingest, {:.1} s in all",
            m.stored,
            m.summary.parked.get(&ErrorClass::Transient).copied().unwrap_or(0),
            m.summary.parked.get(&ErrorClass::Transient).copied().unwrap_or(0) - m.left_transient,
            m.left_transient,
            m.ingest.requests,
            m.ingest.inputs,
            m.replay.requests,
            m.replay.inputs,
            failed(all),
            all.over_limit,
            all.canaries,
            all.fault_inputs,
            all.rejected,
            m.summary.batch_splits,
            m.summary.breaker_opened,
            m.ingest_secs,
            m.total_secs,
        );
        println!(
            "  embed-dlq ingest: retries {:?}; tokens stored {}, wasted {} (estimated)",
            m.summary.retries, m.summary.tokens_stored, m.summary.tokens_wasted
        );
        let client_timeouts = m.summary.retries.get("timeout").copied().unwrap_or(0);
        if client_timeouts > m.ingest.timeouts {
            println!(
                "  WARNING: {client_timeouts} client timeouts for {} held-back answers: the machine is too loaded \
                 for the request timeout, answered requests were sent again",
                m.ingest.timeouts
            );
        }
        let s = &self.seed;
        println!(
            "  seed:      stored {} (parked permanent {}, transient {}, left {}); ingest {} req, replay {} req; \
             {} failed req ({} over the limit); {:.1} s ingest, {:.1} s in all (virtual)",
            s.stored,
            s.parked_permanent,
            s.parked_transient,
            s.left_parked,
            s.ingest_requests,
            s.replay_requests,
            s.failed_requests,
            s.over_limit,
            s.ingest_secs,
            s.total_secs,
        );
    }

    fn print_table_line(&self) {
        let all = &self.ours.all;
        let ours_floor = floor(failed(all), all.requests);
        let inputs = ratio(all.inputs, self.ours.stored);
        let s = &self.seed;
        let seed_floor = floor(s.failed_requests, s.requests());
        println!(
            "| {} | {:.4} | {:.4} | {:.4} | {:.4} | {:+.4} | {:.4} | {:.4} | {:.4} |",
            self.label,
            ratio(all.requests, self.ours.stored),
            inputs,
            failed(all) as f64 / all.requests.max(1) as f64,
            ours_floor,
            inputs - ours_floor,
            ratio(s.requests(), s.stored),
            failed_share(s),
            seed_floor,
        );
    }
}

fn failed_share(s: &SeedOutcome) -> f64 {
    s.failed_requests as f64 / s.requests().max(1) as f64
}

async fn run() {
    std::env::var("DATABASE_URL").expect("DATABASE_URL (run scripts/bench.sh)");
    let seeds: Vec<u64> = std::env::var("ECONOMY_SEEDS")
        .ok()
        .map(|v| v.split(',').filter_map(|s| s.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![42, 1, 2, 3, 4, 5, 6, 7]);
    let only = std::env::var("ECONOMY_ONLY").ok();
    let demo = MockConfig { timeout_hold_ms: 2_000, ..demo_faults() };
    let mut scenarios = vec![
        Scenario::new("a. no faults", Corpus::Clean(10_000), MockConfig::default()),
        Scenario::new("b. 0.5% poison", Corpus::Poison { chunks: 6_400, every: 200 }, MockConfig::default()),
        Scenario {
            workers: 1,
            ..Scenario::new(
                "b. 0.5% poison, 1 worker",
                Corpus::Poison { chunks: 6_400, every: 200 },
                MockConfig::default(),
            )
        },
        Scenario { workers: 1, ..Scenario::new("c. demo mix, 1 worker", Corpus::Demo(10_000), demo.clone()) },
    ];
    for seed in &seeds {
        scenarios.push(Scenario::new(
            format!("c. demo mix, seed {seed}"),
            Corpus::Demo(10_000),
            MockConfig { seed: *seed, ..demo.clone() },
        ));
    }
    let outage =
        MockConfig { outage_after_inputs: Some(10_000), outage_for_ms: 60_000, ..MockConfig::default() };
    for (label, mode) in
        [("d. 60 s outage, wait", OnOutage::Wait), ("d. 60 s outage, park + serve", OnOutage::Park)]
    {
        scenarios.push(Scenario {
            fast: false,
            on_outage: Some(mode),
            ..Scenario::new(label, Corpus::Clean(20_000), outage.clone())
        });
    }
    // An account of 1,200 requests and 400,000 tokens a minute, enforced per second, against a
    // demand far above it (4 workers, 20 ms a request).
    let (rpm, tpm) = (1_200u32, 400_000u32);
    let account = MockConfig {
        rpm_limit: Some(u64::from(rpm)),
        tpm_limit: Some(u64::from(tpm)),
        limit_window_ms: 1_000,
        latency_ms: 20,
        ..MockConfig::default()
    };
    scenarios.push(Scenario {
        fast: false,
        ..Scenario::new(
            "e. 429 storm, no budget, no rate-limit headers",
            Corpus::Clean(2_000),
            MockConfig { limit_headers: false, ..account.clone() },
        )
    });
    scenarios.push(Scenario {
        fast: false,
        ..Scenario::new("e. 429 storm, no budget, header pacing", Corpus::Clean(2_000), account.clone())
    });
    scenarios.push(Scenario {
        fast: false,
        budget: Some((rpm, tpm)),
        ..Scenario::new("e. 429 storm, budget = the account's limits", Corpus::Clean(2_000), account.clone())
    });
    // The poison sweep: the same 10,000-chunk corpus at four poison rates, isolated as
    // without a budget (resent inputs are the cost) and under a request budget alone (only
    // requests count; the budget is far above what the run sends, so it never waits).
    for (rate, every) in SWEEP {
        for (mode, budget) in [(SWEEP_NO_BUDGET, None), (SWEEP_REQUEST_BUDGET, Some((6_000_000, 0)))] {
            scenarios.push(Scenario {
                budget,
                ..Scenario::new(
                    format!("f. poison sweep {rate}, {mode}"),
                    Corpus::Poison { chunks: 10_000, every },
                    MockConfig::default(),
                )
            });
        }
    }
    if let Some(only) = &only {
        scenarios.retain(|s| s.label.contains(only.as_str()));
    }

    println!(
        "provider economy: {} scenarios (mock provider over HTTP; figures from its counters)",
        scenarios.len()
    );
    let mut rows = Vec::new();
    for (n, s) in scenarios.into_iter().enumerate() {
        let ours = measure(&s, n).await;
        let seed = seed(&s);
        let row = Row { label: s.label.clone(), ours, seed };
        println!("{}", row.label);
        row.print_detail();
        rows.push(row);
    }
    println!();
    println!(
        "| scenario | embed-dlq requests / stored | inputs / stored | p | floor 1/(1-p) | inputs - floor | seed requests (= inputs) / stored | seed p | seed floor |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for row in &rows {
        row.print_table_line();
    }
    print_sweep(&rows);
    let demo_rows: Vec<&Row> = rows.iter().filter(|r| r.label.starts_with("c. demo mix, seed")).collect();
    if !demo_rows.is_empty() {
        println!();
        println!("demo mix, 4 workers, by seed: the gap to the request-weighted floor, and to the floor");
        println!("weighed by inputs (inputs / inputs answered without a fault: what this run's faults");
        println!("imposed); the isolation factor is inputs answered / stored (poison isolation's cost)");
        println!(
            "| seed | p | floor 1/(1-p) | inputs / stored | gap | input-weighted floor | gap to it | isolation factor |"
        );
        println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
        let mut gaps = Vec::new();
        for r in demo_rows {
            let all = &r.ours.all;
            let f = floor(failed(all), all.requests);
            let answered = all.inputs - all.fault_inputs;
            let inputs = ratio(all.inputs, r.ours.stored);
            let weighted = ratio(all.inputs, answered);
            println!(
                "| {} | {:.4} | {:.4} | {:.4} | {:+.4} | {:.4} | {:+.4} | {:.4} |",
                r.label.trim_start_matches("c. demo mix, seed "),
                failed(all) as f64 / all.requests as f64,
                f,
                inputs,
                inputs - f,
                weighted,
                inputs - weighted,
                ratio(answered, r.ours.stored),
            );
            gaps.push((inputs - f, inputs - weighted));
        }
        let stats = |xs: Vec<f64>| {
            let mean = xs.iter().sum::<f64>() / xs.len() as f64;
            let (lo, hi) = xs.iter().fold((f64::MAX, f64::MIN), |(l, h), x| (l.min(*x), h.max(*x)));
            format!("mean {mean:+.4}, min {lo:+.4}, max {hi:+.4}")
        };
        println!(
            "gap to the request-weighted floor: {}; to the input-weighted floor: {}",
            stats(gaps.iter().map(|g| g.0).collect()),
            stats(gaps.iter().map(|g| g.1).collect())
        );
    }
}

/// The sweep's poison rates: the label and one poison chunk in `every` (never, for 0%).
const SWEEP: [(&str, usize); 4] = [("0%", usize::MAX), ("0.1%", 1_000), ("1%", 100), ("5%", 20)];
const SWEEP_NO_BUDGET: &str = "no budget";
const SWEEP_REQUEST_BUDGET: &str = "request budget";

/// The sweep's table: requests per 1,000 stored chunks and inputs per stored chunk, by poison
/// rate, without a budget (today's isolation, inputs first) and under a request budget, each
/// against the clean run of its own mode.
fn print_sweep(rows: &[Row]) {
    let find = |rate: &str, mode: &str| {
        let label = format!("f. poison sweep {rate}, {mode}");
        rows.iter().find(|r| r.label == label)
    };
    let per_thousand = |r: &Row| 1000.0 * ratio(r.ours.all.requests, r.ours.stored);
    if find("0%", SWEEP_NO_BUDGET).is_none() {
        return;
    }
    println!();
    println!(
        "poison sweep, 10,000 chunks, 4 workers: requests per 1,000 stored (x the clean run), inputs per stored"
    );
    println!(
        "| poison | no budget: requests / 1,000 | x clean | inputs / stored | request budget: requests / 1,000 | x clean | inputs / stored |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for (rate, _) in SWEEP {
        let mut line = format!("| {rate} |");
        for mode in [SWEEP_NO_BUDGET, SWEEP_REQUEST_BUDGET] {
            match (find(rate, mode), find("0%", mode)) {
                (Some(r), Some(clean)) => line.push_str(&format!(
                    " {:.1} | {:.2} | {:.4} |",
                    per_thousand(r),
                    per_thousand(r) / per_thousand(clean),
                    ratio(r.ours.all.inputs, r.ours.stored)
                )),
                _ => line.push_str(" | | |"),
            }
        }
        println!("{line}");
    }
}
