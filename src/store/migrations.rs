//! The embedded migrations (`migrations/`), listed here with `include_str!` instead of
//! `sqlx::migrate!`, whose proc macro compiles sqlx's Postgres driver a second time for the
//! build host. Each migration is what `sqlx::migrate!` made of the same file (version and
//! description from the file name, checksum of the SQL), so databases migrated by earlier
//! builds see the same checksums. A test checks this list against the folder.

use std::borrow::Cow;
use std::sync::LazyLock;

use sqlx::SqlSafeStr;
use sqlx::migrate::{Migration, MigrationType, Migrator};

/// `(file name, SQL)` of every migration, in order.
macro_rules! embedded {
    ($($file:literal),* $(,)?) => {
        &[$(($file, include_str!(concat!("../../migrations/", $file)))),*]
    };
}

/// Every file of `migrations/`: add a new one here too (the test below fails until then).
const FILES: &[(&str, &str)] = embedded![
    "0001_core.sql",
    "0002_streams.sql",
    "0003_reconcile.sql",
    "0004_identity.sql",
    "0005_relay.sql",
    "0006_event_envelope.sql",
    "0007_leases.sql",
    "0008_console.sql",
    "0009_incremental_reconcile.sql",
    "0010_stream_prefix.sql",
    "0011_dedup_hashes.sql",
    "0012_chunk_event_order.sql",
    "0013_replay_lease.sql",
    "0014_event_seq.sql",
    "0015_withdrawn_event.sql",
    "0016_dlq_counts.sql",
    "0017_reconcile_runs_retention.sql",
    "0018_deletions.sql",
    "0019_positions.sql",
    "0020_source_suspects.sql",
    "0021_lease_charge_in_place.sql",
    "0022_relay_position.sql",
    "0023_relay_cluster.sql",
    "0024_replay_lease_unlogged.sql",
    "0025_stream_fed_tables.sql",
    "0026_revisions.sql",
    "0027_event_revision.sql",
    "0028_revision_switch.sql",
    "0029_table_sources.sql",
    "0030_table_source_chunking.sql",
    "0031_table_source_snapshot_cursor.sql",
];

/// The embedded migrations. [`super::migrate`] applies them all; tests use it to stop at an
/// older version.
pub static MIGRATOR: LazyLock<Migrator> = LazyLock::new(|| {
    Migrator::with_migrations(FILES.iter().map(|&(file, sql)| migration(file, sql)).collect())
});

/// One migration as `sqlx::migrate!` reads a file `<version>_<description>.sql`: underscores
/// of the description become spaces, and a first line `-- no-transaction` runs it outside a
/// transaction.
fn migration(file: &'static str, sql: &'static str) -> Migration {
    let (version, rest) = file.split_once('_').expect("a migration file is named <version>_<name>.sql");
    let version: i64 = version.parse().expect("a migration file name starts with its version");
    let description = rest.trim_end_matches(".sql").replace('_', " ");
    Migration::new(
        version,
        Cow::Owned(description),
        MigrationType::Simple,
        sqlx::AssertSqlSafe(sql).into_sql_str(),
        sql.starts_with("-- no-transaction"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_file_of_the_migrations_folder_is_embedded_in_order() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations");
        let mut on_disk: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|name| name.ends_with(".sql"))
            .collect();
        on_disk.sort();
        let listed: Vec<&str> = FILES.iter().map(|&(file, _)| file).collect();
        assert_eq!(listed, on_disk, "src/store/migrations.rs lists every migration file");
        for (file, sql) in FILES {
            let on_disk = std::fs::read_to_string(format!("{dir}/{file}")).unwrap();
            assert_eq!(*sql, on_disk, "{file}");
        }
    }

    #[test]
    fn versions_and_descriptions_are_read_from_the_file_names() {
        let versions: Vec<i64> = MIGRATOR.iter().map(|m| m.version).collect();
        assert_eq!(versions, (1..=FILES.len() as i64).collect::<Vec<_>>());
        let first = MIGRATOR.iter().next().unwrap();
        assert_eq!(first.description, "core");
        let positions = MIGRATOR.iter().find(|m| m.version == 17).unwrap();
        assert_eq!(positions.description, "reconcile runs retention");
    }
}
