//! Runtime containment, through the real binary where a user would see it: identities the
//! database cannot index, hostile strings in logs, tasks that panic, writers that must not
//! starve each other, and memory bounded by bytes rather than by record count.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use embed_dlq::testkit::mock_provider::{MockConfig, MockProvider};
use tokio::process::Command;

use crate::support::*;

fn ingest_cmd(db: &TestDb, mock: &MockProvider, corpus: &Path) -> Command {
    let mut c = binary();
    c.arg("ingest")
        .arg(corpus)
        .args(["--database-url", &db.url, "--base-url", &mock.base_url(), "--model", "mock"])
        .args(["--batch-max-inputs", "16", "--concurrency", "2", "--request-timeout-ms", "2000"])
        .args(["--retry-base-ms", "5", "--retry-cap-ms", "50", "--no-progress"]);
    c
}

/// A temporary directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        let p = std::env::temp_dir().join(format!(
            "embed-dlq-rt-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }

    fn write(&self, name: &str, data: &[u8]) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, data).unwrap();
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `n` characters that do not compress (a compressible key would fit the index after TOAST).
fn incompressible(n: usize) -> String {
    use rand::RngExt;
    let mut rng = rand::rng();
    (0..n).map(|_| char::from(b"abcdefghijklmnopqrstuvwxyz0123456789"[rng.random_range(0..36)])).collect()
}

fn summary_of(out: &std::process::Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "no JSON summary ({e}); exit {:?}\nstdout: {}\nstderr: {}",
            out.status.code(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_3kb_doc_id_is_rejected_alone_and_its_neighbours_are_stored_on_every_run() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let dir = TempDir::new();
    let mut corpus = String::new();
    for i in 0..5 {
        corpus.push_str(&line("before", i, &format!("good {i}")));
    }
    corpus.push_str(&line(&incompressible(3 * 1024), 0, "a chunk whose id no index can hold"));
    for i in 0..5 {
        corpus.push_str(&line("after", i, &format!("good {i}")));
    }
    let path = dir.write("long-id.jsonl", corpus.as_bytes());

    for run in 0..2 {
        let out = ingest_cmd(&db, &mock, &path).arg("--json").output().await.unwrap();
        let summary = summary_of(&out);
        assert_eq!(out.status.code(), Some(3), "run {run}: {summary}");
        assert_eq!(summary["rejected_lines"], 1, "run {run}: {summary}");
        assert_eq!(summary["rejected_examples"][0]["line"], 6, "{summary}");
        let problem = summary["rejected_examples"][0]["problem"].as_str().unwrap();
        assert!(problem.contains("doc_id") && problem.contains("1024"), "{problem}");
        let done = summary["stored"].as_u64().unwrap() + summary["unchanged"].as_u64().unwrap();
        assert_eq!(done, 10, "run {run}: {summary}");
        assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 10);
        assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0);
        assert_eq!(db.leaks().await, 0);
    }
}

/// A corpus of broken lines must not turn into as many log lines (1M broken lines once gave
/// 156 MB of stderr): the first few of each kind are logged one by one, then a count now and
/// then, then the totals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_lines_are_logged_a_few_then_counted() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let dir = TempDir::new();
    let mut corpus = line("fine", 0, "hello");
    for i in 0..30_000 {
        corpus.push_str(&format!("not json {i}\n"));
    }
    for i in 0..2_500 {
        corpus.push_str(&format!("{}\n", serde_json::json!({"doc_id": "no-text", "chunk_index": i})));
    }
    let path = dir.write("broken.jsonl", corpus.as_bytes());
    let out = ingest_cmd(&db, &mock, &path).output().await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    let lines = stderr.lines().count();
    assert!(
        lines < 100,
        "{lines} lines of log for 32,500 broken lines:\n{}",
        &stderr[..stderr.len().min(4000)]
    );
    let one_by_one = stderr.lines().filter(|l| l.contains("rejected input line (")).count();
    assert_eq!(one_by_one, 20, "the first 20 rejected lines, one by one");
    let invalid = stderr.lines().filter(|l| l.contains("invalid record (")).count();
    assert_eq!(invalid, 20, "the first 20 invalid records, one by one");
    assert!(
        stderr.lines().any(|l| l.contains("rejected input lines in total") && l.contains("30000")),
        "the total of rejected lines: {stderr}"
    );
    assert!(
        stderr.lines().any(|l| l.contains("invalid records in total") && l.contains("2500")),
        "the total of invalid records: {stderr}"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM embedding_dlq WHERE error_class = 'invalid_record'").await,
        2500
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_doc_ids_are_escaped_in_text_logs() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let dir = TempDir::new();
    // Valid JSON whose doc_id holds a newline, a forged log line and ANSI colour codes; no
    // text, so it is parked as an invalid record and its id is logged.
    let hostile = "evil\n2026-01-01T00:00:00Z ERROR forged line\u{1b}[31m red";
    let mut corpus = line("fine", 0, "hello");
    corpus.push_str(&format!("{}\n", serde_json::json!({"doc_id": hostile, "chunk_index": 0})));
    let path = dir.write("hostile.jsonl", corpus.as_bytes());
    let out = ingest_cmd(&db, &mock, &path).env("RUST_LOG", "embed_dlq=debug").output().await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("invalid record"), "the id is logged at all: {stderr}");
    assert!(!stderr.contains('\u{1b}'), "raw escape code in the log: {stderr:?}");
    assert!(
        !stderr.lines().any(|l| l.starts_with("2026-01-01T00:00:00Z ERROR forged")),
        "a doc id forged a log line: {stderr}"
    );
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq WHERE doc_id LIKE 'evil%'").await, 1);
}

