//! Runtime containment, through the real binary where a user would see it: identities the
//! database cannot index, hostile strings in logs, tasks that panic, writers that must not
//! starve each other, and memory bounded by bytes rather than by record count.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use embed_dlq::mock_provider::{MockConfig, MockProvider};
use tokio::process::Command;

use crate::support::*;

fn binary() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_embed-dlq"));
    c.env_remove("EMBED_DLQ_API_KEY")
        .env_remove("RUST_LOG")
        .env_remove("EMBED_DLQ_FAILPOINT")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    c
}

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
