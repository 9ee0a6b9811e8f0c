//! Costs that do not grow with the DLQ (issue 19, item 6), measured at two sizes in one run.
//!
//! ```text
//! eval "$(scripts/services.sh up)"
//! BENCH_COSTS_SIZES=10000,1000000 cargo bench --bench costs
//! ```
//!
//! Per size N (`BENCH_COSTS_SIZES`, default `10000,1000000`):
//!
//! - a database of its own with N DLQ rows of ~1 kB (written by SQL in the tool's shapes: 40%
//!   transient and due, 40% transient backing off, 15% permanent, 5% exhausted; `VACUUM
//!   ANALYZE` afterwards, as autovacuum would). Per round (`BENCH_ROUNDS`, default 5),
//!   alternating: the **gauges** as `serve` samples them now (`gauges::dlq_gauges`: fold,
//!   counters, capped index range, two index first entries) and the **old aggregates** (the two
//!   statements `serve` ran before, verbatim).
//! - the triggers' cost on the throughput-critical paths: a park-shaped statement (500 new rows
//!   of ~1 kB, `INSERT ... ON CONFLICT DO UPDATE`), a re-park (the same 500 rows with new
//!   content: the update path) and a replay-shaped delete of the 500, each timed with the
//!   count triggers enabled and disabled (`ALTER TABLE ... DISABLE TRIGGER`), alternating.
//!   Only the DLQ statement is timed: a real park also writes the manifest and the outbox in
//!   the same transaction, so the share shown is an upper bound.
//! - a Redis of its own (a `redis-server` child on a free port) with an events stream of N
//!   entries (~300-byte bodies): one page of the events check (1,000 recorded entry ids from
//!   the middle of the stream, 2 of them deleted) looked up the way the check does now (one
//!   `XRANGE first last COUNT 2000`) and the way it did before (1,000 pipelined
//!   `XRANGE id id COUNT 1`).
//!
//! - a database of its own per size with N published events in the outbox (an hour old, each
//!   with its entry on the events stream of the Redis above) and, per round, 100 more published
//!   now: a whole **incremental reconcile run** (the events check reads the events since the
//!   previous run and a page of witnesses before it) and a whole **full run** (every retained
//!   event), alternating, side by side. Nothing else is in that database, so the runs are the
//!   events check and the fixed cost of the other checks on empty tables.
//!
//! Times are wall-clock medians per round.

use std::time::{Duration, Instant};

mod common;
use common::{env_usize, median, with_database};

use sqlx::{Connection, PgConnection, PgPool};

fn main() {
    if std::env::args().any(|a| a == "--test" || a == "--list") {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    rt.block_on(run());
}

/// The two statements `serve` ran every 5 s before issue 19 (`depth_by_class`, `schedule`).
const OLD_DEPTH: &str = "SELECT error_class, count(*) AS n FROM embedding_dlq GROUP BY 1";
const OLD_SCHEDULE: &str =
    "SELECT count(*) FILTER (WHERE next_retry_at <= now() AND error_class = 'transient'
                                   AND exhausted_at IS NULL) AS ready,
                count(*) FILTER (WHERE next_retry_at > now() AND error_class = 'transient'
                                   AND exhausted_at IS NULL) AS backing_off,
                count(*) FILTER (WHERE exhausted_at IS NOT NULL) AS exhausted,
                COALESCE(extract(epoch FROM now() - min(first_failed_at)), 0)::float8 AS oldest,
                COALESCE(greatest(extract(epoch FROM min(next_retry_at) - now()), 0), 0)::float8 AS next_due
           FROM embedding_dlq";

