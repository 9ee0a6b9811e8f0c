//! Revisions of a target (migration 0026): the name users query and the relations that hold
//! its vectors, one per embedding model, so that a model can change without a search outage
//! (invariant 14, issue 46).
//!
//! What is here today: the registry, the adoption of an existing table as revision 1 of a
//! target ([`adopt`]) and the making of a shadow revision beside it ([`create_shadow`]).
//! Adopting renames the table (`doc_embeddings` → `doc_embeddings__r1`) and its name becomes
//! a view over it, which every query keeps using; its identity (the `target_table` its
//! manifest, DLQ, outbox, lease, tombstone and position rows record) stays the old name, so
//! no row is rewritten, and `Store` finds the relation through the registry when it opens
//! the target. The view's `embedding` column is cast to plain `vector` (no fixed
//! dimension), so one `CREATE OR REPLACE VIEW` can later point it at a revision of another
//! dimension, and a trigger refuses every write through it. A shadow revision's identity is
//! its own relation's name.

use sqlx::{AssertSqlSafe, PgPool, Row};

use super::{StoreError, inspect_target, lookup_name};

/// Postgres' longest identifier (NAMEDATALEN - 1 bytes): a revision's relation name
/// (`<table>__r<n>`) must fit, or Postgres would silently cut it.
const MAX_IDENTIFIER_BYTES: usize = 63;

/// pgvector's largest `vector(N)`.
const MAX_DIMENSIONS: usize = 16_000;

/// The longest model name a revision records (the DLQ's rows and the provider's requests
/// carry it too).
const MAX_MODEL_BYTES: usize = 256;

/// The longest one attempt at a lock on the query name (the adoption's rename, the switch's
/// replace of the view) waits for the queries already reading it: every query of the name
/// sent meanwhile queues behind the attempt, so a query that runs for minutes would otherwise
/// hold the name for minutes (a search outage). An attempt that times out gives the name back
/// at once and the next one follows after a short pause.
const NAME_LOCK_ATTEMPT: std::time::Duration = std::time::Duration::from_millis(100);

/// How long a revision command keeps trying for the lock on the query name before it gives up
/// with the queries holding it named (nothing changed; rerun it once they end).
const NAME_LOCK_PATIENCE: std::time::Duration = std::time::Duration::from_secs(60);

/// After this long blocked by autovacuum alone (a table just filled is being vacuumed or
/// analyzed, which can run for minutes), the command cancels the autovacuum, as Postgres
/// itself does for any lock request it blocks for `deadlock_timeout` (1 s by default), so
/// that queries of the name need not wait that second. Cancelling needs superuser or
/// `pg_signal_autovacuum_worker` (Postgres 18); without them the next attempt waits as long
/// as it takes, and Postgres cancels the autovacuum after `deadlock_timeout`: the one wait of
/// the name then.
const AUTOVACUUM_PATIENCE: std::time::Duration = std::time::Duration::from_millis(300);