/// Polls `sql` until it returns `want`; false if it never does within a generous bound.
async fn eventually(db: &TestDb, sql: &'static str, want: i64) -> bool {
    for _ in 0..300 {
        if db.count(sql).await == want {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickle_of_input_is_written_within_the_linger_by_either_writer() {
    use tokio::io::AsyncWriteExt;
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let mut s = settings(&db, &mock);
    s.options.writers = 2;
    s.options.write_batch_rows = 512;
    s.options.batch_linger = Duration::from_millis(20);
    let pipeline = pipeline(&s).await;
    // A producer we control: one line, then silence until that line's outcome is in the
    // database. An idle writer must not keep the other one from flushing on its linger.
    let (mut producer, consumer) = tokio::io::duplex(64 * 1024);
    let run = tokio::spawn(async move {
        pipeline.run(tokio::io::BufReader::new(consumer), tokio_util::sync::CancellationToken::new()).await
    });
    for i in 0..4 {
        producer.write_all(line("trickle", i, &format!("slow {i}")).as_bytes()).await.unwrap();
        producer.flush().await.unwrap();
        assert!(
            eventually(&db, "SELECT count(*) FROM doc_embeddings", i64::from(i) + 1).await,
            "line {i} was embedded but its vector was never written while the producer paused"
        );
    }
    drop(producer);
    let summary = tokio::time::timeout(Duration::from_secs(60), run).await.unwrap().unwrap().unwrap();
    assert_eq!(summary.stored, 4);
    assert_eq!(db.leaks().await, 0);
}

/// Numbers like "of 300 records, 12 stored, 0 unchanged, 0 already in the DLQ, 0 parked,
/// 288 not attempted" from a stopped run's error message.
fn accounting(stderr: &str) -> [u64; 7] {
    let rest = &stderr[stderr.find("of ").unwrap_or_else(|| panic!("no accounting in: {stderr}")) + 3..];
    let numbers: Vec<u64> = rest
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .take(7)
        .map(|s| s.parse().unwrap())
        .collect();
    numbers.try_into().unwrap_or_else(|n| panic!("accounting {n:?} in: {stderr}"))
}

/// A task of the run panics (a failpoint): the run stops with a non-zero exit and a clear
/// error that accounts for every record; a rerun then finishes the corpus exactly once.
async fn panic_in_a_task_then_rerun(failpoint: &str, task: &str) {
    const CHUNKS: u64 = 400;
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig { latency_ms: 10, ..MockConfig::default() }).await;
    let dir = TempDir::new();
    let mut corpus = String::new();
    for i in 0..CHUNKS as i32 {
        corpus.push_str(&line("supervised", i, &format!("chunk {i}")));
    }
    let path = dir.write("c.jsonl", corpus.as_bytes());

    let out = ingest_cmd(&db, &mock, &path).env("EMBED_DLQ_FAILPOINT", failpoint).output().await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "a panicked task fails the run: {stderr}");
    let error =
        stderr.lines().find(|l| l.starts_with("embed-dlq: error:")).unwrap_or_else(|| panic!("{stderr}"));
    assert!(error.contains(task) && error.contains("panicked"), "{error}");
    let [records, stored, unchanged, in_dlq, parked, superseded, not_attempted] = accounting(error);
    assert!(records <= CHUNKS && records > 0, "{error}");
    assert_eq!(
        stored + unchanged + in_dlq + parked + superseded + not_attempted,
        records,
        "every record accounted for: {error}"
    );
    assert!(not_attempted > 0, "{error}");
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await as u64, stored, "{error}");
    assert_eq!(db.leaks().await, 0);
    assert_eq!(db.manifest_disagreements().await, 0);

    let inputs_before = mock.control.stats().inputs;
    let out = ingest_cmd(&db, &mock, &path).arg("--json").output().await.unwrap();
    let summary = summary_of(&out);
    assert_eq!(out.status.code(), Some(0), "{summary}");
    assert_eq!(summary["unchanged"].as_u64(), Some(stored), "{summary}");
    assert_eq!(summary["stored"].as_u64(), Some(CHUNKS - stored), "{summary}");
    assert_eq!(
        mock.control.stats().inputs - inputs_before,
        CHUNKS - stored,
        "each missing chunk embedded once"
    );
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await as u64, CHUNKS);
    assert_eq!(db.leaks().await, 0);
    assert_corpus_accounted(&db, &corpus_keys(corpus.as_bytes())).await;
    assert_eq!(db.manifest_disagreements().await, 0);
}

