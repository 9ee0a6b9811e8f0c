//! Shared test fixtures: the kit's fresh database per test (always dropped) with the seed's
//! checks on it, the mock provider on a random port, pipelines wired to both, and Redis helpers.

use std::net::SocketAddr;

use embed_dlq::config::{IngestArgs, IngestSettings, ProviderArgs, RetryArgs, ServiceArgs};
use embed_dlq::ingest::Pipeline;
use embed_dlq::testkit::mock_provider::{MockConfig, MockProvider};
use tokio_util::sync::CancellationToken;

/// A fresh database per test, always dropped (the kit's [`TestDb`]); the seed's checks on it
/// come from [`SeedChecks`].
pub use embed_dlq::testkit::TestDb;

/// The suite's checks on a test database, written in the test crate (never the product's own
/// statements, so a bug there cannot blind the product and its tests together): the seed
/// write-up's leak and duplicate queries, literally, adapted only to the table names; a
/// stronger manifest agreement check; and the corpus oracle ([`SeedChecks::unaccounted`]).
pub trait SeedChecks {
    /// The seed's reconciliation query (manifest rows with neither a vector nor a DLQ row) for
    /// the default table.
    async fn leaks(&self) -> i64;
    /// The seed's reconciliation query for one target table (name as the test created it,
    /// schema `public` unless qualified), joined on the table identity.
    async fn leaks_in(&self, table: &str) -> i64;
    /// The seed's duplicate query for the default table. It cannot fail while the table has
    /// its unique key (the store refuses a table without one): a test proves "each chunk
    /// once" with [`SeedChecks::unaccounted`] against its corpus.
    async fn duplicates(&self) -> i64;
    /// Stronger than the seed's queries: every manifest row of the default table agrees with
    /// where the chunk is.
    async fn manifest_disagreements(&self) -> i64;
    /// The corpus oracle for `table`: every key of `expected` (what the test wrote, see
    /// [`corpus_keys`]) has one vector or one DLQ row (or both: an older vector beside the
    /// parked newest text), no key has two of either, and no vector or DLQ row exists for a
    /// key outside `expected`. Returns the problems (empty: all accounted for).
    async fn unaccounted(
        &self,
        table: &str,
        expected: &std::collections::BTreeSet<(String, i32)>,
    ) -> Vec<String>;
}

/// `table` as the manifest and the DLQ name it (`public.t` for an unqualified `t`).
fn qualified(table: &str) -> String {
    if table.contains('.') { table.to_string() } else { format!("public.{table}") }
}

/// The keys of a JSONL corpus, read by the test crate itself (serde_json, not the product's
/// reader): each line that is a JSON object (once decoded lossily) with a string `doc_id` and
/// an integer `chunk_index`. Lines that are not (broken JSON, missing keys) are rejected by
/// the product, never stored or parked under a key.
pub fn corpus_keys(corpus: &[u8]) -> std::collections::BTreeSet<(String, i32)> {
    corpus
        .split(|b| *b == b'\n')
        // Invalid UTF-8 in a text does not hide the line's key: the product parks such a
        // line as `invalid_record` under it.
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(&String::from_utf8_lossy(line)).ok())
        .filter_map(|v| {
            let doc = v.get("doc_id")?.as_str()?.to_string();
            let idx = i32::try_from(v.get("chunk_index")?.as_i64()?).ok()?;
            Some((doc, idx))
        })
        .collect()
}

impl SeedChecks for TestDb {
    async fn leaks(&self) -> i64 {
        self.leaks_in("doc_embeddings").await
    }

    async fn leaks_in(&self, table: &str) -> i64 {
        // The seed's query; the DLQ and the manifest hold several tables, so both joins and
        // the manifest are narrowed to this one.
        let sql = format!(
            "SELECT count(*) FROM (
                 SELECT m.doc_id, m.chunk_index
                 FROM ingest_manifest m
                 LEFT JOIN {table} e USING (doc_id, chunk_index)
                 LEFT JOIN embedding_dlq d
                        ON d.target_table = m.target_table AND d.doc_id = m.doc_id
                       AND d.chunk_index = m.chunk_index
                 WHERE e.doc_id IS NULL AND d.doc_id IS NULL
                   AND m.target_table = '{}') leaks",
            qualified(table)
        );
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).fetch_one(&self.pool).await.unwrap()
    }

    async fn duplicates(&self) -> i64 {
        self.count(
            "SELECT count(*) FROM (
                 SELECT doc_id, chunk_index, count(*)
                 FROM doc_embeddings
                 GROUP BY doc_id, chunk_index
                 HAVING count(*) > 1) dups",
        )
        .await
    }

    async fn manifest_disagreements(&self) -> i64 {
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

    async fn unaccounted(
        &self,
        table: &str,
        expected: &std::collections::BTreeSet<(String, i32)>,
    ) -> Vec<String> {
        use std::collections::BTreeMap;
        let counts = |sql: String| async move {
            let rows: Vec<(String, i32, i64)> =
                sqlx::query_as(sqlx::AssertSqlSafe(sql)).fetch_all(&self.pool).await.unwrap();
            rows.into_iter().map(|(d, i, n)| ((d, i), n)).collect::<BTreeMap<(String, i32), i64>>()
        };
        let vectors =
            counts(format!("SELECT doc_id, chunk_index, count(*) FROM {table} GROUP BY 1, 2")).await;
        let parked = counts(format!(
            "SELECT doc_id, chunk_index, count(*) FROM embedding_dlq WHERE target_table = '{}' GROUP BY 1, 2",
            qualified(table)
        ))
        .await;
        let mut problems = Vec::new();
        for key in expected {
            let (v, d) = (vectors.get(key).copied().unwrap_or(0), parked.get(key).copied().unwrap_or(0));
            if v + d == 0 {
                problems.push(format!("{}#{}: neither a vector nor a DLQ row", key.0, key.1));
            }
            if v > 1 || d > 1 {
                problems.push(format!("{}#{}: {v} vectors, {d} DLQ rows", key.0, key.1));
            }
        }
        for key in vectors.keys().chain(parked.keys()) {
            if !expected.contains(key) {
                problems.push(format!("{}#{}: not in the corpus", key.0, key.1));
            }
        }
        problems.sort();
        problems.dedup();
        problems
    }
}

/// Panics with the first problems unless every chunk of `expected` is accounted for in the
/// default table ([`SeedChecks::unaccounted`]).
pub async fn assert_corpus_accounted(db: &TestDb, expected: &std::collections::BTreeSet<(String, i32)>) {
    assert_corpus_accounted_in(db, "doc_embeddings", expected).await;
}