/// Runs `sql`, a statement in `tx` that takes an ACCESS EXCLUSIVE lock on `relation` (the
/// query name or the table it names), without ever queueing the name's queries behind a
/// query that runs long: each attempt waits at most [`NAME_LOCK_ATTEMPT`] (a savepoint takes
/// a failed one back), for at most [`NAME_LOCK_PATIENCE`] in all, after which the command
/// fails naming what holds the relation. The transaction's `lock_timeout` is as before after.
/// Returns when the attempt that took the lock began: queries of the name sent since then
/// wait for the commit.
async fn lock_name_with(
    tx: &mut sqlx::PgConnection,
    relation: &str,
    sql: &str,
) -> Result<std::time::Instant, StoreError> {
    let started = std::time::Instant::now();
    let before: String =
        sqlx::query_scalar("SELECT current_setting('lock_timeout')").fetch_one(&mut *tx).await?;
    let mut tried_cancel = false;
    loop {
        sqlx::query("SAVEPOINT embed_dlq_name_lock").execute(&mut *tx).await?;
        // Blocked by autovacuum alone: cancel it once; if that is not allowed, wait for the
        // lock until Postgres cancels it.
        let mut wait_it_out = false;
        if started.elapsed() >= AUTOVACUUM_PATIENCE {
            let held = holders(&mut *tx, relation).await?;
            if !held.is_empty() && held.iter().all(|h| h.autovacuum) {
                wait_it_out = tried_cancel || !cancel_autovacuum(&mut *tx, &held).await?;
                tried_cancel = true;
            }
        }
        let attempt = if wait_it_out { 0 } else { NAME_LOCK_ATTEMPT.as_millis() as i64 };
        sqlx::query("SELECT set_config('lock_timeout', $1, true)")
            .bind(format!("{attempt}ms"))
            .execute(&mut *tx)
            .await?;
        let attempted = std::time::Instant::now();
        match sqlx::query(AssertSqlSafe(sql.to_string())).execute(&mut *tx).await {
            Ok(_) => {
                sqlx::query("RELEASE SAVEPOINT embed_dlq_name_lock").execute(&mut *tx).await?;
                sqlx::query("SELECT set_config('lock_timeout', $1, true)")
                    .bind(&before)
                    .execute(&mut *tx)
                    .await?;
                return Ok(attempted);
            }
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("55P03") => {
                sqlx::query("ROLLBACK TO SAVEPOINT embed_dlq_name_lock").execute(&mut *tx).await?;
                if started.elapsed() >= NAME_LOCK_PATIENCE {
                    let held: Vec<String> = holders(&mut *tx, relation)
                        .await?
                        .iter()
                        .take(5)
                        .map(|h| format!("pid {} ({:.0} s: {})", h.pid, h.seconds, h.query))
                        .collect();
                    return Err(StoreError::Target {
                        table: relation.to_string(),
                        problem: format!(
                            "queries of it held it for {} s (each attempt to lock it waited {} ms, so that                              queries sent meanwhile never waited longer): {}; nothing changed: rerun once they end",
                            NAME_LOCK_PATIENCE.as_secs(),
                            NAME_LOCK_ATTEMPT.as_millis(),
                            if held.is_empty() { "they ended since".to_string() } else { held.join(", ") }
                        ),
                    });
                }
                let pause = rand::random_range(50..250u64);
                tokio::time::sleep(std::time::Duration::from_millis(pause)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Cancels the autovacuum workers in `held` (their work is redone later: Postgres cancels
/// them for any lock request they block); whether that was allowed. Under a savepoint: a
/// refusal (no superuser, no `pg_signal_autovacuum_worker`) leaves the transaction as it was.
async fn cancel_autovacuum(tx: &mut sqlx::PgConnection, held: &[Holder]) -> Result<bool, StoreError> {
    let pids: Vec<i32> = held.iter().map(|h| h.pid).collect();
    sqlx::query("SAVEPOINT embed_dlq_cancel_autovacuum").execute(&mut *tx).await?;
    let cancelled: Result<Option<bool>, sqlx::Error> =
        sqlx::query_scalar("SELECT bool_and(pg_cancel_backend(p)) FROM unnest($1::int[]) AS p")
            .bind(&pids)
            .fetch_one(&mut *tx)
            .await;
    match cancelled {
        Ok(done) => {
            sqlx::query("RELEASE SAVEPOINT embed_dlq_cancel_autovacuum").execute(&mut *tx).await?;
            if done == Some(true) {
                tracing::info!(?pids, "cancelled the autovacuum holding the query name's table");
            }
            Ok(done == Some(true))
        }
        Err(sqlx::Error::Database(_)) => {
            sqlx::query("ROLLBACK TO SAVEPOINT embed_dlq_cancel_autovacuum").execute(&mut *tx).await?;
            Ok(false)
        }
        Err(e) => Err(e.into()),
    }
}

/// A session holding a lock on a relation, as [`lock_name_with`] reports it.
struct Holder {
    pid: i32,
    /// How long its transaction has run.
    seconds: f64,
    /// Its statement, cut to 120 characters.
    query: String,
    autovacuum: bool,
}

/// The other sessions holding a granted lock on `relation`.
async fn holders(tx: &mut sqlx::PgConnection, relation: &str) -> Result<Vec<Holder>, StoreError> {
    let rows = sqlx::query(
        "SELECT a.pid, COALESCE(extract(epoch FROM now() - a.xact_start), 0)::float8,
                left(COALESCE(a.query, ''), 120), COALESCE(a.backend_type = 'autovacuum worker', false)
           FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
          WHERE l.relation = to_regclass($1) AND l.granted AND l.pid <> pg_backend_pid()
          ORDER BY 2 DESC",
    )
    .bind(relation)
    .fetch_all(&mut *tx)
    .await?;
    Ok(rows
        .iter()
        .map(|r| Holder { pid: r.get(0), seconds: r.get(1), query: r.get(2), autovacuum: r.get(3) })
        .collect())
}

/// One revision of a target, as the registry holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Revision {
    /// The query name (canonical: `public.doc_embeddings`).
    pub target: String,
    /// 1, 2, ...: the order revisions were made in.
    pub revision: i32,
    /// What this revision's manifest, DLQ and outbox rows record as their table.
    pub identity: String,
    /// The relation holding its vectors (canonical).
    pub relation: String,
    /// The model it embeds with; `None` for a revision 1 adopted from a table whose model
    /// the tool never recorded (its ingests' own settings).
    pub model: Option<String>,
    /// The `dimensions` request parameter it sends, if any.
    pub request_dimensions: Option<i32>,
    /// The relation's `vector(N)`.
    pub dimensions: i32,
    /// `active` (the query name answers it), `shadow`, `previous` or `retired`.
    pub state: String,
}

/// Every revision in the registry (of `target` only, when given: as a user writes it), by
/// target and revision.
pub async fn list(pool: &PgPool, target: Option<&str>) -> Result<Vec<Revision>, StoreError> {
    let target = match target {
        Some(t) => Some(canonical(pool, t).await?),
        None => None,
    };
    let rows = sqlx::query(
        "SELECT target, revision, identity, relation, model, request_dimensions, dimensions, state
           FROM embed_dlq_revision
          WHERE $1::text IS NULL OR target = $1
          ORDER BY target, revision",
    )
    .bind(target)
    .fetch_all(pool)
    .await?;
    rows.iter().map(revision_of_row).collect::<Result<_, sqlx::Error>>().map_err(StoreError::from)
}

fn revision_of_row(r: &sqlx::postgres::PgRow) -> Result<Revision, sqlx::Error> {
    Ok(Revision {
        target: r.try_get("target")?,
        revision: r.try_get("revision")?,
        identity: r.try_get("identity")?,
        relation: r.try_get("relation")?,
        model: r.try_get("model")?,
        request_dimensions: r.try_get("request_dimensions")?,
        dimensions: r.try_get("dimensions")?,
        state: r.try_get("state")?,
    })
}

/// The canonical name of `table` as a user writes it (`table` or `schema.table`).
async fn canonical(pool: &PgPool, table: &str) -> Result<String, StoreError> {
    let err = |problem: String| StoreError::Target { table: table.to_string(), problem };
    let quoted = lookup_name(table).map_err(err)?;
    let name: Option<String> = sqlx::query_scalar("SELECT embed_dlq_table_name(to_regclass($1))")
        .bind(&quoted)
        .fetch_one(pool)
        .await?;
    name.ok_or_else(|| err("does not exist".into()))
}

/// Serialises the changes to one target's revisions (two adoptions would both find the table
/// a table; a switch and a retirement must see each other's outcome): a transaction-scoped
/// advisory lock on the target's name.
async fn lock_target(tx: &mut sqlx::PgConnection, target: &str) -> Result<(), StoreError> {
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('embed_dlq_revision'), hashtext($1))")
        .bind(target)
        .execute(tx)
        .await?;
    Ok(())
}

/// The select list of the query name's view over `relation`: every column in its order, the
/// vector one as plain `vector` (no fixed dimension, so one view can answer revisions of
/// different dimensions).
async fn view_select(tx: &mut sqlx::PgConnection, relation: &str) -> Result<String, StoreError> {
    let columns: Vec<String> = sqlx::query_scalar(
        "SELECT a.attname::text FROM pg_attribute a
          WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped
          ORDER BY a.attnum",
    )
    .bind(relation)
    .fetch_all(tx)
    .await?;
    let select: Vec<String> = columns
        .iter()
        .map(|c| if c == "embedding" { "embedding::vector AS embedding".to_string() } else { quote_ident(c) })
        .collect();
    Ok(select.join(", "))
}

/// `s` as a quoted SQL identifier.
fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// Makes the table `table` revision 1 of a target of the same name, in one transaction: the
/// table becomes `<table>__r1` (its indexes, constraints, grants and rows go with it), a view
/// of the old name answers its rows (the `embedding` column as plain `vector`), refuses
/// writes, and carries the table's `SELECT` grants and owner; the registry records the
/// revision as active, with `model` and `request_dimensions` when known. Queries running
/// meanwhile wait for the switch (the rename's lock) and then read the view: no moment
/// answers nothing. Idempotent: a target already adopted returns its revision 1.
///
/// Processes that opened the table before keep its old name for up to a minute
/// (`TARGET_CACHE_TTL`) or, for an ingest, the rest of its run: their writes through the view
/// are refused (and retried or reported, never lost), and the next open finds the relation.
pub async fn adopt(
    pool: &PgPool,
    table: &str,
    model: Option<&str>,
    request_dimensions: Option<usize>,
) -> Result<Revision, StoreError> {
    let name = canonical(pool, table).await?;
    let err = |problem: String| StoreError::Target { table: name.clone(), problem };
    let mut tx = pool.begin().await?;
    // One adoption at a time (two would both find the table a table).
    lock_target(&mut tx, &name).await?;
    if let Some(r) = sqlx::query(
        "SELECT target, revision, identity, relation, model, request_dimensions, dimensions, state
           FROM embed_dlq_revision WHERE target = $1 AND revision = 1",
    )
    .bind(&name)
    .fetch_optional(&mut *tx)
    .await?
    {
        return Ok(revision_of_row(&r)?);
    }
    // The table's shape is what every writer needs (columns, vector(N), the unique key).
    let checked = inspect_target(pool, &name, true).await?;
    if checked.name != name || checked.sql_name() != name {
        return Err(err(format!("is a revision's relation already (revision of {})", checked.name)));
    }
    let (kind, schema, relname, owner): (String, String, String, String) = sqlx::query_as(
        "SELECT c.relkind::text, n.nspname::text, c.relname::text, pg_get_userbyid(c.relowner)::text
           FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
          WHERE c.oid = to_regclass($1)",
    )
    .bind(&name)
    .fetch_one(&mut *tx)
    .await?;
    if kind != "r" && kind != "p" {
        return Err(err("is not a table (a view or another kind of relation cannot be adopted)".into()));
    }
    let relation_name = format!("{relname}__r1");
    if relation_name.len() > MAX_IDENTIFIER_BYTES {
        return Err(err(format!(
            "its name is too long for a revision relation ({relation_name:?} is over {MAX_IDENTIFIER_BYTES} bytes)"
        )));
    }
    let ident = quote_ident;
    let (q_schema, q_table, q_relation) = (ident(&schema), ident(&relname), ident(&relation_name));
    let taken: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(format!("{q_schema}.{q_relation}"))
        .fetch_one(&mut *tx)
        .await?;
    if taken {
        return Err(err(format!("{schema}.{relation_name} exists already")));
    }
    let select = view_select(&mut tx, &name).await?;
    let grantees: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(a.grantee)) END
           FROM pg_class c, aclexplode(c.relacl) a
          WHERE c.oid = to_regclass($1) AND a.privilege_type = 'SELECT'",
    )
    .bind(&name)
    .fetch_all(&mut *tx)
    .await?;
    let mut statements = vec![
        format!("ALTER TABLE {q_schema}.{q_table} RENAME TO {q_relation}"),
        format!("CREATE VIEW {q_schema}.{q_table} AS SELECT {select} FROM {q_schema}.{q_relation}"),
        format!(
            "CREATE TRIGGER embed_dlq_refuse_write INSTEAD OF INSERT OR UPDATE OR DELETE ON {q_schema}.{q_table}
               FOR EACH ROW EXECUTE FUNCTION embed_dlq_refuse_write()"
        ),
        format!("ALTER VIEW {q_schema}.{q_table} OWNER TO {}", ident(&owner)),
    ];
    statements.extend(grantees.iter().map(|g| format!("GRANT SELECT ON {q_schema}.{q_table} TO {g}")));
    // The rename takes the table's lock, and holds queries of the name from then to the
    // commit: taken without queueing them behind a long query.
    lock_name_with(&mut tx, &name, &statements[0]).await?;
    for sql in statements.into_iter().skip(1) {
        sqlx::query(AssertSqlSafe(sql)).execute(&mut *tx).await?;
    }
    let relation: String = sqlx::query_scalar("SELECT embed_dlq_table_name(to_regclass($1))")
        .bind(format!("{q_schema}.{q_relation}"))
        .fetch_one(&mut *tx)
        .await?;
    let row = sqlx::query(
        "INSERT INTO embed_dlq_revision
                (target, revision, identity, relation, model, request_dimensions, dimensions, state, activated_at)
         VALUES ($1, 1, $1, $2, $3, $4, $5, 'active', now())
         RETURNING target, revision, identity, relation, model, request_dimensions, dimensions, state",
    )
    .bind(&name)
    .bind(&relation)
    .bind(model)
    .bind(request_dimensions.map(|d| d.min(i32::MAX as usize) as i32))
    .bind(checked.dimensions.min(i32::MAX as usize) as i32)
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(revision_of_row(&row)?)
}

/// Makes a shadow revision of `target` for `model` at `dimensions` (and the `dimensions`
/// request parameter, if any): the next revision number, a relation `<table>__r<n>` shaped
/// like the active revision's (its columns, defaults, constraints and indexes, the vector
/// column at the new dimension, so an HNSW index of the active one is one of the shadow's
/// too) and empty, recorded as `shadow`. A target that is still a plain table is adopted
/// first ([`adopt`]; its revision 1 records `active_model`). The query name keeps answering
/// the active revision.
pub async fn create_shadow(
    pool: &PgPool,
    target: &str,
    active_model: Option<&str>,
    model: &str,
    dimensions: usize,
    request_dimensions: Option<usize>,
) -> Result<Revision, StoreError> {
    let first = adopt(pool, target, active_model, None).await?;
    let err = |problem: String| StoreError::Target { table: first.target.clone(), problem };
    if dimensions == 0 || dimensions > MAX_DIMENSIONS {
        return Err(err(format!("dimensions must be 1..={MAX_DIMENSIONS}, not {dimensions}")));
    }
    if model.is_empty() || model.len() > MAX_MODEL_BYTES {
        return Err(err(format!("the model name must be 1..={MAX_MODEL_BYTES} bytes")));
    }
    let mut tx = pool.begin().await?;
    lock_target(&mut tx, &first.target).await?;
    let (revision, active): (i32, String) = sqlx::query_as(
        "SELECT (SELECT max(revision) + 1 FROM embed_dlq_revision WHERE target = $1),
                (SELECT relation FROM embed_dlq_revision WHERE target = $1 AND state = 'active')",
    )
    .bind(&first.target)
    .fetch_one(&mut *tx)
    .await?;
    let (schema, relname): (String, String) = sqlx::query_as(
        "SELECT n.nspname::text, c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
          WHERE c.oid = to_regclass($1)",
    )
    .bind(&first.target)
    .fetch_one(&mut *tx)
    .await?;
    let relation_name = format!("{relname}__r{revision}");
    if relation_name.len() > MAX_IDENTIFIER_BYTES {
        return Err(err(format!("{relation_name:?} is over {MAX_IDENTIFIER_BYTES} bytes")));
    }
    let ident = quote_ident;
    let qualified = format!("{}.{}", ident(&schema), ident(&relation_name));
    for sql in [
        format!("CREATE TABLE {qualified} (LIKE {active} INCLUDING ALL)"),
        format!("ALTER TABLE {qualified} ALTER COLUMN embedding TYPE vector({dimensions})"),
    ] {
        sqlx::query(AssertSqlSafe(sql)).execute(&mut *tx).await?;
    }
    let relation: String = sqlx::query_scalar("SELECT embed_dlq_table_name(to_regclass($1))")
        .bind(&qualified)
        .fetch_one(&mut *tx)
        .await?;
    let row = sqlx::query(
        "INSERT INTO embed_dlq_revision
                (target, revision, identity, relation, model, request_dimensions, dimensions, state)
         VALUES ($1, $2, $3, $3, $4, $5, $6, 'shadow')
         RETURNING target, revision, identity, relation, model, request_dimensions, dimensions, state",
    )
    .bind(&first.target)
    .bind(revision)
    .bind(&relation)
    .bind(model)
    .bind(request_dimensions.map(|d| d.min(i32::MAX as usize) as i32))
    .bind(dimensions as i32)
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(revision_of_row(&row)?)
}

/// The revisions of the target `table` names that every write must reach: the active one,
/// the shadows being built and the previous one kept for a rollback (not the retired), the
/// active one first. Empty when `table` is not a target with revisions (a plain table, or a
/// revision's own relation named directly: then it alone is written, as before).
pub async fn live(pool: &PgPool, table: &str) -> Result<Vec<Revision>, StoreError> {
    let quoted =
        lookup_name(table).map_err(|problem| StoreError::Target { table: table.to_string(), problem })?;
    let rows = sqlx::query(
        "SELECT target, revision, identity, relation, model, request_dimensions, dimensions, state
           FROM embed_dlq_revision
          WHERE target = embed_dlq_table_name(to_regclass($1)) AND state <> 'retired'
          ORDER BY state <> 'active', revision",
    )
    .bind(&quoted)
    .fetch_all(pool)
    .await?;
    rows.iter().map(revision_of_row).collect::<Result<_, sqlx::Error>>().map_err(StoreError::from)
}

/// How far one revision covers another (the active one), from their manifests and the
/// candidate's relation: what [`activate`] requires before a switch.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Coverage {
    /// Chunks of the active revision.
    pub active_chunks: u64,
    /// Of those, chunks the candidate holds the same text of, stored (or parked as the
    /// active revision has them parked).
    pub covered: u64,
    /// Chunks of the active revision the candidate has no row for.
    pub missing: u64,
    /// Chunks whose text differs between the two, or is unknown on either side (written
    /// before text hashes were recorded: `revision backfill` fills them).
    pub other_text: u64,
    /// Chunks of the same text that the candidate holds in its DLQ (or as exhausted) where
    /// the active revision has them stored.
    pub unresolved: u64,
    /// Chunks the candidate's manifest calls stored with no vector of that content in its
    /// relation.
    pub without_vector: u64,
    /// Chunks the candidate holds that the active revision does not (deleted since).
    pub extra: u64,
    /// A few examples of chunks not covered (`doc#chunk: why`).
    pub examples: Vec<String>,
}

impl Coverage {
    /// Chunks that keep the candidate from covering the active revision.
    pub fn uncovered(&self) -> u64 {
        self.missing + self.other_text + self.unresolved + self.without_vector + self.extra
    }
}

/// Why [`activate`] did not switch, or [`retire`] did not retire.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RevisionError {
    /// The store failed, or the target or revision does not exist.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The revision is not one that can be switched to (retired, already active) or retired
    /// (the active one).
    #[error("revision {revision} of {target} is {state}: {why}")]
    NotSwitchable {
        /// The target.
        target: String,
        /// The revision asked for.
        revision: i32,
        /// Its state.
        state: String,
        /// What to do instead.
        why: &'static str,
    },
    /// The revision does not cover the active one (more chunks than allowed are not covered).
    #[error(
        "revision {revision} of {target} does not cover the active revision: {} of {} chunks not covered \
         ({} missing, {} of other or unknown text, {} unresolved in its DLQ, {} stored without a vector, \
         {} not in the active revision), {allowed} allowed; e.g. {}",
        .coverage.uncovered(), .coverage.active_chunks, .coverage.missing, .coverage.other_text,
        .coverage.unresolved, .coverage.without_vector, .coverage.extra, .coverage.examples.join(", ")
    )]
    NotCovered {
        /// The target.
        target: String,
        /// The revision asked for.
        revision: i32,
        /// What the check found.
        coverage: Coverage,
        /// The `allow_missing` given.
        allowed: u64,
    },
}

