//! What a Postgres table source keeps (migration 0029): its registration, the capture
//! triggers `add_table` installs on the user's table, the queue of changes they write, and
//! the reads of the follower (docs/table-source.md).
//!
//! A change names a key, never a text: the follower reads the row as it is when it embeds it.
//! Same-key transactions are serialised by the row lock, so a change queued later is read
//! later, and the run that reads it later carries a later position: the newest text wins
//! whatever order changes are applied in, and a change read twice (a follower killed before
//! it deleted its changes) is skipped as unchanged, with no provider call.

use std::collections::HashMap;

use sqlx::{PgPool, Row};

use super::StoreError;

/// Longest source name (it names the triggers, whose names Postgres caps at 63 bytes).
pub const MAX_SOURCE_NAME: usize = 40;

/// What `source add-table` registers.
#[derive(Debug, Clone)]
pub struct TableSourceSpec {
    /// The source's name: `[a-z0-9_]`, at most [`MAX_SOURCE_NAME`] bytes.
    pub name: String,
    /// The table followed (schema-qualified or on the search path).
    pub table: String,
    /// The column whose value is the document id.
    pub key_column: String,
    /// A row per chunk: the integer column holding the chunk index. `None`: one chunk a row.
    pub chunk_column: Option<String>,
    /// The text embedded, e.g. `"{title}\n\n{body}"`: `{column}` placeholders, `{{` and `}}`
    /// for braces. A NULL column reads as empty.
    pub template: String,
    /// Columns kept as the chunk's metadata (in the DLQ payload of a parked chunk).
    pub metadata_columns: Vec<String>,
    /// The vector table the source feeds.
    pub target_table: String,
    /// A row holds a whole document, cut into chunks this way. `None`: a row is one chunk.
    pub chunking: Option<Chunking>,
}

/// How a row that holds a whole document is cut into chunks (`source add-table
/// --chunk-chars`/`--chunk-tokens`, `src/ingest/split.rs`). Chunk 0 is the document's start;
/// a cut is deterministic, so an unchanged document gives the same chunks and an edit changes
/// only the chunks around it (the others are skipped as unchanged, with no provider call).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Chunking {
    /// What `size` and `overlap` count.
    pub unit: ChunkUnit,
    /// Most units a chunk holds ([`CHUNK_CHARS`], [`CHUNK_TOKENS`]).
    pub size: u32,
    /// Units of a chunk's end repeated at the next one's start (below `size`).
    pub overlap: u32,
    /// Cut at Markdown's structure first (headings, blocks, lists), then at sentences.
    pub markdown: bool,
}

/// The unit of a [`Chunking`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ChunkUnit {
    /// Unicode scalar values.
    Chars,
    /// `cl100k_base` tokens, the tokenizer of OpenAI's `text-embedding-3-*` and `-ada-002`
    /// (their input limit is 8,191 of them).
    Tokens,
}

/// Bounds of a chunk's size in characters.
pub const CHUNK_CHARS: std::ops::RangeInclusive<u32> = 16..=100_000;
/// Bounds of a chunk's size in tokens (the embedding models' input limit at most).
pub const CHUNK_TOKENS: std::ops::RangeInclusive<u32> = 8..=8_191;

impl ChunkUnit {
    fn as_str(self) -> &'static str {
        match self {
            ChunkUnit::Chars => "chars",
            ChunkUnit::Tokens => "tokens",
        }
    }
}

impl Chunking {
    /// Why this chunking is refused, if it is.
    pub fn problem(&self) -> Option<String> {
        let bounds = match self.unit {
            ChunkUnit::Chars => CHUNK_CHARS,
            ChunkUnit::Tokens => CHUNK_TOKENS,
        };
        if !bounds.contains(&self.size) {
            return Some(format!(
                "a chunk of {} {} is outside {}..={}",
                self.size,
                self.unit.as_str(),
                bounds.start(),
                bounds.end()
            ));
        }
        (self.overlap >= self.size)
            .then(|| format!("an overlap of {} is not below the chunk size {}", self.overlap, self.size))
    }
}

