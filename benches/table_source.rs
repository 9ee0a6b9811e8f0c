//! A Postgres table followed at scale (issue 47): the capture's cost in the user's
//! transactions, a big table snapshotted under live writes with SIGKILLs and a Postgres
//! restart, and the lag from a commit to its vector under a steady rate.
//!
//! ```text
//! BENCH_ROWS=1000000 cargo bench --bench table_source
//! ```
//!
//! It brings up a Postgres+Redis pair of its own (`scripts/services.sh` on private ports, so
//! that it can restart Postgres) and runs the release binary's `ingest --from-table` against
//! the built-in mock provider (in process, no latency, no faults: its inputs counted).
//!
//! 1. **Capture cost.** Two tables of `BENCH_COST_ROWS` rows (default 100,000), one plain,
//!    one a table source's (its triggers installed, never followed). Single-row `UPDATE`s
//!    from 4 connections, each statement timed, in alternating batches of 1,000: the plain
//!    table's embedded column; the source table's embedded column (the trigger writes a
//!    change row); the source table's non-embedded column (the trigger's `WHEN` skips it).
//! 2. **Snapshot under writes.** `documents` holds `BENCH_ROWS` rows when `source add-table`
//!    registers it; a writer then runs `BENCH_RATE` statements a second (default 500): a
//!    third touch only `views` (not embedded), the rest change a random row's body, with one
//!    in 20 a delete and one in 20 an insert. The follower (`ingest --from-table`) is
//!    SIGKILLed `BENCH_KILLS` times (default 20) at random moments and restarted; Postgres
//!    is restarted once half way (the follower and the writer ride it out).
//! 3. **Lag.** With the snapshot done, the writer changes `BENCH_LAG_RATE` (default 1,000)
//!    random rows' bodies a second for `BENCH_LAG_SECS` (default 30) s, each stamped with
//!    `clock_timestamp()`; for the rows changed once in that window, the lag is the vector's
//!    `updated_at` minus the row's stamp (one clock: the server's).
//! 4. **Checked with the bench's own oracle:** every row's vector hash equals the content
//!    hash of the bench's rendering of its text; no vector for a deleted row; and 10,000
//!    more `views` updates with the follower idle make 0 provider inputs.

use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

mod common;
use common::env_usize;

use embed_dlq::model::content_hash;
use embed_dlq::testkit::mock_provider::{MockConfig, MockProvider};
use rand::{RngExt, SeedableRng};
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

const BIN: &str = env!("CARGO_BIN_EXE_embed-dlq");
const DIMS: usize = 256;

/// A Postgres+Redis pair of the bench's own, on ports of its own.
struct Services {
    env: Vec<(String, String)>,
    admin_url: String,
}

impl Services {
    fn start() -> Services {
        let main_state =
            std::env::var("EMBED_DLQ_SERVICES_DIR").unwrap_or_else(|_| "/var/tmp/embed-dlq-services".into());
        let n = std::process::id() % 4000;
        let (pg, redis) = (17_000 + n, 29_000 + n);
        let env = vec![
            ("EMBED_DLQ_SERVICES_DIR".to_string(), format!("/var/tmp/embed-dlq-table-bench-{n}")),
            ("EMBED_DLQ_PG_DIR".to_string(), format!("{main_state}/pg")),
            ("EMBED_DLQ_PG_PORT".to_string(), pg.to_string()),
            ("EMBED_DLQ_REDIS_PORT".to_string(), redis.to_string()),
        ];
        let s = Services { env, admin_url: format!("postgres://postgres@127.0.0.1:{pg}/embed_dlq") };
        s.run("up");
        s
    }

    fn run(&self, verb: &str) {
        let out = std::process::Command::new("bash")
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/services.sh"))
            .arg(verb)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(out.status.success(), "services.sh {verb}: {}", String::from_utf8_lossy(&out.stderr));
    }
}