/// How much of the active revision `candidate` covers (see [`Coverage`]), read in one
/// snapshot of `conn`.
pub async fn coverage(
    conn: &mut sqlx::PgConnection,
    active: &Revision,
    candidate: &Revision,
) -> Result<Coverage, StoreError> {
    let candidate_relation = &candidate.relation;
    // Both manifests of a key by their primary keys; the candidate's vectors joined once (a
    // join the planner can hash or merge: a `NOT EXISTS` in the select list was a subplan
    // run once a row, a million index probes and heap reads at 1M chunks: 55 s cold).
    let sql = format!(
        "WITH a AS MATERIALIZED (
             SELECT doc_id, chunk_index, text_hash, status FROM ingest_manifest WHERE target_table = $1
         ), c AS MATERIALIZED (
             SELECT m.doc_id, m.chunk_index, m.text_hash, m.status,
                    m.status = 'stored' AND e.doc_id IS NULL AS no_vector
               FROM ingest_manifest m
               LEFT JOIN {candidate_relation} e
                 ON e.doc_id = m.doc_id AND e.chunk_index = m.chunk_index AND e.content_hash = m.content_hash
              WHERE m.target_table = $2
         ), pairs AS MATERIALIZED (
             SELECT a.doc_id, a.chunk_index, a.status AS a_status, a.text_hash AS a_text,
                    c.doc_id IS NOT NULL AS present, c.status AS c_status, c.text_hash AS c_text,
                    coalesce(c.no_vector, false) AS no_vector
               FROM a LEFT JOIN c USING (doc_id, chunk_index)
         ), judged AS MATERIALIZED (
             SELECT doc_id, chunk_index,
                    CASE WHEN NOT present THEN 'missing'
                         WHEN a_text IS NULL OR c_text IS DISTINCT FROM a_text THEN 'other_text'
                         WHEN no_vector THEN 'without_vector'
                         WHEN c_status <> 'stored' AND a_status = 'stored' THEN 'unresolved'
                         ELSE 'covered' END AS verdict
               FROM pairs
         )
         SELECT count(*) AS active_chunks,
                count(*) FILTER (WHERE verdict = 'covered') AS covered,
                count(*) FILTER (WHERE verdict = 'missing') AS missing,
                count(*) FILTER (WHERE verdict = 'other_text') AS other_text,
                count(*) FILTER (WHERE verdict = 'unresolved') AS unresolved,
                count(*) FILTER (WHERE verdict = 'without_vector') AS without_vector,
                (SELECT count(*) FROM c WHERE NOT EXISTS (
                     SELECT 1 FROM a WHERE a.doc_id = c.doc_id AND a.chunk_index = c.chunk_index)) AS extra,
                ARRAY(SELECT doc_id || '#' || chunk_index || ': ' || verdict FROM judged
                       WHERE verdict <> 'covered' ORDER BY doc_id, chunk_index LIMIT 5) AS examples
           FROM judged"
    );
    let r = sqlx::query(AssertSqlSafe(sql))
        .bind(&active.identity)
        .bind(&candidate.identity)
        .fetch_one(&mut *conn)
        .await?;
    let n = |c: &str| r.try_get::<i64, _>(c).map(|v| v.max(0) as u64);
    Ok(Coverage {
        active_chunks: n("active_chunks")?,
        covered: n("covered")?,
        missing: n("missing")?,
        other_text: n("other_text")?,
        unresolved: n("unresolved")?,
        without_vector: n("without_vector")?,
        extra: n("extra")?,
        examples: r.try_get("examples")?,
    })
}