/// [`assert_corpus_accounted`] for one target table.
pub async fn assert_corpus_accounted_in(
    db: &TestDb,
    table: &str,
    expected: &std::collections::BTreeSet<(String, i32)>,
) {
    let problems = db.unaccounted(table, expected).await;
    assert!(
        problems.is_empty(),
        "{} of {} corpus keys not accounted for in {table}, e.g. {:?}",
        problems.len(),
        expected.len(),
        &problems[..problems.len().min(10)]
    );
}

pub async fn start_mock(config: MockConfig) -> MockProvider {
    show_warnings();
    MockProvider::start(config, SocketAddr::from(([127, 0, 0, 1], 0)), CancellationToken::new())
        .await
        .expect("start mock provider")
}

/// Settings for a test run: fast retries, short timeouts, small batches.
pub fn settings(db: &TestDb, mock: &MockProvider) -> IngestSettings {
    IngestSettings::resolve(
        ServiceArgs { database_url: Some(db.url.clone()), redis_url: None, ..Default::default() },
        ProviderArgs {
            base_url: Some(mock.base_url()),
            model: Some("mock".into()),
            // Long enough that a loaded machine never times out a healthy answer (a resend
            // counts its inputs twice, and tests count inputs); a test that wants the client
            // to give up sets its own.
            request_timeout_ms: Some(5_000),
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

/// The Redis of the running test's [`backend`]: `REDIS_URL`, or the seed URLs of the cluster
/// in `REDIS_CLUSTER_URL` (comma-separated: the list selects cluster mode).
pub fn redis_url() -> String {
    match backend() {
        Backend::SingleNode => {
            std::env::var("REDIS_URL").expect("REDIS_URL is not set: run the tests with scripts/test.sh")
        }
        Backend::Cluster => std::env::var("REDIS_CLUSTER_URL").expect(
            "REDIS_CLUSTER_URL is not set: run the tests with scripts/test.sh (scripts/services.sh cluster up)",
        ),
    }
}

/// A client for [`redis_url`].
pub fn redis_client() -> embed_dlq::streams::RedisClient {
    let client = embed_dlq::streams::client(&redis_url()).unwrap();
    assert_eq!(client.is_cluster(), backend() == Backend::Cluster);
    client
}

/// Stream keys under a prefix of their own, so tests never see each other's entries.
pub fn fresh_keys() -> embed_dlq::streams::StreamKeys {
    show_warnings();
    embed_dlq::streams::StreamKeys::new(&format!("it-{}-{}", std::process::id(), rand::random::<u32>()))
}

/// Puts the library's warnings into the output of the test that caused them, which the test
/// harness shows only when that test fails: what a `serve` or relay inside a test saw (a
/// failover taken for lost data, a pass that failed) when the test then times out. Called by
/// the helpers most tests start with; the first call installs it.
pub fn show_warnings() {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        use tracing_subscriber::prelude::*;
        let only_ours: tracing_subscriber::filter::Targets = "embed_dlq=warn".parse().unwrap();
        let layer = tracing_subscriber::fmt::layer().with_test_writer().with_ansi(false);
        let _ = tracing_subscriber::registry().with(layer.with_filter(only_ours)).try_init();
    });
}

pub async fn redis() -> embed_dlq::streams::RedisConn {
    show_warnings();
    redis_client().managed().await.expect("connect to REDIS_URL")
}

/// A Redis of this test's own (so it can be flushed or killed), on a free port; stopped on
/// drop.
pub struct PrivateRedis {
    pub url: String,
    port: u16,
    /// Where `SAVE` writes its snapshot and a restart loads it from (none: no persistence).
    dir: Option<std::path::PathBuf>,
    child: std::process::Child,
}

impl PrivateRedis {
    pub async fn start() -> PrivateRedis {
        Self::start_on(None).await
    }

    /// A private Redis that snapshots only on `SAVE` ([`PrivateRedis::save`]), into a
    /// directory of its own, and loads that snapshot when it is restarted
    /// ([`PrivateRedis::crash_and_restart`]): a restore from an older snapshot.
    pub async fn start_with_snapshots() -> PrivateRedis {
        let dir = std::env::temp_dir().join(format!(
            "embed-dlq-redis-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Self::start_on(Some(dir)).await
    }

    async fn start_on(dir: Option<std::path::PathBuf>) -> PrivateRedis {
        let port = free_redis_port();
        let child = spawn_redis(port, dir.as_deref()).await;
        PrivateRedis { url: format!("redis://127.0.0.1:{port}/"), port, dir, child }
    }

    /// Writes a snapshot now (`SAVE`): what a restart comes back with.
    pub async fn save(&self) {
        let mut c = self.manager().await;
        let _: () = redis::cmd("SAVE").query_async(&mut c).await.unwrap();
    }

    /// Kills the server (`SIGKILL`: nothing saved) and starts it again on the same port, from
    /// the last [`PrivateRedis::save`] (or empty, without snapshots).
    pub async fn crash_and_restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = spawn_redis(self.port, self.dir.as_deref()).await;
    }

    pub async fn manager(&self) -> embed_dlq::streams::RedisConn {
        embed_dlq::streams::managed(&embed_dlq::streams::client(&self.url).unwrap()).await.unwrap()
    }

    /// Stops the server (`SIGSTOP`): connections stay open and nothing is answered, like a
    /// host that froze. [`PrivateRedis::thaw`] resumes it.
    pub fn freeze(&self) {
        self.signal("-STOP");
    }

    /// Resumes a frozen server (`SIGCONT`).
    pub fn thaw(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.id().to_string();
        assert!(std::process::Command::new("kill").args([signal, &pid]).status().unwrap().success());
    }
}

/// A port for a private Redis: free now, and below the kernel's ephemeral range (32768 and
/// up) and the private clusters' ports (20000-22705, bus ports 30000-32705), so no client
/// connection or other test can take it while its Redis is down for a restart.
pub fn free_redis_port() -> u16 {
    (0..200)
        .map(|_| 23_000 + rand::random::<u16>() % 6_000)
        .find(|p| std::net::TcpListener::bind(("127.0.0.1", *p)).is_ok())
        .expect("a free port for a private Redis")
}

/// Starts redis-server on `port` (snapshots only on `SAVE`, into `dir` if given, and loaded
/// from there) and waits until it answers.
pub async fn spawn_redis(port: u16, dir: Option<&std::path::Path>) -> std::process::Child {
    let mut command = std::process::Command::new("redis-server");
    command.args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]);
    if let Some(dir) = dir {
        command.arg("--dir").arg(dir);
    }
    let mut child = command
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("redis-server (scripts/services.sh installs it)");
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).unwrap();
    for _ in 0..100 {
        if let Ok(mut c) = client.get_multiplexed_async_connection().await
            && redis::cmd("PING").query_async::<String>(&mut c).await.is_ok()
        {
            return child;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("private redis-server did not come up on {port}");
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// A Redis Cluster of this test's own (3 masters + 3 replicas, `cluster-node-timeout` 1 s
/// unless chosen), started by `scripts/services.sh cluster up` in a state dir and on ports of
/// its own, so a test can kill its nodes; removed (`cluster clean`) on drop.
pub struct PrivateCluster {
    /// The three masters' seed URLs, comma-separated.
    pub url: String,
    /// The six node ports.
    pub ports: Vec<u16>,
    /// `cluster-node-timeout`: how long a node may be unreachable before it is suspected.
    pub node_timeout: std::time::Duration,
    dir: std::path::PathBuf,
    base: u16,
}

impl PrivateCluster {
    pub async fn start() -> PrivateCluster {
        Self::start_with_node_timeout(std::time::Duration::from_secs(1)).await
    }

    /// A private cluster whose nodes are suspected after `node_timeout` (a failover takes
    /// about that long plus an election).
    pub async fn start_with_node_timeout(node_timeout: std::time::Duration) -> PrivateCluster {
        let dir = std::env::temp_dir().join(format!(
            "embed-dlq-cluster-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        ));
        // Node ports and their bus ports (+10000) below the ephemeral range, all free now.
        let free = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
        let base = (0..200)
            .map(|_| 20000 + (rand::random::<u16>() % 2700))
            .find(|b| (0..6).all(|i| free(b + i) && free(b + i + 10000)))
            .expect("six free ports for a private cluster");
        let cluster = PrivateCluster {
            url: (0..3).map(|i| format!("redis://127.0.0.1:{}/", base + i)).collect::<Vec<_>>().join(","),
            ports: (0..6).map(|i| base + i).collect(),
            node_timeout,
            dir,
            base,
        };
        let out = cluster.script("up").output().await.expect("scripts/services.sh");
        assert!(
            out.status.success(),
            "private cluster did not start: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        cluster
    }

    fn script(&self, action: &str) -> tokio::process::Command {
        let mut c = tokio::process::Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/services.sh"));
        c.args(["cluster", action])
            .env("EMBED_DLQ_SERVICES_DIR", &self.dir)
            .env("EMBED_DLQ_CLUSTER_PORT", self.base.to_string())
            .env("EMBED_DLQ_CLUSTER_NODE_TIMEOUT_MS", self.node_timeout.as_millis().to_string())
            .stdin(std::process::Stdio::null());
        c
    }

    /// A plain (non-cluster) connection to one node, for inspecting it.
    pub async fn node(&self, port: u16) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(std::time::Duration::from_secs(1)))
            .set_response_timeout(Some(std::time::Duration::from_secs(2)));
        redis::Client::open(format!("redis://127.0.0.1:{port}/"))?
            .get_multiplexed_async_connection_with_config(&config)
            .await
    }

    /// A field of a node's `INFO <section>` (e.g. `role` of `replication`).
    pub async fn info(&self, port: u16, section: &str, field: &str) -> Option<String> {
        let text: String =
            redis::cmd("INFO").arg(section).query_async(&mut self.node(port).await.ok()?).await.ok()?;
        text.lines().find_map(|l| l.strip_prefix(&format!("{field}:")).map(|v| v.trim().to_string()))
    }

    /// The port of the master that serves `key` (the one node answering a keyed read on it
    /// without a MOVED redirection).
    pub async fn master_of(&self, key: &str) -> u16 {
        for &port in &self.ports {
            if let Ok(mut c) = self.node(port).await
                && redis::cmd("EXISTS").arg(key).query_async::<i64>(&mut c).await.is_ok()
            {
                return port;
            }
        }
        panic!("no node serves {key}");
    }

    /// Kills the node on `port` with SIGKILL (no shutdown, nothing saved).
    pub async fn kill(&self, port: u16) {
        let pid = self.info(port, "server", "process_id").await.expect("the node's pid");
        assert!(std::process::Command::new("kill").args(["-KILL", &pid]).status().unwrap().success());
    }

    /// The pid of the node on `port`.
    pub async fn pid(&self, port: u16) -> String {
        self.info(port, "server", "process_id").await.expect("the node's pid")
    }

    /// Sends `signal` (e.g. `STOP`, `CONT`) to the node process `pid`.
    pub fn signal(&self, pid: &str, signal: &str) {
        assert!(
            std::process::Command::new("kill").args([&format!("-{signal}"), pid]).status().unwrap().success()
        );
    }

    /// Waits until every live node reports a healthy cluster.
    pub async fn wait_healthy(&self, within: std::time::Duration) {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let mut ok = true;
            let mut alive = 0;
            for &port in &self.ports {
                match self.info(port, "cluster", "cluster_enabled").await {
                    None => continue,
                    Some(_) => alive += 1,
                }
                let state: Option<String> = async {
                    let text: String = redis::cmd("CLUSTER")
                        .arg("INFO")
                        .query_async(&mut self.node(port).await.ok()?)
                        .await
                        .ok()?;
                    text.lines().find_map(|l| l.strip_prefix("cluster_state:").map(|v| v.trim().to_string()))
                }
                .await;
                ok &= state.as_deref() == Some("ok");
            }
            if ok && alive > 0 {
                return;
            }
            assert!(tokio::time::Instant::now() < deadline, "the private cluster did not become healthy");
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    }
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        let _ = self
            .script("clean")
            .as_std_mut()
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The event ids of the outbox rows not on any stream of `keys` (events and replay, every
/// shard), in outbox order: what is still unpublished, as Redis itself shows it.
pub async fn unpublished(db: &TestDb, keys: &embed_dlq::streams::StreamKeys) -> Vec<String> {
    let mut r = redis().await;
    let mut on_streams = std::collections::HashSet::new();
    for shard in keys.shard_ids() {
        for stream in [keys.events_of(shard), keys.replay_of(shard)] {
            let all: redis::streams::StreamRangeReply =
                redis::cmd("XRANGE").arg(&stream).arg("-").arg("+").query_async(&mut r).await.unwrap();
            on_streams.extend(all.ids.iter().filter_map(|e| embed_dlq::streams::field(&e.map, "event_id")));
        }
    }
    let outbox: Vec<String> = sqlx::query_scalar("SELECT event_id::text FROM dlq_outbox ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    outbox.into_iter().filter(|e| !on_streams.contains(e)).collect()
}

/// Moves the relay's position back to before every outbox row, as a database restored from
/// a backup taken before the relay's last commits shows it (or a relay that crashed before
/// committing): every row is to be published again.
pub async fn rewind_relay(db: &TestDb) {
    sqlx::query("UPDATE relay_position SET lower = '3:3:', upper = NULL, after_id = 0, last_id = 0")
        .execute(&db.pool)
        .await
        .unwrap();
}

/// Relays every unpublished outbox row to `keys`; returns the new stream entries. Every entry
/// it added to the events streams is checked against the events contract
/// ([`assert_events_conform_after`]).
pub async fn relay_all(db: &TestDb, keys: &embed_dlq::streams::StreamKeys) -> u64 {
    use embed_dlq::relay::{Relay, RelayConfig};
    let before = events_heads(keys).await;
    let mut relay = Relay::new(db.pool.clone(), redis().await, keys.clone(), RelayConfig::default());
    let published = relay_until_idle(&mut relay).await;
    assert_events_conform_after(keys, &before).await;
    published
}

/// Passes of `relay` until one finds nothing to publish; returns the new stream entries.
pub async fn relay_until_idle(relay: &mut embed_dlq::relay::Relay) -> u64 {
    let mut published = 0;
    loop {
        let c = relay.run_once().await.unwrap();
        published += c.published;
        if c.claimed == 0 {
            return published;
        }
    }
}

/// The events contract, `docs/events.schema.json`: what a consumer in any language is promised
/// about the events streams. Checked by one long-lived Python process per test binary
/// (`tests/it/events_checker.py`, Python's `jsonschema` package, draft 2020-12 with formats
/// asserted), which `scripts/test.sh` installs: no JSON Schema crate in the build.
pub struct EventsContract {
    /// The schema document.
    pub schema: serde_json::Value,
    /// The checker process, one request at a time.
    checker: std::sync::Mutex<SchemaChecker>,
}

/// Path of the contract in the repository.
pub const EVENTS_SCHEMA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/events.schema.json");

/// The checker script.
const EVENTS_CHECKER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/it/events_checker.py");

/// What to do when the checker can't run.
const CHECKER_HELP: &str = "the events contract is checked with python3 and its jsonschema and \
rfc3339-validator packages: scripts/test.sh installs them (pip install 'jsonschema>=4.18,<5' \
'rfc3339-validator>=0.1.4,<0.2')";

/// A running `events_checker.py`: one JSON request per line in, one answer per line out.
struct SchemaChecker {
    /// The process: it exits with the test binary (its stdin closes).
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl SchemaChecker {
    /// Starts the checker on `docs/events.schema.json`; panics (never skips) when python3 or the
    /// packages are missing.
    fn start() -> Self {
        use std::io::BufRead;
        use std::process::{Command, Stdio};
        let mut child = Command::new("python3")
            .arg(EVENTS_CHECKER)
            .arg(EVENTS_SCHEMA)
            // Not the repository: its redis/ folder would pass for a package.
            .current_dir(std::env::temp_dir())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("python3 cannot be run ({e}): {CHECKER_HELP}"));
        let stdin = child.stdin.take().unwrap();
        let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut first = String::new();
        stdout.read_line(&mut first).expect("the events checker's first line");
        if first.trim_end() != "ready" {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the events checker did not start ({}): {CHECKER_HELP}", first.trim_end());
        }
        SchemaChecker { child, stdin, stdout }
    }

    /// The checker's answer to `request`: empty when it answered `ok`.
    fn ask(&mut self, request: &serde_json::Value) -> Vec<String> {
        use std::io::{BufRead, Write};
        let mut line = serde_json::to_string(request).unwrap();
        line.push('\n');
        let mut answer = String::new();
        let io = self.stdin.write_all(line.as_bytes()).and_then(|()| self.stdin.flush());
        let read = io.and_then(|()| self.stdout.read_line(&mut answer));
        match read {
            Ok(n) if n > 0 => {}
            outcome => panic!(
                "the events checker (pid {}) died ({outcome:?}, exit {:?}): {CHECKER_HELP}",
                self.child.id(),
                self.child.try_wait()
            ),
        }
        match answer.trim_end() {
            "ok" => Vec::new(),
            problems => serde_json::from_str(problems)
                .unwrap_or_else(|e| panic!("the events checker answered {problems:?} ({e})")),
        }
    }
}

/// The contract (read, and its checker started, on first use).
pub fn events_contract() -> &'static EventsContract {
    static CONTRACT: std::sync::OnceLock<EventsContract> = std::sync::OnceLock::new();
    CONTRACT.get_or_init(|| {
        let text = std::fs::read_to_string(EVENTS_SCHEMA).expect("docs/events.schema.json");
        let schema: serde_json::Value = serde_json::from_str(&text).expect("the events schema is JSON");
        EventsContract { schema, checker: std::sync::Mutex::new(SchemaChecker::start()) }
    })
}

impl EventsContract {
    /// The checker's answer to `request` (one exchange at a time, whichever test asks).
    fn ask(&self, request: serde_json::Value) -> Vec<String> {
        self.checker.lock().unwrap_or_else(std::sync::PoisonError::into_inner).ask(&request)
    }

    /// Why the schema is not a valid draft 2020-12 schema (its meta-schema); empty when it is.
    pub fn schema_problems(&self) -> Vec<String> {
        self.ask(serde_json::json!({ "schema": null }))
    }

    /// Why `body` (an event body) breaks the contract; empty when it conforms.
    pub fn body_problems(&self, body: &serde_json::Value) -> Vec<String> {
        self.ask(serde_json::json!({ "body": body }))
    }

    /// Why a stream entry (its field/value pairs) breaks the contract: `$defs/entry`, its body
    /// (parsed), and its `event` field equal to the body's; empty when it conforms.
    pub fn entry_problems(&self, fields: &std::collections::BTreeMap<String, String>) -> Vec<String> {
        self.ask(serde_json::json!({ "entry": fields }))
    }

    /// Every event kind the contract describes.
    pub fn kinds(&self) -> std::collections::BTreeSet<String> {
        self.schema["properties"]["event"]["enum"]
            .as_array()
            .expect("the schema lists the event kinds")
            .iter()
            .map(|k| k.as_str().unwrap().to_string())
            .collect()
    }
}

/// One entry of an events stream, its fields as strings.
#[derive(Debug, Clone)]
pub struct EventEntry {
    /// The stream (shard) it is on.
    pub stream: String,
    /// Its entry id.
    pub id: String,
    /// Its field/value pairs.
    pub fields: std::collections::BTreeMap<String, String>,
}

/// Entries in the replay streams of `keys` (every shard; `XLEN`).
pub async fn replay_len(keys: &embed_dlq::streams::StreamKeys) -> usize {
    let mut r = redis().await;
    let mut n = 0;
    for shard in keys.shard_ids() {
        let len: usize = redis::cmd("XLEN").arg(keys.replay_of(shard)).query_async(&mut r).await.unwrap();
        n += len;
    }
    n
}

/// The work items of every entry on the replay streams of `keys`, parsed here as JSON (not
/// by the product's parser; an entry's `items`, or its body when it carries one item),
/// shard by shard in stream order; with the streams' count of entries ever added
/// (`XINFO STREAM`'s `entries-added`, trims and deletions included).
pub async fn replay_entries(keys: &embed_dlq::streams::StreamKeys) -> (Vec<serde_json::Value>, u64) {
    let mut r = redis().await;
    let (mut bodies, mut added) = (Vec::new(), 0);
    for shard in keys.shard_ids() {
        let stream = keys.replay_of(shard);
        // A missing stream: nothing was ever added.
        let info: redis::RedisResult<std::collections::HashMap<String, redis::Value>> =
            redis::cmd("XINFO").arg("STREAM").arg(&stream).query_async(&mut r).await;
        added += info
            .unwrap_or_default()
            .get("entries-added")
            .map_or(0, |v| redis::from_redis_value_ref::<u64>(v).expect("entries-added is a count"));
        let all: redis::streams::StreamRangeReply =
            redis::cmd("XRANGE").arg(&stream).arg("-").arg("+").query_async(&mut r).await.unwrap();
        for e in all.ids {
            let body: String = e.get("body").expect("a work item has a body");
            let body: serde_json::Value = serde_json::from_str(&body).expect("a work item's body is JSON");
            match body.get("items").and_then(|i| i.as_array()) {
                Some(items) => bodies.extend(items.iter().cloned()),
                None => bodies.push(body),
            }
        }
    }
    (bodies, added)
}

/// The last entry id of every shard's events stream of `keys` (`0-0` when empty or missing):
/// where [`assert_events_conform_after`] starts.
pub async fn events_heads(keys: &embed_dlq::streams::StreamKeys) -> Vec<String> {
    let mut r = redis().await;
    let mut heads = Vec::new();
    for shard in keys.shard_ids() {
        let last: redis::streams::StreamRangeReply = redis::cmd("XREVRANGE")
            .arg(keys.events_of(shard))
            .arg("+")
            .arg("-")
            .arg("COUNT")
            .arg(1)
            .query_async(&mut r)
            .await
            .unwrap();
        heads.push(last.ids.first().map_or_else(|| "0-0".to_string(), |e| e.id.clone()));
    }
    heads
}

/// Every entry of the events streams of `keys` after `heads` (one id per shard, from
/// [`events_heads`]), in stream order per shard.
pub async fn events_after(keys: &embed_dlq::streams::StreamKeys, heads: &[String]) -> Vec<EventEntry> {
    let mut r = redis().await;
    let mut out = Vec::new();
    for shard in keys.shard_ids() {
        let stream = keys.events_of(shard);
        let mut after = heads[usize::from(shard)].clone();
        loop {
            let page: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
                .arg(&stream)
                .arg(format!("({after}"))
                .arg("+")
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut r)
                .await
                .unwrap();
            let Some(last) = page.ids.last() else { break };
            after = last.id.clone();
            for e in &page.ids {
                let fields = e
                    .map
                    .keys()
                    .map(|k| (k.clone(), embed_dlq::streams::field(&e.map, k).expect("a string field")))
                    .collect();
                out.push(EventEntry { stream: stream.clone(), id: e.id.clone(), fields });
            }
        }
    }
    out
}

/// Panics unless every entry of the events streams of `keys` after `heads` conforms to the
/// events contract (`docs/events.schema.json`); returns them.
pub async fn assert_events_conform_after(
    keys: &embed_dlq::streams::StreamKeys,
    heads: &[String],
) -> Vec<EventEntry> {
    let contract = events_contract();
    let entries = events_after(keys, heads).await;
    for e in &entries {
        let problems = contract.entry_problems(&e.fields);
        assert!(
            problems.is_empty(),
            "{} {} breaks the events contract (docs/events.schema.json): {problems:#?}\nentry: {:#?}",
            e.stream,
            e.id,
            e.fields
        );
    }
    entries
}

/// [`assert_events_conform_after`] from the start of every shard's events stream.
pub async fn assert_events_conform(keys: &embed_dlq::streams::StreamKeys) -> Vec<EventEntry> {
    let heads = vec!["0-0".to_string(); usize::from(keys.shards())];
    assert_events_conform_after(keys, &heads).await
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

/// Parks `n` transient chunks of document `doc` (the provider is down while they are
/// ingested) and makes them due now.
pub async fn park_due(db: &TestDb, n: usize, doc: &str) {
    let down = start_mock(MockConfig::default()).await;
    down.control.set_outage(true);
    let mut s = settings(db, &down);
    s.retry.max_attempts = 1;
    // Past the breaker's threshold the rest is parked without a call (large corpora).
    s.options.on_outage = embed_dlq::embed::gate::OnOutage::Park;
    let p = pipeline(&s).await;
    let corpus: String = (0..n).map(|i| line(doc, i as i32, &format!("{doc} chunk {i}"))).collect();
    let r = p.run(input(corpus.into_bytes()), CancellationToken::new()).await.unwrap();
    assert_eq!(r.parked_total(), n as u64);
    make_due(db).await;
}

/// Rows of `table` read so far (sequential and index fetches), as the server's statistics
/// count them: what a statement read, compared before and after it, whatever its plan. A
/// backend reports its counts when it ends, or within 10 s of going idle (PGSTAT_IDLE_INTERVAL):
/// call [`quiet_statistics`] before the first reading, and read with the pool that ran the
/// statement closed.
pub async fn rows_read(db: &TestDb, table: &str) -> i64 {
    statistic(db, "pg_stat_user_tables", &["seq_tup_read", "idx_tup_fetch"], "relid", table).await
}

/// Blocks of index `index` read so far (from the buffer cache or the disk), as the server's
/// statistics count them: what index scans walked, including entries a scan passed over
/// without returning them (which [`rows_read`] does not see). Reported like [`rows_read`].
pub async fn index_blocks_read(db: &TestDb, index: &str) -> i64 {
    statistic(db, "pg_statio_user_indexes", &["idx_blks_read", "idx_blks_hit"], "indexrelid", index).await
}

/// Scans of index `index` so far (each probe by key is one), reported like [`rows_read`].
pub async fn index_scans(db: &TestDb, index: &str) -> i64 {
    statistic(db, "pg_stat_user_indexes", &["idx_scan"], "indexrelid", index).await
}

/// The sum of `counters` of statistics view `view` for the relation named `name` (matched on
/// the view's column `key`).
async fn statistic(db: &TestDb, view: &str, counters: &[&str], key: &str, name: &str) -> i64 {
    let sum: Vec<String> = counters.iter().map(|c| format!("coalesce({c}, 0)")).collect();
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT ({})::bigint FROM {view} WHERE {key} = $1::regclass",
        sum.join(" + ")
    )))
    .bind(name)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// Waits until every idle backend has reported what it read (see [`rows_read`]).
pub async fn quiet_statistics() {
    tokio::time::sleep(std::time::Duration::from_secs(11)).await;
}

/// Waits until `db`'s statistics show more than `before` rows of `table` read (the closed
/// pool's backends reported), then a little longer for the rest of their counts.
pub async fn rows_read_since(db: &TestDb, table: &str, before: i64) -> i64 {
    wait_for("the statistics of the statement", std::time::Duration::from_secs(30), async || {
        rows_read(db, table).await > before
    })
    .await;
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    rows_read(db, table).await - before
}

/// Makes every scheduled DLQ row due now (instead of waiting out the DLQ backoff).
pub async fn make_due(db: &TestDb) {
    sqlx::query("UPDATE embedding_dlq SET next_retry_at = now() WHERE next_retry_at IS NOT NULL")
        .execute(&db.pool)
        .await
        .unwrap();
}

/// Whether the server `DATABASE_URL` points at has a database called `name`.
async fn database_exists(name: &str) -> bool {
    use sqlx::Connection;
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL (scripts/test.sh sets it)");
    let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_database WHERE datname = $1")
        .bind(name)
        .fetch_one(&mut conn)
        .await
        .unwrap();
    n > 0
}

#[tokio::test]
async fn test_database_is_dropped_with_its_value_even_while_connected() {
    let db = TestDb::new().await;
    let name = db.name().expect("owned").to_string();
    assert!(database_exists(&name).await);
    // Another open connection (a child process would hold one) does not keep it alive.
    let other = embed_dlq::store::connect(&db.url, 1).await.unwrap();
    sqlx::query("SELECT 1").execute(&other).await.unwrap();
    drop(db);
    assert!(!database_exists(&name).await, "{name} survived its TestDb");
}

#[tokio::test]
async fn test_database_is_dropped_when_the_test_panics() {
    // What `#[tokio::test]` does: a runtime of its own whose future panics.
    let (tx, rx) = std::sync::mpsc::channel();
    let test = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async move {
            let db = TestDb::unmigrated().await;
            tx.send(db.name().expect("owned").to_string()).unwrap();
            panic!("a failing test (expected)");
        })
    });
    assert!(test.join().is_err(), "the test thread panicked");
    let name = rx.recv().unwrap();
    assert!(!database_exists(&name).await, "{name} survived a panicking test");
}

