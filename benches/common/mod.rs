//! Helpers shared by the benches (`mod common;` in each): settings from the environment, a
//! database of the bench's own, the reconcile data set, and the probes of the capacity bench
//! (CPU-seconds per tier: this process, Postgres' backends, each Redis node).
//!
//! Every bench uses only part of this module.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::{Connection, PgConnection, PgPool};

/// `name` parsed as a number, else `default`.
pub fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// `url` with its database replaced by `db` (query string dropped).
pub fn with_database(url: &str, db: &str) -> String {
    let base = url.split('?').next().unwrap();
    let scheme_end = base.find("://").map(|i| i + 3).unwrap_or(0);
    let path_start = base[scheme_end..].find('/').map(|i| i + scheme_end).unwrap_or(base.len());
    format!("{}/{db}", &base[..path_start])
}

/// The median (upper median of an even count).
pub fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.partial_cmp(b).unwrap());
    xs[xs.len() / 2]
}

/// A database of the bench's own on the server of `admin`, migrated; dropped by
/// [`BenchDb::drop`].
pub struct BenchDb {
    pub name: String,
    pub url: String,
    pub pool: PgPool,
    admin: PgConnection,
}

impl BenchDb {
    /// Creates database `name` and runs the migrations.
    pub async fn create(admin: &str, name: &str) -> BenchDb {
        let mut conn = PgConnection::connect(admin).await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
            .execute(&mut conn)
            .await
            .unwrap();
        let url = with_database(admin, name);
        let pool = embed_dlq::store::connect(&url, 8).await.unwrap();
        embed_dlq::store::migrate(&pool).await.unwrap();
        BenchDb { name: name.to_string(), url, pool, admin: conn }
    }

    /// Closes the pool and drops the database.
    pub async fn drop(mut self) {
        self.pool.close().await;
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE \"{}\" WITH (FORCE)", self.name)))
            .execute(&mut self.admin)
            .await
            .unwrap();
    }
}

/// `size` manifest rows of the default table: every hundredth parked with a DLQ row, the
/// rest stored with a vector (1000 distinct 768-dim vectors, each row its own copy); then
/// `VACUUM ANALYZE`, as autovacuum would.
pub async fn load_reconcile_rows(pool: &PgPool, size: usize) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TEMP TABLE basis AS
             SELECT g AS k, (SELECT array_agg(sin(g * 7.1 + j)::real) FROM generate_series(1, 768) j)::vector(768) AS v
               FROM generate_series(0, 999) g;
         INSERT INTO ingest_manifest (target_table, doc_id, chunk_index, content_hash, status, source_seq)
         SELECT 'public.doc_embeddings', 'bench-doc-' || lpad((i / 8)::text, 8, '0'), i % 8,
                encode(sha256(i::text::bytea), 'hex'),
                CASE WHEN i % 100 = 99 THEN 'parked' ELSE 'stored' END, (1::bigint << 32) | i
           FROM generate_series(0, {n}) i;
         INSERT INTO doc_embeddings (doc_id, chunk_index, content_hash, embedding)
         SELECT 'bench-doc-' || lpad((i / 8)::text, 8, '0'), i % 8, encode(sha256(i::text::bytea), 'hex'), b.v
           FROM generate_series(0, {n}) i JOIN basis b ON b.k = i % 1000
          WHERE i % 100 <> 99;
         INSERT INTO embedding_dlq (target_table, doc_id, chunk_index, content_hash, model, dimensions, payload,
                                    error_class, error_reason, last_error, last_status, attempts, next_retry_at)
         SELECT 'public.doc_embeddings', 'bench-doc-' || lpad((i / 8)::text, 8, '0'), i % 8,
                encode(sha256(i::text::bytea), 'hex'), 'bench', 768,
                jsonb_build_object('doc_id', 'bench-doc-' || lpad((i / 8)::text, 8, '0'), 'chunk_index', i % 8,
                                   'text', 'text of chunk ' || i),
                'transient', 'http_503', 'HTTP 503', 503, 3, now() + interval '1 hour'
           FROM generate_series(0, {n}) i WHERE i % 100 = 99;
         DROP TABLE basis;",
        n = size - 1
    )))
    .execute(pool)
    .await
    .unwrap();
    sqlx::raw_sql("VACUUM ANALYZE ingest_manifest, doc_embeddings, embedding_dlq")
        .execute(pool)
        .await
        .unwrap();
}