/// A registered table source, as the follower reads it.
#[derive(Debug, Clone)]
pub struct TableSource {
    /// Its name.
    pub name: String,
    /// The followed table as Postgres prints its OID (quoted where needed).
    pub table: String,
    /// The key column.
    pub key_column: String,
    /// The key column's type (`format_type`), used to cast keys read back as text.
    pub key_type: String,
    /// The chunk index column, if a row is a chunk.
    pub chunk_column: Option<String>,
    /// The parsed template.
    pub template: Template,
    /// The metadata columns.
    pub metadata_columns: Vec<String>,
    /// The vector table fed.
    pub target_table: String,
    /// Whether a snapshot over every row has finished since the source was added or truncated.
    pub snapshot_done: bool,
    /// Whether the next snapshot is a resync after a TRUNCATE (full cleanup).
    pub resync_full: bool,
    /// The key the unfinished snapshot resumes after: the last row of its last part that
    /// settled in every revision (`None`: from the first row).
    pub snapshot_after: Option<(String, i32)>,
    /// A row is a whole document, cut this way.
    pub chunking: Option<Chunking>,
}

/// A table source's problem that no retry fixes.
#[derive(Debug, thiserror::Error)]
pub enum TableSourceError {
    /// The spec does not fit the table (a missing column, a bad name, a bad template).
    #[error("table source {name}: {problem}")]
    Invalid {
        /// The source's name.
        name: String,
        /// What is wrong.
        problem: String,
    },
    /// No source of that name is registered.
    #[error("no table source named {0} (see `embed-dlq source list`)")]
    Unknown(String),
    /// Another follower holds the source (one follower a source): a standby waits for it.
    #[error("table source {0}: another follower holds this source")]
    FollowerRunning(String),
    /// The database failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<sqlx::Error> for TableSourceError {
    fn from(e: sqlx::Error) -> Self {
        TableSourceError::Store(StoreError::Db(e))
    }
}

/// A template: literal text and column placeholders, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct Template {
    parts: Vec<Part>,
}

#[derive(Debug, Clone, PartialEq)]
enum Part {
    Text(String),
    Column(String),
}

impl Template {
    /// Parses `{column}` placeholders (`{{`, `}}` for literal braces).
    pub fn parse(template: &str) -> Result<Template, String> {
        let mut parts = Vec::new();
        let mut text = String::new();
        let mut chars = template.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '{' if chars.peek() == Some(&'{') => {
                    chars.next();
                    text.push('{');
                }
                '}' if chars.peek() == Some(&'}') => {
                    chars.next();
                    text.push('}');
                }
                '{' => {
                    let mut name = String::new();
                    loop {
                        match chars.next() {
                            Some('}') => break,
                            Some(c) => name.push(c),
                            None => return Err(format!("an unclosed placeholder {{{name}")),
                        }
                    }
                    if name.is_empty() {
                        return Err("an empty placeholder {}".into());
                    }
                    if !text.is_empty() {
                        parts.push(Part::Text(std::mem::take(&mut text)));
                    }
                    parts.push(Part::Column(name));
                }
                '}' => return Err("a lone } (write }} for a brace)".into()),
                c => text.push(c),
            }
        }
        if !text.is_empty() {
            parts.push(Part::Text(text));
        }
        if !parts.iter().any(|p| matches!(p, Part::Column(_))) {
            return Err("no {column} placeholder: every row would embed the same text".into());
        }
        Ok(Template { parts })
    }

    /// The columns named, each once, in order of first use.
    pub fn columns(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for p in &self.parts {
            if let Part::Column(c) = p
                && !out.contains(c)
            {
                out.push(c.clone());
            }
        }
        out
    }

    /// The text for `values`, in the order of [`Template::columns`] (`None`: NULL, empty).
    pub fn render(&self, values: &[Option<String>]) -> String {
        let columns = self.columns();
        let mut out = String::new();
        for p in &self.parts {
            match p {
                Part::Text(t) => out.push_str(t),
                Part::Column(c) => {
                    let i = columns.iter().position(|x| x == c).expect("a column of the template");
                    if let Some(Some(v)) = values.get(i) {
                        out.push_str(v);
                    }
                }
            }
        }
        out
    }

    /// The template written back (what was registered).
    pub fn source(&self) -> String {
        let mut out = String::new();
        for p in &self.parts {
            match p {
                Part::Text(t) => out.push_str(&t.replace('{', "{{").replace('}', "}}")),
                Part::Column(c) => {
                    out.push('{');
                    out.push_str(c);
                    out.push('}');
                }
            }
        }
        out
    }
}

