//! A throwaway database per test: created on the server a URL points at, migrated (or not),
//! and dropped with the value — also when the test panics, because the drop runs in `Drop`.
//!
//! Names are `it_<pid>_[<run>_]<seq>_<random>`: the creating process id lets
//! `scripts/services.sh drop-test-dbs` drop what a killed run (no destructors) left, once that
//! process is gone; `<run>` is `EMBED_DLQ_TEST_RUN` when set, so a script can count exactly
//! its own run's databases afterwards (`scripts/test.sh` checks that none remain).
//!
//! Why not `#[sqlx::test]`: it keeps the database of a failed test (for inspection, until the
//! next run of the same binary), it hands out a pool but no URL (our tests start the binary
//! with `--database-url`), and it has no unmigrated variant.

use std::sync::atomic::{AtomicU32, Ordering};

use sqlx::{Connection, PgConnection, PgPool};

/// The variable naming the server test databases are created on (`scripts/test.sh` sets it).
pub const DATABASE_URL_VAR: &str = "DATABASE_URL";

/// The variable whose value, when set, tags every test database name with one run.
pub const RUN_TAG_VAR: &str = "EMBED_DLQ_TEST_RUN";

/// The prefix of every test database name (what `drop-test-dbs` and the leak check match).
pub const NAME_PREFIX: &str = "it_";

/// Why a test database could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TestDbError {
    /// Connecting to the server or creating the database failed.
    #[error("create test database {name}: {source}")]
    Create {
        /// The database that was being made.
        name: String,
        /// What Postgres (or the connection) said.
        #[source]
        source: sqlx::Error,
    },
    /// Connecting to the fresh database or migrating it failed (it is dropped again).
    #[error("prepare test database {name}: {source}")]
    Prepare {
        /// The database that was being prepared.
        name: String,
        /// What the store said.
        #[source]
        source: crate::store::StoreError,
    },
}

/// A database of its own for one test, with a pool on it; dropped with the value.
pub struct TestDb {
    /// Connection URL of this database: pass it to a child process (`--database-url`).
    pub url: String,
    /// A small pool on this database.
    pub pool: PgPool,
    /// What `Drop` removes; `None` for a database this value does not own.
    owned: Option<Owned>,
}

/// The database a [`TestDb`] drops, and the server URL to drop it through.
struct Owned {
    server_url: String,
    name: String,
}

impl TestDb {
    /// A fresh, migrated database on the server `DATABASE_URL` points at.
    ///
    /// # Panics
    ///
    /// When `DATABASE_URL` is unset or the database cannot be made: this is for tests, where a
    /// panic with the reason is the report.
    pub async fn new() -> TestDb {
        TestDb::create(&server_url_from_env()).await.unwrap_or_else(|e| panic!("{e}"))
    }

    /// A fresh database on the server `DATABASE_URL` points at, with no migration applied
    /// (to test migrating, or a schema from before a migration).
    ///
    /// # Panics
    ///
    /// As [`TestDb::new`].
    pub async fn unmigrated() -> TestDb {
        TestDb::create_unmigrated(&server_url_from_env()).await.unwrap_or_else(|e| panic!("{e}"))
    }

    /// A fresh, migrated database on the server `server_url` points at (any database of that
    /// server: only the server part is used): a copy of the server's migrated template
    /// ([`migrated_template`]), checked by migrating it (a no-op on a complete copy).
    pub async fn create(server_url: &str) -> Result<TestDb, TestDbError> {
        let template = migrated_template(server_url).await?;
        let db = match TestDb::create_from(server_url, Some(&template)).await {
            Ok(db) => db,
            // A server restarted on a fresh data dir no longer has the template this process
            // made on it: made again once.
            Err(_) => {
                forget_template(server_url);
                let template = migrated_template(server_url).await?;
                TestDb::create_from(server_url, Some(&template)).await?
            }
        };
        match crate::store::migrate(&db.pool).await {
            Ok(()) => Ok(db),
            Err(source) => Err(TestDbError::Prepare { name: db.name().unwrap_or_default().into(), source }),
        }
    }

    /// A fresh database on the server `server_url` points at, with no migration applied.
    pub async fn create_unmigrated(server_url: &str) -> Result<TestDb, TestDbError> {
        TestDb::create_from(server_url, None).await
    }

