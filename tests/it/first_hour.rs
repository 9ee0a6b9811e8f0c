//! A newcomer's first hour with the real binary (issue 20, items 10-13): every command that
//! follows or relays the streams refuses a database relayed under another prefix (the one
//! message `serve` gives), a normal stop is not a warning, `dlq` pages end where the rows
//! do, refusals share one exit code, output reads as English, and `mock-provider` documents
//! only its own flags and reports usage like the client estimates it.

use std::process::Stdio;
use std::time::Duration;

use embed_dlq::testkit::mock_provider::{self, MockConfig};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;
use tokio_util::sync::CancellationToken;

use crate::support::*;

fn binary() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_embed-dlq"));
    c.env_remove("EMBED_DLQ_API_KEY")
        .env_remove("RUST_LOG")
        .env_remove("EMBED_DLQ_STREAM_PREFIX")
        .env_remove("EMBED_DLQ_CONFIG")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    c
}

/// The binary with the test database, the Redis of the test and a stream prefix of its own.
fn on(db: &TestDb, prefix: &str) -> Command {
    let mut c = binary();
    c.env("DATABASE_URL", &db.url).env("REDIS_URL", redis_url()).env("EMBED_DLQ_STREAM_PREFIX", prefix);
    c
}

fn fresh_prefix(what: &str) -> String {
    format!("it-{what}-{}-{}", std::process::id(), rand::random::<u32>())
}

/// Runs `c` to its end; a command that should refuse at once but runs on fails the test
/// instead of hanging it (the bound is a hang guard, not a timing assertion).
async fn output(mut c: Command) -> std::process::Output {
    tokio::time::timeout(Duration::from_secs(300), c.output())
        .await
        .expect("the command ran on instead of ending")
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_stream_command_refuses_a_database_relayed_under_another_prefix() {
    let db = TestDb::new().await;
    let recorded = fresh_prefix("recorded");
    embed_dlq::store::prefix::check(&db.pool, &recorded).await.unwrap();
    let other = fresh_prefix("other");
    let expected = format!(
        "this database's outbox is relayed to the streams under prefix {recorded:?} (recorded in \
         embed_dlq_streams on "
    );
    for args in [
        &["tail", "--from", "0", "--no-follow"][..],
        &["console", "--listen", "127.0.0.1:0"],
        &["reconcile"],
        &["serve", "--replayers", "1"],
        &["demo", "--chunks", "1"],
    ] {
        let out = output({
            let mut c = on(&db, &other);
            c.args(args);
            c
        })
        .await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?} must refuse with the usage code: {stderr}");
        assert!(
            stderr.contains(&expected) && stderr.contains(&format!("stream_prefix = {other:?}")),
            "{args:?} must give serve's message: {stderr}"
        );
    }
    // With the recorded prefix, tail reads (an empty stream, nothing to refuse).
    let out = output({
        let mut c = on(&db, &recorded);
        c.args(["tail", "--from", "0", "--no-follow"]);
        c
    })
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));

    // The events are in Redis: a database tail cannot reach costs the check, not the tail.
    let out = output({
        let mut c = on(&db, &recorded);
        c.args(["--database-url", "postgres://postgres@127.0.0.1:1/nowhere"]);
        c.args(["tail", "--from", "0", "--no-follow"]);
        c
    })
    .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("unchecked"), "the tail says it could not check: {stderr}");

    // Reading commands record nothing: a fresh database stays free for the first serve.
    let fresh = TestDb::new().await;
    let out = output({
        let mut c = on(&fresh, &other);
        c.args(["tail", "--from", "0", "--no-follow"]);
        c
    })
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(fresh.count("SELECT count(*) FROM embed_dlq_streams").await, 0);
}

/// Starts `c`, waits for `ready` on stderr (or a first line on stdout with `ready_stdout`),
/// sends SIGTERM and returns the exit code and what it wrote on stderr from the signal on (and
/// before it, on stderr not read until then).
async fn start_then_stop(mut c: Command, ready: &str, ready_stdout: bool) -> (Option<i32>, String) {
    let mut child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut stdout = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = String::new();
    let wait = async {
        if ready_stdout {
            stdout.next_line().await.unwrap().expect("a line on stdout");
        } else {
            while let Some(l) = stderr.next_line().await.unwrap() {
                seen.push_str(&l);
                seen.push('\n');
                if l.contains(ready) {
                    return;
                }
            }
            panic!("ended before {ready:?}: {seen}");
        }
    };
    tokio::time::timeout(Duration::from_secs(300), wait).await.expect("the command never got ready");
    let pid = child.id().unwrap().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let mut seen = String::new();
    let drain = async {
        while let Some(l) = stderr.next_line().await.unwrap() {
            seen.push_str(&l);
            seen.push('\n');
        }
        while stdout.next_line().await.unwrap().is_some() {}
        child.wait().await.unwrap()
    };
    let status = tokio::time::timeout(Duration::from_secs(300), drain).await.expect("stopped");
    (status.code(), seen)
}