/// A queued change: a key to read again, or a TRUNCATE.
#[derive(Debug, Clone, PartialEq)]
pub struct Change {
    /// The queue row's id (the order changes were queued in).
    pub id: i64,
    /// The key, `None` for a TRUNCATE.
    pub key: Option<(String, i32)>,
}

/// A row of the source as the follower embeds it.
#[derive(Debug, Clone, PartialEq)]
pub struct SourceRow {
    /// The document id (the key as text) and chunk index.
    pub key: (String, i32),
    /// The rendered text.
    pub text: String,
    /// The metadata columns as a JSON object, if any are configured.
    pub metadata: Option<serde_json::Value>,
}

/// The chunks of `target` the manifest holds for each document at or past the count its
/// current text cuts into: what a document that got shorter no longer has, deleted by the
/// follower at its run's position (so a write older than the cut goes, a newer one stays).
pub async fn trailing_chunks(
    pool: &PgPool,
    target: &str,
    counts: &[(String, i32)],
) -> Result<Vec<(String, i32)>, TableSourceError> {
    if counts.is_empty() {
        return Ok(Vec::new());
    }
    let (docs, ns): (Vec<&str>, Vec<i32>) = counts.iter().map(|(d, n)| (d.as_str(), *n)).unzip();
    let rows = sqlx::query(
        "SELECT m.doc_id, m.chunk_index
           FROM UNNEST($2::text[], $3::int[]) AS d(doc_id, n)
           JOIN ingest_manifest m
             ON m.target_table = $1 AND m.doc_id = d.doc_id AND m.chunk_index >= d.n
          ORDER BY 1, 2",
    )
    .bind(target)
    .bind(&docs)
    .bind(&ns)
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// An identifier quoted for SQL.
fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// A string quoted as an SQL literal.
fn literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// The three trigger names of a source.
fn trigger_names(name: &str) -> [String; 3] {
    [
        format!("embed_dlq_{name}_rows"),
        format!("embed_dlq_{name}_update"),
        format!("embed_dlq_{name}_truncate"),
    ]
}

/// Registers a source and installs its capture triggers on the table, in one transaction:
/// every change committed after it is queued, and the follower's first snapshot reads
/// everything committed before.
pub async fn add_table(pool: &PgPool, spec: &TableSourceSpec) -> Result<TableSource, TableSourceError> {
    let invalid = |problem: String| TableSourceError::Invalid { name: spec.name.clone(), problem };
    if spec.name.is_empty()
        || spec.name.len() > MAX_SOURCE_NAME
        || !spec.name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    {
        return Err(invalid(format!("a source name is 1..={MAX_SOURCE_NAME} of [a-z0-9_]")));
    }
    let template = Template::parse(&spec.template).map_err(|e| invalid(format!("template: {e}")))?;
    if let Some(chunking) = &spec.chunking {
        if spec.chunk_column.is_some() {
            return Err(invalid("a row with a chunk column is a chunk already: no chunking".into()));
        }
        if let Some(problem) = chunking.problem() {
            return Err(invalid(problem));
        }
    }
    let mut tx = pool.begin().await?;
    let Some(row) = sqlx::query(
        "SELECT c.oid, c.oid::regclass::text AS name FROM pg_class c WHERE c.oid = to_regclass($1)",
    )
    .bind(&spec.table)
    .fetch_optional(&mut *tx)
    .await?
    else {
        return Err(invalid(format!("no table {}", spec.table)));
    };
    let oid: sqlx::postgres::types::Oid = row.get("oid");
    let table: String = row.get("name");
    let columns: HashMap<String, String> = sqlx::query(
        "SELECT attname::text AS name, format_type(atttypid, atttypmod) AS type
           FROM pg_attribute WHERE attrelid = $1 AND attnum > 0 AND NOT attisdropped",
    )
    .bind(oid)
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .map(|r| (r.get("name"), r.get("type")))
    .collect();
    let column = |c: &str| columns.get(c).ok_or_else(|| invalid(format!("{table} has no column {c}")));
    let key_type = column(&spec.key_column)?.clone();
    if let Some(c) = &spec.chunk_column
        && !["integer", "smallint"].contains(&column(c)?.as_str())
    {
        return Err(invalid(format!("the chunk column {c} is not integer or smallint")));
    }
    let text_columns = template.columns();
    for c in text_columns.iter().chain(&spec.metadata_columns) {
        column(c)?;
    }
    sqlx::query(
        "INSERT INTO embed_table_sources
            (name, source_table, source_oid, key_column, key_type, chunk_column, template,
             text_columns, metadata_columns, target_table, chunk_unit, chunk_size, chunk_overlap,
             chunk_markdown)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)",
    )
    .bind(&spec.name)
    .bind(&table)
    .bind(oid)
    .bind(&spec.key_column)
    .bind(&key_type)
    .bind(&spec.chunk_column)
    .bind(template.source())
    .bind(&text_columns)
    .bind(&spec.metadata_columns)
    .bind(&spec.target_table)
    .bind(spec.chunking.map(|c| c.unit.as_str()))
    .bind(spec.chunking.map(|c| c.size as i32))
    .bind(spec.chunking.map_or(0, |c| c.overlap as i32))
    .bind(spec.chunking.is_some_and(|c| c.markdown))
    .execute(&mut *tx)
    .await
    .map_err(|e| match &e {
        sqlx::Error::Database(d) if d.is_unique_violation() => invalid("a source of this name exists".into()),
        _ => TableSourceError::from(e),
    })?;
    for sql in trigger_sql(&spec.name, &table, &spec.key_column, spec.chunk_column.as_deref(), &text_columns)
    {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&mut *tx).await?;
    }
    tx.commit().await?;
    load(pool, &spec.name).await
}