    /// A fresh database, a copy of `template` (else of the server's default template).
    async fn create_from(server_url: &str, template: Option<&str>) -> Result<TestDb, TestDbError> {
        let name = fresh_name();
        let create_error = |source| TestDbError::Create { name: name.clone(), source };
        let mut conn = PgConnection::connect(server_url).await.map_err(create_error)?;
        let sql = match template {
            Some(t) => format!("CREATE DATABASE \"{name}\" TEMPLATE \"{t}\""),
            None => format!("CREATE DATABASE \"{name}\""),
        };
        let created = sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&mut conn).await;
        conn.close().await.ok();
        created.map_err(create_error)?;
        // Owned from here on: an error below drops the database again.
        let url = with_database(server_url, &name);
        let owned = Owned { server_url: server_url.to_string(), name: name.clone() };
        let pool = match crate::store::connect(&url, 4).await {
            Ok(pool) => pool,
            Err(source) => {
                owned.drop_database();
                return Err(TestDbError::Prepare { name, source });
            }
        };
        Ok(TestDb { url, pool, owned: Some(owned) })
    }

    /// A handle on a database someone else owns (for example the only database of a private
    /// server the test tears down itself): the same helpers, and nothing dropped.
    pub fn borrowed(url: String, pool: PgPool) -> TestDb {
        TestDb { url, pool, owned: None }
    }

    /// The name of the database this value drops; `None` for a borrowed one.
    pub fn name(&self) -> Option<&str> {
        self.owned.as_ref().map(|o| o.name.as_str())
    }

    /// Runs a `SELECT count(*) …` and returns the count.
    ///
    /// # Panics
    ///
    /// When the query fails (the panic names the query).
    pub async fn count(&self, sql: &'static str) -> i64 {
        sqlx::query_scalar(sql).fetch_one(&self.pool).await.expect(sql)
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if let Some(owned) = self.owned.take() {
            owned.drop_database();
        }
    }
}

impl Owned {
    /// `DROP DATABASE … WITH (FORCE)` (which also ends this test's own connections), on a
    /// thread of its own with a runtime of its own: `Drop` cannot await, and blocking on the
    /// test's runtime from inside it would panic. Waits for the drop, so the database is gone
    /// when the value is.
    fn drop_database(self) {
        let Owned { server_url, name } = self;
        let dropped = std::thread::spawn(move || -> Result<(), String> {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            runtime.block_on(async {
                let mut conn = PgConnection::connect(&server_url).await.map_err(|e| e.to_string())?;
                let sql = format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)");
                let result = sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&mut conn).await;
                conn.close().await.ok();
                result.map(drop).map_err(|e| format!("{name}: {e}"))
            })
        })
        .join();
        // No panic here (it could be during an unwind, which would abort): a database that
        // survives is reported by scripts/test.sh and dropped by `drop-test-dbs`.
        match dropped {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!("could not drop test database {e}"),
            Err(_) => tracing::warn!("the thread dropping a test database panicked"),
        }
    }
}

/// The prefix of the migrated templates test databases are copied from (not matched by
/// `drop-test-dbs`: a template outlives the runs that use it).
pub const TEMPLATE_PREFIX: &str = "it_template_";

/// `(server URL, template)` of the templates this process made or found.
static MADE_TEMPLATES: std::sync::Mutex<Vec<(String, String)>> = std::sync::Mutex::new(Vec::new());

fn forget_template(server_url: &str) {
    MADE_TEMPLATES.lock().unwrap_or_else(std::sync::PoisonError::into_inner).retain(|(u, _)| u != server_url);
}

