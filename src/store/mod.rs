//! Postgres: the system of record. A stage's own statements sit with the stage that runs them
//! (`ingest/lease.rs`: the intake window's one round trip; `relay/sql.rs`: the
//! outbox's claim and marks; `replay/sql.rs`: the scheduler's enqueue and the replayers'
//! fenced commits; [`crate::reconcile::sql`]: the checks and repairs, and the seed's leak and
//! duplicate queries). Every write of a chunk is one transaction that starts with the manifest
//! claim, which locks the chunks' manifest rows in key order, accepts only a record at least as
//! new as the one it holds ([`position`]) and releases the run's leases of them.
//!
//! What stays here is shared by the stages or belongs to none:
//!
//! - this module: [`Store`] (the pool and the target table, inspected in the catalog and
//!   cached), connections, migrations, the classification of Postgres errors;
//! - `write`: the manifest claim every outcome starts with and the fenced store of vectors
//!   (ingest's writers and replay's commit); [`park`]: the park transaction (ingest, the
//!   stream source, the reconciler's withdraw repair);
//! - `delete`: deletions (explicit deletes from the input, a run's cleanup), fenced like writes
//!   by position and by tombstones that the manifest claim honours;
//! - `source`: the attempts charged to a stream source's suspect entries; [`position`]: the
//!   one scale of positions that fences writes and deletions; [`prefix`]: the one stream prefix
//!   a database is relayed under;
//! - `dlq`: the operator actions and the manifest locks every DLQ writer takes first; `console`: what the operator console reads beyond them
//!   (keyset pages in any sort order, activity over time) and its audit trail.
//!
//! A chunk's identity is (target table, doc_id, chunk_index); the table is recorded by its
//! canonical catalog name (`public.doc_embeddings`), so two spellings are one identity and two
//! tables never share state.

pub(crate) mod console;
pub(crate) mod delete;
pub(crate) mod dlq;
mod migrations;
pub mod park;
pub mod position;
pub mod prefix;
pub mod revision;
pub(crate) mod source;
pub mod table_source;
pub(crate) mod write;

use park::OnNewerParked;
pub(crate) use write::{StoreCounts, StoredChunk};

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool, Row};

pub use migrations::MIGRATOR;

/// Store failures, split by what the caller can do about them.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// A statement failed; [`StoreError::is_transient`] tells whether a retry may help.
    #[error("database error: {0}")]
    Db(#[from] sqlx::Error),
    /// The embedded migrations could not be applied.
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// The target table is missing or unusable: a configuration problem, not retried.
    #[error("target table {table}: {problem}")]
    Target {
        /// The table name as configured.
        table: String,
        /// What is wrong with it (missing, a missing column, a wrong vector type or dimension).
        problem: String,
    },
}

impl StoreError {
    /// Whether retrying the same statement may succeed (connection loss, restart,
    /// serialization failure, deadlock) — by error kind and SQLSTATE, never by message.
    pub fn is_transient(&self) -> bool {
        match self {
            StoreError::Db(e) => is_transient_db(e),
            _ => false,
        }
    }
}

fn is_transient_db(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|c| {
            c.starts_with("08") // connection exception
                || c == "40001" // serialization_failure
                || c == "40P01" // deadlock_detected
                || c == "57P01" // admin_shutdown
                || c == "57P02" // crash_shutdown
                || c == "57P03" // cannot_connect_now
                || c == "53300" // too_many_connections
        }),
        _ => false,
    }
}

/// Opens a pool. `max_connections` should cover the workers plus the intake.
pub async fn connect(url: &str, max_connections: u32) -> Result<PgPool, StoreError> {
    let options: PgConnectOptions = url.parse()?;
    let pool = PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(options.application_name("embed-dlq"))
        .await?;
    Ok(pool)
}