/// N DLQ rows in the tool's shape, ~1 kB payload each.
const FILL: &str = "INSERT INTO embedding_dlq (target_table, doc_id, chunk_index, content_hash, payload,
                                   error_class, error_reason, attempts, next_retry_at, exhausted_at,
                                   first_failed_at, error_history)
     SELECT 'public.doc_embeddings', 'doc-' || (i / 100), i % 100, md5(i::text),
            jsonb_build_object('doc_id', 'doc-' || (i / 100), 'chunk_index', i % 100,
                               'text', repeat(md5(i::text), 30)),
            CASE WHEN i % 20 < 16 OR i % 20 = 19 THEN 'transient' ELSE 'permanent_input' END,
            'http_503', 3,
            CASE WHEN i % 20 < 8 THEN now() - make_interval(secs => i % 3600)
                 WHEN i % 20 < 16 THEN now() + make_interval(secs => 60 + i % 3600) END,
            CASE WHEN i % 20 = 19 THEN now() END,
            now() - make_interval(secs => i % 86400), '[]'
       FROM generate_series($1::bigint, $2::bigint - 1) i";

/// 500 rows parked in one statement (the park's upsert, minus the manifest and outbox).
const PARK: &str = "INSERT INTO embedding_dlq AS q (target_table, doc_id, chunk_index, content_hash, payload,
                                        error_class, error_reason, attempts, next_retry_at, error_history)
     SELECT 'public.doc_embeddings', 'bench-park', i, md5($1 || i),
            jsonb_build_object('text', repeat(md5($1 || i), 30)), 'transient', 'http_503', 3,
            now() + interval '60 seconds', '[]'
       FROM generate_series(0, 499) i
     ON CONFLICT (target_table, doc_id, chunk_index) DO UPDATE SET
            content_hash = EXCLUDED.content_hash, payload = EXCLUDED.payload,
            generation = nextval('embed_dlq_generation_seq'), next_retry_at = EXCLUDED.next_retry_at
      WHERE q.content_hash IS DISTINCT FROM EXCLUDED.content_hash";
const REPLAYED: &str = "DELETE FROM embedding_dlq WHERE doc_id = 'bench-park'";
const TRIGGERS: [&str; 3] =
    ["embedding_dlq_count_insert", "embedding_dlq_count_update", "embedding_dlq_count_delete"];

struct Row {
    size: usize,
    gauges_ms: f64,
    old_ms: f64,
    park: (f64, f64),
    repark: (f64, f64),
    replay: (f64, f64),
    batched_ms: f64,
    per_id_ms: f64,
    incremental_ms: f64,
    full_ms: f64,
}

async fn run() {
    let admin = std::env::var("DATABASE_URL").expect("DATABASE_URL (eval \"$(scripts/services.sh up)\")");
    let sizes: Vec<usize> = std::env::var("BENCH_COSTS_SIZES")
        .unwrap_or_else(|_| "10000,1000000".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let rounds = env_usize("BENCH_ROUNDS", 5).max(1);
    let redis = PrivateRedis::start().await;
    let mut table = Vec::new();
    for size in sizes {
        let db_name = format!("bench_{}_{size}", std::process::id());
        let mut admin_conn = PgConnection::connect(&admin).await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{db_name}\"")))
            .execute(&mut admin_conn)
            .await
            .unwrap();
        let pool = embed_dlq::store::connect(&with_database(&admin, &db_name), 4).await.unwrap();
        embed_dlq::store::migrate(&pool).await.unwrap();
        let started = Instant::now();
        let step = 100_000;
        for from in (0..size).step_by(step) {
            sqlx::query(FILL)
                .bind(from as i64)
                .bind((from + step).min(size) as i64)
                .execute(&pool)
                .await
                .unwrap();
        }
        sqlx::query("VACUUM ANALYZE embedding_dlq").execute(&pool).await.unwrap();
        println!("{size} DLQ rows loaded in {:.0}s", started.elapsed().as_secs_f64());
        let (gauges_ms, old_ms) = gauges(&pool, rounds).await;
        let (park, repark, replay) = triggers(&pool, rounds).await;
        let (batched_ms, per_id_ms) = events(&redis, size, rounds).await;
        pool.close().await;
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE \"{db_name}\" WITH (FORCE)")))
            .execute(&mut admin_conn)
            .await
            .unwrap();
        let (incremental_ms, full_ms) = reconcile_runs(&admin, &redis, size, rounds).await;
        table.push(Row {
            size,
            gauges_ms,
            old_ms,
            park,
            repark,
            replay,
            batched_ms,
            per_id_ms,
            incremental_ms,
            full_ms,
        });
    }
    println!();
    println!(
        "| DLQ rows / events | gauges now | old aggregates | events page, one range | events page, per id |"
    );
    println!("| --- | --- | --- | --- | --- |");
    for r in &table {
        println!(
            "| {} | {:.2} ms | {:.0} ms | {:.2} ms | {:.2} ms |",
            r.size, r.gauges_ms, r.old_ms, r.batched_ms, r.per_id_ms
        );
    }
    println!();
    println!("| events retained | incremental reconcile run | full reconcile run |");
    println!("| --- | --- | --- |");
    for r in &table {
        println!("| {} | {:.1} ms | {:.0} ms |", r.size, r.incremental_ms, r.full_ms);
    }
    println!();
    println!("| DLQ rows | park 500 (triggers / none) | re-park 500 | replay-delete 500 |");
    println!("| --- | --- | --- | --- |");
    for r in &table {
        let cell =
            |(on, off): (f64, f64)| format!("{on:.1} / {off:.1} ms ({:+.0}%)", (on / off - 1.0) * 100.0);
        println!("| {} | {} | {} | {} |", r.size, cell(r.park), cell(r.repark), cell(r.replay));
    }
}