/// What [`activate`] did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Activation {
    /// The target.
    pub target: String,
    /// The revision now active.
    pub active: i32,
    /// The revision active before, now `previous` (kept, and written, for a rollback).
    pub previous: i32,
    /// The coverage the switch was made on.
    pub coverage: Coverage,
    /// How long the coverage check took (inside the switch's transaction, before the view
    /// changes: queries of the name do not wait for it).
    pub coverage_check_ms: u64,
    /// How long the switch itself held queries of the name: from the view's replace to the
    /// commit, in microseconds.
    pub switch_us: u64,
}

/// Switches the query name of `target` to `revision` (`None`: the `previous` one, a
/// rollback), in one transaction, if it covers the active revision ([`coverage`]) with at
/// most `allow_missing` chunks not covered: the view is replaced (a query running across the
/// switch reads one revision whole: the replace waits for it, and queries after it wait for
/// the commit), the active revision becomes `previous` and an older `previous` a `shadow`
/// (still written: only `retire` stops that).
pub async fn activate(
    pool: &PgPool,
    target: &str,
    revision: Option<i32>,
    allow_missing: u64,
) -> Result<Activation, RevisionError> {
    let name = canonical(pool, target).await?;
    let mut tx = pool.begin().await.map_err(StoreError::from)?;
    lock_target(&mut tx, &name).await?;
    let rows = sqlx::query(
        "SELECT target, revision, identity, relation, model, request_dimensions, dimensions, state
           FROM embed_dlq_revision WHERE target = $1 ORDER BY revision FOR UPDATE",
    )
    .bind(&name)
    .fetch_all(&mut *tx)
    .await
    .map_err(StoreError::from)?;
    let all: Vec<Revision> =
        rows.iter().map(revision_of_row).collect::<Result<_, _>>().map_err(StoreError::from)?;
    let not_found = |what: String| StoreError::Target { table: name.clone(), problem: what };
    let active = all
        .iter()
        .find(|r| r.state == "active")
        .cloned()
        .ok_or_else(|| not_found("has no revisions (make one with `revision create`)".into()))?;
    let wanted = match revision {
        Some(n) => all.iter().find(|r| r.revision == n).cloned(),
        None => all.iter().find(|r| r.state == "previous").cloned(),
    }
    .ok_or_else(|| {
        not_found(match revision {
            Some(n) => format!("has no revision {n}"),
            None => "has no previous revision to roll back to".into(),
        })
    })?;
    let refuse = |why| RevisionError::NotSwitchable {
        target: name.clone(),
        revision: wanted.revision,
        state: wanted.state.clone(),
        why,
    };
    match wanted.state.as_str() {
        "active" => return Err(refuse("already active")),
        "retired" => return Err(refuse("its relation was dropped; make a new revision")),
        _ => {}
    }
    let checking = std::time::Instant::now();
    let coverage = coverage(&mut tx, &active, &wanted).await?;
    let coverage_check_ms = u64::try_from(checking.elapsed().as_millis()).unwrap_or(u64::MAX);
    if coverage.uncovered() > allow_missing {
        return Err(RevisionError::NotCovered {
            target: name,
            revision: wanted.revision,
            coverage,
            allowed: allow_missing,
        });
    }
    // The view over the new relation: the revisions share their columns.
    let select = view_select(&mut tx, &wanted.relation).await?;
    let replace = format!("CREATE OR REPLACE VIEW {name} AS SELECT {select} FROM {}", wanted.relation);
    // From the view's replace (it waits for the queries reading the name and holds new ones,
    // each attempt at most `NAME_LOCK_ATTEMPT`) to the commit: the only moment a query of the
    // name waits.
    let switching = lock_name_with(&mut tx, &name, &replace).await?;
    let statements = [
        "UPDATE embed_dlq_revision SET state = 'shadow' WHERE target = $1 AND state = 'previous'",
        "UPDATE embed_dlq_revision SET state = 'previous' WHERE target = $1 AND state = 'active'",
        "UPDATE embed_dlq_revision SET state = 'active', activated_at = now() WHERE target = $1 AND revision = $2",
    ];
    for (n, sql) in statements.into_iter().enumerate() {
        let q = sqlx::query(sql).bind(&name);
        let q = if n == 2 { q.bind(wanted.revision) } else { q };
        q.execute(&mut *tx).await.map_err(StoreError::from)?;
    }
    tx.commit().await.map_err(StoreError::from)?;
    let switch_us = u64::try_from(switching.elapsed().as_micros()).unwrap_or(u64::MAX);
    Ok(Activation {
        target: name,
        active: wanted.revision,
        previous: active.revision,
        coverage,
        coverage_check_ms,
        switch_us,
    })
}