/// Opens a pool whose connections plan every prepared statement once, generically
/// (`plan_cache_mode = force_generic_plan`), and never with a sequential scan
/// (`enable_seqscan = off`), without a connection until one is needed. For a statement sent
/// hundreds of times a run that reads by index whatever its parameters and the table's size:
/// Postgres otherwise keeps planning it again for each call (a custom plan looks cheaper),
/// which was a third of the statement's time ([`Store::with_lookup_pool`]). The plan is made
/// once and kept, so it must not depend on the table's size when it is made either: a plan
/// made while the manifest was empty (just truncated and analyzed) scanned it per document
/// range once it had grown back, 100 times slower.
pub fn connect_generic_plans(url: &str, max_connections: u32) -> Result<PgPool, StoreError> {
    let options: PgConnectOptions = url.parse()?;
    let options = options
        .application_name("embed-dlq")
        .options([("plan_cache_mode", "force_generic_plan"), ("enable_seqscan", "off")]);
    Ok(PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(30))
        .connect_lazy_with(options))
}

/// Applies the embedded migrations (idempotent).
pub async fn migrate(pool: &PgPool) -> Result<(), StoreError> {
    MIGRATOR.run(pool).await?;
    Ok(())
}

/// The model and request parameters this store's ingests embed with, recorded on every DLQ
/// row so replay can embed it the same way whatever `serve` is configured with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EmbeddingSpace {
    pub(crate) model: String,
    pub(crate) request_dimensions: Option<i32>,
}

/// The target vector table: canonical name and dimension as found in the catalog.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TargetTable {
    /// Canonical: schema-qualified, parts quoted only where needed (`public.doc_embeddings`);
    /// the identity recorded in the manifest, the DLQ and the outbox. Valid SQL as it is.
    pub name: String,
    /// The relation that holds the identity's vectors, canonical and valid SQL: the identity
    /// itself, except for a revision 1 adopted as a target's first revision
    /// (`public.doc_embeddings__r1` under the query name `public.doc_embeddings`:
    /// [`revision`], migration 0026). Every statement on vectors names this.
    quoted: String,
    pub dimensions: usize,
    /// The revision of its target this identity is (1 for a table without revisions): the
    /// `revision` label of the counters its writes and provider calls feed.
    pub revision: i32,
    /// The second statement of [`Store::store_batch`] for this table.
    pub(crate) store_sql: String,
    /// The statement of [`Store::store_new`] for this table.
    pub(crate) new_store_sql: String,
    /// The withdraw of [`Store::park_batch`] for this table ([`OnNewerParked::Withdraw`]).
    pub(crate) withdraw_sql: String,
}

impl TargetTable {
    /// The relation holding the vectors, as SQL (identifier, already quoted).
    pub(crate) fn sql_name(&self) -> &str {
        &self.quoted
    }
}

/// How long an inspected target table is trusted before its catalog entry is read again (a
/// table re-created with another dimension is noticed within this time).
const TARGET_CACHE_TTL: Duration = Duration::from_secs(60);
/// Most target tables cached at once (names come from DLQ rows: bounded by the tables in use,
/// capped anyway).
const TARGET_CACHE_MAX: usize = 256;

type TargetCache = HashMap<String, (std::time::Instant, Arc<TargetTable>)>;

/// Postgres access for ingest, replay and the reconciler.
#[derive(Clone)]
pub struct Store {
    // Crate-visible: each stage's SQL (replay/sql.rs, relay/sql.rs, ...) sits with the stage
    // and writes through the same pool and target.
    pub(crate) pool: PgPool,
    pub(crate) target: Arc<TargetTable>,
    pub(crate) space: Option<Arc<EmbeddingSpace>>,
    /// What a park of a chunk's new text does to its previous text's vector, and so what the
    /// reconciler's `superseded_vectors` check expects.
    pub(crate) on_newer_parked: OnNewerParked,
    /// Other tables met in DLQ rows (replay) or the manifest (reconcile), by name as asked.
    pub(crate) tables: Arc<Mutex<TargetCache>>,
    /// The manifest's size class when the last intake window was claimed: names the prepared
    /// claim statement, so it is planned again each time the manifest doubles (`ingest/lease.rs`).
    pub(crate) claim_plan: Arc<std::sync::atomic::AtomicU32>,
    /// Where an ingest's read-only manifest lookups go (`ingest/lease.rs`): a pool that plans
    /// them generically ([`connect_generic_plans`]). `None`: the main pool.
    pub(crate) lookup_pool: Option<PgPool>,
    /// Store batches left that skip the plain inserts of new chunks after one met a row that
    /// was not new (`store/write.rs`, `NEW_CHUNK_PAUSE`).
    pub(crate) new_chunk_pause: Arc<std::sync::atomic::AtomicU32>,
}

