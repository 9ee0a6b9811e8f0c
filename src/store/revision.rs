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

use super::{StoreError, inspect_target, quote_table_name};

/// Postgres' longest identifier (NAMEDATALEN - 1 bytes): a revision's relation name
/// (`<table>__r<n>`) must fit, or Postgres would silently cut it.
const MAX_IDENTIFIER_BYTES: usize = 63;

/// pgvector's largest `vector(N)`.
const MAX_DIMENSIONS: usize = 16_000;

/// The longest model name a revision records (the DLQ's rows and the provider's requests
/// carry it too).
const MAX_MODEL_BYTES: usize = 256;

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
    let quoted = quote_table_name(table).map_err(err)?;
    let name: Option<String> = sqlx::query_scalar("SELECT embed_dlq_table_name(to_regclass($1))")
        .bind(&quoted)
        .fetch_one(pool)
        .await?;
    name.ok_or_else(|| err("does not exist".into()))
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
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('embed_dlq_revision'), hashtext($1))")
        .bind(&name)
        .execute(&mut *tx)
        .await?;
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
    let ident = |s: &str| format!("\"{}\"", s.replace('"', "\"\""));
    let (q_schema, q_table, q_relation) = (ident(&schema), ident(&relname), ident(&relation_name));
    let taken: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(format!("{q_schema}.{q_relation}"))
        .fetch_one(&mut *tx)
        .await?;
    if taken {
        return Err(err(format!("{schema}.{relation_name} exists already")));
    }
    // The columns in their order, the vector one without its fixed dimension.
    let columns: Vec<String> = sqlx::query_scalar(
        "SELECT a.attname::text FROM pg_attribute a
          WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped
          ORDER BY a.attnum",
    )
    .bind(&name)
    .fetch_all(&mut *tx)
    .await?;
    let select: Vec<String> = columns
        .iter()
        .map(|c| if c == "embedding" { "embedding::vector AS embedding".to_string() } else { ident(c) })
        .collect();
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
        format!("CREATE VIEW {q_schema}.{q_table} AS SELECT {} FROM {q_schema}.{q_relation}", select.join(", ")),
        format!(
            "CREATE TRIGGER embed_dlq_refuse_write INSTEAD OF INSERT OR UPDATE OR DELETE ON {q_schema}.{q_table}
               FOR EACH ROW EXECUTE FUNCTION embed_dlq_refuse_write()"
        ),
        format!("ALTER VIEW {q_schema}.{q_table} OWNER TO {}", ident(&owner)),
    ];
    statements.extend(grantees.iter().map(|g| format!("GRANT SELECT ON {q_schema}.{q_table} TO {g}")));
    for sql in statements {
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
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('embed_dlq_revision'), hashtext($1))")
        .bind(&first.target)
        .execute(&mut *tx)
        .await?;
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
    let ident = |s: &str| format!("\"{}\"", s.replace('"', "\"\""));
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
