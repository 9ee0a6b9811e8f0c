//! The history checker: a seeded, randomized interleaving of everything users and operators do
//! to a deployment, run against the real binary, real Postgres and a private Redis, then checked
//! against a reference model kept by the test.
//!
//! Operations: ingests of corpora whose texts change between versions (into two target tables),
//! concurrent ingests of the same keys, `serve` processes (some SIGKILLed at random moments),
//! ingests SIGKILLed mid-run, provider faults and outages, a Redis `FLUSHALL` and a Redis restart
//! that loses everything, `dlq requeue` / `dlq purge`, and `reconcile --repair`.
//!
//! The model is simple because the product's promise is: whatever happened, rerunning the newest
//! corpus with a healthy provider and letting `serve` drain leaves every key as the newest
//! text's vector, or a DLQ row holding the newest payload (for inputs the provider rejects).
//! At the end it checks, per table and key: that outcome (the stored vector compared with the
//! mock's deterministic vector of the newest text), no duplicates, no leaks, no transient DLQ
//! row left, one `parked` event per parked row and content on the events stream, and a clean
//! reconcile after one repair.
//!
//! Scale and seeds come from the environment (`scripts/chaos.sh` sets them for long runs):
//! `EMBED_DLQ_HISTORY_SEEDS` (comma-separated; default a fixed list plus one random seed),
//! `EMBED_DLQ_HISTORY_KEYS`, `EMBED_DLQ_HISTORY_OPS`, `EMBED_DLQ_HISTORY_MINUTES` (run ops until
//! then instead of counting them), `EMBED_DLQ_HISTORY_MIN_KILLS`, `EMBED_DLQ_HISTORY_REPORT`
//! (also write the report to this file).

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::process::Stdio;
use std::time::{Duration, Instant};

use embed_dlq::testkit::mock_provider::{self, MockConfig, MockProvider};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use tokio::process::{Child, Command};

use crate::support::*;

const TABLES: [&str; 2] = ["doc_embeddings", "hist_b"];
const DIMS: usize = 768;
const MODEL: &str = "mock";

/// How big a history is.
#[derive(Debug, Clone)]
struct Scale {
    keys: usize,
    ops: usize,
    deadline: Option<Duration>,
    min_kills: u64,
}

impl Scale {
    fn from_env() -> Scale {
        let num = |k: &str, d: u64| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
        Scale {
            keys: num("EMBED_DLQ_HISTORY_KEYS", 240) as usize,
            ops: num("EMBED_DLQ_HISTORY_OPS", 24) as usize,
            deadline: std::env::var("EMBED_DLQ_HISTORY_MINUTES")
                .ok()
                .and_then(|v| v.parse::<f64>().ok())
                .map(|m| Duration::from_secs_f64(m * 60.0)),
            min_kills: num("EMBED_DLQ_HISTORY_MIN_KILLS", 2),
        }
    }
}

/// A Redis of the history's own on a fixed port, so it can be flushed, killed and restarted
/// under the processes that use it.
struct HistoryRedis {
    port: u16,
    child: Option<std::process::Child>,
}

impl HistoryRedis {
    async fn start() -> HistoryRedis {
        // Below the kernel's ephemeral range, so no client connection can take the port
        // while Redis is down for a restart.
        let port = (0..100)
            .map(|_| 29_000 + rand::random::<u16>() % 3_000)
            .find(|p| std::net::TcpListener::bind(("127.0.0.1", *p)).is_ok())
            .expect("a free port for the history's Redis");
        let mut r = HistoryRedis { port, child: None };
        r.spawn().await;
        r
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    async fn spawn(&mut self) {
        let child = std::process::Command::new("redis-server")
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server (scripts/services.sh installs it)");
        self.child = Some(child);
        let client = redis::Client::open(self.url()).unwrap();
        for _ in 0..200 {
            if let Ok(mut c) = client.get_multiplexed_async_connection().await
                && redis::cmd("PING").query_async::<String>(&mut c).await.is_ok()
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("history redis did not come up on {}", self.port);
    }

    /// Kills Redis (everything in it is lost: no persistence) and starts it again.
    async fn restart(&mut self) {
        self.kill();
        self.spawn().await;
    }

    /// A connection for the checker's own commands: FLUSHALL and large XRANGE pages take
    /// longer than redis-rs's default 500 ms reply timeout at scale.
    async fn conn(&self) -> redis::aio::MultiplexedConnection {
        let config = redis::AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_secs(60)));
        let client = redis::Client::open(self.url()).unwrap();
        client.get_multiplexed_async_connection_with_config(&config).await.unwrap()
    }

