//! Reconcile at scale: full, incremental and deep runs against the seed's bare anti-join over
//! the same rows, measured side by side in one run.
//!
//! ```text
//! eval "$(scripts/services.sh up)"
//! BENCH_RECONCILE_ROWS=100000,1000000 cargo bench --bench reconcile
//! ```
//!
//! For each size N it makes a database of its own with N manifest rows: 99% stored with a
//! 768-dim vector, 1% parked with a DLQ row (written by SQL, in the shapes the tool writes;
//! `VACUUM ANALYZE` afterwards, as autovacuum would). Then, per round (`BENCH_ROUNDS`,
//! default 5), alternating so that all see the same machine noise:
//!
//! - **seed**: the seed's reconciliation query, verbatim (`LEFT JOIN … WHERE e.doc_id IS NULL
//!   AND d.doc_id IS NULL`), every row fetched;
//! - **full**: `Reconciler::run_sweep(Check, Full)`, every check, the stream checks included
//!   when `REDIS_URL` is set (a fresh prefix: empty streams);
//! - **incremental**: after `BENCH_CHANGED` chunks (default 1000) were re-stored with new
//!   content (manifest, vector and `updated_at` changed in one transaction, as an ingest
//!   does), `run_sweep(Check, Incremental)`.
//!
//! A deep run (every vector read: what every run did before sweeps existed) is timed
//! `BENCH_DEEP_ROUNDS` times (default 2). Times are wall-clock around the call (lock and
//! horizon included); ratios are medians of the per-round ratios to the seed query. The
//! changes are made 2.5 s before the incremental run, as periodic runs are minutes apart (a
//! run re-checks the 2 s of changes before its predecessor's horizon).

use std::time::{Duration, Instant};

mod common;
use common::{change_reconcile_rows, env_usize, load_reconcile_rows, median, with_database};

use embed_dlq::reconcile::{Mode, ReconcileConfig, Reconciler, Sweep};
use embed_dlq::store::Store;
use sqlx::{Connection, PgConnection, PgPool};

fn main() {
    // `cargo test --benches` runs benches in test mode: do nothing there.
    if std::env::args().any(|a| a == "--test" || a == "--list") {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    rt.block_on(run());
}

/// The seed's reconciliation query, as the seed writes it.
const SEED_QUERY: &str = "SELECT m.doc_id, m.chunk_index
FROM ingest_manifest m
LEFT JOIN doc_embeddings e USING (doc_id, chunk_index)
LEFT JOIN embedding_dlq   d USING (doc_id, chunk_index)
WHERE e.doc_id IS NULL AND d.doc_id IS NULL";

async fn run() {
    let admin = std::env::var("DATABASE_URL").expect("DATABASE_URL (eval \"$(scripts/services.sh up)\")");
    let sizes: Vec<usize> = std::env::var("BENCH_RECONCILE_ROWS")
        .unwrap_or_else(|_| "100000".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let rounds = env_usize("BENCH_ROUNDS", 5).max(1);
    let deep_rounds = env_usize("BENCH_DEEP_ROUNDS", 2).max(1);
    let changed = env_usize("BENCH_CHANGED", 1000);
    let mut table = Vec::new();
    for size in sizes {
        let db_name = format!("bench_{}_{size}", std::process::id());
        let mut conn = PgConnection::connect(&admin).await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{db_name}\"")))
            .execute(&mut conn)
            .await
            .unwrap();
        let url = with_database(&admin, &db_name);
        let pool = embed_dlq::store::connect(&url, 8).await.unwrap();
        embed_dlq::store::migrate(&pool).await.unwrap();
        let started = Instant::now();
        load_reconcile_rows(&pool, size).await;
        println!("{size} manifest rows loaded in {:.0}s", started.elapsed().as_secs_f64());
        let row = measure(&pool, size, rounds, deep_rounds, changed).await;
        table.push(row);
        pool.close().await;
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE \"{db_name}\" WITH (FORCE)")))
            .execute(&mut conn)
            .await
            .unwrap();
    }
    println!();
    println!(
        "| manifest rows | seed anti-join | full | incremental ({changed} changed) | deep | full / seed | incremental / seed | deep / seed |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for r in table {
        println!(
            "| {} | {:.0} ms | {:.0} ms | {:.1} ms | {:.0} ms | {:.2} | {:.3} | {:.1} |",
            r.size,
            r.seed_ms,
            r.full_ms,
            r.incremental_ms,
            r.deep_ms,
            r.full_ratio,
            r.incremental_ratio,
            r.deep_ratio
        );
    }
}