/// Records the text hash of chunks of `revision` whose manifest rows predate text hashes
/// (NULL), each only where the row's content hash proves the revision holds exactly that
/// text: `rows` are (doc_id, chunk_index, the content hash the revision would give the text,
/// the text's hash). Returns the rows filled. A row whose text differs is left alone (and
/// stays uncovered), so a stale input can never make a revision look covered.
pub async fn fill_text_hashes(
    pool: &PgPool,
    revision: &Revision,
    rows: &[(String, i32, String, crate::model::TextHash)],
) -> Result<u64, StoreError> {
    let docs: Vec<&str> = rows.iter().map(|r| r.0.as_str()).collect();
    let idxs: Vec<i32> = rows.iter().map(|r| r.1).collect();
    let hashes: Vec<&str> = rows.iter().map(|r| r.2.as_str()).collect();
    let texts: Vec<&[u8]> = rows.iter().map(|r| r.3.as_bytes()).collect();
    let done = sqlx::query(
        "UPDATE ingest_manifest m SET text_hash = i.text_hash
           FROM UNNEST($2::text[], $3::int[], $4::text[], $5::bytea[]) AS i(doc_id, chunk_index, content_hash, text_hash)
          WHERE m.target_table = $1 AND m.doc_id = i.doc_id AND m.chunk_index = i.chunk_index
            AND m.content_hash = i.content_hash AND m.text_hash IS NULL",
    )
    .bind(&revision.identity)
    .bind(&docs)
    .bind(&idxs)
    .bind(&hashes)
    .bind(&texts)
    .execute(pool)
    .await?;
    Ok(done.rows_affected())
}

