//! `demo`: the end-to-end demo. It starts the fault-injecting provider in-process, writes a
//! corpus with poison inputs and broken lines, ingests it with a progress bar, ingests it
//! again to show that an identical rerun makes no provider call, drains an outage through
//! `serve`, and checks the seed's leak and duplicate queries.

use std::io::Write;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use embed_dlq::config::{IngestArgs, IngestSettings, ProviderArgs, RetryArgs, ServiceArgs};
use embed_dlq::dlq::{self, Filter};
use embed_dlq::embed::retry::DlqSchedule;
use embed_dlq::testkit::corpus::{CorpusSpec, demo_faults, write_corpus};
use embed_dlq::testkit::mock_provider::MockProvider;
use tokio_util::sync::CancellationToken;

use super::args::DemoCommand;
use super::render::{count, print_summary, write_human_summary, write_report};
use super::{Resolver, exit};

/// Runs `demo` on the configured services; returns the exit code.
pub async fn command(resolver: &Resolver, args: DemoCommand, cancel: CancellationToken) -> i32 {
    let DemoCommand { chunks, concurrency, json, stream_prefix, setup_hint } = args;
    let flags = embed_dlq::config::FileConfig {
        serve: embed_dlq::config::ServeArgs { stream_prefix, ..Default::default() },
        ..Default::default()
    };
    let urls = resolver
        .settings(flags)
        .and_then(|s| Ok((s.database_url()?.to_string(), s.redis_client()?, s.stream_keys())));
    let (url, redis, keys) = match urls {
        Ok(u) => u,
        Err(e) => return exit::fail(exit::USAGE, &format!("{e} (or run scripts/demo.sh)")),
    };
    // The demo relays under the configured prefix (`embed-dlq` unless told otherwise), so the
    // commands it shows next see its streams; a database relayed under another one is refused
    // up front with `serve`'s message, before anything is ingested.
    match embed_dlq::store::connect(&url, 1).await {
        Ok(pool) => {
            let checked = super::refuse_other_prefix(&pool, keys.prefix()).await;
            pool.close().await;
            if let Err(code) = checked {
                return code;
            }
        }
        Err(e) => return exit::fail(exit::FAILURE, &e.to_string()),
    }
    let code = match run(&url, &redis, &keys, chunks as usize, concurrency as usize, json, cancel).await {
        Ok(code) => code,
        Err(e) => exit::fail(exit::FAILURE, &format!("{e:#}")),
    };
    if code == exit::OK && !json {
        print_next(setup_hint.as_deref(), keys.prefix());
    }
    code
}

/// The commands to try next, copy-pasteable into a fresh shell: the line that sets the
/// services' environment (`scripts/demo.sh` passes it as `--setup-hint`), the stream prefix
/// when it is not the default, and the binary as it was invoked.
fn print_next(setup_hint: Option<&str>, prefix: &str) {
    let bin = std::env::args().next().unwrap_or_else(|| "embed-dlq".into());
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "\n== next ==");
    let _ = writeln!(out, "In a fresh shell, from the same directory:");
    match setup_hint {
        Some(h) => {
            let _ = writeln!(out, "  {h}");
        }
        None => {
            let _ = writeln!(out, "  # with DATABASE_URL and REDIS_URL set as for this demo");
        }
    }
    if prefix != embed_dlq::config::DEFAULT_STREAM_PREFIX {
        let _ = writeln!(out, "  export EMBED_DLQ_STREAM_PREFIX={prefix}");
    }
    for (args, what) in [
        ("dlq stats", "the parked rows by error class"),
        ("dlq list --limit 5", "the oldest parked rows (then: dlq show ID)"),
        ("reconcile", "manifest, vectors, DLQ, outbox and streams agree: exit 0"),
        ("tail --from 0 --count 10", "the first events on the stream"),
        ("console", "the console on http://127.0.0.1:8088 (Ctrl-C stops it)"),
        ("serve", "relay and replay, as in pass 3 (Ctrl-C stops it)"),
    ] {
        let _ = writeln!(out, "  {bin} {args:<26} # {what}");
    }
}