const REQUIRED_COLUMNS: [&str; 5] = ["doc_id", "chunk_index", "content_hash", "embedding", "updated_at"];

impl Store {
    /// Binds to `table`, reading its `embedding vector(N)` dimension from the catalog and
    /// checking that it has the columns and unique key the upserts rely on.
    pub async fn open(pool: PgPool, table: &str) -> Result<Store, StoreError> {
        let target = Arc::new(inspect_target(&pool, table, false).await?);
        let mut cache = HashMap::new();
        cache.insert(target.name.clone(), (std::time::Instant::now(), target.clone()));
        Ok(Store {
            pool,
            target,
            space: None,
            on_newer_parked: OnNewerParked::default(),
            tables: Arc::new(Mutex::new(cache)),
            claim_plan: Arc::default(),
            lookup_pool: None,
            new_chunk_pause: Arc::default(),
        })
    }

    /// Sets what this store's parks do to the vector of a chunk's previous text, and what its
    /// reconciler expects ([`OnNewerParked`]; [`OnNewerParked::Withdraw`] unless set). Every
    /// process working on one database should use the same policy: a reconciler told `withdraw`
    /// repairs what ingests under `keep` leave on purpose.
    pub fn with_on_newer_parked(mut self, policy: OnNewerParked) -> Store {
        self.on_newer_parked = policy;
        self
    }

    /// Sends the intake's read-only manifest lookups through `pool` (from
    /// [`connect_generic_plans`], sized for the windows in flight), so that they are planned
    /// once, not once a window, while every other statement keeps its custom plans.
    pub fn with_lookup_pool(mut self, pool: PgPool) -> Store {
        self.lookup_pool = Some(pool);
        self
    }

    /// What this store's parks do to the vector of a chunk's previous text.
    pub fn on_newer_parked(&self) -> OnNewerParked {
        self.on_newer_parked
    }

    /// Records `model` (and the `dimensions` request parameter, if any) on every DLQ row this
    /// store parks, so replay embeds the row as ingest did. Without it rows record no model
    /// and replay uses the model `serve` is configured with.
    pub(crate) fn with_model(mut self, model: &str, request_dimensions: Option<usize>) -> Store {
        self.space = Some(Arc::new(EmbeddingSpace {
            model: model.to_string(),
            request_dimensions: request_dimensions.map(|d| d.min(i32::MAX as usize) as i32),
        }));
        self
    }

    /// The pool, for callers that run their own queries (reports, tests).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The target table.
    pub(crate) fn target(&self) -> &TargetTable {
        &self.target
    }

    /// The canonical name of this store's target table (`public.doc_embeddings`): the
    /// identity its manifest, DLQ and outbox rows record.
    pub fn table_name(&self) -> &str {
        &self.target.name
    }

    /// The target table named `table` (as recorded on a DLQ row or given by a user), checked
    /// like [`Store::open`] checks its own and cached for a minute: this store's own table
    /// too, so that a long-running process (`serve`'s replayers) finds a table adopted as a
    /// revision (its vectors moved to another relation, migration 0026) within that minute.
    pub(crate) async fn target_for(&self, table: &str) -> Result<Arc<TargetTable>, StoreError> {
        {
            let cache = self.tables.lock().expect("target cache lock");
            if let Some((at, t)) = cache.get(table)
                && at.elapsed() < TARGET_CACHE_TTL
            {
                return Ok(t.clone());
            }
        }
        // Names recorded by this tool are canonical (valid SQL); anything else is quoted.
        let canonical = table.starts_with('"') || table.contains('.');
        let target = Arc::new(inspect_target(&self.pool, table, canonical).await?);
        let mut cache = self.tables.lock().expect("target cache lock");
        if cache.len() >= TARGET_CACHE_MAX {
            cache.clear();
        }
        cache.insert(table.to_string(), (std::time::Instant::now(), target.clone()));
        Ok(target)
    }
}

