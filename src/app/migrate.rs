//! `migrate`: applies the schema migrations and, with `--dimensions`, creates the target
//! table.

use embed_dlq::config::{FileConfig, IngestArgs};
use embed_dlq::store::{self, StoreError};

use super::args::MigrateCommand;
use super::{Resolver, exit};

/// Runs `migrate`; returns the exit code.
pub async fn command(resolver: &Resolver, args: MigrateCommand) -> i32 {
    let MigrateCommand { table, dimensions } = args;
    let flags = FileConfig { ingest: IngestArgs { table, ..Default::default() }, ..Default::default() };
    let (settings, url) = match resolver.with_database(flags) {
        Ok(r) => r,
        Err(e) => return exit::usage(&e),
    };
    let create = dimensions.map(|d| (settings.table.as_str(), d as usize));
    match migrate(&url, create).await {
        Ok(()) => {
            match create {
                Some((t, d)) => println!("migrations applied; table {t} ready (vector({d}))"),
                None => println!("migrations applied"),
            }
            exit::OK
        }
        Err(e) => exit::fail(exit::FAILURE, &e.to_string()),
    }
}

/// Applies the migrations; with `create`, also creates that target table.
async fn migrate(url: &str, create: Option<(&str, usize)>) -> Result<(), StoreError> {
    let pool = store::connect(url, 2).await?;
    store::migrate(&pool).await?;
    if let Some((t, d)) = create {
        store::create_target_table(&pool, t, d).await?;
    }
    Ok(())
}