async fn gauges(pool: &PgPool, rounds: usize) -> (f64, f64) {
    let (mut now, mut old) = (Vec::new(), Vec::new());
    let mut conn = pool.acquire().await.unwrap();
    for _ in 0..rounds {
        let t = Instant::now();
        let g = embed_dlq::gauges::dlq_gauges(&mut conn).await.unwrap();
        now.push(ms(t.elapsed()));
        let t = Instant::now();
        sqlx::query(OLD_DEPTH).fetch_all(&mut *conn).await.unwrap();
        sqlx::query(OLD_SCHEDULE).fetch_one(&mut *conn).await.unwrap();
        old.push(ms(t.elapsed()));
        std::hint::black_box(g);
    }
    (median(now), median(old))
}

async fn set_triggers(pool: &PgPool, on: bool) {
    for t in TRIGGERS {
        let verb = if on { "ENABLE" } else { "DISABLE" };
        sqlx::query(sqlx::AssertSqlSafe(format!("ALTER TABLE embedding_dlq {verb} TRIGGER {t}")))
            .execute(pool)
            .await
            .unwrap();
    }
}

/// Medians of (with triggers, without) for park, re-park and replay-delete of 500 rows.
async fn triggers(pool: &PgPool, rounds: usize) -> ((f64, f64), (f64, f64), (f64, f64)) {
    let mut samples: [[Vec<f64>; 2]; 3] = Default::default();
    for round in 0..rounds * 4 {
        for on in [true, false] {
            set_triggers(pool, on).await;
            let k = usize::from(!on);
            let t = Instant::now();
            sqlx::query(PARK).bind(format!("a{round}")).execute(pool).await.unwrap();
            samples[0][k].push(ms(t.elapsed()));
            let t = Instant::now();
            sqlx::query(PARK).bind(format!("b{round}")).execute(pool).await.unwrap();
            samples[1][k].push(ms(t.elapsed()));
            let t = Instant::now();
            sqlx::query(REPLAYED).execute(pool).await.unwrap();
            samples[2][k].push(ms(t.elapsed()));
        }
    }
    set_triggers(pool, true).await;
    let m = |s: &[Vec<f64>; 2]| (median(s[0].clone()), median(s[1].clone()));
    (m(&samples[0]), m(&samples[1]), m(&samples[2]))
}

