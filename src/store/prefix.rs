//! Which stream prefix a database's outbox is relayed under (`embed_dlq_streams`, migration
//! 0010): one database, one set of streams. Two deployments with different prefixes over one
//! database would split the outbox between their streams, and each reconciler would publish
//! the other's events again; so the first `serve` or `reconcile` records its prefix and any
//! process configured with another one refuses to start. Processes that only read the
//! streams (`tail`, `console`) [`verify`] the prefix without recording one.

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use super::StoreError;

/// The database's outbox is relayed under another stream prefix than this process's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "this database's outbox is relayed to the streams under prefix {recorded:?} (recorded in \
     embed_dlq_streams on {since}); this process is configured with stream_prefix = \
     {configured:?}. Two prefixes over one database would split every event between them: use \
     {recorded:?}, or a database of its own. To move this database to new streams for good, stop \
     every serve, run `embed-dlq migrate --adopt-stream-prefix {configured}`, then \
     `embed-dlq reconcile --repair` (see docs/SCALING.md, \"One database, one set of streams\")"
)]
pub struct PrefixMismatch {
    /// The prefix the database is relayed under.
    pub recorded: String,
    /// When it was recorded.
    pub since: DateTime<Utc>,
    /// The prefix this process was given.
    pub configured: String,
}

/// Why [`check`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PrefixError {
    /// The database is relayed under another prefix.
    #[error(transparent)]
    Mismatch(#[from] PrefixMismatch),
    /// The statement failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Records `prefix` as the database's stream prefix if none is recorded yet, and checks that
/// the recorded one is `prefix`.
pub async fn check(pool: &PgPool, prefix: &str) -> Result<(), PrefixError> {
    let (recorded, since): (String, DateTime<Utc>) = sqlx::query_as(
        "WITH new AS (
             INSERT INTO embed_dlq_streams (stream_prefix) VALUES ($1)
             ON CONFLICT (singleton) DO NOTHING
             RETURNING stream_prefix, recorded_at
         )
         SELECT stream_prefix, recorded_at FROM new
         UNION ALL
         SELECT stream_prefix, recorded_at FROM embed_dlq_streams WHERE NOT EXISTS (SELECT 1 FROM new)",
    )
    .bind(prefix)
    .fetch_one(pool)
    .await
    .map_err(StoreError::from)?;
    if recorded != prefix {
        return Err(PrefixMismatch { recorded, since, configured: prefix.to_string() }.into());
    }
    Ok(())
}

/// Checks, without recording anything, that the database is not relayed under another prefix
/// than `prefix`: for processes that only read the streams. A database with no prefix
/// recorded yet (or not migrated yet) passes.
pub async fn verify(pool: &PgPool, prefix: &str) -> Result<(), PrefixError> {
    let recorded: Option<(String, DateTime<Utc>)> =
        match sqlx::query_as("SELECT stream_prefix, recorded_at FROM embed_dlq_streams")
            .fetch_optional(pool)
            .await
        {
            Ok(r) => r,
            // Not migrated yet: nothing recorded.
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(UNDEFINED_TABLE) => None,
            Err(e) => return Err(StoreError::from(e).into()),
        };
    match recorded {
        Some((recorded, since)) if recorded != prefix => {
            Err(PrefixMismatch { recorded, since, configured: prefix.to_string() }.into())
        }
        _ => Ok(()),
    }
}

/// SQLSTATE of a statement on a table that does not exist.
const UNDEFINED_TABLE: &str = "42P01";

/// Records `prefix` as the database's stream prefix, replacing the recorded one: the database
/// moves to new streams (every `serve` of the old prefix must be stopped first).
pub async fn adopt(pool: &PgPool, prefix: &str) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO embed_dlq_streams (stream_prefix) VALUES ($1)
         ON CONFLICT (singleton) DO UPDATE SET stream_prefix = EXCLUDED.stream_prefix, recorded_at = now()",
    )
    .bind(prefix)
    .execute(pool)
    .await?;
    Ok(())
}