/// The statements that install a source's triggers. An update reaches the capture function
/// only when the key, the chunk index or a column of the template changed.
fn trigger_sql(
    name: &str,
    table: &str,
    key: &str,
    chunk: Option<&str>,
    text_columns: &[String],
) -> Vec<String> {
    let [rows, update, truncate] = trigger_names(name);
    let args = format!("{}, {}, {}", literal(name), literal(key), literal(chunk.unwrap_or("")));
    let watched: Vec<String> = std::iter::once(key)
        .chain(chunk)
        .chain(text_columns.iter().map(String::as_str))
        .map(|c| format!("OLD.{0} IS DISTINCT FROM NEW.{0}", ident(c)))
        .collect();
    vec![
        format!(
            "CREATE TRIGGER {} AFTER INSERT OR DELETE ON {table} FOR EACH ROW EXECUTE FUNCTION embed_dlq_capture({args})",
            ident(&rows)
        ),
        format!(
            "CREATE TRIGGER {} AFTER UPDATE ON {table} FOR EACH ROW WHEN ({}) EXECUTE FUNCTION embed_dlq_capture({args})",
            ident(&update),
            watched.join(" OR ")
        ),
        format!(
            "CREATE TRIGGER {} AFTER TRUNCATE ON {table} FOR EACH STATEMENT EXECUTE FUNCTION embed_dlq_capture({args})",
            ident(&truncate)
        ),
    ]
}

/// The source named `name`.
pub async fn load(pool: &PgPool, name: &str) -> Result<TableSource, TableSourceError> {
    let Some(r) = sqlx::query(
        "SELECT name, source_oid::regclass::text AS tbl, key_column, key_type, chunk_column, template,
                metadata_columns, target_table, snapshot_done_at IS NOT NULL AS done, resync_full,
                chunk_unit, chunk_size, chunk_overlap, chunk_markdown, snapshot_after_key, snapshot_after_chunk
           FROM embed_table_sources WHERE name = $1",
    )
    .bind(name)
    .fetch_optional(pool)
    .await?
    else {
        return Err(TableSourceError::Unknown(name.into()));
    };
    let template: String = r.get("template");
    let unit = match r.get::<Option<&str>, _>("chunk_unit") {
        None => None,
        Some("chars") => Some(ChunkUnit::Chars),
        Some("tokens") => Some(ChunkUnit::Tokens),
        Some(other) => {
            return Err(TableSourceError::Invalid {
                name: name.into(),
                problem: format!("chunk unit {other}"),
            });
        }
    };
    let chunking = unit.map(|unit| Chunking {
        unit,
        size: r.get::<Option<i32>, _>("chunk_size").unwrap_or(0).max(0) as u32,
        overlap: r.get::<i32, _>("chunk_overlap").max(0) as u32,
        markdown: r.get("chunk_markdown"),
    });
    Ok(TableSource {
        name: r.get("name"),
        table: r.get("tbl"),
        key_column: r.get("key_column"),
        key_type: r.get("key_type"),
        chunk_column: r.get("chunk_column"),
        template: Template::parse(&template)
            .map_err(|e| TableSourceError::Invalid { name: name.into(), problem: e })?,
        metadata_columns: r.get("metadata_columns"),
        target_table: r.get("target_table"),
        snapshot_done: r.get("done"),
        resync_full: r.get("resync_full"),
        snapshot_after: r
            .get::<Option<String>, _>("snapshot_after_key")
            .map(|k| (k, r.get::<Option<i32>, _>("snapshot_after_chunk").unwrap_or(0))),
        chunking,
    })
}