/// One page of the events check against a stream of `size` entries, both ways.
async fn events(redis: &PrivateRedis, size: usize, rounds: usize) -> (f64, f64) {
    let client = redis::Client::open(redis.url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let key = format!("bench:events:{size}");
    let body = "x".repeat(300);
    let mut ids: Vec<String> = Vec::with_capacity(size);
    for chunk in (0..size).collect::<Vec<_>>().chunks(1000) {
        let mut pipe = redis::pipe();
        for i in chunk {
            pipe.cmd("XADD").arg(&key).arg("*").arg("seq").arg(*i).arg("body").arg(&body);
        }
        let added: Vec<String> = pipe.query_async(&mut conn).await.unwrap();
        ids.extend(added);
    }
    let page: Vec<String> = ids[size / 2..(size / 2 + 1000).min(size)].to_vec();
    let _: i64 =
        redis::cmd("XDEL").arg(&key).arg(&page[10]).arg(&page[500]).query_async(&mut conn).await.unwrap();
    let (mut batched, mut per_id) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let t = Instant::now();
        let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
            .arg(&key)
            .arg(page.first().unwrap())
            .arg(page.last().unwrap())
            .arg("COUNT")
            .arg(page.len() * 2)
            .query_async(&mut conn)
            .await
            .unwrap();
        batched.push(ms(t.elapsed()));
        assert_eq!(reply.ids.len(), page.len() - 2);
        let t = Instant::now();
        let mut pipe = redis::pipe();
        for id in &page {
            pipe.cmd("XRANGE").arg(&key).arg(id).arg(id).arg("COUNT").arg(1);
        }
        let hits: Vec<Vec<redis::Value>> = pipe.query_async(&mut conn).await.unwrap();
        per_id.push(ms(t.elapsed()));
        assert_eq!(hits.iter().filter(|h| h.is_empty()).count(), 2);
    }
    let _: i64 = redis::cmd("DEL").arg(&key).query_async(&mut conn).await.unwrap();
    (median(batched), median(per_id))
}

/// N published events an hour old, outbox rows in the tool's shape with their stream entries.
const OLD_EVENTS: &str = "INSERT INTO dlq_outbox (event, doc_id, chunk_index, body, stream, target_table,
                                 created_at, published_at, entry_id)
     SELECT 'parked', 'doc-' || ((i + $2) / 100), (i + $2) % 100, '{}', 'events', 'public.doc_embeddings',
            now() - interval '1 hour', now() - interval '1 hour', e
       FROM unnest($1::text[]) WITH ORDINALITY AS u(e, i)";
/// The events of one round: published now.
const NEW_EVENTS: &str = "INSERT INTO dlq_outbox (event, doc_id, chunk_index, body, stream, target_table,
                                 published_at, entry_id)
     SELECT 'parked', 'new-' || $2, i, '{}', 'events', 'public.doc_embeddings', now(), e
       FROM unnest($1::text[]) WITH ORDINALITY AS u(e, i)";

/// Makes every outbox row published, as a relay that published them all would leave things:
/// the position past every committed transaction, and each event's dedup record (field
/// `event_id` of the shard's hash of its hour) naming its entry (`entry_id`, kept by the
/// loaders above for this).
/// Rows up to id `after` are taken as recorded already; returns the highest id recorded.
async fn mark_published(
    pool: &sqlx::PgPool,
    conn: &mut redis::aio::MultiplexedConnection,
    prefix: &str,
    after: i64,
) -> i64 {
    let rows: Vec<(String, String, String, i64)> = sqlx::query_as(
        "SELECT embed_dlq_dedup_hour(created_at), event_id::text, entry_id, id FROM dlq_outbox
          WHERE entry_id IS NOT NULL AND txid IS NOT NULL AND id > $1",
    )
    .bind(after)
    .fetch_all(pool)
    .await
    .unwrap();
    for chunk in rows.chunks(1000) {
        let mut pipe = redis::pipe();
        for (hour, event_id, entry_id, _) in chunk {
            pipe.hset(format!("{{{prefix}}}:published:{hour}"), event_id, entry_id).ignore();
        }
        let _: () = pipe.query_async(conn).await.unwrap();
    }
    sqlx::query(
        "UPDATE relay_position SET lower = pg_current_snapshot(), upper = NULL, after_id = 0, last_id = 0",
    )
    .execute(pool)
    .await
    .unwrap();
    rows.iter().map(|r| r.3).max().unwrap_or(after)
}

