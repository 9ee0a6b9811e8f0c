//! One settings model for every command, run as a user runs it: the real binary with its
//! settings only in a config file (the environment cleared), bounds that end in exit 2 and
//! never in a panic, secrets kept out of `--help`, and `dlq requeue` refusing to requeue
//! everything without `--all`.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use embed_dlq::testkit::mock_provider::{self, MockConfig, MockProvider};
use redis::AsyncCommands;
use tokio::process::Command;
use tokio_util::sync::CancellationToken;

use crate::support::*;

/// Every environment variable the binary reads settings from.
const SETTINGS_ENV: &[&str] = &[
    "DATABASE_URL",
    "REDIS_URL",
    "EMBED_DLQ_CONFIG",
    "EMBED_DLQ_BASE_URL",
    "EMBED_DLQ_MODEL",
    "EMBED_DLQ_STREAM_PREFIX",
    "EMBED_DLQ_API_KEY",
    "EMBED_DLQ_FAILPOINT",
    "RUST_LOG",
];

/// The binary with no settings in its environment and stdin closed.
fn bare() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_embed-dlq"));
    for v in SETTINGS_ENV {
        c.env_remove(v);
    }
    c.stdin(Stdio::null()).kill_on_drop(true);
    c
}

/// A directory removed on drop, holding the config file.
struct Dir(PathBuf);