/// The names of every registered source.
pub async fn list(pool: &PgPool) -> Result<Vec<String>, TableSourceError> {
    Ok(sqlx::query_scalar("SELECT name FROM embed_table_sources ORDER BY name").fetch_all(pool).await?)
}

/// The capture triggers a source should have that its table lacks (dropped or disabled by
/// hand): each is a change the follower would never see.
pub async fn missing_triggers(pool: &PgPool, source: &TableSource) -> Result<Vec<String>, TableSourceError> {
    let present: Vec<String> = sqlx::query_scalar(
        "SELECT t.tgname::text FROM pg_trigger t JOIN embed_table_sources s ON s.source_oid = t.tgrelid
          WHERE s.name = $1 AND t.tgenabled <> 'D'",
    )
    .bind(&source.name)
    .fetch_all(pool)
    .await?;
    Ok(trigger_names(&source.name).into_iter().filter(|t| !present.contains(t)).collect())
}

/// Reinstalls a source's capture triggers (dropped or disabled by hand) and schedules a
/// resync with a full cleanup: changes committed while a trigger was missing were never
/// queued, deletes among them too, so only reading the whole table again catches them up.
pub async fn repair_triggers(pool: &PgPool, source: &TableSource) -> Result<(), TableSourceError> {
    let mut tx = pool.begin().await?;
    for t in trigger_names(&source.name) {
        let sql = format!("DROP TRIGGER IF EXISTS {} ON {}", ident(&t), source.table);
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&mut *tx).await?;
    }
    let text_columns = source.template.columns();
    for sql in trigger_sql(
        &source.name,
        &source.table,
        &source.key_column,
        source.chunk_column.as_deref(),
        &text_columns,
    ) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&mut *tx).await?;
    }
    sqlx::query("UPDATE embed_table_sources SET snapshot_done_at = NULL, resync_full = true, snapshot_after_key = NULL, snapshot_after_chunk = NULL WHERE name = $1")
        .bind(&source.name)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(())
}

/// The key of the advisory lock a source's follower holds (`ingest::table`).
pub(crate) fn follower_lock_key(name: &str) -> String {
    format!("embed-dlq:table-source:{name}")
}

/// Unregisters a source: drops its triggers and its queue, in one transaction, and only while
/// no follower runs (its lock is taken for the transaction). The vectors it wrote stay.
pub async fn remove_table(pool: &PgPool, source: &TableSource) -> Result<(), TableSourceError> {
    let mut tx = pool.begin().await?;
    let free: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock(hashtextextended($1, 0))")
        .bind(follower_lock_key(&source.name))
        .fetch_one(&mut *tx)
        .await?;
    if !free {
        return Err(TableSourceError::FollowerRunning(source.name.clone()));
    }
    for t in trigger_names(&source.name) {
        let sql = format!("DROP TRIGGER IF EXISTS {} ON {}", ident(&t), source.table);
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&mut *tx).await?;
    }
    // The queue's rows go with it (ON DELETE CASCADE).
    sqlx::query("DELETE FROM embed_table_sources WHERE name = $1")
        .bind(&source.name)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(())
}

/// Most changes counted for a source's queue depth: the count reads the queue's index, so
/// it is capped to keep a sample cheap behind a huge backlog (the age is exact anyway).
pub const LAG_COUNT_CAP: i64 = 1_000_000;