/// Re-stores `n` stored chunks (from `offset` on, by key) with new content, as an ingest of
/// changed text does: manifest and vector in one transaction.
pub async fn change_reconcile_rows(pool: &PgPool, offset: usize, n: usize, round: usize) {
    let mut tx = pool.begin().await.unwrap();
    let keys = "SELECT doc_id, chunk_index FROM ingest_manifest WHERE status = 'stored'
                 ORDER BY doc_id, chunk_index OFFSET $1 LIMIT $2";
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE ingest_manifest m SET content_hash = encode(sha256((m.content_hash || $3)::bytea), 'hex'),
                updated_at = now()
           FROM ({keys}) k WHERE m.doc_id = k.doc_id AND m.chunk_index = k.chunk_index"
    )))
    .bind(offset as i64)
    .bind(n as i64)
    .bind(round.to_string())
    .execute(&mut *tx)
    .await
    .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE doc_embeddings e SET content_hash = m.content_hash, updated_at = now(),
                embedding = array_fill(0.5::real, ARRAY[768])::vector
           FROM ({keys}) k JOIN ingest_manifest m USING (doc_id, chunk_index)
          WHERE e.doc_id = k.doc_id AND e.chunk_index = k.chunk_index"
    )))
    .bind(offset as i64)
    .bind(n as i64)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
}

// ---------------------------------------------------------------------------------------
// CPU probes
// ---------------------------------------------------------------------------------------

/// Clock ticks per second of `/proc/<pid>/stat` (USER_HZ, 100 on every Linux build in use).
const TICKS_PER_SEC: f64 = 100.0;

/// utime + stime (ticks) and ppid of `/proc/<path>/stat`.
fn proc_stat(path: &str) -> Option<(u64, u32)> {
    let s = std::fs::read_to_string(format!("/proc/{path}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest[0] is field 3 (state): ppid is field 4, utime 14, stime 15.
    let ppid = f.get(1)?.parse().ok()?;
    let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some((ticks, ppid))
}

/// Which tier a Postgres process's CPU is booked to.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum PgClass {
    /// Client backends (and autovacuum workers) of the bench's database.
    Own,
    /// Processes whose title names no database: I/O workers (Postgres 18 reads through
    /// them), parallel query workers, WAL writer, checkpointer, background writer,
    /// launchers, autovacuum workers. Shared with whatever else the server runs.
    Background,
    /// Client backends of other databases (other users of the server): not ours, shown so
    /// that a reader sees how busy the server was.
    Other,
}

#[derive(Default)]
struct SamplerState {
    /// Live children of the postmaster: class and last seen ticks.
    procs: HashMap<u32, (PgClass, u64)>,
    /// Ticks of children that exited, by class (Own, Background, Other).
    dead: [u64; 3],
    /// CPU ticks the sampler thread itself used (subtracted from this process's).
    sampler_ticks: u64,
}

fn class_index(c: PgClass) -> usize {
    match c {
        PgClass::Own => 0,
        PgClass::Background => 1,
        PgClass::Other => 2,
    }
}

/// CPU-seconds of each tier at one instant; [`CpuSnapshot::since`] gives a phase's.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuSnapshot {
    /// This process, the sampler thread excluded.
    pub client: f64,
    /// Postgres backends of the bench's database.
    pub pg_own: f64,
    /// Postgres' server-wide processes (WAL writer, checkpointer, ...).
    pub pg_background: f64,
    /// Postgres backends of other databases.
    pub pg_other: f64,
}

impl CpuSnapshot {
    /// `self - earlier`.
    pub fn since(&self, earlier: &CpuSnapshot) -> CpuSnapshot {
        CpuSnapshot {
            client: self.client - earlier.client,
            pg_own: self.pg_own - earlier.pg_own,
            pg_background: self.pg_background - earlier.pg_background,
            pg_other: self.pg_other - earlier.pg_other,
        }
    }
}