#[tokio::test]
async fn a_borrowed_database_is_left_alone() {
    let owner = TestDb::unmigrated().await;
    let name = owner.name().expect("owned").to_string();
    drop(TestDb::borrowed(owner.url.clone(), owner.pool.clone()));
    assert!(database_exists(&name).await, "a borrowed handle dropped {name}");
    drop(owner);
    assert!(!database_exists(&name).await);
}

/// A real scrape of `serve --metrics-addr` over `db` (its own stream prefix, one replayer, a
/// reconcile every second), once the DLQ gauges and the reconcile timestamp are exported:
/// what the metrics test checks.
pub async fn scrape_serve(db: &TestDb) -> String {
    scrape_serve_until(db, |text| {
        text.contains("embed_dlq_dlq_depth")
            && text.contains("embed_dlq_reconcile_last_success_timestamp_seconds")
    })
    .await
}

/// [`scrape_serve`], taken once `ready` accepts it (up to 60 s).
pub async fn scrape_serve_until(db: &TestDb, ready: impl Fn(&str) -> bool) -> String {
    use std::time::Duration;
    let keys = fresh_keys();
    let mock = start_mock(MockConfig::default()).await;
    // Below the kernel's ephemeral range (no client connection holds it) and checked free.
    let port = (0..100)
        .map(|_| 20_000 + rand::random::<u16>() % 1_000)
        .find(|p| std::net::TcpListener::bind(("127.0.0.1", *p)).is_ok())
        .expect("a free port for the metrics endpoint");
    let prefix = keys.events().trim_start_matches('{').split('}').next().unwrap().to_string();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_embed-dlq"))
        .arg("serve")
        .args(["--database-url", &db.url, "--redis-url", &redis_url(), "--base-url", &mock.base_url()])
        .args(["--stream-prefix", &prefix, "--replayers", "1", "--reconcile-every-secs", "1"])
        .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
        // A stream source too, so that its gauges are in the scrape.
        .args(["--from-stream", &format!("{prefix}:source")])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let url = format!("http://127.0.0.1:{port}/metrics");
    let mut body = String::new();
    // Up to 60 s on a loaded machine; usually well under a second.
    for _ in 0..600 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if let Ok(r) = embed_dlq::http::client_builder().build().unwrap().get(&url).send().await
            && let Ok(text) = r.text().await
            && ready(&text)
        {
            body = text;
            break;
        }
    }
    child.kill().await.ok();
    assert!(!body.is_empty(), "the metrics endpoint never showed what the test waits for");
    body
}