/// Queue depth of a source (at most [`LAG_COUNT_CAP`]) and the age of its oldest change in
/// seconds (0 when empty).
pub async fn lag(pool: &PgPool, name: &str) -> Result<(i64, f64), TableSourceError> {
    let all = lags(pool).await?;
    Ok(all.into_iter().find(|(n, _, _)| n == name).map_or((0, 0.0), |(_, c, a)| (c, a)))
}

/// [`lag`] of every registered source: `(name, changes, oldest age in seconds)`.
pub async fn lags(pool: &PgPool) -> Result<Vec<(String, i64, f64)>, TableSourceError> {
    let rows = sqlx::query(
        "SELECT s.name,
                (SELECT count(*) FROM (SELECT 1 FROM embed_table_changes c
                                        WHERE c.source = s.name LIMIT $1) x) AS n,
                COALESCE(EXTRACT(EPOCH FROM clock_timestamp() -
                         (SELECT c.queued_at FROM embed_table_changes c
                           WHERE c.source = s.name ORDER BY c.id LIMIT 1)), 0)::float8 AS age
           FROM embed_table_sources s ORDER BY s.name",
    )
    .bind(LAG_COUNT_CAP)
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(|r| (r.get("name"), r.get("n"), r.get("age"))).collect())
}

/// The oldest `limit` changes of a source, in queue order.
pub async fn pending_changes(pool: &PgPool, name: &str, limit: i64) -> Result<Vec<Change>, TableSourceError> {
    let rows = sqlx::query(
        "SELECT id, doc_key, chunk_key FROM embed_table_changes WHERE source = $1 ORDER BY id LIMIT $2",
    )
    .bind(name)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| {
            let doc: Option<String> = r.get("doc_key");
            let chunk: Option<i32> = r.get("chunk_key");
            Change { id: r.get("id"), key: doc.map(|d| (d, chunk.unwrap_or(0))) }
        })
        .collect())
}

/// Deletes applied changes (after the run that read their rows has settled them).
pub async fn delete_changes(pool: &PgPool, name: &str, ids: &[i64]) -> Result<(), TableSourceError> {
    sqlx::query("DELETE FROM embed_table_changes WHERE source = $1 AND id = ANY($2)")
        .bind(name)
        .bind(ids)
        .execute(pool)
        .await?;
    Ok(())
}

/// A TRUNCATE queued at `id`: every change up to it is superseded by a resync of the whole
/// table with a full cleanup, which the next snapshot performs.
pub async fn start_resync(pool: &PgPool, name: &str, id: i64) -> Result<(), TableSourceError> {
    let mut tx = pool.begin().await?;
    sqlx::query("UPDATE embed_table_sources SET snapshot_done_at = NULL, resync_full = true, snapshot_after_key = NULL, snapshot_after_chunk = NULL WHERE name = $1")
        .bind(name)
        .execute(&mut *tx)
        .await?;
    sqlx::query("DELETE FROM embed_table_changes WHERE source = $1 AND id <= $2")
        .bind(name)
        .bind(id)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(())
}

/// Records that the snapshot has settled every row up to `key` (in key order) in every
/// revision: a follower that starts later resumes after it.
pub async fn snapshot_reached(
    pool: &PgPool,
    name: &str,
    key: &(String, i32),
) -> Result<(), TableSourceError> {
    sqlx::query(
        "UPDATE embed_table_sources SET snapshot_after_key = $2, snapshot_after_chunk = $3
          WHERE name = $1 AND snapshot_done_at IS NULL",
    )
    .bind(name)
    .bind(&key.0)
    .bind(key.1)
    .execute(pool)
    .await?;
    Ok(())
}

/// Records that a snapshot over every row has settled.
pub async fn snapshot_done(pool: &PgPool, name: &str) -> Result<(), TableSourceError> {
    sqlx::query(
        "UPDATE embed_table_sources SET snapshot_done_at = now(), resync_full = false,
                snapshot_after_key = NULL, snapshot_after_chunk = NULL WHERE name = $1",
    )
    .bind(name)
    .execute(pool)
    .await?;
    Ok(())
}