#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints (scripts/test.sh)")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_worker_stops_the_run_visibly_and_a_rerun_completes_exactly_once() {
    panic_in_a_task_then_rerun("ingest_worker=panic@5", "ingest worker").await;
}

#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints (scripts/test.sh)")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_writer_stops_the_run_visibly_and_a_rerun_completes_exactly_once() {
    panic_in_a_task_then_rerun("ingest_writer=panic@2", "ingest writer").await;
}

/// Runs `cmd` to its end and returns its exit status and its peak resident memory (VmHWM,
/// polled from /proc while it runs; the high-water mark only grows, so the last reading
/// before exit holds the peak). Not `ru_maxrss` from wait4: Linux folds the spawning
/// process's own high-water mark into it at exec, and the test process is large.
fn run_and_measure(mut cmd: std::process::Command) -> (std::process::ExitStatus, u64) {
    let mut child = cmd.spawn().unwrap();
    let status_file = format!("/proc/{}/status", child.id());
    let mut peak_kb = 0u64;
    loop {
        let hwm = std::fs::read_to_string(&status_file).ok().and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("VmHWM:").and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            })
        });
        // No VmHWM once the process has exited (a zombie has no memory left).
        let Some(kb) = hwm else { break };
        peak_kb = peak_kb.max(kb);
        std::thread::sleep(Duration::from_millis(5));
    }
    let status = child.wait().unwrap();
    assert!(peak_kb > 0, "the child's memory was never sampled");
    (status, peak_kb * 1024)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lines_of_megabytes_of_metadata_stay_within_the_byte_budget() {
    use std::io::Write;
    const LINES: usize = 20;
    const METADATA: usize = 8_000_000;
    let db = TestDb::new().await;
    // A slow provider: the reader runs far ahead of the workers, so without a bound by bytes
    // every record read piles up in memory (20 x 8 MB here, which took 200 MB before).
    let mock = start_mock(MockConfig { latency_ms: 1000, ..MockConfig::default() }).await;
    let dir = TempDir::new();
    let path = dir.0.join("big.jsonl");
    {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
        let blob = "m".repeat(METADATA);
        for i in 0..LINES {
            writeln!(
                f,
                "{}",
                serde_json::json!({"doc_id": "big", "chunk_index": i, "text": format!("chunk {i}"),
                    "metadata": {"blob": blob, "n": i}})
            )
            .unwrap();
        }
    }
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_embed-dlq"));
    cmd.env_remove("EMBED_DLQ_API_KEY")
        .env_remove("RUST_LOG")
        .env_remove("EMBED_DLQ_FAILPOINT")
        .arg("ingest")
        .arg(&path)
        .args(["--database-url", &db.url, "--base-url", &mock.base_url(), "--model", "mock"])
        .args(["--concurrency", "4", "--request-timeout-ms", "10000", "--no-progress"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let (status, peak) = tokio::task::spawn_blocking(move || run_and_measure(cmd)).await.unwrap();
    assert_eq!(status.code(), Some(0));
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, LINES as i64);
    // The default budget (64 MiB) plus the line being read and parsed, plus the process
    // itself (about 95 MiB measured); all 20 records at once are 160 MB of metadata alone.
    let bound = 144 * 1024 * 1024;
    assert!(peak < bound, "peak RSS {} MiB exceeds {} MiB", peak >> 20, bound >> 20);
}

fn serve_cmd(db: &TestDb, mock: &MockProvider, prefix: &str) -> Command {
    let mut c = binary();
    c.arg("serve")
        .args(["--database-url", &db.url, "--redis-url", &redis_url(), "--base-url", &mock.base_url()])
        .args(["--model", "mock", "--stream-prefix", prefix, "--replayers", "2", "--replay-batch", "8"])
        .args(["--min-idle-ms", "1000", "--relay-poll-ms", "100", "--grace-ms", "2000"])
        .args(["--retry-base-ms", "5", "--retry-cap-ms", "50"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c
}

#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints (scripts/test.sh)")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_exits_non_zero_when_a_replayer_panics_and_a_restart_drains_the_dlq() {
    let db = TestDb::new().await;
    // Park 40 chunks during an outage and make them due at once.
    let down = start_mock(MockConfig::default()).await;
    down.control.set_outage(true);
    let mut s = settings(&db, &down);
    s.retry.max_attempts = 1;
    let mut corpus = String::new();
    for i in 0..40 {
        corpus.push_str(&line("serve-panic", i, &format!("chunk {i}")));
    }
    let keys = corpus_keys(corpus.as_bytes());
    pipeline(&s)
        .await
        .run(input(corpus.into_bytes()), tokio_util::sync::CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 40);
    sqlx::query("UPDATE embedding_dlq SET next_retry_at = now()").execute(&db.pool).await.unwrap();

    let up = start_mock(MockConfig::default()).await;
    let prefix = format!("it-rt-{}-{}", std::process::id(), rand::random::<u32>());
    let child = serve_cmd(&db, &up, &prefix)
        .env("EMBED_DLQ_FAILPOINT", "replay_before_commit=panic")
        .spawn()
        .unwrap();
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .expect("serve must not keep running with a dead replayer")
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let error =
        stderr.lines().find(|l| l.starts_with("embed-dlq: error:")).unwrap_or_else(|| panic!("{stderr}"));
    assert!(error.contains("replayer") && error.contains("panicked"), "{error}");
    assert!(error.contains("failpoint replay_before_commit reached"), "{error}");
    assert_eq!(db.leaks().await, 0);

    // Restarted (as a process supervisor would), serve takes over what the dead replayer
    // held and drains the DLQ.
    let mut child = serve_cmd(&db, &up, &prefix).stderr(Stdio::null()).spawn().unwrap();
    assert!(
        eventually(&db, "SELECT count(*) FROM embedding_dlq", 0).await,
        "the DLQ drains after the restart"
    );
    assert!(child.try_wait().unwrap().is_none(), "the restarted serve keeps running");
    let pid = child.id().unwrap().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait()).await.unwrap().unwrap();
    assert_eq!(status.code(), Some(0));
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 40);
    assert_corpus_accounted(&db, &keys).await;
    assert_eq!(db.manifest_disagreements().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bom_is_skipped_and_broken_utf8_ids_are_rejected_not_merged() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let s = settings(&db, &mock);
    let mut corpus = b"\xef\xbb\xbf".to_vec();
    corpus.extend_from_slice(line("bom", 0, "first line after the mark").as_bytes());
    corpus.extend_from_slice(b"{\"doc_id\":\"id-\xff\",\"chunk_index\":0,\"text\":\"one\"}\n");
    corpus.extend_from_slice(b"{\"doc_id\":\"id-\xfe\",\"chunk_index\":0,\"text\":\"two\"}\n");
    corpus.extend_from_slice(b"{\"doc_id\":\"ok\",\"chunk_index\":0,\"text\":\"caf\xe9\"}\n");
    let summary =
        pipeline(&s).await.run(input(corpus), tokio_util::sync::CancellationToken::new()).await.unwrap();
    assert_eq!(summary.stored, 1, "{summary:?}");
    assert_eq!(summary.rejected_lines, 2, "{summary:?}");
    let lines: Vec<u64> = summary.rejected_examples.iter().map(|r| r.line).collect();
    assert_eq!(lines, vec![2, 3]);
    // Broken text under a readable id is still parked, under that id.
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 1);
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq WHERE doc_id = 'ok'").await, 1);
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings WHERE doc_id = 'bom'").await, 1);
}
