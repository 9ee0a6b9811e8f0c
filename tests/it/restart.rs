//! `serve` keeps going through a restart of Postgres and of Redis: a private pair of services
//! (own ports, own data, same scripts/services.sh) is stopped and started again in the middle
//! of a replay, and the DLQ still drains without loss or duplicate.

use std::process::Stdio;
use std::time::Duration;

use embed_dlq::testkit::mock_provider::MockConfig;
use tokio_util::sync::CancellationToken;

use crate::support::*;

/// A private Postgres+Redis pair, removed on drop.
struct PrivateServices {
    env: Vec<(String, String)>,
    database_url: String,
    redis_url: String,
}

fn services_script() -> String {
    format!("{}/scripts/services.sh", env!("CARGO_MANIFEST_DIR"))
}

impl PrivateServices {
    /// Starts a private pair on ports below the kernel's ephemeral range (so no client
    /// connection of a busy test run can hold them while the pair is restarted), checked free
    /// first; a start that still loses a race is retried on other ports.
    fn start() -> PrivateServices {
        let main_state =
            std::env::var("EMBED_DLQ_SERVICES_DIR").unwrap_or_else(|_| "/var/tmp/embed-dlq-services".into());
        let free = |port: u16| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok();
        let mut last_error = String::new();
        for _ in 0..5 {
            let n = rand::random::<u16>() % 4000;
            let (pg, redis) = (21_000 + n, 25_000 + n);
            if !free(pg) || !free(redis) {
                continue;
            }
            let env = vec![
                (
                    "EMBED_DLQ_SERVICES_DIR".to_string(),
                    format!("/var/tmp/embed-dlq-it-{}-{n}", std::process::id()),
                ),
                ("EMBED_DLQ_PG_DIR".to_string(), format!("{main_state}/pg")),
                ("EMBED_DLQ_PG_PORT".to_string(), pg.to_string()),
                ("EMBED_DLQ_REDIS_PORT".to_string(), redis.to_string()),
            ];
            let s = PrivateServices {
                database_url: format!("postgres://postgres@127.0.0.1:{pg}/embed_dlq"),
                redis_url: format!("redis://127.0.0.1:{redis}/"),
                env,
            };
            match s.try_run("up") {
                Ok(()) => return s,
                Err(e) => last_error = e, // dropping `s` cleans its state dir
            }
        }
        panic!("could not start a private Postgres+Redis pair: {last_error}");
    }

    fn try_run(&self, verb: &str) -> Result<(), String> {
        let out = std::process::Command::new("bash")
            .arg(services_script())
            .arg(verb)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .output()
            .unwrap();
        if out.status.success() {
            Ok(())
        } else {
            Err(format!("services.sh {verb}: {}", String::from_utf8_lossy(&out.stderr)))
        }
    }

    fn run(&self, verb: &str) {
        if let Err(e) = self.try_run(verb) {
            panic!("{e}");
        }
    }
}