impl TableSource {
    /// The select list of a row read: key as text, chunk index, the template's columns as
    /// text, the metadata object.
    fn select_list(&self) -> String {
        let chunk =
            self.chunk_column.as_deref().map_or("0".to_string(), |c| format!("{}::integer", ident(c)));
        let texts: Vec<String> =
            self.template.columns().iter().map(|c| format!("{}::text", ident(c))).collect();
        let metadata = if self.metadata_columns.is_empty() {
            "NULL::jsonb".to_string()
        } else {
            let pairs: Vec<String> =
                self.metadata_columns.iter().map(|c| format!("{}, {}", literal(c), ident(c))).collect();
            format!("jsonb_build_object({})", pairs.join(", "))
        };
        // Aliased: an output column named like a table column would be what ORDER BY sorts
        // by (the key as text, in string order, with pages cut by the numeric key).
        format!(
            "{}::text AS embed_dlq_key, {chunk} AS embed_dlq_chunk, ARRAY[{}]::text[] AS embed_dlq_texts, {metadata} AS embed_dlq_metadata",
            ident(&self.key_column),
            texts.join(", ")
        )
    }

    fn row_of(&self, r: &sqlx::postgres::PgRow) -> SourceRow {
        let texts: Vec<Option<String>> = r.get(2);
        SourceRow { key: (r.get(0), r.get(1)), text: self.template.render(&texts), metadata: r.get(3) }
    }

    /// The current rows of the documents `docs` (every chunk row of them), by key.
    pub async fn read_rows(
        &self,
        pool: &PgPool,
        docs: &[String],
    ) -> Result<HashMap<(String, i32), SourceRow>, TableSourceError> {
        let sql = format!(
            "SELECT {} FROM {} WHERE {} = ANY($1::text[]::{}[])",
            self.select_list(),
            self.table,
            ident(&self.key_column),
            self.key_type
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(docs).fetch_all(pool).await?;
        Ok(rows.iter().map(|r| self.row_of(r)).map(|row| (row.key.clone(), row)).collect())
    }

    /// Up to `limit` rows after `after` and at or before `until` in key order: keyset
    /// paging, each page its own statement, so a later page reads a later state. Each bound
    /// is in the statement only when given, so that every page is an index range scan.
    pub async fn page(
        &self,
        pool: &PgPool,
        after: Option<&(String, i32)>,
        until: Option<&(String, i32)>,
        limit: i64,
    ) -> Result<Vec<SourceRow>, TableSourceError> {
        let key = ident(&self.key_column);
        let ty = &self.key_type;
        let (order, row_key) = match &self.chunk_column {
            Some(c) => (format!("{key}, {}", ident(c)), format!("({key}, {})", ident(c))),
            None => (key.clone(), key.clone()),
        };
        let mut bounds = Vec::new();
        let mut keys = Vec::new();
        for (op, bound) in [(">", after), ("<=", until)] {
            let Some(bound) = bound else { continue };
            let n = keys.len() * 2 + 1;
            let value = match &self.chunk_column {
                Some(_) => format!("(${n}::text::{ty}, ${}::integer)", n + 1),
                // The chunk parameter is bound all the same: used, so that its type is known.
                None => format!("${n}::text::{ty} AND ${}::integer IS NOT NULL", n + 1),
            };
            bounds.push(format!("{row_key} {op} {value}"));
            keys.push(bound);
        }
        let filter = if bounds.is_empty() { "true".to_string() } else { bounds.join(" AND ") };
        let sql = format!(
            "SELECT {} FROM {} WHERE {filter} ORDER BY {order} LIMIT ${}",
            self.select_list(),
            self.table,
            keys.len() * 2 + 1
        );
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for k in keys {
            query = query.bind(k.0.clone()).bind(k.1);
        }
        let rows = query.bind(limit).fetch_all(pool).await?;
        Ok(rows.iter().map(|r| self.row_of(r)).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_render_columns_and_escaped_braces() {
        let t = Template::parse("{title}\n\n{body} {{x}} {title}").unwrap();
        assert_eq!(t.columns(), vec!["title".to_string(), "body".to_string()]);
        assert_eq!(t.render(&[Some("T".into()), None]), "T\n\n {x} T");
        assert_eq!(Template::parse(&t.source()).unwrap(), t);
        assert!(Template::parse("no placeholder").is_err());
        assert!(Template::parse("{open").is_err());
        assert!(Template::parse("a } b").is_err());
        assert!(Template::parse("{}").is_err());
    }

    #[test]
    fn identifiers_and_literals_are_quoted() {
        assert_eq!(ident("we\"ird"), "\"we\"\"ird\"");
        assert_eq!(literal("it's"), "'it''s'");
    }
}