/// The name of the server's copy of the current migrations, made once (by whichever test
/// process gets there first, under an advisory lock) and then copied by every
/// [`TestDb::new`]: a copy costs the server a file copy, where running the twenty migrations
/// again for each of the suite's 300 databases cost it parsing, catalog writes and index
/// builds (BENCHMARKS.md "Build and test time"). Named by a digest of the migrations, so a changed
/// migration gets a template of its own; making one drops the templates of other digests.
pub async fn migrated_template(server_url: &str) -> Result<String, TestDbError> {
    use sha2::Digest;
    let known = |url: &str| {
        let made = MADE_TEMPLATES.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        made.iter().find(|(u, _)| u == url).map(|(_, name)| name.clone())
    };
    if let Some(name) = known(server_url) {
        return Ok(name);
    }
    let mut digest = sha2::Sha256::new();
    for m in crate::store::MIGRATOR.iter() {
        digest.update(m.version.to_le_bytes());
        digest.update(&*m.checksum);
    }
    let digest = digest.finalize();
    let name = format!("{TEMPLATE_PREFIX}{}", crate::model::hex(&digest[..8]));
    let create_error = |source| TestDbError::Create { name: name.clone(), source };
    let mut conn = PgConnection::connect(server_url).await.map_err(create_error)?;
    // One maker at a time across processes; the lock ends with the connection.
    sqlx::query("SELECT pg_advisory_lock(hashtext('embed-dlq test template'))")
        .execute(&mut conn)
        .await
        .map_err(create_error)?;
    let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
        .bind(&name)
        .fetch_one(&mut conn)
        .await
        .map_err(create_error)?;
    if !exists {
        // Made under another name and renamed when complete: a maker killed halfway leaves
        // no template that looks finished.
        let building = format!("{name}_building");
        for sql in [
            format!("DROP DATABASE IF EXISTS \"{building}\" WITH (FORCE)"),
            format!("CREATE DATABASE \"{building}\""),
        ] {
            sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&mut conn).await.map_err(create_error)?;
        }
        let prepare_error = |source| TestDbError::Prepare { name: building.clone(), source };
        let pool =
            crate::store::connect(&with_database(server_url, &building), 1).await.map_err(prepare_error)?;
        let migrated = crate::store::migrate(&pool).await;
        pool.close().await;
        migrated.map_err(prepare_error)?;
        let sql = format!("ALTER DATABASE \"{building}\" RENAME TO \"{name}\"");
        sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&mut conn).await.map_err(create_error)?;
        // Templates of other migrations (older checkouts); one still being copied stays.
        let others: Vec<String> = sqlx::query_scalar(
            "SELECT datname FROM pg_database WHERE starts_with(datname, $1) AND datname <> $2",
        )
        .bind(TEMPLATE_PREFIX)
        .bind(&name)
        .fetch_all(&mut conn)
        .await
        .map_err(create_error)?;
        for other in others {
            let sql = format!("DROP DATABASE IF EXISTS \"{other}\"");
            sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&mut conn).await.ok();
        }
    }
    conn.close().await.ok();
    MADE_TEMPLATES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push((server_url.to_string(), name.clone()));
    Ok(name)
}

fn server_url_from_env() -> String {
    std::env::var(DATABASE_URL_VAR).unwrap_or_else(|_| {
        panic!(
            "{DATABASE_URL_VAR} is not set: run the tests with scripts/test.sh (it starts Postgres+pgvector and Redis)"
        )
    })
}

/// `it_<pid>_[<run>_]<seq>_<random>`; a run tag that is not plain alphanumeric is ignored (it
/// is pasted into SQL and must match `drop-test-dbs`' pattern).
fn fresh_name() -> String {
    static SEQ: AtomicU32 = AtomicU32::new(0);
    let run = std::env::var(RUN_TAG_VAR)
        .ok()
        .filter(|t| !t.is_empty() && t.len() <= 16 && t.bytes().all(|b| b.is_ascii_alphanumeric()))
        .map(|t| format!("{t}_"))
        .unwrap_or_default();
    format!(
        "{NAME_PREFIX}{}_{run}{}_{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::SeqCst),
        rand::random::<u32>()
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

/// Writes `rows` (position, vector) into `raw_embeddings` (a table shaped like
/// `doc_embeddings`) in one statement, with the fastest plain method measured here (binary
/// binds, `UNNEST`): the raw write baseline the benchmarks and the outage example compare the
/// pipeline with. Documents are `<prefix>-<position / 8>`, 8 chunks each, with a made-up
/// content hash.
pub async fn insert_raw_rows(
    conn: &mut PgConnection,
    prefix: &str,
    rows: &[(usize, &pgvector::Vector)],
) -> Result<(), sqlx::Error> {
    let docs: Vec<String> = rows.iter().map(|(n, _)| format!("{prefix}-{}", n / 8)).collect();
    let idxs: Vec<i32> = rows.iter().map(|(n, _)| (n % 8) as i32).collect();
    let hashes: Vec<String> = rows.iter().map(|(n, _)| format!("{n:064x}")).collect();
    let vectors: Vec<&pgvector::Vector> = rows.iter().map(|(_, v)| *v).collect();
    sqlx::query(
        "INSERT INTO raw_embeddings (doc_id, chunk_index, content_hash, embedding)
         SELECT * FROM UNNEST($1::text[], $2::int[], $3::text[], $4::vector[])",
    )
    .bind(&docs)
    .bind(&idxs)
    .bind(&hashes)
    .bind(&vectors)
    .execute(conn)
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_url_rewrite() {
        assert_eq!(with_database("postgres://u@h:1/db", "x"), "postgres://u@h:1/x");
        assert_eq!(
            with_database("postgres://u@h:1/db?sslmode=disable", "x"),
            "postgres://u@h:1/x?sslmode=disable"
        );
        assert_eq!(with_database("postgres://u@h:1", "x"), "postgres://u@h:1/x");
    }

    #[test]
    fn names_carry_the_pid_and_a_sane_run_tag() {
        let name = fresh_name();
        let pid = format!("{NAME_PREFIX}{}_", std::process::id());
        assert!(name.starts_with(&pid), "{name}");
        assert!(name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'), "{name}");
    }
}
