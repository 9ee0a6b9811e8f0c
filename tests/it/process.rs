//! The real binary as a user runs it: signals, crashes, exit codes, and secrets in output.

use std::process::Stdio;
use std::time::Duration;

use embed_dlq::testkit::corpus::{CorpusSpec, write_corpus};
use embed_dlq::testkit::mock_provider::{self, MockConfig, MockProvider};
use tokio::process::{Child, Command};

use crate::support::*;

fn binary() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_embed-dlq"));
    c.env_remove("EMBED_DLQ_API_KEY").env_remove("RUST_LOG").stdin(Stdio::null());
    c
}

fn ingest_cmd(db: &TestDb, mock: &MockProvider, corpus: &std::path::Path) -> Command {
    let mut c = binary();
    c.arg("ingest")
        .arg(corpus)
        .args(["--database-url", &db.url, "--base-url", &mock.base_url(), "--model", "mock"])
        .args(["--batch-max-inputs", "16", "--concurrency", "2", "--request-timeout-ms", "2000"])
        .args(["--retry-base-ms", "5", "--retry-cap-ms", "50", "--no-progress"]);
    c
}

fn write_temp_corpus(spec: &CorpusSpec) -> (tempdir::Dir, std::path::PathBuf) {
    let dir = tempdir::Dir::new();
    let path = dir.0.join("corpus.jsonl");
    let mut f = std::fs::File::create(&path).unwrap();
    write_corpus(&mut f, spec, 32_000).unwrap();
    (dir, path)
}