/// Quotes a possibly schema-qualified identifier (`a.b` → `"a"."b"`).
pub(crate) fn quote_table_name(name: &str) -> Result<String, String> {
    let parts: Vec<&str> = name.split('.').collect();
    if parts.is_empty() || parts.len() > 2 || parts.iter().any(|p| p.is_empty()) {
        return Err(format!("{name:?} is not a table name (use `table` or `schema.table`)"));
    }
    Ok(parts.iter().map(|p| format!("\"{}\"", p.replace('"', "\"\""))).collect::<Vec<_>>().join("."))
}

/// A name to look up in the catalog (`to_regclass`): a canonical one, as this tool records
/// and hands on names (`"Docs"."My Chunks"`: quoted only where a part needs it), stands as it
/// is; a user's `table` or `schema.table`, which holds no quote, is quoted part by part.
pub(crate) fn lookup_name(name: &str) -> Result<String, String> {
    if name.contains('"') { Ok(name.to_string()) } else { quote_table_name(name) }
}

/// Reads `table` from the catalog. `canonical`: the name is one this tool recorded (SQL as it
/// stands); otherwise it is a user's `table` or `schema.table` and is quoted first. Either way
/// the SQL used later is the canonical name the catalog gives back, never the input.
async fn inspect_target(pool: &PgPool, table: &str, canonical: bool) -> Result<TargetTable, StoreError> {
    let err = |problem: String| StoreError::Target { table: table.to_string(), problem };
    let lookup = if canonical { table.to_string() } else { lookup_name(table).map_err(err)? };
    let found: Option<(i64, String)> = sqlx::query_as(
        "SELECT c.oid::bigint, embed_dlq_table_name(c.oid::regclass)
           FROM pg_class c WHERE c.oid = to_regclass($1)",
    )
    .bind(&lookup)
    .fetch_optional(pool)
    .await?;
    let (oid, name) =
        found.ok_or_else(|| err("does not exist (run `embed-dlq migrate`, or create it)".into()))?;
    // A revision's identity or relation stands for the revision, its vectors for its
    // relation (migration 0026); a target's query name for its revision 1 while that lives,
    // else for its active revision; anything else is its own identity and relation.
    let revision: Option<(String, String, i32)> = sqlx::query_as(
        "SELECT identity, relation, revision FROM embed_dlq_revision
          WHERE state <> 'retired' AND (identity = $1 OR relation = $1 OR (target = $1 AND state = 'active'))
          ORDER BY identity = $1 DESC, relation = $1 DESC LIMIT 1",
    )
    .bind(&name)
    .fetch_optional(pool)
    .await?;
    let (name, relation, oid, revision) = match revision {
        None => (name.clone(), name, oid, 1),
        Some((identity, relation, revision)) => {
            let oid: Option<i64> = sqlx::query_scalar("SELECT to_regclass($1)::oid::bigint")
                .bind(&relation)
                .fetch_one(pool)
                .await?;
            let oid = oid.ok_or_else(|| {
                err(format!("its revision's relation {relation} does not exist (embed_dlq_revision)"))
            })?;
            (identity, relation, oid, revision)
        }
    };
    let cols = sqlx::query(
        "SELECT a.attname::text AS name, format_type(a.atttypid, a.atttypmod) AS type, a.atttypmod AS typmod
           FROM pg_attribute a
          WHERE a.attrelid = $1::bigint::oid AND a.attnum > 0 AND NOT a.attisdropped",
    )
    .bind(oid)
    .fetch_all(pool)
    .await?;
    let mut dims = None;
    for col in REQUIRED_COLUMNS {
        let found = cols.iter().find(|r| r.get::<String, _>("name") == col);
        let Some(found) = found else {
            return Err(err(format!("missing column {col} (needs {})", REQUIRED_COLUMNS.join(", "))));
        };
        if col == "embedding" {
            let ty: String = found.get("type");
            let typmod: i32 = found.get("typmod");
            if !ty.starts_with("vector(") || typmod <= 0 {
                return Err(err(format!(
                    "column embedding is {ty}, expected vector(N) with a fixed dimension"
                )));
            }
            dims = Some(typmod as usize);
        }
    }
    // The upserts need a unique constraint or index on exactly (doc_id, chunk_index).
    let has_key: bool = sqlx::query_scalar(
        "SELECT EXISTS (
             SELECT 1 FROM pg_index i
              WHERE i.indrelid = $1::bigint::oid AND i.indisunique AND i.indpred IS NULL
                AND (SELECT array_agg(a.attname::text ORDER BY a.attname)
                       FROM pg_attribute a
                      WHERE a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey))
                    = ARRAY['chunk_index', 'doc_id'])",
    )
    .bind(oid)
    .fetch_one(pool)
    .await?;
    if !has_key {
        return Err(err(
            "needs a UNIQUE (doc_id, chunk_index) constraint: without it replays duplicate vectors".into(),
        ));
    }
    Ok(TargetTable {
        store_sql: write::store_sql(&relation),
        new_store_sql: write::new_store_sql(&relation),
        withdraw_sql: park::park_withdraw_sql(&relation),
        quoted: relation,
        name,
        dimensions: dims.expect("embedding checked"),
        revision,
    })
}