/// Adds `n` entries to `stream`; returns their ids.
async fn add_entries(conn: &mut redis::aio::MultiplexedConnection, stream: &str, n: usize) -> Vec<String> {
    let mut ids = Vec::with_capacity(n);
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        let mut pipe = redis::pipe();
        for i in chunk {
            pipe.cmd("XADD").arg(stream).arg("*").arg("seq").arg(*i).arg("body").arg("x".repeat(300));
        }
        let added: Vec<String> = pipe.query_async(conn).await.unwrap();
        ids.extend(added);
    }
    ids
}

/// Whole reconcile runs over a database whose outbox retains `size` published events:
/// (incremental, full) medians.
async fn reconcile_runs(admin: &str, redis: &PrivateRedis, size: usize, rounds: usize) -> (f64, f64) {
    use embed_dlq::reconcile::{Check, Mode, ReconcileConfig, Reconciler, Sweep};
    let db_name = format!("bench_rec_{}_{size}", std::process::id());
    let mut admin_conn = PgConnection::connect(admin).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{db_name}\"")))
        .execute(&mut admin_conn)
        .await
        .unwrap();
    let pool = embed_dlq::store::connect(&with_database(admin, &db_name), 4).await.unwrap();
    embed_dlq::store::migrate(&pool).await.unwrap();
    let keys = embed_dlq::streams::StreamKeys::new(&format!("bench-rec-{size}"));
    let client = redis::Client::open(redis.url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let started = Instant::now();
    let ids = add_entries(&mut conn, &keys.events(), size).await;
    for (n, chunk) in ids.chunks(50_000).enumerate() {
        sqlx::query(OLD_EVENTS).bind(chunk).bind((n * 50_000) as i64).execute(&pool).await.unwrap();
    }
    let mut recorded = mark_published(&pool, &mut conn, keys.prefix(), 0).await;
    sqlx::query("VACUUM ANALYZE dlq_outbox").execute(&pool).await.unwrap();
    println!("{size} published events loaded in {:.0}s", started.elapsed().as_secs_f64());
    let store = embed_dlq::store::Store::open(pool.clone(), "doc_embeddings").await.unwrap();
    let managed =
        embed_dlq::streams::managed(&embed_dlq::streams::client(&redis.url).unwrap()).await.unwrap();
    let config = ReconcileConfig { events_maxlen: 0, ..ReconcileConfig::default() };
    let mut reconciler = Reconciler { store, redis: Some(managed), keys: keys.clone(), config };
    let mut run = async |sweep: Sweep| {
        let t = Instant::now();
        let report = reconciler.run_sweep(Mode::Check, Some(sweep)).await.unwrap();
        let elapsed = ms(t.elapsed());
        assert_eq!(report.get(Check::MissingEvents).found, 0, "{report:#?}");
        elapsed
    };
    run(Sweep::Full).await;
    let (mut incremental, mut full) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let new = add_entries(&mut conn, &keys.events(), 100).await;
        sqlx::query(NEW_EVENTS).bind(&new).bind(round as i64).execute(&pool).await.unwrap();
        recorded = mark_published(&pool, &mut conn, keys.prefix(), recorded).await;
        incremental.push(run(Sweep::Incremental).await);
        full.push(run(Sweep::Full).await);
    }
    let _: i64 = redis::cmd("DEL").arg(keys.events()).query_async(&mut conn).await.unwrap();
    pool.close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE \"{db_name}\" WITH (FORCE)")))
        .execute(&mut admin_conn)
        .await
        .unwrap();
    (median(incremental), median(full))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// A `redis-server` of the bench's own on a free port (the shared one serves other work).
struct PrivateRedis {
    url: String,
    child: std::process::Child,
}

impl PrivateRedis {
    async fn start() -> PrivateRedis {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut child = std::process::Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("redis-server (scripts/services.sh installs it)");
        let url = format!("redis://127.0.0.1:{port}/");
        let client = redis::Client::open(url.as_str()).unwrap();
        for _ in 0..100 {
            if let Ok(mut c) = client.get_multiplexed_async_connection().await
                && redis::cmd("PING").query_async::<String>(&mut c).await.is_ok()
            {
                return PrivateRedis { url, child };
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("redis-server did not come up on {port}");
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