/// Which Redis the fixtures of this module talk to: the single node of `REDIS_URL`, or the
/// Redis Cluster of `REDIS_CLUSTER_URL` (scripts/test.sh starts one with
/// `scripts/services.sh cluster up`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    SingleNode,
    Cluster,
}

thread_local! {
    /// The backend of the runtime this thread belongs to (set on every thread of a runtime
    /// built by [`run_on`]; a plain `#[tokio::test]` runtime has none: single node).
    static BACKEND: std::cell::Cell<Backend> = const { std::cell::Cell::new(Backend::SingleNode) };
}

/// The backend of the running test (see [`on_single_and_cluster!`]).
pub fn backend() -> Backend {
    BACKEND.with(|b| b.get())
}

/// Runs a test body on a 2-worker runtime of its own whose every thread (workers, blocking
/// pool, the test's own) reports `backend`, so that every fixture the body calls, in any task,
/// talks to the same Redis.
pub fn run_on(backend: Backend, body: impl std::future::Future<Output = ()>) {
    BACKEND.with(|b| b.set(backend));
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .on_thread_start(move || BACKEND.with(|b| b.set(backend)))
        .build()
        .expect("test runtime")
        .block_on(body);
}

/// Generates a test twice, as a module named after it: `single_node` runs the body against
/// the Redis of `REDIS_URL`, `cluster` against the Redis Cluster of `REDIS_CLUSTER_URL`. The
/// Redis fixtures (`redis_url`, `redis_client`, `redis`, `relay_all`, `reconciler`) follow
/// [`backend`], so the body is written once. A test that must break its Redis (flush, kill)
/// uses a [`PrivateRedis`] and stays single.
///
/// ```ignore
/// on_single_and_cluster! {
///     async fn relay_publishes_once() {
///         let mut redis = redis().await;   // single node, then cluster
///     }
/// }
/// ```
macro_rules! on_single_and_cluster {
    ($($(#[$meta:meta])* async fn $name:ident() $body:block)+) => {$(
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            $(#[$meta])*
            #[test]
            fn single_node() {
                crate::support::run_on(crate::support::Backend::SingleNode, async $body)
            }

            $(#[$meta])*
            #[test]
            fn cluster() {
                crate::support::run_on(crate::support::Backend::Cluster, async $body)
            }
        }
    )+};
}
pub(crate) use on_single_and_cluster;

/// A replayer of the `replayers` group over `keys`, embedding through `mock` with a request
/// timeout of `timeout`: the one way the tests build one.
pub async fn replayer_for(
    db: &TestDb,
    mock: &MockProvider,
    keys: &embed_dlq::streams::StreamKeys,
    name: &str,
    config: embed_dlq::replay::ReplayConfig,
    timeout: std::time::Duration,
) -> embed_dlq::replay::Replayer {
    let mut s = settings(db, mock);
    s.client.timeout = timeout;
    replayer_on(pipeline(&s).await, keys, name, config).await
}

/// A replayer of the `replayers` group over `keys` with the store and embedder of `p` (a
/// pipeline of the test's settings, e.g. pointed at a hand-written provider).
pub async fn replayer_on(
    p: Pipeline,
    keys: &embed_dlq::streams::StreamKeys,
    name: &str,
    config: embed_dlq::replay::ReplayConfig,
) -> embed_dlq::replay::Replayer {
    let mut redis = redis().await;
    embed_dlq::replay::ensure_group(&mut redis, keys).await.unwrap();
    embed_dlq::replay::Replayer {
        name: name.into(),
        store: p.store,
        embedder: p.embedder,
        client: embed_dlq::streams::client(&redis_url()).unwrap(),
        redis,
        keys: keys.clone(),
        config,
        paused_until: None,
    }
}

/// One read of `rep` (a batch of new entries, or nothing after its block time), processed.
pub async fn read_once(rep: &mut embed_dlq::replay::Replayer) -> embed_dlq::replay::ReplayCounts {
    let client = embed_dlq::streams::client(&redis_url()).unwrap();
    let mut conn = embed_dlq::streams::blocking(&client, std::time::Duration::from_secs(1)).await.unwrap();
    rep.read_once(&mut conn, &CancellationToken::new()).await.unwrap()
}

/// The binary as a user runs it, with none of this machine's settings that would change what
/// a test asks of it (API key, config file, failpoint, log filter), stdin closed, killed with
/// its handle.
pub fn binary() -> tokio::process::Command {
    let mut c = tokio::process::Command::new(env!("CARGO_BIN_EXE_embed-dlq"));
    c.env_remove("EMBED_DLQ_API_KEY")
        .env_remove("EMBED_DLQ_CONFIG")
        .env_remove("EMBED_DLQ_FAILPOINT")
        .env_remove("RUST_LOG")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    c
}

/// `db.url` with its host and port replaced by `addr` (a proxy in front of the server).
pub fn through(db: &TestDb, addr: std::net::SocketAddr) -> String {
    let mut url = reqwest::Url::parse(&db.url).unwrap();
    url.set_host(Some(&addr.ip().to_string())).unwrap();
    url.set_port(Some(addr.port())).unwrap();
    url.to_string()
}

/// The Postgres server `db` lives on (for a proxy in front of it).
pub fn postgres_addr(db: &TestDb) -> std::net::SocketAddr {
    let url = reqwest::Url::parse(&db.url).unwrap();
    let host = url.host_str().unwrap();
    let ip: std::net::IpAddr =
        if host == "localhost" { [127, 0, 0, 1].into() } else { host.parse().unwrap() };
    (ip, url.port().unwrap_or(5432)).into()
}

/// The stream prefix `keys` were made under.
pub fn prefix_of(keys: &embed_dlq::streams::StreamKeys) -> String {
    keys.events().trim_start_matches('{').split('}').next().unwrap().to_string()
}

/// `serve` against `database_url`, the test's Redis and the mock at `base_url`, under `keys`'
/// prefix, with short replay periods and quick retries; output discarded.
pub fn serve_process(
    database_url: &str,
    base_url: &str,
    keys: &embed_dlq::streams::StreamKeys,
    extra: &[&str],
) -> tokio::process::Command {
    let mut c = tokio::process::Command::new(env!("CARGO_BIN_EXE_embed-dlq"));
    c.arg("serve")
        .args(["--database-url", database_url, "--redis-url", &redis_url(), "--base-url", base_url])
        .args(["--model", "mock", "--stream-prefix", &prefix_of(keys), "--request-timeout-ms", "2000"])
        .args(["--retry-base-ms", "5", "--retry-cap-ms", "50", "--relay-poll-ms", "100"])
        .args(extra)
        .env_remove("EMBED_DLQ_FAILPOINT")
        .env_remove("EMBED_DLQ_API_KEY")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true);
    c
}

/// Waits until no connection of the product's (application name `embed-dlq`) but the test's
/// own pool's is open on the test's database: after a SIGKILL, a backend may still be
/// committing what the dead process sent last (the server reads and runs a `COMMIT` that was
/// in its socket before the kill), so only then do the tables hold everything the killed
/// process will ever have written.
pub async fn killed_writers_gone(db: &TestDb) {
    wait_for("the killed process's database sessions to end", std::time::Duration::from_secs(60), async || {
        let open = db
            .count(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'embed-dlq'",
            )
            .await;
        open <= i64::from(db.pool.size())
    })
    .await;
}

/// Polls `done` every 100 ms until it holds; fails the test naming `what` if it does not
/// within `within`.
pub async fn wait_for(what: &str, within: std::time::Duration, mut done: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + within;
    while !done().await {
        assert!(tokio::time::Instant::now() < deadline, "{what}: not within {within:?}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// Leaves `replay_lease`'s statistics as a long-running deployment does: analyzed while it
/// held leases that have expired since (every lease has, a lease length after any analyze:
/// `leased_until` is always "now + a lease"), then emptied and vacuumed. The planner now
/// expects no live lease, whatever the table holds.
pub async fn age_lease_statistics(db: &TestDb) {
    sqlx::raw_sql(
        "INSERT INTO replay_lease (dlq_id, generation, leased_until)
         SELECT id, generation, now() - interval '1 hour' FROM embedding_dlq;
         ANALYZE replay_lease;
         DELETE FROM replay_lease;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::raw_sql("VACUUM ANALYZE replay_lease").execute(&db.pool).await.unwrap();
}

/// Writes `n` parked chunks straight into the manifest and the DLQ of `public.doc_embeddings`
/// (docs `<prefix>-1..=n`, chunk 0): transient (`http_503`) rows due since `due_ago` when it is
/// given, permanent (`http_400`, never scheduled) rows otherwise. Faster than parking them
/// through a pipeline, for tests that need a DLQ far bigger than a batch.
pub async fn insert_parked_rows(db: &TestDb, prefix: &str, n: usize, due_ago: Option<&str>) {
    insert_parked_rows_unanalyzed(db, prefix, n, due_ago).await;
    sqlx::raw_sql("ANALYZE ingest_manifest; ANALYZE embedding_dlq").execute(&db.pool).await.unwrap();
}

/// [`insert_parked_rows`] without the `ANALYZE` after it: the planner goes on believing what
/// the statistics said before the rows came.
pub async fn insert_parked_rows_unanalyzed(db: &TestDb, prefix: &str, n: usize, due_ago: Option<&str>) {
    let (class, reason, due) = match due_ago {
        Some(ago) => ("transient", "http_503", format!("now() - interval '{ago}'")),
        None => ("permanent_input", "http_400", "NULL".to_string()),
    };
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "INSERT INTO ingest_manifest (target_table, doc_id, chunk_index, content_hash, status)
         SELECT 'public.doc_embeddings', '{prefix}-' || i, 0, md5('{prefix}' || i), 'parked'
           FROM generate_series(1, {n}) i;
         INSERT INTO embedding_dlq (target_table, doc_id, chunk_index, content_hash, payload, error_class,
                                    error_reason, attempts, next_retry_at, model)
         SELECT 'public.doc_embeddings', '{prefix}-' || i, 0, md5('{prefix}' || i),
                jsonb_build_object('doc_id', '{prefix}-' || i, 'chunk_index', 0, 'text', '{prefix} text ' || i),
                '{class}', '{reason}', 1, {due}, 'mock'
           FROM generate_series(1, {n}) i;"
    )))
    .execute(&db.pool)
    .await
    .unwrap();
}

/// Leaves `table` as Postgres sees it after its rows were deleted and an `ANALYZE` ran before
/// vacuum took their pages away: pages and no live row, so the planner believes the table
/// holds one row, whatever is written to it, until the next `ANALYZE` (autovacuum is turned
/// off for it here). `fill` writes the rows that are then deleted. What a drained DLQ, a
/// deleted corpus's manifest or a cleared vector table looks like to the planner for up to a
/// minute, or longer on a server whose autovacuum workers are busy.
pub async fn leave_believed_empty(db: &TestDb, table: &str, fill: &str) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE {table} SET (autovacuum_enabled = off); {fill}; DELETE FROM {table}; ANALYZE {table};"
    )))
    .execute(&db.pool)
    .await
    .unwrap();
    let believed: (i32, f32) =
        sqlx::query_as("SELECT relpages, reltuples FROM pg_class WHERE oid = $1::regclass")
            .bind(table)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(believed.0 > 0 && believed.1 == 0.0, "{table}: pages, no live row: {believed:?}");
}