/// Medians of one size.
struct Row {
    size: usize,
    seed_ms: f64,
    full_ms: f64,
    incremental_ms: f64,
    deep_ms: f64,
    full_ratio: f64,
    incremental_ratio: f64,
    deep_ratio: f64,
}

async fn timed<F: std::future::Future>(f: F) -> (Duration, F::Output) {
    let start = Instant::now();
    let out = f.await;
    (start.elapsed(), out)
}

async fn seed_query(pool: &PgPool) -> Duration {
    let (took, rows) = timed(sqlx::query(SEED_QUERY).fetch_all(pool)).await;
    assert!(rows.unwrap().is_empty(), "the bench data has no leak");
    took
}

async fn measure(pool: &PgPool, size: usize, rounds: usize, deep_rounds: usize, changed: usize) -> Row {
    let redis = match std::env::var("REDIS_URL") {
        Ok(u) => Some(embed_dlq::streams::managed(&embed_dlq::streams::client(&u).unwrap()).await.unwrap()),
        Err(_) => None,
    };
    let prefix = format!("bench-reconcile-{}-{size}", std::process::id());
    let mut r = Reconciler {
        store: Store::open(pool.clone(), "doc_embeddings").await.unwrap(),
        redis,
        keys: embed_dlq::streams::StreamKeys::new(&prefix),
        config: ReconcileConfig::default(),
    };
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let mut run = async |sweep: Sweep| {
        let (took, report) = timed(r.run_sweep(Mode::Check, Some(sweep))).await;
        let report = report.unwrap();
        assert_eq!(report.total_found(), 0, "{report:#?}");
        assert_eq!(report.sweep, sweep);
        took
    };
    // Establishes the resume points.
    run(Sweep::Deep).await;
    let (mut seed, mut full, mut inc) = (vec![], vec![], vec![]);
    let (mut full_ratio, mut inc_ratio) = (vec![], vec![]);
    for round in 0..rounds {
        let s = ms(seed_query(pool).await);
        let f = ms(run(Sweep::Full).await);
        change_reconcile_rows(pool, round * changed, changed, round).await;
        // Periodic runs are minutes apart, changes come in between: more than the 2 s of
        // changes a run re-checks before its predecessor's horizon (without the pause the
        // next full sweep would read this round's changed vectors again).
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let i = ms(run(Sweep::Incremental).await);
        println!("{size} rows, round {round}: seed {s:.0} ms, full {f:.0} ms, incremental {i:.1} ms");
        full_ratio.push(f / s);
        inc_ratio.push(i / s);
        seed.push(s);
        full.push(f);
        inc.push(i);
    }
    let (mut deep, mut deep_ratio) = (vec![], vec![]);
    for round in 0..deep_rounds {
        let s = ms(seed_query(pool).await);
        let d = ms(run(Sweep::Deep).await);
        println!("{size} rows, deep round {round}: seed {s:.0} ms, deep {d:.0} ms");
        deep_ratio.push(d / s);
        deep.push(d);
    }
    Row {
        size,
        seed_ms: median(seed),
        full_ms: median(full),
        incremental_ms: median(inc),
        deep_ms: median(deep),
        full_ratio: median(full_ratio),
        incremental_ratio: median(inc_ratio),
        deep_ratio: median(deep_ratio),
    }
}