/// What one revision's manifest holds for a key a backfill reads: the record a copy of it
/// must match (its text) and take on (its position).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldRecord {
    /// The hash of the text alone; `None` for a row written before text hashes existed.
    pub text_hash: Option<Vec<u8>>,
    /// The content hash (its model, dimension and text).
    pub content_hash: String,
    /// The record's position.
    pub source_seq: i64,
}

/// The manifest rows of the identity `identity` for `keys` (doc_id, chunk_index), in one
/// statement by the primary key: the answer's `n`th entry is the `n`th key's row, `None` where
/// it has none.
pub async fn held_records(
    pool: &PgPool,
    identity: &str,
    keys: &[(&str, i32)],
) -> Result<Vec<Option<HeldRecord>>, StoreError> {
    let docs: Vec<&str> = keys.iter().map(|k| k.0).collect();
    let idxs: Vec<i32> = keys.iter().map(|k| k.1).collect();
    let rows: Vec<(i64, Option<Vec<u8>>, String, i64)> = sqlx::query_as(
        "SELECT k.n, m.text_hash, m.content_hash, m.source_seq
           FROM UNNEST($2::text[], $3::int[]) WITH ORDINALITY AS k(doc_id, chunk_index, n)
           JOIN ingest_manifest m
             ON m.target_table = $1 AND m.doc_id = k.doc_id AND m.chunk_index = k.chunk_index",
    )
    .bind(identity)
    .bind(&docs)
    .bind(&idxs)
    .fetch_all(pool)
    .await?;
    let mut held = vec![None; keys.len()];
    for (n, text_hash, content_hash, source_seq) in rows {
        if let Some(slot) = usize::try_from(n - 1).ok().and_then(|i| held.get_mut(i)) {
            *slot = Some(HeldRecord { text_hash, content_hash, source_seq });
        }
    }
    Ok(held)
}

