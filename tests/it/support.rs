//! Shared test fixtures: a fresh migrated database per test on the real Postgres, the mock
//! provider on a random port, and pipelines wired to both.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};

use embed_dlq::config::{IngestArgs, IngestSettings, ProviderArgs, RetryArgs, ServiceArgs};
use embed_dlq::ingest::Pipeline;
use embed_dlq::mock_provider::{MockConfig, MockProvider};
use sqlx::{Connection, PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

/// A database of its own, migrated, on the server `DATABASE_URL` points at.
pub struct TestDb {
    pub url: String,
    pub pool: PgPool,
}

fn admin_url() -> String {
    std::env::var("DATABASE_URL").expect(
        "DATABASE_URL is not set: run the tests with scripts/test.sh (it starts Postgres+pgvector and Redis)",
    )
}

/// `url` with its database name replaced.
fn with_database(url: &str, db: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let scheme_end = base.find("://").map(|i| i + 3).unwrap_or(0);
    let path_start = base[scheme_end..].find('/').map(|i| i + scheme_end).unwrap_or(base.len());
    let mut out = format!("{}/{db}", &base[..path_start]);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    out
}

impl TestDb {
    pub async fn new() -> TestDb {
        let db = TestDb::unmigrated().await;
        embed_dlq::store::migrate(&db.pool).await.expect("migrate test database");
        db
    }

    /// A database of its own with no migration applied yet.
    pub async fn unmigrated() -> TestDb {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let admin = admin_url();
        let name = format!(
            "it_{}_{}_{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::SeqCst),
            rand::random::<u32>()
        );
        let mut conn = PgConnection::connect(&admin).await.expect("connect to DATABASE_URL");
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
            .execute(&mut conn)
            .await
            .expect("create test database");
        conn.close().await.ok();
        let url = with_database(&admin, &name);
        let pool = embed_dlq::store::connect(&url, 4).await.expect("connect to test database");
        TestDb { url, pool }
    }

    pub async fn count(&self, sql: &'static str) -> i64 {
        sqlx::query_scalar(sql).fetch_one(&self.pool).await.expect(sql)
    }

    /// The seed's reconciliation query (manifest rows with neither a vector nor a DLQ row) for
    /// the default table.
    pub async fn leaks(&self) -> i64 {
        self.leaks_in("doc_embeddings").await
    }

    /// The seed's reconciliation query for one target table, joined on the table identity.
    pub async fn leaks_in(&self, table: &str) -> i64 {
        let sql = format!(
            "SELECT count(*) FROM ingest_manifest m
               LEFT JOIN {table} e ON e.doc_id = m.doc_id AND e.chunk_index = m.chunk_index
               LEFT JOIN embedding_dlq d
                 ON d.target_table = m.target_table AND d.doc_id = m.doc_id AND d.chunk_index = m.chunk_index
              WHERE m.target_table = embed_dlq_table_name('{table}'::regclass)
                AND e.doc_id IS NULL AND d.doc_id IS NULL"
        );
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).fetch_one(&self.pool).await.unwrap()
    }

    /// The seed's duplicate query for the default table.
    pub async fn duplicates(&self) -> i64 {
        self.duplicates_in("doc_embeddings").await
    }

    /// The seed's duplicate query for one target table.
    pub async fn duplicates_in(&self, table: &str) -> i64 {
        let sql = format!(
            "SELECT count(*) FROM (SELECT doc_id, chunk_index FROM {table}
               GROUP BY doc_id, chunk_index HAVING count(*) > 1) d"
        );
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).fetch_one(&self.pool).await.unwrap()
    }

    /// Stronger than the seed's queries: every manifest row of the default table agrees with
    /// where the chunk is.
    pub async fn manifest_disagreements(&self) -> i64 {
        self.count(
            "SELECT count(*) FROM ingest_manifest m
               LEFT JOIN doc_embeddings e ON e.doc_id = m.doc_id AND e.chunk_index = m.chunk_index
               LEFT JOIN embedding_dlq d
                 ON d.target_table = m.target_table AND d.doc_id = m.doc_id AND d.chunk_index = m.chunk_index
              WHERE m.target_table = 'public.doc_embeddings'
                AND NOT (
                    (m.status = 'stored' AND e.content_hash = m.content_hash AND d.id IS NULL)
                 OR (m.status IN ('parked', 'exhausted') AND d.content_hash = m.content_hash))",
        )
        .await
    }
}

pub async fn start_mock(config: MockConfig) -> MockProvider {
    MockProvider::start(config, SocketAddr::from(([127, 0, 0, 1], 0)), CancellationToken::new())
        .await
        .expect("start mock provider")
}