impl Dir {
    fn new() -> Dir {
        let p = std::env::temp_dir().join(format!(
            "embed-dlq-cfg-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&p).unwrap();
        Dir(p)
    }

    fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A prefix (and table name part) no other test uses.
fn unique(what: &str) -> String {
    format!("{what}_{}_{}", std::process::id(), rand::random::<u32>())
}

/// A config file naming the test's services, a non-default table and stream prefix.
fn config_text(db: &TestDb, table: &str, prefix: &str, mock: Option<&MockProvider>) -> String {
    let mut t = format!(
        "[services]\ndatabase_url = {:?}\nredis_url = {:?}\n[ingest]\ntable = {table:?}\n[serve]\nstream_prefix = {prefix:?}\nrelay_poll_ms = 50\nrelay_marker_ttl_secs = 3600\n",
        db.url,
        redis_url()
    );
    if let Some(m) = mock {
        t.push_str(&format!(
            "[provider]\nbase_url = {:?}\nmodel = \"mock\"\nrequest_timeout_ms = 2000\n[retry]\nretry_base_ms = 5\nretry_cap_ms = 50\n",
            m.base_url()
        ));
    }
    t
}

/// `embed-dlq dlq ARGS` with only the config file `cfg` for settings.
fn dlq_cmd(cfg: &std::path::Path, args: &[&str]) -> Command {
    let mut c = bare();
    c.env("EMBED_DLQ_CONFIG", cfg).arg("dlq").args(args);
    c
}

async fn output(mut c: Command) -> (Option<i32>, String, String) {
    let out =
        tokio::time::timeout(Duration::from_secs(60), c.output()).await.expect("command finishes").unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

async fn table_exists(db: &TestDb, table: &str) -> bool {
    sqlx::query_scalar::<_, bool>("SELECT to_regclass($1) IS NOT NULL")
        .bind(table)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

async fn rows(db: &TestDb, sql: String) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).fetch_one(&db.pool).await.unwrap()
}

/// Creates `table` (768 dims, the mock's size) and ingests `corpus` into it through the library.
async fn ingest_into(db: &TestDb, mock: &MockProvider, table: &str, corpus: String) {
    embed_dlq::store::create_target_table(&db.pool, table, 768).await.unwrap();
    let mut s = settings(db, mock);
    s.table = table.to_string();
    s.retry.max_attempts = 1;
    pipeline(&s).await.run(input(corpus.into_bytes()), CancellationToken::new()).await.unwrap();
}

fn corpus(doc: &str, n: i32, poison_every: i32) -> String {
    (0..n)
        .map(|i| {
            let text = if poison_every > 0 && i % poison_every == 0 {
                format!("{doc} {i} {}", mock_provider::POISON_400)
            } else {
                format!("{doc} {i}")
            };
            line(doc, i, &text)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_takes_database_and_table_from_the_config_file() {
    let db = TestDb::new().await;
    let dir = Dir::new();
    let table = unique("cfg_migrate");
    let cfg = dir.write("c.toml", &config_text(&db, &table, "unused", None));
    let mut c = bare();
    c.env("EMBED_DLQ_CONFIG", &cfg).args(["migrate", "--dimensions", "8"]);
    let (code, out, err) = output(c).await;
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(table_exists(&db, &table).await, "the file's [ingest] table was created: {out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingest_takes_every_setting_from_the_config_file() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let dir = Dir::new();
    let table = unique("cfg_ingest");
    embed_dlq::store::create_target_table(&db.pool, &table, 768).await.unwrap();
    let cfg = dir.write("c.toml", &config_text(&db, &table, "unused", Some(&mock)));
    let input = dir.write("c.jsonl", &corpus("ing", 20, 0));
    let mut c = bare();
    c.arg("--config").arg(&cfg).arg("ingest").arg(&input).args(["--no-progress", "--json"]);
    let (code, out, err) = output(c).await;
    assert_eq!(code, Some(0), "{out}{err}");
    assert_eq!(rows(&db, format!("SELECT count(*) FROM \"{table}\"")).await, 20);
    assert_eq!(db.count("SELECT count(*) FROM doc_embeddings").await, 0);
    assert!(mock.control.stats().inputs >= 20, "the file's base_url was used");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_relays_under_the_config_files_stream_prefix() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let table = unique("cfg_serve");
    ingest_into(&db, &mock, &table, corpus("srv", 6, 2)).await;
    let parked = db.count("SELECT count(*) FROM embedding_dlq").await;
    assert_eq!(parked, 3);
    let dir = Dir::new();
    let prefix = unique("cfg-serve");
    let cfg = dir.write("c.toml", &config_text(&db, &table, &prefix, Some(&mock)));
    let mut c = bare();
    c.env("EMBED_DLQ_CONFIG", &cfg)
        .args(["serve", "--replayers", "0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    let mut redis = redis().await;
    let events = format!("{{{prefix}}}:events");
    let mut len = 0u64;
    for _ in 0..300 {
        len = redis.xlen(&events).await.unwrap();
        if len >= parked as u64 {
            break;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("serve exited early with {status}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(len >= parked as u64, "the parks reached {events}");
    // The file's marker lifetime reached the relay (the default is 7 days).
    let hour: String = sqlx::query_scalar(
        // Every event is on the stream (its record written with it); its row may not be marked yet.
        "SELECT embed_dlq_dedup_hour(created_at) FROM dlq_outbox WHERE stream = 'events' ORDER BY id LIMIT 1",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let ttl: i64 = redis.ttl(format!("{{{prefix}}}:published:{hour}")).await.unwrap();
    assert!((3000..=3600).contains(&ttl), "dedup hash TTL {ttl} s, configured 3600");
    let pid = child.id().unwrap().to_string();
    std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output()).await.unwrap().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let _: () = redis.del(&events).await.unwrap();
}

/// One database, one set of streams: a second stream prefix over the same database would
/// split the outbox between two sets of streams (each relay claiming part of it) and each
/// reconciler would publish the other's events again. The first process records its prefix;
/// `serve` and `reconcile` with another one exit 2 naming both, change nothing and publish
/// nothing; `migrate --adopt-stream-prefix` moves the database on purpose.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_stream_prefix_over_one_database_is_refused() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    ingest_into(&db, &mock, "doc_embeddings", corpus("pfx", 6, 2)).await;
    let (first, second) = (unique("pfx-a"), unique("pfx-b"));
    let run = |prefix: &str, args: &[&str]| {
        let mut c = bare();
        c.env("DATABASE_URL", &db.url).env("REDIS_URL", redis_url()).args(args);
        c.args(["--stream-prefix", prefix]);
        output(c)
    };
    let (code, out, err) = run(&first, &["reconcile"]).await;
    assert_eq!(code, Some(0), "the first prefix is recorded and the run goes on: {out}{err}");
    let position =
        "SELECT lower::text || '/' || coalesce(upper::text, '') || '/' || after_id FROM relay_position";
    let position_before: String = sqlx::query_scalar(position).fetch_one(&db.pool).await.unwrap();
    for args in [&["reconcile", "--repair"][..], &["serve", "--replayers", "0"]] {
        let (code, out, err) = run(&second, args).await;
        assert_eq!(code, Some(2), "{args:?}: {out}{err}");
        assert!(err.contains(&first) && err.contains(&second), "{args:?} names both prefixes: {err}");
        assert!(err.contains("--adopt-stream-prefix"), "{err}");
    }
    assert_eq!(
        sqlx::query_scalar::<_, String>(position).fetch_one(&db.pool).await.unwrap(),
        position_before,
        "nothing was relayed under the second prefix"
    );
    let mut redis = redis().await;
    let second_events: u64 = redis.xlen(format!("{{{second}}}:events")).await.unwrap();
    assert_eq!(second_events, 0);
    // Refused before touching Redis: not even the second prefix's `:meta` was written.
    let second_meta: u64 = redis.exists(format!("{{{second}}}:meta")).await.unwrap();
    assert_eq!(second_meta, 0, "a refused process wrote {{{second}}}:meta");
    // Moving on purpose: the new prefix is accepted, the old one refused.
    let mut c = bare();
    c.env("DATABASE_URL", &db.url).args(["migrate", "--adopt-stream-prefix", &second]);
    let (code, out, err) = output(c).await;
    assert_eq!(code, Some(0), "{out}{err}");
    let (code, out, err) = run(&second, &["reconcile"]).await;
    assert_eq!(code, Some(0), "{out}{err}");
    let (code, _, err) = run(&first, &["reconcile"]).await;
    assert_eq!(code, Some(2), "{err}");
    let mut c = bare();
    c.env("DATABASE_URL", &db.url).args(["migrate", "--adopt-stream-prefix", "bad {prefix}"]);
    let (code, _, err) = output(c).await;
    assert_eq!(code, Some(2), "a prefix outside its bounds is a usage error: {err}");
    let _: () = redis.del(&[format!("{{{first}}}:meta"), format!("{{{second}}}:meta")]).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_follows_the_config_files_stream_prefix() {
    let db = TestDb::new().await;
    let dir = Dir::new();
    let prefix = unique("cfg-tail");
    let mut redis = redis().await;
    let events = format!("{{{prefix}}}:events");
    let body =
        serde_json::json!({"event": "parked", "doc_id": "from-the-file", "chunk_index": 3}).to_string();
    let _: String =
        redis.xadd(&events, "*", &[("outbox_id", "1"), ("event", "parked"), ("body", &body)]).await.unwrap();
    let cfg = dir.write("c.toml", &config_text(&db, "doc_embeddings", &prefix, None));
    let mut c = bare();
    c.arg("--config").arg(&cfg).args(["tail", "--from", "0", "--no-follow", "--json"]);
    let (code, out, err) = output(c).await;
    let _: () = redis.del(&events).await.unwrap();
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("from-the-file"), "tail read {events}: {out:?} {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_checks_and_repairs_the_config_files_table() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let table = unique("cfg_reconcile");
    ingest_into(&db, &mock, &table, corpus("rec", 30, 0)).await;
    assert_eq!(rows(&db, format!("SELECT count(*) FROM \"{table}\"")).await, 30);
    let dir = Dir::new();
    let cfg = dir.write("c.toml", &config_text(&db, &table, &unique("cfg-rec"), None));
    let mut c = bare();
    c.env("EMBED_DLQ_CONFIG", &cfg).args(["reconcile", "--repair", "--json"]);
    let (code, out, err) = output(c).await;
    assert_eq!(code, Some(0), "a consistent corpus in the file's table is clean: {out}{err}");
    assert_eq!(
        db.count("SELECT count(*) FROM ingest_manifest WHERE status = 'reingest'").await,
        0,
        "repair must not mark the corpus for re-embedding"
    );
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest WHERE status = 'stored'").await, 30);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_opens_the_config_files_table() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let table = unique("cfg_dlq");
    ingest_into(&db, &mock, &table, corpus("dlq", 8, 4)).await;
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 2);
    // Only the file's table exists: a command that falls back to the default fails.
    sqlx::query("DROP TABLE doc_embeddings").execute(&db.pool).await.unwrap();
    let dir = Dir::new();
    let cfg = dir.write("c.toml", &config_text(&db, &table, "unused", None));
    let mut c = bare();
    c.env("EMBED_DLQ_CONFIG", &cfg).args(["dlq", "stats", "--json"]);
    let (code, out, err) = output(c).await;
    assert_eq!(code, Some(0), "{out}{err}");
    let stats: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(stats["by_class"][0]["parked"], 2, "{stats}");
}

/// Two target tables share one DLQ: `dlq` acts on its own table's rows (`--table`, the config
/// file's table, else the default) and touches another table's only with `--all-tables`.
/// Before, `dlq purge --table a` deleted table b's rows too, and `list`/`stats` mixed them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_acts_on_its_own_tables_rows_only() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let (a, b) = (unique("dlq_a"), unique("dlq_b"));
    ingest_into(&db, &mock, &a, corpus("a", 8, 4)).await; // 2 parked
    ingest_into(&db, &mock, &b, corpus("b", 12, 4)).await; // 3 parked
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 5);
    let dir = Dir::new();
    let cfg = dir.write("c.toml", &config_text(&db, &b, "unused", None));
    let dlq = |args: &[&str]| output(dlq_cmd(&cfg, args));
    let listed = |out: &str| -> Vec<String> {
        let rows: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        rows.as_array().unwrap().iter().map(|r| r["doc_id"].as_str().unwrap().to_string()).collect()
    };
    // --table a: a's rows only; the config file's table (b) without the flag.
    let (code, out, err) = dlq(&["--json", "--table", &a, "list"]).await;
    assert_eq!(code, Some(0), "{out}{err}");
    assert_eq!(listed(&out), ["a", "a"], "{out}");
    let (code, out, err) = dlq(&["--json", "list"]).await;
    assert_eq!(code, Some(0), "{out}{err}");
    assert_eq!(listed(&out), ["b", "b", "b"], "{out}");
    let (_, out, _) = dlq(&["--json", "list", "--all-tables"]).await;
    assert_eq!(listed(&out).len(), 5, "{out}");
    let (_, out, _) = dlq(&["--json", "--table", &a, "stats"]).await;
    let stats: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(stats["by_class"][0]["parked"], 2, "{stats}");
    assert_eq!(stats["by_class"].as_array().unwrap().len(), 1, "{stats}");
    // A purge of a leaves b's rows (and b's manifest) alone.
    let (code, out, err) = dlq(&["--json", "--table", &a, "purge", "--yes"]).await;
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("\"purged\":2"), "{out}");
    let left: Vec<String> =
        sqlx::query_scalar("SELECT doc_id FROM embedding_dlq ORDER BY id").fetch_all(&db.pool).await.unwrap();
    assert_eq!(left, ["b", "b", "b"]);
    // A requeue of the (empty) a touches none of b's rows.
    let (code, out, err) = dlq(&["--json", "--table", &a, "requeue", "--all"]).await;
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("\"requeued\":0"), "{out}");
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq WHERE error_class <> 'transient'").await, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_lists_and_purges_the_rows_of_one_model_only() {
    // Rows parked under a model the provider has retired wait in the DLQ (replay postpones
    // them); the operator finds and purges exactly those.
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    let table = unique("dlq_model");
    ingest_into(&db, &mock, &table, corpus("m", 12, 4)).await; // 3 parked
    sqlx::query(
        "UPDATE embedding_dlq SET model = 'retired-model' WHERE id = (SELECT min(id) FROM embedding_dlq)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let dir = Dir::new();
    let cfg = dir.write("c.toml", &config_text(&db, &table, "unused", None));
    let dlq = |args: &[&str]| output(dlq_cmd(&cfg, args));
    let (code, out, err) = dlq(&["--json", "list", "--model", "retired-model"]).await;
    assert_eq!(code, Some(0), "{out}{err}");
    let rows: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(rows.as_array().unwrap().len(), 1, "{out}");
    let (code, out, err) = dlq(&["--json", "purge", "--model", "retired-model", "--yes"]).await;
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("\"purged\":1"), "{out}");
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 2);
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq WHERE model = 'retired-model'").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_range_settings_exit_2_naming_the_setting_never_a_panic() {
    let db = TestDb::new().await;
    let dir = Dir::new();
    let input = dir.write("c.jsonl", &corpus("oob", 2, 0));
    let run = |args: &[&str], cfg: Option<&Path>| {
        let mut c = bare();
        if let Some(p) = cfg {
            c.arg("--config").arg(p);
        }
        c.arg("ingest").arg(&input).args(["--database-url", &db.url, "--base-url", "http://127.0.0.1:9/v1"]);
        c.args(["--no-progress"]).args(args);
        output(c)
    };
    let max = u64::MAX.to_string();
    // Each of these panicked (exit 101) or ran away with memory before.
    for (args, setting) in [
        (vec!["--writers", &max], "writers"),
        (vec!["--max-line-bytes", &max], "max_line_bytes"),
        (vec!["--concurrency", "10000000"], "concurrency"),
        (vec!["--request-timeout-ms", &max], "request_timeout_ms"),
        (vec!["--breaker-cooldown-ms", &max], "breaker_cooldown_ms"),
        (vec!["--dlq-cap-secs", &max], "dlq_cap_secs"),
        // The settings of the stream source and of deletions (issue 21).
        (vec!["--source-min-idle-ms", &max], "source_min_idle_ms"),
        (vec!["--source-min-idle-ms", "0"], "source_min_idle_ms"),
        (vec!["--source-delivery-cap", "4294967295"], "source_delivery_cap"),
        (vec!["--source-delivery-cap", "0"], "source_delivery_cap"),
        (vec!["--source-max-inflight-entries", &max], "source_max_inflight_entries"),
        (vec!["--source-shards", "65"], "source_shards"),
        (vec!["--cleanup-max-fraction", "1.5"], "cleanup_max_fraction"),
        (vec!["--cleanup-max-fraction=-0.1"], "cleanup_max_fraction"),
        (vec!["--cleanup-max-fraction", "NaN"], "cleanup_max_fraction"),
        (vec!["--cleanup-max-rejected-lines", &max], "cleanup_max_rejected_lines"),
    ] {
        let (code, out, err) = run(&args, None).await;
        assert_eq!(code, Some(2), "{args:?}: {out}{err}");
        assert!(err.contains(setting) && err.contains("out of range"), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    // From the file: the message names the file and key.
    let cfg = dir.write("c.toml", "[ingest]\nconcurrency = 10000000\n");
    let (code, _, err) = run(&[], Some(&cfg)).await;
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("[ingest] concurrency") && err.contains("c.toml"), "{err}");
    assert_eq!(db.count("SELECT count(*) FROM ingest_manifest").await, 0, "nothing ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_base_url_that_is_not_http_is_a_usage_error_not_a_parked_corpus() {
    let db = TestDb::new().await;
    let dir = Dir::new();
    let input = dir.write("c.jsonl", &corpus("url", 5, 0));
    for bad in ["localhost:8089/v1", "not a url", "ftp://127.0.0.1/v1"] {
        let mut c = bare();
        c.arg("ingest").arg(&input).args(["--database-url", &db.url, "--base-url", bad, "--no-progress"]);
        c.args(["--retry-max-attempts", "1"]);
        let (code, out, err) = output(c).await;
        assert_eq!(code, Some(2), "{bad}: {out}{err}");
        assert!(err.contains("base_url"), "{err}");
    }
    // From the environment, named as such.
    let mut c = bare();
    c.env("EMBED_DLQ_BASE_URL", "127.0.0.1:8089").arg("ingest").arg(&input);
    c.args(["--database-url", &db.url, "--no-progress"]);
    let (code, _, err) = output(c).await;
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("EMBED_DLQ_BASE_URL"), "{err}");
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 0, "nothing parked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn help_never_shows_passwords_from_the_environment() {
    const SECRETS: [&str; 3] = ["pg-s3cret-pw", "redis-s3cret-pw", "gw-s3cret-pw"];
    for args in [
        vec!["--help"],
        vec!["migrate", "--help"],
        vec!["ingest", "--help"],
        vec!["serve", "--help"],
        vec!["tail", "--help"],
        vec!["reconcile", "--help"],
        vec!["dlq", "requeue", "--help"],
        vec!["demo", "--help"],
    ] {
        let mut c = bare();
        c.env("DATABASE_URL", format!("postgres://user:{}@db.example:5432/x", SECRETS[0]))
            .env("REDIS_URL", format!("redis://:{}@redis.example:6379/", SECRETS[1]))
            .env("EMBED_DLQ_BASE_URL", format!("https://u:{}@gw.example/v1", SECRETS[2]))
            .args(&args);
        let (code, out, err) = output(c).await;
        assert_eq!(code, Some(0), "{args:?}: {err}");
        for s in SECRETS {
            assert!(!out.contains(s) && !err.contains(s), "{args:?} printed a password: {out}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_requeue_without_a_filter_needs_all_when_not_on_a_terminal() {
    let db = TestDb::new().await;
    let mock = start_mock(MockConfig::default()).await;
    ingest_into(&db, &mock, "doc_embeddings", corpus("rq", 4, 2)).await;
    assert_eq!(db.count("SELECT count(*) FROM embedding_dlq").await, 2);
    let requeued = || db.count("SELECT count(*) FROM dlq_outbox WHERE event = 'requeued'");
    let dlq = |args: &[&str]| {
        let mut c = bare();
        c.args(["dlq", "--database-url", &db.url]).args(args);
        output(c)
    };

    let (code, out, err) = dlq(&["requeue"]).await;
    assert_eq!(code, Some(2), "{out}{err}");
    assert!(err.contains("--all"), "{err}");
    assert_eq!(requeued().await, 0, "nothing requeued");

    let (code, out, _) = dlq(&["requeue", "--dry-run"]).await;
    assert_eq!(code, Some(0));
    assert!(out.contains('2'), "{out}");
    assert_eq!(requeued().await, 0);

    let (code, _, err) = dlq(&["requeue", "--all", "--class", "permanent_input"]).await;
    assert_eq!(code, Some(2), "--all and a filter contradict each other: {err}");

    // On a terminal it asks; anything but "yes" changes nothing.
    let on_terminal = |answer: &'static str| {
        let mut c = Command::new("script");
        let cmd = format!("{} dlq requeue --database-url '{}'", env!("CARGO_BIN_EXE_embed-dlq"), db.url);
        c.args(["-qec", &cmd, "/dev/null"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for v in SETTINGS_ENV {
            c.env_remove(v);
        }
        async move {
            use tokio::io::AsyncWriteExt;
            let mut child = c.spawn().expect("`script` (util-linux) runs the command on a pseudo-terminal");
            child.stdin.take().unwrap().write_all(answer.as_bytes()).await.unwrap();
            let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
                .await
                .unwrap()
                .unwrap();
            (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned())
        }
    };
    let (code, out) = on_terminal("no\n").await;
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("requeue all 2 DLQ rows"), "{out}");
    assert_eq!(requeued().await, 0, "not confirmed: nothing requeued");

    let (code, out, err) = dlq(&["requeue", "--class", "permanent_input"]).await;
    assert_eq!(code, Some(0), "a filter needs no confirmation: {out}{err}");
    assert_eq!(requeued().await, 2);

    let (code, out, err) = dlq(&["requeue", "--all", "--json"]).await;
    assert_eq!(code, Some(0), "{out}{err}");
    assert_eq!(requeued().await, 4);

    let (code, out) = on_terminal("yes\n").await;
    assert_eq!(code, Some(0), "{out}");
    assert_eq!(requeued().await, 6, "confirmed on the terminal");
}