/// The demo, then every command of the block it ends with ("== next =="), as printed: in an
/// environment holding only the services' URLs (what `eval "$(scripts/services.sh up)"` sets)
/// and what the block itself exports.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_runs_every_pass_and_every_command_it_shows_next_works() {
    let db = TestDb::new().await;
    let prefix = fresh_prefix("demo");
    let out = output({
        let mut c = on(&db, &prefix);
        c.args(["demo", "--chunks", "300"]);
        c
    })
    .await;
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("provider requests seen by the mock in pass 2: 0"), "{stdout}");
    assert!(stdout.contains("outage: 300 chunks parked as transient"), "{stdout}");
    assert!(stdout.contains("total findings: 0"), "{stdout}");
    assert_eq!(db.leaks().await, 0);
    assert_eq!(db.manifest_disagreements().await, 0);

    let bin = env!("CARGO_BIN_EXE_embed-dlq");
    let block: Vec<&str> = stdout.lines().skip_while(|l| *l != "== next ==").skip(1).collect();
    let (mut env, mut commands) = (Vec::new(), Vec::new());
    for l in &block {
        let l = l.split(" #").next().unwrap().trim();
        if let Some(kv) = l.strip_prefix("export ") {
            let (k, v) = kv.split_once('=').expect(l);
            env.push((k.to_string(), v.to_string()));
        } else if let Some(args) = l.strip_prefix(bin) {
            commands.push(args.split_whitespace().map(str::to_string).collect::<Vec<_>>());
        }
    }
    assert!(
        env.contains(&("EMBED_DLQ_STREAM_PREFIX".to_string(), prefix.clone())),
        "a demo on another prefix than the default says so: {block:#?}"
    );
    let names: Vec<String> = commands.iter().map(|c| c[..c.len().min(2)].join(" ")).collect();
    for expected in ["dlq stats", "dlq list", "reconcile", "tail --from", "console", "serve"] {
        assert!(names.iter().any(|n| n.starts_with(expected)), "no {expected} in {block:#?}");
    }
    for args in commands {
        let mut c = binary();
        c.env("DATABASE_URL", &db.url).env("REDIS_URL", redis_url()).envs(env.iter().cloned()).args(&args);
        let what = args.join(" ");
        match args[0].as_str() {
            "console" => {
                // Another process of this machine may hold the console's default port.
                c.args(["--listen", "127.0.0.1:0"]);
                let (code, stderr) = start_then_stop(c, "console: serving", false).await;
                assert_eq!(code, Some(0), "{what}: {stderr}");
            }
            "serve" => {
                let (code, stderr) = start_then_stop(c, "serving: relay", false).await;
                assert_eq!(code, Some(0), "{what}: {stderr}");
            }
            _ => {
                let out = output(c).await;
                let stdout = String::from_utf8_lossy(&out.stdout);
                assert_eq!(
                    out.status.code(),
                    Some(0),
                    "{what}: {stdout}\n{}",
                    String::from_utf8_lossy(&out.stderr)
                );
                if args[0] == "tail" {
                    assert!(stdout.contains(" parked "), "{what} shows the demo's events: {stdout}");
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_normal_stop_of_tail_console_and_serve_is_not_a_warning() {
    let db = TestDb::new().await;
    let prefix = fresh_prefix("stop");
    let keys = embed_dlq::streams::StreamKeys::new(&prefix);
    let mut conn = redis().await;
    let _: String = redis::cmd("XADD")
        .arg(keys.events())
        .arg("*")
        .arg("event")
        .arg("parked")
        .arg("body")
        .arg(r#"{"doc_id":"d","chunk_index":0}"#)
        .query_async(&mut conn)
        .await
        .unwrap();
    let runs = [
        (vec!["tail", "--from", "0"], "", true),
        (vec!["console", "--listen", "127.0.0.1:0"], "console: serving", false),
        (vec!["serve", "--replayers", "1"], "serving: relay, scheduler, replayers", false),
    ];
    for (args, ready, on_stdout) in runs {
        let mut c = on(&db, &prefix);
        c.args(&args);
        let (code, stderr) = start_then_stop(c, ready, on_stdout).await;
        assert_eq!(code, Some(0), "{args:?}: {stderr}");
        assert!(!stderr.contains(" WARN "), "a normal stop of {args:?} logged a warning: {stderr}");
        assert!(stderr.contains(" INFO "), "the stop is logged: {stderr}");
    }
}

/// Parks `n` poison inputs of doc `doc` in `db`'s DLQ.
async fn park(db: &TestDb, doc: &str, n: i32) {
    let mock = start_mock(MockConfig::default()).await;
    let corpus: String =
        (0..n).map(|i| line(doc, i, &format!("text {i} {}", mock_provider::POISON_400))).collect();
    let summary =
        pipeline(&settings(db, &mock)).await.run(input(corpus.into_bytes()), CancellationToken::new()).await;
    assert_eq!(summary.unwrap().parked_total(), n as u64);
    mock.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_pages_end_with_the_rows_refusals_agree_and_counts_read_as_english() {
    let db = TestDb::new().await;
    park(&db, "three", 3).await;
    park(&db, "one", 1).await;
    let prefix = fresh_prefix("dlq");
    let run = |args: &[&str]| {
        let mut c = on(&db, &prefix);
        c.args(args);
        output(c)
    };

    // A page that is not the last one says how to get the next; the last one does not.
    let out = run(&["dlq", "list", "--limit", "3"]).await;
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    let next = stdout.lines().find_map(|l| l.strip_prefix("next page: --after-id ")).expect(&stdout);
    let out = run(&["dlq", "list", "--limit", "3", "--after-id", next]).await;
    let last_page = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(last_page.lines().count(), 1, "the fourth row, alone: {last_page}");
    assert!(!last_page.contains("next page"), "{last_page}");
    let out = run(&["dlq", "list", "--limit", "4"]).await;
    assert!(!String::from_utf8_lossy(&out.stdout).contains("next page"));
    let out = run(&["dlq", "list", "--doc", "nobody"]).await;
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "no DLQ rows match", "an empty page says so");

    // The same refusal (no terminal to confirm on, no --yes/--all) has the same code: usage.
    let purge = run(&["dlq", "purge", "--doc", "one"]).await;
    assert_eq!(purge.status.code(), Some(2), "{}", String::from_utf8_lossy(&purge.stderr));
    let requeue = run(&["dlq", "requeue"]).await;
    assert_eq!(requeue.status.code(), Some(2), "{}", String::from_utf8_lossy(&requeue.stderr));

    // One row is a row.
    let out = run(&["dlq", "purge", "--doc", "one", "--dry-run"]).await;
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "would purge 1 row");
    let out = run(&["dlq", "requeue", "--doc", "one", "--dry-run"]).await;
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "would requeue 1 row");
    let out = run(&["dlq", "purge", "--doc", "three", "--dry-run"]).await;
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "would purge 3 rows");

    // The reconcile report names its mode in words.
    let out = run(&["reconcile"]).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains(", mode check)"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mock_provider_help_shows_only_its_own_flags() {
    let out = output({
        let mut c = binary();
        c.args(["mock-provider", "--help"]);
        c
    })
    .await;
    let help = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{help}");
    for foreign in ["--database-url", "--redis-url", "--redis-cluster", "--config", "MockConfig"] {
        assert!(!help.contains(foreign), "mock-provider --help shows {foreign}: {help}");
    }
    for own in ["--listen", "--settings", "--rpm-limit", "--tpm-limit", "rate_429"] {
        assert!(help.contains(own), "mock-provider --help misses {own}: {help}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mock_reports_usage_like_the_clients_estimate() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let texts: Vec<String> = (0..40).map(|i| format!("chunk {i} {}", "lorem ipsum ".repeat(i))).collect();
    let corpus: String = texts.iter().enumerate().map(|(i, t)| line("u", i as i32, t)).collect();
    let summary =
        pipeline(&settings(&db, &mock)).await.run(input(corpus.into_bytes()), CancellationToken::new()).await;
    let summary = summary.unwrap();
    assert_eq!(summary.stored, 40);
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let estimate = embed_dlq::embed::limit::estimate_tokens(&refs);
    assert_eq!(summary.reported_tokens, estimate, "{summary:?}");
    assert_eq!(summary.tokens_stored, estimate, "{summary:?}");
    mock.shutdown().await;
}