/// Longest input of the demo ingest: the corpus generator and the settings agree on it.
const DEMO_MAX_INPUT_CHARS: usize = 8_000;

/// Runs the demo against `database_url`; returns the exit code.
async fn run(
    database_url: &str,
    redis: &embed_dlq::streams::RedisClient,
    keys: &embed_dlq::streams::StreamKeys,
    chunks: usize,
    concurrency: usize,
    json: bool,
    cancel: CancellationToken,
) -> anyhow::Result<i32> {
    let mock = MockProvider::start(demo_faults(), SocketAddr::from(([127, 0, 0, 1], 0)), cancel.clone())
        .await
        .context("starting the mock provider")?;
    eprintln!("mock provider on {} with faults: 5% 429, 8% 5xx, 0.5% timeouts, 2% resets", mock.base_url());
    let run_id = chrono::Utc::now().format("%Y%m%dT%H%M%S").to_string();
    let dir = std::env::temp_dir().join(format!("embed-dlq-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let corpus = dir.join("corpus.jsonl");
    write_demo_corpus(&corpus, &run_id, chunks)?;

    let mut pipeline = demo_settings(database_url, &mock, concurrency)?.pipeline().await?;
    use std::io::IsTerminal;
    pipeline.options.progress = !json && std::io::stderr().is_terminal();
    pipeline.options.total_bytes = std::fs::metadata(&corpus).ok().map(|m| m.len());
    let Some((first, calls_second)) = ingest_twice(&pipeline, &mock, &corpus, json, &cancel).await? else {
        return Ok(exit::INTERRUPTED);
    };
    let (leaks, duplicates) = seed_checks(&pipeline.store).await?;
    let limits_held = limits_pass(database_url, &run_id, concurrency, json, &cancel).await?;
    if !json {
        println!("\n== pass 3: provider outage, then replay drains the DLQ ==");
    }
    let drained =
        outage_and_drain(&pipeline, &mock, (redis, keys), &run_id, chunks.min(2_000), json, cancel.clone())
            .await?;
    let (more_leaks, more_duplicates) = seed_checks(&pipeline.store).await?;
    let (leaks, duplicates) = (leaks + more_leaks, duplicates + more_duplicates);
    let report = reconcile(&pipeline, redis, keys).await?;
    if !json {
        print_checks(&report, leaks, duplicates, &mock.control.stats())?;
    }
    mock.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
    let accounted =
        first.stored + first.parked_total() + first.unchanged + first.already_parked + first.superseded;
    let reconciled = report.get(embed_dlq::reconcile::Check::Leaks).found == 0
        && report.get(embed_dlq::reconcile::Check::Duplicates).found == 0;
    let ok = leaks == 0
        && duplicates == 0
        && calls_second == 0
        && accounted == first.records
        && drained
        && reconciled
        && limits_held;
    if !ok {
        eprintln!(
            "embed-dlq: demo checks FAILED (leaks {leaks}, duplicates {duplicates}, pass-2 calls {calls_second}, accounted {accounted}/{})",
            first.records
        );
        return Ok(exit::FAILURE);
    }
    Ok(exit::OK)
}

/// Writes the demo corpus (poison inputs every 200 chunks, broken lines) to `path`.
fn write_demo_corpus(path: &std::path::Path, run_id: &str, chunks: usize) -> anyhow::Result<()> {
    let spec = CorpusSpec {
        doc_prefix: format!("demo-{run_id}"),
        chunks,
        poison_every: 200,
        broken_lines: true,
        ..CorpusSpec::default()
    };
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    let facts = write_corpus(&mut f, &spec, DEMO_MAX_INPUT_CHARS)?;
    f.flush()?;
    eprintln!(
        "corpus {}: {chunks} chunks ({} poison inputs, {} broken lines)",
        path.display(),
        chunks - facts.clean,
        facts.invalid_records + facts.rejected_lines
    );
    Ok(())
}

/// The demo's ingest settings: the in-process mock, short timeouts and retries (so the faults
/// show within seconds), validated like the command line.
fn demo_settings(
    database_url: &str,
    mock: &MockProvider,
    concurrency: usize,
) -> anyhow::Result<IngestSettings> {
    IngestSettings::resolve(
        ServiceArgs { database_url: Some(database_url.to_string()), redis_url: None, ..Default::default() },
        ProviderArgs {
            base_url: Some(mock.base_url()),
            model: Some("mock-embed-768".into()),
            request_timeout_ms: Some(1_000),
            ..Default::default()
        },
        IngestArgs {
            concurrency: Some(concurrency),
            max_input_chars: Some(DEMO_MAX_INPUT_CHARS),
            ..Default::default()
        },
        RetryArgs {
            retry_max_attempts: Some(4),
            retry_base_ms: Some(50),
            retry_cap_ms: Some(1_000),
            ..Default::default()
        },
        None,
    )
    .map_err(anyhow::Error::msg)
}

/// Passes 1 and 2: ingests the corpus with faults, then again. Returns the first summary and
/// the provider calls of the second pass (there must be none), or `None` when interrupted.
async fn ingest_twice(
    pipeline: &embed_dlq::ingest::Pipeline,
    mock: &MockProvider,
    corpus: &std::path::Path,
    json: bool,
    cancel: &CancellationToken,
) -> anyhow::Result<Option<(embed_dlq::ingest::IngestSummary, u64)>> {
    if !json {
        println!("== pass 1: ingest with faults ==");
    }
    let first = open_and_run(pipeline, corpus, cancel.clone()).await?;
    print_summary(&first, json);
    if cancel.is_cancelled() {
        return Ok(None);
    }
    if !json {
        println!("\n== pass 2: the same corpus again (must make no provider call) ==");
    }
    let calls_before = mock.control.stats().requests;
    let second = open_and_run(pipeline, corpus, cancel.clone()).await?;
    let calls_second = mock.control.stats().requests - calls_before;
    if json {
        print_summary(&second, true);
    } else {
        let mut out = std::io::stdout().lock();
        write_human_summary(&mut out, &second)?;
        writeln!(out, "provider requests seen by the mock in pass 2: {calls_second}")?;
    }
    Ok(Some((first, calls_second)))
}

/// The mock account of the limits pass: requests a minute, two seconds' worth at once.
const DEMO_ACCOUNT_RPM: u32 = 1_200;

/// Pass 2b: a small corpus against a mock account that enforces a request limit, with the
/// same budget on our side (`max_requests_per_minute`): the limiter holds requests back
/// and the provider never answers 429. Returns whether it did.
async fn limits_pass(
    database_url: &str,
    run_id: &str,
    concurrency: usize,
    json: bool,
    cancel: &CancellationToken,
) -> anyhow::Result<bool> {
    use embed_dlq::testkit::mock_provider::MockConfig;
    let account = MockConfig {
        rpm_limit: Some(u64::from(DEMO_ACCOUNT_RPM)),
        limit_window_ms: 2_000,
        ..MockConfig::default()
    };
    // Its own child token: shutting this mock down must not cancel the rest of the demo.
    let mock = MockProvider::start(account, SocketAddr::from(([127, 0, 0, 1], 0)), cancel.child_token())
        .await
        .context("starting the rate-limited mock provider")?;
    let mut settings = demo_settings(database_url, &mock, concurrency)?;
    settings.limits.max_requests_per_minute = Some(DEMO_ACCOUNT_RPM);
    settings.options.batch_max_inputs = 8;
    let mut pipeline = settings.pipeline().await?;
    pipeline.options.progress = false;
    let spec =
        CorpusSpec { doc_prefix: format!("demo-{run_id}-limits"), chunks: 480, ..CorpusSpec::default() };
    let mut corpus = Vec::new();
    write_corpus(&mut corpus, &spec, DEMO_MAX_INPUT_CHARS)?;
    pipeline.run(std::io::Cursor::new(corpus), cancel.clone()).await.map_err(|e| anyhow::anyhow!("{e}"))?;
    let served = mock.control.stats();
    let limiter = pipeline.embedder.client.limiter().stats();
    mock.shutdown().await;
    if !json {
        println!("\n== pass 2b: provider limits (--max-requests-per-minute {DEMO_ACCOUNT_RPM}) ==");
        println!(
            "limiter: {} requests to an account of {DEMO_ACCOUNT_RPM}/min, {} answered 429; the budget held {} back ({:.1}s of waiting summed over them)",
            served.requests,
            served.over_limit,
            limiter.delayed_requests,
            limiter.waited.as_secs_f64()
        );
    }
    Ok(served.over_limit == 0 || cancel.is_cancelled())
}

/// The seed's leak and duplicate counts over the demo's table (both must be zero).
async fn seed_checks(store: &embed_dlq::store::Store) -> anyhow::Result<(i64, i64)> {
    let table = Some(store.table_name());
    let leaks = embed_dlq::reconcile::sql::leaks(store.pool(), table).await?;
    let duplicates = embed_dlq::reconcile::sql::duplicates(store.pool(), table).await?;
    Ok((leaks, duplicates))
}

/// One reconciler run (check only) over the demo's table and streams.
async fn reconcile(
    pipeline: &embed_dlq::ingest::Pipeline,
    redis: &embed_dlq::streams::RedisClient,
    keys: &embed_dlq::streams::StreamKeys,
) -> anyhow::Result<embed_dlq::reconcile::Report> {
    let mut reconciler = embed_dlq::reconcile::Reconciler {
        store: pipeline.store.clone(),
        redis: Some(redis.managed().await?),
        keys: keys.clone(),
        config: Default::default(),
    };
    Ok(reconciler.run_once(embed_dlq::reconcile::Mode::Check).await?)
}

/// Prints the reconcile report, the seed's checks and what the mock served.
fn print_checks(
    report: &embed_dlq::reconcile::Report,
    leaks: i64,
    duplicates: i64,
    stats: &embed_dlq::testkit::mock_provider::MockStats,
) -> anyhow::Result<()> {
    println!("\n== reconcile ==");
    write_report(&mut std::io::stdout().lock(), report)?;
    println!("\n== checks ==");
    println!("leaks (manifest rows with neither vector nor DLQ row): {leaks}");
    println!("duplicate vectors by (doc_id, chunk_index):            {duplicates}");
    println!(
        "mock provider served {} requests: {} ok, {} rate-limited, {} 5xx, {} timeouts, {} resets, {} rejected",
        stats.requests,
        stats.ok,
        stats.rate_limited,
        stats.server_errors,
        stats.timeouts,
        stats.resets,
        stats.rejected
    );
    Ok(())
}

/// Pass 3: the provider answers 503 while a corpus is ingested (its chunks park as
/// transient), the outage ends, `serve` relays the parks to Redis and its replayers drain the
/// DLQ. Returns whether the DLQ of this pass drained to zero.
async fn outage_and_drain(
    pipeline: &embed_dlq::ingest::Pipeline,
    mock: &MockProvider,
    (redis, keys): (&embed_dlq::streams::RedisClient, &embed_dlq::streams::StreamKeys),
    run_id: &str,
    chunks: usize,
    json: bool,
    cancel: CancellationToken,
) -> anyhow::Result<bool> {
    let prefix = format!("demo-{run_id}-outage");
    let schedule = DlqSchedule { base: Duration::from_secs(1), ..pipeline.options.dlq_schedule };
    let provider_calls = ingest_during_outage(pipeline, mock, &prefix, chunks, schedule, &cancel).await?;
    let this_pass = Filter { doc_prefix: Some(format!("{prefix}-")), ..Filter::default() };
    let parked_now = dlq::count(&pipeline.store, &this_pass).await?;
    if !json {
        println!(
            "outage: {} parked as transient ({} answered 503); the outage ends now",
            count(parked_now, "chunk", "chunks"),
            count(provider_calls, "provider call", "provider calls")
        );
        println!("serve: relay + scheduler + 2 replayers (DLQ schedule base 1s)");
    }
    let serve_cancel = cancel.child_token();
    let serve = tokio::spawn(embed_dlq::serve::serve(
        pipeline.store.clone(),
        pipeline.embedder.clone(),
        redis.clone(),
        demo_serve_config(keys.clone(), schedule),
        serve_cancel.clone(),
    ));
    let started = std::time::Instant::now();
    let mut left = parked_now;
    while left > 0 && started.elapsed() < Duration::from_secs(120) && !cancel.is_cancelled() {
        tokio::time::sleep(Duration::from_millis(500)).await;
        left = dlq::count(&pipeline.store, &this_pass).await?;
        if !json {
            println!("  DLQ rows of this pass: {left:>6}  ({:.1}s)", started.elapsed().as_secs_f64());
        }
    }
    serve_cancel.cancel();
    serve.await?.map_err(anyhow::Error::msg)?;
    let mut conn = redis.managed().await?;
    let events: u64 = redis::cmd("XLEN").arg(keys.events()).query_async(&mut conn).await?;
    if !json {
        println!(
            "drained {} in {:.1}s; {} on {}",
            count(parked_now - left, "parked chunk", "parked chunks"),
            started.elapsed().as_secs_f64(),
            count(events, "event", "events"),
            keys.events(),
        );
    }
    // An outage pass that parked nothing showed nothing: that is a failure of the demo too.
    Ok(left == 0 && (parked_now > 0 || cancel.is_cancelled()))
}

/// Ingests a fresh corpus under `prefix` while the mock answers 503: two attempts per
/// request and a breaker that never opens, so every chunk parks as transient on `schedule`.
/// Returns the provider calls made.
async fn ingest_during_outage(
    pipeline: &embed_dlq::ingest::Pipeline,
    mock: &MockProvider,
    prefix: &str,
    chunks: usize,
    schedule: DlqSchedule,
    cancel: &CancellationToken,
) -> anyhow::Result<u64> {
    let mut corpus = Vec::new();
    write_corpus(
        &mut corpus,
        &CorpusSpec { doc_prefix: prefix.to_string(), chunks, ..CorpusSpec::default() },
        100_000,
    )?;
    let mut outage = pipeline.clone();
    outage.options.progress = false;
    outage.options.dlq_schedule = schedule;
    outage.embedder.policy.max_attempts = 2;
    outage.embedder.gate = std::sync::Arc::new(embed_dlq::embed::gate::ProviderGate::new(
        embed_dlq::embed::gate::BreakerConfig { failure_threshold: 1_000_000, ..Default::default() },
    ));
    mock.control.set_outage(true);
    let parked =
        outage.run(std::io::Cursor::new(corpus), cancel.clone()).await.map_err(|e| anyhow::anyhow!("{e}"))?;
    mock.control.set_outage(false);
    Ok(parked.provider_calls)
}

/// `serve` as the demo runs it: two replayers on `schedule`, a fast relay poll, a short grace.
fn demo_serve_config(
    keys: embed_dlq::streams::StreamKeys,
    schedule: DlqSchedule,
) -> embed_dlq::serve::ServeConfig {
    embed_dlq::serve::ServeConfig {
        replayers: 2,
        relay: embed_dlq::relay::RelayConfig { poll: Duration::from_millis(200), ..Default::default() },
        replay: embed_dlq::replay::ReplayConfig {
            schedule,
            block: Duration::from_millis(500),
            ..Default::default()
        },
        keys,
        grace: Duration::from_secs(5),
        consumer_prefix: format!("demo-{}", std::process::id()),
        reconcile_every: None,
        reconcile_sweeps: Default::default(),
        metrics: false,
        source: None,
        source_ingest: Default::default(),
        table_followers: Vec::new(),
    }
}

async fn open_and_run(
    pipeline: &embed_dlq::ingest::Pipeline,
    path: &std::path::Path,
    cancel: CancellationToken,
) -> anyhow::Result<embed_dlq::ingest::IngestSummary> {
    let f = tokio::fs::File::open(path).await?;
    let reader = tokio::io::BufReader::with_capacity(256 * 1024, f);
    let summary = pipeline.run(reader, cancel).await.map_err(|e| anyhow::anyhow!("{e}"))?;
    // Leave the stream of logs a moment to flush before the summary.
    tokio::time::sleep(Duration::from_millis(10)).await;
    Ok(summary)
}