/// Settings for a test run: fast retries, short timeouts, small batches.
pub fn settings(db: &TestDb, mock: &MockProvider) -> IngestSettings {
    IngestSettings::resolve(
        ServiceArgs { database_url: Some(db.url.clone()), redis_url: None },
        ProviderArgs {
            base_url: Some(mock.base_url()),
            model: Some("mock".into()),
            request_timeout_ms: Some(400),
            ..Default::default()
        },
        IngestArgs { batch_max_inputs: Some(32), concurrency: Some(4), ..Default::default() },
        RetryArgs {
            retry_max_attempts: Some(3),
            retry_base_ms: Some(5),
            retry_cap_ms: Some(40),
            breaker_failure_threshold: Some(1000),
            ..Default::default()
        },
        None,
    )
    .expect("valid test settings")
}

pub async fn pipeline(settings: &IngestSettings) -> Pipeline {
    settings.pipeline().await.expect("build pipeline")
}

/// Reader over in-memory JSONL.
pub fn input(bytes: Vec<u8>) -> std::io::Cursor<Vec<u8>> {
    std::io::Cursor::new(bytes)
}

/// One JSONL line.
pub fn line(doc: &str, idx: i32, text: &str) -> String {
    format!("{}\n", serde_json::json!({"doc_id": doc, "chunk_index": idx, "text": text}))
}

#[test]
fn database_url_rewrite() {
    assert_eq!(with_database("postgres://u@h:1/db", "x"), "postgres://u@h:1/x");
    assert_eq!(
        with_database("postgres://u@h:1/db?sslmode=disable", "x"),
        "postgres://u@h:1/x?sslmode=disable"
    );
    assert_eq!(with_database("postgres://u@h:1", "x"), "postgres://u@h:1/x");
}

/// The Redis named by `REDIS_URL` (scripts/test.sh starts one).
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").expect("REDIS_URL is not set: run the tests with scripts/test.sh")
}

/// Stream keys under a prefix of their own, so tests never see each other's entries.
pub fn fresh_keys() -> embed_dlq::streams::StreamKeys {
    embed_dlq::streams::StreamKeys::new(&format!("it-{}-{}", std::process::id(), rand::random::<u32>()))
}

pub async fn redis() -> redis::aio::ConnectionManager {
    let client = embed_dlq::streams::client(&redis_url()).unwrap();
    embed_dlq::streams::managed(&client).await.expect("connect to REDIS_URL")
}

/// A Redis of this test's own (so it can be flushed or killed), on a free port; stopped on
/// drop.
pub struct PrivateRedis {
    pub url: String,
    child: std::process::Child,
}

impl PrivateRedis {
    pub async fn start() -> PrivateRedis {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let mut child = std::process::Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("redis-server (scripts/services.sh installs it)");
        let url = format!("redis://127.0.0.1:{port}/");
        let client = embed_dlq::streams::client(&url).unwrap();
        for _ in 0..100 {
            if let Ok(mut c) = client.get_multiplexed_async_connection().await
                && redis::cmd("PING").query_async::<String>(&mut c).await.is_ok()
            {
                return PrivateRedis { url, child };
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("private redis-server did not come up on {port}");
    }

    pub async fn manager(&self) -> redis::aio::ConnectionManager {
        embed_dlq::streams::managed(&embed_dlq::streams::client(&self.url).unwrap()).await.unwrap()
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Relays every unpublished outbox row to `keys`; returns the new stream entries.
pub async fn relay_all(db: &TestDb, keys: &embed_dlq::streams::StreamKeys) -> u64 {
    use embed_dlq::relay::{Relay, RelayConfig};
    let mut relay = Relay::new(db.pool.clone(), redis().await, keys.clone(), RelayConfig::default());
    let mut published = 0;
    loop {
        let c = relay.run_once().await.unwrap();
        published += c.published;
        if c.claimed == 0 {
            return published;
        }
    }
}

/// A reconciler over `db` and the streams under `keys`.
pub async fn reconciler(
    db: &TestDb,
    keys: &embed_dlq::streams::StreamKeys,
    config: embed_dlq::reconcile::ReconcileConfig,
) -> embed_dlq::reconcile::Reconciler {
    let p = pipeline(&settings(db, &start_mock(MockConfig::default()).await)).await;
    embed_dlq::reconcile::Reconciler {
        store: p.store,
        redis: Some(redis().await),
        keys: keys.clone(),
        config,
    }
}

/// Reconcile thresholds that report lost work at once and never a young backlog or stall.
pub fn immediate() -> embed_dlq::reconcile::ReconcileConfig {
    embed_dlq::reconcile::ReconcileConfig {
        outbox_stuck_after: std::time::Duration::from_secs(3600),
        replay_stall_after: std::time::Duration::from_secs(3600),
        lost_work_grace: std::time::Duration::ZERO,
        ..Default::default()
    }
}

/// Makes every scheduled DLQ row due now (instead of waiting out the DLQ backoff).
pub async fn make_due(db: &TestDb) {
    sqlx::query("UPDATE embedding_dlq SET next_retry_at = now() WHERE next_retry_at IS NOT NULL")
        .execute(&db.pool)
        .await
        .unwrap();
}