mod tempdir {
    /// A temporary directory removed on drop.
    pub struct Dir(pub std::path::PathBuf);
    impl Dir {
        pub fn new() -> Dir {
            let p = std::env::temp_dir().join(format!(
                "embed-dlq-it-{}-{}",
                std::process::id(),
                rand::random::<u64>()
            ));
            std::fs::create_dir_all(&p).unwrap();
            Dir(p)
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

async fn wait_for_vectors(db: &TestDb, at_least: i64, child: &mut Child) {
    for _ in 0..600 {
        if db.count("SELECT count(*) FROM doc_embeddings").await >= at_least {
            return;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("ingest exited early with {status}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("ingest made no progress");
}

fn signal(child: &Child, sig: &str) {
    let pid = child.id().expect("child running").to_string();
    let status = std::process::Command::new("kill").args([sig, &pid]).status().unwrap();
    assert!(status.success());
}

/// Interrupts (SIGTERM) or crashes (SIGKILL) an ingest in the middle, checks that what was
/// written is consistent, then reruns to completion and checks that nothing was lost,
/// duplicated or embedded twice.
async fn interrupt_then_rerun(sig: &str) {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig { latency_ms: 15, ..MockConfig::default() }).await;
    let spec = CorpusSpec { chunks: 3_000, poison_every: 100, ..CorpusSpec::default() };
    let (_dir, path) = write_temp_corpus(&spec);
    let mut child =
        ingest_cmd(&db, &mock, &path).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    wait_for_vectors(&db, 300, &mut child).await;
    signal(&child, sig);
    let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .expect("ingest exits promptly after the signal")
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if sig == "-TERM" {
        assert_eq!(out.status.code(), Some(130), "graceful stop exit code; stderr: {stderr}");
        assert!(stderr.contains("shutdown requested"), "{stderr}");
    }
    assert_eq!(db.leaks().await, 0);
    assert_eq!(db.manifest_disagreements().await, 0);
    let done_before = db.count("SELECT count(*) FROM ingest_manifest").await;
    assert!(done_before > 0 && done_before < 3_000, "interrupted in the middle: {done_before}");

    let inputs_before = mock.control.stats().inputs;
    let rerun = ingest_cmd(&db, &mock, &path).arg("--json").output().await.unwrap();
    assert_eq!(rerun.status.code(), Some(0), "{}", String::from_utf8_lossy(&rerun.stderr));
    let summary: serde_json::Value = serde_json::from_slice(&rerun.stdout).unwrap();
    assert_eq!(
        summary["unchanged"].as_i64().unwrap() + summary["already_parked"].as_i64().unwrap(),
        done_before,
        "finished chunks are not embedded again: {summary}"
    );
    let embedded_again = mock.control.stats().inputs - inputs_before;
    assert!(
        embedded_again <= (3_000 - done_before) as u64 + 200,
        "rerun embedded {embedded_again} inputs for {} missing chunks",
        3_000 - done_before
    );
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest").await, 3_000);
    assert_eq!(db.leaks().await, 0);
    assert_corpus_accounted(&db, &corpus_keys(&std::fs::read(&path).unwrap())).await;
    assert_eq!(db.manifest_disagreements().await, 0);
    let stored = db.count("SELECT count(*) FROM doc_embeddings").await;
    let parked = db.count("SELECT count(*) FROM embedding_dlq").await;
    assert_eq!(stored + parked, 3_000);
    assert_eq!(db.count("SELECT count(*) FROM dlq_outbox WHERE event = 'parked'").await, parked);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_mid_ingest_then_rerun_completes_exactly_once() {
    interrupt_then_rerun("-TERM").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_ingest_then_rerun_completes_exactly_once() {
    interrupt_then_rerun("-KILL").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_key_never_appears_in_output_rows_or_events() {
    const KEY: &str = "sk-test-5ecret-Key-0f-the-t3st";
    let db = TestDb::new().await;
    // A leaky provider that echoes the Authorization header in its error bodies.
    let mock = start_mock(MockConfig {
        api_key: Some(KEY.into()),
        echo_auth_in_errors: true,
        rate_5xx: 0.5,
        seed: 11,
        ..MockConfig::default()
    })
    .await;
    let mut corpus = String::new();
    for i in 0..100 {
        let text =
            if i % 10 == 0 { format!("p {}", mock_provider::POISON_400) } else { format!("chunk {i}") };
        corpus.push_str(&line("secret", i, &text));
    }
    let dir = tempdir::Dir::new();
    let path = dir.0.join("c.jsonl");
    std::fs::write(&path, corpus).unwrap();
    let out = ingest_cmd(&db, &mock, &path)
        .env("EMBED_DLQ_API_KEY", KEY)
        .env("RUST_LOG", "trace")
        .args(["--retry-max-attempts", "2"])
        .output()
        .await
        .unwrap();
    let all = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{all}");
    assert!(mock.control.stats().server_errors > 0 && mock.control.stats().rejected > 0);
    assert!(!all.contains(KEY), "key leaked into output");
    assert!(!all.contains("5ecret"), "part of the key leaked into output");
    let leaked_rows = db
        .count(
            "SELECT (SELECT count(*) FROM embedding_dlq
                      WHERE last_error LIKE '%5ecret%' OR payload::text LIKE '%5ecret%')
                  + (SELECT count(*) FROM dlq_outbox WHERE body::text LIKE '%5ecret%')",
        )
        .await;
    assert_eq!(leaked_rows, 0);
    assert!(
        db.count("SELECT count(*) FROM embedding_dlq WHERE last_error LIKE '%[redacted]%'").await > 0,
        "the echo was there and was redacted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_codes_and_clear_errors() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig { api_key: Some("k".repeat(8)), ..MockConfig::default() }).await;
    let dir = tempdir::Dir::new();
    let path = dir.0.join("c.jsonl");
    std::fs::write(&path, format!("{}not json\n", line("e", 0, "hello"))).unwrap();

    // Wrong key: stops with 4 and says why.
    let out = ingest_cmd(&db, &mock, &path).env("EMBED_DLQ_API_KEY", "nope-nope").output().await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    assert!(stderr.contains("unauthorized") && stderr.contains("401"), "{stderr}");

    // Right key, one rejected line: finishes with 3 and names the line.
    let out = ingest_cmd(&db, &mock, &path).env("EMBED_DLQ_API_KEY", "k".repeat(8)).output().await.unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(3), "{stdout}");
    assert!(stdout.contains("line 2: malformed JSON"), "{stdout}");

    // Unknown config key: usage error 2.
    let cfg = dir.0.join("c.toml");
    std::fs::write(&cfg, "[provider]\nmodle = \"x\"\n").unwrap();
    let out = ingest_cmd(&db, &mock, &path).arg("--config").arg(&cfg).output().await.unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("modle"));

    // Missing target table: 1 with a hint.
    let out = ingest_cmd(&db, &mock, &path).args(["--table", "nope"]).output().await.unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not exist"));
}

/// Issue 20, item 16: a gateway answers a request without a key with a plain-text 500, which
/// looks like an outage. So `ingest` (and `serve`) warn at start when the variable the key is
/// read from is unset or empty, naming it, and say nothing when it is set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unset_api_key_variable_is_warned_about_at_start() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let dir = tempdir::Dir::new();
    let path = dir.0.join("c.jsonl");
    std::fs::write(&path, line("k", 0, "hello")).unwrap();

    let out = ingest_cmd(&db, &mock, &path).output().await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("EMBED_DLQ_API_KEY is not set"), "{stderr}");

    let out = ingest_cmd(&db, &mock, &path).args(["--api-key-env", "MY_GATEWAY_KEY"]).output().await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("MY_GATEWAY_KEY is not set"), "{stderr}");

    let out = ingest_cmd(&db, &mock, &path).env("EMBED_DLQ_API_KEY", "sk-set").output().await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("not set"), "{stderr}");
}

/// `RUST_LOG` picks what is logged, by level and by module; a value that does not parse is
/// said so, and the default applies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_log_chooses_what_is_logged_and_a_bad_value_is_named() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let dir = tempdir::Dir::new();
    // Each run its own documents (an unchanged rerun parks nothing), one input of them the
    // provider rejects: its park is logged at debug by the ingest writer.
    let stderr_with = async |rust_log: &str| {
        let path = dir.0.join("c.jsonl");
        let corpus: String = (0..8)
            .map(|i| {
                let text =
                    if i == 3 { format!("p {}", mock_provider::POISON_400) } else { format!("chunk {i}") };
                line(&format!("log {rust_log}"), i, &text)
            })
            .collect();
        std::fs::write(&path, corpus).unwrap();
        let out = ingest_cmd(&db, &mock, &path).env("RUST_LOG", rust_log).output().await.unwrap();
        assert!(out.status.code().is_some(), "{out:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let parks_logged =
        |log: &str| log.lines().filter(|l| l.contains("DEBUG embed_dlq::ingest::writer: parked")).count();

    let chosen = stderr_with("warn,embed_dlq::ingest=debug").await;
    assert_eq!(parks_logged(&chosen), 1, "the chosen module's debug lines:\n{chosen}");
    let bare = stderr_with("debug").await;
    assert_eq!(parks_logged(&bare), 1, "a bare level:\n{bare}");
    let other = stderr_with("warn,embed_dlq::replay=debug").await;
    assert_eq!(parks_logged(&other), 0, "another module's level:\n{other}");
    let default = stderr_with("").await;
    assert_eq!(parks_logged(&default), 0, "{default}");
    let bad = stderr_with("embed_dlq=loudest").await;
    assert!(bad.contains("RUST_LOG does not parse"), "{bad}");
    assert_eq!(parks_logged(&bad), 0, "the default applies:\n{bad}");
}

/// A run's first windows claim leases even before another run is seen (two runs started
/// together), but only for what they will embed: an unchanged rerun alone sends no claim at
/// all (the read-only lookup answers it), while a window with a changed chunk still claims.
/// The claim statement is made to panic (`ingest_claim`): the unchanged rerun must not reach
/// it, the changed one must.
#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints (scripts/test.sh)")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_windows_of_an_unchanged_rerun_alone_claim_nothing() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    // Three windows of 512 keys: all of them among a run's first (always-leased) windows.
    let spec = CorpusSpec { doc_prefix: "young".into(), chunks: 1_500, ..CorpusSpec::default() };
    let (_dir, path) = write_temp_corpus(&spec);
    let first = ingest_cmd(&db, &mock, &path).output().await.unwrap();
    assert_eq!(first.status.code(), Some(0), "{}", String::from_utf8_lossy(&first.stderr));

    let inputs_before = mock.control.stats().inputs;
    let rerun = ingest_cmd(&db, &mock, &path)
        .arg("--json")
        .env("EMBED_DLQ_FAILPOINT", "ingest_claim=panic")
        .output()
        .await
        .unwrap();
    assert_eq!(rerun.status.code(), Some(0), "{}", String::from_utf8_lossy(&rerun.stderr));
    let summary: serde_json::Value = serde_json::from_slice(&rerun.stdout).unwrap();
    assert_eq!(summary["unchanged"], 1_500, "{summary}");
    assert_eq!(mock.control.stats().inputs, inputs_before, "nothing embedded again");

    // One chunk changed: its window wants an embedding, so it claims its lease.
    let corpus = std::fs::read_to_string(&path).unwrap();
    let changed = corpus.replacen("\"text\":\"", "\"text\":\"changed ", 1);
    assert_ne!(changed, corpus);
    std::fs::write(&path, changed).unwrap();
    let rerun = ingest_cmd(&db, &mock, &path)
        .env("EMBED_DLQ_FAILPOINT", "ingest_claim=panic")
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&rerun.stderr);
    assert_ne!(rerun.status.code(), Some(0), "the changed chunk's window claimed nothing: {stderr}");
    assert!(stderr.contains("ingest_claim"), "{stderr}");
}