/// Whether `revision` holds chunks written before text hashes existed (one probe: the first
/// such row ends it; a manifest of only new rows is read once through).
pub async fn lacks_text_hashes(pool: &PgPool, revision: &Revision) -> Result<bool, StoreError> {
    Ok(sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM ingest_manifest WHERE target_table = $1 AND text_hash IS NULL)",
    )
    .bind(&revision.identity)
    .fetch_one(pool)
    .await?)
}

/// What [`retire`] removed.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Retired {
    /// The target.
    pub target: String,
    /// The revision retired.
    pub revision: i32,
    /// Its relation, dropped.
    pub relation: String,
    /// Its manifest rows deleted.
    pub manifest_rows: u64,
    /// Its DLQ rows deleted (no event is written for them: the revision is gone).
    pub dlq_rows: u64,
}

/// Retires `revision` of `target`, in one transaction: its relation is dropped, its
/// manifest, DLQ, tombstone, lease and stream-source rows are deleted, and it is recorded as
/// `retired` (kept as history; its number is never given again). Writes stop reaching it
/// (an ingest running meanwhile fails that revision's part, the others go on). Refused for
/// the active revision.
pub async fn retire(pool: &PgPool, target: &str, revision: i32) -> Result<Retired, RevisionError> {
    let name = canonical(pool, target).await?;
    let mut tx = pool.begin().await.map_err(StoreError::from)?;
    lock_target(&mut tx, &name).await?;
    let row = sqlx::query(
        "SELECT target, revision, identity, relation, model, request_dimensions, dimensions, state
           FROM embed_dlq_revision WHERE target = $1 AND revision = $2 FOR UPDATE",
    )
    .bind(&name)
    .bind(revision)
    .fetch_optional(&mut *tx)
    .await
    .map_err(StoreError::from)?;
    let r = match row {
        Some(row) => revision_of_row(&row).map_err(StoreError::from)?,
        None => {
            return Err(
                StoreError::Target { table: name, problem: format!("has no revision {revision}") }.into()
            );
        }
    };
    let refuse =
        |why| RevisionError::NotSwitchable { target: name.clone(), revision, state: r.state.clone(), why };
    match r.state.as_str() {
        "active" => return Err(refuse("the query name answers it: switch to another revision first")),
        "retired" => return Err(refuse("retired already")),
        _ => {}
    }
    // The manifest first (every writer locks its manifest rows before the DLQ's).
    let mut counts = [0u64; 2];
    for (n, sql) in [
        "DELETE FROM ingest_manifest WHERE target_table = $1",
        "DELETE FROM embedding_dlq WHERE target_table = $1",
        "DELETE FROM ingest_tombstone WHERE target_table = $1",
        "DELETE FROM ingest_lease WHERE target_table = $1",
        "DELETE FROM ingest_stream_fed WHERE target_table = $1",
        "DELETE FROM source_suspect WHERE target_table = $1",
    ]
    .into_iter()
    .enumerate()
    {
        let done = sqlx::query(sql).bind(&r.identity).execute(&mut *tx).await.map_err(StoreError::from)?;
        if n < 2 {
            counts[n] = done.rows_affected();
        }
    }
    sqlx::query(AssertSqlSafe(format!("DROP TABLE {}", r.relation)))
        .execute(&mut *tx)
        .await
        .map_err(StoreError::from)?;
    sqlx::query(
        "UPDATE embed_dlq_revision SET state = 'retired', retired_at = now() WHERE target = $1 AND revision = $2",
    )
    .bind(&name)
    .bind(revision)
    .execute(&mut *tx)
    .await
    .map_err(StoreError::from)?;
    tx.commit().await.map_err(StoreError::from)?;
    Ok(Retired {
        target: name,
        revision,
        relation: r.relation,
        manifest_rows: counts[0],
        dlq_rows: counts[1],
    })
}

