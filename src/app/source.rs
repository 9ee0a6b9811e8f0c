//! `source add-table` and `source list`: Postgres tables as sources (docs/table-source.md).

use embed_dlq::config::{FileConfig, IngestArgs};
use embed_dlq::store::table_source::{self, ChunkUnit, Chunking, TableSourceSpec};

use super::args::SourceCommand;
use super::{Resolver, exit};

/// Runs a `source` subcommand; returns the exit code.
pub async fn command(resolver: &Resolver, args: SourceCommand) -> i32 {
    let target = match &args {
        SourceCommand::AddTable { target, .. } => target.clone(),
        SourceCommand::List { .. } | SourceCommand::Repair { .. } | SourceCommand::Remove { .. } => None,
    };
    let flags =
        FileConfig { ingest: IngestArgs { table: target, ..Default::default() }, ..Default::default() };
    let (settings, url) = match resolver.with_database(flags) {
        Ok(r) => r,
        Err(e) => return exit::usage(&e),
    };
    let pool = match embed_dlq::store::connect(&url, 2).await {
        Ok(p) => p,
        Err(e) => return exit::fail(exit::FAILURE, &e.to_string()),
    };
    match args {
        SourceCommand::AddTable {
            name,
            table,
            key,
            chunk_column,
            text,
            metadata,
            target: _,
            chunk_chars,
            chunk_tokens,
            chunk_overlap,
            markdown,
        } => {
            let chunking = match (chunk_chars, chunk_tokens) {
                (Some(size), _) => Some((ChunkUnit::Chars, size)),
                (None, Some(size)) => Some((ChunkUnit::Tokens, size)),
                (None, None) if chunk_overlap > 0 || markdown => {
                    return exit::fail(
                        exit::USAGE,
                        "--chunk-overlap and --markdown go with --chunk-chars or --chunk-tokens",
                    );
                }
                (None, None) => None,
            }
            .map(|(unit, size)| Chunking { unit, size, overlap: chunk_overlap, markdown });
            let spec = TableSourceSpec {
                name,
                table,
                key_column: key,
                chunk_column,
                template: unescape(&text),
                metadata_columns: metadata,
                target_table: settings.table.clone(),
                chunking,
            };
            match table_source::add_table(&pool, &spec).await {
                Ok(s) => {
                    println!(
                        "table source {} follows {} into {}: triggers installed; `embed-dlq ingest --from-table {}` snapshots it, then applies its changes",
                        s.name, s.table, s.target_table, s.name
                    );
                    exit::OK
                }
                Err(table_source::TableSourceError::Store(e)) => exit::fail(exit::FAILURE, &e.to_string()),
                Err(e) => exit::fail(exit::USAGE, &e.to_string()),
            }
        }
        SourceCommand::List { json } => list(&pool, json).await,
        SourceCommand::Remove { name } => {
            let removed = async {
                let s = table_source::load(&pool, &name).await?;
                table_source::remove_table(&pool, &s).await.map(|()| s)
            };
            match removed.await {
                Ok(s) => {
                    println!(
                        "table source {} removed: its triggers on {} are dropped; the vectors it wrote stay in {}",
                        s.name, s.table, s.target_table
                    );
                    exit::OK
                }
                Err(table_source::TableSourceError::Store(e)) => exit::fail(exit::FAILURE, &e.to_string()),
                Err(e) => exit::fail(exit::USAGE, &e.to_string()),
            }
        }
        SourceCommand::Repair { name } => {
            let repaired = async {
                let s = table_source::load(&pool, &name).await?;
                table_source::repair_triggers(&pool, &s).await
            };
            match repaired.await {
                Ok(()) => {
                    println!(
                        "table source {name}: triggers installed; the next `ingest --from-table {name}` resyncs the table with a full cleanup (--yes if it deletes more than cleanup_max_fraction)"
                    );
                    exit::OK
                }
                Err(e) => exit::fail(exit::FAILURE, &e.to_string()),
            }
        }
    }
}

/// `\n` and `\t` in a template given on the command line are a newline and a tab (`\\` a
/// backslash), so `--text '{title}\n\n{body}'` needs no shell quoting tricks.
fn unescape(text: &str) -> String {
    let mut out = String::new();
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some('\\') => out.push('\\'),
            Some(other) => {
                out.push('\\');
                out.push(other);
            }
            None => out.push('\\'),
        }
    }
    out
}

async fn list(pool: &sqlx::PgPool, json: bool) -> i32 {
    let names = match table_source::list(pool).await {
        Ok(n) => n,
        Err(e) => return exit::fail(exit::FAILURE, &e.to_string()),
    };
    let mut rows = Vec::new();
    let mut broken = false;
    for name in names {
        let report = async {
            let s = table_source::load(pool, &name).await?;
            let (changes, lag) = table_source::lag(pool, &name).await?;
            let missing = table_source::missing_triggers(pool, &s).await?;
            Ok::<_, table_source::TableSourceError>((s, changes, lag, missing))
        };
        match report.await {
            Ok((s, changes, lag, missing)) => {
                broken |= !missing.is_empty();
                rows.push(serde_json::json!({
                    "name": s.name, "table": s.table, "target": s.target_table, "key": s.key_column,
                    "chunk_column": s.chunk_column, "chunking": s.chunking, "template": s.template.source(),
                    "snapshot_done": s.snapshot_done, "resync_full": s.resync_full,
                    "changes_pending": changes, "lag_seconds": lag, "missing_triggers": missing,
                }));
            }
            Err(e) => return exit::fail(exit::FAILURE, &e.to_string()),
        }
    }
    if json {
        println!("{}", serde_json::Value::Array(rows));
    } else if rows.is_empty() {
        println!("no table sources (add one with `embed-dlq source add-table`)");
    } else {
        for r in &rows {
            let missing = r["missing_triggers"].as_array().map_or(0, Vec::len);
            println!(
                "{}: {} -> {}; snapshot {}; {} changes pending, {:.1} s behind{}",
                r["name"].as_str().unwrap_or_default(),
                r["table"].as_str().unwrap_or_default(),
                r["target"].as_str().unwrap_or_default(),
                if r["snapshot_done"].as_bool() == Some(true) { "done" } else { "pending" },
                r["changes_pending"],
                r["lag_seconds"].as_f64().unwrap_or_default(),
                if missing > 0 {
                    format!(
                        "; MISSING TRIGGERS {} (changes are not captured: `embed-dlq source repair NAME`)",
                        r["missing_triggers"]
                    )
                } else {
                    String::new()
                }
            );
        }
    }
    if broken { exit::FINDINGS } else { exit::OK }
}

#[cfg(test)]
mod tests {
    #[test]
    fn templates_on_the_command_line_take_newline_and_tab_escapes() {
        assert_eq!(super::unescape(r"{title}\n\n{body}\t\\x\q"), "{title}\n\n{body}\t\\x\\q");
    }
}