impl Drop for PrivateServices {
    fn drop(&mut self) {
        let _ = std::process::Command::new("bash")
            .arg(services_script())
            .arg("clean")
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .output();
        if let Some((_, dir)) = self.env.iter().find(|(k, _)| k == "EMBED_DLQ_SERVICES_DIR") {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_survives_postgres_and_redis_restarts_without_loss() {
    let svc = tokio::task::spawn_blocking(PrivateServices::start).await.unwrap();
    let pool = embed_dlq::store::connect(&svc.database_url, 4).await.unwrap();
    embed_dlq::store::migrate(&pool).await.unwrap();
    let db = TestDb::borrowed(svc.database_url.clone(), pool);

    // Park 600 chunks during an outage, make them due.
    let down = start_mock(MockConfig::default()).await;
    down.control.set_outage(true);
    let mut s = settings(&db, &down);
    s.retry.max_attempts = 1;
    let mut corpus = String::new();
    for i in 0..600 {
        corpus.push_str(&line("restart", i, &format!("chunk {i}")));
    }
    let keys = corpus_keys(corpus.as_bytes());
    pipeline(&s).await.run(input(corpus.into_bytes()), CancellationToken::new()).await.unwrap();
    sqlx::query("UPDATE embedding_dlq SET next_retry_at = now()").execute(&db.pool).await.unwrap();

    let slow = start_mock(MockConfig { latency_ms: 40, ..MockConfig::default() }).await;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_embed-dlq"))
        .arg("serve")
        .args([
            "--database-url",
            &svc.database_url,
            "--redis-url",
            &svc.redis_url,
            "--base-url",
            &slow.base_url(),
        ])
        .args(["--model", "mock", "--replayers", "2", "--replay-batch", "8", "--min-idle-ms", "1500"])
        .args([
            "--relay-poll-ms",
            "100",
            "--retry-base-ms",
            "20",
            "--retry-cap-ms",
            "200",
            "--dlq-base-secs",
            "1",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let db_url = svc.database_url.clone();
    let left = || async {
        let pool = embed_dlq::store::connect(&db_url, 1).await.ok()?;
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM embedding_dlq").fetch_one(&pool).await.ok()?;
        pool.close().await;
        Some(n)
    };
    for _ in 0..400 {
        if left().await.unwrap_or(600) < 500 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(left().await.unwrap() > 0, "restart must happen in the middle of the replay");
    db.pool.close().await;
    // Both services go away and come back while serve keeps running.
    let svc = tokio::task::spawn_blocking(move || {
        svc.run("down");
        std::thread::sleep(Duration::from_secs(1));
        svc.run("up");
        svc
    })
    .await
    .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        if left().await == Some(0) {
            break;
        }
        assert!(child.try_wait().unwrap().is_none(), "serve died");
        assert!(
            tokio::time::Instant::now() < deadline,
            "DLQ did not drain after the restart: {:?}",
            left().await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let pool = embed_dlq::store::connect(&svc.database_url, 2).await.unwrap();
    let db = TestDb::borrowed(svc.database_url.clone(), pool);
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 600);
    assert_corpus_accounted(&db, &keys).await;
    assert_eq!(db.leaks().await, 0);
    assert_eq!(db.manifest_disagreements().await, 0);
    child.kill().await.ok();
    db.pool.close().await;
    drop(svc);
}

/// A revision backfill across a restart of Postgres (issue 46): the run rides the outage out
/// or stops with a clear error, and a rerun finishes; either way the shadow ends holding every
/// chunk of the active revision with the vector of its text, the switch's coverage check finds
/// nothing missing, and the provider saw each chunk about once (what was in flight at the
/// restart at most twice). The oracle: the content hashes of the corpus the test wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backfill_across_a_postgres_restart_copies_every_chunk() {
    use embed_dlq::model::content_hash;
    use embed_dlq::store::revision::{activate, create_shadow};
    const CHUNKS: i32 = 2_000;
    let svc = tokio::task::spawn_blocking(PrivateServices::start).await.unwrap();
    let pool = embed_dlq::store::connect(&svc.database_url, 4).await.unwrap();
    embed_dlq::store::migrate(&pool).await.unwrap();
    let db = TestDb::borrowed(svc.database_url.clone(), pool);
    let fast = start_mock(MockConfig::default()).await;
    let text = |i: i32| format!("restart backfill chunk {i}");
    let corpus: String = (0..CHUNKS).map(|i| line("rb", i, &text(i))).collect();
    pipeline(&settings(&db, &fast))
        .await
        .run(input(corpus.clone().into_bytes()), CancellationToken::new())
        .await
        .unwrap();
    create_shadow(&db.pool, "doc_embeddings", Some("mock"), "mock-next", 256, Some(256)).await.unwrap();
    let dir =
        std::env::temp_dir().join(format!("embed-dlq-rb-{}-{}", std::process::id(), rand::random::<u64>()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("dump.jsonl");
    std::fs::write(&path, &corpus).unwrap();
    let slow = start_mock(MockConfig { latency_ms: 30, ..MockConfig::default() }).await;
    let url = svc.database_url.clone();
    let backfill = || {
        let mut c = tokio::process::Command::new(env!("CARGO_BIN_EXE_embed-dlq"));
        c.args(["--database-url", &url, "revision", "backfill"])
            .arg(&path)
            .args(["--base-url", &slow.base_url(), "--model", "mock", "--no-progress"])
            .args(["--batch-max-inputs", "16", "--concurrency", "2", "--request-timeout-ms", "5000"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        c
    };
    let child = backfill().spawn().unwrap();
    let db_url = svc.database_url.clone();
    let copied = || async {
        let pool = embed_dlq::store::connect(&db_url, 1).await.ok()?;
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM doc_embeddings__r2").fetch_one(&pool).await.ok()?;
        pool.close().await;
        Some(n)
    };
    for _ in 0..600 {
        if copied().await.unwrap_or(0) >= 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(copied().await.unwrap() < CHUNKS as i64, "the restart must come in the middle of the backfill");
    db.pool.close().await;
    let svc = tokio::task::spawn_blocking(move || {
        svc.run("down");
        std::thread::sleep(Duration::from_secs(1));
        svc.run("up");
        svc
    })
    .await
    .unwrap();
    let out = child.wait_with_output().await.unwrap();
    let mut runs = 1;
    if out.status.code() != Some(0) {
        // Stopped by the outage: it must say why, and a rerun finishes.
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.trim().is_empty(), "a backfill stopped by the outage says why");
        let again = backfill().output().await.unwrap();
        assert_eq!(again.status.code(), Some(0), "{}", String::from_utf8_lossy(&again.stderr));
        runs += 1;
    }
    let pool = embed_dlq::store::connect(&svc.database_url, 2).await.unwrap();
    let db = TestDb::borrowed(svc.database_url.clone(), pool);
    let r2 = crate::revisions::hashes(&db, "doc_embeddings__r2").await;
    assert_eq!(r2.len(), CHUNKS as usize, "in {runs} run(s)");
    for i in 0..CHUNKS {
        assert_eq!(r2.get(&("rb".to_string(), i)), Some(&content_hash("mock-next", 256, &text(i))), "rb#{i}");
    }
    // Each chunk about once: what was in flight when Postgres went away (two writers' statements
    // and the workers' batches) at most once more.
    let sent = slow.control.stats().inputs;
    eprintln!(
        "backfill across a Postgres restart: {runs} run(s), {sent} provider inputs for {CHUNKS} chunks"
    );
    assert!(sent <= CHUNKS as u64 + 2 * 512 + 3 * 2 * 16, "{sent} inputs for {CHUNKS} chunks");
    let switched = activate(&db.pool, "doc_embeddings", Some(2), 0).await.unwrap();
    assert_eq!(switched.coverage.covered, CHUNKS as u64);
    db.pool.close().await;
    let _ = std::fs::remove_dir_all(&dir);
    drop(svc);
}