/// Samples the postmaster's children every 100 ms on a thread of its own (so that the CPU
/// of a backend that exits between two snapshots is still counted, up to its last sample),
/// and books them by database. Needs the server on this machine: without access to the
/// postmaster's `/proc` entries the Postgres columns are zero and [`CpuSampler::postgres`]
/// is `false`.
pub struct CpuSampler {
    state: Arc<Mutex<SamplerState>>,
    postmaster: Option<u32>,
    dbs: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl CpuSampler {
    /// A sampler of the server `pool` talks to, booking backends of database `db` as own.
    pub async fn start(pool: &PgPool, db: &str) -> CpuSampler {
        let backend: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(pool).await.unwrap();
        let postmaster = proc_stat(&backend.to_string()).map(|(_, ppid)| ppid);
        let state = Arc::new(Mutex::new(SamplerState::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let dbs = Arc::new(Mutex::new(vec![db.to_string()]));
        let thread = {
            let (state, stop, dbs) = (state.clone(), stop.clone(), dbs.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Some(pm) = postmaster {
                        scan(&state, pm, &dbs.lock().unwrap());
                    }
                    if let Some((ticks, _)) = proc_stat("thread-self") {
                        state.lock().unwrap().sampler_ticks = ticks;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
        };
        CpuSampler { state, postmaster, dbs, stop, thread: Some(thread) }
    }

    /// Books the backends of database `db` as own too (call before connecting to it).
    pub fn add_own_db(&self, db: &str) {
        self.dbs.lock().unwrap().push(db.to_string());
    }

    /// Whether the Postgres columns are measured (the postmaster's processes are readable).
    pub fn postgres(&self) -> bool {
        self.postmaster.is_some()
    }

    /// Every tier's CPU-seconds so far (a fresh scan).
    pub fn snapshot(&self) -> CpuSnapshot {
        if let Some(pm) = self.postmaster {
            scan(&self.state, pm, &self.dbs.lock().unwrap());
        }
        let st = self.state.lock().unwrap();
        let mut by = st.dead;
        for (class, ticks) in st.procs.values() {
            by[class_index(*class)] += ticks;
        }
        let own = proc_stat("self").map(|(t, _)| t).unwrap_or(0).saturating_sub(st.sampler_ticks);
        CpuSnapshot {
            client: own as f64 / TICKS_PER_SEC,
            pg_own: by[0] as f64 / TICKS_PER_SEC,
            pg_background: by[1] as f64 / TICKS_PER_SEC,
            pg_other: by[2] as f64 / TICKS_PER_SEC,
        }
    }
}

impl Drop for CpuSampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The postmaster's children now: from `/proc/<pm>/task/<pm>/children`, else a scan of
/// `/proc`.
fn children(pm: u32) -> Vec<u32> {
    if let Ok(s) = std::fs::read_to_string(format!("/proc/{pm}/task/{pm}/children")) {
        return s.split_whitespace().filter_map(|p| p.parse().ok()).collect();
    }
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| proc_stat(&pid.to_string()).is_some_and(|(_, ppid)| ppid == pm))
        .collect()
}

/// The class of a Postgres child from its process title (`postgres: <user> <db> <host>
/// <activity>` for a client backend); `None` while the title is not set yet.
fn classify(pid: u32, dbs: &[String]) -> Option<PgClass> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let title = String::from_utf8_lossy(&raw).replace('\0', " ");
    if !title.starts_with("postgres: ") {
        return None;
    }
    let words: Vec<&str> = title.split_whitespace().collect();
    if words.iter().any(|w| dbs.iter().any(|d| d == w)) {
        Some(PgClass::Own)
    } else if words.get(3).is_some_and(|host| host.ends_with(')') || *host == "[local]") {
        // `postgres: <user> <db> <host>(<port>)`: a client backend of another database.
        Some(PgClass::Other)
    } else {
        Some(PgClass::Background)
    }
}

fn scan(state: &Mutex<SamplerState>, pm: u32, dbs: &[String]) {
    let live = children(pm);
    let mut st = state.lock().unwrap();
    let mut seen = Vec::with_capacity(live.len());
    for pid in live {
        let Some((ticks, _)) = proc_stat(&pid.to_string()) else { continue };
        seen.push(pid);
        match st.procs.get_mut(&pid) {
            Some(entry) => entry.1 = ticks,
            None => {
                // A title not set yet: counted as background this time, classified later.
                if let Some(class) = classify(pid, dbs) {
                    st.procs.insert(pid, (class, ticks));
                }
            }
        }
    }
    let gone: Vec<u32> = st.procs.keys().copied().filter(|p| !seen.contains(p)).collect();
    for pid in gone {
        let (class, ticks) = st.procs.remove(&pid).unwrap();
        st.dead[class_index(class)] += ticks;
    }
}

/// Counters of one Redis node (`INFO`): CPU-seconds (user + sys), bytes in and out, memory.
#[derive(Clone, Copy, Debug, Default)]
pub struct RedisStats {
    pub cpu: f64,
    pub net_in: f64,
    pub net_out: f64,
    pub used_memory: f64,
}

impl RedisStats {
    /// `self - earlier`.
    pub fn since(&self, earlier: &RedisStats) -> RedisStats {
        RedisStats {
            cpu: self.cpu - earlier.cpu,
            net_in: self.net_in - earlier.net_in,
            net_out: self.net_out - earlier.net_out,
            used_memory: self.used_memory - earlier.used_memory,
        }
    }
}

/// The `INFO` counters of one node over a plain (non-cluster) connection.
pub async fn redis_stats(conn: &mut redis::aio::MultiplexedConnection) -> RedisStats {
    let info: String = redis::cmd("INFO").query_async(conn).await.unwrap();
    let field = |name: &str| -> f64 {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    };
    RedisStats {
        cpu: field("used_cpu_user") + field("used_cpu_sys"),
        net_in: field("total_net_input_bytes"),
        net_out: field("total_net_output_bytes"),
        used_memory: field("used_memory"),
    }
}

/// One Redis node: its address, role, the slots it serves, a connection for `INFO`.
pub struct RedisNode {
    pub addr: String,
    pub master: bool,
    pub slots: Vec<(u16, u16)>,
    pub conn: redis::aio::MultiplexedConnection,
}

impl RedisNode {
    /// Whether this node serves `slot`.
    pub fn serves(&self, slot: u16) -> bool {
        self.slots.iter().any(|&(a, b)| (a..=b).contains(&slot))
    }
}

/// The single node of `url`.
pub async fn single_node(url: &str) -> RedisNode {
    let conn = redis::Client::open(url).unwrap().get_multiplexed_async_connection().await.unwrap();
    RedisNode { addr: url.to_string(), master: true, slots: vec![(0, 16383)], conn }
}

/// Every node of the cluster one of whose seed URLs is `seeds` (comma-separated), from
/// `CLUSTER NODES`.
pub async fn cluster_nodes(seeds: &str) -> Vec<RedisNode> {
    let seed = seeds.split(',').map(str::trim).find(|u| !u.is_empty()).unwrap().to_string();
    let mut conn =
        redis::Client::open(seed.as_str()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let text: String = redis::cmd("CLUSTER").arg("NODES").query_async(&mut conn).await.unwrap();
    let mut nodes = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 8 || f[2].contains("fail") {
            continue;
        }
        let addr = f[1].split('@').next().unwrap().to_string();
        let slots = f[8..]
            .iter()
            .filter(|s| !s.starts_with('['))
            .filter_map(|s| {
                let (a, b) = s.split_once('-').unwrap_or((s, s));
                Some((a.parse().ok()?, b.parse().ok()?))
            })
            .collect();
        let conn = redis::Client::open(format!("redis://{addr}/"))
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        nodes.push(RedisNode { addr, master: f[2].contains("master"), slots, conn });
    }
    nodes.sort_by(|a, b| a.addr.cmp(&b.addr));
    nodes
}

/// The mock provider in a process of its own (the release binary's `mock-provider`), so
/// that its CPU (making vectors) is not booked to the client.
pub struct MockProcess {
    child: std::process::Child,
    addr: String,
    http: reqwest::Client,
}

impl MockProcess {
    /// Starts it on a free port of 127.0.0.1 and waits until it answers.
    pub async fn start() -> MockProcess {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let addr = format!("127.0.0.1:{port}");
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_embed-dlq"))
            .args(["mock-provider", "--listen", &addr])
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let http = embed_dlq::http::client_builder().build().unwrap();
        for _ in 0..200 {
            if http.get(format!("http://{addr}/healthz")).send().await.is_ok() {
                return MockProcess { child, addr, http };
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("the mock provider did not come up on {addr}");
    }

    /// The provider base URL to configure.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Starts or ends an outage (every request answers 503).
    pub async fn set_outage(&self, on: bool) {
        let state = if on { "on" } else { "off" };
        self.http
            .post(format!("http://{}/control/outage/{state}", self.addr))
            .send()
            .await
            .unwrap()
            .error_for_status()
            .unwrap();
    }

    /// The mock process's CPU-seconds so far (provider side: not the tool's cost).
    pub fn cpu(&self) -> f64 {
        proc_stat(&self.child.id().to_string()).map(|(t, _)| t as f64 / TICKS_PER_SEC).unwrap_or(0.0)
    }
}

impl Drop for MockProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