impl Drop for Services {
    fn drop(&mut self) {
        self.run("clean");
        if let Some((_, dir)) = self.env.iter().find(|(k, _)| k == "EMBED_DLQ_SERVICES_DIR") {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn summary(mut xs: Vec<f64>) -> (f64, f64, usize) {
    xs.sort_by(f64::total_cmp);
    (percentile(&xs, 0.5), percentile(&xs, 0.99), xs.len())
}

async fn sql(pool: &sqlx::PgPool, text: &str) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(text.to_string())).execute(pool).await.unwrap();
}

async fn cli(url: &str, args: &[&str]) {
    let out = Command::new(BIN).args(["--database-url", url]).args(args).output().await.unwrap();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Phase 1: per-statement latency of single-row UPDATEs, in µs, per variant.
async fn capture_cost(pool: &sqlx::PgPool, url: &str) {
    let rows = env_usize("BENCH_COST_ROWS", 100_000) as i64;
    for t in ["cost_plain", "cost_captured"] {
        sql(pool, &format!(
            "CREATE TABLE {t} (id bigint PRIMARY KEY, title text NOT NULL, body text, views integer NOT NULL DEFAULT 0);
             INSERT INTO {t} (id, title, body) SELECT i, 'title ' || i, 'body of document ' || i FROM generate_series(1, {rows}) AS i;
"
        ))
        .await;
        sql(pool, &format!("VACUUM ANALYZE {t}")).await;
    }
    cli(
        url,
        &[
            "source",
            "add-table",
            "cost",
            "--table",
            "cost_captured",
            "--key",
            "id",
            "--text",
            r"{title}\n\n{body}",
            "--metadata",
            "views",
            "--target",
            "cost_embeddings",
        ],
    )
    .await;
    let variants = [
        ("plain table, embedded column", "UPDATE cost_plain SET body = 'b ' || $2::bigint WHERE id = $1"),
        ("table source, embedded column", "UPDATE cost_captured SET body = 'b ' || $2::bigint WHERE id = $1"),
        (
            "table source, views only",
            "UPDATE cost_captured SET views = views + 1 WHERE id = $1 AND $2::bigint IS NOT NULL",
        ),
    ];
    let mut lat: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    let mut n = 0i64;
    for _round in 0..5 {
        for (v, (_, stmt)) in variants.iter().enumerate() {
            let mut tasks = Vec::new();
            for worker in 0..4i64 {
                let pool = pool.clone();
                let stmt = stmt.to_string();
                let base = n + worker * 250;
                tasks.push(tokio::spawn(async move {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(base as u64);
                    let mut out = Vec::with_capacity(250);
                    for i in 0..250 {
                        let id = rng.random_range(1..=rows);
                        let t = Instant::now();
                        sqlx::query(sqlx::AssertSqlSafe(stmt.clone()))
                            .bind(id)
                            .bind(base + i)
                            .execute(&pool)
                            .await
                            .unwrap();
                        out.push(t.elapsed().as_secs_f64() * 1e6);
                    }
                    out
                }));
            }
            for t in tasks {
                lat[v].extend(t.await.unwrap());
            }
            n += 1_000;
        }
    }
    let (plain50, plain99, _) = summary(lat[0].clone());
    println!(
        "\n## capture cost: single-row UPDATE latency, 4 connections, {rows} rows a table, 5 x 1,000 statements a variant, alternating"
    );
    println!("| variant | p50 µs | p99 µs | p50 / plain | p99 / plain |");
    println!("| --- | --- | --- | --- | --- |");
    for (v, (name, _)) in variants.iter().enumerate() {
        let (p50, p99, _) = summary(lat[v].clone());
        println!("| {name} | {p50:.0} | {p99:.0} | {:.2} | {:.2} |", p50 / plain50, p99 / plain99);
    }
    cli(url, &["source", "remove", "cost"]).await;
}

/// The bench's own rendering of a row's text (the source's template).
fn text_of(title: &str, body: &Option<String>) -> String {
    format!("{title}\n\n{}", body.clone().unwrap_or_default())
}

fn follower(url: &str, base_url: &str, idle: Option<&str>) -> Child {
    let mut c = Command::new(BIN);
    c.args(["ingest", "--from-table", "docs", "--database-url", url, "--base-url", base_url])
        .args(["--model", "mock", "--retry-base-ms", "50", "--retry-cap-ms", "1000"])
        .env_remove("REDIS_URL")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    if let Some(ms) = idle {
        c.args(["--idle-exit-ms", ms]);
    }
    c.spawn().unwrap()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let rows = env_usize("BENCH_ROWS", 1_000_000) as i64;
    let rate = env_usize("BENCH_RATE", 500) as u64;
    let kills = env_usize("BENCH_KILLS", 20);
    let lag_rate = env_usize("BENCH_LAG_RATE", 1_000) as u64;
    let lag_secs = env_usize("BENCH_LAG_SECS", 30) as u64;
    let services = Services::start();
    let url = services.admin_url.clone();
    let pool = embed_dlq::store::connect(&url, 8).await.unwrap();
    embed_dlq::store::migrate(&pool).await.unwrap();
    cli(&url, &["migrate", "--dimensions", &DIMS.to_string()]).await;
    capture_cost(&pool, &url).await;

    let mock = MockProvider::start(
        MockConfig { dimensions: DIMS, ..MockConfig::default() },
        SocketAddr::from(([127, 0, 0, 1], 0)),
        CancellationToken::new(),
    )
    .await
    .unwrap();
    sql(&pool, &format!(
        "CREATE TABLE documents (id bigint PRIMARY KEY, title text NOT NULL, body text, views integer NOT NULL DEFAULT 0, changed_at timestamptz);
         INSERT INTO documents (id, title, body) SELECT i, 'title ' || i, 'body of document ' || i FROM generate_series(1, {rows}) AS i;
"
    ))
    .await;
    sql(&pool, "VACUUM ANALYZE documents").await;
    cli(
        &url,
        &[
            "source",
            "add-table",
            "docs",
            "--table",
            "documents",
            "--key",
            "id",
            "--text",
            r"{title}\n\n{body}",
            "--metadata",
            "views",
        ],
    )
    .await;

    // The writer: `rate` statements a second until stopped; errors (Postgres restarting) are
    // counted and the statement skipped.
    let stop = CancellationToken::new();
    let (statements, failed, views_only) =
        (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let lag_phase = Arc::new(AtomicBool::new(false));
    let writer = {
        let (pool, stop, statements, failed, views_only, lag_phase) = (
            pool.clone(),
            stop.clone(),
            statements.clone(),
            failed.clone(),
            views_only.clone(),
            lag_phase.clone(),
        );
        tokio::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(47);
            let mut next_id = rows + 1;
            let mut tick = tokio::time::interval(Duration::from_millis(10));
            let mut changed_in_lag: std::collections::HashMap<i64, u32> = Default::default();
            let mut n = 0u64;
            while !stop.is_cancelled() {
                tick.tick().await;
                let lag = lag_phase.load(Ordering::Relaxed);
                let per_tick = if lag { lag_rate / 100 } else { rate / 100 };
                for _ in 0..per_tick.max(1) {
                    n += 1;
                    let id = rng.random_range(1..next_id);
                    let stmt = if lag {
                        *changed_in_lag.entry(id).or_default() += 1;
                        format!(
                            "UPDATE documents SET body = 'lag {n} of ' || id, changed_at = clock_timestamp() WHERE id = {id};"
                        )
                    } else {
                        match n % 60 {
                            k if k % 3 == 0 => {
                                views_only.fetch_add(1, Ordering::Relaxed);
                                format!("UPDATE documents SET views = views + 1 WHERE id = {id};")
                            }
                            1 | 31 | 59 => format!("DELETE FROM documents WHERE id = {id};"),
                            2 | 32 | 58 => {
                                next_id += 1;
                                format!(
                                    "INSERT INTO documents (id, title, body) VALUES ({}, 'new', 'inserted {n}');",
                                    next_id - 1
                                )
                            }
                            _ => format!(
                                "UPDATE documents SET body = 'version {n} of ' || id WHERE id = {id};"
                            ),
                        }
                    };
                    // Each statement its own transaction, as an application's would be.
                    match sqlx::raw_sql(sqlx::AssertSqlSafe(stmt)).execute(&pool).await {
                        Ok(_) => statements.fetch_add(1, Ordering::Relaxed),
                        Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                    };
                }
            }
            changed_in_lag
        })
    };

    // The snapshot under writes: SIGKILLs at random moments, one Postgres restart half way.
    let started = Instant::now();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut child = follower(&url, &mock.base_url(), None);
    let snapshot_done = async |pool: &sqlx::PgPool| -> bool {
        sqlx::query_scalar::<_, bool>(
            "SELECT snapshot_done_at IS NOT NULL FROM embed_table_sources WHERE name = 'docs'",
        )
        .fetch_one(pool)
        .await
        .unwrap_or(false)
    };
    let mut restarted = false;
    for k in 0..kills {
        tokio::time::sleep(Duration::from_millis(rng.random_range(1_000..6_000))).await;
        child.kill().await.unwrap();
        if !restarted && k == kills / 2 {
            let t = Instant::now();
            services.run("down");
            services.run("up");
            restarted = true;
            println!("postgres restarted in {:.1} s (after kill {k})", t.elapsed().as_secs_f64());
        }
        child = follower(&url, &mock.base_url(), None);
    }
    let kills_done = started.elapsed();
    while !snapshot_done(&pool).await {
        if let Ok(Some(_)) = child.try_wait() {
            child = follower(&url, &mock.base_url(), None);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let snapshot_wall = started.elapsed();
    // Let the queue catch up before the lag phase.
    let queued = async |pool: &sqlx::PgPool| -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM embed_table_changes WHERE source = 'docs'")
            .fetch_one(pool)
            .await
            .unwrap()
    };
    while queued(&pool).await > 2 * rate as i64 {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let lag_start: chrono_free::Stamp = chrono_free::now(&pool).await;
    lag_phase.store(true, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(lag_secs)).await;
    stop.cancel();
    let changed_in_lag = writer.await.unwrap();
    while queued(&pool).await > 0 {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;

    // Non-embedded updates with the follower idle: no provider input.
    let inputs_before = mock.control.stats().inputs;
    sql(&pool, "UPDATE documents SET views = views + 1 WHERE id IN (SELECT id FROM documents ORDER BY id LIMIT 10000)").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let views_inputs = mock.control.stats().inputs - inputs_before;
    let views_queued = queued(&pool).await;
    child.kill().await.unwrap();

    // Lag: rows changed once in the window (one clock: the server's).
    let once: Vec<i64> = changed_in_lag.iter().filter(|(_, n)| **n == 1).map(|(id, _)| *id).collect();
    let lags: Vec<f64> = sqlx::query_scalar(
        "SELECT EXTRACT(EPOCH FROM (e.updated_at - d.changed_at))::float8 * 1000
           FROM documents d JOIN doc_embeddings e ON e.doc_id = d.id::text AND e.chunk_index = 0
          WHERE d.id = ANY($1) AND d.changed_at >= $2::timestamptz",
    )
    .bind(&once)
    .bind(lag_start.0)
    .fetch_all(&pool)
    .await
    .unwrap();

    // The oracle.
    let want: std::collections::HashMap<String, String> =
        sqlx::query_as::<_, (i64, String, Option<String>)>("SELECT id, title, body FROM documents")
            .fetch_all(&pool)
            .await
            .unwrap()
            .into_iter()
            .map(|(id, t, b)| (id.to_string(), content_hash("mock", DIMS, &text_of(&t, &b))))
            .collect();
    let got: Vec<(String, i32, String)> =
        sqlx::query_as("SELECT doc_id, chunk_index, content_hash FROM doc_embeddings")
            .fetch_all(&pool)
            .await
            .unwrap();
    let mut stale = 0;
    let mut extra = 0;
    for (doc, idx, hash) in &got {
        match want.get(doc) {
            Some(h) if h == hash && *idx == 0 => {}
            Some(_) => stale += 1,
            None => extra += 1,
        }
    }
    let missing = want.len() as i64 - (got.len() as i64 - extra);
    let dlq: i64 = sqlx::query_scalar("SELECT count(*) FROM embedding_dlq").fetch_one(&pool).await.unwrap();
    let inputs = mock.control.stats().inputs;
    let (l50, l99, ln) = summary(lags);
    println!(
        "\n## {rows} rows snapshotted under {rate} statements/s, {kills} SIGKILLs, one Postgres restart"
    );
    println!("| measure | value |");
    println!("| --- | --- |");
    println!(
        "| writer statements committed (failed while Postgres was down) | {} ({}) |",
        statements.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed)
    );
    println!("| of them views-only (not embedded) | {} |", views_only.load(Ordering::Relaxed));
    println!("| kills over | {:.1} s |", kills_done.as_secs_f64());
    println!("| snapshot done after | {:.1} s |", snapshot_wall.as_secs_f64());
    println!("| rows at the end / vectors | {} / {} |", want.len(), got.len());
    println!(
        "| **lost (row without vector), stale, extra (vector without row)** | **{missing}, {stale}, {extra}** |"
    );
    println!("| DLQ rows | {dlq} |");
    println!(
        "| provider inputs / rows at the end | {inputs} / {} = {:.4} |",
        want.len(),
        inputs as f64 / want.len() as f64
    );
    println!(
        "| 10,000 views-only updates, follower idle: provider inputs, changes queued | {views_inputs}, {views_queued} |"
    );
    println!(
        "| commit to vector at {lag_rate}/s for {lag_secs} s: p50, p99 (rows changed once: n) | {l50:.0} ms, {l99:.0} ms (n = {ln}) |"
    );
    drop(mock);
    pool.close().await;
    drop(services);
    assert!(
        missing == 0 && stale == 0 && extra == 0 && views_inputs == 0,
        "the follower lost or kept something stale"
    );
}

/// The server's clock, read once (no chrono dependency: the timestamp goes back as a bind).
mod chrono_free {
    /// A server timestamp as text.
    pub struct Stamp(pub String);

    pub async fn now(pool: &sqlx::PgPool) -> Stamp {
        Stamp(sqlx::query_scalar("SELECT clock_timestamp()::text").fetch_one(pool).await.unwrap())
    }
}