    async fn flushall(&self) {
        let mut c = self.conn().await;
        let _: () = redis::cmd("FLUSHALL").query_async(&mut c).await.unwrap();
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for HistoryRedis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The texts of every key at one corpus version.
#[derive(Debug, Clone)]
struct Corpus {
    version: u32,
    texts: Vec<String>,
}

fn key_of(k: usize) -> (String, i32) {
    (format!("h{}", k / 8), (k % 8) as i32)
}

/// A text for key `k` first written at `version`; a few are inputs the provider rejects for
/// good (and may become clean again in a later version).
fn text_for(k: usize, version: u32, rng: &mut StdRng) -> String {
    if rng.random_bool(0.03) {
        format!("key {k} v{version} {}", mock_provider::POISON_400)
    } else {
        format!("key {k} v{version} words to embed for the history checker")
    }
}

impl Corpus {
    fn first(keys: usize, rng: &mut StdRng) -> Corpus {
        Corpus { version: 0, texts: (0..keys).map(|k| text_for(k, 0, rng)).collect() }
    }

    /// The next version: about `share` of the keys get a new text.
    fn next(&self, rng: &mut StdRng, share: f64) -> Corpus {
        let version = self.version + 1;
        let texts = self
            .texts
            .iter()
            .enumerate()
            .map(|(k, t)| if rng.random_bool(share) { text_for(k, version, rng) } else { t.clone() })
            .collect();
        Corpus { version, texts }
    }

    fn write(&self, dir: &std::path::Path) -> std::path::PathBuf {
        let path = dir.join(format!("corpus-v{}.jsonl", self.version));
        if !path.exists() {
            let mut s = String::with_capacity(self.texts.len() * 80);
            for (k, t) in self.texts.iter().enumerate() {
                let (doc, idx) = key_of(k);
                s.push_str(&line(&doc, idx, t));
            }
            std::fs::write(&path, s).unwrap();
        }
        path
    }
}

/// The providers a history can point a process at.
struct Providers {
    healthy: MockProvider,
    flaky: MockProvider,
    slow: MockProvider,
    /// Healthy until an outage is switched on.
    outage: MockProvider,
    /// Always down (503): what a short outage parks.
    down: MockProvider,
    /// Very slow: a replay through it is in flight for a while.
    crawling: MockProvider,
}

impl Providers {
    async fn start(seed: u64) -> Providers {
        Providers {
            healthy: start_mock(MockConfig { seed, ..MockConfig::default() }).await,
            flaky: start_mock(MockConfig {
                seed: seed ^ 0x5eed,
                rate_429: 0.05,
                retry_after_ms: 20,
                rate_5xx: 0.08,
                rate_timeout: 0.01,
                timeout_hold_ms: 3_000,
                rate_reset: 0.02,
                ..MockConfig::default()
            })
            .await,
            slow: start_mock(MockConfig { seed: seed ^ 0x510, latency_ms: 40, ..MockConfig::default() })
                .await,
            outage: start_mock(MockConfig { seed: seed ^ 0x07, ..MockConfig::default() }).await,
            down: start_mock(MockConfig { seed: seed ^ 0xd0, rate_5xx: 1.0, ..MockConfig::default() }).await,
            crawling: start_mock(MockConfig { seed: seed ^ 0xc4, latency_ms: 600, ..MockConfig::default() })
                .await,
        }
    }

    fn pick(&self, rng: &mut StdRng) -> (&'static str, String) {
        match rng.random_range(0..4) {
            0 => ("healthy", self.healthy.base_url()),
            1 => ("flaky", self.flaky.base_url()),
            2 => ("slow", self.slow.base_url()),
            _ => ("outage", self.outage.base_url()),
        }
    }
}

/// Everything a history run has: services, providers, the model and counters.
struct History {
    seed: u64,
    rng: StdRng,
    db: TestDb,
    redis: HistoryRedis,
    prefix: String,
    providers: Providers,
    dir: std::path::PathBuf,
    /// The newest corpus version written.
    newest: Corpus,
    /// Per table: the newest version ingested into it at least once (even partly).
    ingested: BTreeMap<&'static str, u32>,
    corpora: HashMap<u32, Corpus>,
    serves: Vec<Child>,
    outage_on: bool,
    ops: BTreeMap<&'static str, u64>,
    kills: u64,
    log: Vec<String>,
}

fn binary() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_embed-dlq"));
    c.env_remove("EMBED_DLQ_API_KEY")
        .env_remove("EMBED_DLQ_CONFIG")
        .env_remove("EMBED_DLQ_FAILPOINT")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    c
}

impl History {
    async fn new(seed: u64, scale: &Scale) -> History {
        let mut rng = StdRng::seed_from_u64(seed);
        let db = TestDb::new().await;
        let redis = HistoryRedis::start().await;
        let dir = std::env::temp_dir().join(format!("embed-dlq-history-{}-{seed}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let newest = Corpus::first(scale.keys, &mut rng);
        let mut corpora = HashMap::new();
        corpora.insert(0, newest.clone());
        let mut h = History {
            seed,
            rng,
            providers: Providers::start(seed).await,
            prefix: format!("hist-{}-{seed}", std::process::id()),
            db,
            redis,
            dir,
            newest,
            ingested: BTreeMap::new(),
            corpora,
            serves: Vec::new(),
            outage_on: false,
            ops: BTreeMap::new(),
            kills: 0,
            log: Vec::new(),
        };
        let out = binary()
            .args(["migrate", "--database-url", &h.db.url, "--table", TABLES[1], "--dimensions", "768"])
            .output()
            .await
            .unwrap();
        assert!(out.status.success(), "migrate: {}", String::from_utf8_lossy(&out.stderr));
        h.note("start", format!("seed {seed}, {} keys", scale.keys));
        h
    }

    fn note(&mut self, op: &'static str, what: String) {
        *self.ops.entry(op).or_default() += 1;
        self.log.push(format!("{op}: {what}"));
    }

    fn common_flags(&self, c: &mut Command, base_url: &str) {
        c.args(["--database-url", &self.db.url, "--redis-url", &self.redis.url()])
            .args(["--base-url", base_url, "--model", MODEL, "--request-timeout-ms", "1000"])
            .args(["--retry-max-attempts", "3", "--retry-base-ms", "5", "--retry-cap-ms", "50"])
            .args(["--dlq-base-secs", "1", "--dlq-cap-secs", "2", "--dlq-max-replays", "50"])
            .args(["--breaker-cooldown-ms", "200", "--max-outage-secs", "3"]);
    }

    fn ingest_cmd(&self, table: &str, corpus: &std::path::Path, base_url: &str) -> Command {
        let mut c = binary();
        c.arg("ingest").arg(corpus);
        self.common_flags(&mut c, base_url);
        c.args([
            "--table",
            table,
            "--batch-max-inputs",
            "64",
            "--concurrency",
            "4",
            "--no-progress",
            "--json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        c
    }

    fn serve_cmd(&self, base_url: &str) -> Command {
        let mut c = binary();
        c.arg("serve");
        self.common_flags(&mut c, base_url);
        c.args(["--stream-prefix", &self.prefix, "--replayers", "2", "--replay-batch", "16"])
            .args(["--min-idle-ms", "1500", "--relay-poll-ms", "100", "--grace-ms", "2000"])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        c
    }

    fn pick_table(&mut self) -> &'static str {
        TABLES[self.rng.random_range(0..TABLES.len())]
    }

    /// The corpus to ingest into `table`: usually the newest, sometimes a new version first.
    fn corpus_for(&mut self, table: &'static str, bump: bool) -> Corpus {
        if bump {
            let share = self.rng.random_range(0.05..0.4);
            let next = self.newest.next(&mut self.rng, share);
            self.corpora.insert(next.version, next.clone());
            self.newest = next;
        }
        let c = self.newest.clone();
        self.ingested.insert(table, c.version);
        c
    }

    /// One ingest, possibly SIGKILLed at a random moment.
    async fn ingest(&mut self, bump: bool, kill: bool) {
        let table = self.pick_table();
        let corpus = self.corpus_for(table, bump);
        let path = corpus.write(&self.dir);
        let (provider, url) = self.providers.pick(&mut self.rng);
        let mut child = self.ingest_cmd(table, &path, &url).spawn().unwrap();
        let what = format!("v{} into {table} via {provider}", corpus.version);
        if kill {
            let after = Duration::from_millis(self.rng.random_range(20..1500));
            if tokio::time::timeout(after, child.wait()).await.is_err() {
                child.start_kill().unwrap();
                let _ = child.wait().await;
                self.kills += 1;
                self.note("ingest_killed", format!("{what}, SIGKILL after {after:?}"));
                return;
            }
        }
        let out = tokio::time::timeout(Duration::from_secs(600), child.wait_with_output())
            .await
            .expect("ingest finishes")
            .unwrap();
        let code = out.status.code();
        assert!(
            matches!(code, Some(0 | 4)),
            "seed {}: ingest {what} exited {code:?}: {}",
            self.seed,
            String::from_utf8_lossy(&out.stderr)
        );
        self.note(if bump { "ingest_new_version" } else { "ingest" }, format!("{what}: exit {code:?}"));
    }

    /// Two ingests of the same keys at once.
    async fn concurrent_ingests(&mut self) {
        let table = self.pick_table();
        let bump = self.rng.random_bool(0.5);
        let corpus = self.corpus_for(table, bump);
        let path = corpus.write(&self.dir);
        let (_, a) = self.providers.pick(&mut self.rng);
        let (_, b) = self.providers.pick(&mut self.rng);
        let (mut ca, mut cb) = (self.ingest_cmd(table, &path, &a), self.ingest_cmd(table, &path, &b));
        let (ra, rb) = tokio::join!(ca.output(), cb.output());
        for r in [ra, rb] {
            let out = r.unwrap();
            assert!(
                matches!(out.status.code(), Some(0 | 4)),
                "seed {}: concurrent ingest exited {:?}: {}",
                self.seed,
                out.status.code(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        self.note("concurrent_ingests", format!("v{} into {table}", corpus.version));
    }

    /// Content changes while its replay is in flight: an outage parks a new version, a serve
    /// replays it through a very slow provider, and meanwhile the next version (changing the
    /// same keys again) is parked by another outage. The replays of the older texts must
    /// commit nothing.
    async fn change_in_flight(&mut self) {
        let table = self.pick_table();
        let down = self.providers.down.base_url();
        for round in 0..2 {
            let corpus = self.corpus_for(table, true);
            let path = corpus.write(&self.dir);
            let mut c = self.ingest_cmd(table, &path, &down);
            // A short outage: everything changed parks as transient, the breaker stays shut.
            c.args(["--breaker-failure-threshold", "10000"]);
            let out = c.output().await.unwrap();
            assert!(
                matches!(out.status.code(), Some(0 | 4)),
                "seed {}: ingest during an outage exited {:?}: {}",
                self.seed,
                out.status.code(),
                String::from_utf8_lossy(&out.stderr)
            );
            if round == 0 {
                let crawling = self.providers.crawling.base_url();
                let child = self.serve_cmd(&crawling).spawn().unwrap();
                self.serves.push(child);
                // Parked rows are due within a second; let the replays get under way.
                tokio::time::sleep(Duration::from_millis(self.rng.random_range(1200..2500))).await;
            }
        }
        self.note("change_in_flight", format!("two versions into {table} around a slow replay"));
    }

    fn start_serve(&mut self) {
        if self.serves.len() >= 2 {
            return;
        }
        let (provider, url) = self.providers.pick(&mut self.rng);
        let child = self.serve_cmd(&url).spawn().unwrap();
        self.serves.push(child);
        self.note("serve_started", format!("via {provider}"));
    }

    async fn kill_serve(&mut self, hard: bool) {
        if self.serves.is_empty() {
            self.start_serve();
            tokio::time::sleep(Duration::from_millis(self.rng.random_range(100..800))).await;
        }
        let i = self.rng.random_range(0..self.serves.len());
        let mut child = self.serves.swap_remove(i);
        if hard {
            child.start_kill().unwrap();
            self.kills += 1;
        } else if let Some(pid) = child.id() {
            let _ = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status();
        }
        let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
            .await
            .expect("serve exits after the signal")
            .unwrap();
        self.note(if hard { "serve_killed" } else { "serve_stopped" }, format!("{status}"));
    }

    async fn run_cli(&mut self, op: &'static str, args: &[&str]) {
        let mut c = binary();
        c.args(args)
            .args(["--database-url", &self.db.url, "--redis-url", &self.redis.url()])
            .env("EMBED_DLQ_STREAM_PREFIX", &self.prefix);
        let out = c.output().await.unwrap();
        let code = out.status.code();
        let ok = match op {
            "reconcile_repair" => matches!(code, Some(0 | 5)),
            _ => code == Some(0),
        };
        assert!(
            ok,
            "seed {}: {args:?} exited {code:?}: {}{}",
            self.seed,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        self.note(op, format!("exit {code:?}"));
    }

    /// One random operation.
    async fn step(&mut self, scale: &Scale, done: usize) {
        let kills_behind = self.kills < scale.min_kills && done.is_multiple_of(2);
        let choice =
            if kills_behind { self.rng.random_range(0..2) * 5 } else { self.rng.random_range(0..16) };
        match choice {
            0 => self.ingest(true, true).await,
            14 | 15 => self.change_in_flight().await,
            1 | 2 => {
                let bump = self.rng.random_bool(0.6);
                self.ingest(bump, false).await
            }
            3 => self.concurrent_ingests().await,
            4 => self.start_serve(),
            5 => self.kill_serve(true).await,
            6 => self.kill_serve(false).await,
            7 => {
                self.outage_on = !self.outage_on;
                self.providers.outage.control.set_outage(self.outage_on);
                self.note("outage", if self.outage_on { "on".into() } else { "off".into() });
            }
            8 => {
                if self.rng.random_bool(0.5) {
                    self.redis.flushall().await;
                    self.note("redis_flushall", String::new());
                } else {
                    self.redis.restart().await;
                    self.note("redis_restart", "data lost".into());
                }
            }
            9 => {
                self.run_cli("dlq_requeue", &["dlq", "requeue", "--all", "--all-tables", "--rate", "100000"])
                    .await
            }
            10 => {
                self.run_cli(
                    "dlq_purge",
                    &["dlq", "purge", "--class", "permanent_input", "--all-tables", "--yes"],
                )
                .await
            }
            11 => self.run_cli("reconcile_repair", &["reconcile", "--repair"]).await,
            _ => {
                let pause = Duration::from_millis(self.rng.random_range(100..1500));
                tokio::time::sleep(pause).await;
                self.note("pause", format!("{pause:?}"));
            }
        }
    }

    /// Brings the deployment to rest the way an operator would: provider healthy, the newest
    /// corpus rerun into every table it went to, serve drains the DLQ, one reconcile repair.
    async fn settle(&mut self) -> Vec<(String, bool, String)> {
        let mut checks = Vec::new();
        for mut s in std::mem::take(&mut self.serves) {
            let _ = s.start_kill();
            let _ = s.wait().await;
        }
        self.providers.outage.control.set_outage(false);
        let url = self.providers.healthy.base_url();
        let newest = self.newest.clone();
        let path = newest.write(&self.dir);
        let tables: Vec<&'static str> = self.ingested.keys().copied().collect();
        for table in tables.iter().copied() {
            self.ingested.insert(table, newest.version);
            let out = self.ingest_cmd(table, &path, &url).output().await.unwrap();
            assert_eq!(
                out.status.code(),
                Some(0),
                "seed {}: final ingest into {table}: {}",
                self.seed,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        // Transient rows parked by earlier runs are replayed by serve on their schedule; make
        // them due now (in every table) so the check does not wait out the backoff.
        self.run_cli(
            "dlq_requeue",
            &["dlq", "requeue", "--class", "transient", "--all-tables", "--rate", "100000"],
        )
        .await;
        let mut serve = self.serve_cmd(&url).spawn().unwrap();
        // Replay drains about a thousand rows a second here; give large histories time.
        let limit = Duration::from_secs(180 + self.newest.texts.len() as u64 / 200);
        let drained = self.wait_until_drained(limit).await;
        checks.push(("no transient DLQ row once healthy and served".into(), drained, String::new()));
        // One repair (with serve running, so what it re-publishes is relayed), then a clean check.
        self.run_cli("reconcile_repair", &["reconcile", "--repair"]).await;
        self.wait_until_drained(Duration::from_secs(60)).await;
        let mut c = binary();
        c.args(["reconcile", "--json", "--database-url", &self.db.url, "--redis-url", &self.redis.url()])
            .env("EMBED_DLQ_STREAM_PREFIX", &self.prefix);
        let out = c.output().await.unwrap();
        let report = String::from_utf8_lossy(&out.stdout).to_string();
        checks.push(("reconcile clean after one repair".into(), out.status.code() == Some(0), report));
        if let Some(pid) = serve.id() {
            let _ = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status();
        }
        let _ = tokio::time::timeout(Duration::from_secs(30), serve.wait()).await;
        let _ = serve.start_kill();
        checks
    }

    /// Waits until no transient DLQ row and no unpublished outbox row is left.
    async fn wait_until_drained(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            let left = self
                .db
                .count(
                    "SELECT (SELECT count(*) FROM embedding_dlq WHERE error_class = 'transient')
                          + (SELECT count(*) FROM dlq_outbox WHERE published_at IS NULL)",
                )
                .await;
            if left == 0 {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Checks every key of every table against the model.
    async fn check_model(&self) -> Vec<(String, bool, String)> {
        let mut checks = Vec::new();
        let pool = &self.db.pool;
        for (table, version) in &self.ingested {
            let corpus = &self.corpora[version];
            let vectors: HashMap<(String, i32), (String, pgvector::Vector)> =
                sqlx::query_as::<_, (String, i32, String, pgvector::Vector)>(sqlx::AssertSqlSafe(format!(
                    "SELECT doc_id, chunk_index, content_hash, embedding FROM {table}"
                )))
                .fetch_all(pool)
                .await
                .unwrap()
                .into_iter()
                .map(|(d, i, h, v)| ((d, i), (h, v)))
                .collect();
            let dlq: HashMap<(String, i32), (String, serde_json::Value)> =
                sqlx::query_as::<_, (String, i32, String, serde_json::Value)>(
                    "SELECT d.doc_id, d.chunk_index, d.error_class, d.payload FROM embedding_dlq d
                      WHERE d.target_table IN ($1, 'public.' || $1)",
                )
                .bind(table)
                .fetch_all(pool)
                .await
                .unwrap()
                .into_iter()
                .map(|(d, i, c, p)| ((d, i), (c, p)))
                .collect();
            let (mut stored_ok, mut parked_ok) = (0u64, 0u64);
            let mut wrong = Vec::new();
            for (k, text) in corpus.texts.iter().enumerate() {
                let key = key_of(k);
                let hash = embed_dlq::model::content_hash(MODEL, DIMS, text);
                match (vectors.get(&key), dlq.get(&key)) {
                    (Some((h, v)), None) if *h == hash => {
                        let want = mock_provider::vector_for(text, DIMS);
                        let close = v.as_slice().iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-5);
                        if close {
                            stored_ok += 1;
                        } else {
                            wrong.push(format!("{key:?}: stored vector is not the newest text's"));
                        }
                    }
                    (_, Some((class, payload))) if payload["text"].as_str() == Some(text.as_str()) => {
                        if vectors.get(&key).is_some_and(|(h, _)| *h == hash) {
                            wrong.push(format!("{key:?}: DLQ row ({class}) beside its stored vector"));
                        } else if class == "transient" {
                            wrong.push(format!("{key:?}: still transient"));
                        } else if !text.contains(mock_provider::POISON_400) {
                            wrong.push(format!("{key:?}: a clean text parked as {class}"));
                        } else {
                            parked_ok += 1;
                        }
                    }
                    (v, d) => wrong.push(format!(
                        "{key:?}: expected {text:?}; vector hash {:?}, DLQ {:?}",
                        v.map(|(h, _)| h),
                        d.map(|(c, p)| (c, p["text"].clone()))
                    )),
                }
            }
            checks.push((
                format!("{table}: every key is the newest text's vector or its DLQ row"),
                wrong.is_empty(),
                format!(
                    "{stored_ok} stored, {parked_ok} parked, {} wrong{}",
                    wrong.len(),
                    wrong.iter().take(5).map(|w| format!("; {w}")).collect::<String>()
                ),
            ));
            let dups: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT count(*) FROM (SELECT 1 FROM {table} GROUP BY doc_id, chunk_index HAVING count(*) > 1) d"
            )))
            .fetch_one(pool)
            .await
            .unwrap();
            checks.push((format!("{table}: no duplicate vectors"), dups == 0, format!("{dups}")));
            let extra = vectors.len().saturating_sub(corpus.texts.len());
            checks.push((format!("{table}: no vector outside the corpus"), extra == 0, format!("{extra}")));
        }
        for table in self.ingested.keys() {
            let leaks: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT count(*) FROM ingest_manifest m
                  WHERE m.target_table IN ('{table}', 'public.{table}')
                    AND NOT EXISTS (SELECT 1 FROM {table} e
                                     WHERE e.doc_id = m.doc_id AND e.chunk_index = m.chunk_index)
                    AND NOT EXISTS (SELECT 1 FROM embedding_dlq d
                                     WHERE d.target_table = m.target_table
                                       AND d.doc_id = m.doc_id AND d.chunk_index = m.chunk_index)"
            )))
            .fetch_one(pool)
            .await
            .unwrap();
            checks.push((format!("{table}: no leaks (the seed's query)"), leaks == 0, format!("{leaks}")));
        }
        checks.push(self.parked_events_check().await);
        checks
    }

    /// Every DLQ row was announced by a `parked` event, and no row was announced twice for
    /// the same content (the texts of this history never return to an earlier one, so one
    /// park of one content is one event whatever ran concurrently or was retried).
    async fn parked_events_check(&self) -> (String, bool, String) {
        let mut c = self.redis.conn().await;
        let stream = embed_dlq::streams::StreamKeys::new(&self.prefix).events();
        let mut seen: HashMap<(i64, String), u64> = HashMap::new();
        let mut start = "-".to_string();
        loop {
            let page: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
                .arg(&stream)
                .arg(&start)
                .arg("+")
                .arg("COUNT")
                .arg(2000)
                .query_async(&mut c)
                .await
                .unwrap();
            let n = page.ids.len();
            for e in page.ids {
                start = format!("({}", e.id);
                if embed_dlq::streams::field(&e.map, "event").as_deref() != Some("parked") {
                    continue;
                }
                let Some(body) = embed_dlq::streams::field(&e.map, "body")
                    .and_then(|b| serde_json::from_str::<serde_json::Value>(&b).ok())
                else {
                    continue;
                };
                let id = body["dlq_id"].as_i64().unwrap_or(-1);
                let hash = body["content_hash"].as_str().unwrap_or("?").to_string();
                *seen.entry((id, hash)).or_default() += 1;
            }
            if n < 2000 {
                break;
            }
        }
        let rows: Vec<(i64, String)> = sqlx::query_as("SELECT id, content_hash FROM embedding_dlq")
            .fetch_all(&self.db.pool)
            .await
            .unwrap();
        // The events stream is capped (MAXLEN): an announcement older than its first entry
        // was trimmed by policy, which the outbox's recorded entry id proves.
        let head: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
            .arg(&stream)
            .arg("-")
            .arg("+")
            .arg("COUNT")
            .arg(1)
            .query_async(&mut c)
            .await
            .unwrap();
        let head = head.ids.first().map(|e| embed_dlq::streams::parse_entry_id(&e.id)).unwrap_or((0, 0));
        let unannounced: Vec<&(i64, String)> = rows.iter().filter(|k| !seen.contains_key(*k)).collect();
        let ids: Vec<i64> = unannounced.iter().map(|(id, _)| *id).collect();
        let recorded: Vec<(i64, String, Option<String>)> = sqlx::query_as(
            "SELECT dlq_id, body->>'content_hash', entry_id FROM dlq_outbox
              WHERE event = 'parked' AND dlq_id = ANY($1) AND published_at IS NOT NULL",
        )
        .bind(&ids)
        .fetch_all(&self.db.pool)
        .await
        .unwrap();
        let trimmed: std::collections::HashSet<(i64, String)> = recorded
            .into_iter()
            .filter(|(_, _, e)| e.as_deref().is_some_and(|e| embed_dlq::streams::parse_entry_id(e) < head))
            .map(|(id, h, _)| (id, h))
            .collect();
        let mut bad: Vec<String> = unannounced
            .iter()
            .filter(|k| !trimmed.contains(**k))
            .map(|(id, _)| format!("row {id}: its content was never announced as parked"))
            .collect();
        bad.extend(
            seen.iter()
                .filter(|(_, n)| **n > 1)
                .map(|((id, h), n)| format!("row {id} content {}: {n} parked events", &h[..h.len().min(12)])),
        );
        (
            "one parked event per DLQ row and content".into(),
            bad.is_empty(),
            format!(
                "{} rows, {} parked events, {} announced before the stream's length cap trimmed them, {} problems{}",
                rows.len(),
                seen.values().sum::<u64>(),
                trimmed.len(),
                bad.len(),
                bad.iter().take(5).map(|b| format!("; {b}")).collect::<String>()
            ),
        )
    }

    async fn counts(&self) -> String {
        let mut s = String::new();
        for table in self.ingested.keys() {
            let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
                .fetch_one(&self.db.pool)
                .await
                .unwrap();
            let _ = write!(s, "{table}: {n} vectors; ");
        }
        let by_class: Vec<(String, i64)> =
            sqlx::query_as("SELECT error_class, count(*) FROM embedding_dlq GROUP BY 1 ORDER BY 1")
                .fetch_all(&self.db.pool)
                .await
                .unwrap();
        let _ = write!(s, "DLQ {by_class:?}; ");
        let events: i64 = self.db.count("SELECT count(*) FROM dlq_outbox WHERE event = 'parked'").await;
        let _ = write!(s, "parked events in the outbox {events}");
        s
    }
}

/// Runs one seeded history to the end; returns the report and whether every invariant held.
async fn run_history(seed: u64, scale: &Scale) -> (String, bool) {
    let started = Instant::now();
    let mut h = History::new(seed, scale).await;
    let mut done = 0usize;
    loop {
        let more = match scale.deadline {
            Some(d) => started.elapsed() < d || h.kills < scale.min_kills,
            None => done < scale.ops || h.kills < scale.min_kills,
        };
        if !more {
            break;
        }
        h.step(scale, done).await;
        done += 1;
    }
    let mut checks = h.settle().await;
    checks.extend(h.check_model().await);
    let all_ok = checks.iter().all(|(_, ok, _)| *ok);

    let mut r = String::new();
    let _ = writeln!(
        r,
        "history seed {seed}: {} keys, {done} operations, {} kills, {:.0}s",
        scale.keys,
        h.kills,
        started.elapsed().as_secs_f64()
    );
    let _ = writeln!(r, "operations: {:?}", h.ops);
    let _ = writeln!(r, "final: {}", h.counts().await);
    for (name, ok, detail) in &checks {
        let detail = if detail.len() > 600 { &detail[..600] } else { detail.as_str() };
        let _ = writeln!(r, "  [{}] {name}: {detail}", if *ok { "pass" } else { "FAIL" });
    }
    if !all_ok {
        let _ = writeln!(r, "history (last 40 operations):");
        for l in h.log.iter().rev().take(40).rev() {
            let _ = writeln!(r, "    {l}");
        }
    }
    let _ = std::fs::remove_dir_all(&h.dir);
    (r, all_ok)
}

/// Fixed seeds for CI, plus one random seed printed with the report (rerun it with
/// `EMBED_DLQ_HISTORY_SEEDS=<seed>`).
fn seeds() -> Vec<u64> {
    match std::env::var("EMBED_DLQ_HISTORY_SEEDS") {
        Ok(s) if !s.trim().is_empty() => {
            s.split(',').map(|x| x.trim().parse().expect("numeric seed")).collect()
        }
        _ => vec![7, 1009, rand::random::<u32>() as u64],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomized_histories_keep_every_promise() {
    let scale = Scale::from_env();
    let mut failed = Vec::new();
    let mut full = String::new();
    for seed in seeds() {
        let (report, ok) = run_history(seed, &scale).await;
        println!("{report}");
        full.push_str(&report);
        if !ok {
            failed.push(seed);
        }
    }
    if let Ok(path) = std::env::var("EMBED_DLQ_HISTORY_REPORT") {
        std::fs::write(path, &full).unwrap();
    }
    assert!(
        failed.is_empty(),
        "histories failed for seeds {failed:?} (rerun with EMBED_DLQ_HISTORY_SEEDS):\n{full}"
    );
}