/// One revision and what it holds: what the revision gauges and the console show.
#[derive(Debug, Clone)]
pub struct RevisionNumbers {
    /// The revision.
    pub revision: Revision,
    /// Rows of its manifest (stored, parked or in flight); 0 for a retired one.
    pub chunks: u64,
    /// DLQ rows under its identity; 0 for a retired one.
    pub dlq_rows: u64,
    /// How much of its target's active revision it covers; `None` for the active revision
    /// itself and for a retired one.
    pub coverage: Option<Coverage>,
}

impl RevisionNumbers {
    /// The share of the active revision's chunks covered (1 for the active revision, and
    /// when the active one holds nothing).
    pub fn covered_ratio(&self) -> f64 {
        match &self.coverage {
            Some(c) if c.active_chunks > 0 => c.covered as f64 / c.active_chunks as f64,
            _ => 1.0,
        }
    }
}

/// Every revision in the registry (of `target` only, when given) with its numbers: counts
/// by the manifest's and the DLQ's primary keys, and a coverage count for each live revision
/// that is not active (about a second at 1M chunks: sample it, do not poll it).
pub async fn numbers(pool: &PgPool, target: Option<&str>) -> Result<Vec<RevisionNumbers>, StoreError> {
    let all = list(pool, target).await?;
    let mut out = Vec::with_capacity(all.len());
    for r in &all {
        if r.state == "retired" {
            out.push(RevisionNumbers { revision: r.clone(), chunks: 0, dlq_rows: 0, coverage: None });
            continue;
        }
        let (chunks, dlq): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM ingest_manifest WHERE target_table = $1),
                    (SELECT count(*) FROM embedding_dlq WHERE target_table = $1)",
        )
        .bind(&r.identity)
        .fetch_one(pool)
        .await?;
        let active = all.iter().find(|a| a.target == r.target && a.state == "active");
        let coverage = match active {
            Some(a) if a.revision != r.revision => {
                let mut conn = pool.acquire().await?;
                Some(coverage(&mut conn, a, r).await?)
            }
            _ => None,
        };
        out.push(RevisionNumbers {
            revision: r.clone(),
            chunks: chunks.max(0) as u64,
            dlq_rows: dlq.max(0) as u64,
            coverage,
        });
    }
    Ok(out)
}

/// Longest pause of intake a quiesced switch may ask for ([`activate_quiesced`]).
pub const MAX_SWITCH_WAIT: std::time::Duration = std::time::Duration::from_secs(600);

/// Most chunks not covered that a quiesced switch takes for work in flight (and pauses intake
/// for): a stream source holds at most its in-flight entries (4,096 by default) unsettled.
pub const IN_FLIGHT_BOUND: u64 = 10_000;

/// How long past its wait a pause of intake stays on record if the `activate` that asked for
/// it dies: the longest a killed switch can hold up a stream source.
const PAUSE_MARGIN: std::time::Duration = std::time::Duration::from_secs(10);

/// [`activate`] under live writes: when the first check finds at most [`IN_FLIGHT_BOUND`]
/// chunks beyond `allow_missing` not covered (work in flight), asks every stream source
/// writing `target` to read no new entry (migration 0028) while the coverage check is retried, every 250 ms for up to `wait`
/// (at most [`MAX_SWITCH_WAIT`]), so that the work in flight commits in every revision and
/// the check can pass; then switches and lets intake go on. A zero `wait` is [`activate`]
/// alone. Refusals other than coverage are returned at once; the last coverage refusal when
/// the wait runs out. Corpus runs are not paused.
pub async fn activate_quiesced(
    pool: &PgPool,
    target: &str,
    revision: Option<i32>,
    allow_missing: u64,
    wait: std::time::Duration,
) -> Result<Activation, RevisionError> {
    let wait = wait.min(MAX_SWITCH_WAIT);
    // First without a pause: a covered shadow switches at once, and one with a real gap (more
    // than what can be in flight) is refused at once, holding no intake up.
    match activate(pool, target, revision, allow_missing).await {
        Err(RevisionError::NotCovered { coverage, .. })
            if !wait.is_zero() && coverage.uncovered() <= allow_missing.saturating_add(IN_FLIGHT_BOUND) => {}
        other => return other,
    }
    let name = canonical(pool, target).await?;
    sqlx::query(
        "INSERT INTO embed_dlq_revision_switch (target, until) VALUES ($1, now() + $2 * interval '1 millisecond')
         ON CONFLICT (target) DO UPDATE SET since = now(), until = EXCLUDED.until",
    )
    .bind(&name)
    .bind((wait + PAUSE_MARGIN).as_millis() as i64)
    .execute(pool)
    .await
    .map_err(StoreError::from)?;
    let started = std::time::Instant::now();
    let result = loop {
        match activate(pool, &name, revision, allow_missing).await {
            Err(RevisionError::NotCovered { .. }) if started.elapsed() < wait => {
                tokio::time::sleep(std::time::Duration::from_millis(250)).await;
            }
            other => break other,
        }
    };
    if let Err(e) =
        sqlx::query("DELETE FROM embed_dlq_revision_switch WHERE target = $1").bind(&name).execute(pool).await
    {
        tracing::warn!(error = %e, target = %name, "could not end the pause of intake; it ends by itself within seconds");
    }
    result
}

/// Whether a switch of `target` (its canonical name) has asked stream sources to pause
/// their intake ([`activate_quiesced`]).
pub async fn intake_paused(pool: &PgPool, target: &str) -> Result<bool, StoreError> {
    Ok(sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM embed_dlq_revision_switch WHERE target = $1 AND until > now())",
    )
    .bind(target)
    .fetch_one(pool)
    .await?)
}