/// Creates a target table of another dimension with the required shape (for `migrate
/// --table NAME --dimensions N`).
pub async fn create_target_table(pool: &PgPool, table: &str, dimensions: usize) -> Result<(), StoreError> {
    let quoted = quote_table_name(table)
        .map_err(|problem| StoreError::Target { table: table.to_string(), problem })?;
    let sql = format!(
        "CREATE TABLE IF NOT EXISTS {quoted} (
            doc_id       text        NOT NULL,
            chunk_index  int         NOT NULL,
            content_hash text        NOT NULL,
            embedding    vector({dimensions}) NOT NULL,
            created_at   timestamptz NOT NULL DEFAULT now(),
            updated_at   timestamptz NOT NULL DEFAULT now(),
            UNIQUE (doc_id, chunk_index))"
    );
    sqlx::query(AssertSqlSafe(sql)).execute(pool).await?;
    Ok(())
}

/// Classifies a Postgres error for the background loops (relay, scheduler, replayers; broader
/// than [`StoreError::is_transient`], which also lists 40, 53, 55P03 and 58 codes): by
/// `sqlx` kind and SQLSTATE. Transient: I/O, pool timeouts, protocol trouble, connection
/// exceptions (08), transaction rollbacks (40: serialization failure, deadlock), insufficient
/// resources (53), lock not available (55P03), operator intervention (57, e.g. a cancelled
/// statement or a shutting-down server, except 57P04 database dropped), system I/O errors
/// (58000, 58030), a read-only server during failover (25006) and a session the server
/// ended because it sat idle in a transaction (25P03: a relay that held the outbox's position
/// longer than [`crate::relay::RelayConfig::claim_idle_timeout`], the position free for the next pass). Everything else, e.g. an
/// undefined table (42P01) or column (42703), a permission problem or a decode error, needs a
/// person and is permanent.
pub(crate) fn is_transient_in_background(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Protocol(_)
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|c| {
            c.starts_with("08")
                || c.starts_with("40")
                || c.starts_with("53")
                || (c.starts_with("57") && c != "57P04")
                || matches!(c.as_ref(), "55P03" | "58000" | "58030" | "25006" | "25P03" | "72000")
        }),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting() {
        assert_eq!(quote_table_name("doc_embeddings").unwrap(), "\"doc_embeddings\"");
        assert_eq!(quote_table_name("s.t").unwrap(), "\"s\".\"t\"");
        assert_eq!(quote_table_name("we\"ird").unwrap(), "\"we\"\"ird\"");
        assert!(quote_table_name("a.b.c").is_err());
        assert!(quote_table_name("").is_err());
        assert!(quote_table_name("a.").is_err());
    }
}