/// SQL writing `n` vectors (`<prefix>-<i>`, chunk 0, every value 0.5) into `doc_embeddings`,
/// with no manifest row: the rest of a vector table beside the rows a test works on.
pub fn fake_vectors(prefix: &str, n: usize) -> String {
    format!(
        "INSERT INTO doc_embeddings (doc_id, chunk_index, content_hash, embedding)
         SELECT '{prefix}-' || i, 0, md5('{prefix}' || i), array_fill(0.5::real, ARRAY[768])::vector
           FROM generate_series(1, {n}) i"
    )
}

/// SQL writing `n` manifest rows of stored chunks (`<prefix>-<i>`, chunk 0) of
/// `doc_embeddings`, with no vector: the rest of a corpus beside the rows a test works on.
pub fn stored_chunks(prefix: &str, n: usize) -> String {
    format!(
        "INSERT INTO ingest_manifest (target_table, doc_id, chunk_index, content_hash, status)
         SELECT 'public.doc_embeddings', '{prefix}-' || i, 0, md5('{prefix}' || i), 'stored'
           FROM generate_series(1, {n}) i"
    )
}

/// Replay settings for tests that drive a replayer by hand: batches of 64, a 200 ms block, a
/// min-idle no test reaches (30 s: nothing is taken over unless a test says so), a quick
/// scheduler tick.
pub fn quick_replay_config() -> embed_dlq::replay::ReplayConfig {
    embed_dlq::replay::ReplayConfig {
        batch: 64,
        block: std::time::Duration::from_millis(200),
        min_idle: std::time::Duration::from_secs(30),
        schedule_every: std::time::Duration::from_millis(100),
        ..Default::default()
    }
}
