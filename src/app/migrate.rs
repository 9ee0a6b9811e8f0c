//! `migrate`: applies the schema migrations and, with `--dimensions`, creates the target
//! table.

use embed_dlq::config::{FileConfig, IngestArgs};
use embed_dlq::store::{self, StoreError};

use super::args::MigrateCommand;
use super::{Resolver, exit};

/// Runs `migrate`; returns the exit code.
pub async fn command(resolver: &Resolver, args: MigrateCommand) -> i32 {
    let MigrateCommand { table, dimensions, adopt_stream_prefix } = args;
    if let Some(p) = &adopt_stream_prefix
        && let Err(e) = embed_dlq::config::check_stream_prefix(p)
    {
        return exit::fail(exit::USAGE, &format!("--adopt-stream-prefix: {e}"));
    }
    let flags = FileConfig { ingest: IngestArgs { table, ..Default::default() }, ..Default::default() };
    let (settings, url) = match resolver.with_database(flags) {
        Ok(r) => r,
        Err(e) => return exit::usage(&e),
    };
    let create = dimensions.map(|d| (settings.table.as_str(), d as usize));
    match migrate(&url, create, adopt_stream_prefix.as_deref()).await {
        Ok(()) => {
            match create {
                Some((t, d)) => println!("migrations applied; table {t} ready (vector({d}))"),
                None => println!("migrations applied"),
            }
            if let Some(p) = adopt_stream_prefix {
                println!("the outbox is now relayed under stream prefix {p:?}");
            }
            exit::OK
        }
        Err(e) => exit::fail(exit::FAILURE, &e.to_string()),
    }
}

/// Applies the migrations; with `create`, also creates that target table; with `prefix`,
/// records it as the database's stream prefix.
async fn migrate(url: &str, create: Option<(&str, usize)>, prefix: Option<&str>) -> Result<(), StoreError> {
    let pool = store::connect(url, 2).await?;
    store::migrate(&pool).await?;
    if let Some((t, d)) = create {
        store::create_target_table(&pool, t, d).await?;
    }
    if let Some(p) = prefix {
        store::prefix::adopt(&pool, p).await?;
    }
    Ok(())
}
